"""CPU-only speed-ups applied to a loaded model, each exact (same arithmetic, less overhead).

Costs a profile of the serving step shows on CPU and that transformers' eager modeling does
not avoid (benchmarks/results/cpu-profile.md has the figures):

- Allocation churn. Activations of a prefill step are megabytes; glibc serves blocks above its
  mmap threshold with fresh mmap'd pages and unmaps them on free, so every large temporary costs
  page faults and zeroing. `tune_allocator` keeps freed memory in the heap for reuse.
- oneDNN kernel creation per shape. A bfloat16 / float16 matmul on CPU runs an AMX/AVX-512 kernel
  that oneDNN builds (JIT) for each (rows, in, out) shape and caches. Prefill steps have a new
  token count almost every time, so each step paid a kernel build per distinct layer shape, in
  the text model and in the vision tower (whose row count is the image's patch count).
  `bucket_linear_rows` pads the rows of every linear layer to a few fixed sizes, so the kernels
  are built once and reused; padded rows are dropped from the output (row results do not depend
  on the other rows). Float32 through MKL builds nothing per shape; packed float32 linears (below)
  go through oneDNN and are padded the same way.
- Weight reorders and MKL's small-row products. A bfloat16 linear through `F.linear` reorders its
  weight into oneDNN's blocked layout on every call; `pack_linear_weights` keeps the weight packed
  (done once, lazily on the model thread, the plain copy released): a bf16 decode step 28 -> 25 ms.
  Float32 linears are packed too, with MKL's own packed GEMM (`cblas_sgemm_pack` / `_compute` through
  torch's `mkl::_mkl_linear`) where torch has MKL: a packed kernel streams decode-sized products' weights
  far faster than plain sgemm (the second round's figures in docs/decisions.md), MKL's is as fast as oneDNN's
  there (benchmarks/results/skinny_linear.md) and a few percent faster at prefill sizes in the engine
  (cpu_paths-mkl-float32-float32.md), and it builds nothing per row count, so float32 rows are not padded.
  Like oneDNN's, its sums are not always in plain sgemm's order (float32 rounding apart). Without MKL (e.g. aarch64 builds) float32 goes through oneDNN like bf16, padded,
  and keeps the plain weight for one-row products when that second copy is cheap
  (`decode_copies_fit`; oneDNN's one-row kernel is ~20% slower than MKL's GEMV). The language
  model's q/k/v and gate/up projections are also fused into one packed product each
  (layers/cpu_fused.py): the same bytes, fewer and larger calls.
- Patch embeddings written as convolutions. Qwen2-VL's patch embed is a Conv3d whose kernel is
  the whole patch (stride = kernel), called on `[patches, C, T, P, P]`: one output position per
  patch, i.e. a matrix product. As a convolution it is ~30x slower on CPU than the same product
  as a matmul. `convs_as_linear` computes exactly that product when the input is one kernel
  large (with a packed weight and padded rows, as the linears), and falls back to the convolution
  otherwise.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import functools
import os
import time
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from loguru import logger

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_KEEP_BYTES = 1 << 30  # allocations up to 1 GiB come from the heap; up to 1 GiB of free heap is kept
KERNEL_CACHE_CAPACITY = 4096  # oneDNN kernels kept (its default: 1024)
PRIME_BUDGET_S = 3.0  # warmup time for building kernels ahead (the bench model: 1.8 s bf16, 2.8 s fp32 for all)

_tuned = False
# Row bucketing through F.linear and the convolution rewrite are for reduced precision only: a
# matmul sums a patch in another order than the convolution, ~1e-4 apart after a few layers of the
# tiny models in float32, where parity tests hold logits to 1e-4.
_REDUCED = (torch.bfloat16, torch.float16)
# dtypes whose linears keep a oneDNN-prepacked weight (see pack_linear_weights)
PACKED_DTYPES = (torch.bfloat16, torch.float32)


def tune_allocator() -> bool:
    """Keep large freed blocks for reuse instead of returning them to the OS on every free.

    Process-wide and once. Memory is still reused (and RSS stays near the peak of a step, as with
    tcmalloc, which vLLM's CPU build preloads). Returns whether glibc accepted the settings."""
    global _tuned
    if _tuned:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        # glibc refuses an mmap threshold above its heap limit (32 MiB on some builds): then that limit.
        mmap_ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) or bool(libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20))
        ok = mmap_ok and bool(libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES))
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        ok = False
    _tuned = ok
    logger.info("allocator: large CPU temporaries {} reused from the heap", "are" if ok else "cannot be (no glibc)")
    return ok


