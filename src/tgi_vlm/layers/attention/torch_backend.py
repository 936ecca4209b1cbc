"""Reference paged attention in plain PyTorch (CPU and GPU).

Registered with transformers' AttentionInterface and selected for the text sub-model only. It
receives rotary-applied query `[1, Hq, T, D]` and key/value `[1, Hkv, T, D]` for the packed step,
writes K/V into the paged cache at `attn_metadata.slots`, then attends each sequence over its
cached positions. Returns `[1, T, Hq, D]` as transformers expects.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tgi_vlm.layers.attention.metadata import AttentionMetadata


def torch_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    attn_metadata: AttentionMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if attn_metadata is None:
        raise RuntimeError("tgi_vlm paged attention called without attn_metadata (use the engine's forward)")
    meta = attn_metadata
    k_cache, v_cache = meta.kv_cache.flat(module.layer_idx)  # [slots, Hkv, D]
    k_cache.index_copy_(0, meta.slots, key[0].transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slots, value[0].transpose(0, 1).to(v_cache.dtype))

    q = query[0].transpose(0, 1)  # [T, Hq, D]
    out = torch.empty_like(q)
    chunk = attention_chunk_size(module)
    if meta.decode is not None:
        _decode(q, out, k_cache, v_cache, meta, scaling, sliding_window, chunk, softcap)
    for index, span in enumerate(meta.prefills):
        q_span = q[span.q_start : span.q_end].transpose(0, 1)[None]  # [1, Hq, L, D]
        k_span = _gather(k_cache, span.slot_index).transpose(0, 1)[None].to(q.dtype)  # [1, Hkv, kv_len, D]
        v_span = _gather(v_cache, span.slot_index).transpose(0, 1)[None].to(q.dtype)
        mask = meta.prefill_mask(index, sliding_window, chunk)
        o = _attend(q_span, k_span, v_span, mask, scaling, softcap)
        out[span.q_start : span.q_end] = o[0].transpose(0, 1)
    return out[None], None


def attention_chunk_size(module: torch.nn.Module) -> int | None:
    """Chunked-attention layers (Llama4) attend only within fixed position chunks; read once per module."""
    size = getattr(module, "_tgi_vlm_chunk_size", False)
    if size is False:
        config = module.config
        layer_types = getattr(config, "layer_types", None) or []
        chunked = module.layer_idx < len(layer_types) and layer_types[module.layer_idx] == "chunked_attention"
        size = getattr(config, "attention_chunk_size", None) if chunked else None
        module._tgi_vlm_chunk_size = size
    return size


def _decode(q, out, k_cache, v_cache, meta, scaling, sliding_window, chunk, softcap) -> None:
    group = meta.decode
    q_dec = (q if group.rows_are_all else q[group.rows])[:, :, None, :]  # [B, Hq, 1, D]
    k_dec = _gather(k_cache, group.slot_index).permute(0, 2, 1, 3).to(q.dtype)  # [B, Hkv, max_kv, D]
    v_dec = _gather(v_cache, group.slot_index).permute(0, 2, 1, 3).to(q.dtype)
    mask = meta.decode_mask(sliding_window, chunk)
    o = _attend(q_dec, k_dec, v_dec, mask, scaling, softcap)
    if group.rows_are_all:
        out.copy_(o[:, :, 0])
    else:
        out[group.rows] = o[:, :, 0]


def _attend(q, k, v, mask, scaling, softcap) -> torch.Tensor:
    """q [B, Hq, L, D], k/v [B, Hkv, S, D], bool mask → [B, Hq, L, D].

    SDPA has no logit softcapping (Gemma2's `softcap`: scores → tanh(scores / cap) · cap before
    the mask), so capped layers take transformers' eager formula, softmax in float32.
    """
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scaling is None else scaling)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _gather(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`cache[index]` for a long index of any shape; index_select is 2-4× faster than advanced indexing on CPU."""
    return cache.index_select(0, index.reshape(-1)).view(*index.shape, *cache.shape[1:])
