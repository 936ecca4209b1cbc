"""The built libraries loaded with ctypes, and which ops this process can run (`load`).

`load(settings)` builds (or finds in the cache) and loads both libraries once per process; the ops (ops.py) call
into what it loaded. A library that cannot load here is logged once with the reason, and its ops report that reason
(`CpuKernels.reason`); their callers then run torch's operations.
"""

from __future__ import annotations

import ctypes
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from loguru import logger

from tgi_vlm.config import KernelSettings
from tgi_vlm.kernels.cpu import build

ABI_VERSION = 1  # decode_attention.c's ABI_VERSION
DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2}  # the C files' DTYPE_* values

_P, _I64, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def _bind(library: ctypes.CDLL, name: str, argtypes: list) -> ctypes._CFuncPtr:
    fn = getattr(library, name)
    fn.argtypes = argtypes
    fn.restype = _INT
    return fn


class PortableLibrary:
    """rotary_kv.c and rms_norm.c."""

    def __init__(self, library: ctypes.CDLL, path: Path):
        self.path = path
        self.rotary_kv = _bind(library, "tgi_vlm_rotary_kv",
                               [_INT, _P, _I64, _I64, _I64, _I64, _I64, _P, _P, _I64, _P, _P, _P, _P, _P, _INT])
        self.rms_norm = _bind(library, "tgi_vlm_rms_norm", [_INT, _P, _I64, _P, _P, _I64, _I64, _I64, _FLOAT, _INT])
        self.gemma_rms_norm = _bind(library, "tgi_vlm_gemma_rms_norm",
                                    [_INT, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _FLOAT, _INT])
        self.gemma_rms_norm_add = _bind(library, "tgi_vlm_gemma_rms_norm_add",
                                        [_INT, _P, _P, _P, _P, _I64, _I64, _FLOAT, _INT])


class Avx512Library:
    """decode_attention.c, skinny_linear.c, greedy.c and grouped_linear.c; `attention_dtypes`: the dtypes its decode attention computes (none
    when built without AVX-512), `skinny_max_rows` / `skinny_bf16_max_rows`: the most rows its float32 / bfloat16
    linear takes (0: none; the bf16 one needs AVX512-BF16), `amx_max_rows`: the most its bf16 linear runs on AMX
    tiles (0: no AMX)."""

    def __init__(self, library: ctypes.CDLL, path: Path):
        self.path = path
        if library.tgi_vlm_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path.name} has ABI {library.tgi_vlm_abi_version()}, expected {ABI_VERSION}")
        self.decode_attention = _bind(library, "tgi_vlm_decode_attention",
                                      [_INT, _P, _I64, _I64, _P, _P, _P, _I64, _P, _P, _P, _P, _I64, _I64, _I64, _I64,
                                       _I64, _I64, _FLOAT, _INT])
        self.skinny_linear = _bind(library, "tgi_vlm_skinny_linear", [_P, _I64, _I64, _P, _I64, _P, _P, _INT])
        self.skinny_max_rows = library.tgi_vlm_skinny_max_rows()
        self.skinny_linear_bf16 = _bind(library, "tgi_vlm_skinny_linear_bf16",
                                        [_P, _I64, _I64, _P, _I64, _P, _P, _INT, _INT])
        self.skinny_bf16_max_rows = library.tgi_vlm_skinny_bf16_max_rows()  # 0: built without AVX512-BF16
        self.amx_max_rows = library.tgi_vlm_amx_max_rows()  # 0: no AMX tiles here (built without, or refused)
        self.greedy_logsumexp = _bind(library, "tgi_vlm_greedy_logsumexp", [_P, _I64, _I64, _I64, _P, _P, _P, _INT])
        self.grouped_int8_linear = _bind(library, "tgi_vlm_grouped_int8_linear",
                                         [_P, _INT, _I64, _I64, _P, _I64, _P, _P, _I64, _P, _INT])
        self.grouped_int8_dequantize = _bind(library, "tgi_vlm_grouped_int8_dequantize",
                                             [_P, _I64, _I64, _P, _P, _I64, _P, _INT, _INT])
        self.grouped_packed_linear = _bind(library, "tgi_vlm_grouped_packed_linear",
                                           [_P, _INT, _I64, _I64, _P, _P, _INT, _I64, _P, _P, _I64, _P, _INT])
        self.grouped_packed_dequantize = _bind(library, "tgi_vlm_grouped_packed_dequantize",
                                               [_P, _P, _INT, _I64, _I64, _P, _P, _I64, _P, _INT, _INT])
        self.grouped_packed = bool(library.tgi_vlm_grouped_packed_supported())  # AVX512-BW/VL: packed 4/5-bit codes
        codes = library.tgi_vlm_decode_attention_dtypes()
        self.attention_dtypes = frozenset(dtype for dtype, code in DTYPE_CODES.items() if codes & code)


