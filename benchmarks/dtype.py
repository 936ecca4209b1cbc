"""float32 vs bfloat16 (the default on a CPU with native bf16): the engine on vlm_engine.py's mixed VLM workload.

The bench Qwen2-VL (~100M parameters) is loaded once per dtype; the same requests (1-2 images of 64-448 px,
10-120 words, 8-48 new tokens, EOS ignored; --quick: 8 smaller ones) run through the engine as TGI's router
would drive it (vlm_engine.run_engine). The two dtypes alternate `--repeat` times and the fastest run of each
counts. Besides wall time the process CPU time of each run is recorded: on a machine shared with other jobs
CPU seconds move less than wall seconds. Also: one 512x768 @ 768x2048 matmul per dtype on one thread (median
of 20), the kernel-level figure behind the rule in tgi_vlm/dtypes.py.

    .venv/bin/python benchmarks/dtype.py [--quick] [--threads 1] [--repeat 2]

Writes benchmarks/results/dtype.{json,md} (--quick: dtype-quick.{json,md}).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.vlm_engine import PREFILL_BUDGET, make_workload, run_engine, throughput
from tgi_vlm.config import EngineConfig
from tgi_vlm.dtypes import cpu_has_native_bf16
from tgi_vlm.models import get_model
from tgi_vlm.testing import tiny_model_path
from tgi_vlm.testing.machine import machine

RESULTS = Path(__file__).parent / "results"
DTYPES = ("float32", "bfloat16")


def matmul_ms(dtype: torch.dtype) -> float:
    with torch.inference_mode():
        a, b = torch.randn(512, 768, dtype=dtype), torch.randn(768, 2048, dtype=dtype)
        for _ in range(3):
            a @ b
        times = []
        for _ in range(20):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def bench(args) -> dict:
    path = tiny_model_path("qwen2_vl", size="bench")
    engines = {}
    for name in DTYPES:
        engines[name] = get_model(str(path), EngineConfig(device="cpu", dtype=name, cpu_kv_cache_bytes=1 << 30))
        engines[name].prefill_budget = PREFILL_BUDGET  # as if Warmup had reported the router's max_prefill_tokens
    jobs = make_workload(8 if args.quick else 32, args.quick)
    for engine in engines.values():
        run_engine(engine, make_workload(2, quick=True, seed=99))  # warm every path once
    best = {name: (float("inf"), float("inf")) for name in DTYPES}  # (wall s, CPU s) of the fastest run
    for _ in range(args.repeat):
        for name, engine in engines.items():
            engine.encoder_cache.clear_shared()  # a repeat must not reuse the last run's vision features
            cpu = time.process_time()
            seconds, _ = run_engine(engine, jobs)
            if seconds < best[name][0]:
                best[name] = (seconds, time.process_time() - cpu)
    runs = {name: dict(throughput(wall, jobs), cpu_s=cpu) for name, (wall, cpu) in best.items()}
    with torch.inference_mode():
        torch.set_num_threads(1)
        kernel = {name: matmul_ms(getattr(torch, name)) for name in ("float32", "bfloat16", "float16")}
        torch.set_num_threads(args.threads)
    return dict(
        model=path.name,
        requests=len(jobs),
        output_tokens=sum(j.max_new_tokens for j in jobs),
        cpu_has_native_bf16=cpu_has_native_bf16(),
        engine=runs,
        bf16_speedup_wall=runs["float32"]["seconds"] / runs["bfloat16"]["seconds"],
        bf16_speedup_cpu=runs["float32"]["cpu_s"] / runs["bfloat16"]["cpu_s"],
        matmul_512x768x2048_ms_one_thread=kernel,
    )


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"# float32 vs bfloat16 — {result['timestamp']}",
        "",
        f"{result['model']}, {result['requests']} requests ({result['output_tokens']} output tokens), engine driven "
        f"like TGI's router; {m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}, native bf16: "
        f"{result['cpu_has_native_bf16']}; 1-min load average {m['load_avg_1m']:.1f} at the start (other jobs share "
        "these cores: CPU seconds are the steadier figure). Fastest of the repeats.",
        "",
        "| dtype | wall s | tokens/s | CPU s |",
        "|---|---:|---:|---:|",
    ]
    for name, run in result["engine"].items():
        lines.append(f"| {name} | {run['seconds']:.1f} | {run['tok_s']:.1f} | {run['cpu_s']:.1f} |")
    kernel = result["matmul_512x768x2048_ms_one_thread"]
    lines += [
        "",
        f"bfloat16 / float32: {result['bf16_speedup_wall']:.2f}x by wall time, {result['bf16_speedup_cpu']:.2f}x by "
        "CPU time.",
        "",
        "One 512x768 @ 768x2048 matmul, one thread, median of 20: " + ", ".join(
            f"{name} {ms:.2f} ms" for name, ms in kernel.items()) + ".",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 smaller requests")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = dict(timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"), machine=machine(), **bench(args))
    name = "dtype-quick" if args.quick else "dtype"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2))
    (RESULTS / f"{name}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
