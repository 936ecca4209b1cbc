"""Planning one forward: which tokens of which sequences run, and the tensors that describe them.

Decide on the host, act on the device: `schedule` is plain Python over sequence counters;
`build_step` turns its decision into the packed token ids, positions, slots and attention
metadata that every layer shares, and the step context (`layers/step_context.py`: which request
and adapter each row belongs to) that the runner sets around the language model's forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgi_vlm.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    DecodeGroup,
    PagedKVCache,
    PrefillSpan,
)
from tgi_vlm.layers.step_context import StepContext
from tgi_vlm.models.sequence import Sequence


def schedule(seqs: list[Sequence], prefill_budget: int | None) -> list[int]:
    """Tokens each sequence feeds in the next forward (0 for finished ones).

    A decoding sequence feeds 1, plus its draft tokens when speculating. A prefilling one feeds the router's `chunk_len` on its first
    prefill (the whole prompt when unset); later chunks share what the budget leaves after the
    decode tokens, in batch order, at least one token each so every sequence progresses.
    Pure: calling it twice gives the same answer (`to_pb` uses it for `current_tokens`).
    """
    sizes = [0 if s.finished else (1 + len(s.draft) if not s.prefilling else -1) for s in seqs]
    left = None if prefill_budget is None else prefill_budget - sum(n for n in sizes if n > 0)
    for i, seq in enumerate(seqs):
        if sizes[i] != -1:
            continue
        if not seq.started or left is None:  # first prefill: the router sized it (chunk_len, else all of it)
            n = seq.remaining_prompt if seq.first_chunk_len is None else min(seq.first_chunk_len, seq.remaining_prompt)
        else:
            n = min(seq.remaining_prompt, max(left, 1))
        sizes[i] = seq.align_chunk(max(n, 1))
        if left is not None:
            left -= sizes[i]
    return sizes


@dataclass
class SeqWindow:
    """Sequence `seq` runs positions [start, end) in rows [row, row + end - start) of the step."""

    seq: Sequence
    start: int
    end: int
    row: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def samples(self) -> bool:
        """The window reaches the end of the known tokens, so the step yields a new token."""
        return self.end >= len(self.seq.all_ids)

    @property
    def first_sample_row(self) -> int:
        """Row predicting the token after all_ids; later rows (drafts) verify one token each."""
        return self.row + len(self.seq.all_ids) - 1 - self.start

    @property
    def sample_rows(self) -> int:
        return self.end - len(self.seq.all_ids) + 1


@dataclass
class StepInputs:
    windows: list[SeqWindow]
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long, absolute positions (adapters may replace, e.g. mrope)
    metadata: AttentionMetadata
    context: StepContext  # per row: request, adapter (one entry per window, in window order)


def build_step(seqs: list[Sequence], sizes: list[int], kv_cache: PagedKVCache, backend: AttentionBackend,
               device: torch.device) -> StepInputs:
    windows: list[SeqWindow] = []
    ids: list[int] = []
    positions: list[int] = []
    row = 0
    for seq, n in zip(seqs, sizes):
        if n == 0:
            continue
        start = seq.num_computed
        windows.append(SeqWindow(seq, start, start + n, row))
        ids.extend(seq.window_ids(start, start + n))
        positions.extend(range(start, start + n))
        row += n
    input_ids = torch.tensor(ids, dtype=torch.long, device=device)
    positions_t = torch.tensor(positions, dtype=torch.long, device=device)
    slots = torch.cat([w.seq.slot_tensor[w.start : w.end] for w in windows])
    metadata = AttentionMetadata(
        kv_cache=kv_cache,
        slots=slots,
        decode=_decode_group(windows, row),
        prefills=[_prefill_span(w) for w in windows if w.num_tokens > 1],
        backend=backend,
    )
    return StepInputs(windows, input_ids, positions_t, metadata, step_context(windows, device))


def step_context(windows: list[SeqWindow], device: torch.device) -> StepContext:
    """Sequence b of the context is `windows[b]`, owning rows [w.row, w.row + w.num_tokens); a step
    has at least one window (a batch with nothing to run is released before its next step)."""
    return StepContext(
        request_ids=tuple(w.seq.request_id for w in windows),
        row_starts=tuple(w.row for w in windows) + (windows[-1].row + windows[-1].num_tokens,),
        adapters=tuple(w.seq.adapter_index for w in windows),
        device=torch.device(device),
    )


def _decode_group(windows: list[SeqWindow], num_tokens: int) -> DecodeGroup | None:
    singles = [w for w in windows if w.num_tokens == 1]
    if not singles:
        return None
    # padding is 0 → slot 0 of reserved block 0, masked out
    slot_index = torch.nn.utils.rnn.pad_sequence([w.seq.slot_tensor[: w.end] for w in singles], batch_first=True)
    return DecodeGroup.build([w.row for w in singles], [w.end for w in singles], slot_index, num_tokens,
                             keys=[w.seq.uid for w in singles])


def _prefill_span(window: SeqWindow) -> PrefillSpan:
    seq = window.seq
    groups = seq.mm.bidirectional_groups if seq.mm is not None else None
    if groups is not None and groups.shape[0] < window.end:  # generated/draft rows are plain causal
        groups = torch.cat([groups, groups.new_full((window.end - groups.shape[0],), -1)])
    return PrefillSpan(
        q_start=window.row,
        q_end=window.row + window.end - window.start,
        kv_len=window.end,
        slot_index=seq.slot_tensor[: window.end],
        bidirectional_groups=None if groups is None else groups[: window.end],
    )