def size_kernel_cache() -> None:
    """Let oneDNN keep the kernels the packed products need (`prime_packed_kernels` builds them at warmup).

    Its primitive cache holds 1024 kernels by default, fewer than priming the bench model builds: a building
    pass after 64 image prefills took 1.44-1.52 s at 1024 (kernels evicted, rebuilt) and 0.36-0.44 s at 4096
    (`benchmarks/kernel_priming.py`). An evicted kernel is rebuilt, ~2 ms, by the next step that
    needs it. oneDNN reads ONEDNN_PRIMITIVE_CACHE_CAPACITY once, when it first builds a kernel, so this runs
    before the first forward (`speed_up_for_cpu`); a value the user set is kept."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(KERNEL_CACHE_CAPACITY))


def row_bucket(rows: int) -> int:
    """The padded row count: exact up to 32 rows (decode batches); above, a multiple of 32 or of
    1/8 of the power of two below `rows`, whichever is larger: at most 12.5% padding past 256 rows,
    8 sizes per doubling (63 sizes up to 2048 rows)."""
    if rows <= 32:
        return rows
    step = max(32, (1 << (rows.bit_length() - 1)) // 8)
    return -(-rows // step) * step


def padded_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`x` as `[rows, in]` with zero rows appended up to `row_bucket(rows)`, and `rows`."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    flat = x.reshape(rows, x.shape[-1])
    padded = row_bucket(rows)
    return (F.pad(flat, (0, 0, 0, padded - rows)) if padded != rows else flat), rows


def _bucketed_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    flat, rows = padded_rows(x)
    return F.linear(flat, self.weight, self.bias)[:rows].view(*x.shape[:-1], self.out_features)


def bucket_linear_rows(model: torch.nn.Module) -> int:
    """Route every `nn.Linear` of `model` whose weight is bfloat16/float16 through row bucketing
    (instance-level forward; modules, parameters and hooks stay as they are). Returns the count."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype in _REDUCED:
            module.forward = types.MethodType(_bucketed_linear_forward, module)
            count += 1
    return count


@functools.cache
def mkl_packs_float32() -> bool:
    """Whether this torch build multiplies float32 with MKL's packed GEMM (`mkl::_mkl_linear`); asked per layer and
    step through `pads_rows`, answered once."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


# The row count MKL packs for. Its packed layout is the same for every count from 2 rows up (checked for the
# shapes served here: bit-equal to packing for the exact count, tests/unit/test_cpu_speedups.py), and
# `mkl::_mkl_linear` takes the packed path only when told the count it sees, so each call passes its own.
# MKL does not document that a packed matrix serves other counts, so each product shape is also checked once per
# process when first packed (`_mkl_layout_agrees`); a shape that disagrees stays on oneDNN.
MKL_PACK_ROWS = 64
_MKL_CHECK_ROWS = (1, 2, 97)
_mkl_layout_checked: dict[tuple[int, int], bool] = {}


def _mkl_layout_agrees(weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether `packed` multiplies like `weight` at a few row counts other than the one it was packed for
    (float32 rounding apart), once per (out, in) shape and process."""
    key = tuple(weight.shape)
    if key not in _mkl_layout_checked:
        agrees = packed.is_mkldnn
        generator = torch.Generator().manual_seed(0)
        for rows in _MKL_CHECK_ROWS if agrees else ():
            x = torch.randn(rows, weight.shape[1], generator=generator)
            got = torch.ops.mkl._mkl_linear(x, packed, weight, None, rows)
            want = F.linear(x, weight)
            agrees = agrees and bool(((got - want).abs() <= 1e-4 * (x.abs() @ weight.abs().T) + 1e-6).all())
        if not agrees:
            logger.warning("MKL's packed float32 product disagreed with F.linear for a {} weight at another row count "
                           "than it was packed for: that shape stays on oneDNN", "x".join(map(str, key)))
        _mkl_layout_checked[key] = agrees
    return _mkl_layout_checked[key]


