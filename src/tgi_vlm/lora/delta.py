"""`LoraDelta`: one linear layer's LoRA term for every loaded adapter, added to the layer's output row by row.

For adapter i targeting the layer, peft's merged weight is `W + scale_i B_i A_i`; for a row of adapter i the
layer's output is `x W^T + (x A_i^T)(scale_i B_i)^T`. Stored: `a[i]` `[r_i, in]` and `b[i]` = `scale_i B_i`
`[out, r_i]` (scale folded at load) in the model's dtype and device; index 0 (the base model) and adapters that do
not target this layer have none, and cost nothing.

Eager steps: the step context (layers/step_context.py) groups rows by adapter; per adapter with rows, two small
products over its rows — contiguous runs through slices (`addmm_` into the output view), scattered rows through
`index_select` / `index_add_`. A captured CUDA graph cannot change its grouping between replays, so inside one the
adapters are stacked (`a_all` `[R, in]`, `b_all` `[out, R]`, R the sum of ranks) and each row's rank columns are
kept by a mask read from the static adapter-index buffer (`row_adapter`): one pair of products for every adapter,
exact (the other adapters' columns are multiplied by 0).

`add_to` writes into `out` in place, which may be a column block of a fused q/k/v or gate/up product
(layers/linear/fused.py): the lean layers read that product directly. Outside the engine's language-model forward
(no step context: plain transformers, the vision tower) it adds nothing.
"""

from __future__ import annotations

import torch

from tgi_vlm.layers.step_context import current


class LoraDelta:
    """The `LinearExtra` of one layer: `a`/`b` by adapter index (see the module docstring)."""

    def __init__(self, pairs: dict[int, tuple[torch.Tensor, torch.Tensor]], in_features: int, out_features: int):
        self.a = {i: a for i, (a, _) in pairs.items()}  # [r_i, in]
        self.b = {i: b for i, (_, b) in pairs.items()}  # [out, r_i], scale folded in
        self.in_features, self.out_features = in_features, out_features
        order = sorted(pairs)
        self.a_all = torch.cat([self.a[i] for i in order])  # [R, in]
        self.b_all = torch.cat([self.b[i] for i in order], dim=1)  # [out, R]
        self.column_adapter = torch.cat([torch.full((self.a[i].shape[0],), i, dtype=torch.long) for i in order]
                                        ).to(self.a_all.device)  # [R]

    @property
    def adapters(self) -> tuple[int, ...]:
        return tuple(sorted(self.a))

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
            keep = ctx.row_adapter[:, None] == self.column_adapter[None, :]  # [T, R]
            target.addmm_((rows @ self.a_all.T) * keep, self.b_all.T)
            return
        for adapter, ranges in ctx.adapter_ranges.items():
            a = self.a.get(adapter)
            if a is None:
                continue
            b = self.b[adapter]
            if len(ranges) == 1:
                start, end = ranges[0]
                target[start:end].addmm_(rows[start:end] @ a.T, b.T)
            else:
                index = _group_rows(ctx, adapter)
                target.index_add_(0, index, (rows.index_select(0, index) @ a.T) @ b.T)


def _group_rows(ctx, adapter: int) -> torch.Tensor:
    for group in ctx.adapter_groups:
        if group.adapter == adapter:
            return group.rows
    raise KeyError(adapter)
