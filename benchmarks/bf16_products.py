"""The bf16 products of a decode or short prefill step: the native product (`tgi_vlm::skinny_linear_bf16`: AMX tiles
where the CPU has them, else the VDPBF16PS loop for its few rows) against oneDNN's packed product, which the linear
plan would use otherwise (layers/skinny_linear.py quotes these figures).

Gemma 3 270M's shapes: its 18 layers' four products (q/k/v fused 1536 x 640, o 640 x 1024, gate/up fused 4096 x 640,
down 640 x 2048), each layer its own random weights so nothing stays in cache, and the tied 262,144 x 640 head; each
row count timed as the median of a few passes over all of them, the two kernels alternating.

    PYTHONPATH=src .venv/bin/python benchmarks/bf16_products.py [--rows 1,4,16,64,256] [--threads 2]

Writes benchmarks/results/bf16_products.{json,md}.
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
from tgi_vlm.kernels.cpu import ops
from tgi_vlm.testing.machine import machine

RESULTS = Path(__file__).parent / "results"
LAYER_SHAPES = [(1536, 640), (640, 1024), (4096, 640), (640, 2048)]  # (out, in)
HEAD = (262_144, 640)


def timed(fn, passes: int) -> float:
    fn()
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 32, 64, 128, 256])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--passes", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    kernels = cpu_kernels.load(KernelSettings.from_env())
    if not kernels.available("skinny_linear_bf16") or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        raise SystemExit("needs the native bf16 product (AVX512-BF16) and oneDNN's bf16 packing")
    amx_rows, loop_rows = ops.amx_max_rows(), ops.skinny_bf16_max_rows()
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=gen).bfloat16() for n, k in LAYER_SHAPES] for _ in range(18)]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in layer] for layer in weights]
    blocked = [[ops.blocked_weight_bf16(w) for w in layer] for layer in weights]
    head = torch.randn(*HEAD, generator=gen).bfloat16()
    head_packed, head_blocked = torch.ops.mkldnn._reorder_linear_weight(head, 16), ops.blocked_weight_bf16(head)
    rows_out = []
    for rows in a.rows:
        if rows > max(amx_rows, loop_rows):
            continue
        xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for _, k in LAYER_SHAPES}
        layers_native = timed(lambda xs=xs: [ops.skinny_linear_bf16(xs[k], b, n, None)
                                       for layer in blocked for (n, k), b in zip(LAYER_SHAPES, layer)], a.passes)
        layers_onednn = timed(lambda xs=xs: [torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")
                                       for layer in packed for (n, k), w in zip(LAYER_SHAPES, layer)], a.passes)
        x = torch.randn(rows, HEAD[1], generator=gen).bfloat16()
        head_native = timed(lambda x=x: ops.skinny_linear_bf16(x, head_blocked, HEAD[0], None), a.passes)
        head_onednn = timed(lambda x=x: torch.ops.mkldnn._linear_pointwise(x, head_packed, None, "none", [], ""),
                            a.passes)
        rows_out.append({"rows": rows, "path": "amx" if rows <= amx_rows else "vdpbf16ps",
                         "layers_native_ms": layers_native, "layers_onednn_ms": layers_onednn,
                         "head_native_ms": head_native, "head_onednn_ms": head_onednn})
        print(rows_out[-1], flush=True)
    report = {"machine": machine(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "threads": a.threads, "amx_max_rows": amx_rows, "loop_max_rows": loop_rows, "rows": rows_out}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bf16_products.json").write_text(json.dumps(report, indent=1))
    layer_bytes = sum(n * k * 2 for n, k in LAYER_SHAPES) * 18
    lines = [f"# bf16 products, native vs oneDNN packed — {report['date']}", "",
             f"{json.dumps(report['machine'])}; {a.threads} threads; AMX rows up to {amx_rows}, VDPBF16PS loop up to "
             f"{loop_rows}. Median of {a.passes} passes, weights cold (18 layers of Gemma 3 270M's shapes, "
             f"{layer_bytes / 1e6:.0f} MB; the head {HEAD[0] * HEAD[1] * 2 / 1e6:.0f} MB).", "",
             "| rows | native path | 72 decoder products native ms | oneDNN ms | head native ms | oneDNN ms |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in rows_out:
        lines.append(f"| {r['rows']} | {r['path']} | {r['layers_native_ms']:.2f} | {r['layers_onednn_ms']:.2f} | "
                     f"{r['head_native_ms']:.2f} | {r['head_onednn_ms']:.2f} |")
    (RESULTS / "bf16_products.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