class PackedWeight:
    """A linear weight packed once for its kernel (no reorder per call): MKL's packed GEMM for float32 where
    torch has MKL, else oneDNN's blocked layout. With `decode_copy` (float32, when memory allows: see
    `decode_copies_fit`) a second copy serves decode-sized products: with MKL, the native skinny loop's layout
    (layers/skinny_linear.py: the bench model's 48 decode products at 13 rows 26.8 -> 17.3 ms); with oneDNN, the
    plain weight for one-row products (MKL's GEMV streams it faster than oneDNN's packed kernel: 84 decode linears
    of the bench model 12 vs 15 ms). Made on first use, on the thread that runs the model (see `_pack`)."""

    def __init__(self, weight: torch.Tensor, *, decode_copy: bool):
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.mkl = weight.dtype == torch.float32 and mkl_packs_float32()
        self.one_row, self.skinny = None, None
        if self.mkl:
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, MKL_PACK_ROWS)
            self.mkl = _mkl_layout_agrees(weight, self.packed)
        if self.mkl:
            # `_mkl_linear` reads only the plain weight's shape and dtype on its packed path: a stand-in without storage
            self.shape_of = weight.new_zeros(()).expand(weight.shape)
            if decode_copy:
                from tgi_vlm.layers.skinny_linear import skinny_weight

                self.skinny = skinny_weight(weight)
            return
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
        self.one_row = weight if decode_copy and weight.dtype == torch.float32 else None

    @property
    def pads_rows(self) -> bool:
        return not self.mkl

    def key(self, bias: torch.Tensor | None) -> tuple:
        """What oneDNN keys its kernel on, besides the rows."""
        return self.in_features, self.out_features, self.dtype, bias is not None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x `[..., in]` -> `[..., out]`."""
        if self.mkl:
            return self._mkl_product(x, bias)
        if self.one_row is not None and x.numel() == x.shape[-1]:
            return F.linear(x, self.one_row, bias)
        flat, rows = padded_rows(x)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, bias, "none", [], "")
        return out[:rows].view(*x.shape[:-1], out.shape[-1])

    def _mkl_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if self.skinny is not None and self.skinny.takes(rows):
            return self.skinny(x, bias)
        out = torch.ops.mkl._mkl_linear(x.reshape(rows, x.shape[-1]), self.packed, self.shape_of, bias, rows)
        return out.view(*x.shape[:-1], self.out_features)


def _packed_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight = self.__dict__.get("_packed_weight")
    if weight is None:
        weight = _pack(self)
    return weight(x, self.bias)


def _pack(module: torch.nn.Linear) -> PackedWeight:
    """Pack on first use, on the thread that runs the model: weights packed on another thread (the
    loading one) made a bf16 decode step 1.6x slower (39 vs 25 ms). The plain weight's storage is
    then released unless kept for one-row products (the parameter keeps its dtype and name)."""
    weight = PackedWeight(module.weight.detach(), decode_copy=module.__dict__.get("_decode_copy", False))
    module.__dict__["_packed_weight"] = weight
    if weight.one_row is None:
        module.weight.data = module.weight.data.new_empty(0)
    return weight


def row_buckets(max_rows: int) -> list[int]:
    """Every padded row count `row_bucket` gives for 1..max_rows, ascending."""
    buckets, rows = [], 1
    while rows <= max_rows:
        bucket = row_bucket(rows)
        buckets.append(bucket)
        rows = bucket + 1
    return buckets


def packed_products(model: torch.nn.Module, row_caps: dict[torch.nn.Module, int] | None = None,
                    ) -> list[tuple[PackedWeight, torch.Tensor | None, int | None]]:
    """The packed weights (with their bias) that `model`'s linears, fused groups and patch convolutions have
    made so far, one per distinct (in, out, dtype, bias or not): what a oneDNN kernel is built for. The third
    item is the most rows that product meets, for modules in `row_caps` (None: any)."""
    from tgi_vlm.layers.cpu_fused import fused_groups

    row_caps = row_caps or {}
    found: dict[tuple, tuple[PackedWeight, torch.Tensor | None, int | None]] = {}
    candidates = [(m.__dict__.get("_packed_weight"), getattr(m, "bias", None), row_caps.get(m)) for m in model.modules()]
    candidates += [(group.weight, group.bias, None) for group in fused_groups(model)]
    for weight, bias, cap in candidates:
        if isinstance(weight, PackedWeight):
            key = weight.key(bias)
            if key not in found or (found[key][2] is not None and (cap is None or cap > found[key][2])):
                found[key] = (weight, bias, cap)  # a shape shared by a capped and an uncapped module: uncapped
    return list(found.values())


def prime_packed_kernels(model: torch.nn.Module, max_rows: int, *, row_caps: dict[torch.nn.Module, int] | None = None,
                         budget_s: float = PRIME_BUDGET_S, clock: Callable[[], float] = time.perf_counter,
                         ) -> tuple[int, int]:
    """Build, now, oneDNN's kernel for each row bucket up to `max_rows` of every packed product shape.

    oneDNN builds (JIT-compiles) a kernel for each row count a product meets, ~2 ms each here; a serving run
    meets a new bucket in most of its early prefill steps (each step's token count, each image's patch
    count), and warmup's one batch meets only its own. Run at warmup, on the model thread, after the
    warmup batch (which packs the weights it uses). Smallest buckets first, while `budget_s` lasts (checked
    before each bucket): a large model's big products cost far more than their kernel's build, so leaving
    them to build on first use loses nothing. `row_caps`: modules that never see more rows than this (the
    lm-head: one row per sequence, or logprob chunks). MKL's float32 products build nothing and are skipped.
    Returns (products run, largest bucket primed)."""
    products = [product for product in packed_products(model, row_caps) if product[0].pads_rows]  # MKL: nothing to build
    start, count, done = clock(), 0, 0
    with torch.inference_mode():
        for rows in row_buckets(max_rows) if products else ():
            if clock() - start > budget_s:
                break
            for weight, bias, cap in products:
                if cap is None or rows <= row_bucket(cap):
                    weight(torch.zeros(rows, weight.in_features, dtype=weight.dtype), bias)
                    count += 1
            done = rows
    return count, done


def decode_copies_fit(model: torch.nn.Module) -> bool:
    """Whether float32 packed linears also keep a second copy for decode-sized products (`PackedWeight`): when
    those weights take at most 1/16 of the memory this process may use, so the second copy is cheap."""
    fp32_bytes = sum(m.weight.numel() * 4 for m in model.modules()
                     if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32)
    memory = _usable_memory()
    return memory is not None and 0 < fp32_bytes <= memory // 16


def _usable_memory() -> int | None:
    """Physical memory, or the cgroup's limit when lower (a container on a large host)."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            limit = open(path).read().strip()
        except OSError:
            continue
        if limit.isdigit():
            memory = min(memory, int(limit))
    return memory


