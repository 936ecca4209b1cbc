"""The CPU kernels under a serving step, in isolation: what layers/cpu.py and the torch backend chose from.

1. Linear layers of the bench model's shapes (q/o 768x768, k/v 768x256, gate/up 768x2560, down
   2560x768, lm-head 768x3763) at decode and prefill row counts: `F.linear` (what transformers
   runs) vs oneDNN's prepacked weights (`torch.ops.mkldnn._linear_pointwise`), bfloat16 and
   float32. Fastest of --repeat calls.
2. A new row count per call, as prefill steps see: 40 distinct counts in 300-2048, every layer
   shape, unbucketed vs padded to `row_bucket` (cold: first pass, kernels not yet built; warm: second).
3. Qwen2-VL's patch embedding (Conv3d, kernel = stride = one patch) vs the same product as a matmul.
4. Decode attention for 13 sequences of 300 positions: batched gather + SDPA vs one SDPA per
   sequence over a contiguous view, before and after `tune_allocator` (run in child processes:
   the allocator setting is process-wide and cannot be undone).

    .venv/bin/python benchmarks/cpu_kernels.py [--repeat 50]

Writes benchmarks/results/cpu_kernels.{json,md}. Needs an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from tgi_vlm.layers.linear.kernels import row_bucket

RESULTS = Path(__file__).parent / "results"
SHAPES = {"q/o": (768, 768), "k/v": (768, 256), "gate/up": (768, 2560), "down": (2560, 768), "lm_head": (768, 3763)}
ROWS = (1, 8, 16, 64, 256, 1024, 2048)


def fastest_ms(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def linear_table(repeat: int) -> list[dict]:
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for name, (k, n) in SHAPES.items():
            w = torch.randn(n, k, dtype=dtype) * 0.02
            for m in ROWS:
                x = torch.randn(m, k, dtype=dtype)
                plain = fastest_ms(lambda x=x, w=w: F.linear(x, w), repeat)
                packed = None
                if dtype == torch.bfloat16:
                    pw = torch.ops.mkldnn._reorder_linear_weight(w, m)
                    packed = fastest_ms(lambda x=x, pw=pw: torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], ""), repeat)
                rows.append(dict(dtype=str(dtype).removeprefix("torch."), layer=name, rows=m, f_linear_ms=plain,
                                 packed_ms=packed))
    return rows


def new_shapes(dtype: torch.dtype) -> dict:
    rng = random.Random(0)
    counts = rng.sample(range(300, 2049), 40)
    weights = {name: torch.randn(n, k, dtype=dtype) * 0.02 for name, (k, n) in SHAPES.items() if name != "lm_head"}
    inputs = {m: {k: torch.randn(m, k, dtype=dtype) for k in {768, 2560}} for m in counts}
    out = {}
    for label, pad in (("unbucketed", lambda m: m), ("bucketed", row_bucket)):
        passes = []
        for _ in range(2):
            start = time.perf_counter()
            for m in counts:
                p = pad(m)
                for w in weights.values():
                    x = inputs[m][w.shape[1]]
                    F.linear(F.pad(x, (0, 0, 0, p - m)) if p != m else x, w)
            passes.append((time.perf_counter() - start) * 1e3 / len(counts))
        out[label] = dict(cold_ms_per_step=passes[0], warm_ms_per_step=passes[1])
    out["distinct_counts"] = len(counts)
    out["distinct_buckets"] = len({row_bucket(m) for m in counts})
    return out


def patch_embed(repeat: int) -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        conv = torch.nn.Conv3d(3, 256, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=False).to(dtype)
        x = torch.randn(1024, 3, 2, 14, 14, dtype=dtype)  # one 448x448 image
        w = conv.weight.reshape(256, -1)
        rows.append(dict(dtype=str(dtype).removeprefix("torch."), patches=1024,
                         conv3d_ms=fastest_ms(lambda conv=conv, x=x: conv(x), max(3, repeat // 5)),
                         matmul_ms=fastest_ms(lambda x=x, w=w: F.linear(x.reshape(1024, -1), w), repeat)))
    return rows


ATTENTION_CHILD = r"""
import sys, time, torch, torch.nn.functional as F
if sys.argv[1] == "tuned":
    from tgi_vlm.layers.cpu import tune_allocator; tune_allocator()
