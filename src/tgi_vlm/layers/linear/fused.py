"""Sibling projections of one input as one matrix product (q/k/v; gate/up), on CPU.

transformers' decoder layers project the same hidden states three times for attention and twice for the MLP.
On a 2-core CPU each product is a separate call with its own overhead, and small outputs use the cores poorly:
the bench model's 84 decode linears take 10.9 ms at 13 rows as separate products and 9.9 ms as 48 fused ones; at
256 prefill rows 26.5 vs 22.9 ms (benchmarks/results/cpu-profile.md).

A group exists when every member's planned kernel `fuses()` and they agree in kind, input width, dtype and bias
(`kernels.same_inputs`): the group's kernel is one kernel of that kind over the concatenated weights (packed
lazily on the model thread like any packed kernel; the members' plain weights are released then). Each member's
kernel becomes a `FusedMember`: the first member called with an input computes the whole group's product for it
and keeps the column blocks until each member has taken its own; a member called with another input (a pattern
the text decoders do not have) recomputes the group for that input, so results stay right whatever the call
order. Every member's `extra` term is added into its own column block of the product (`FusedProjections.product`),
or the group's own `extra` for the whole product instead when it has one (the members' LoRA terms as one,
lora/delta.py), so the lean layer (layers/cpu_decoder.py), which slices the product itself, gets them too.
"""

from __future__ import annotations

import torch

from tgi_vlm.layers.linear.kernels import LinearExtra, LinearKernel, PlainWeights
from tgi_vlm.layers.linear.modules import KernelLinear

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedProjections:
    """One product for sibling linears of one input; `kernel` owns the concatenated weight."""

    def __init__(self, members: list[KernelLinear], kernel: LinearKernel):
        self.members = members
        self.kernel = kernel
        self.widths = [m.out_features for m in members]
        # A term for the whole product, added instead of the members' own (e.g. the members' LoRA deltas as one,
        # lora/delta.py `LoraDelta.fused`): its value must equal the members' terms added into their column blocks.
        self.extra: LinearExtra | None = None
        self._input: torch.Tensor | None = None
        self._outputs: list[torch.Tensor] = []
        self._untaken: set[int] = set()

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The whole group's output for `x` (`[..., sum(widths)]`, members' extra terms included); the members'
        outputs are its column blocks in member order."""
        out = self.kernel(x)
        if self.extra is not None:
            self.extra.add_to(x, out)
            return out
        start = 0
        for member, width in zip(self.members, self.widths):
            extra: LinearExtra | None = member.extra
            if extra is not None:
                extra.add_to(x, out[..., start : start + width])
            start += width
        return out

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self._input:
            self._outputs = list(self.product(x).split(self.widths, dim=-1))
            self._input = x
            self._untaken = set(range(len(self.members)))
        out = self._outputs[index]
        self._untaken.discard(index)
        if not self._untaken:  # every member has its output: hold nothing between layers
            self._input, self._outputs = None, []
        return out


class FusedMember(LinearKernel):
    """A member's view of its group: its column block of the group's product."""

    def __init__(self, group: FusedProjections, index: int):
        super().__init__(PlainWeights((group.members[index],)))
        self.group, self.index = group, index
        self.name = f"fused({group.kernel.name})"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(self.index, x)

    def run(self, x: torch.Tensor, extra: LinearExtra | None) -> torch.Tensor:
        return self.group.output(self.index, x)  # the group's product added every member's extra term

    @property
    def ready(self) -> bool:
        return self.group.kernel.ready


def fuse(members: list[KernelLinear]) -> FusedProjections:
    """One group over `members` (their kernels fuse and agree: `kernels.same_inputs`)."""
    kernel = members[0].linear_kernel.fused_over(PlainWeights(tuple(members)))
    group = FusedProjections(members, kernel)
    for index, member in enumerate(members):
        member.linear_kernel = FusedMember(group, index)
    return group


def fused_group(module: torch.nn.Module, names: tuple[str, ...]) -> FusedProjections | None:
    """The group made of exactly `module`'s `names` projections, in that order, if there is one."""
    members = [getattr(module, name, None) for name in names]
    kernels = [getattr(m, "linear_kernel", None) for m in members]
    if not all(isinstance(k, FusedMember) for k in kernels):
        return None
    group = kernels[0].group
    if group.members != members or [k.index for k in kernels] != list(range(len(names))):
        return None
    return group


def fused_groups(model: torch.nn.Module) -> list[FusedProjections]:
    """Every group inside `model`, each once."""
    groups: dict[int, FusedProjections] = {}
    for module in model.modules():
        kernel = getattr(module, "linear_kernel", None)
        if isinstance(kernel, FusedMember):
            groups.setdefault(id(kernel.group), kernel.group)
    return list(groups.values())
