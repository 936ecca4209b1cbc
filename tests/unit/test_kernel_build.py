"""kernels/cpu/build.py and library.py: libraries built once into a cache keyed by what made them, scratch never
left behind, a failing compiler an error rather than a library; the portable kernels load on a CPU without AVX-512
(only decode attention and the skinny linears are missing there); loading keeps subnormal floats."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tgi_vlm.kernels.cpu import build, library

COMPILER = build.compiler_command(None)
NOT_BUILT_HERE = build.unsupported_platform(COMPILER)
needs_a_build = pytest.mark.skipif(NOT_BUILT_HERE is not None, reason=f"nothing is built here: {NOT_BUILT_HERE}")
NO_AVX512 = "model name\t: Test CPU\nflags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2\n"


@needs_a_build
def test_a_library_is_built_once_per_key_and_no_scratch_is_left(tmp_path):
    built = build.build(build.PORTABLE, tmp_path, COMPILER, build.cpu_flags())
    assert built.parent == tmp_path and built.exists() and built.name.startswith("tgi_vlm_portable-")
    stamp = built.stat().st_mtime_ns
    assert build.build(build.PORTABLE, tmp_path, COMPILER, build.cpu_flags()) == built
    assert built.stat().st_mtime_ns == stamp  # loaded, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [built.name]


@needs_a_build
def test_the_key_follows_the_cpu_and_the_compiler():
    key = build.cache_key(build.PORTABLE, COMPILER, NO_AVX512)
    assert build.cache_key(build.PORTABLE, COMPILER, NO_AVX512) == key
    assert build.cache_key(build.PORTABLE, COMPILER, NO_AVX512 + " avx512f") != key
    assert build.cache_key(build.PORTABLE, [*COMPILER, "-m64"], NO_AVX512) != key  # another command
    assert build.cache_key(build.AVX512, COMPILER, NO_AVX512) != key


def test_a_failing_compiler_is_an_error_not_a_library(tmp_path):
    with pytest.raises(RuntimeError, match="false exited 1"):
        build.build(build.PORTABLE, tmp_path, ["false"], NO_AVX512)
    assert list(tmp_path.iterdir()) == []


@needs_a_build
def test_the_portable_kernels_load_on_a_cpu_without_avx512(tmp_path):
    kernels = library.load_libraries(tmp_path, COMPILER, NO_AVX512)
    assert kernels.available("rotary_and_store") and kernels.available("rms_norm")
    assert not kernels.available("decode_attention") and not kernels.available("skinny_linear")
    assert kernels.reason("decode_attention") == "this CPU has no AVX-512" and kernels.state("skinny_linear").unsupported
    assert [p.name.split("-")[0] for p in tmp_path.iterdir()] == ["tgi_vlm_portable"]  # the other was not built
    assert kernels.summary() == ("native CPU kernels: loaded rotary_and_store, rms_norm, gemma_rms_norm, gemma_rms_norm_add; "
                                 "decode_attention, skinny_linear, skinny_linear_bf16, greedy_logsumexp, "
                                 "grouped_int8_linear, grouped_int8_dequantize, grouped_packed_linear, "
                                 "grouped_packed_dequantize unavailable (this CPU has no AVX-512)")


def test_without_a_compiler_nothing_loads_and_every_op_says_why(tmp_path):
    kernels = library.load_libraries(tmp_path, None, NO_AVX512)
    reasons = {op: kernels.reason(op) for op in library.OP_LIBRARY}
    expected = NOT_BUILT_HERE if NOT_BUILT_HERE is not None else "no C compiler (set CC, or install gcc)"
    assert set(reasons.values()) == {expected} and all(kernels.state(op).unsupported for op in reasons)
    assert list(tmp_path.iterdir()) == []


def test_a_library_that_fails_to_build_is_a_failure_not_a_missing_feature(tmp_path):
    kernels = library.load_libraries(tmp_path, ["false"], NO_AVX512)
    state = kernels.state("rms_norm")
    assert state.library is None and not state.unsupported and "false exited 1" in state.reason


def test_loading_the_kernels_keeps_subnormal_floats():
    """Linked with -ffast-math, GCC < 13 would add crtfastmath.o, whose constructor turns on flush-to-zero for the
    whole process when the library loads: every torch computation would change. A fresh process checks it."""
    code = ("import torch; from tgi_vlm.config import KernelSettings; from tgi_vlm.kernels import cpu; "
            "print(cpu.load(KernelSettings()).summary()); "
            "x = torch.tensor([1e-40]); assert (x * 1.0).item() > 0, 'subnormals flushed'; print('kept')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "kept" in result.stdout, result.stderr[-2000:]
