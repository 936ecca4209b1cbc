"""VlmCausalLMBatch and VlmCausalLM: the media path (images, videos) on top of the flash engine.

Per step (see DESIGN.md): find the media spans overlapping each sequence's token window, encode
the items not yet in the encoder cache (one batched encoder call per kind), scatter exactly the
`[start, end)` slice of each span's embedding rows into `inputs_embeds`, run the language model,
then drop encoder entries whose span is fully prefilled. Everything architecture-specific is
asked of `self.adapter`.
"""

from __future__ import annotations

import torch
from loguru import logger

from tgi_vlm.config import EngineConfig
from tgi_vlm.models.architectures import adapter_for
from tgi_vlm.models.encoder_cache import EncoderCache
from tgi_vlm.models.flash_causal_lm import FlashCausalLM, FlashCausalLMBatch
from tgi_vlm.models.intake import TokenizedPrompt
from tgi_vlm.models.media_prefetch import MediaPrefetch
from tgi_vlm.models.media_spans import MediaSpan, spans_overlapping
from tgi_vlm.models.sequence import MultimodalState, Sequence
from tgi_vlm.models.step import StepInputs
from tgi_vlm.models.tensor_parallel import ShardLayout, keep_own_kv_head, load_kwargs
from tgi_vlm.models.vlm_intake import MediaCutInWarmup, prompt_parts, tokenize_media
from tgi_vlm.pb import generate_pb2


class VlmCausalLMBatch(FlashCausalLMBatch):
    """Same contract as the flash batch; media state lives in each sequence's `mm` and is freed with it."""


