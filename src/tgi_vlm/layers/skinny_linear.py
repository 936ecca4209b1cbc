"""Float32 linears for decode-sized row counts, in C (attention/native/skinny_linear.c; part of layers/cpu.py's speed-ups).

A decode step's linears are as fast as the weights stream from memory. On the 2-core host measured, MKL's packed
float32 kernel streams the bench model's 48 decode products at ~13-15 GB/s for 13 rows, the native loop at ~21-23 GB/s
(26.8 -> 17.3 ms for all of them, weights cold as in a serving step; `benchmarks/skinny_linear.py`). It is used for
1..`MAX_ROWS` rows; more rows (prefill) stay on MKL's packed GEMM, where compute, not streaming, is the limit.

It needs its own copy of each weight, in a layout where one 64-byte load holds 16 output columns' weights for one
input position (`blocked_weight`), so it is made only where `layers/cpu.py`'s rule for a second copy of the float32
weights allows it (at most 1/16 of the machine's memory: the bench model's 380 MB on 24 GB), on CPUs with AVX-512
where the native library builds. Sums are float32, in another order than MKL's (within float32 rounding:
tests/unit/test_skinny_linear.py holds each output to the worst-case bound of its summation order against float64,
and the typical error to 3x MKL's own).
"""

from __future__ import annotations

import torch

from tgi_vlm.layers.attention import native_decode

# Up to this many rows the native loop was faster than MKL's packed kernel on every row count measured
# (benchmarks/results/skinny_linear.md: 24 rows 0.85 of MKL's time; 32 rows 0.98 there, 1.09 in an earlier run).
MAX_ROWS = 24
ENABLED = True  # benchmarks/cpu_paths.py turns it off to measure what it buys (read when a weight is packed)


def blocked_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` `[out, in]` as `[ceil(out / 32) * 2, in, 16]`: blocks of 16 output columns, each input-position-major;
    columns past `out` are zero. Contiguous and 64-byte aligned (the C loop's aligned loads)."""
    out_features, in_features = weight.shape
    padded = -(-out_features // 32) * 32
    blocked = torch.zeros(padded // 16, in_features, 16, dtype=torch.float32)
    if blocked.data_ptr() % 64:  # torch's CPU allocator aligns to 64 bytes; anything else would fault in the C loop
        raise RuntimeError("skinny_linear: the allocator returned memory not aligned to 64 bytes")
    source = torch.zeros(padded, in_features, dtype=torch.float32)
    source[:out_features] = weight
    blocked.copy_(source.view(padded // 16, 16, in_features).transpose(1, 2))
    return blocked


class SkinnyWeight:
    """A float32 weight in the native loop's layout, with the library that multiplies by it."""

    def __init__(self, library: native_decode.NativeDecodeAttention, weight: torch.Tensor):
        self.library = library
        self.out_features = weight.shape[0]
        self.blocked = blocked_weight(weight)
        self.max_rows = min(MAX_ROWS, library.linear_max_rows)

    def takes(self, rows: int) -> bool:
        return 1 <= rows <= self.max_rows

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x` `[..., in]` with `takes(rows)` -> `[..., out]`."""
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        return self.library.skinny_linear(flat, self.blocked, self.out_features, bias).view(*x.shape[:-1],
                                                                                            self.out_features)


def skinny_weight(weight: torch.Tensor) -> SkinnyWeight | None:
    """The native copy of a float32 `weight`, or None where the library is not there (no compiler, no AVX-512,
    not x86-64 Linux) or `ENABLED` is off."""
    if not ENABLED or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    library = native_decode.load()
    if library is None or library.linear_max_rows < 1:
        return None
    return SkinnyWeight(library, weight)
