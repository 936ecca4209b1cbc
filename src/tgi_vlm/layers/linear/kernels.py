"""Ways of computing one linear layer's `x @ weight.T + bias`: one class per way, each owning its storage.

A kernel is chosen once per layer at load (`layers/linear/plan.py`) and called by the layer's module
(`layers/linear/modules.py`) for every product. Kernels take their plain weight from a `PlainWeights`
source: the layer's own parameters, a patch convolution's weight seen as a matrix, or the concatenation
of sibling layers' weights (`layers/linear/fused.py`).

| kernel | where (plan.py decides) | storage |
|---|---|---|
| `TorchLinear` | GPU; CPU with the speed-ups off; tensor-parallel ranks; weights that are not plain tensors (a quantized or otherwise subclassed weight) | the layer's parameters, read at every call |
| `BucketedLinear` | CPU, bf16/fp16 weights that cannot be packed (shared with another module, e.g. a tied lm-head; fp16; bf16 on a CPU without AVX-512BW) | the parameters; rows padded to `row_bucket` (`FusedBucketedLinear`: a concatenated copy for a fused group) |
| `OneDnnPackedLinear` | CPU, bf16 (and float32 on a torch without MKL) | oneDNN's blocked copy; the plain weight released |
| `OneDnnPackedSkinnyLinear` | CPU, bf16, with the native bf16 product for few rows (AMX: 1..64; AVX512-BF16: 1..4) where it loads and memory allows a second copy | oneDNN's copy + the native blocked copy |
| `MklPackedLinear` | CPU, float32 where torch has MKL's packed GEMM | MKL's packed copy; plain weight released |
| `MklSkinnyLinear` | as MKL, plus the native decode loop for 1..24 rows where the library loads and memory allows a second copy | MKL's packed copy + the native loop's blocked copy |

A weight another module shares (a tied lm-head, whose weight is also the token embedding) gets the packed kernel
its dtype gets where memory allows a second copy (`keeps_plain`: the plain weight is not released, its other
owner still reads it): a tied 262,144 x 640 float32 lm-head, one row, F.linear 57.8 ms vs oneDNN's packed copy
31.7 ms; 16 rows 190.5 vs 68.6 ms (AMD EPYC, 2 cores, benchmarks/results/linear_kernels-*.md).

Why packed kernels pack lazily, on first use: weights packed on another thread than the one that runs the
model (the loading one) made a bf16 decode step 1.6x slower (39 vs 25 ms). Why oneDNN's rows are padded:
oneDNN builds (JIT) a kernel per (rows, in, out) shape; prefill steps bring a new row count almost every
step, so rows are padded to a few bucket sizes (`row_bucket`), padded rows dropped from the output (a row's
result does not depend on other rows). MKL builds nothing per row count, so its rows are not padded.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F
from loguru import logger

from tgi_vlm.layers.padding import zero_padded


class LinearExtra(Protocol):
    """A per-layer term added to a linear layer's output in every path (plain, packed, fused, the lean layer):
    e.g. a LoRA delta. `add_to` adds, in place, its term for input `x` `[..., in]` into `out` `[..., out]`
    (which may be a column block of a fused product)."""

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class PlainWeights:
    """Where a kernel reads its plain `[out, in]` weight and bias: one layer's parameters, a patch convolution's
    weight seen as a matrix (`as_matrix`), or several sibling layers' weights concatenated along the outputs."""

    modules: tuple[torch.nn.Module, ...]
    as_matrix: bool = False  # a convolution whose input is exactly one kernel: [out, C * prod(kernel)]

    @property
    def shape(self) -> tuple[int, int]:
        first = self.modules[0]
        return sum(m.weight.shape[0] for m in self.modules), first.weight[0].numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.modules[0].weight.dtype

    @property
    def has_bias(self) -> bool:
        return self.modules[0].bias is not None

    def weight(self) -> torch.Tensor:
        """The plain weight (the parameter itself for one layer; a new concatenated tensor for several)."""
        if len(self.modules) == 1:
            weight = self.modules[0].weight
            return weight.reshape(weight.shape[0], -1) if self.as_matrix else weight
        return torch.cat([m.weight.detach() for m in self.modules])

    def bias(self) -> torch.Tensor | None:
        if not self.has_bias:
            return None
        return self.modules[0].bias if len(self.modules) == 1 else torch.cat([m.bias.detach() for m in self.modules])

    def release(self) -> None:
        """Drop the parameters' plain storage once a kernel holds its own copy (each keeps its dtype and name; a
        convolution keeps its weight for inputs larger than one kernel)."""
        if self.as_matrix:
            return
        for module in self.modules:
            module.weight.data = module.weight.data.new_empty(0)


