"""`tgi-vlm bench --profile`: py-spy samples the shard (rank 0) during the measured run; the samples are
summed into buckets named after where a shard spends its time (benchmarks/profile_summary.py reads the
raw file for more)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

# Frames that name where a shard spends its time, outermost first wins the sample.
PROFILE_BUCKETS = [
    ("vision tower", ("get_image_features", "encode (")),
    ("processor / tokenize", ("tokenize_request", "media_inputs", "process (")),
    ("language model forward", ("language_model", "forward (tgi_vlm/models/flash_causal_lm.py")),
    ("attention (paged torch)", ("torch_paged_attention",)),
    ("sampling / logits", ("sample (", "choose_tokens", "compute_logits")),
    ("detokenize / stopping", ("_emit", "detokenizer", "stopping")),
    ("step bookkeeping", ("build_step", "schedule", "to_pb", "concatenate", "filter")),
    ("grpc / idle", ("grpc", "asyncio", "select", "epoll", "wait (threading")),
]


def start_profiler(shard, out: Path | None) -> subprocess.Popen | None:
    """py-spy sampling the shard process (rank 0's; raw collapsed stacks), when asked for and installed."""
    if out is None or shard is None:
        return None
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(exe).exists():
        print("py-spy is not installed; no profile (pip install py-spy)", file=sys.stderr)
        return None
    return subprocess.Popen([exe, "record", "--pid", str(shard.processes[0].pid), "--format", "raw", "--rate", "50",
                             "--nonblocking", "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_profiler(spy: subprocess.Popen | None, out: Path | None) -> dict[str, float]:
    if spy is None:
        return {}
    spy.send_signal(signal.SIGINT)
    try:
        spy.wait(30)
    except subprocess.TimeoutExpired:
        spy.kill()
        return {}
    return summarize_profile(out) if out.exists() else {}


def summarize_profile(path: Path) -> dict[str, float]:
    """Share of py-spy samples per bucket: a sample goes to the innermost bucket frame found on its stack."""
    counts: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        total += int(n)
        counts[_bucket(stack.split(";"))] += int(n)
    return {k: v / total for k, v in counts.most_common()} if total else {}


def _bucket(frames: list[str]) -> str:
    for frame in reversed(frames):  # innermost first
        for name, needles in PROFILE_BUCKETS:
            if any(n in frame for n in needles):
                return name
    return "other"
