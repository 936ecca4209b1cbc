"""Do the lean decoder layers (layers/cpu_decoder.py) cost anything on vlm_engine.py's image workload? Two
engines of the bench Qwen2-VL model in one process, one with transformers' own layer forward, run in turn on
vlm_engine's 32 image requests (its router-like loop, prefill budget 512); each side's tokens are compared
(the lean forward is bit-exact, so they must be equal).

    PYTHONPATH=src .venv/bin/python benchmarks/lean_layers_vlm.py [--rounds 3] [--dtype float32]

Writes benchmarks/results/lean_layers_vlm.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import vlm_engine  # noqa: E402

from tgi_vlm.config import EngineConfig  # noqa: E402
from tgi_vlm.layers.cpu_decoder import remove_lean_layers  # noqa: E402
from tgi_vlm.models import get_model  # noqa: E402
from tgi_vlm.testing import tiny_model_path  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def engine(path: str, dtype: str, lean: bool):
    e = get_model(path, EngineConfig(device="cpu", dtype=dtype, cpu_kv_cache_bytes=1 << 30))
    e.prefill_budget = vlm_engine.PREFILL_BUDGET
    if not lean:
        removed = remove_lean_layers(e.language_model)
        assert removed == e.language_model.config.num_hidden_layers, "nothing to compare against"
    return e


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    a = p.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated")
    path = str(tiny_model_path("qwen2_vl", size="bench"))
    engines = {"lean": engine(path, a.dtype, True), "transformers": engine(path, a.dtype, False)}
    jobs = vlm_engine.make_workload(32, False)
    for e in engines.values():
        vlm_engine.run_engine(e, vlm_engine.make_workload(2, quick=True, seed=99))  # warm
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    tokens = {}
    for r in range(a.rounds):
        for name in (("lean", "transformers") if r % 2 == 0 else ("transformers", "lean")):
            engines[name].encoder_cache.clear_shared()  # no vision features carried over between runs
            s, tokens[name] = vlm_engine.run_engine(engines[name], jobs)
            seconds[name].append(s)
            print(f"round {r + 1} {name}: {s:.2f} s", flush=True)
    ratio = statistics.median(seconds["lean"]) / statistics.median(seconds["transformers"])
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "dtype": a.dtype, "seconds": seconds,
              "median_ratio_lean_over_transformers": ratio, "same_tokens": tokens["lean"] == tokens["transformers"]}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "lean_layers_vlm.json").write_text(json.dumps(report, indent=1))
    md = (f"# Lean decoder layers on vlm_engine's image workload — {report['date']}\n\n"
          f"{a.dtype}, 32 requests, two engines in one process run in turn (`benchmarks/lean_layers_vlm.py`).\n\n"
          "| side | seconds per run |\n|---|---|\n"
          + "".join(f"| {n} | {', '.join(f'{s:.2f}' for s in v)} |\n" for n, v in seconds.items())
          + f"\nMedian lean / transformers: {ratio:.3f}; tokens {'identical' if report['same_tokens'] else 'DIFFERENT'}.\n")
    (RESULTS / "lean_layers_vlm.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