class LinearKernel:
    """One way of computing `x @ weight.T + bias` for one layer (or one fused group of layers)."""

    name: ClassVar[str] = "linear"
    pads_rows: ClassVar[bool] = False  # builds a kernel per row count (oneDNN): warmup primes its buckets

    def __init__(self, source: PlainWeights):
        self.source = source
        self.out_features, self.in_features = source.shape
        self.dtype = source.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `[..., in]` -> `[..., out]`."""
        raise NotImplementedError

    def run(self, x: torch.Tensor, extra: LinearExtra | None) -> torch.Tensor:
        """The layer's output: the product, plus the layer's extra term when it has one."""
        out = self(x)
        if extra is not None:
            extra.add_to(x, out)
        return out

    @property
    def ready(self) -> bool:
        """Whether its storage exists (packed kernels pack on first use)."""
        return True

    def builds_for(self, rows: int) -> bool:
        """Whether a product of `rows` rows builds (JITs) a kernel of its own on first use: what warmup primes."""
        return self.pads_rows

    def fuses(self) -> bool:
        """Whether sibling layers with this kernel may share one product of the same kind (`fused_over`)."""
        return False

    def fused_over(self, source: PlainWeights) -> LinearKernel:
        """A kernel of this kind and these options over `source` (several layers' weights concatenated)."""
        raise TypeError(f"{self.name} kernels do not fuse")

    def same_kind(self, other: LinearKernel) -> bool:
        return type(other) is type(self)


class TorchLinear(LinearKernel):
    """`F.linear` on the layer's own parameters, read at every call (tensor-parallel DTensors, tied weights and
    weight subclasses stay what their owners made them)."""

    name = "torch"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.source.weight(), self.source.bias())


