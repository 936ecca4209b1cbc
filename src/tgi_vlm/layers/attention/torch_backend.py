"""Reference paged attention in plain PyTorch (CPU and GPU).

Writes the step's K/V into the paged cache at `meta.slots`, then attends each sequence over its
cached positions: all one-token (decode) sequences in one batched SDPA call, each prefill chunk in
its own. Masks come from the metadata (built once per step and shared by the layers).

K/V copies: a prefill span with nothing cached before it (the usual first chunk of a prompt)
attends to the step's own key/value rows, no copy. Spans after a cached prefix gather their
positions from the paged cache, one `index_select` per layer; so does the decode group (`_decode`).
On CPU the production backend (cpu_backend.py, a subclass) decodes without that gather: through the
native kernel, or over a dense per-sequence copy that each step only appends to (decode_mirror.py).
This backend stays the reference the others are tested against, and imports no native code.
Measured alternatives (benchmarks/results/cpu-profile.md): one SDPA per sequence over a view of its
blocks when they are contiguous costs ~28 us of call overhead per sequence and layer, more than the
batched gather at 8+ sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tgi_vlm.layers.attention.backend import AttentionBackend
from tgi_vlm.layers.attention.metadata import AttentionMetadata
from tgi_vlm.layers.padding import zero_padded


class TorchPagedBackend(AttentionBackend):
    name = "torch"
    takes_written_kv = True

    def forward(self, layer_idx, query, key, value, meta: AttentionMetadata, *, scaling, sliding_window,
                softcap=None, kv_written: bool = False) -> torch.Tensor:
        """`kv_written`: the caller already stored this step's key/value at `meta.slots` (the lean layer's
        fused rotary, `tgi_vlm::rotary_and_store`)."""
        k_cache, v_cache = meta.kv_cache.flat(layer_idx)  # [slots, Hkv, D]
        if not kv_written:
            write_kv(k_cache, v_cache, key, value, meta.slots)
        q = query[0].transpose(0, 1)  # [T, Hq, D]
        out = torch.empty_like(q)
        chunk = self.pattern.chunk_size(layer_idx)
        if meta.decode is not None:
            self._decode(layer_idx, q, out, k_cache, v_cache, meta, scaling, sliding_window, chunk, softcap)
        for index, span in enumerate(meta.prefills):
            q_span = q[span.q_start : span.q_end].transpose(0, 1)[None]  # [1, Hq, L, D]
            if span.kv_len == span.q_len and k_cache.dtype == key.dtype:
                # Nothing cached before this span: its keys/values are exactly this step's rows
                # (what was just written), so attend to those in place instead of gathering a copy.
                k_span = key[:, :, span.q_start : span.q_end]
                v_span = value[:, :, span.q_start : span.q_end]
            else:
                k_span = _gather(k_cache, span.slot_index).transpose(0, 1)[None].to(q.dtype)  # [1, Hkv, kv_len, D]
                v_span = _gather(v_cache, span.slot_index).transpose(0, 1)[None].to(q.dtype)
            if not softcap and _plain_causal(span, sliding_window, chunk):
                # No mask tensor: SDPA's causal kernel also skips the blocks above the diagonal.
                o = causal_attention(q_span, k_span, v_span, scaling)
            else:
                mask = meta.prefill_mask(index, sliding_window, chunk)
                o = attend(q_span, k_span, v_span, mask, scaling, softcap)
            out[span.q_start : span.q_end] = o[0].transpose(0, 1)
        return out[None]

    def _decode(self, layer_idx, q, out, k_cache, v_cache, meta: AttentionMetadata, scaling, sliding_window, chunk,
                softcap) -> None:
        """The decode group's rows of `out` (`q` `[T, Hq, D]`): the reference, a gather of each sequence's
        positions from the paged cache and one batched SDPA (the CPU backend overrides this)."""
        gather_decode(q, out, k_cache, v_cache, meta, scaling, sliding_window, chunk, softcap)


def _plain_causal(span, sliding_window: int | None, chunk: int | None) -> bool:
    """The span's mask is exactly the lower triangle: a whole sequence (no cached prefix), no
    bidirectional image block, and no window or attention chunk shorter than the sequence."""
    return (span.kv_len == span.q_len and span.bidirectional_groups is None
            and (not sliding_window or sliding_window >= span.kv_len) and (not chunk or chunk >= span.kv_len))


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Store key/value `[1, Hkv, T, D]` at `slots` `[T]` of the flat `[num_slots, Hkv, D]` caches."""
    k_cache.index_copy_(0, slots, key[0].transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(0, slots, value[0].transpose(0, 1).to(v_cache.dtype))


_CAUSAL_BLOCK = 32
_PADDED_DTYPES = (torch.bfloat16, torch.float16)
_PADDED_MAX_ROWS = 1024  # measured gains end below this (longer spans: even or a few % slower)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Causal SDPA of one span (`q [1, Hq, L, D]`, K/V `[1, Hkv, L, D]`); in bf16/fp16, over rows padded
    at the end to a multiple of 32.

    Why: torch's CPU flash kernel runs reduced-precision spans whose length is not a multiple of its
    32-row blocks much slower: on the bench model's shapes 183 rows take 348 us and 192 rows 219 us,
    250 take 508 and 256 take 332 (benchmarks/results/cpu-profile.md). Exact for the real rows: under
    the causal mask row i sees keys 0..i only, so keys appended after the last row are never weighed;
    the padded rows' outputs are dropped. The kernel's blocking then differs, so sums may round
    differently (about one bf16 ulp). Float32 keeps the unpadded call (its parity is held to 1e-4 and
    the gain there is small), and so do spans past 1024 rows and other devices (not measured there)."""
    length = q.shape[2]
    padded = -(-length // _CAUSAL_BLOCK) * _CAUSAL_BLOCK
    if (q.dtype not in _PADDED_DTYPES or padded == length or padded > _PADDED_MAX_ROWS
            or q.device.type != "cpu"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
    q, k, v = (zero_padded(t, 2, padded) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)[:, :, :length]


def attend(q, k, v, mask, scaling, softcap) -> torch.Tensor:
    """SDPA, or the explicit form when logits are soft-capped (Gemma2: cap·tanh(s/cap) before the mask)."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = softcap * torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def gather_decode(q, out, k_cache, v_cache, meta, scaling, sliding_window, chunk, softcap) -> None:
    """The reference decode: every decode row's positions gathered from the paged cache, one batched SDPA."""
    group = meta.decode
    q_dec = (q if group.rows_are_all else q[group.rows])[:, :, None, :]  # [B, Hq, 1, D]
    k_dec = _gather(k_cache, group.slot_index).permute(0, 2, 1, 3).to(q.dtype)  # [B, Hkv, max_kv, D]
    v_dec = _gather(v_cache, group.slot_index).permute(0, 2, 1, 3).to(q.dtype)
    mask = meta.decode_mask(sliding_window, chunk)
    o = attend(q_dec, k_dec, v_dec, mask, scaling, softcap)
    if group.rows_are_all:
        out.copy_(o[:, :, 0])
    else:
        out[group.rows] = o[:, :, 0]


def _gather(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`cache[index]` for a long index of any shape; index_select is 2-4× faster than advanced indexing on CPU."""
    return cache.index_select(0, index.reshape(-1)).view(*index.shape, *cache.shape[1:])
