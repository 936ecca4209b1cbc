"""What the router's token counting costs the shard beside it: `tgi-vlm bench`'s workload served with the
Qwen2-VL counting shortcut (`VlmPrompt.expanded_ids`, the default) and with the image processor
(`TokenCounter(fast_count=False)`), alternating, each run with a shard of its own.

Both sides produce the same prompt ids (tests/models/test_router_fast_count.py); what differs is the
router's CPU time, which it spends on the two cores the shard's forward uses.

    PYTHONPATH=src .venv/bin/python benchmarks/router_counting.py [--pairs 3] [--dtype bfloat16]

Writes benchmarks/results/router_counting.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
from datetime import datetime, timezone
from pathlib import Path

from tgi_vlm.benchmarking.load import Requests
from tgi_vlm.benchmarking.synthetic import WorkloadSpec, make_workload
from tgi_vlm.benchmarking.targets.driver import DriverTarget
from tgi_vlm.router import session
from tgi_vlm.router.tokens import TokenCounter
from tgi_vlm.testing import tiny_model_path

RESULTS = Path(__file__).parent / "results"
SIDES = {"processor": False, "shortcut": True}


def serve_once(model: str, items, spec: WorkloadSpec, fast_count: bool, dtype: str) -> dict:
    session.TokenCounter = functools.partial(TokenCounter, fast_count=fast_count)  # what router_session builds
    try:
        serving = asyncio.run(DriverTarget(model, shard_args=["--dtype", dtype]).run(Requests(spec, items)))
    finally:
        session.TokenCounter = TokenCounter
    tokens = sum(len(r.tokens) for r in serving.requests if r.error is None)
    return {"out_tok_per_s": tokens / serving.wall_s, "router_cpu_s": serving.cpu_s.get("router"),
            "shard_cpu_s": serving.cpu_s.get("shard"), "failed": sum(r.error is not None for r in serving.requests)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args()
    model = str(tiny_model_path("qwen2_vl", size="bench"))
    spec = WorkloadSpec()
    items = make_workload(spec, TokenCounter(model).tokenizer)
    runs = {name: [] for name in SIDES}
    for pair in range(args.pairs):
        order = list(SIDES) if pair % 2 == 0 else list(SIDES)[::-1]
        for name in order:
            runs[name].append(serve_once(model, items, spec, SIDES[name], args.dtype))
            print(name, runs[name][-1], flush=True)
    ratios = [s["out_tok_per_s"] / p["out_tok_per_s"] for s, p in zip(runs["shortcut"], runs["processor"])]
    result = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "dtype": args.dtype,
              "workload": spec.to_dict(), "runs": runs, "pair_ratios": ratios, "median_ratio": statistics.median(ratios)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "router_counting.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Router token counting: shortcut vs image processor ({result['when']}, {args.dtype})", "",
             "`benchmarks/router_counting.py`: `tgi-vlm bench`'s 64-request workload on the bench Qwen2-VL, each run "
             "with its own shard, the two sides alternating.", "",
             "| pair | processor out tok/s | shortcut out tok/s | ratio | router CPU s (processor → shortcut) |",
             "|---:|---:|---:|---:|---:|"]
    for i, (p, s) in enumerate(zip(runs["processor"], runs["shortcut"])):
        lines.append(f"| {i + 1} | {p['out_tok_per_s']:.1f} | {s['out_tok_per_s']:.1f} | {s['out_tok_per_s'] / p['out_tok_per_s']:.3f} | "
                     f"{p['router_cpu_s']:.2f} → {s['router_cpu_s']:.2f} |")
    lines += ["", f"Median ratio {result['median_ratio']:.3f}."]
    (RESULTS / "router_counting.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