def row_bucket(rows: int) -> int:
    """The padded row count: exact up to 32 rows (decode batches); above, a multiple of 32 or of
    1/8 of the power of two below `rows`, whichever is larger: at most 12.5% padding past 256 rows,
    8 sizes per doubling (63 sizes up to 2048 rows)."""
    if rows <= 32:
        return rows
    step = max(32, (1 << (rows.bit_length() - 1)) // 8)
    return -(-rows // step) * step


def row_buckets(max_rows: int) -> list[int]:
    """Every padded row count `row_bucket` gives for 1..max_rows, ascending."""
    buckets, rows = [], 1
    while rows <= max_rows:
        bucket = row_bucket(rows)
        buckets.append(bucket)
        rows = bucket + 1
    return buckets


def padded_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`x` as `[rows, in]` with zero rows appended up to `row_bucket(rows)`, and `rows`."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    flat = x.reshape(rows, x.shape[-1])
    padded = row_bucket(rows)
    return (zero_padded(flat, 0, padded) if padded != rows else flat), rows



class BucketedLinear(TorchLinear):
    """`F.linear` on the parameters with rows padded to `row_bucket`: oneDNN's reduced-precision kernels are
    built once per bucket, not once per row count."""

    name = "torch-bucketed"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat, rows = padded_rows(x)
        return F.linear(flat, self.source.weight(), self.source.bias())[:rows].view(*x.shape[:-1], self.out_features)

    def fuses(self) -> bool:
        return not self.source.as_matrix

    def fused_over(self, source: PlainWeights) -> LinearKernel:
        return FusedBucketedLinear(source)


class OwnedLinear(LinearKernel):
    """A kernel that keeps its own (packed or concatenated) copy of the weight, made on first use on the thread that
    runs the model (see the module docstring); the plain parameters are released then."""

    def __init__(self, source: PlainWeights, *, keeps_plain: bool = False):
        super().__init__(source)
        self.bias: torch.Tensor | None = None
        self._packed = False
        # A shared weight (a tied lm-head): its other owner reads the plain parameter, so it is kept.
        self.keeps_plain = keeps_plain
        if keeps_plain:
            self.name = f"{type(self).name}+plain-kept"

    @property
    def ready(self) -> bool:
        return self._packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self._packed:
            self.pack()
        return self._product(x)

    def pack(self) -> None:
        weight = self.source.weight().detach()
        self.bias = self.source.bias()
        self.bias = None if self.bias is None else self.bias.detach()
        self._pack(weight)
        if not self.keeps_plain:
            self.source.release()
        self._packed = True

    def _pack(self, weight: torch.Tensor) -> None:
        raise NotImplementedError

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def fuses(self) -> bool:
        return not self.source.as_matrix

    def fused_over(self, source: PlainWeights) -> LinearKernel:
        return type(self)(source)


class FusedBucketedLinear(OwnedLinear):
    """`BucketedLinear` over sibling layers' weights concatenated once (first use) into a tensor of its own."""

    name = "torch-bucketed"

    def _pack(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        flat, rows = padded_rows(x)
        return F.linear(flat, self.weight, self.bias)[:rows].view(*x.shape[:-1], self.out_features)


class OneDnnPackedLinear(OwnedLinear):
    """oneDNN's blocked weight layout (no reorder per call); rows padded as `BucketedLinear` pads them."""

    name = "onednn-packed"
    pads_rows = True

    def _pack(self, weight: torch.Tensor) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        flat, rows = padded_rows(x)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out[:rows].view(*x.shape[:-1], self.out_features)


class OneDnnPackedSkinnyLinear(OneDnnPackedLinear):
    """bfloat16 through oneDNN's packed copy, and for up to a few hundred rows (decode batches, short prefills, an
    lm-head's last rows) the native bf16 product over a second, blocked copy (layers/skinny_linear.py): AMX tiles for
    1..64 rows where the CPU has them, else the AVX512-BF16 loop for 1..4 rows; it streams the weights ~1.3-1.6x
    faster there."""

    name = "onednn-packed+native-skinny"

    def _pack(self, weight: torch.Tensor) -> None:
        from tgi_vlm.layers.skinny_linear import SkinnyBf16Weight

        super()._pack(weight)
        self.skinny = SkinnyBf16Weight(weight)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if self.skinny.takes(rows):
            return self.skinny(x, self.bias)
        return super()._product(x)

    def builds_for(self, rows: int) -> bool:
        return not self.skinny.takes(rows)  # the native product builds nothing per row count


class OneDnnPackedGemvLinear(OneDnnPackedLinear):
    """float32 through oneDNN (a torch without MKL), keeping the plain weight for one-row products too: MKL's GEMV
    streams it faster than oneDNN's packed kernel (84 decode linears of the bench model 12 vs 15 ms)."""

    name = "onednn-packed+gemv"

    def _pack(self, weight: torch.Tensor) -> None:
        super()._pack(weight)
        self.one_row = weight

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[-1]:
            return F.linear(x, self.one_row, self.bias)
        return super()._product(x)


@functools.cache
def mkl_packs_float32() -> bool:
    """Whether this torch build multiplies float32 with MKL's packed GEMM (`mkl::_mkl_linear`)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


@functools.cache
def cpu_vendor() -> str:
    """This CPU's vendor as /proc/cpuinfo names it ("GenuineIntel", "AuthenticAMD", ...); "" where unreadable."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def mkl_serves_float32() -> bool:
    """Whether float32 products go to MKL's packed GEMM: torch has it and the CPU is Intel's. On other vendors MKL
    dispatches to generic code and its packed product loses to oneDNN's at every row count (AMD EPYC, AVX2, 2 cores,
    Gemma 3 270M's 72 decoder linears: 1 row 26.2 vs 21.6 ms, 4 rows 89.2 vs 31.1, 16 rows 91.9 vs 48.2;
    benchmarks/results/linear_kernels-*.md)."""
    return mkl_packs_float32() and cpu_vendor() == "GenuineIntel"


def can_pack_weights(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build and CPU prepack `dtype` weights for oneDNN: bfloat16 needs AVX512-BW/VL/DQ or
    AVX-NE-CONVERT (oneDNN refuses to reorder a bf16 weight on an AVX2-only CPU, at the first product)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype != torch.bfloat16 or _onednn_bf16()


@functools.cache
def _onednn_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


# The row count MKL packs for. Its packed layout is the same for every count from 2 rows up (checked for the
# shapes served here: bit-equal to packing for the exact count, tests/unit/test_linear_kernels.py), and
# `mkl::_mkl_linear` takes the packed path only when told the count it sees, so each call passes its own.
# MKL does not document that a packed matrix serves other counts, so each product shape is also checked once per
# process when planned (`mkl_layout_agrees`); a shape that disagrees goes to oneDNN.
MKL_PACK_ROWS = 64
_MKL_CHECK_ROWS = (1, 2, 97)
_mkl_layout_checked: dict[tuple[int, int], bool] = {}


def mkl_layout_agrees(out_features: int, in_features: int, weight: torch.Tensor | None = None) -> bool:
    """Whether MKL's packed copy of an `[out, in]` weight multiplies like the weight at row counts other than the one
    it was packed for (float32 rounding apart), once per shape and process. The layout is a property of the shape:
    a random weight is checked unless one is given."""
    key = (out_features, in_features)
    if key not in _mkl_layout_checked:
        generator = torch.Generator().manual_seed(0)
        if weight is None:
            weight = torch.randn(out_features, in_features, generator=generator)
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, MKL_PACK_ROWS)
        _mkl_layout_checked[key] = _packed_multiplies_like(packed, weight, generator)
        if not _mkl_layout_checked[key]:
            logger.warning("MKL's packed float32 product disagreed with F.linear for a {}x{} weight at another row "
                           "count than it was packed for: that shape goes to oneDNN", *key)
    return _mkl_layout_checked[key]


def _packed_multiplies_like(packed: torch.Tensor, weight: torch.Tensor, generator: torch.Generator) -> bool:
    if not packed.is_mkldnn:
        return False
    for rows in _MKL_CHECK_ROWS:
        x = torch.randn(rows, weight.shape[1], generator=generator)
        got = torch.ops.mkl._mkl_linear(x, packed, weight, None, rows)
        if not bool(((got - F.linear(x, weight)).abs() <= 1e-4 * (x.abs() @ weight.abs().T) + 1e-6).all()):
            return False
    return True


class MklPackedLinear(OwnedLinear):
    """float32 through MKL's packed GEMM (`cblas_sgemm_pack` / `_compute` via `mkl::_mkl_linear`): one packed copy
    for every row count, nothing built per shape. Its sums are not always in plain sgemm's order (float32 rounding
    apart)."""

    name = "mkl-packed"

    def _pack(self, weight: torch.Tensor) -> None:
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, MKL_PACK_ROWS)
        # `_mkl_linear` reads only the plain weight's shape and dtype on its packed path: a stand-in without storage
        self.shape_of = weight.new_zeros(()).expand(weight.shape)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        out = torch.ops.mkl._mkl_linear(x.reshape(rows, x.shape[-1]), self.packed, self.shape_of, self.bias, rows)
        return out.view(*x.shape[:-1], self.out_features)


class MklSkinnyLinear(MklPackedLinear):
    """MKL's packed GEMM, and for decode-sized row counts (1..`skinny_linear.MAX_ROWS`) the native loop over a
    second, blocked copy of the weight (layers/skinny_linear.py: the bench model's 48 decode products at 13 rows
    26.8 -> 17.3 ms)."""

    name = "mkl-packed+native-skinny"

    def _pack(self, weight: torch.Tensor) -> None:
        from tgi_vlm.kernels.cpu import ops
        from tgi_vlm.layers.skinny_linear import SkinnyWeight

        super()._pack(weight)
        # The plan chose this kernel where `skinny_available` held for the process's settings (the library loaded).
        self.skinny = SkinnyWeight(weight, ops.skinny_max_rows())

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if self.skinny.takes(rows):
            return self.skinny(x, self.bias)
        return super()._product(x)


def same_inputs(kernels: Sequence[LinearKernel]) -> bool:
    """Whether sibling kernels can be one product: the same kind, input width, dtype and bias presence."""
    first = kernels[0]
    return all(k.same_kind(first) and k.in_features == first.in_features and k.dtype == first.dtype
               and k.source.has_bias == first.source.has_bias for k in kernels)