B, Hq, Hkv, D, L = 13, 12, 4, 64, 300
dt = torch.bfloat16
kc = torch.randn(65536, Hkv, D, dtype=dt); vc = torch.randn(65536, Hkv, D, dtype=dt)
q = torch.randn(B, Hq, 1, D, dtype=dt)
starts = [i * 320 for i in range(B)]
idx = torch.stack([torch.arange(s, s + L) for s in starts]).reshape(-1)
def best(fn, n=int(sys.argv[2])):
    fn(); b = 1e9
    for _ in range(n):
        t = time.perf_counter(); fn(); b = min(b, time.perf_counter() - t)
    return b * 1e6
def gathered():
    k = kc.index_select(0, idx).view(B, L, Hkv, D).permute(0, 2, 1, 3)
    v = vc.index_select(0, idx).view(B, L, Hkv, D).permute(0, 2, 1, 3)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
def views():
    return torch.cat([F.scaled_dot_product_attention(q[b:b+1], kc[s:s+L].transpose(0, 1)[None],
                      vc[s:s+L].transpose(0, 1)[None], enable_gqa=True) for b, s in enumerate(starts)])
with torch.inference_mode():
    print(best(gathered), best(views))
"""


def decode_attention(repeat: int) -> dict:
    out = {}
    for mode in ("default", "tuned"):
        result = subprocess.run([sys.executable, "-c", ATTENTION_CHILD, mode, str(repeat * 4)], capture_output=True,
                                text=True, check=True)
        gathered, views = map(float, result.stdout.split())
        out[mode] = dict(gather_sdpa_us=gathered, per_sequence_views_us=views)
    return out


def markdown(r: dict) -> str:
    lines = [f"# CPU kernels ({r['machine']['cpu']}, {r['machine']['threads']} threads, torch {r['machine']['torch']})",
             "", f"{r['date']}; `benchmarks/cpu_kernels.py`; fastest of {r['repeat']} calls.", "",
             "## Linear layers: F.linear vs oneDNN prepacked weights (ms)", "",
             "| dtype | layer | rows | F.linear | prepacked |", "|---|---|---:|---:|---:|"]
    for row in r["linear"]:
        packed = "-" if row["packed_ms"] is None else f"{row['packed_ms']:.3f}"
        lines.append(f"| {row['dtype']} | {row['layer']} | {row['rows']} | {row['f_linear_ms']:.3f} | {packed} |")
    lines += ["", "## A new row count every prefill step (all 4 text-layer shapes, ms per step)", "",
              "| dtype | rows | cold | warm |", "|---|---|---:|---:|"]
    for dtype, res in r["new_shapes"].items():
        for label in ("unbucketed", "bucketed"):
            lines.append(f"| {dtype} | {label} | {res[label]['cold_ms_per_step']:.2f} | {res[label]['warm_ms_per_step']:.2f} |")
        lines.append(f"| {dtype} | ({res['distinct_counts']} counts → {res['distinct_buckets']} buckets) | | |")
    lines += ["", "## Patch embedding, one 448x448 image (ms)", "", "| dtype | Conv3d | matmul |", "|---|---:|---:|"]
    for row in r["patch_embed"]:
        lines.append(f"| {row['dtype']} | {row['conv3d_ms']:.2f} | {row['matmul_ms']:.2f} |")
    lines += ["", "## Decode attention, 13 sequences x 300 positions, one layer (us)", "",
              "| allocator | gather + batched SDPA | SDPA per sequence on views |", "|---|---:|---:|"]
    for mode, res in r["decode_attention"].items():
        lines.append(f"| {mode} | {res['gather_sdpa_us']:.0f} | {res['per_sequence_views_us']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    with torch.inference_mode():
        result = dict(
            date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            machine=dict(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads(),
                         torch=torch.__version__, capability=torch.backends.cpu.get_cpu_capability()),
            repeat=args.repeat,
            linear=linear_table(args.repeat),
            new_shapes={str(d).removeprefix("torch."): new_shapes(d) for d in (torch.bfloat16, torch.float32)},
            patch_embed=patch_embed(args.repeat),
        )
    result["decode_attention"] = decode_attention(args.repeat)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_kernels.json").write_text(json.dumps(result, indent=2))
    (RESULTS / "cpu_kernels.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
