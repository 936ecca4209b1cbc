"""Why the shard releases its loading thread's OpenMP workers (layers/cpu.release_openmp_threads): small torch ops
on another thread than the one that ran the first parallel region, before and after the release. 72 gelus of a
16 x 4096 bf16 tensor (a decode step's count of small products), min of 20; each case in a fresh process.

    .venv/bin/python benchmarks/openmp_threads.py         # writes benchmarks/results/openmp_threads.{json,md}
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"

CASE = r"""
import sys, threading, time, torch
from tgi_vlm.layers.cpu import release_openmp_threads
def run():
    x = torch.randn(16, 4096).bfloat16()
    times = []
    for _ in range(20):
        start = time.perf_counter()
        for _ in range(72):
            torch.nn.functional.gelu(x)
        times.append(time.perf_counter() - start)
    print(min(times) * 1e3)
case = sys.argv[1]
if case != "thread, main never ran a region":
    torch.nn.functional.gelu(torch.randn(16, 4096).bfloat16())  # a parallel region on the main thread
if case == "thread, after release_openmp_threads":
    release_openmp_threads()
if case == "main thread":
    run()
else:
    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
"""
CASES = ["main thread", "thread, main never ran a region", "thread, main ran a region",
         "thread, after release_openmp_threads"]


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    from tgi_vlm.testing.machine import machine

    out = {}
    for case in CASES:
        done = subprocess.run([sys.executable, "-c", CASE, case], capture_output=True, text=True, check=True)
        out[case] = float(done.stdout.strip().splitlines()[-1])
        print(f"{case}: {out[case]:.2f} ms", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "openmp_threads.json").write_text(json.dumps(dict(machine=machine(), ms=out), indent=1) + "\n")
    lines = ["# 72 small torch ops (gelu, 16 x 4096 bf16) on the main thread and on another", "",
             f"- machine: {machine()}", "", "| case | ms (min of 20) |", "|---|---:|"]
    lines += [f"| {case} | {ms:.2f} |" for case, ms in out.items()]
    (RESULTS / "openmp_threads.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
