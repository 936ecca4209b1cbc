"""Who each packed row of a step belongs to: the per-row context a layer reads during the forward.

A step packs the tokens of several sequences into rows `[0, T)` (`models/step.py`). Attention learns
where each sequence's rows are from its own metadata; everything else a layer may need per row (which
request, which LoRA adapter; media when a kind needs it) is here. The model runner builds one `StepContext`
per step (`build_step`) and sets it around the language model's forward with `using(ctx)`; a layer
reads it with `current()`, so no new argument is threaded through transformers' modules. Outside
that forward (plain transformers, the vision tower, tests calling a layer directly) `current()` is None:
run as the base model.

Decide on the host, act on the device: the context holds per-sequence host tuples; the per-row device
tensors and the grouping of rows by adapter (`adapter_ranges`, `adapter_runs`, `adapter_groups`, and
`padded_groups`, the LoRA layers' batched form) are derived from them at most once per step, on first
use, so a step whose layers never ask builds no tensor.

Captured CUDA graphs cannot read host values at replay. A graphed context (`for_graph`) has one row
per padded decode slot and a static adapter-index buffer `[S]` that every replay refills (padding
rows 0); inside a graph a layer reads only `row_adapter`, which is that buffer. Its host fields
describe the capture, not the replay.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import cached_property

import torch

BASE_ADAPTER = 0  # adapter index of the base model (no LoRA delta)


@dataclass(frozen=True, eq=False)
class AdapterRows:
    """The rows of one adapter in a step: contiguous half-open runs `[start, end)` in ascending order,
    and the same rows as a device index `[num_rows]` long (for `index_select` / `index_add_`)."""

    adapter: int
    ranges: tuple[tuple[int, int], ...]
    rows: torch.Tensor


@dataclass(frozen=True, eq=False)
class PaddedGroups:
    """The rows of every adapter but the base model's, as `k` equal-width groups (for batched products).

    `rows` `[k * width]`: group g's rows at `[g * width, (g + 1) * width)`, ascending, a shorter group padded by
    repeating its last row; `padding` `[k * width, 1]` bool marks those repeats (a product over them is zeroed
    before it is added, so a row is never added twice). `adapters` `[k]`: each group's adapter index; `span`: the
    half-open range of indices when the adapters are consecutive (a slice instead of a gather), else None."""

    adapters: torch.Tensor
    rows: torch.Tensor
    padding: torch.Tensor | None  # None: every group is exactly `width` rows
    width: int
    span: tuple[int, int] | None


@dataclass(frozen=True, eq=False)
class StepContext:
    """Per-sequence facts of one step, in step order (the step's windows); sequence b owns rows
    `[row_starts[b], row_starts[b + 1])`. Lifetime: one step (graphed: as long as its graph)."""

    request_ids: tuple[int, ...]  # [B] the router's request ids
    row_starts: tuple[int, ...]  # [B + 1] first row of each sequence, then T
    adapters: tuple[int, ...]  # [B] adapter index (BASE_ADAPTER = 0 for the base model)
    device: torch.device
    # Graphed contexts only: the static [S] adapter-index buffer a replay copies into.
    static_adapters: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        b = len(self.request_ids)
        if len(self.row_starts) != b + 1 or len(self.adapters) != b:
            raise ValueError(f"step context: {b} request ids, {len(self.row_starts)} row starts and "
                             f"{len(self.adapters)} adapter indices (want B, B + 1 and B)")

    @classmethod
    def for_graph(cls, size: int, device: torch.device | str) -> StepContext:
        """The context a captured decode graph of `size` rows sees: row i is sequence i, and
        `row_adapter` is a static buffer of zeros that each replay refills (`StaticDecodeInputs.fill`). Its
        request ids are placeholders (-1): inside a graph only `row_adapter` means anything."""
        device = torch.device(device)
        return cls(request_ids=(-1,) * size, row_starts=tuple(range(size + 1)),
                   adapters=(BASE_ADAPTER,) * size, device=device,
                   static_adapters=torch.zeros(size, dtype=torch.long, device=device))

    # ----- host queries -----
    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)

    @property
    def num_rows(self) -> int:
        return self.row_starts[-1]

    @property
    def graphed(self) -> bool:
        """Inside a captured graph: read `row_adapter` only (the host fields are the capture's)."""
        return self.static_adapters is not None

    @cached_property
    def adapter_ranges(self) -> dict[int, tuple[tuple[int, int], ...]]:
        """Adapter index → its rows as ascending half-open runs (neighbouring sequences of one adapter
        merged), adapters in ascending order."""
        runs: dict[int, list[tuple[int, int]]] = {}
        for seq, adapter in enumerate(self.adapters):
            start, end = self.row_starts[seq], self.row_starts[seq + 1]
            if start == end:
                continue
            own = runs.setdefault(adapter, [])
            if own and own[-1][1] == start:
                own[-1] = (own[-1][0], end)
            else:
                own.append((start, end))
        return {a: tuple(runs[a]) for a in sorted(runs)}

    # ----- device views (built on first use, once per step) -----
    @cached_property
    def _host_row_seq(self) -> torch.Tensor:
        counts = torch.tensor([e - s for s, e in zip(self.row_starts, self.row_starts[1:])], dtype=torch.long)
        return torch.repeat_interleave(torch.arange(self.num_seqs), counts)  # [T] on the host

    @cached_property
    def row_seq(self) -> torch.Tensor:
        """`[T]` long: the step sequence of every row."""
        return self._host_row_seq.to(self.device)

    @cached_property
    def row_adapter(self) -> torch.Tensor:
        """`[T]` long: the adapter index of every row (graphed: the static buffer, refilled per replay)."""
        if self.static_adapters is not None:
            return self.static_adapters
        if all(a == BASE_ADAPTER for a in self.adapters):
            return torch.zeros(self.num_rows, dtype=torch.long, device=self.device)
        return torch.tensor(self.adapters, dtype=torch.long)[self._host_row_seq].to(self.device)

    @cached_property
    def adapter_groups(self) -> tuple[AdapterRows, ...]:
        """The step's rows grouped by adapter, ascending adapter index (the base model's group too, when
        it has rows). Not available inside a graph: there rows are told apart by `row_adapter`."""
        if self.graphed:
            raise RuntimeError("adapter_groups is host-side grouping and cannot change between graph replays; "
                               "inside a captured graph read row_adapter")
        groups = []
        for adapter, ranges in self.adapter_ranges.items():
            rows = torch.cat([torch.arange(s, e) for s, e in ranges]).to(self.device)
            groups.append(AdapterRows(adapter, ranges, rows))
        return tuple(groups)


    @cached_property
    def adapter_runs(self) -> tuple[tuple[int, int, int], ...]:
        """(adapter, start, end) for every run of rows of an adapter other than the base model, ascending adapter."""
        return tuple((a, s, e) for a, ranges in self.adapter_ranges.items() if a != BASE_ADAPTER for s, e in ranges)

    @cached_property
    def padded_groups(self) -> PaddedGroups | None:
        """The non-base adapters' rows as equal-width groups (`PaddedGroups`); None when every row is the base
        model's. Host-side grouping, as `adapter_groups`: not inside a graph."""
        if self.graphed:
            raise RuntimeError("padded_groups is host-side grouping; inside a captured graph read row_adapter")
        groups = {a: [r for s, e in ranges for r in range(s, e)]
                  for a, ranges in self.adapter_ranges.items() if a != BASE_ADAPTER}
        if not groups:
            return None
        width = max(len(rows) for rows in groups.values())
        rows, padding = [], []
        for own in groups.values():
            rows += own + [own[-1]] * (width - len(own))
            padding += [False] * len(own) + [True] * (width - len(own))
        adapters = list(groups)
        span = (adapters[0], adapters[-1] + 1) if adapters == list(range(adapters[0], adapters[-1] + 1)) else None
        return PaddedGroups(torch.tensor(adapters, device=self.device), torch.tensor(rows, device=self.device),
                            torch.tensor(padding, device=self.device)[:, None] if any(padding) else None, width, span)


_CURRENT: ContextVar[StepContext | None] = ContextVar("tgi_vlm_step_context", default=None)


def current() -> StepContext | None:
    """The context of the forward running now, or None outside the engine's language-model forward."""
    return _CURRENT.get()


@contextmanager
def using(ctx: StepContext | None) -> Iterator[StepContext | None]:
    """Make `ctx` the current step context for the body (nests; restored on exit, also on error)."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)
