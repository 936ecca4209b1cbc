"""Bare `Sequence`s for planning tests (schedule, build_step): only the counters and slots planning
reads; no tokenizer, chooser or model."""

from __future__ import annotations

import torch

from tgi_vlm.models.sequence import MultimodalState, Sequence


def make_seq(prompt_len: int, *, computed: int = 0, generated: int = 0, started: bool | None = None,
             chunk_len: int | None = None, draft: tuple[int, ...] = (), finished: bool = False,
             groups: list[int] | None = None, request_id: int = 0, adapter_id: str = "",
             adapter_index: int = 0, max_new_tokens: int = 16) -> Sequence:
    """A sequence with `computed` positions in the cache and `generated` tokens after the prompt;
    `started` defaults to whether anything was computed. Slot of position p is 100·(request_id+1) + p."""
    total = prompt_len + max_new_tokens
    slots = [100 * (request_id + 1) + p for p in range(total)]
    mm = MultimodalState(group_ids=groups) if groups is not None else None
    return Sequence(
        request_id=request_id,
        all_ids=list(range(10, 10 + prompt_len + generated)),
        prompt_len=prompt_len,
        max_new_tokens=max_new_tokens,
        chooser=None,
        stopping=None,
        detokenizer=None,
        block_table=[],
        slot_tensor=torch.tensor(slots),
        slot_list=slots,
        owns_blocks=False,
        mm=mm,
        adapter_id=adapter_id,
        adapter_index=adapter_index,
        num_computed=computed,
        first_chunk_len=chunk_len,
        started=computed > 0 if started is None else started,
        finished=finished,
        draft=list(draft),
    )


def decoding(prompt_len: int = 6, *, draft: tuple[int, ...] = (), **kw) -> Sequence:
    """A sequence that has prefilled its prompt and sampled one token (it feeds that token next)."""
    return make_seq(prompt_len, computed=prompt_len, generated=1, draft=draft, **kw)
