"""The machine facts every benchmark report starts with (CPU, cores, threads, versions, load)."""

from __future__ import annotations

import os
import platform

import torch
import transformers


def machine() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return dict(cpu=cpu, cores=os.cpu_count(), torch_threads=torch.get_num_threads(), torch=torch.__version__,
                transformers=transformers.__version__, python=platform.python_version(),
                load_avg_1m=os.getloadavg()[0])  # other processes on the same cores skew every number
