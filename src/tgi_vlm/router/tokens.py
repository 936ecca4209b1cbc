"""Input token counts for the router, from the same processor code the shard runs.

The router sizes each request's KV allocation from its prompt length. Rather than estimating image
tokens (TGI's router over-counts Qwen), it loads the model's processor (not the weights) and runs
the prompt half of the architecture adapter through the shard's own intake functions
(`vlm_intake.prompt_parts` / `process_prompt`), then applies `truncate` (keep the last tokens).
"""

from __future__ import annotations

import threading

from tgi_vlm.config import InputLimits
from tgi_vlm.errors import InvalidRequest
from tgi_vlm.models.intake import request_chunks
from tgi_vlm.pb import generate_pb2 as pb


class CountError(ValueError):
    """The request cannot be tokenized (bad image, text-only model given an image, processor refusal)."""


class TokenCounter:
    """`count(request)` → prompt tokens the shard will see; `input_ids(request)` → the ids themselves.
    Thread-safe (one call at a time)."""

    def __init__(self, model_id: str, *, revision: str | None = None, trust_remote_code: bool = False,
                 limits: InputLimits | None = None):
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(model_id, revision=revision, trust_remote_code=trust_remote_code)
        self.limits = limits or InputLimits()
        self._lock = threading.Lock()  # HF fast tokenizers refuse concurrent use ("Already borrowed")
        self.prompt = None
        self.processor = None  # VLMs: the HF processor (its chat template may live there)
        if getattr(hf_config, "vision_config", None) is not None:
            from transformers import AutoProcessor

            from tgi_vlm.models.architectures import prompt_for

            processor = AutoProcessor.from_pretrained(model_id, revision=revision, trust_remote_code=trust_remote_code)
            self.prompt = prompt_for(hf_config.model_type)(processor, hf_config)
            self.processor = processor
            self.tokenizer = processor.tokenizer
        else:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_id, revision=revision, trust_remote_code=trust_remote_code)

    def count(self, request: pb.Request) -> int:
        return len(self.input_ids(request))

    def offsets(self, text: str, add_special_tokens: bool = True) -> list[tuple[int, int, int]]:
        """(id, start, stop) per token of plain text, character offsets into `text` (TGI's /tokenize)."""
        with self._lock:
            encoding = self.tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        return [(i, start, stop) for i, (start, stop) in zip(encoding["input_ids"], encoding["offset_mapping"])]

    def input_ids(self, request: pb.Request) -> list[int]:
        """The prompt's token ids as the shard builds them (image placeholders expanded), truncated."""
        with self._lock:
            try:
                ids = self._ids(request)
            except InvalidRequest as exc:
                raise CountError(str(exc)) from None
        return ids[-request.truncate:] if request.truncate else ids

    def _ids(self, request: pb.Request) -> list[int]:
        if self.prompt is None:
            chunks = request_chunks(request)
            if any(isinstance(c, bytes) for c in chunks):
                raise CountError(f"request {request.id}: the model is text-only and cannot take image inputs")
            return list(self.tokenizer("".join(chunks), add_special_tokens=request.add_special_tokens)["input_ids"])
        from tgi_vlm.models.vlm_intake import process_prompt, prompt_parts

        parts, images, _ = prompt_parts(request, self.limits)
        return process_prompt(self.prompt, request, parts, images)["input_ids"][0].tolist()
