"""Float32 decode-sized linears: the native loop (`tgi_vlm::skinny_linear`, layers/skinny_linear.py) against MKL's and oneDNN's packed kernels.

The bench model's 48 language-model products of a decode step (12 layers x fused q/k/v, o, fused gate/up, down),
each with its own weights, called in layer order, so the 380 MB of weights stream from memory as in a serving step
(between one step's use of a weight and the next, every other weight passed through the caches). Medians of
repeated passes per row count; ratios against MKL's packed kernel, in the same run.

    PYTHONPATH=src .venv/bin/python benchmarks/skinny_linear.py [--threads 2] [--passes 20]

Writes benchmarks/results/skinny_linear.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from tgi_vlm.config import KernelSettings
from tgi_vlm.kernels import cpu as cpu_kernels
from tgi_vlm.layers.linear.kernels import MklPackedLinear, OneDnnPackedLinear, PlainWeights
from tgi_vlm.layers.skinny_linear import skinny_available, skinny_weight

RESULTS = Path(__file__).parent / "results"
SHAPES = [(768, 1280), (768, 768), (768, 5120), (2560, 768)]  # (in, out) per layer
LAYERS = 12
ROWS = (1, 4, 8, 13, 16, 24, 32)


def _time_pass(products, inputs, passes: int) -> float:
    times = []
    for i in range(passes + 2):
        start = time.perf_counter()
        for layer in products:
            for product, x in zip(layer, inputs):
                product(x, None)
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _packed(kind, weight: torch.Tensor):
    """A packed kernel of `kind` over `weight`, packed now, called as the native copy is: `(x, bias)`."""
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight.data = weight.clone()
    kernel = kind(PlainWeights((layer,)))
    kernel.pack()
    return lambda x, bias: kernel(x)


def measure(passes: int) -> list[dict]:
    settings = KernelSettings.from_env()
    if not skinny_available(settings):
        reason = cpu_kernels.load(settings).reason("skinny_linear") or "switched off (TGI_VLM_SKINNY_LINEAR)"
        raise SystemExit(f"tgi_vlm::skinny_linear is not available here: {reason}")
    torch.manual_seed(0)
    weights = [[torch.randn(out, inp) for inp, out in SHAPES] for _ in range(LAYERS)]
    total_bytes = sum(w.numel() * 4 for layer in weights for w in layer)
    kinds = {
        "native": [[skinny_weight(w, settings) for w in layer] for layer in weights],
        "mkl": [[_packed(MklPackedLinear, w) for w in layer] for layer in weights],
        "onednn": [[_packed(OneDnnPackedLinear, w) for w in layer] for layer in weights],  # a torch without MKL
    }
    results = []
    for rows in ROWS:
        inputs = [torch.randn(rows, inp) for inp, _ in SHAPES]
        row = {"rows": rows}
        for kind, layers in kinds.items():
            ms = _time_pass(layers, inputs, passes)
            row[kind] = {"ms": ms, "gb_per_s": total_bytes / ms / 1e6}
        row["native_vs_mkl"] = row["native"]["ms"] / row["mkl"]["ms"]
        results.append(row)
    return results


def markdown(results: list[dict], meta: dict) -> str:
    lines = ["| rows | native ms (GB/s) | MKL packed ms (GB/s) | oneDNN packed ms (GB/s) | native / MKL |",
             "|---:|---:|---:|---:|---:|"]
    for r in results:
        cells = [f"{r[k]['ms']:.2f} ({r[k]['gb_per_s']:.1f})" for k in ("native", "mkl", "onednn")]
        lines.append(f"| {r['rows']} | " + " | ".join(cells) + f" | {r['native_vs_mkl']:.2f} |")
    return (f"# Float32 decode-sized linears ({meta['when']})\n\n`benchmarks/skinny_linear.py`: the bench model's 48 "
            f"decode products ({LAYERS} layers, 380 MB of float32 weights streamed in layer order), {meta['threads']} "
            f"threads, median of {meta['passes']} passes. The serving path uses the native loop for 1-24 rows "
            "(layers/skinny_linear.py `MAX_ROWS`) and MKL's packed kernel above.\n\n" + "\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--passes", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    meta = {"threads": args.threads, "passes": args.passes,
            "when": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    results = measure(args.passes)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "skinny_linear.json").write_text(json.dumps({**meta, "results": results}, indent=2) + "\n")
    (RESULTS / "skinny_linear.md").write_text(markdown(results, meta))
    print(markdown(results, meta))


if __name__ == "__main__":
    main()
