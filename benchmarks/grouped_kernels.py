"""The quantized (int8-grouped) product by row count: `tgi_vlm::grouped_int8_linear` (FMA loop; AMX tiles for bf16
12..32 rows) against de-quantizing slices of the weight (`grouped_int8_dequantize`) and multiplying with torch, on
Gemma 3 270M's shapes, random codes, bf16 rows, warm (min of 7). Backs NATIVE_MAX_ROWS and AMX_MIN_ROWS
(layers/linear/grouped.py, csrc/grouped_linear.c).

    .venv/bin/python benchmarks/grouped_kernels.py        # writes benchmarks/results/grouped_kernels.{json,md}
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tgi_vlm.config import KernelSettings
from tgi_vlm.kernels import cpu
from tgi_vlm.kernels.cpu import ops
from tgi_vlm.testing.machine import machine

RESULTS = Path(__file__).parent / "results"
SHAPES = [(4096, 640), (640, 2048), (262_144, 640)]  # (out, in): fused gate/up, down, the lm-head
ROWS = [1, 4, 8, 12, 16, 32, 64, 256]
SLICE_VALUES = 1 << 22


def best_ms(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def sliced(x, codes, scales):
    step = max(16, SLICE_VALUES // codes.shape[1])
    return torch.cat([F.linear(x, ops.grouped_int8_dequantize(codes[s:s + step], scales[s:s + step], None, 32,
                                                              x.dtype))
                      for s in range(0, codes.shape[0], step)], dim=-1)


def main() -> None:
    assert cpu.load(KernelSettings()).available("grouped_int8_linear"), "the native library does not load here"
    torch.manual_seed(0)
    rows_out = []
    for out, in_features in SHAPES:
        codes = torch.randint(-128, 128, (out, in_features), dtype=torch.int8)
        scales = torch.rand(out, in_features // 32) * 0.01
        for rows in ROWS:
            x = torch.randn(rows, in_features).bfloat16()
            native = best_ms(lambda x=x, c=codes, s=scales: ops.grouped_int8_linear(x, c, s, None, 32))
            dense = best_ms(lambda x=x, c=codes, s=scales: sliced(x, c, s))
            rows_out.append(dict(out=out, inp=in_features, rows=rows, native_ms=native, sliced_ms=dense))
            print(out, in_features, rows, f"native {native:.2f} sliced {dense:.2f}", flush=True)
    result = dict(machine=machine(), rows=rows_out)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "grouped_kernels.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# The int8-grouped product by row count (bf16 rows, group 32, warm, min of 7)", "",
             f"- machine: {result['machine']}", "",
             "| weight (out x in) | rows | native op ms | de-quantized slices + torch ms |", "|---|---:|---:|---:|"]
    lines += [f"| {r['out']} x {r['inp']} | {r['rows']} | {r['native_ms']:.2f} | {r['sliced_ms']:.2f} |"
              for r in rows_out]
    (RESULTS / "grouped_kernels.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
