"""The serving run against the reference: the report (JSON), the terminal table, the summary lines and
the PNG chart (`tgi-vlm bench`, comparison "reference"). The report's fields are what benchmarks/peers
and other scripts read back: change them only with their readers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from tgi_vlm.benchmarking.results import ReferenceResult, ServingResult, percentiles
from tgi_vlm.benchmarking.synthetic import WorkItem, WorkloadSpec


def summarize(spec: WorkloadSpec, items: list[WorkItem], serving: ServingResult,
              reference: ReferenceResult | None, model_id: str) -> dict:
    ok = [r for r in serving.requests if r.error is None]
    out_tokens = sum(len(r.tokens) for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [x for r in ok for x in r.itl_s]
    report = {
        "model": Path(model_id).name,  # no local paths in results
        "dtype": serving.dtype,  # None over HTTP: TGI's /info does not report it
        "workload": spec.to_dict(),
        "prompt_tokens_mean": float(np.mean([it.prompt_tokens for it in items])),
        "output_tokens": sum(it.params.max_new_tokens for it in items),
        "serving": {
            "wall_s": serving.wall_s,
            "failed": len(serving.requests) - len(ok),
            "req_per_s": len(ok) / serving.wall_s,
            "out_tok_per_s": out_tokens / serving.wall_s,
            "ttft_s": percentiles(ttft),
            "itl_s": percentiles(itl),
            "calls": serving.calls,
            "time_split": time_split(serving),
            "cpu_s": serving.cpu_s,  # shard and router (this process: token counting included)
            "profile": serving.profile,
        },
    }
    if reference is not None:
        ref_tokens = sum(len(o) for o in reference.outputs)
        matches = sum(r.tokens == o for r, o in zip(serving.requests, reference.outputs))
        report["transformers"] = {
            "wall_s": reference.wall_s,
            "dtype": reference.dtype,
            "req_per_s": len(items) / reference.wall_s,
            "out_tok_per_s": ref_tokens / reference.wall_s,
            "batch_latency_s": percentiles(reference.batch_latencies_s),
        }
        report["throughput_ratio"] = report["serving"]["out_tok_per_s"] / report["transformers"]["out_tok_per_s"]
        report["exact_matches"] = matches
        report["first_mismatch_at"] = [first_difference(r.tokens, o) for r, o in zip(serving.requests, reference.outputs)]
    return report


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def time_split(serving: ServingResult) -> dict[str, float]:
    """Where the serving wall time went, in seconds (shard figures are what it reports per RPC).
    Empty when the run had no step records (over HTTP)."""
    steps = serving.steps
    if not steps:
        return {}
    forward = sum(s.forward_ns for s in steps) / 1e9
    sample = sum(s.decode_ns for s in steps) / 1e9
    server = sum(s.total_ns for s in steps) / 1e9
    rpc = sum(s.wall_s for s in steps)
    return {
        "shard forward (incl. vision, embeds)": forward,
        "shard sampling + detokenize": sample,
        "shard other (from_pb/tokenize, concat, to_pb)": server - forward - sample,
        "gRPC + (de)serialization": rpc - server,
        "router, between RPCs": serving.wall_s - rpc,
        "prefill RPCs": sum(s.wall_s for s in steps if s.kind != "decode"),
        "decode RPCs": sum(s.wall_s for s in steps if s.kind == "decode"),
        "steps": len(steps),
        "mean decode batch": float(np.mean([s.size for s in steps if s.kind == "decode"] or [0])),
    }


def write_results(report: dict, out_dir: Path, name: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    json_path.write_text(json.dumps(report, indent=2))
    written = [json_path]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install 'tgi-vlm[bench]')", file=sys.stderr)
        return written
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    systems = {"tgi-vlm (router + shard)": report["serving"]}
    if "transformers" in report:
        systems["transformers generate"] = report["transformers"]
    ax1.bar(list(systems), [s["out_tok_per_s"] for s in systems.values()], color=["tab:blue", "tab:gray"][: len(systems)])
    ax1.set_ylabel("output tokens / s")
    ax1.set_title("throughput")
    qs = ["p50", "p90", "p99"]
    x = np.arange(len(qs))
    for offset, key, label in ((-0.2, "ttft_s", "TTFT"), (0.2, "itl_s", "inter-token")):
        values = [(report["serving"][key][q] or 0) * 1000 for q in qs]
        ax2.bar(x + offset, values, width=0.4, label=label)
    ax2.set_xticks(x, qs)
    ax2.set_ylabel("ms")
    ax2.set_title("tgi-vlm latency")
    ax2.legend()
    fig.suptitle(f"{Path(report['model']).name}: {report['workload']['num_requests']} requests")
    fig.tight_layout()
    png = out_dir / f"{name}.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return written + [png]


def result_table(report: dict):
    from rich.table import Table

    table = Table(title=f"{Path(report['model']).name} — {report['workload']['num_requests']} requests")
    for col in ("system", "req/s", "out tok/s", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms", "wall s"):
        table.add_column(col, justify="right" if col != "system" else "left")
    s = report["serving"]
    table.add_row(f"tgi-vlm ({report.get('transport', 'router driver')})", f"{s['req_per_s']:.2f}", f"{s['out_tok_per_s']:.1f}", _ms(s["ttft_s"]), _ms(s["itl_s"]),
                  f"{s['wall_s']:.1f}")
    if "transformers" in report:
        t = report["transformers"]
        table.add_row("transformers (static)", f"{t['req_per_s']:.2f}", f"{t['out_tok_per_s']:.1f}", "—", "—",
                      f"{t['wall_s']:.1f}")
    return table


def _ms(p: dict) -> str:
    return "/".join("—" if v is None else f"{v * 1000:.0f}" for v in p.values())


def summary_lines(report: dict) -> list[str]:
    lines = [f"dtype: tgi-vlm {report.get('dtype') or 'not reported (HTTP)'}"
             + (f", transformers {report['transformers']['dtype']}" if "transformers" in report else "")]
    if "throughput_ratio" in report:
        n = report["workload"]["num_requests"]
        lines.append(f"throughput ratio (tgi-vlm / transformers): {report['throughput_ratio']:.2f}x; "
                     f"exact output matches: {report['exact_matches']}/{n}")
    split = report["serving"]["time_split"]
    if split:
        lines.append("serving time split: " + ", ".join(
            f"{k} {v:.1f}" + ("" if k in ("steps", "mean decode batch") else " s") for k, v in split.items()))
    if report["serving"]["profile"]:
        lines.append("shard profile (py-spy samples): " + ", ".join(
            f"{k} {v:.0%}" for k, v in report["serving"]["profile"].items()))
    return lines
