"""The prefix-cache comparison's report: the workload with the driver's prefix cache off, then on, side by
side (`tgi-vlm bench --workload multiturn|shared-prefix`, comparison "prefix-caching").

Figures: TTFT of turns >= 2 (multiturn) or of every request, output tokens/s, the prefix hit rate (prompt
tokens reused / prompt tokens), blocks cached, evictions, and whether both modes produced the same tokens
(greedy: they must). JSON and a markdown table.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

from tgi_vlm.benchmarking.report import time_split
from tgi_vlm.benchmarking.results import ServingResult, percentiles

MODES = (("off", False), ("on", True))  # (report key, prefix caching), in the order they run


def mode_report(serving: ServingResult) -> dict:
    ok = [r for r in serving.requests if r.error is None]
    out_tokens = sum(len(r.tokens) for r in ok)

    def ttft(keep) -> dict:
        return percentiles([r.ttft_s for r in ok if r.ttft_s is not None and keep(r)])

    return {
        "wall_s": serving.wall_s,
        "failed": len(serving.requests) - len(ok),
        "out_tok_per_s": out_tokens / serving.wall_s,
        "ttft_s": ttft(lambda r: True),
        "ttft_first_turn_s": ttft(lambda r: r.turn == 0),
        "ttft_later_turns_s": ttft(lambda r: r.turn > 0),
        "itl_s": percentiles([x for r in ok for x in r.itl_s]),
        "prefix": serving.prefix,
        "prefill_tokens_computed": serving.prefix.get("prompt_tokens", 0) - serving.prefix.get("cached_tokens", 0),
        "cpu_s": serving.cpu_s,
        "calls": serving.calls,
        "time_split": time_split(serving),
    }


def compare(workload: str, spec, results: dict[str, ServingResult], model_id: str, machine: dict) -> dict:
    off, on = (mode_report(results[name]) for name, _ in MODES)
    ttft_key = "ttft_later_turns_s" if workload == "multiturn" else "ttft_s"
    same = sum(a.tokens == b.tokens for a, b in zip(results["off"].requests, results["on"].requests))
    return {
        "workload": workload,
        "model": Path(model_id).name,  # no local paths in results
        "dtype": results["on"].dtype,
        "spec": spec.to_dict(),
        "machine": machine,
        "requests": len(results["on"].requests),
        "off": off,
        "on": on,
        "ttft_measured": ttft_key,
        "ttft_p50_on_over_off": _ratio(on[ttft_key]["p50"], off[ttft_key]["p50"]),
        "throughput_on_over_off": _ratio(on["out_tok_per_s"], off["out_tok_per_s"]),
        "shard_cpu_on_over_off": _ratio(on["cpu_s"].get("shard"), off["cpu_s"].get("shard")),
        "outputs_identical": same,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def machine_info() -> dict:
    import platform

    import torch

    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "load_avg_1m": os.getloadavg()[0],
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def markdown(report: dict, machine_end: dict | None = None) -> str:
    off, on = report["off"], report["on"]
    later = report["workload"] == "multiturn"
    m = report["machine"]
    load_end = (machine_end or {}).get("load_avg_1m")
    lines = [
        f"# prefix caching — {report['workload']} — {m['date']}",
        "",
        f"{report['model']}, {report.get('dtype') or 'float32'}, CPU ({m['cores']} cores, torch threads {m['torch_threads']} in the shard and "
        f"the router: the shard inherits the environment); "
        f"1-min load average {m['load_avg_1m']:.1f} at the start"
        + (f", {load_end:.1f} at the end" if load_end is not None else "")
        + ". Each mode on a fresh shard; the router driver's prefix cache off, then on.",
        "",
        *([f"The machine was shared with other work (load above its {m['cores']} cores): absolute figures are "
           "slower than on a quiet machine and the two modes ran minutes apart under varying load.", ""]
          if max(m["load_avg_1m"], load_end or 0) > m["cores"] else []),
        f"Workload: {json.dumps(report['spec'])} — {report['requests']} requests.",
        "",
        "| | prefix caching off | on | on / off | target |",
        "|---|---:|---:|---:|---:|",
        _row(f"TTFT {'turns ≥ 2' if later else 'all requests'}, p50 (s)", off[report["ttft_measured"]]["p50"],
             on[report["ttft_measured"]]["p50"], report["ttft_p50_on_over_off"], "≤ 0.3"),
    ]
    if later:
        lines.append(_row("TTFT turn 1, p50 (s)", off["ttft_first_turn_s"]["p50"], on["ttft_first_turn_s"]["p50"],
                          _ratio(on["ttft_first_turn_s"]["p50"], off["ttft_first_turn_s"]["p50"]), ""))
    lines += [
        _row("output tokens/s", off["out_tok_per_s"], on["out_tok_per_s"], report["throughput_on_over_off"], "≥ 2×"),
        _row("wall (s)", off["wall_s"], on["wall_s"], _ratio(on["wall_s"], off["wall_s"]), ""),
        _row("shard CPU time (s)", off["cpu_s"].get("shard"), on["cpu_s"].get("shard"),
             report["shard_cpu_on_over_off"], ""),
        _row("router CPU time (s, incl. token counting)", off["cpu_s"].get("router"), on["cpu_s"].get("router"),
             _ratio(on["cpu_s"].get("router"), off["cpu_s"].get("router")), ""),
        _row("prompt tokens computed by the shard", off["prefill_tokens_computed"], on["prefill_tokens_computed"],
             _ratio(on["prefill_tokens_computed"], off["prefill_tokens_computed"]), ""),
        f"| prefix hit rate (prompt tokens reused) | {off['prefix']['hit_rate']:.1%} | {on['prefix']['hit_rate']:.1%} | | |",
        f"| prompt tokens reused / sent | {off['prefix']['cached_tokens']} / {off['prefix']['prompt_tokens']} "
        f"| {on['prefix']['cached_tokens']} / {on['prefix']['prompt_tokens']} | | |",
        f"| requests with a hit | {off['prefix']['hits']} | {on['prefix']['hits']} | | |",
        f"| blocks cached at the end / evictions | — | {on['prefix']['blocks_cached']} / {on['prefix']['evictions']} | | |",
        f"| claims refused by the shard | — | {on['prefix']['refused_claims']} | | |",
        f"| failed requests | {off['failed']} | {on['failed']} | | |",
        "",
        f"Outputs identical in both modes (greedy): {report['outputs_identical']}/{report['requests']}.",
        "",
    ]
    return "\n".join(lines)


def _row(label: str, off: float | None, on: float | None, ratio: float | None, target: str) -> str:
    def fmt(v):
        if v is None or isinstance(v, int):
            return "—" if v is None else str(v)
        return f"{v:.3f}" if v < 10 else f"{v:.1f}"

    return f"| {label} | {fmt(off)} | {fmt(on)} | {'—' if ratio is None else f'{ratio:.2f}'} | {target} |"


def summary_lines(report: dict) -> list[str]:
    key = report["ttft_measured"]
    return [
        f"{report['workload']}: TTFT p50 ({key}) off {report['off'][key]['p50']:.3f} s, on {report['on'][key]['p50']:.3f} s "
        f"(on/off {report['ttft_p50_on_over_off']:.2f}); output tok/s off {report['off']['out_tok_per_s']:.1f}, "
        f"on {report['on']['out_tok_per_s']:.1f} ({report['throughput_on_over_off']:.2f}x); "
        f"hit rate {report['on']['prefix']['hit_rate']:.1%}; outputs identical {report['outputs_identical']}/{report['requests']}",
    ]


def write(report: dict, out_dir: Path, name: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps(report, indent=2))
    md_path.write_text(markdown(report, report.get("machine_end")))
    return [json_path, md_path]
