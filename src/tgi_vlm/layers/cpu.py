"""Serving on CPU: process-wide tuning, and the CPU linear plan with the lean decoder layers on top.

Costs a profile of the serving step shows on CPU and that transformers' eager modeling does not avoid
(benchmarks/results/cpu-profile.md has the figures):

- Allocation churn. Activations of a prefill step are megabytes; glibc serves blocks above its mmap threshold
  with fresh mmap'd pages and unmaps them on free, so every large temporary costs page faults and zeroing.
  `tune_allocator` keeps freed memory in the heap for reuse.
- oneDNN's kernel cache. Packed bf16 products build (JIT) a kernel per row bucket; `size_kernel_cache` lets
  oneDNN keep the ones warmup primes.
- The products themselves: which kernel each linear layer and patch convolution computes with (packed oneDNN
  bf16, MKL float32, the native skinny loop, fused q/k/v and gate/up) is the linear plan's business
  (layers/linear/plan.py), asked for here with what this process allows (`PlanOptions`): a second float32 copy
  for decode-sized products only where it is cheap (`decode_copies_fit`), the native loop where it loads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import torch
from loguru import logger

from tgi_vlm.config import KernelSettings
from tgi_vlm.layers.linear.plan import LinearPlan, PlanOptions, plan_linears

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_KEEP_BYTES = 1 << 30  # allocations up to 1 GiB come from the heap; up to 1 GiB of free heap is kept
KERNEL_CACHE_CAPACITY = 4096  # oneDNN kernels kept (its default: 1024)

_tuned = False


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


_OMP_PAUSE_SOFT = 1  # omp.h: omp_pause_soft


def release_openmp_threads() -> bool:
    """Give back the calling thread's OpenMP worker threads (`omp_pause_resource_all(omp_pause_soft)`, libgomp).

    The shard loads its model on the main thread and runs it on its model thread (server/service.py). libgomp keeps
    a worker pool for each thread that ran a parallel region, and once the pools' threads outnumber the CPUs it stops
    spinning between regions (its throttled spin: ~100 spins), so every parallel region of the model thread waits
    for sleeping workers to wake. On 2 cores, 72 small torch ops (gelu of 16 x 4096 bf16) took 1.56 ms on the main
    thread and 6.38 ms on another thread once the main thread had run one parallel region, 1.59 ms after this call
    (benchmarks/openmp_threads.py, results/openmp_threads.md); a Gemma 3 270M decode step 25.3 ms on the loading thread, 34.8 on another. Called on the loading thread
    when the model is loaded; a later region there would make a new pool (nothing does). Returns whether it ran."""
    try:
        status = ctypes.CDLL("libgomp.so.1").omp_pause_resource_all(_OMP_PAUSE_SOFT)
    except (OSError, AttributeError):  # no libgomp in this process (another OpenMP runtime, or none)
        logger.info("OpenMP: the loading thread's worker threads not released (no libgomp)")
        return False
    logger.info("OpenMP: the loading thread's worker threads {}",
                "released" if status == 0 else f"not released (omp_pause_resource_all returned {status})")
    return status == 0


def size_kernel_cache() -> None:
    """Let oneDNN keep the kernels the packed products need (`prime_packed_kernels` builds them at warmup).

    Its primitive cache holds 1024 kernels by default, fewer than priming the bench model builds: a building
    pass after 64 image prefills took 1.44-1.52 s at 1024 (kernels evicted, rebuilt) and 0.36-0.44 s at 4096
    (`benchmarks/kernel_priming.py`). An evicted kernel is rebuilt, ~2 ms, by the next step that
    needs it. oneDNN reads ONEDNN_PRIMITIVE_CACHE_CAPACITY once, when it first builds a kernel, so this runs
    before the first forward (`speed_up_for_cpu`); a value the user set is kept."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(KERNEL_CACHE_CAPACITY))


def decode_copies_fit(model: torch.nn.Module) -> bool:
    """Whether packed linears may keep a second copy of their weights: float32 ones for decode-sized products (the
    native loop's, or the plain weight for oneDNN's one-row products), and a tied lm-head of either dtype its
    packed copy beside the embedding's plain weight. True when the float32 and bfloat16 linear weights take at most
    1/16 of the memory this process may use, so a second copy is cheap. (bf16 counts since the tied head needs it:
    Gemma 3 270M's 262,144 x 640 head, one bf16 row, F.linear 23.2 ms vs the packed copy 15.6 ms on the AMX host.)"""
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                       if isinstance(m, torch.nn.Linear) and m.weight.dtype in (torch.float32, torch.bfloat16)
                       and not m.weight.is_meta)  # a quantized layer's placeholder: its kernel holds int8 codes
    memory = _usable_memory()
    return memory is not None and 0 < weight_bytes <= memory // 16


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


def speed_up_for_cpu(model: torch.nn.Module, *, language_model: torch.nn.Module | None = None,
                     sharded: bool = False, kernels: KernelSettings | None = None) -> LinearPlan:
    """All of the above for a model about to serve on CPU, and its linear plan (layers/linear/plan.py: packed,
    fused kernels; logged); `language_model`'s Llama-family decoder layers also take the lean forward
    (layers/cpu_decoder.py), with the native kernels `kernels` switches on (None: the defaults).

    A tensor-parallel model keeps plain `F.linear` products (its plan hooks the modules). `kernels.cpu_speedups`
    off (TGI_VLM_CPU_SPEEDUPS=0, for benchmarks that measure what it buys): every layer `torch`, nothing else."""
    kernels = kernels or KernelSettings()
    if not kernels.cpu_speedups:
        logger.info("TGI_VLM_CPU_SPEEDUPS=0: CPU speed-ups off")
        return plan_linears(model, PlanOptions(cpu=False), language_model=language_model)
    from tgi_vlm.layers.cpu_decoder import install_lean_layers
    from tgi_vlm.layers.linear.grouped import grouped_native_available
    from tgi_vlm.layers.skinny_linear import skinny_available, skinny_bf16_available

    tune_allocator()
    size_kernel_cache()
    decode_copy = decode_copies_fit(model)
    options = PlanOptions(cpu=True, sharded=sharded, decode_copy=decode_copy,
                          skinny=decode_copy and not sharded and skinny_available(kernels),
                          skinny_bf16=decode_copy and not sharded and skinny_bf16_available(kernels),
                          grouped_int8=grouped_native_available(kernels))
    plan = plan_linears(model, options, language_model=language_model)
    # after fusing: a lean layer slices its fused products itself (layers/cpu_decoder.py)
    lean = install_lean_layers(language_model, kernels) if plan.groups and language_model is not None else 0
    logger.info("CPU: {} patch-embedding convolution(s) run as matmuls; {} q/k/v or gate/up group(s) fused; {} "
                "decoder layer(s) with the lean forward", len(plan.patch_convs), len(plan.groups), lean)
    return plan
