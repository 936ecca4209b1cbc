"""Prompt tokens for the router, from the same processor code the shard runs.

The router sizes each request's KV allocation from its prompt length, and its prefix cache keys
blocks on the prompt's token ids and media (images). Rather than estimating image tokens (TGI's
router over-counts Qwen), it loads the model's processor (not the weights) and runs the prompt half
of the architecture adapter through the shard's own intake functions:
- `count` (lengths only): `vlm_intake.process_prompt` on the whole prompt, then `truncate`;
- `tokenize` (ids, media spans with content hashes, bidirectional groups): `vlm_intake.tokenize_media`
  exactly as the shard's `VlmCausalLM.tokenize_request` calls it, so spans, truncation and the
  `MediaRef`s made from them (`MediaSpan.ref`) are the shard's by construction. It also runs the
  processor once per image, so it costs more.

Where the architecture can give the expanded ids from image sizes alone (`VlmPrompt.expanded_ids`:
Qwen2-VL and Qwen2.5-VL), both skip the image processor's pixel work: images are still decoded and
checked (the same refusals), spans located and truncated by the shard's functions. The router runs
beside the shard on the same cores: the shortcut cuts its CPU per bench run by about a fifth
(benchmarks/router_counting.py; the throughput effect is within noise). `fast_count=False` keeps
the processor (tests and that benchmark compare the two).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

from loguru import logger

from tgi_vlm.config import InputLimits
from tgi_vlm.errors import InvalidRequest
from tgi_vlm.media import MediaKind
from tgi_vlm.models.request_input import request_chunks, truncate_ids
from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.prefix_hash import MediaRef

# Probe images for `TokenCounter.shortcut_agrees` (width, height): small, odd, wide, tall, large.
_PROBE_SIZES = ((28, 28), (41, 97), (300, 200), (448, 448), (1000, 37), (1600, 1200))


class CountError(ValueError):
    """The request cannot be tokenized (bad image, text-only model given an image, processor refusal)."""


@dataclass(frozen=True)
class PromptTokens:
    """A prompt as the shard will see it (after truncation)."""

    ids: list[int]
    media: list[MediaRef]  # each surviving item's kind, span and the sha256 of its bytes, in prompt order
    group_ids: list[int] | None = None  # [len(ids)] bidirectional group per position (-1 causal); None: causal

    def __len__(self) -> int:
        return len(self.ids)


@contextmanager
def _one_torch_thread():
    """The image processor's tensor ops on one intra-op thread: the router runs beside the shard,
    whose forward owns the cores; a second processor thread would stall the shard's at every
    parallel region (measured in benchmarks/results/cpu-profile.md)."""
    import torch

    previous = torch.get_num_threads()
    if previous == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class TokenCounter:
    """`count(request)` → prompt length; `input_ids(request)` → the ids; `tokenize(request)` →
    `PromptTokens` (ids, media spans, groups: what the prefix cache keys on). Thread-safe (one call at a time)."""

    def __init__(self, model_id: str, *, revision: str | None = None, trust_remote_code: bool = False,
                 limits: InputLimits | None = None, fast_count: bool = True):
        from transformers import AutoConfig

        from tgi_vlm.quantization.gguf_file import pretrained_source

        model_id, gguf_args = pretrained_source(model_id)  # a GGUF file: its directory, and gguf_file=
        hf_config = AutoConfig.from_pretrained(model_id, revision=revision, trust_remote_code=trust_remote_code,
                                               **gguf_args)
        self.limits = limits or InputLimits()
        self.fast_count = fast_count
        self._shortcut_failed = False
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
            self.fast_count = fast_count and self.shortcut_agrees()
        else:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_id, revision=revision,
                                                           trust_remote_code=trust_remote_code, **gguf_args)

    def shortcut_agrees(self) -> bool:
        """Whether the counting shortcut gives the processor's ids on probe images of several sizes and
        shapes. Checked once at start: a processor configured in a way the shortcut does not read (its
        own settings, ones merged from the tokenizer's config) then keeps the processor for every request."""
        from tgi_vlm.images import make_test_image

        parts = ["Describe ", MediaKind.IMAGE, " in a few words."]
        try:
            for k, (width, height) in enumerate(_PROBE_SIZES):
                image = make_test_image(width, height, seed=k)
                shortcut = self.prompt.expanded_ids(parts, [image])
                if shortcut is None:
                    return False
                processed = self.prompt.process(self.prompt.build_prompt(parts), [image])
                ids = processed["input_ids"][0].tolist()
                if shortcut != (ids, [ids.count(self.prompt.media_token_id(MediaKind.IMAGE))]):
                    logger.info("router token counting: the shortcut differs from the processor at {}x{}; "
                                "using the processor", width, height)
                    return False
        except Exception as exc:  # noqa: BLE001 - no shortcut then, whatever the reason
            logger.info("router token counting: no shortcut ({}: {})", type(exc).__name__, exc)
            return False
        return True

    def count(self, request: pb.Request) -> int:
        return len(self.input_ids(request))

    def offsets(self, text: str, add_special_tokens: bool = True) -> list[tuple[int, int, int]]:
        """(id, start, stop) per token of plain text, character offsets into `text` (TGI's /tokenize)."""
        with self._lock:
            encoding = self.tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        return [(i, start, stop) for i, (start, stop) in zip(encoding["input_ids"], encoding["offset_mapping"])]

    def input_ids(self, request: pb.Request) -> list[int]:
        """The prompt's token ids as the shard builds them (media placeholders expanded), truncated."""
        with self._lock, _one_torch_thread():
            try:
                ids = self._ids(request)
            except InvalidRequest as exc:
                raise CountError(str(exc)) from None
        return ids[-request.truncate:] if request.truncate else ids

    def tokenize(self, request: pb.Request) -> PromptTokens:
        with self._lock, _one_torch_thread():
            try:
                return self._tokenize(request)
            except InvalidRequest as exc:
                raise CountError(str(exc)) from None

    def _ids(self, request: pb.Request) -> list[int]:
        if self.prompt is None:
            return list(self._text_ids(request))
        from tgi_vlm.models.vlm_intake import process_prompt, prompt_parts

        parts, items, _ = prompt_parts(self.prompt, request, self.limits)
        expanded = self._expanded(request, parts, items)
        if expanded is not None:
            return expanded[0]
        return process_prompt(self.prompt, request, parts, items)["input_ids"][0].tolist()

    def _tokenize(self, request: pb.Request) -> PromptTokens:
        if self.prompt is None:
            return PromptTokens(truncate_ids(self._text_ids(request), request.truncate), [])
        from tgi_vlm.models.vlm_intake import media_kinds, prompt_parts, tokenize_media

        parts, items, digests = prompt_parts(self.prompt, request, self.limits)
        expanded = self._expanded(request, parts, items)
        if expanded is not None:
            return self._tokens_from_counts(request, media_kinds(parts), *expanded, digests)
        ids, processed, spans = tokenize_media(self.prompt, request, parts, items, digests, warmup=False)
        return self._prompt_tokens(ids, processed, spans)

    def _expanded(self, request: pb.Request, parts: list, items: list) -> tuple[list[int], list[int]] | None:
        """(ids, per-item token counts) without the image processor, or None: use it. Whatever the
        shortcut cannot do (an unsupported architecture, a size the processor refuses) goes the
        processor's way, which also words any refusal."""
        if not self.fast_count:
            return None
        try:
            return self.prompt.expanded_ids(parts, items, request.add_special_tokens)
        except Exception as exc:  # noqa: BLE001 - the processor path below decides and words the error
            if not self._shortcut_failed:  # e.g. a size the processor refuses; said once, not per request
                self._shortcut_failed = True
                logger.info("router token counting: shortcut failed ({}: {}); the processor decides", type(exc).__name__, exc)
            return None

    def _tokens_from_counts(self, request: pb.Request, kinds: list[MediaKind], ids: list[int], counts: list[int],
                            digests: list[str]) -> PromptTokens:
        """Spans and truncation exactly as `tokenize_media` does them, from the shortcut's ids and counts."""
        from tgi_vlm.models.vlm_intake import prompt_spans, truncate_with_media

        spans = prompt_spans(request, self.prompt, ids, kinds, counts, digests)
        ids, _, spans = truncate_with_media(request, ids, {}, spans)
        return self._prompt_tokens(ids, {}, spans)

    def _prompt_tokens(self, ids: list[int], processed: dict, spans: list) -> PromptTokens:
        groups = self.prompt.bidirectional_groups(processed, ids, spans)
        return PromptTokens(ids, [s.ref for s in spans], None if groups is None else groups.tolist())

    def _text_ids(self, request: pb.Request) -> list[int]:
        chunks = request_chunks(request)
        media = [c for c in chunks if not isinstance(c, str)]
        if media:
            raise CountError(f"request {request.id}: the model is text-only and cannot take {media[0].kind.value} inputs")
        return self.tokenizer("".join(chunks), add_special_tokens=request.add_special_tokens)["input_ids"]
