"""Decode attention straight from the paged KV cache, in C for x86-64 CPUs with AVX-512 (native/decode_attention.c).

Why: a decode step's attention on CPU was either a gather of every sequence's context per layer, or SDPA over
the decode mirror's dense copy, padded to the longest sequence; both run torch's flash kernel one query row per
head: 420 us per layer for 13 sequences of 80-430 positions on the bench model in bf16. The kernel reads each
sequence's own positions through its slot list (no copy, no padding), G query heads per kv head over rows then in
cache: 183 us for the same layer, and 465 us against 955 with the cache cold as in a serving step
(benchmarks/native_decode_attention.py). torch offers no block-table-aware
CPU attention, and no package that does supports this torch.

How it is built: the first shard on a machine compiles the one C file with the system C compiler (`CC`, else
`cc`), `-O3 -march=native -fopenmp`, into a cache keyed by the source, the flags, the compiler and the CPU
(`$TGI_VLM_KERNEL_CACHE`, default ~/.cache/tgi-vlm/kernels); later starts load the cached library. No compiler,
no AVX-512, another OS or architecture, or a build error: a warning, and decode attention stays on the torch
path (the decode mirror). `TGI_VLM_NATIVE_ATTENTION=0` turns it off.

The same library holds `rotary_and_store` (native/rotary_kv.c): the lean decoder layer's rotary of the query and
key heads and the K/V store into the cache in one pass, bit-equal to torch's operations; `rms_norm`
(native/rms_norm.c): the lean layer's RMSNorm in one call, within a few ulps of torch's; and `skinny_linear`
(native/skinny_linear.c): float32 linears for decode-sized row counts (layers/skinny_linear.py).

What the attention computes (tests/unit/test_native_decode.py holds it to the torch path): for each decode row, the softmax
of scaled q·k over positions [start, end) of its sequence, times V; float32 and bfloat16 (AVX-512F), head
sizes that are multiples of 16 up to 256, any G = Hq / Hkv. Sums are in float32 in another order than torch's:
float32 results differ from SDPA's by ~1e-7, bfloat16 ones by up to one bf16 ulp. Soft-capped logits (Gemma2),
other dtypes (float16, an fp8 cache) and other devices keep the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from loguru import logger

from tgi_vlm.layers.attention.metadata import DecodeGroup, slot_bound

SOURCE = Path(__file__).with_name("native") / "decode_attention.c"
# Rotary + K/V store: bit-exact with torch's element-wise operations, so compiled without -ffast-math and
# without contracting a * b + c into one fused multiply-add (each product is rounded, as torch rounds it).
ROTARY_SOURCE = Path(__file__).with_name("native") / "rotary_kv.c"
ROTARY_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-c")
# RMSNorm in one pass: like the rotary, every operation rounded as torch's (no -ffast-math, no contraction).
NORM_SOURCE = Path(__file__).with_name("native") / "rms_norm.c"
HEADERS = (Path(__file__).with_name("native") / "bf16.h",)  # included by the scalar files: part of the cache key
# Float32 linears for few rows: intrinsics only (no -ffast-math: nothing to gain, and sums stay as written).
LINEAR_SOURCE = Path(__file__).with_name("native") / "skinny_linear.c"
LINEAR_FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fPIC", "-c")
ABI_VERSION = 1  # decode_attention.c's ABI_VERSION
# Compiled with -ffast-math (glibc's vector expf needs it) but linked without it: linked with it, GCC < 13 adds
# crtfastmath.o, whose constructor turns on flush-to-zero / denormals-are-zero for the whole process on load.
COMPILE_FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC", "-c")
LINK_FLAGS = ("-shared", "-fopenmp", "-lm")
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2}
MAX_HEAD_DIM = 256
BUILD_TIMEOUT_S = 120

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [ctypes.c_int, _P, _I64, _I64, _P, _P, _P, _I64, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64,
             ctypes.c_float, ctypes.c_int]


def cache_dir() -> Path:
    """Where built kernels are kept: $TGI_VLM_KERNEL_CACHE or ~/.cache/tgi-vlm/kernels."""
    configured = os.environ.get("TGI_VLM_KERNEL_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "tgi-vlm" / "kernels"


class NativeDecodeAttention:
    """The loaded library: which dtypes its decode attention computes, and the calls (decode attention, rotary + K/V
    store, RMSNorm, float32 skinny linears)."""

    def __init__(self, library: ctypes.CDLL, path: Path):
        self.path = path
        if library.tgi_vlm_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path.name} has ABI {library.tgi_vlm_abi_version()}, expected {ABI_VERSION}")
        self._fn = library.tgi_vlm_decode_attention
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = ctypes.c_int
        self._rotary = library.tgi_vlm_rotary_kv
        self._rotary.argtypes = [ctypes.c_int, _P, _I64, _I64, _I64, _I64, _I64, _P, _P, _I64, _P, _P, _P, _P, _P,
                                 ctypes.c_int]
        self._rotary.restype = ctypes.c_int
        self._linear = library.tgi_vlm_skinny_linear
        self._linear.argtypes = [_P, _I64, _I64, _P, _I64, _P, _P, ctypes.c_int]
        self._linear.restype = ctypes.c_int
        self.linear_max_rows = library.tgi_vlm_skinny_max_rows()
        self._norm = library.tgi_vlm_rms_norm
        self._norm.argtypes = [ctypes.c_int, _P, _I64, _P, _P, _I64, _I64, _I64, ctypes.c_float, ctypes.c_int]
        self._norm.restype = ctypes.c_int
        codes = library.tgi_vlm_decode_attention_dtypes()
        self.dtypes = frozenset(dtype for dtype, code in _DTYPE_CODES.items() if codes & code)

    def skinny_linear(self, x: torch.Tensor, blocked: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                      ) -> torch.Tensor:
        """float32 `x` `[rows, in]` (1 <= rows <= `linear_max_rows`, contiguous) times a weight in
        `skinny_linear.blocked_weight`'s layout, plus `bias` `[out]`: `[rows, out]`."""
        rows, in_features = x.shape
        if not (x.dtype == blocked.dtype == torch.float32 and x.is_contiguous() and blocked.is_contiguous()
                and 1 <= rows <= self.linear_max_rows and blocked.shape[1:] == (in_features, 16)
                and blocked.shape[0] == 2 * -(-out_features // 32) and blocked.data_ptr() % 64 == 0
                and (bias is None or (bias.dtype == torch.float32 and bias.shape == (out_features,)
                                      and bias.is_contiguous()))):
            raise ValueError(f"skinny_linear: inconsistent inputs (x {tuple(x.shape)} {x.dtype}, weight "
                             f"{tuple(blocked.shape)} {blocked.dtype}, {out_features} outputs)")
        out = torch.empty(rows, out_features, dtype=torch.float32)
        status = self._linear(x.data_ptr(), rows, in_features, blocked.data_ptr(), out_features,
                              None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads())
        if status == -2:
            raise MemoryError("skinny_linear: no memory for the transposed input")
        if status != 0:
            raise RuntimeError(f"skinny_linear refused {rows} rows of {in_features} -> {out_features}")
        return out

    def can_norm(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `rms_norm` takes `x` `[..., H]` (rows of H contiguous, as one strided run of rows) and `weight`."""
        return (x.device.type == "cpu" and x.dtype in _DTYPE_CODES and weight.dtype == x.dtype and x.dim() >= 2
                and x.stride(-1) == 1 and weight.shape == x.shape[-1:] and weight.is_contiguous()
                and all(x.stride(i) == x.stride(i + 1) * x.shape[i + 1] for i in range(x.dim() - 2)))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """transformers' Llama-family RMSNorm of `x` (a new contiguous tensor); None when `can_norm` says no (then the
        caller runs torch's operations). Outputs may differ from torch's in the last places (native/rms_norm.c: the
        sum of squares is in double; tests/unit/test_cpu_decoder.py holds them within 4 ulps)."""
        if not self.can_norm(x, weight):
            return None
        out = torch.empty(x.shape, dtype=x.dtype)
        hidden = x.shape[-1]
        rows = x.numel() // hidden if hidden else 0
        if rows:
            status = self._norm(_DTYPE_CODES[x.dtype], x.data_ptr(), x.stride(-2), weight.data_ptr(), out.data_ptr(),
                                hidden, rows, hidden, eps, torch.get_num_threads())
            if status != 0:
                raise RuntimeError(f"rms_norm refused dtype {x.dtype}")
        return out

    def supports_cache(self, k_cache: torch.Tensor) -> bool:
        """Whether decode over this layer's flat cache `[slots, Hkv, D]` can run here (the query must match it)."""
        head_dim = k_cache.shape[-1]
        return (k_cache.device.type == "cpu" and k_cache.dtype in self.dtypes and head_dim % 16 == 0
                and head_dim <= MAX_HEAD_DIM and k_cache.is_contiguous())

    def can_run(self, q: torch.Tensor, k_cache: torch.Tensor, softcap: float | None) -> bool:
        return (not softcap and q.dtype == k_cache.dtype and q.stride(-1) == 1 and q.shape[1] % k_cache.shape[1] == 0
                and self.supports_cache(k_cache))

    def can_rotate(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether `rotary_and_store` can take this layer's fused product (`[1, T, W]`), rotary tables
        (`[1, T, D]`) and flat cache."""
        return (qkv.device.type == "cpu" and qkv.dtype in _DTYPE_CODES and qkv.dim() == 3 and qkv.shape[0] == 1
                and qkv.stride(-1) == 1 and k_cache.dtype == qkv.dtype and k_cache.is_contiguous()
                and cos.dtype == qkv.dtype and sin.dtype == qkv.dtype and cos.shape == sin.shape
                and cos.dim() == 3 and cos.shape[:2] == qkv.shape[:2] and cos.shape[-1] == k_cache.shape[-1]
                and cos.stride() == sin.stride() and cos.stride(-1) == 1 and k_cache.shape[-1] % 2 == 0)

    def rotary_and_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, max_slot: int):
        """The lean layer's rotary of the query and key heads of `qkv` `[1, T, (Hq + 2 Hkv) D]`, bit-equal to
        `x * cos + rotate_half(x) * sin` in torch, and the torch backend's `write_kv` of the rotated keys and the
        values at `slots` (largest `max_slot`, computed once per step by the caller), in one pass. Returns query `[1, Hq, T, D]`, key and value `[1, Hkv, T, D]` (views)."""
        _, tokens, width = qkv.shape
        kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
        if width != (q_heads + 2 * kv_heads) * head_dim or slots.shape != (tokens,) or slots.dtype != torch.long:
            raise ValueError(f"rotary_and_store: a fused product of width {width} does not hold {q_heads} + 2 x "
                             f"{kv_heads} heads of {head_dim}, or {tuple(slots.shape)} slots for {tokens} rows")
        if max_slot >= k_cache.shape[0]:
            raise ValueError("rotary_and_store: a slot past the cache, or negative")
        slots = slots.contiguous()
        q = torch.empty(tokens, q_heads, head_dim, dtype=qkv.dtype)
        k = torch.empty(tokens, kv_heads, head_dim, dtype=qkv.dtype)
        status = self._rotary(_DTYPE_CODES[qkv.dtype], qkv.data_ptr(), qkv.stride(1), tokens, q_heads, kv_heads,
                              head_dim, cos.data_ptr(), sin.data_ptr(), cos.stride(1), q.data_ptr(), k.data_ptr(),
                              k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"rotary_and_store refused dtype {qkv.dtype}, head_dim {head_dim}")
        value = qkv[0, :, (q_heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
        return q.transpose(0, 1)[None], k.transpose(0, 1)[None], value.transpose(0, 1)[None]

    def attend(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               step: NativeDecodeStep, scaling: float | None, sliding_window: int | None, chunk: int | None) -> None:
        """Decode rows of `q` `[T, Hq, D]` (rows `step.rows`) attend over their cached positions; results go to the
        same rows of `out` (same shape, last dim contiguous). Other rows of `out` are not touched."""
        if not (out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
                and v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype and v_cache.is_contiguous()
                and q.shape[-1] == k_cache.shape[-1] and step.max_slot < k_cache.shape[0]
                and step.max_row < q.shape[0]):
            # The C code indexes raw memory: what the torch path would refuse with an IndexError must not reach it.
            raise ValueError(f"native decode attention: inconsistent inputs (q {tuple(q.shape)}, out "
                             f"{tuple(out.shape)}, cache {tuple(k_cache.shape)}/{tuple(v_cache.shape)}, "
                             f"largest slot {step.max_slot})")
        starts, ends = step.bounds(sliding_window, chunk)
        _, hq, head_dim = q.shape
        scale = scaling if scaling is not None else head_dim ** -0.5
        status = self._fn(_DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(),
                          v_cache.data_ptr(), step.slot_index.data_ptr(), step.slot_index.shape[1],
                          step.rows.data_ptr(), starts.data_ptr(), ends.data_ptr(), out.data_ptr(), out.stride(0),
                          out.stride(1), step.num_rows, hq, k_cache.shape[1], head_dim, scale, torch.get_num_threads())
        if status == -2:
            raise MemoryError("native decode attention: no memory for a thread's scratch buffers")
        if status != 0:  # can_run checked what the library checks: this is a bug, not bad input
            raise RuntimeError(f"native decode attention refused dtype {q.dtype}, head_dim {head_dim}")


@dataclass
class NativeDecodeStep:
    """One step's decode rows for the native kernel (`AttentionMetadata.backend_state`): host-made, shared by the
    layers. Positions [start, end) of row b are attended: end = kv_len; start from the sliding window and
    Llama4's attention chunk, the same positions `metadata.decode_mask` lets through."""

    group: DecodeGroup
    rows: torch.Tensor = field(init=False)
    slot_index: torch.Tensor = field(init=False)
    max_slot: int = field(init=False)  # checked by `attend` against each layer's cache, computed once here
    max_row: int = field(init=False)
    _bounds: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        self.rows = self.group.rows.contiguous()
        self.slot_index = self.group.slot_index.contiguous()
        if max(self.group.kv_len_list, default=0) > self.slot_index.shape[1] or self.slot_index.shape[0] != self.num_rows:
            raise ValueError("decode group: a kv_len exceeds its slot index, or rows and slot index disagree")
        self.max_slot = slot_bound(self.slot_index, empty=0)
        self.max_row = max(self.group.row_list, default=-1)

    @property
    def num_rows(self) -> int:
        return len(self.group.row_list)

    def bounds(self, sliding_window: int | None, chunk: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        key = (sliding_window, chunk)
        if key not in self._bounds:
            starts = []
            for length in self.group.kv_len_list:
                start = 0
                if sliding_window:
                    start = max(start, length - sliding_window)
                if chunk:
                    start = max(start, (length - 1) // chunk * chunk)
                starts.append(start)
            self._bounds[key] = (torch.tensor(starts, dtype=torch.long), torch.tensor(self.group.kv_len_list,
                                                                                      dtype=torch.long))
        return self._bounds[key]


@functools.cache
def load() -> NativeDecodeAttention | None:
    """The kernel library, built on first use and cached on disk; None (with the reason logged) where it cannot
    run. Once per process."""
    reason = _unsupported_platform()
    if reason is None:
        try:
            path = _build()
            native = NativeDecodeAttention(ctypes.CDLL(str(path)), path)
        except (OSError, subprocess.SubprocessError, RuntimeError) as error:
            reason = f"building or loading {SOURCE.name} failed: {error}"
        else:
            if not native.dtypes:
                reason = "this CPU has no AVX-512"
            else:
                logger.info("native decode attention: {} ({})", path.name,
                            ", ".join(sorted(str(d).removeprefix("torch.") for d in native.dtypes)))
                return native
    logger.warning("native decode attention unavailable ({}); decode attention stays on the torch path", reason)
    return None


def _unsupported_platform() -> str | None:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"built only on x86-64 Linux, not {sys.platform}/{platform.machine()}"
    if _compiler() is None:
        return "no C compiler (set CC, or install gcc)"
    return None


def _compiler() -> list[str] | None:
    """The C compiler command: $CC (split as a shell would: "ccache gcc"), else cc, else gcc."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def _build() -> Path:
    """Compile the source into the cache unless a library for the same key is there; returns its path."""
    compiler = _compiler()
    key = _cache_key(compiler)
    target = cache_dir() / f"decode_attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: two shards starting together never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built, obj, rotary_obj, norm_obj, linear_obj = (Path(scratch) / name for name in (
            target.name, "decode_attention.o", "rotary_kv.o", "rms_norm.o", "skinny_linear.o"))
        for command in ([*compiler, *COMPILE_FLAGS, str(SOURCE), "-o", str(obj)],
                        [*compiler, *ROTARY_FLAGS, str(ROTARY_SOURCE), "-o", str(rotary_obj)],
                        [*compiler, *ROTARY_FLAGS, str(NORM_SOURCE), "-o", str(norm_obj)],
                        [*compiler, *LINEAR_FLAGS, str(LINEAR_SOURCE), "-o", str(linear_obj)],
                        [*compiler, str(obj), str(rotary_obj), str(norm_obj), str(linear_obj), "-o", str(built),
                         *LINK_FLAGS]):
            result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if result.returncode != 0:
                raise RuntimeError(f"{command[0]} exited {result.returncode}: {result.stderr.strip()[-800:]}")
        os.replace(built, target)
    logger.info("native decode attention built into {}", target)
    return target


def _cache_key(compiler: list[str]) -> str:
    """Source, ABI, flags, the compiler's identity and the CPU's feature flags (-march=native builds for them)."""
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update(ROTARY_SOURCE.read_bytes())
    digest.update(NORM_SOURCE.read_bytes())
    for header in HEADERS:
        digest.update(header.read_bytes())
    digest.update(LINEAR_SOURCE.read_bytes())
    digest.update(repr((ABI_VERSION, COMPILE_FLAGS, ROTARY_FLAGS, LINEAR_FLAGS, LINK_FLAGS, compiler)).encode())
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30)
    digest.update(version.stdout.encode())
    digest.update(_cpu_flags().encode())
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    wanted = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                name = line.split(":", 1)[0].strip()
                if name in ("model name", "flags") and name not in wanted:
                    wanted[name] = line
                if len(wanted) == 2:
                    break
    except OSError:
        pass
    return "".join(wanted.values()) or platform.processor()
