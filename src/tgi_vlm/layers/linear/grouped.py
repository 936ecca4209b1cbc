"""The kernel of a quantized linear layer: its weight as int8 codes with a scale (and offset) per group of inputs.

`GroupedInt8Linear` owns a `GroupedInt8Weight` (tgi_vlm/quantization/grouped.py; a GGUF file's blocks or an on-the-fly
int8 weight) and multiplies with the native op `tgi_vlm::grouped_int8_linear` for up to `NATIVE_MAX_ROWS` rows
(decode steps, the lm-head's last rows), where the codes stream from memory once per product. Above that (prefill
chunks) the weight is de-quantized to the input's dtype a slice of outputs at a time (`DENSE_SLICE_VALUES`, so each
slice is still in cache when torch multiplies by it) and multiplied by torch: the native loop does two float32 FMAs
per 32 weights per row and runs out of FMA throughput long before torch's AMX / AVX-512 products do.
benchmarks/grouped_kernels.py on a 2-core Xeon with AMX, bf16 rows (ms, native / sliced): a 4096 x 640 weight at 16
rows 0.35 / 0.67, 32 rows 0.37 / 0.69, 64 rows 2.26 / 0.82; the 262,144 x 640 head at 16 rows 22.6 / 42.4, 32 rows
25.0 / 58.0, 64 rows 149.4 / 72.8 (results/grouped_kernels.md).
On a CPU with AMX, bf16 products of 12..32 rows run on AMX tiles inside the op (each 16 x 32 piece of the weight
de-quantized to bf16 just before its tile product, as a bf16 model holds it): the figures above. Without the native library (no AVX-512) every product takes the sliced path through
torch's de-quantization: slower, never wrong.

bf16 inputs therefore meet the weight at two precisions, by row count: below 12 rows (the FMA loop) the format's
exact float32 weight, at 12..32 rows (AMX) and above 32 (sliced, torch's bf16 product) the weight rounded to bf16, as
transformers' bf16 model of the de-quantized checkpoint holds it. A request's bf16 logits can so move by a bf16
rounding with the size of the batch it decodes in (float32 inputs: exact weights on every path). The bias is added
after the native product (in bf16: a second rounding).

A weight stored in activation order (GPTQ `desc_act`, `GroupedInt8Weight.input_order`) takes x's columns gathered
in that order first; siblings fuse only when their orders are equal (GPTQ sorts by the shared input's statistics, so
q/k/v and gate/up usually agree).

Sibling projections fuse (q/k/v, gate/up) when their groups agree: the codes, scales and offsets are concatenated
along the outputs, which is exact (rows of W are independent).

Where the native product computes the layer, codes of 4 or 5 bits are held packed (`PACK_CODES`;
quantization/packed_codes.py), two to a byte, and the packed ops unpack them in registers: the same sums, bit for
bit, from 0.5-0.625 bytes per code instead of 1 (decode products are bound by memory). Packing needs inputs in
multiples of 32 and AVX512-BW/VL; elsewhere codes stay int8.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tgi_vlm.kernels.cpu import ops
from tgi_vlm.layers.linear.kernels import LinearKernel, PlainWeights
from tgi_vlm.quantization.grouped import GroupedInt8Weight
from tgi_vlm.quantization.packed_codes import PackedCodes

NATIVE_MAX_ROWS = 32
PACK_CODES = True  # hold 4- / 5-bit codes packed where the packed ops load (benchmarks/switch_ab.py flips it)
DENSE_SLICE_VALUES = 1 << 22  # weights de-quantized at a time above NATIVE_MAX_ROWS (8 MB of bf16)


def grouped_native_available(kernels=None) -> bool:
    """Whether the native grouped product loads here (the avx512 library: AVX-512 and a C compiler)."""
    from tgi_vlm.config import KernelSettings
    from tgi_vlm.kernels import cpu as cpu_kernels

    return cpu_kernels.load(kernels or KernelSettings()).available("grouped_int8_linear")


def packed_native_available(kernels=None) -> bool:
    """Whether the packed products load here too (AVX512-BW/VL besides the grouped product)."""
    from tgi_vlm.config import KernelSettings
    from tgi_vlm.kernels import cpu as cpu_kernels

    return cpu_kernels.load(kernels or KernelSettings()).available("grouped_packed_linear")


def quantized_weight_of(module: torch.nn.Module) -> GroupedInt8Weight | None:
    """The quantized weight a loader attached to `module` for the plan to hand to its kernel, if any."""
    return getattr(module, "quantized_weight", None)


class GroupedInt8Linear(LinearKernel):
    """x W^T + b with W a `GroupedInt8Weight` (the layer's parameter is an empty placeholder on the meta device)."""

    def __init__(self, source: PlainWeights, weight: GroupedInt8Weight, *, native: bool):
        super().__init__(source)
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(f"a {weight.source} weight {weight.shape} for a layer of "
                             f"{(self.out_features, self.in_features)}")
        self.weight = weight
        self.bias = source.bias()
        self.native = native and weight.group % 16 == 0
        if self.native and PACK_CODES and self.in_features % 32 == 0 and packed_native_available():
            weight.store_packed()  # in place: an embedding sharing the weight reads the packed codes too
        packing = f"+packed{weight.codes.bits}" if isinstance(weight.codes, PackedCodes) else ""
        self.name = f"int8-grouped({weight.source}){'+native' if self.native else ''}{packing}"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.weight.input_order is not None:  # columns in the stored (activation) order
            flat = flat.index_select(1, self.weight.input_order)
        rows = flat.shape[0]
        if self.native and 1 <= rows <= NATIVE_MAX_ROWS and x.dtype in (torch.float32, torch.bfloat16):
            w = self.weight
            if isinstance(w.codes, PackedCodes):
                out = ops.grouped_packed_linear(flat.contiguous(), w.codes.nibbles, w.codes.high, w.codes.zero,
                                                w.scales, w.offsets, w.group)
            else:
                out = ops.grouped_int8_linear(flat.contiguous(), w.codes, w.scales, w.offsets, w.group)
            if self.bias is not None:
                out += self.bias
        else:
            out = self._sliced_product(flat)
        return out.view(*x.shape[:-1], self.out_features)

    def _sliced_product(self, flat: torch.Tensor) -> torch.Tensor:
        w = self.weight
        step = max(16, DENSE_SLICE_VALUES // self.in_features)
        parts = []
        for start in range(0, self.out_features, step):
            part = slice(start, start + step)
            offsets = None if w.offsets is None else w.offsets[part]
            if self.native and flat.dtype in (torch.float32, torch.bfloat16) and isinstance(w.codes, PackedCodes):
                codes = w.codes.rows(part)
                dense = ops.grouped_packed_dequantize(codes.nibbles, codes.high, codes.zero, w.scales[part], offsets,
                                                      w.group, flat.dtype)
            elif self.native and flat.dtype in (torch.float32, torch.bfloat16):
                dense = ops.grouped_int8_dequantize(w.codes[part], w.scales[part], offsets, w.group, flat.dtype)
            else:
                dense = w.dequantize(rows=part, stored_order=True).to(flat.dtype)
            parts.append(F.linear(flat, dense, None if self.bias is None else self.bias[part]))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def fuses(self) -> bool:
        return True

    def same_kind(self, other: LinearKernel) -> bool:
        return (type(other) is type(self) and other.native == self.native and other.weight.group == self.weight.group
                and (other.weight.offsets is None) == (self.weight.offsets is None)
                and _same_order(other.weight.input_order, self.weight.input_order))

    def fused_over(self, source: PlainWeights) -> LinearKernel:
        parts = [m.linear_kernel.weight for m in source.modules]
        sources = sorted({p.source for p in parts})
        packed = [p.codes for p in parts if isinstance(p.codes, PackedCodes)]
        codes = PackedCodes.cat(packed) if len(packed) == len(parts) else None
        fused = GroupedInt8Weight(
            codes=codes if codes is not None else torch.cat([p.int8_codes() for p in parts]), scales=torch.cat([p.scales for p in parts]),
            offsets=None if parts[0].offsets is None else torch.cat([p.offsets for p in parts]),
            group=parts[0].group, source="+".join(sources), input_order=parts[0].input_order)
        return GroupedInt8Linear(source, fused, native=self.native)


def _same_order(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