# Which library holds each op (ops.py registers them as tgi_vlm::<name>).
OP_LIBRARY = {"rotary_and_store": "portable", "rms_norm": "portable", "gemma_rms_norm": "portable",
              "gemma_rms_norm_add": "portable",
              "decode_attention": "avx512",
              "skinny_linear": "avx512", "skinny_linear_bf16": "avx512", "greedy_logsumexp": "avx512",
              "grouped_int8_linear": "avx512", "grouped_int8_dequantize": "avx512",
              "grouped_packed_linear": "avx512", "grouped_packed_dequantize": "avx512"}
_PACKED_OPS = ("grouped_packed_linear", "grouped_packed_dequantize")  # need AVX512-BW/VL too (Avx512Library.grouped_packed)
_BINDINGS = {"portable": PortableLibrary, "avx512": Avx512Library}


@dataclass(frozen=True)
class LibraryState:
    """One library's load outcome: the loaded library, or why not; `unsupported`: the reason is something this
    machine lacks (platform, compiler, CPU feature), not a failure of something that should have worked."""

    library: PortableLibrary | Avx512Library | None
    reason: str | None = None
    unsupported: bool = False


@dataclass(frozen=True)
class CpuKernels:
    """What loaded in this process, by library name ("portable", "avx512")."""

    libraries: dict[str, LibraryState]

    @property
    def portable(self) -> PortableLibrary | None:
        return self.libraries["portable"].library

    @property
    def avx512(self) -> Avx512Library | None:
        return self.libraries["avx512"].library

    def state(self, op: str) -> LibraryState:
        if op not in OP_LIBRARY:
            raise KeyError(f"unknown native op {op!r}; known: {', '.join(sorted(OP_LIBRARY))}")
        return self.libraries[OP_LIBRARY[op]]

    def available(self, op: str) -> bool:
        library = self.state(op).library
        return library is not None and (op not in _PACKED_OPS or library.grouped_packed)

    def reason(self, op: str) -> str | None:
        """Why `op` is not available here (None: it is)."""
        if self.state(op).library is not None and not self.available(op):
            return "built without AVX512-BW/VL (byte-wise masked adds)"
        return self.state(op).reason

    def summary(self) -> str:
        """One line: which ops loaded, and why the others did not."""
        loaded = [op for op in OP_LIBRARY if self.available(op)]
        missing: dict[str, list[str]] = {}
        for op in OP_LIBRARY:
            if not self.available(op):
                missing.setdefault(self.reason(op), []).append(op)
        parts = [f"loaded {', '.join(loaded)}" if loaded else "none loaded"]
        parts += [f"{', '.join(ops)} unavailable ({reason})" for reason, ops in missing.items()]
        return "native CPU kernels: " + "; ".join(parts)


def load_libraries(cache_dir: Path, compiler: list[str] | None, cpu_flags: str) -> CpuKernels:
    """Build and load every library that can run on a CPU with `cpu_flags` (`build.cpu_flags()`'s format)."""
    platform_reason = build.unsupported_platform(compiler)
    libraries = {}
    for spec in build.LIBRARIES:
        if platform_reason is not None:
            libraries[spec.name] = LibraryState(None, platform_reason, unsupported=True)
        elif spec.needs_cpu_flag and not build.has_cpu_flag(cpu_flags, spec.needs_cpu_flag):
            libraries[spec.name] = LibraryState(None, f"this CPU has no {spec.needs_cpu_feature}", unsupported=True)
        else:
            libraries[spec.name] = _load_one(spec, cache_dir, compiler, cpu_flags)
    return CpuKernels(libraries)


def _load_one(spec: build.LibrarySpec, cache_dir: Path, compiler: list[str], cpu_flags: str) -> LibraryState:
    try:
        path = build.build(spec, cache_dir, compiler, cpu_flags)
        library = _BINDINGS[spec.name](ctypes.CDLL(str(path)), path)
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        return LibraryState(None, f"building or loading the {spec.name} library failed: {error}")
    if isinstance(library, Avx512Library) and not library.attention_dtypes:
        # the CPU said AVX-512F but the compiler built the fallback (its -march=native knows no AVX-512 here)
        return LibraryState(None, f"{path.name} was built without AVX-512", unsupported=True)
    return LibraryState(library)


_lock = threading.Lock()
_loaded: CpuKernels | None = None


def load(settings: KernelSettings) -> CpuKernels:
    """The process's kernels: built on the first call (with that call's compiler and cache directory; later calls
    return the same libraries) and cached on disk. Libraries that cannot load are logged once, with the reason."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = load_libraries(settings.kernel_cache_dir, build.compiler_command(settings.cc), build.cpu_flags())
            _log(_loaded)
        return _loaded


def loaded() -> CpuKernels | None:
    """What `load` loaded, or None before its first call."""
    return _loaded


def _log(kernels: CpuKernels) -> None:
    for name, state in kernels.libraries.items():
        if state.library is not None:
            logger.info("native kernels: {} library {}", name, state.library.path.name)
        else:
            ops = ", ".join(op for op, lib in OP_LIBRARY.items() if lib == name)
            logger.warning("native kernels {} unavailable ({}); their callers run torch's operations", ops, state.reason)
