"""The native CPU kernels as torch ops, namespace `tgi_vlm` (`torch.ops.tgi_vlm.<name>`).

Each op is defined with `torch.library.Library` (schema + CPU kernel) and a fake implementation, so it shows in the
profiler under its name and torch.compile traces it without running it. Not `torch.library.custom_op`: its Python
wrapper cost ~35 us per call on the AVX2 host against ~18 us for this registration (paired, 13 rows of RMSNorm:
custom_op 40.3, Library 21.8, the Python body 14.5, torch's own norm 32.6 us), and the lean layer calls three ops
per layer. The C code indexes raw memory: every op checks, at its own entry, what
would otherwise read or write outside its tensors (shapes, dtypes, contiguity, alignment, and every index: the
largest and the smallest slot are read from the slot tensors themselves, never taken from the caller), and refuses
with a ValueError. Those checks come before the library is looked up, so they hold where it is not built as well.
An op whose library did not load (`library.load`) raises RuntimeError with the loader's reason; callers ask
`CpuKernels.available` first, and the `can_*` predicates below for the inputs at hand, and run torch's operations
otherwise.

| op | computes | mutates |
|---|---|---|
| `decode_attention` | one query row per sequence over its cached positions, from the paged cache | `out` |
| `rotary_and_store` | rotary of the query and key heads, and the K/V store at the slots | `k_cache`, `v_cache` |
| `rms_norm` | transformers' Llama-family RMSNorm | nothing |
| `gemma_rms_norm` | transformers' Gemma RMSNorm (`(1 + w)`, one rounding), per head of `[T, G, H]` | `out` (may be `x`) |
| `gemma_rms_norm_add` | `residual + gemma_norm(x)` (Gemma 3's sandwich norms and their residual adds), rounded as transformers | `out` (may be `residual`) |
| `skinny_linear` | float32 x W^T + b for 1..`skinny_max_rows` rows, W in `blocked_weight`'s layout | nothing |
| `greedy_logsumexp` | per float32 row: the max's first index, the max, logsumexp | nothing |
| `grouped_int8_linear` | float32 / bfloat16 x W^T, W as int8 codes with a float32 scale (and offset) per group of inputs | nothing |
| `grouped_int8_dequantize` | that weight as a float32 / bfloat16 matrix (the format's values; bf16 rounded once) | nothing |
| `grouped_packed_linear`, `grouped_packed_dequantize` | the same over 4- / 5-bit codes held packed (quantization/packed_codes.py) | nothing |
| `skinny_linear_bf16` | bfloat16 x W^T + b for 1..`skinny_bf16_max_rows` rows (AMX tiles up to `amx_max_rows`, else AVX512-BF16), W in `blocked_weight_bf16`'s | nothing |
"""

from __future__ import annotations

import sys

import torch

from tgi_vlm.kernels.cpu import library

MAX_HEAD_DIM = 256  # decode_attention.c's MAX_HEAD_DIM
_DTYPE_CODES = library.DTYPE_CODES


_LIBRARY = torch.library.Library("tgi_vlm", "DEF")


# Callers reach a kernel without torch's dispatcher (`_op`) unless the profiler records, a dispatch or function mode is
# active (FakeTensorMode) or torch.compile / torch.jit traces: the
# dispatcher's ~3-10 us per call, over the ~12 op calls of each of Gemma 3 270M's 18 layers, was ~1.5 ms of a ~26 ms
# batch-1 decode step. The kernel is the same function either way, its checks included. False: always the op.
DIRECT_CALLS = True


def _op(schema: str, fake):
    """Define `tgi_vlm::<schema>` with the decorated function as its CPU kernel and `fake` as its meta kernel;
    returns a callable that runs the kernel function itself, or the op (`torch.ops.tgi_vlm.<name>.default`) while
    the profiler records (so each call shows under its name), a dispatch mode is active or torch.compile traces (so
    they see the op); the op is the callable's `op`."""
    name = schema.split("(", 1)[0]

    def register(kernel):
        _LIBRARY.define(schema)
        _LIBRARY.impl(name, kernel, "CPU")
        torch.library.register_fake(f"tgi_vlm::{name}", fake, lib=_LIBRARY)
        op = getattr(torch.ops.tgi_vlm, name).default
        profiler = torch.autograd.profiler
        compiling = torch.compiler.is_compiling
        dispatch_modes = torch._C._len_torch_dispatch_stack  # e.g. FakeTensorMode: the op's fake runs, not the C
        function_modes = torch._C._is_torch_function_mode_enabled  # e.g. a TorchFunctionMode that records calls
        jit_tracing = torch.jit.is_tracing

        def call(*args, **kwargs):
            if (DIRECT_CALLS and not profiler._is_profiler_enabled and not dispatch_modes() and not function_modes()
                    and not compiling() and not jit_tracing()):
                return kernel(*args, **kwargs)
            return op(*args, **kwargs)

        call.op = op
        call.__name__ = call.__qualname__ = name
        call.__doc__ = kernel.__doc__
        return call

    return register


_SMALL = 256  # up to this many indices, min/max of a host list is cheaper than aminmax and two read-backs


def slot_bound(slots: torch.Tensor, *, empty: int) -> int:
    """The largest of `slots` (a CPU tensor), for a bounds check against a cache's slot count: a negative slot
    makes it `sys.maxsize`, so that check refuses it too; `empty` when there are none."""
    count = slots.numel()
    if not count:
        return empty
    if count <= _SMALL:
        values = slots.view(-1).tolist()
        low, high = min(values), max(values)
    else:
        low, high = (int(v) for v in torch.aminmax(slots))
    return high if low >= 0 else sys.maxsize