def pack_linear_weights(model: torch.nn.Module, *, decode_copy: bool = False) -> int:
    """bfloat16 and float32 linears whose weight no other module shares (an lm-head tied to the
    embeddings is left alone) multiply with a prepacked copy of their weight (`PackedWeight`: MKL's for float32
    where torch has MKL, else oneDNN's): no reorder per call. oneDNN's rows are padded as `bucket_linear_rows`
    does (it builds a kernel per row count). `decode_copy`: float32 ones keep a second copy for decode-sized products (`PackedWeight`). Returns
    the count."""
    if not can_pack_weights():
        return 0
    owners = collections.Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype in PACKED_DTYPES and owners[id(module.weight)] == 1:
            module.forward = types.MethodType(_packed_linear_forward, module)
            module.__dict__["_decode_copy"] = decode_copy
            count += 1
    return count


def _conv_as_linear_forward(self: torch.nn.Conv3d | torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    if tuple(x.shape[2:]) != tuple(self.kernel_size):
        return self._conv_forward(x, self.weight, self.bias)
    patches = x.reshape(x.shape[0], -1)
    weight = self.__dict__.get("_packed_weight")
    if weight is None and self.__dict__.get("_pack_patches"):
        # Packed, rows padded like the linears: the row count is the image's patch count, new for almost
        # every image, and oneDNN builds a kernel per row count (an unpadded product at a count it had not
        # met: 4.8 vs 0.5 ms). Made on first use, on the model thread; the plain weight stays for inputs
        # larger than one kernel. bf16 sums may round differently from the unpadded product (one ulp).
        weight = self.__dict__["_packed_weight"] = PackedWeight(self.weight.detach().reshape(self.out_channels, -1),
                                                                decode_copy=False)
    if weight is None:
        out = F.linear(patches, self.weight.reshape(self.out_channels, -1), self.bias)
    else:
        out = weight(patches, self.bias)
    return out.view(x.shape[0], self.out_channels, *([1] * len(self.kernel_size)))


def can_pack_weights() -> bool:
    """Whether this torch build has oneDNN's weight prepacking (`PackedWeight`)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def convs_as_linear(model: torch.nn.Module, *, pack: bool = True) -> int:
    """Reduced-precision patch-embedding convolutions (stride = kernel, no padding, no groups/dilation) compute a
    matmul when their input is exactly one kernel; give them that path (through a packed weight when `pack`
    and the dtype allows). Returns the count."""
    count = 0
    for module in model.modules():
        if type(module) not in (torch.nn.Conv2d, torch.nn.Conv3d) or module.weight.dtype not in _REDUCED:
            continue
        if (module.stride != module.kernel_size or module.groups != 1 or any(module.padding)
                or any(d != 1 for d in module.dilation) or module.padding_mode != "zeros"):
            continue
        module.forward = types.MethodType(_conv_as_linear_forward, module)
        module.__dict__["_pack_patches"] = pack and module.weight.dtype in PACKED_DTYPES and can_pack_weights()
        count += 1
    return count


def speed_up_for_cpu(model: torch.nn.Module, *, language_model: torch.nn.Module | None = None,
                     sharded: bool = False) -> None:
    """All of the above for a model about to serve on CPU (logs what was done); `language_model`'s
    q/k/v and gate/up projections are also fused (layers/cpu_fused.py) and its Llama-family decoder
    layers take the lean forward (layers/cpu_decoder.py).

    A tensor-parallel model keeps transformers' own linear forwards: its plan hooks them.
    TGI_VLM_CPU_SPEEDUPS=0 turns all of it off (for benchmarks that measure what it buys)."""
    if os.environ.get("TGI_VLM_CPU_SPEEDUPS", "1") == "0":
        logger.info("TGI_VLM_CPU_SPEEDUPS=0: CPU speed-ups off")
        return
    from tgi_vlm.layers.cpu_decoder import install_lean_layers
    from tgi_vlm.layers.cpu_fused import fuse_sibling_projections

    tune_allocator()
    size_kernel_cache()
    convs = convs_as_linear(model, pack=not sharded)
    linears = 0 if sharded else bucket_linear_rows(model)
    decode_copy = decode_copies_fit(model)
    packed = 0 if sharded else pack_linear_weights(model, decode_copy=decode_copy)
    # last: a fused member's forward replaces the packed one set just above (packing is lazy, so none happened)
    fused = 0 if sharded or language_model is None else fuse_sibling_projections(language_model, decode_copy=decode_copy)
    # after fusing: a lean layer slices its fused products itself (layers/cpu_decoder.py)
    lean = install_lean_layers(language_model) if fused else 0
    logger.info("CPU: {} patch-embedding convolution(s) run as matmuls; {} bf16/fp16 linear layer(s) pad their "
                "rows to reuse oneDNN kernels; {} linear layer(s) with prepacked weights; {} q/k/v or gate/up "
                "group(s) fused; {} decoder layer(s) with the lean forward", convs, linears, packed, fused, lean)