class VlmCausalLM(FlashCausalLM):
    """Owns, beyond the flash engine: the architecture adapter and the encoder cache (per-request
    entries put/popped by the step, the cross-request LRU by content hash)."""

    batch_type = VlmCausalLMBatch

    def __init__(self, model, processor, config: EngineConfig, *, model_id: str = "", layout: ShardLayout | None = None):
        self.processor = processor
        self.adapter = adapter_for(model.config.model_type)(model, processor, model.config)
        super().__init__(model, processor.tokenizer, config, model_id=model_id, layout=layout)
        self.encoder_cache = EncoderCache(shared_bytes=config.encoder_cache_bytes)
        self.media_prefetch = MediaPrefetch(self.adapter.prompt, config.limits)

    def find_language_model(self) -> torch.nn.Module:
        return self.adapter.language_model()

    def attention_pattern(self):
        return self.adapter.attention_pattern()

    @property
    def position_rows(self) -> int:
        return self.adapter.position_rows

    @property
    def router_prefix_caching(self) -> bool:
        # TGI's router keys its radix tree on token ids only, and every image expands to the same
        # placeholder ids: two requests with different images would be offered each other's blocks.
        # So, as TGI, never for VLMs; the shard still accepts (verified) cache_len from our
        # media-aware driver, which does not need Info's permission.
        return False

    # ----- requests (vlm_intake.py) -----
    def start_media(self, requests) -> None:
        """Start decoding the batch's videos on worker threads (media_prefetch.py)."""
        self.media_prefetch.start(requests)

    def tokenize_request(self, request: generate_pb2.Request, *, warmup: bool = False) -> TokenizedPrompt:
        parts, items, digests = prompt_parts(self.adapter.prompt, request, self.config.limits,
                                             self.media_prefetch.take(request))
        try:
            ids, processed, spans = tokenize_media(self.adapter.prompt, request, parts, items, digests, warmup=warmup)
        except MediaCutInWarmup as cut:
            # The router sizes warmup from its own limits; an item its truncation cuts is left out.
            logger.warning("warmup request {}: {}; warming up without media", request.id, cut)
            text_only = [p for p in parts if isinstance(p, str)]
            ids, processed, spans = tokenize_media(self.adapter.prompt, request, text_only, [], [], warmup=warmup)
        groups = self.adapter.bidirectional_groups(processed, ids, spans)
        mm = MultimodalState(
            media=spans,
            adapter_state=self.adapter.adapter_state(processed, ids, spans),
            bidirectional_groups=groups,  # host tensor until make_sequence
            group_ids=None if groups is None else groups.tolist(),
        )
        return TokenizedPrompt(ids=ids, mm=mm)

    def make_sequence(self, request, prompt: TokenizedPrompt, *, liveness: bool = False, warmup: bool = False) -> Sequence:
        seq = super().make_sequence(request, prompt, liveness=liveness, warmup=warmup)
        for span in seq.mm.media:
            span.cache_key = self.encoder_cache.new_key()
        if seq.mm.bidirectional_groups is not None:
            seq.mm.bidirectional_groups = seq.mm.bidirectional_groups.to(self.device)
        return seq

    def release_sequences(self, seqs: list[Sequence]) -> None:
        super().release_sequences(seqs)
        for seq in seqs:
            for span in seq.media:
                self.encoder_cache.pop(span.cache_key)

    # ----- the step -----
    def embed_step(self, batch, step: StepInputs) -> torch.Tensor:
        embeds = self.embed_tokens(step.input_ids.clamp(max=self.embed_tokens.num_embeddings - 1))  # [T, H]
        windows = [w for w in step.windows if w.seq.media_pending]
        if not windows:
            return embeds
        self._encode_needed(windows)
        rows, features = [], []
        for w in windows:
            for span, s, e in spans_overlapping(w.seq.media, w.start, w.end):
                index = span.embed_index[s - span.offset : e - span.offset]
                is_embed = index >= 0
                rows.append(w.row + (s - w.start) + torch.nonzero(is_embed)[:, 0])
                features.append(self.encoder_cache.get(span.cache_key)[index[is_embed].to(self.device)])
        if rows:  # the embedding output is a fresh tensor: scatter in place
            embeds[torch.cat(rows).to(self.device)] = torch.cat(features).to(embeds.dtype)
        return embeds

    def _encode_needed(self, windows) -> None:
        needed: list[MediaSpan] = []
        for w in windows:
            for span, _, _ in spans_overlapping(w.seq.media, w.start, w.end):
                if span.cache_key in self.encoder_cache:
                    continue
                shared = self.encoder_cache.lookup(span.feature_key)
                if shared is not None:
                    self.encoder_cache.put(span.cache_key, shared)
                else:
                    needed.append(span)
        if not needed:
            return
        outputs = self._encode_unique(needed)
        for span in needed:
            features = outputs[span.feature_key]
            if features.shape[0] != span.num_embed:
                raise RuntimeError(
                    f"vision tower gave {features.shape[0]} rows for {span.kind.value} {span.index}, "
                    f"prompt has {span.num_embed}"
                )
            self.encoder_cache.put(span.cache_key, features)
            self.encoder_cache.remember(span.feature_key, features)

    def _encode_unique(self, spans: list[MediaSpan]) -> dict:
        """Features by `feature_key`, one encoder call per kind; the same item twice in one step is encoded once."""
        by_kind: dict = {}
        for s in spans:
            by_kind.setdefault(s.kind, {})[s.feature_key] = s
        outputs = {}
        for kind, unique in by_kind.items():
            outputs.update(zip(unique, self.adapter.encode(kind, [s.pixel_inputs for s in unique.values()])))
        return outputs

    def position_ids(self, batch, step: StepInputs) -> torch.Tensor:
        return self.adapter.position_ids(step)

    def after_step(self, batch, step: StepInputs) -> None:
        for w in step.windows:
            for span in w.seq.media:
                if span.end <= w.seq.num_computed:
                    self.encoder_cache.pop(span.cache_key)


def load_vlm(model_id: str, hf_config, config: EngineConfig, attn_name: str, dtype, layout: ShardLayout,
             *, revision=None, trust_remote_code: bool = False, packed=None) -> VlmCausalLM:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    adapter_for(hf_config.model_type)  # fail early, listing the supported types
    kwargs = dict(revision=revision, trust_remote_code=trust_remote_code,
                  attn_implementation={"text_config": attn_name, "vision_config": "sdpa"}, dtype=dtype,
                  use_safetensors=True, **load_kwargs(hf_config, layout, config.device))
    if packed is not None:  # an AWQ / GPTQ / compressed-tensors checkpoint (quantization/packed_checkpoint.py)
        from tgi_vlm.quantization.packed_checkpoint import load_packed

        model = load_packed(AutoModelForImageTextToText.from_pretrained, model_id, packed, hf_config, config.device,
                            **kwargs)
    else:
        model = AutoModelForImageTextToText.from_pretrained(model_id, **kwargs).to(config.device)
    keep_own_kv_head(model.get_decoder(), model.config.get_text_config(), layout)
    processor = AutoProcessor.from_pretrained(model_id, revision=revision, trust_remote_code=trust_remote_code)
    logger.info("loaded {} ({}) on {} in {}", model_id, type(model).__name__, config.device, dtype)
    return VlmCausalLM(model, processor, config, model_id=model_id, layout=layout)
