"""The modules whose products are planned kernels: linear layers and patch-embedding convolutions.

The plan (plan.py) turns each `nn.Linear` of the model into a `KernelLinear` by changing the instance's class
(`module.__class__`), not by replacing the module or patching its forward: the instance keeps its parameters
(names, dtypes, tensor-parallel DTensors, weights tied to other modules), its hooks and its place in the model,
and `isinstance(m, nn.Linear)` still holds. What it gains is one owner for its product: `linear_kernel`, and an
optional per-layer `extra` term (a LoRA delta) that runs in every path, the fused and lean ones included.
"""

from __future__ import annotations

import torch

from tgi_vlm.layers.linear.kernels import LinearExtra, LinearKernel


class KernelLinear(torch.nn.Linear):
    """An `nn.Linear` computed by its planned kernel (`linear_kernel`), plus its `extra` term if any."""

    linear_kernel: LinearKernel
    extra: LinearExtra | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_kernel.run(x, self.extra)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kernel={self.linear_kernel.name}"


def give_kernel(module: torch.nn.Linear, kernel: LinearKernel) -> KernelLinear:
    """Make `module` (exactly an `nn.Linear`, or already a `KernelLinear`) compute through `kernel`."""
    if type(module) is torch.nn.Linear:
        module.__class__ = KernelLinear
    elif type(module) is not KernelLinear:
        raise TypeError(f"only torch.nn.Linear layers take a planned kernel, not {type(module).__name__}")
    module.linear_kernel = kernel
    return module


class _PatchConvMixin:
    """A stride = kernel, unpadded convolution (a patch embedding) whose input is exactly one kernel computes one
    matrix product; as a convolution it is ~30x slower on CPU. That product goes through `patch_kernel`; any other
    input convolves as before."""

    patch_kernel: LinearKernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[2:]) != tuple(self.kernel_size):
            return self._conv_forward(x, self.weight, self.bias)
        out = self.patch_kernel(x.reshape(x.shape[0], -1))
        return out.view(x.shape[0], self.out_channels, *([1] * len(self.kernel_size)))


class PatchConv2d(_PatchConvMixin, torch.nn.Conv2d):
    pass


class PatchConv3d(_PatchConvMixin, torch.nn.Conv3d):
    pass


PATCH_CLASSES: dict[type, type] = {torch.nn.Conv2d: PatchConv2d, torch.nn.Conv3d: PatchConv3d}


def is_patch_embedding(module: torch.nn.Module) -> bool:
    """A plain Conv2d/Conv3d with stride = kernel, no padding, groups or dilation: one output per patch."""
    return (type(module) in PATCH_CLASSES and module.stride == module.kernel_size and module.groups == 1
            and not any(module.padding) and all(d == 1 for d in module.dilation) and module.padding_mode == "zeros")


def give_patch_kernel(module: torch.nn.Module, kernel: LinearKernel) -> torch.nn.Module:
    module.__class__ = PATCH_CLASSES[type(module)]
    module.patch_kernel = kernel
    return module
