"""`LoraDelta`: one linear layer's LoRA term for every loaded adapter, added to the layer's output row by row.

For adapter i targeting the layer, peft's merged weight is `W + scale_i B_i A_i`; for a row of adapter i the
layer's output is `x W^T + (x A_i^T)(scale_i B_i)^T`. Stored in float32 on the model's device, stacked by adapter
index: A^T `[N + 1, in, r]` and (scale_i B_i)^T `[N + 1, r, out]` (scale folded at load), each contiguous in the
layout `bmm` reads (a transposed view sent float32 `bmm` down a path ~500x slower: 5.1 ms against 8.7 us for one
decode layer's product, same run); slot 0 (the base model) and adapters that do not target this layer are zeros,
smaller ranks zero-padded, so any product over them adds exactly 0. Base rows are never multiplied in eager steps.

The delta is computed in float32 whatever the model's dtype (the stacks are float32; a bf16 model's rows are
converted, its delta rounded once when added): torch's CPU `bmm` in bfloat16 took 0.7-10 ms for one decode layer's
product where float32 took 25 us (same run, a loaded 2-core Xeon), and float32 is the more exact sum.

Eager steps read the step context's grouping (layers/step_context.py, built once per step for all layers): with at
most `SLICED_RUNS` runs of adapter rows (a prefill of one or two sequences), two products per run on slices
(`addmm_` into the output view); otherwise every adapter's rows at once — gathered into `k` equal-width groups
(`PaddedGroups`), two batched products (`bmm`) against the `k` adapters' stacks, padding rows zeroed, added back
with one `index_add_` — seven operations per layer however many adapters the batch mixes. A captured CUDA graph
cannot change its grouping between replays, so inside one every adapter's rank columns are computed for every row
and kept by a mask read from the static adapter-index buffer (`row_adapter`): one pair of products, exact (the
other adapters' columns are multiplied by 0).

`add_to` writes into `out` in place. A fused q/k/v or gate/up group (layers/linear/fused.py) gets one term for its
whole product (`LoraDelta.fused`: the members' A side by side, their B block-diagonal), so it runs one product pair
instead of one per member; the lean layers read that product directly. Outside the engine's language-model forward
(no step context: plain transformers, the vision tower) it adds nothing.
"""

from __future__ import annotations

import torch

from tgi_vlm.layers.step_context import PaddedGroups, current

# Up to this many runs of adapter rows (a prefill of few sequences), two products per run on slices of the rows;
# more (a decode batch of several adapters), every adapter's rows in two batched products (`_add_grouped`). The
# graphs' masked product (every row times every adapter's rank columns) was tried for eager decode steps of up to 4
# adapters too: paired on the bench model's 16-sequence decode step, 51.7 ms against grouping's 49.4 (base 37.2).
SLICED_RUNS = 2


def _add_product(target: torch.Tensor, h: torch.Tensor, b: torch.Tensor) -> None:
    """`target += h @ b` (`h`, `b` float32): fused into the output for a float32 model, else rounded once and added."""
    if target.dtype == torch.float32:
        target.addmm_(h, b)
    else:
        target.add_((h @ b).to(target.dtype))


