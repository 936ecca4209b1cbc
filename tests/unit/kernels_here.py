"""Which native CPU kernels run on this machine, for the tests that need them (not a test module).

Only what the machine lacks skips (no x86-64 Linux, no compiler, no AVX-512: the loader's reason is the skip
message); where an op should load, failing to load fails its tests."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from tgi_vlm.config import KernelSettings
from tgi_vlm.kernels import cpu


def kernels() -> cpu.CpuKernels:
    return cpu.load(KernelSettings())


def needs(op: str) -> pytest.MarkDecorator:
    """Skip where `op` cannot run on this machine, saying why."""
    loaded, state = kernels(), kernels().state(op)
    lacking = state.library is None and state.unsupported
    lacking_feature = state.library is not None and not loaded.available(op)  # e.g. packed codes without AVX512-BW
    return pytest.mark.skipif(lacking or lacking_feature,
                              reason=f"tgi_vlm::{op} is not available here: {loaded.reason(op)}")


def require(op: str) -> cpu.CpuKernels:
    """The kernels, with `op` loaded (a test failure where it should have and did not)."""
    loaded = kernels()
    assert loaded.available(op), f"tgi_vlm::{op} should load on this machine but did not: {loaded.reason(op)}"
    return loaded


@contextmanager
def op_calls() -> Iterator[Counter]:
    """Counts of the `tgi_vlm::` ops called inside the block, as the profiler names them (filled on exit)."""
    counts: Counter = Counter()
    with torch.autograd.profiler.profile(use_kineto=False) as profile:
        yield counts
    counts.update(e.name for e in profile.function_events if e.name.startswith("tgi_vlm::"))
