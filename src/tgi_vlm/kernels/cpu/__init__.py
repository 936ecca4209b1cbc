"""The native CPU kernels: `load(settings)` builds and loads them once per process; `ops` are the torch ops
(`torch.ops.tgi_vlm.*`). See ops.py for what each computes and checks, build.py for how they are built."""

from tgi_vlm.kernels.cpu import ops
from tgi_vlm.kernels.cpu.library import CpuKernels, load, loaded

__all__ = ["CpuKernels", "load", "loaded", "ops"]