class LoraDelta:
    """The `LinearExtra` of one layer (see the module docstring). Float32 stacks, one slot per adapter index (slot 0,
    the base model, and adapters that do not target this layer hold zeros; ranks below the largest are zero-padded):
    `at_stack` `[N + 1, in, r]` (A transposed) and `bt_stack` `[N + 1, r, out]` (B transposed, scale folded in),
    both contiguous in the layout `bmm` reads; `a_columns` `[in, (N + 1) r]`, the same A side by side, for graphs."""

    def __init__(self, at_stack: torch.Tensor, bt_stack: torch.Tensor, adapters: tuple[int, ...]):
        self.at_stack, self.bt_stack = at_stack, bt_stack  # [N + 1, in, r], [N + 1, r, out] float32
        self.in_features, self.rank, self.out_features = at_stack.shape[1], at_stack.shape[2], bt_stack.shape[2]
        self.adapters = adapters
        self.a_columns = at_stack.permute(1, 0, 2).reshape(self.in_features, -1)  # [in, (N + 1) r]
        # graphs: column j of the stacked rank dimension belongs to adapter j // rank
        self.column_adapter = torch.arange(at_stack.shape[0], device=at_stack.device).repeat_interleave(self.rank)

    @classmethod
    def from_pairs(cls, pairs: dict[int, tuple[torch.Tensor, torch.Tensor]], num_adapters: int) -> LoraDelta:
        """From each targeting adapter's (A `[r_i, in]`, scaled B `[out, r_i]`), float32 on their device."""
        first_a, first_b = next(iter(pairs.values()))
        rank = max(a.shape[0] for a, _ in pairs.values())
        at_stack = first_a.new_zeros(num_adapters + 1, first_a.shape[1], rank, dtype=torch.float32)
        bt_stack = first_a.new_zeros(num_adapters + 1, rank, first_b.shape[0], dtype=torch.float32)
        for index, (a, b) in pairs.items():
            at_stack[index, :, : a.shape[0]] = a.T
            bt_stack[index, : a.shape[0]] = b.T
        return cls(at_stack, bt_stack, tuple(sorted(pairs)))

    @classmethod
    def fused(cls, members: list[LoraDelta | None], widths: list[int]) -> LoraDelta:
        """One term for a fused group's whole product `[..., sum(widths)]` (layers/linear/fused.py): the members' A
        side by side along the rank, their B block-diagonal (member m's rank rows feed only its own column block),
        so a step runs one product pair for the group instead of one per member. Members without a term add 0."""
        present = [m for m in members if m is not None]
        slots, in_features, device = present[0].at_stack.shape[0], present[0].in_features, present[0].at_stack.device
        ranks = [m.rank if m is not None else 0 for m in members]
        at_stack = torch.zeros(slots, in_features, sum(ranks), device=device)
        bt_stack = torch.zeros(slots, sum(ranks), sum(widths), device=device)
        row, column = 0, 0
        for member, rank, width in zip(members, ranks, widths):
            if member is not None:
                at_stack[:, :, row : row + rank] = member.at_stack
                bt_stack[:, row : row + rank, column : column + width] = member.bt_stack
            row, column = row + rank, column + width
        return cls(at_stack, bt_stack, tuple(sorted({a for m in present for a in m.adapters})))

    def pair(self, adapter: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(A `[r, in]`, scaled B `[out, r]`) of `adapter` as stored (rank zero-padded to the layer's largest)."""
        return self.at_stack[adapter].T, self.bt_stack[adapter].T

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> None:
        ctx = current()
        if ctx is None:
            return
        rows = x.reshape(-1, self.in_features)  # [T, in]
        target = out.view(-1, out.shape[-1])  # [T, out], a view (raises rather than add into a copy)
        if rows.shape[0] != ctx.num_rows:
            raise RuntimeError(f"a LoRA layer got {rows.shape[0]} rows in a step of {ctx.num_rows}: only layers "
                               "that see every row of the step can carry an adapter")
        if ctx.graphed:
            self._add_masked(rows, target, ctx.row_adapter, self.a_columns, self.bt_stack.view(-1, self.out_features),
                             self.column_adapter)
            return
        runs = ctx.adapter_runs
        if not runs:
            return
        if len(runs) <= SLICED_RUNS:
            for adapter, start, end in runs:
                _add_product(target[start:end], rows[start:end].float() @ self.at_stack[adapter], self.bt_stack[adapter])
            return
        self._add_grouped(rows, target, ctx.padded_groups)

    def _add_masked(self, rows: torch.Tensor, target: torch.Tensor, row_adapter: torch.Tensor, a_columns: torch.Tensor,
                    b_rows: torch.Tensor, column_adapter: torch.Tensor) -> None:
        """Every row times every adapter's rank columns, each row keeping its own adapter's (a graph's path: nothing
        host-side)."""
        h = rows.float() @ a_columns  # [T, k r]
        h.mul_(row_adapter[:, None] == column_adapter[None, :])
        _add_product(target, h, b_rows)

    def _add_grouped(self, rows: torch.Tensor, target: torch.Tensor, groups: PaddedGroups) -> None:
        """Every adapter's rows at once: two batched products over `k` equal-width groups."""
        if groups.span is not None:
            at, bt = self.at_stack[groups.span[0] : groups.span[1]], self.bt_stack[groups.span[0] : groups.span[1]]
        else:
            at, bt = self.at_stack.index_select(0, groups.adapters), self.bt_stack.index_select(0, groups.adapters)
        x = rows.index_select(0, groups.rows).view(at.shape[0], groups.width, self.in_features)  # [k, m, in]
        delta = torch.bmm(torch.bmm(x.float(), at), bt).view(-1, self.out_features)  # [k * m, out] float32
        if groups.padding is not None:
            delta.masked_fill_(groups.padding, 0)
        target.index_add_(0, groups.rows, delta.to(target.dtype))  # no-op conversion for a float32 model
