"""Sibling projections of one input as one matrix product, on CPU (part of layers/cpu.py's speed-ups).

transformers' decoder layers project the same hidden states three times for attention
(`q_proj`, `k_proj`, `v_proj`) and twice for the MLP (`gate_proj`, `up_proj`). On a 2-core CPU each
product is a separate oneDNN call with its own overhead, and small outputs use the cores poorly:
the bench model's 84 decode linears take 10.9 ms at 13 rows as separate products and 9.9 ms as 48
fused ones; at 256 prefill rows 26.5 vs 22.9 ms (benchmarks/results/cpu-profile.md).

How, without touching transformers' modules: the group's weights are concatenated and packed once
(lazily, on the model thread, like `pack_linear_weights`); each member's forward asks the group for
its output. The first member called with an input computes every member's output for it in one
product and keeps them until each member has taken its own; a member called with another input
(a pattern the text decoders do not have) recomputes the group for that input, so results stay right
whatever the call order. Each output is a column slice (a view) of the fused product: the same dot
products as the separate layers, possibly summed in another order by oneDNN's blocking (float32
parity holds to 1e-4; bf16 parity is checked with its near-tie rule).

Only the language model's layers are fused (vision towers have other patterns, e.g. Idefics2's
perceiver projects queries and keys from different inputs).
"""

from __future__ import annotations

import types

import torch

from tgi_vlm.layers.cpu import PACKED_DTYPES, PackedWeight, can_pack_weights

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_GROUPS_ATTR = "_tgi_vlm_fused_projections"  # on the owning module: {member names: FusedProjections}


class FusedProjections:
    def __init__(self, members: list[torch.nn.Linear], *, decode_copy: bool = False):
        self.members = members
        self.widths = [m.out_features for m in members]
        self.decode_copy = decode_copy
        self.weight: PackedWeight | None = None
        self.bias: torch.Tensor | None = None
        self._input: torch.Tensor | None = None
        self._outputs: list[torch.Tensor] = []
        self._untaken: set[int] = set()

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self._input:
            self._compute(x)
        out = self._outputs[index]
        self._untaken.discard(index)
        if not self._untaken:  # every member has its output: hold nothing between layers
            self._input, self._outputs = None, []
        return out

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The whole group's product for `x` (`[..., sum(widths)]`), for a caller that slices it itself
        (layers/cpu_decoder.py); the members' outputs are its column blocks in member order."""
        if self.weight is None:
            self._pack()
        return self.weight(x, self.bias)

    def _compute(self, x: torch.Tensor) -> None:
        out = self.product(x)
        self._outputs = list(out.split(self.widths, dim=-1))
        self._input = x
        self._untaken = set(range(len(self.members)))

    def _pack(self) -> None:
        """On first use, on the model thread (see layers/cpu.py `_pack`); the members' plain weights are
        released (the parameters keep their dtype and names)."""
        self.weight = PackedWeight(torch.cat([m.weight.detach() for m in self.members]), decode_copy=self.decode_copy)
        if self.members[0].bias is not None:
            self.bias = torch.cat([m.bias.detach() for m in self.members])
        for m in self.members:
            m.weight.data = m.weight.data.new_empty(0)


def _member_forward(group: FusedProjections, index: int):
    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return group.output(index, x)

    return forward


def _fusable(members: list) -> bool:
    first = members[0]
    return (all(type(m) is torch.nn.Linear for m in members)
            and first.weight.dtype in PACKED_DTYPES
            and all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
                    and m.weight.device == first.weight.device for m in members)
            and len({m.bias is None for m in members}) == 1)


def fuse_sibling_projections(language_model: torch.nn.Module, *, decode_copy: bool = False) -> int:
    """Give every q/k/v and gate/up group of `language_model` one fused, packed product (see above).
    Weights another module shares are left alone. `decode_copy`: as `pack_linear_weights`. Returns
    the number of groups fused."""
    if not can_pack_weights():
        return 0
    owners: dict[int, int] = {}
    for module in language_model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    count, taken = 0, set()
    for module in language_model.modules():
        for names in GROUPS:
            members = [getattr(module, name, None) for name in names]
            if any(m is None for m in members) or not _fusable(members):
                continue
            if any(owners.get(id(m.weight), 0) != 1 or id(m) in taken for m in members):
                continue  # a weight or a layer shared with another module: left alone
            taken.update(id(m) for m in members)
            group = FusedProjections(members, decode_copy=decode_copy)
            module.__dict__.setdefault(_GROUPS_ATTR, {})[names] = group
            for index, m in enumerate(members):
                m.forward = types.MethodType(_member_forward(group, index), m)
            count += 1
    return count


def fused_group(module: torch.nn.Module, names: tuple[str, ...]) -> FusedProjections | None:
    """The group `fuse_sibling_projections` made of `module`'s `names` projections, if it did."""
    return module.__dict__.get(_GROUPS_ATTR, {}).get(names)


def fused_groups(model: torch.nn.Module) -> list[FusedProjections]:
    """Every group `fuse_sibling_projections` made inside `model`."""
    return [group for module in model.modules() for group in module.__dict__.get(_GROUPS_ATTR, {}).values()]
