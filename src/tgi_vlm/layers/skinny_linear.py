"""Float32 linears for decode-sized row counts, in C (`tgi_vlm::skinny_linear`, kernels/cpu/csrc/skinny_linear.c;
part of layers/cpu.py's speed-ups).

A decode step's linears are as fast as the weights stream from memory. On the 2-core host measured, MKL's packed
float32 kernel streams the bench model's 48 decode products at ~13-15 GB/s for 13 rows, the native loop at ~21-23 GB/s
(26.8 -> 17.3 ms for all of them, weights cold as in a serving step; `benchmarks/skinny_linear.py`). It is used for
1..`MAX_ROWS` rows; more rows (prefill) stay on MKL's packed GEMM, where compute, not streaming, is the limit.

It needs its own copy of each weight, in a layout where one 64-byte load holds 16 output columns' weights for one
input position (`ops.blocked_weight`), so it is made only where `layers/cpu.py`'s rule for a second copy of the float32
weights allows it (at most 1/16 of the machine's memory: the bench model's 380 MB on 24 GB), where
`KernelSettings.skinny_linear` is on and the kernel loads (CPUs with AVX-512). Sums are float32, in another order than
MKL's (within float32 rounding: tests/unit/test_skinny_linear.py holds each output to the worst-case bound of its
summation order against float64, and the typical error to 3x MKL's own).
"""

from __future__ import annotations

import torch

from tgi_vlm.config import KernelSettings
from tgi_vlm.kernels import cpu as cpu_kernels
from tgi_vlm.kernels.cpu import ops

# Up to this many rows the native loop was faster than MKL's packed kernel on every row count measured
# (benchmarks/results/skinny_linear.md: 24 rows 0.85 of MKL's time; 32 rows 0.98 there, 1.09 in an earlier run).
MAX_ROWS = 24


class BlockedWeight:
    """A weight in a native product's blocked layout (`blocked`), for 1..`max_rows` rows through `product`
    (`ops.skinny_linear` or `ops.skinny_linear_bf16`)."""

    product = staticmethod(ops.skinny_linear)

    def __init__(self, weight: torch.Tensor, blocked: torch.Tensor, max_rows: int):
        self.out_features = weight.shape[0]
        self.blocked = blocked
        self.max_rows = max_rows

    def takes(self, rows: int) -> bool:
        return 1 <= rows <= self.max_rows

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x` `[..., in]` with `takes(rows)` -> `[..., out]`."""
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out = self.product(flat, self.blocked, self.out_features, bias)
        return out.view(*x.shape[:-1], self.out_features)


class SkinnyWeight(BlockedWeight):
    """A float32 weight in the native loop's layout; `max_rows`: the most rows it multiplies (at most the kernel's)."""

    def __init__(self, weight: torch.Tensor, max_rows: int):
        super().__init__(weight, ops.blocked_weight(weight), min(MAX_ROWS, max_rows))


def skinny_available(kernels: KernelSettings | None = None) -> bool:
    """Whether float32 decode products may use the native loop: `kernels.skinny_linear` on (None: the defaults, on)
    and the kernel there (a C compiler, AVX-512, x86-64 Linux); built on first use."""
    kernels = kernels or KernelSettings()
    return kernels.skinny_linear and cpu_kernels.load(kernels).available("skinny_linear") and ops.skinny_max_rows() >= 1


def skinny_weight(weight: torch.Tensor, kernels: KernelSettings | None = None) -> SkinnyWeight | None:
    """The native copy of a float32 CPU `weight`, or None where `skinny_available(kernels)` says no."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or not skinny_available(kernels):
        return None
    return SkinnyWeight(weight, ops.skinny_max_rows())


# Up to this many rows the bf16 loop (AVX512-BF16 pair products) streamed faster than oneDNN's packed kernel on the
# AMX host (Gemma 3 270M's shapes, bf16: 262,144 x 640 at 1/2/4 rows 12.6/12.3/14.3 vs 16.7/15.2/16.0 ms, 6 rows
# even, 8 rows 18.3 vs 15.4; 640 x 1024 at 1 row 0.053 vs 0.076 ms): past it, the loop is compute-bound.
BF16_MAX_ROWS = 4
# On AMX tiles the same copy serves short prefills too (16-row tiles, two at a time, over each pair of column blocks
# while it is in cache), without building anything per row count. `benchmarks/results/bf16_products.md` (Gemma 3
# 270M's 72 decoder products, weights cold, and its head): faster than oneDNN's packed product up to 64 rows (1/16/64
# rows 8.4/8.8/14.4 ms vs 11.2/11.6/15.6; head 11.2/12.7/26.7 vs 13.4/14.6/34.9), slower at 128 and 256 (41.1 / 43.0
# vs 32.2 / 37.1 ms); past AMX_MAX_ROWS, oneDNN.
AMX_MAX_ROWS = 64


class SkinnyBf16Weight(BlockedWeight):
    """A bfloat16 weight in the bf16 loop's layout (`ops.blocked_weight_bf16`), for 1..`max_rows` rows: AMX's
    `AMX_MAX_ROWS` where the tiles take this width (a multiple of 32), else the AVX512-BF16 loop's `BF16_MAX_ROWS`."""

    product = staticmethod(ops.skinny_linear_bf16)

    def __init__(self, weight: torch.Tensor):
        amx = min(AMX_MAX_ROWS, ops.amx_max_rows()) if weight.shape[1] % 32 == 0 else 0
        super().__init__(weight, ops.blocked_weight_bf16(weight),
                         max(min(BF16_MAX_ROWS, ops.skinny_bf16_max_rows()), amx))


def skinny_bf16_available(kernels: KernelSettings | None = None) -> bool:
    """Whether bf16 decode products may use the native bf16 loop: `kernels.skinny_linear` on and the loop built here
    (AVX-512 with its BF16 extension)."""
    kernels = kernels or KernelSettings()
    return (kernels.skinny_linear and cpu_kernels.load(kernels).available("skinny_linear_bf16")
            and ops.skinny_bf16_max_rows() >= 1)
