"""VlmCausalLMBatch and VlmCausalLM: the image path on top of the flash engine.

Per step (see DESIGN.md): find the image spans overlapping each sequence's token window, encode
the images not yet in the encoder cache (one batched vision call), scatter exactly the
`[start, end)` slice of each span's embedding rows into `inputs_embeds`, run the language model,
then drop encoder entries whose span is fully prefilled. Everything architecture-specific is
asked of `self.adapter`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
from loguru import logger

from tgi_vlm.config import EngineConfig
from tgi_vlm.errors import InvalidRequest
from tgi_vlm.images import ImageError, decode_image
from tgi_vlm.models.architectures import adapter_for
from tgi_vlm.models.encoder_cache import EncoderCache
from tgi_vlm.models.flash_causal_lm import FlashCausalLM, FlashCausalLMBatch, TokenizedPrompt
from tgi_vlm.models.image_spans import ImageSpan, locate_spans, spans_overlapping
from tgi_vlm.models.sequence import Sequence
from tgi_vlm.models.step import StepInputs
from tgi_vlm.pb import generate_pb2


class _ImageCutInWarmup(Exception):
    pass


@dataclass
class ImagePrompt(TokenizedPrompt):
    images: list[ImageSpan] = field(default_factory=list)
    extras: dict = field(default_factory=dict)
    bidirectional_groups: torch.Tensor | None = None


@dataclass
class VlmSequence(Sequence):
    images: list[ImageSpan] = field(default_factory=list)
    extras: dict = field(default_factory=dict)  # adapter state, e.g. mrope rows
    bidirectional_groups: torch.Tensor | None = None  # [prompt_len] on the model's device (attention masks)
    group_ids: list[int] | None = None  # the same on the host, for scheduling without device syncs

    def align_chunk(self, n: int) -> int:
        """Never end a chunk inside a bidirectional block: its earlier tokens must see its later ones."""
        groups = self.group_ids
        end = self.num_computed + n
        if groups is None or end >= self.prompt_len:
            return n
        group = groups[end - 1]
        while group >= 0 and end < self.prompt_len and groups[end] == group:
            end += 1
        return end - self.num_computed

    @property
    def images_pending(self) -> bool:
        return bool(self.images) and self.num_computed < self.images[-1].end


class VlmCausalLMBatch(FlashCausalLMBatch):
    """Same contract as the flash batch; image state lives on each VlmSequence and is freed with it."""


class VlmCausalLM(FlashCausalLM):
    batch_type = VlmCausalLMBatch

    def __init__(self, model, processor, config: EngineConfig, *, model_id: str = ""):
        self.processor = processor
        self.adapter = adapter_for(model.config.model_type)(model, processor, model.config)
        super().__init__(model, processor.tokenizer, config, model_id=model_id)
        self.encoder_cache = EncoderCache(shared_bytes=config.encoder_cache_bytes)

    def find_language_model(self) -> torch.nn.Module:
        return self.adapter.language_model()

    # ----- requests -----
    def tokenize_request(self, request: generate_pb2.Request, *, warmup: bool = False) -> ImagePrompt:
        parts, images, digests = self._decode_chunks(request)
        try:
            return self._tokenize(request, parts, images, digests, warmup=warmup)
        except _ImageCutInWarmup as cut:
            # The router sizes warmup from its own limits; an image its truncation cuts is left out.
            logger.warning("warmup request {}: {}; warming up without images", request.id, cut)
            return self._tokenize(request, [p for p in parts if p is not None], [], [], warmup=warmup)

    def _tokenize(self, request, parts: list[str | None], images: list, digests: list[str], *, warmup: bool) -> ImagePrompt:
        text = self.adapter.build_prompt(parts)
        try:
            processed = self.adapter.process(text, images, add_special_tokens=request.add_special_tokens)
            per_image = [self.adapter.image_inputs(img) for img in images]
        except Exception as exc:  # noqa: BLE001 - any processor failure on user content is that request's problem
            raise InvalidRequest(request.id, f"the processor rejected the input: {type(exc).__name__}: {exc}") from None
        ids = processed["input_ids"][0].tolist()
        try:
            located = locate_spans(ids, self.adapter.image_token_id, [count for _, count in per_image])
        except ValueError as exc:
            raise InvalidRequest(request.id, str(exc)) from None
        spans = [
            ImageSpan(i, offset, length, embed_index, int((embed_index >= 0).sum()), digest, pixels)
            for i, ((offset, length, embed_index), (pixels, _), digest) in enumerate(
                zip(located, per_image, digests)
            )
        ]
        ids, processed, spans = self._truncate_with_images(request, ids, processed, spans, warmup=warmup)
        return ImagePrompt(
            ids=ids,
            images=spans,
            extras=self.adapter.prompt_extras(processed, ids, spans),
            bidirectional_groups=self.adapter.bidirectional_groups(processed, ids, spans),
        )

    def _decode_chunks(self, request) -> tuple[list[str | None], list, list[str]]:
        """(text parts with None for images, decoded images, sha256 of each image's bytes)."""
        if not request.HasField("input_chunks") or not request.input_chunks.chunks:
            return [request.inputs], [], []
        parts: list[str | None] = []
        images, digests = [], []
        limits = self.config.limits
        for chunk in request.input_chunks.chunks:
            if chunk.WhichOneof("chunk") == "text":
                parts.append(chunk.text)
                continue
            if len(images) >= limits.max_images_per_request:
                raise InvalidRequest(request.id, f"more than {limits.max_images_per_request} images in one request")
            try:
                images.append(decode_image(chunk.image.data, limits))
            except ImageError as exc:
                raise InvalidRequest(request.id, f"image {len(images)}: {exc}") from None
            digests.append(hashlib.sha256(chunk.image.data).hexdigest())
            parts.append(None)
        return parts, images, digests

    def _truncate_with_images(self, request, ids, processed, spans, *, warmup: bool = False):
        """Keep the last `truncate` tokens; images wholly cut off are dropped, one cut through is an error
        (in warmup: the request is re-tokenized without images, see tokenize_request)."""
        if not request.truncate or len(ids) <= request.truncate:
            return ids, processed, spans
        cut = len(ids) - request.truncate
        for span in spans:
            if span.offset < cut < span.end and warmup:
                raise _ImageCutInWarmup(f"truncate={request.truncate} cuts image {span.index}")
            if span.offset < cut < span.end:
                raise InvalidRequest(
                    request.id,
                    f"truncate={request.truncate} would cut image {span.index} (tokens {span.offset}..{span.end - 1} "
                    f"of {len(ids)}); raise truncate or shorten the text",
                )
        kept = [s for s in spans if s.offset >= cut]
        for s in kept:
            s.offset -= cut
        processed = {k: (v[:, cut:] if k in ("input_ids", "mm_token_type_ids", "token_type_ids") else v)
                     for k, v in processed.items()}
        return ids[cut:], processed, kept

    def make_sequence(self, request, prompt: ImagePrompt, *, liveness: bool = False, warmup: bool = False) -> VlmSequence:
        base = super().make_sequence(request, prompt, liveness=liveness, warmup=warmup)
        for span in prompt.images:
            span.cache_key = self.encoder_cache.new_key()
        groups = prompt.bidirectional_groups
        return VlmSequence(
            **{f: getattr(base, f) for f in Sequence.__dataclass_fields__},
            images=prompt.images,
            extras=prompt.extras,
            bidirectional_groups=None if groups is None else groups.to(self.device),
            group_ids=None if groups is None else groups.tolist(),
        )

    def release_sequences(self, seqs: list[Sequence]) -> None:
        super().release_sequences(seqs)
        for seq in seqs:
            for span in getattr(seq, "images", ()):
                self.encoder_cache.pop(span.cache_key)

    # ----- the step -----
    def embed_step(self, batch, step: StepInputs) -> torch.Tensor:
        embeds = self.embed_tokens(step.input_ids.clamp(max=self.embed_tokens.num_embeddings - 1))  # [T, H]
        windows = [w for w in step.windows if getattr(w.seq, "images_pending", False)]
        if not windows:
            return embeds
        self._encode_needed(windows)
        rows, features = [], []
        for w in windows:
            for span, s, e in spans_overlapping(w.seq.images, w.start, w.end):
                index = span.embed_index[s - span.offset : e - span.offset]
                is_embed = index >= 0
                rows.append(w.row + (s - w.start) + torch.nonzero(is_embed)[:, 0])
                features.append(self.encoder_cache.get(span.cache_key)[index[is_embed].to(self.device)])
        if rows:  # the embedding output is a fresh tensor: scatter in place
            embeds[torch.cat(rows).to(self.device)] = torch.cat(features).to(embeds.dtype)
        return embeds

    def _encode_needed(self, windows) -> None:
        needed: list[ImageSpan] = []
        for w in windows:
            for span, _, _ in spans_overlapping(w.seq.images, w.start, w.end):
                if span.cache_key in self.encoder_cache:
                    continue
                shared = self.encoder_cache.lookup(span.content_hash)
                if shared is not None:
                    self.encoder_cache.put(span.cache_key, shared)
                else:
                    needed.append(span)
        if not needed:
            return
        unique = {s.content_hash: s for s in needed}  # the same image twice in one step is encoded once
        outputs = dict(zip(unique, self.adapter.encode([s.pixel_inputs for s in unique.values()])))
        for span in needed:
            features = outputs[span.content_hash]
            if features.shape[0] != span.num_embed:
                raise RuntimeError(
                    f"vision tower gave {features.shape[0]} rows for image {span.index}, prompt has {span.num_embed}"
                )
            self.encoder_cache.put(span.cache_key, features)
            self.encoder_cache.remember(span.content_hash, features)

    def position_ids(self, batch, step: StepInputs) -> torch.Tensor:
        custom = self.adapter.position_ids(step, [getattr(w.seq, "extras", {}) for w in step.windows])
        if custom is not None:
            return custom
        return (step.positions + self.adapter.position_offset)[None]

    def after_step(self, batch, step: StepInputs) -> None:
        for w in step.windows:
            for span in getattr(w.seq, "images", ()):
                if span.end <= w.seq.num_computed:
                    self.encoder_cache.pop(span.cache_key)


def load_vlm(model_id: str, hf_config, config: EngineConfig, attn_name: str, dtype, *, revision=None,
             trust_remote_code: bool = False) -> VlmCausalLM:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    adapter_for(hf_config.model_type)  # fail early, listing the supported types
    model = AutoModelForImageTextToText.from_pretrained(
        model_id,
        revision=revision,
        trust_remote_code=trust_remote_code,
        attn_implementation={"text_config": attn_name, "vision_config": "sdpa"},
        dtype=dtype,
        use_safetensors=True,
    ).to(config.device)
    processor = AutoProcessor.from_pretrained(model_id, revision=revision, trust_remote_code=trust_remote_code)
    logger.info("loaded {} ({}) on {} in {}", model_id, type(model).__name__, config.device, dtype)
    return VlmCausalLM(model, processor, config, model_id=model_id)