def _loaded(op: str):
    kernels = library.loaded()
    lib = kernels.libraries[library.OP_LIBRARY[op]].library if kernels is not None else None
    if lib is None:
        reason = kernels.reason(op) if kernels is not None else "the native kernels were not loaded (kernels.cpu.load)"
        raise RuntimeError(f"tgi_vlm::{op} is not available: {reason}")
    return lib


def _refuse(op: str, problem: str | None) -> None:
    if problem is not None:
        raise ValueError(f"tgi_vlm::{op}: {problem}")


def _all_cpu(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.is_cpu for t in tensors)


# ----- decode attention -----

def _cache_problem(k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    shape = k_cache.shape
    if not (len(shape) == 3 and k_cache.dtype in _DTYPE_CODES and k_cache.is_contiguous() and shape[1] > 0
            and 0 < shape[2] <= MAX_HEAD_DIM and shape[2] % 16 == 0):
        return (f"the cache must be [slots, Hkv, D] contiguous float32 or bfloat16 with D a multiple of 16 up to "
                f"{MAX_HEAD_DIM}, got {tuple(shape)} {k_cache.dtype}")
    if not (v_cache.shape == shape and v_cache.dtype == k_cache.dtype and v_cache.is_contiguous()):
        return f"values {tuple(v_cache.shape)} {v_cache.dtype} do not match keys {tuple(shape)} {k_cache.dtype}"
    return None


def _decode_problem(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_index: torch.Tensor, row_spans: torch.Tensor) -> str | None:
    """Everything but the indices' values."""
    problem = _cache_problem(k_cache, v_cache)
    if problem is not None:
        return problem
    if not _all_cpu(q, out, k_cache, v_cache, slot_index, row_spans):
        return "every tensor must be on the CPU"
    q_shape, k_shape = q.shape, k_cache.shape
    if not (len(q_shape) == 3 and q.dtype == k_cache.dtype and q.stride(-1) == 1 and q_shape[2] == k_shape[2]
            and q_shape[1] % k_shape[1] == 0):
        return (f"query {tuple(q.shape)} {q.dtype} (last dim contiguous) does not fit the cache "
                f"{tuple(k_cache.shape)} {k_cache.dtype}")
    if not (out.shape == q_shape and out.dtype == q.dtype and out.stride(-1) == 1):
        return f"out {tuple(out.shape)} {out.dtype} is not shaped as the query {tuple(q.shape)} {q.dtype}"
    if not (slot_index.dtype == torch.long and slot_index.dim() == 2 and slot_index.is_contiguous()):
        return f"the slot index must be [B, width] contiguous int64, got {tuple(slot_index.shape)} {slot_index.dtype}"
    if not (row_spans.dtype == torch.long and row_spans.shape == (3, slot_index.shape[0]) and row_spans.is_contiguous()):
        return (f"row_spans must be [3, {slot_index.shape[0]}] contiguous int64 (rows, starts, ends), got "
                f"{tuple(row_spans.shape)} {row_spans.dtype}")
    return None


def _decode_index_problem(q: torch.Tensor, k_cache: torch.Tensor, slot_index: torch.Tensor,
                          row_spans: torch.Tensor) -> str | None:
    largest = slot_bound(slot_index, empty=0)
    if largest >= k_cache.shape[0]:
        return f"a slot past the cache of {k_cache.shape[0]} slots, or negative (largest: {largest})"
    # a host list's min/max (one row per decoding sequence): aminmax's OpenMP region cost ~60 us per layer
    rows, starts, ends = row_spans.tolist()
    rows_low, rows_high, starts_low, ends_high = min(rows), max(rows), min(starts), max(ends)
    if rows_low < 0 or rows_high >= q.shape[0]:
        return f"a row outside the query's {q.shape[0]} rows ({rows_low}..{rows_high})"
    if starts_low < 0 or ends_high > slot_index.shape[1]:
        return f"positions outside the slot index's width {slot_index.shape[1]} ({starts_low}..{ends_high})"
    return None


@_op("decode_attention(Tensor q, Tensor(a!) out, Tensor k_cache, Tensor v_cache, Tensor slot_index, "
     "Tensor row_spans, float scale) -> ()", lambda *args: None)
def decode_attention(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_index: torch.Tensor, row_spans: torch.Tensor, scale: float) -> None:
    """Decode rows of `q` `[T, Hq, D]` attend over their cached positions; results go to the same rows of `out`
    (other rows are not touched). `k_cache`/`v_cache` `[slots, Hkv, D]`; `slot_index` `[B, width]`: the cache slot
    of each position of each sequence; `row_spans` `[3, B]`: sequence b's query/output row, and the first and the
    end of the positions it attends. Softmax of `scale` q.k over those positions, times V; sums in float32 in
    another order than torch's (float32: ~1e-7 from SDPA; bfloat16: up to one ulp)."""
    _refuse("decode_attention", _decode_problem(q, out, k_cache, v_cache, slot_index, row_spans))
    if not row_spans.shape[1]:
        return
    _refuse("decode_attention", _decode_index_problem(q, k_cache, slot_index, row_spans))
    lib = _loaded("decode_attention")
    if q.dtype not in lib.attention_dtypes:
        computed = ", ".join(sorted(str(d) for d in lib.attention_dtypes))
        raise ValueError(f"tgi_vlm::decode_attention: this build computes {computed}, not {q.dtype}")
    rows, starts, ends = row_spans
    hq, head_dim = q.shape[1], q.shape[2]
    status = lib.decode_attention(_DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(),
                                  v_cache.data_ptr(), slot_index.data_ptr(), slot_index.shape[1], rows.data_ptr(),
                                  starts.data_ptr(), ends.data_ptr(), out.data_ptr(), out.stride(0), out.stride(1),
                                  row_spans.shape[1], hq, k_cache.shape[1], head_dim, scale, torch.get_num_threads())
    if status == -2:
        raise MemoryError("tgi_vlm::decode_attention: no memory for a thread's scratch buffers")
    if status != 0:  # the checks above are the library's: this is a bug, not bad input
        raise RuntimeError(f"tgi_vlm::decode_attention refused dtype {q.dtype}, head_dim {head_dim}")


def decode_attention_dtypes() -> frozenset[torch.dtype]:
    """The dtypes this process's decode attention computes (empty where it did not load)."""
    kernels = library.loaded()
    lib = kernels.avx512 if kernels is not None else None
    return lib.attention_dtypes if lib is not None else frozenset()


def can_decode_from(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether `decode_attention` runs here over this layer's flat caches `[slots, Hkv, D]` (the query must match)."""
    return (k_cache.is_cpu and v_cache.is_cpu and k_cache.dtype in decode_attention_dtypes()
            and _cache_problem(k_cache, v_cache) is None)


def can_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, softcap: float | None) -> bool:
    """Whether `decode_attention` computes this layer's decode: not soft-capped (Gemma2), and the query `[T, Hq, D]`
    fits the cache."""
    q_shape, k_shape = q.shape, k_cache.shape
    return (not softcap and q.is_cpu and len(q_shape) == 3 and len(k_shape) == 3 and q.dtype == k_cache.dtype
            and q.stride(-1) == 1 and q_shape[2] == k_shape[2] and k_shape[1] > 0 and q_shape[1] % k_shape[1] == 0
            and can_decode_from(k_cache, v_cache))


# ----- rotary + K/V store -----

def _rotary_problem(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int, k_cache: torch.Tensor,
                    v_cache: torch.Tensor) -> str | None:
    dtype, shape, k_shape, c_shape = qkv.dtype, qkv.shape, k_cache.shape, cos.shape
    if not (dtype in _DTYPE_CODES and qkv.is_cpu and len(shape) == 3 and shape[0] == 1 and qkv.stride(-1) == 1):
        return f"the fused product must be [1, T, W] CPU float32 or bfloat16, last dim contiguous, got {tuple(shape)}"
    if not (k_cache.is_cpu and v_cache.is_cpu and len(k_shape) == 3 and k_cache.dtype == dtype
            and v_cache.dtype == dtype and v_cache.shape == k_shape and k_cache.is_contiguous()
            and v_cache.is_contiguous() and k_shape[2] > 0 and k_shape[2] % 2 == 0):
        return (f"caches {tuple(k_shape)} {k_cache.dtype} / {tuple(v_cache.shape)} {v_cache.dtype} must be "
                f"[slots, Hkv, D] contiguous, D even, of the product's dtype {dtype}")
    c_stride = cos.stride()
    if not (cos.is_cpu and sin.is_cpu and cos.dtype == dtype and sin.dtype == dtype and len(c_shape) == 3
            and sin.shape == c_shape and c_shape[0] == 1 and c_shape[1] == shape[1] and c_shape[2] == k_shape[2]
            and sin.stride() == c_stride and c_stride[2] == 1):
        return f"rotary tables {tuple(c_shape)} / {tuple(sin.shape)} are not [1, T, D] for {tuple(shape)}"
    if q_heads < 1 or shape[2] != (q_heads + 2 * k_shape[1]) * k_shape[2]:
        return (f"a fused product of width {shape[2]} does not hold {q_heads} + 2 x {k_shape[1]} heads of "
                f"{k_shape[2]}")
    return None


def _rotary_fake(qkv, cos, sin, q_heads, k_cache, v_cache, slots):
    tokens, kv_heads, head_dim = qkv.shape[1], k_cache.shape[1], k_cache.shape[2]
    return qkv.new_empty(tokens, q_heads, head_dim), qkv.new_empty(tokens, kv_heads, head_dim)


@_op("rotary_and_store(Tensor qkv, Tensor cos, Tensor sin, int q_heads, Tensor(a!) k_cache, Tensor(b!) v_cache, "
     "Tensor slots) -> (Tensor, Tensor)", _rotary_fake)
def rotary_and_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary of the query and key heads of a fused product `qkv` `[1, T, (Hq + 2 Hkv) D]` (`cos`/`sin`
    `[1, T, D]`), bit-equal to `x * cos + rotate_half(x) * sin` in torch, and the store of the rotated keys and the
    values (the product's last Hkv heads) at `slots` `[T]` of `k_cache`/`v_cache` `[slots, Hkv, D]`, in one pass.
    Returns the rotated query `[T, Hq, D]` and key `[T, Hkv, D]` (new tensors)."""
    _refuse("rotary_and_store", _rotary_problem(qkv, cos, sin, q_heads, k_cache, v_cache))
    tokens = qkv.shape[1]
    if slots.dtype != torch.long or slots.shape != (tokens,) or not slots.is_cpu:
        raise ValueError(f"tgi_vlm::rotary_and_store: {tuple(slots.shape)} {slots.dtype} slots for {tokens} rows")
    largest = slot_bound(slots, empty=-1)
    if largest >= k_cache.shape[0]:
        raise ValueError(f"tgi_vlm::rotary_and_store: a slot past the cache of {k_cache.shape[0]} slots, or negative "
                         f"(largest: {largest})")
    lib = _loaded("rotary_and_store")
    slots = slots.contiguous()
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    q = torch.empty(tokens, q_heads, head_dim, dtype=qkv.dtype)
    k = torch.empty(tokens, kv_heads, head_dim, dtype=qkv.dtype)
    status = lib.rotary_kv(_DTYPE_CODES[qkv.dtype], qkv.data_ptr(), qkv.stride(1), tokens, q_heads, kv_heads, head_dim,
                           cos.data_ptr(), sin.data_ptr(), cos.stride(1), q.data_ptr(), k.data_ptr(),
                           k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"tgi_vlm::rotary_and_store refused dtype {qkv.dtype}, head_dim {head_dim}")
    return q, k


def can_rotate(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int, k_cache: torch.Tensor,
               v_cache: torch.Tensor) -> bool:
    """Whether `rotary_and_store` takes this layer's fused product, rotary tables and flat caches (the slots are
    checked by the op)."""
    return _rotary_problem(qkv, cos, sin, q_heads, k_cache, v_cache) is None


# ----- RMSNorm -----

def _norm_problem(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    shape, stride = x.shape, x.stride()
    if not (x.is_cpu and weight.is_cpu and x.dtype in _DTYPE_CODES and weight.dtype == x.dtype and len(shape) >= 2
            and stride[-1] == 1 and weight.shape == shape[-1:] and weight.is_contiguous()
            and all(stride[i] == stride[i + 1] * shape[i + 1] for i in range(len(shape) - 2))):
        return (f"x {tuple(x.shape)} {x.dtype} must be CPU float32 or bfloat16 rows of H contiguous, as one strided "
                f"run of rows, with a weight [H] of its dtype (got {tuple(weight.shape)} {weight.dtype})")
    return None


@_op("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", lambda x, weight, eps: x.new_empty(x.shape))
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama-family RMSNorm of `x` `[..., H]` (a new contiguous tensor): the same steps except the sum
    of squares (in double here), so outputs may differ from torch's in the last places (csrc/rms_norm.c;
    tests/unit/test_cpu_decoder.py holds them within 4 ulps)."""
    _refuse("rms_norm", _norm_problem(x, weight))
    lib = _loaded("rms_norm")
    out = torch.empty(x.shape, dtype=x.dtype)
    hidden = x.shape[-1]
    rows = x.numel() // hidden if hidden else 0
    if rows:
        status = lib.rms_norm(_DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(-2), weight.data_ptr(), out.data_ptr(),
                              hidden, rows, hidden, eps, torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"tgi_vlm::rms_norm refused dtype {x.dtype}")
    return out


def can_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` takes `x` `[..., H]` and `weight`."""
    return _norm_problem(x, weight) is None


# ----- Gemma's RMSNorm -----

def _gemma_norm_problem(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> str | None:
    for name, t in (("x", x), ("out", out)):
        shape, stride = t.shape, t.stride()
        if not (t.is_cpu and t.dtype in _DTYPE_CODES and len(shape) == 3 and stride[2] == 1 and stride[1] == shape[2]
                and stride[0] >= shape[1] * shape[2]):
            return (f"{name} {tuple(shape)} {t.dtype} must be CPU float32 or bfloat16 [T, G, H], heads of H contiguous "
                    f"and adjacent, tokens apart by at least G x H (strides {tuple(stride)})")
    if not (out.shape == x.shape and out.dtype == x.dtype and weight.is_cpu and weight.dtype == x.dtype
            and weight.shape == x.shape[2:] and weight.is_contiguous()):
        return (f"out {tuple(out.shape)} {out.dtype} and weight {tuple(weight.shape)} {weight.dtype} must match x "
                f"{tuple(x.shape)} {x.dtype} ([T, G, H] and [H])")
    if out.data_ptr() != x.data_ptr() and _overlap(x, out):
        return "out overlaps x without being x"
    return None


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else -1
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


@_op("gemma_rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()", lambda *args: None)
def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """transformers' Gemma RMSNorm (`x * rsqrt(mean(x^2) + eps) * (1 + weight)` in float32, cast once) of every head
    of `x` `[T, G, H]` into `out` (the same shape; `x` itself normalizes in place, e.g. the query heads of a fused
    q/k/v product). The same steps as torch's except the sum of squares, in double (csrc/rms_norm.c), so outputs may
    differ in the last places (tests/unit/test_gemma_norm.py)."""
    _refuse("gemma_rms_norm", _gemma_norm_problem(x, weight, out))
    lib = _loaded("gemma_rms_norm")
    tokens, heads, hidden = x.shape
    if tokens and heads and hidden:
        status = lib.gemma_rms_norm(_DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(),
                                    out.stride(0), tokens, heads, hidden, eps, torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"tgi_vlm::gemma_rms_norm refused dtype {x.dtype}")


def can_gemma_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemma_rms_norm` takes `x` `[T, G, H]` and `weight`, in place."""
    return _gemma_norm_problem(x, weight, x) is None


def _norm_add_problem(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, out: torch.Tensor) -> str | None:
    shape, dtype = x.shape, x.dtype
    if not (x.is_cpu and dtype in _DTYPE_CODES and x.dim() >= 1 and x.is_contiguous()):
        return f"x {tuple(shape)} {dtype} must be contiguous CPU float32 or bfloat16 rows"
    for name, t in (("residual", residual), ("out", out)):
        if not (t.is_cpu and t.dtype == dtype and t.shape == shape and t.is_contiguous()):
            return f"{name} {tuple(t.shape)} {t.dtype} must be contiguous and match x {tuple(shape)} {dtype}"
    if not (weight.is_cpu and weight.dtype == dtype and weight.dim() == 1 and weight.shape[0] == shape[-1]
            and weight.is_contiguous()):
        return f"weight {tuple(weight.shape)} {weight.dtype} must be [{shape[-1]}] {dtype}"
    if _overlap(x, out) or (out.data_ptr() != residual.data_ptr() and _overlap(residual, out)):
        return "out overlaps x, or residual without being it"
    return None


@_op("gemma_rms_norm_add(Tensor x, Tensor weight, float eps, Tensor residual, Tensor(a!) out) -> ()",
     lambda *args: None)
def gemma_rms_norm_add(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor,
                       out: torch.Tensor) -> None:
    """`out = residual + gemma_norm(x)` over rows of `x` `[..., H]` (`out` may be `residual`): transformers' Gemma 3
    sandwich norm and the residual add after it, each rounded to the dtype as transformers rounds them; the sum of
    squares in double as `gemma_rms_norm`'s (csrc/rms_norm.c; tests/unit/test_gemma_norm.py)."""
    _refuse("gemma_rms_norm_add", _norm_add_problem(x, weight, residual, out))
    lib = _loaded("gemma_rms_norm_add")
    hidden = x.shape[-1]
    rows = x.numel() // hidden if hidden else 0
    if rows and hidden:
        status = lib.gemma_rms_norm_add(_DTYPE_CODES[x.dtype], x.data_ptr(), weight.data_ptr(), residual.data_ptr(),
                                        out.data_ptr(), rows, hidden, eps, torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"tgi_vlm::gemma_rms_norm_add refused dtype {x.dtype}")


# ----- skinny linear -----

def blocked_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` `[out, in]` in `skinny_linear`'s layout, `[ceil(out / 32) * 2, in, 16]`: blocks of 16 output
    columns, each input-position-major; columns past `out` are zero. Contiguous and 64-byte aligned (the C loop's
    aligned loads)."""
    out_features, in_features = weight.shape
    padded = -(-out_features // 32) * 32
    blocked = torch.zeros(padded // 16, in_features, 16, dtype=torch.float32)
    if blocked.data_ptr() % 64:  # torch's CPU allocator aligns to 64 bytes; anything else would fault in the C loop
        raise RuntimeError("skinny_linear: the allocator returned memory not aligned to 64 bytes")
    source = torch.zeros(padded, in_features, dtype=torch.float32)
    source[:out_features] = weight
    blocked.copy_(source.view(padded // 16, 16, in_features).transpose(1, 2))
    return blocked


def skinny_max_rows() -> int:
    """The most rows `skinny_linear` takes in this process (0 where it did not load)."""
    kernels = library.loaded()
    return kernels.avx512.skinny_max_rows if kernels is not None and kernels.avx512 is not None else 0


def _linear_problem(x: torch.Tensor, blocked: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                    ) -> str | None:
    if not (_all_cpu(x, blocked, bias) and x.dim() == 2 and x.dtype == blocked.dtype == torch.float32
            and x.is_contiguous() and blocked.is_contiguous() and x.shape[0] >= 1 and out_features >= 1
            and blocked.dim() == 3
            and blocked.shape[1:] == (x.shape[1], 16) and blocked.shape[0] == 2 * -(-out_features // 32)
            and blocked.data_ptr() % 64 == 0
            and (bias is None or (bias.dtype == torch.float32 and bias.shape == (out_features,)
                                  and bias.is_contiguous()))):
        return (f"inconsistent inputs (x {tuple(x.shape)} {x.dtype}, weight {tuple(blocked.shape)} {blocked.dtype}, "
                f"{out_features} outputs, bias {None if bias is None else tuple(bias.shape)})")
    return None


@_op("skinny_linear(Tensor x, Tensor blocked, int out_features, Tensor? bias) -> Tensor",
     lambda x, blocked, out_features, bias: x.new_empty(x.shape[0], out_features))
def skinny_linear(x: torch.Tensor, blocked: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 `x` `[rows, in]` (1 <= rows <= `skinny_max_rows()`, contiguous) times a weight in `blocked_weight`'s
    layout, plus `bias` `[out]`: `[rows, out]`. Sums in float32 in another order than MKL's (within float32
    rounding: tests/unit/test_skinny_linear.py)."""
    _refuse("skinny_linear", _linear_problem(x, blocked, out_features, bias))
    lib = _loaded("skinny_linear")
    rows, in_features = x.shape
    if rows > lib.skinny_max_rows:
        raise ValueError(f"tgi_vlm::skinny_linear: inconsistent inputs ({rows} rows, at most {lib.skinny_max_rows})")
    out = torch.empty(rows, out_features, dtype=torch.float32)
    status = lib.skinny_linear(x.data_ptr(), rows, in_features, blocked.data_ptr(), out_features,
                               None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads())
    if status == -2:
        raise MemoryError("tgi_vlm::skinny_linear: no memory for the transposed input")
    if status != 0:
        raise RuntimeError(f"tgi_vlm::skinny_linear refused {rows} rows of {in_features} -> {out_features}")
    return out


# ----- skinny linear, bfloat16 -----

def blocked_weight_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 `weight` `[out, in]` in `skinny_linear_bf16`'s layout, `[ceil(out / 32) * 2, ceil(in / 2), 32]`:
    blocks of 16 output columns, each a run of input pairs, a pair's two values side by side per column; columns past
    `out` and the odd input past `in` are zero. Contiguous and 64-byte aligned."""
    out_features, in_features = weight.shape
    padded_out, pairs = -(-out_features // 32) * 32, -(-in_features // 2)
    source = torch.zeros(padded_out, 2 * pairs, dtype=torch.bfloat16)
    source[:out_features, :in_features] = weight
    blocked = torch.empty(padded_out // 16, pairs, 32, dtype=torch.bfloat16)
    if blocked.data_ptr() % 64:
        raise RuntimeError("skinny_linear_bf16: the allocator returned memory not aligned to 64 bytes")
    # [blocks, 16 columns, pairs, 2] -> [blocks, pairs, 16 columns, 2]
    blocked.view(padded_out // 16, pairs, 16, 2).copy_(source.view(padded_out // 16, 16, pairs, 2).transpose(1, 2))
    return blocked


def skinny_bf16_max_rows() -> int:
    """The most rows `skinny_linear_bf16` takes in this process (0 where it did not load or the CPU has no
    AVX512-BF16)."""
    kernels = library.loaded()
    return kernels.avx512.skinny_bf16_max_rows if kernels is not None and kernels.avx512 is not None else 0


def _bf16_linear_problem(x: torch.Tensor, blocked: torch.Tensor, out_features: int,
                         bias: torch.Tensor | None) -> str | None:
    if not (_all_cpu(x, blocked, bias) and x.dim() == 2 and x.dtype == blocked.dtype == torch.bfloat16
            and x.is_contiguous() and blocked.is_contiguous() and x.shape[0] >= 1 and out_features >= 1
            and blocked.dim() == 3 and blocked.shape[1:] == (-(-x.shape[1] // 2), 32)
            and blocked.shape[0] == 2 * -(-out_features // 32) and blocked.data_ptr() % 64 == 0
            and (bias is None or (bias.dtype == torch.bfloat16 and bias.shape == (out_features,)
                                  and bias.is_contiguous()))):
        return (f"inconsistent inputs (x {tuple(x.shape)} {x.dtype}, weight {tuple(blocked.shape)} {blocked.dtype}, "
                f"{out_features} outputs, bias {None if bias is None else (tuple(bias.shape), bias.dtype)})")
    return None


def amx_max_rows() -> int:
    """The most rows `skinny_linear_bf16` multiplies on AMX tiles in this process (0: no AMX; the input width must
    also be a multiple of 32); past 16, in tiles of 16 rows over the cached weights."""
    kernels = library.loaded()
    return kernels.avx512.amx_max_rows if kernels is not None and kernels.avx512 is not None else 0


@_op("skinny_linear_bf16(Tensor x, Tensor blocked, int out_features, Tensor? bias, bool amx=True) -> Tensor",
     lambda x, blocked, out_features, bias, amx=True: x.new_empty(x.shape[0], out_features))
def skinny_linear_bf16(x: torch.Tensor, blocked: torch.Tensor, out_features: int,
                       bias: torch.Tensor | None, amx: bool = True) -> torch.Tensor:
    """bfloat16 `x` `[rows, in]` (1 <= rows <= `skinny_bf16_max_rows()`, or `amx_max_rows()` on AMX, contiguous) times a weight in
    `blocked_weight_bf16`'s layout, plus `bias` `[out]`: `[rows, out]` bfloat16, summed in float32 and rounded once
    (csrc/skinny_linear.c; tests/unit/test_skinny_linear_bf16.py). With `amx`, on AMX tiles where they take the
    product (`amx_max_rows()` rows at most, `in` a multiple of 32), else the VDPBF16PS loop."""
    _refuse("skinny_linear_bf16", _bf16_linear_problem(x, blocked, out_features, bias))
    lib = _loaded("skinny_linear_bf16")
    rows, in_features = x.shape
    most = max(lib.skinny_bf16_max_rows, lib.amx_max_rows if amx and in_features % 32 == 0 else 0)
    if rows > most:
        raise ValueError(f"tgi_vlm::skinny_linear_bf16: inconsistent inputs ({rows} rows, at most {most})")
    out = torch.empty(rows, out_features, dtype=torch.bfloat16)
    status = lib.skinny_linear_bf16(x.data_ptr(), rows, in_features, blocked.data_ptr(), out_features,
                                    None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads(),
                                    int(amx))
    if status == -2:
        raise MemoryError("tgi_vlm::skinny_linear_bf16: no memory for the paired input")
    if status != 0:
        raise RuntimeError(f"tgi_vlm::skinny_linear_bf16 refused {rows} rows of {in_features} -> {out_features}")
    return out


# ----- greedy choice -----

def _greedy_problem(scores: torch.Tensor) -> str | None:
    if not (scores.is_cpu and scores.dtype == torch.float32 and scores.dim() == 2 and scores.shape[1] >= 1
            and scores.stride(1) == 1 and scores.stride(0) >= scores.shape[1]):
        return (f"scores must be CPU float32 [B, V] with V >= 1 and rows of V contiguous, got {tuple(scores.shape)} "
                f"{scores.dtype} strides {tuple(scores.stride())}")
    return None


def _greedy_fake(scores):
    rows = scores.shape[0]
    return scores.new_empty(rows, dtype=torch.long), scores.new_empty(rows), scores.new_empty(rows)


@_op("greedy_logsumexp(Tensor scores) -> (Tensor, Tensor, Tensor)", _greedy_fake)
def greedy_logsumexp(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of float32 `scores` `[B, V]`: the index of the first maximum (argmax's choice; the first NaN where there
    is one), the maximum, and the row's logsumexp, in one call (csrc/greedy.c): `[B]` int64, `[B]` and `[B]` float32.
    The logsumexp is within float32 rounding of torch's (tests/unit/test_greedy_logsumexp.py)."""
    _refuse("greedy_logsumexp", _greedy_problem(scores))
    lib = _loaded("greedy_logsumexp")
    rows = scores.shape[0]
    ids = torch.empty(rows, dtype=torch.long)
    chosen, lse = torch.empty(rows), torch.empty(rows)
    if rows:
        status = lib.greedy_logsumexp(scores.data_ptr(), rows, scores.shape[1], scores.stride(0), ids.data_ptr(),
                                      chosen.data_ptr(), lse.data_ptr(), torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"tgi_vlm::greedy_logsumexp refused {tuple(scores.shape)}")
    return ids, chosen, lse


def can_choose_greedily(scores: torch.Tensor) -> bool:
    """Whether `greedy_logsumexp` runs here on `scores` (the library loaded and the tensor fits)."""
    kernels = library.loaded()
    return (kernels is not None and kernels.available("greedy_logsumexp") and _greedy_problem(scores) is None)


# ----- grouped int8 weights (quantized checkpoints) -----

def _grouped_problem(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                     group: int) -> str | None:
    codes_ok = codes.dim() == 2 and codes.dtype == torch.int8 and codes.is_contiguous() and codes.is_cpu
    return _grouped_shape_problem(x, tuple(codes.shape) if codes_ok else None, scales, offsets, group,
                                  f"int8 codes {tuple(codes.shape)} {codes.dtype}")


def _grouped_shape_problem(x: torch.Tensor, shape: tuple[int, ...] | None, scales: torch.Tensor,
                           offsets: torch.Tensor | None, group: int, codes: str) -> str | None:
    """x, scales and offsets against a weight of `shape` `[out, in]` (None: its codes are not fit to run)."""
    rows_ok = x.dim() == 2 and x.shape[0] >= 1 and x.is_contiguous() and x.dtype in _DTYPE_CODES
    if not (shape is not None and _all_cpu(x, scales, offsets) and rows_ok and shape[0] >= 1 and group >= 16
            and group % 16 == 0 and shape[1] == x.shape[1] and x.shape[1] % group == 0 and x.shape[1] >= group):
        return (f"inconsistent inputs (x {tuple(x.shape)} {x.dtype}, {codes}, "
                f"group {group}: CPU tensors, contiguous float32/bfloat16 x, int8 codes [out, in], a group that is a "
                f"multiple of 16 dividing in)")
    groups = (shape[0], shape[1] // group)
    for name, t in (("scales", scales), ("offsets", offsets)):
        if t is not None and not (t.dtype == torch.float32 and tuple(t.shape) == groups and t.is_contiguous()):
            return f"{name} must be contiguous float32 {groups}, got {tuple(t.shape)} {t.dtype}"
    return None


@_op("grouped_int8_linear(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, int group) -> Tensor",
     lambda x, codes, scales, offsets, group: x.new_empty(x.shape[0], codes.shape[0]))
def grouped_int8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                        group: int) -> torch.Tensor:
    """`x` `[rows, in]` (float32 or bfloat16) times W^T where W[o, k] = scales[o, k // group] * codes[o, k]
    - offsets[o, k // group] (no offsets: 0): `[rows, out]` in x's dtype, summed in float32 (csrc/grouped_linear.c;
    tests/unit/test_grouped_int8_linear.py holds it to F.linear over the de-quantized weight)."""
    _refuse("grouped_int8_linear", _grouped_problem(x, codes, scales, offsets, group))
    lib = _loaded("grouped_int8_linear")
    out = torch.empty(x.shape[0], codes.shape[0], dtype=x.dtype)
    status = lib.grouped_int8_linear(x.data_ptr(), _DTYPE_CODES[x.dtype], x.shape[0], x.shape[1], codes.data_ptr(),
                                     codes.shape[0], scales.data_ptr(), None if offsets is None else offsets.data_ptr(),
                                     group, out.data_ptr(), torch.get_num_threads())
    if status == -2:
        raise MemoryError("tgi_vlm::grouped_int8_linear: no memory for the float32 copy of x")
    if status != 0:
        raise RuntimeError(f"tgi_vlm::grouped_int8_linear refused {tuple(x.shape)} x {tuple(codes.shape)}")
    return out


@_op("grouped_int8_dequantize(Tensor codes, Tensor scales, Tensor? offsets, int group, ScalarType dtype) -> Tensor",
     lambda codes, scales, offsets, group, dtype: codes.new_empty(codes.shape, dtype=dtype))
def grouped_int8_dequantize(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, group: int,
                            dtype: torch.dtype) -> torch.Tensor:
    """The weight `grouped_int8_linear` multiplies by, `[out, in]` in `dtype` (float32: bit for bit
    `GroupedInt8Weight.dequantize`; bfloat16: that, rounded once)."""
    if dtype not in _DTYPE_CODES:
        _refuse("grouped_int8_dequantize", f"dtype must be float32 or bfloat16, got {dtype}")
    probe = torch.empty(1, codes.shape[1] if codes.dim() == 2 else 0, dtype=dtype)  # the weight's checks, as x's
    _refuse("grouped_int8_dequantize", _grouped_problem(probe, codes, scales, offsets, group))
    lib = _loaded("grouped_int8_dequantize")
    out = torch.empty(codes.shape, dtype=dtype)
    status = lib.grouped_int8_dequantize(codes.data_ptr(), codes.shape[0], codes.shape[1], scales.data_ptr(),
                                         None if offsets is None else offsets.data_ptr(), group, out.data_ptr(),
                                         _DTYPE_CODES[dtype], torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"tgi_vlm::grouped_int8_dequantize refused {tuple(codes.shape)}")
    return out


def _packed_problem(nibbles: torch.Tensor, high: torch.Tensor | None, zero: int) -> str | None:
    if not (nibbles.dim() == 2 and nibbles.dtype == torch.uint8 and nibbles.is_contiguous() and nibbles.shape[0] >= 1
            and nibbles.shape[1] % 16 == 0 and nibbles.shape[1] >= 16 and zero in (0, 8, 16)):
        return (f"packed codes must be contiguous uint8 nibbles [out, in / 2] with in a multiple of 32 and zero 0, 8 "
                f"or 16, got {tuple(nibbles.shape)} {nibbles.dtype}, zero {zero}")
    if high is not None and not (high.dtype == torch.int32 and high.is_contiguous()
                                 and tuple(high.shape) == (nibbles.shape[0], nibbles.shape[1] // 16)):
        return (f"high bits must be contiguous int32 {(nibbles.shape[0], nibbles.shape[1] // 16)}, got "
                f"{tuple(high.shape)} {high.dtype}")
    return None


def _packed_checks(op: str, x: torch.Tensor, nibbles: torch.Tensor, high: torch.Tensor | None, zero: int,
                   scales: torch.Tensor, offsets: torch.Tensor | None, group: int) -> None:
    """The packing's checks, then the int8 op's on the unpacked shape."""
    _refuse(op, _packed_problem(nibbles, high, zero) or (None if _all_cpu(nibbles, high) else "CPU tensors only"))
    _refuse(op, _grouped_shape_problem(x, (nibbles.shape[0], nibbles.shape[1] * 2), scales, offsets, group,
                                       f"packed codes of {(nibbles.shape[0], nibbles.shape[1] * 2)}"))


@_op("grouped_packed_linear(Tensor x, Tensor nibbles, Tensor? high, int zero, Tensor scales, Tensor? offsets, "
     "int group) -> Tensor",
     lambda x, nibbles, high, zero, scales, offsets, group: x.new_empty(x.shape[0], nibbles.shape[0]))
def grouped_packed_linear(x: torch.Tensor, nibbles: torch.Tensor, high: torch.Tensor | None, zero: int,
                          scales: torch.Tensor, offsets: torch.Tensor | None, group: int) -> torch.Tensor:
    """`grouped_int8_linear` over codes held packed (quantization/packed_codes.py's layout): the same sums, bit for
    bit, from 0.5 (4-bit) or 0.625 (5-bit) bytes per code instead of 1."""
    _packed_checks("grouped_packed_linear", x, nibbles, high, zero, scales, offsets, group)
    lib = _loaded("grouped_packed_linear")
    out = torch.empty(x.shape[0], nibbles.shape[0], dtype=x.dtype)
    status = lib.grouped_packed_linear(x.data_ptr(), _DTYPE_CODES[x.dtype], x.shape[0], x.shape[1], nibbles.data_ptr(),
                                       None if high is None else high.data_ptr(), zero, nibbles.shape[0],
                                       scales.data_ptr(), None if offsets is None else offsets.data_ptr(), group,
                                       out.data_ptr(), torch.get_num_threads())
    if status == -2:
        raise MemoryError("tgi_vlm::grouped_packed_linear: no memory for the float32 copy of x")
    if status != 0:
        raise RuntimeError(f"tgi_vlm::grouped_packed_linear refused {tuple(x.shape)} x {tuple(nibbles.shape)} packed")
    return out


@_op("grouped_packed_dequantize(Tensor nibbles, Tensor? high, int zero, Tensor scales, Tensor? offsets, int group, "
     "ScalarType dtype) -> Tensor",
     lambda nibbles, high, zero, scales, offsets, group, dtype:
     nibbles.new_empty(nibbles.shape[0], nibbles.shape[1] * 2, dtype=dtype))
def grouped_packed_dequantize(nibbles: torch.Tensor, high: torch.Tensor | None, zero: int, scales: torch.Tensor,
                              offsets: torch.Tensor | None, group: int, dtype: torch.dtype) -> torch.Tensor:
    """`grouped_int8_dequantize` over codes held packed."""
    if dtype not in _DTYPE_CODES:
        _refuse("grouped_packed_dequantize", f"dtype must be float32 or bfloat16, got {dtype}")
    probe = torch.empty(1, nibbles.shape[1] * 2 if nibbles.dim() == 2 else 0, dtype=dtype)
    _packed_checks("grouped_packed_dequantize", probe, nibbles, high, zero, scales, offsets, group)
    lib = _loaded("grouped_packed_dequantize")
    out = torch.empty(nibbles.shape[0], nibbles.shape[1] * 2, dtype=dtype)
    status = lib.grouped_packed_dequantize(nibbles.data_ptr(), None if high is None else high.data_ptr(), zero,
                                           nibbles.shape[0], nibbles.shape[1] * 2, scales.data_ptr(),
                                           None if offsets is None else offsets.data_ptr(), group, out.data_ptr(),
                                           _DTYPE_CODES[dtype], torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"tgi_vlm::grouped_packed_dequantize refused {tuple(nibbles.shape)} packed")
    return out


def can_run_grouped_int8(x: torch.Tensor) -> bool:
    """Whether `grouped_int8_linear` runs here (the library loaded, x CPU float32/bfloat16)."""
    kernels = library.loaded()
    return (kernels is not None and kernels.available("grouped_int8_linear") and x.is_cpu
            and x.dtype in _DTYPE_CODES)
