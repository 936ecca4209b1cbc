"""What building oneDNN's kernels at warmup buys (layers/linear/plan.py `prime_packed_kernels`, models/warmup.py).

Each side runs in a process of its own (oneDNN's kernel cache is process-wide), bench Qwen2-VL in bfloat16:
- `primed`: the shard's default: Warmup (the router's batch, 1024-token prompts, prefill budget 2048) builds
  every packed product's kernels up to 2048 rows, with oneDNN's cache at 4096 kernels;
- `unprimed`: the same Warmup without the building (kernels are built when a step first needs them);
- `cache1024`: primed, with oneDNN's own default cache of 1024 kernels (ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024).

Then, per side: 64 one-image prefills of `tgi-vlm bench`'s workload with another seed than warmup's (each
request alone, new image sizes and prompt lengths: the row counts a serving start meets), timed; then one more
building pass, timed (short when the kernels are still cached, as long as the first when they were evicted).
Sides alternate over `--rounds`.

    PYTHONPATH=src .venv/bin/python benchmarks/kernel_priming.py [--rounds 2]

Writes benchmarks/results/kernel_priming.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SIDES = ("primed", "unprimed", "cache1024")


def measure(side: str) -> dict:
    from transformers import AutoTokenizer

    import tgi_vlm.models.warmup as warmup_module
    from tgi_vlm.benchmarking.synthetic import WorkloadSpec, make_workload
    from tgi_vlm.config import EngineConfig
    from tgi_vlm.layers.linear.plan import prime_packed_kernels
    from tgi_vlm.models import get_model
    from tgi_vlm.router.warmup import warmup_request
    from tgi_vlm.testing import tiny_model_path
    from tgi_vlm.testing.harness import make_batch

    path = str(tiny_model_path("qwen2_vl", size="bench"))
    engine = get_model(path, EngineConfig(device="cpu", dtype="bfloat16", cpu_kv_cache_bytes=1 << 30))
    if side == "unprimed":
        warmup_module.prime_packed_kernels = lambda *args, **kwargs: (0, 0)
    start = time.perf_counter()
    engine.warmup(warmup_request(1024, 2048, 2048, None))
    warmup_s = time.perf_counter() - start
    items = make_workload(WorkloadSpec(seed=1), AutoTokenizer.from_pretrained(path))
    start = time.perf_counter()
    for i, item in enumerate(items):
        batch = engine.batch_from_pb(make_batch(i + 1, [item.params.to_pb(i)]))
        _, batch, _ = engine.generate_token(batch)
        if batch is not None:
            batch.release()
    prefills_s = time.perf_counter() - start
    start = time.perf_counter()
    products, _ = prime_packed_kernels(engine.model, 2048, row_caps={engine.lm_head: 256})
    return {"side": side, "warmup_s": warmup_s, "prefills_s": prefills_s, "building_pass_after_s": time.perf_counter() - start,
            "products": products, "cache_capacity": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY")}


def run_side(side: str) -> dict:
    env = dict(os.environ)
    env.pop("ONEDNN_PRIMITIVE_CACHE_CAPACITY", None)
    if side == "cache1024":
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "1024"
    out = subprocess.run([sys.executable, __file__, "--side", side], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def markdown(report: dict) -> str:
    lines = [f"# Building oneDNN's kernels at warmup — {report['date']}", "",
             "bench Qwen2-VL, bfloat16, each side in its own process (`benchmarks/kernel_priming.py`); 64 one-image "
             f"prefills of new sizes after Warmup; load average at the end {report['load_average']:.1f}.", "",
             "| side | warmup s | 64 prefills s | a building pass after s |", "|---|---:|---:|---:|"]
    for run in report["runs"]:
        lines.append(f"| {run['side']} | {run['warmup_s']:.2f} | {run['prefills_s']:.2f} | {run['building_pass_after_s']:.2f} |")
    med = {side: statistics.median(r["prefills_s"] for r in report["runs"] if r["side"] == side) for side in SIDES}
    lines += ["", "Median 64 prefills: " + ", ".join(f"{side} {s:.2f} s" for side, s in med.items()) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # internal: one side, JSON on stdout
    a = p.parse_args()
    if a.side:
        print(json.dumps(measure(a.side)))
        return
    runs = []
    for r in range(a.rounds):
        for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
            runs.append(run_side(side))
            print(runs[-1], flush=True)
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "load_average": os.getloadavg()[0], "runs": runs}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kernel_priming.json").write_text(json.dumps(report, indent=1))
    (RESULTS / "kernel_priming.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
