"""Compiling the C sources (csrc/) into shared libraries, kept in an on-disk cache.

The first process on a machine compiles each library with the system C compiler (`KernelSettings.cc`, else `cc`,
else `gcc`) for this CPU (`-march=native`), into `KernelSettings.kernel_cache_dir` under a name keyed by
everything that makes the binary: the sources and headers, the flags, the compiler's command and `--version`, and
the CPU's model and feature flags. Later processes load the cached file. A library is built beside its target and
renamed into place, so two shards starting together never load a half-written file.

Two libraries, so that what runs anywhere is not lost where the rest cannot run:
- `portable`: rotary_kv.c and rms_norm.c, scalar C, on any x86-64 Linux with a C compiler;
- `avx512`: decode_attention.c, skinny_linear.c, greedy.c and grouped_linear.c, AVX-512 intrinsics; not built on a CPU without AVX-512F.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

CSRC = Path(__file__).with_name("csrc")
BUILD_TIMEOUT_S = 120

# Rotary + K/V store and RMSNorm: bit-exact with torch's element-wise operations (the norm up to its sum of squares),
# so compiled without -ffast-math and without contracting a * b + c into one fused multiply-add (each product is
# rounded, as torch rounds it).
SCALAR_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-c")
# Decode attention and the greedy choice's logsumexp: compiled with -ffast-math (glibc's vector expf needs it) but linked without it: linked with it,
# GCC < 13 adds crtfastmath.o, whose constructor turns on flush-to-zero / denormals-are-zero for the whole process on
# load.
ATTENTION_FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC", "-c")
# Float32 linears for few rows: intrinsics only (no -ffast-math: nothing to gain, and sums stay as written).
LINEAR_FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fPIC", "-c")
# Quantized (int8-grouped) weights: as LINEAR_FLAGS, and no contraction either, so the de-quantized weight is
# scale * code - offset rounded twice, bit for bit the gguf package's values.
GROUPED_FLAGS = (*LINEAR_FLAGS[:-1], "-ffp-contract=off", "-c")
LINK_FLAGS = ("-shared", "-fopenmp", "-lm")


@dataclass(frozen=True)
class Source:
    name: str  # a file of csrc/
    flags: tuple[str, ...]

    @property
    def path(self) -> Path:
        return CSRC / self.name


@dataclass(frozen=True)
class LibrarySpec:
    """One shared library: its sources (each with its compile flags), the headers they include (part of the cache
    key), and the CPU feature it needs (a /proc/cpuinfo flag and its name; None: any x86-64)."""

    name: str
    sources: tuple[Source, ...]
    headers: tuple[str, ...] = ()
    needs_cpu_flag: str | None = None
    needs_cpu_feature: str | None = None

    def file_name(self, key: str) -> str:
        return f"tgi_vlm_{self.name}-{key}.so"


PORTABLE = LibrarySpec("portable", (Source("rotary_kv.c", SCALAR_FLAGS), Source("rms_norm.c", SCALAR_FLAGS)),
                       headers=("bf16.h",))
AVX512 = LibrarySpec("avx512", (Source("decode_attention.c", ATTENTION_FLAGS), Source("skinny_linear.c", LINEAR_FLAGS),
                                Source("greedy.c", ATTENTION_FLAGS), Source("grouped_linear.c", GROUPED_FLAGS)),
                     headers=("amx.h",), needs_cpu_flag="avx512f", needs_cpu_feature="AVX-512")
LIBRARIES = (PORTABLE, AVX512)


def unsupported_platform(compiler: list[str] | None) -> str | None:
    """Why nothing can be built here, or None."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"built only on x86-64 Linux, not {sys.platform}/{platform.machine()}"
    if compiler is None:
        return "no C compiler (set CC, or install gcc)"
    return None


def compiler_command(cc: str | None) -> list[str] | None:
    """The C compiler command: `cc` (KernelSettings.cc, split as a shell would: "ccache gcc"), else cc, else gcc."""
    if cc:
        return shlex.split(cc)
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def build(spec: LibrarySpec, cache_dir: Path, compiler: list[str], cpu_flags: str) -> Path:
    """The library's path in `cache_dir`, compiled unless a library of the same key is there. Raises RuntimeError
    (with the compiler's message) when a command fails."""
    target = cache_dir / spec.file_name(cache_key(spec, compiler, cpu_flags))
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        objects = [Path(scratch) / f"{Path(source.name).stem}.o" for source in spec.sources]
        commands = [[*compiler, *source.flags, str(source.path), "-o", str(obj)]
                    for source, obj in zip(spec.sources, objects)]
        commands.append([*compiler, *map(str, objects), "-o", str(built), *LINK_FLAGS])
        for command in commands:
            result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if result.returncode != 0:
                raise RuntimeError(f"{command[0]} exited {result.returncode}: {result.stderr.strip()[-800:]}")
        os.replace(built, target)
    logger.info("native kernels: built {}", target)
    return target


def cache_key(spec: LibrarySpec, compiler: list[str], cpu_flags: str) -> str:
    """Sources, headers, flags, the compiler's identity and the CPU's feature flags (-march=native builds for them)."""
    digest = hashlib.sha256()
    for source in spec.sources:
        digest.update(source.path.read_bytes())
    for header in spec.headers:
        digest.update((CSRC / header).read_bytes())
    digest.update(repr(([(s.name, s.flags) for s in spec.sources], LINK_FLAGS, compiler)).encode())
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30)
    digest.update(version.stdout.encode())
    digest.update(cpu_flags.encode())
    return digest.hexdigest()[:16]


def cpu_flags() -> str:
    """This CPU's model name and feature flags (/proc/cpuinfo's first "model name" and "flags" lines)."""
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


def has_cpu_flag(flags: str, flag: str) -> bool:
    """Whether `flag` is one of the words of the "flags" line in `flags` (`cpu_flags`)."""
    for line in flags.splitlines():
        if line.split(":", 1)[0].strip() == "flags":
            return flag in line.split(":", 1)[1].split()
    return False
