"""Per-step attention metadata, built once on the host and shared by every layer.

A step packs the scheduled tokens of all sequences into one ragged row `[1, T]`. Sequences that
feed exactly one token (decode) form one padded group and run as a single batched SDPA call;
sequences that feed more (prefill chunks) run one SDPA call each. Masks are built lazily, once
per (group, sliding window) and cached for the remaining layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tgi_vlm.layers.attention.kv_cache import PagedKVCache

if TYPE_CHECKING:
    from tgi_vlm.layers.attention.backend import AttentionBackend


@dataclass
class PrefillSpan:
    """One multi-token sequence of the step. Rows `[q_start, q_end)` of the packed tokens are the
    positions `[kv_len - (q_end - q_start), kv_len)` of the sequence."""

    q_start: int
    q_end: int
    kv_len: int
    slot_index: torch.Tensor  # [kv_len] long: cache slot of every position 0..kv_len-1
    # [kv_len] long or None: positions sharing a group id >= 0 attend to each other both ways
    # (Gemma3 image blocks, PaliGemma prefix); -1 = plain causal.
    bidirectional_groups: torch.Tensor | None = None

    @property
    def q_len(self) -> int:
        return self.q_end - self.q_start


@dataclass
class DecodeGroup:
    """Sequences feeding one token each, padded to the longest: slot_index `[B, max_kv]` (padding
    points at slot 0 and is masked out), kv_lens `[B]`, rows `[B]` into the packed tokens.

    `row_list` / `kv_len_list` are the same numbers on the host: planning reads these, never the
    device tensors (a read-back would be a host sync per step, and per graph replay)."""

    rows: torch.Tensor
    slot_index: torch.Tensor
    kv_lens: torch.Tensor
    rows_are_all: bool  # the step is decode only: rows == arange(T), no gather/scatter needed
    row_list: list[int]
    kv_len_list: list[int]
    # Sequence uids (unique for the process's life), in group order; None where the group is not
    # made of live sequences (CUDA-graph static inputs). The decode mirror keys its rows by these.
    keys: list[int] | None = None

    @classmethod
    def build(cls, rows: list[int], kv_lens: list[int], slot_index: torch.Tensor, num_tokens: int,
              keys: list[int] | None = None) -> DecodeGroup:
        device = slot_index.device
        return cls(
            rows=torch.tensor(rows, dtype=torch.long, device=device),
            slot_index=slot_index,
            kv_lens=torch.tensor(kv_lens, dtype=torch.long, device=device),
            rows_are_all=len(rows) == num_tokens,
            row_list=list(rows),
            kv_len_list=list(kv_lens),
            keys=keys,
        )


@dataclass
class AttentionMetadata:
    """One step's attention inputs. Created by the step builder (or a graph's static inputs), lives
    for one forward; `backend` is the model's own backend, `backend_state` what its `plan` made."""

    kv_cache: PagedKVCache
    slots: torch.Tensor  # [T] long: where this step's keys/values are written
    decode: DecodeGroup | None
    prefills: list[PrefillSpan]
    backend: AttentionBackend | None = None
    backend_state: object | None = None
    _masks: dict = field(default_factory=dict, repr=False)
    # What layer code computes once per step and shares across layers (layers/native_step.py), by its key.
    layer_state: dict = field(default_factory=dict, repr=False)

    def clear_masks(self) -> None:
        """Forget cached masks (static graph inputs are refilled in place between runs)."""
        self._masks.clear()
        self.layer_state.clear()

    def decode_mask(self, sliding_window: int | None, chunk_size: int | None = None) -> torch.Tensor:
        """[B, 1, 1, max_kv] bool: True where the decode query may attend."""
        key = ("decode", sliding_window, chunk_size)
        if key not in self._masks:
            group = self.decode
            self._masks[key] = decode_mask(group.kv_lens, group.slot_index.shape[1], sliding_window, chunk_size)
        return self._masks[key]

    def prefill_mask(self, index: int, sliding_window: int | None, chunk_size: int | None = None) -> torch.Tensor:
        """[1, 1, q_len, kv_len] bool for prefill span `index`."""
        key = (index, sliding_window, chunk_size)
        if key not in self._masks:
            self._masks[key] = _span_mask(self.prefills[index], sliding_window, chunk_size)
        return self._masks[key]


def decode_mask(kv_lens: torch.Tensor, width: int, sliding_window: int | None,
                chunk_size: int | None) -> torch.Tensor:
    """[B, 1, 1, width] bool: position p is visible to a decode query of a sequence with kv_len L when
    p < L, within the sliding window, and (Llama4 chunked attention) in the query's own chunk."""
    positions = torch.arange(width, device=kv_lens.device)[None, :]
    lens = kv_lens[:, None]
    mask = positions < lens
    if sliding_window:
        mask &= positions > lens - 1 - sliding_window
    if chunk_size:
        mask &= positions >= ((lens - 1) // chunk_size) * chunk_size
    return mask[:, None, None, :]


def _span_mask(span: PrefillSpan, sliding_window: int | None, chunk_size: int | None) -> torch.Tensor:
    device = span.slot_index.device
    k_pos = torch.arange(span.kv_len, device=device)
    q_pos = k_pos[span.kv_len - span.q_len :]
    mask = k_pos[None, :] <= q_pos[:, None]
    groups = span.bidirectional_groups
    if groups is not None:
        q_groups = groups[span.kv_len - span.q_len :]
        mask |= (q_groups[:, None] == groups[None, :]) & (q_groups[:, None] >= 0)
    # transformers' composition: AND(window, OR(causal, bidirectional block))
    if sliding_window:
        mask &= q_pos[:, None] - k_pos[None, :] < sliding_window
    if chunk_size:
        mask &= (q_pos[:, None] // chunk_size) == (k_pos[None, :] // chunk_size)
    return mask[None, None]
