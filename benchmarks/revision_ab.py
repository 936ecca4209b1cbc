"""What a change buys in serving: `tgi-vlm bench`'s workload served by the shard of this checkout and by
the shard of another git revision, alternating, each run with a shard of its own (started as the launcher
does). The router driver is this checkout's on both sides; only the shard's code differs.

The other revision is checked out into a temporary git worktree, the generated gRPC stubs are copied in,
and its shard runs with that worktree's `src` first on PYTHONPATH.

    PYTHONPATH=src .venv/bin/python benchmarks/revision_ab.py --base 75e1f0d [--pairs 4] [--dtype bfloat16] --name NAME

Writes benchmarks/results/revision_ab-NAME.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from tgi_vlm.benchmarking.load import Requests
from tgi_vlm.benchmarking.synthetic import WorkloadSpec, make_workload
from tgi_vlm.benchmarking.targets.driver import DriverTarget
from tgi_vlm.testing import tiny_model_path

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()


def checkout(revision: str, into: Path) -> Path:
    """`revision`'s source tree (with this checkout's generated stubs); returns its `src`."""
    git("worktree", "add", "--detach", "--force", str(into), revision)
    stubs = REPO / "src" / "tgi_vlm" / "pb"
    for stub in stubs.glob("generate_pb2*"):
        shutil.copy(stub, into / "src" / "tgi_vlm" / "pb" / stub.name)
    return into / "src"


def serve_once(model: str, items, spec: WorkloadSpec, dtype: str, src: Path) -> dict:
    path = os.pathsep.join(p for p in (str(src), os.environ.get("PYTHONPATH", "")) if p)
    target = DriverTarget(model, shard_env={"PYTHONPATH": path}, shard_args=["--dtype", dtype])
    serving = asyncio.run(target.run(Requests(spec, items)))
    tokens = sum(len(r.tokens) for r in serving.requests if r.error is None)
    prefill = sum(s.wall_s for s in serving.steps if s.kind != "decode")
    decode = sum(s.wall_s for s in serving.steps if s.kind == "decode")
    return {"out_tok_per_s": tokens / serving.wall_s, "wall_s": serving.wall_s, "prefill_rpc_s": prefill,
            "decode_rpc_s": decode, "failed": sum(r.error is not None for r in serving.requests),
            "outputs": [r.tokens for r in serving.requests]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="git revision to compare this checkout's shard against")
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--name", required=True)
    p.add_argument("--model", help="model directory (default: the bench Qwen2-VL); `real-gemma`: Gemma 3 270M "
                                   "(tgi_vlm.testing.real_models, the real-models extra)")
    p.add_argument("--images-per-request", type=int, default=1, help="0 for a text model")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    a = p.parse_args()
    if a.model == "real-gemma":
        from tgi_vlm.testing.real_models import gemma3_270m_dir

        a.model = str(gemma3_270m_dir())
    model = a.model or str(tiny_model_path("qwen2_vl", size="bench"))
    spec = WorkloadSpec(num_requests=a.num_requests, images_per_request=a.images_per_request,
                        concurrency=a.concurrency)
    from transformers import AutoTokenizer

    items = make_workload(spec, AutoTokenizer.from_pretrained(model))
    head = git("rev-parse", "--short", "HEAD") + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    base = git("rev-parse", "--short", a.base)
    with tempfile.TemporaryDirectory(prefix="tgi-vlm-ab-") as tmp:
        try:
            sides = {"base": checkout(a.base, Path(tmp) / "base"), "this": REPO / "src"}
            runs = []
            for pair in range(a.pairs):
                order = ("base", "this") if pair % 2 == 0 else ("this", "base")
                result = {side: serve_once(model, items, spec, a.dtype, sides[side]) for side in order}
                result["first"] = order[0]
                result["same_outputs"] = result["base"].pop("outputs") == result["this"].pop("outputs")
                runs.append(result)
                print(f"pair {pair + 1}: base {result['base']['out_tok_per_s']:.1f}, this {result['this']['out_tok_per_s']:.1f} "
                      f"out tok/s (ratio {result['this']['out_tok_per_s'] / result['base']['out_tok_per_s']:.3f})", flush=True)
        finally:  # never hide the error that got us here
            subprocess.run(["git", "worktree", "remove", "--force", str(Path(tmp) / "base")], cwd=REPO, capture_output=True)
            subprocess.run(["git", "worktree", "prune"], cwd=REPO, capture_output=True)
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "base": base, "this": head,
              "model": Path(model).name,
              "dtype": a.dtype, "load_average": os.getloadavg(), "workload": spec.to_dict(), "pairs": runs}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"revision_ab-{a.name}.json").write_text(json.dumps(report, indent=1))
    (RESULTS / f"revision_ab-{a.name}.md").write_text(markdown(report))
    print(markdown(report))


def markdown(report: dict) -> str:
    ratios = [r["this"]["out_tok_per_s"] / r["base"]["out_tok_per_s"] for r in report["pairs"]]
    w = report["workload"]
    lines = [f"# Shard {report['this']} vs {report['base']} — {report['date']}", "",
             f"`tgi-vlm bench`'s workload ({w['num_requests']} requests, {w['concurrency']} in flight, "
             f"{w['images_per_request']} image(s) each, `{report.get('model', 'bench Qwen2-VL')}`, {report['dtype']}), the two shards "
             f"served alternately (`benchmarks/revision_ab.py`); load average at the end {report['load_average'][0]:.1f}.", "",
             "| pair | first | base out tok/s | this out tok/s | ratio | prefill RPCs s (base / this) | decode RPCs s | same tokens |",
             "|---:|---|---:|---:|---:|---:|---:|---|"]
    for i, (r, ratio) in enumerate(zip(report["pairs"], ratios), 1):
        b, t = r["base"], r["this"]
        lines.append(f"| {i} | {r.get('first', '?')} | {b['out_tok_per_s']:.1f} | {t['out_tok_per_s']:.1f} | {ratio:.3f} | "
                     f"{b['prefill_rpc_s']:.2f} / {t['prefill_rpc_s']:.2f} | {b['decode_rpc_s']:.2f} / {t['decode_rpc_s']:.2f} | "
                     f"{'yes' if r['same_outputs'] else 'no'} |")
    lines += ["", f"Median ratio {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}). The first run "
              "of a pair is the shard started first; \"same tokens\" compares every request's tokens (bf16 tokens can "
              "differ with the batch a request shared a step with, so a bf16 \"no\" does not by itself mean a change)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
