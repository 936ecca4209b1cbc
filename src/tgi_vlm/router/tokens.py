"""Input token counts for the router, from the same processor code the shard runs.

The router sizes each request's KV allocation from its prompt length. Rather than estimating image
tokens (TGI's router over-counts Qwen), it loads the model's processor (not the weights) and runs
the architecture adapter's `build_prompt` / `process`, exactly as `VlmCausalLM.tokenize_request`
does, then applies `truncate` (keep the last tokens).
"""

from __future__ import annotations

import threading

from tgi_vlm.config import InputLimits
from tgi_vlm.images import ImageError, decode_image
from tgi_vlm.pb import generate_pb2 as pb


class CountError(ValueError):
    """The request cannot be tokenized (bad image, text-only model given an image, processor refusal)."""


class TokenCounter:
    """`count(request)` → prompt tokens the shard will see. Thread-safe (one call at a time)."""

    def __init__(self, model_id: str, *, revision: str | None = None, trust_remote_code: bool = False,
                 limits: InputLimits | None = None):
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(model_id, revision=revision, trust_remote_code=trust_remote_code)
        self.limits = limits or InputLimits()
        self._lock = threading.Lock()  # HF fast tokenizers refuse concurrent use ("Already borrowed")
        self.adapter = None
        if getattr(hf_config, "vision_config", None) is not None:
            from transformers import AutoProcessor

            from tgi_vlm.models.architectures import adapter_for

            processor = AutoProcessor.from_pretrained(model_id, revision=revision, trust_remote_code=trust_remote_code)
            # Adapters use the model only for the vision tower and positions; prompts need none.
            self.adapter = adapter_for(hf_config.model_type)(None, processor, hf_config)
            self.tokenizer = processor.tokenizer
        else:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_id, revision=revision, trust_remote_code=trust_remote_code)

    def count(self, request: pb.Request) -> int:
        with self._lock:
            n = self._count(request)
        return min(n, request.truncate) if request.truncate else n

    def _count(self, request: pb.Request) -> int:
        parts, images = self._chunks(request)
        if self.adapter is None:
            if images:
                raise CountError(f"request {request.id}: the model is text-only and cannot take image inputs")
            text = "".join(p for p in parts if p is not None)
            return len(self.tokenizer(text, add_special_tokens=request.add_special_tokens)["input_ids"])
        text = self.adapter.build_prompt(parts)
        try:
            processed = self.adapter.process(text, images, add_special_tokens=request.add_special_tokens)
        except Exception as exc:  # noqa: BLE001 - the processor's failure on user content
            raise CountError(f"request {request.id}: the processor rejected the input: {exc}") from None
        return int(processed["input_ids"].shape[-1])

    def _chunks(self, request: pb.Request) -> tuple[list[str | None], list]:
        if not request.HasField("input_chunks") or not request.input_chunks.chunks:
            return [request.inputs], []
        parts: list[str | None] = []
        images = []
        for chunk in request.input_chunks.chunks:
            if chunk.WhichOneof("chunk") == "text":
                parts.append(chunk.text)
                continue
            try:
                images.append(decode_image(chunk.image.data, self.limits))
            except ImageError as exc:
                raise CountError(f"request {request.id}: image {len(images)}: {exc}") from None
            parts.append(None)
        return parts, images
