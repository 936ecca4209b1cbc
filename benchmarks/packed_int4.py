"""Decode-sized products of a 4-bit grouped weight three ways, for the choice written in docs/decisions.md ("Quantized
checkpoints, second part"): the shard's exact `GroupedInt8Weight` product (`tgi_vlm::grouped_int8_linear`, int8 codes
q - z, float32 scales), core torch's int4 weight-only op (`aten._weight_int4pack_mm_for_cpu`: codes packed two a byte,
(scale, zero) per group in the activation's dtype, bf16 here), and the bf16 weight de-quantized (`F.linear`, the
float model's cost). Also each form's bytes and the int4 op's error against the exact product (float64 of the exact
float32 weight): (scale, zero) rounded to bf16 is not the checkpoint's definition.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/packed_int4.py     # writes results/packed_int4.{json,md}
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).parent / "results"
SHAPES = [(640, 2048), (2048, 640), (2560, 768)]  # [out, in]: an MLP's down / up at 640 wide, the bench model's up
ROWS = (1, 16)
GROUP = 128


def timed(fns: dict, reps: int = 300) -> dict[str, float]:
    """Fastest of `reps` per function, the functions interleaved (a shared 2-core machine: the minimum is the least
    disturbed run; the median is kept too)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: (min(v) * 1e3, statistics.median(v) * 1e3) for k, v in times.items()}


def case(out: int, inp: int, rows: int) -> dict:
    from tgi_vlm.kernels.cpu import ops
    from tgi_vlm.quantization.packed_formats import grouped_weight

    g = torch.Generator().manual_seed(out * inp)
    q = torch.randint(0, 16, (out, inp), generator=g, dtype=torch.int32)
    z = torch.randint(0, 16, (out, inp // GROUP), generator=g, dtype=torch.int32)
    s = (torch.rand(out, inp // GROUP, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
    exact = grouped_weight(q, z, s, GROUP, 4, "bench")
    w = exact.dequantize()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    sz = torch.stack([s.float().t(), ((8 - z) * s.float()).t()], -1).to(torch.bfloat16).contiguous()
    x = torch.randn(rows, inp, generator=g).to(torch.bfloat16)
    w_bf16 = w.to(torch.bfloat16)
    truth = x.double() @ w.double().t()
    int4 = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz)
    grouped = ops.grouped_int8_linear(x, exact.codes, exact.scales, None, GROUP)
    scale = truth.abs().max().item()
    # the weight each computes with: int4pack's definition is (q - 8) * scale + zero, both rounded to bf16
    w_int4 = (q - 8).float() * sz[..., 0].float().t().repeat_interleave(GROUP, 1) + sz[..., 1].float().t(
    ).repeat_interleave(GROUP, 1)
    ms = timed({"grouped-int8 (exact)": lambda: ops.grouped_int8_linear(x, exact.codes, exact.scales, None, GROUP),
                "int4pack (torch)": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz),
                "bf16 F.linear": lambda: F.linear(x, w_bf16)})
    return {
        "shape": f"{out}x{inp}", "rows": rows, "ms": {k: v[0] for k, v in ms.items()},
        "ms_median": {k: v[1] for k, v in ms.items()},
        "max_err_rel": {"grouped-int8 (exact)": (grouped.double() - truth).abs().max().item() / scale,
                        "int4pack (torch)": (int4.double() - truth).abs().max().item() / scale,
                        "bf16 F.linear": (F.linear(x, w_bf16).double() - truth).abs().max().item() / scale},
        "weight_err_rel": {"grouped-int8 (exact)": 0.0,
                           "int4pack (torch)": ((w_int4 - w).abs().max() / w.abs().max()).item(),
                           "bf16 F.linear": ((w_bf16.float() - w).abs().max() / w.abs().max()).item()},
        "bytes": {"grouped-int8 (exact)": exact.nbytes, "int4pack (torch)": packed.nbytes + sz.nbytes,
                  "bf16 F.linear": w_bf16.nbytes},
    }


def main() -> None:
    from tgi_vlm.config import KernelSettings
    from tgi_vlm.kernels import cpu
    from tgi_vlm.testing.machine import machine

    assert cpu.load(KernelSettings()).available("grouped_int8_linear"), "the native library does not load here"
    results = [case(o, i, r) for o, i in SHAPES for r in ROWS]
    kinds = list(results[0]["ms"])
    host = machine()
    lines = [f"# 4-bit grouped products (group {GROUP}, bf16 rows): exact int8 codes vs torch's int4pack vs bf16", "",
             f"{host.get('cpu', host)}; torch {torch.__version__}, {torch.get_num_threads()} threads; fastest (median) "
             "of 300 interleaved runs on a shared machine. Errors: the product's max |error| over max |exact| (bf16 "
             "outputs: their rounding dominates), and the weight's own (what each multiplies by, against the "
             "checkpoint's exact float32 values).", "",
             "| shape [out x in] | rows | " + " | ".join(f"{k} ms" for k in kinds) + " | " +
             " | ".join(f"{k} product err" for k in kinds) + " |",
             "|---|---:|" + "---:|" * (2 * len(kinds))]
    for r in results:
        lines.append(f"| {r['shape']} | {r['rows']} | " + " | ".join(
            f"{r['ms'][k]:.3f} ({r['ms_median'][k]:.3f})" for k in kinds) + " | " +
            " | ".join(f"{r['max_err_rel'][k]:.1e}" for k in kinds) + " |")
    lines += ["", "| shape | " + " | ".join(f"{k} weight err" for k in kinds) + " |", "|---|" + "---:|" * len(kinds)]
    for r in results[:: len(ROWS)]:
        lines.append(f"| {r['shape']} | " + " | ".join(f"{r['weight_err_rel'][k]:.1e}" for k in kinds) + " |")
    lines += ["", "| shape | " + " | ".join(f"{k} bytes" for k in kinds) + " |", "|---|" + "---:|" * len(kinds)]
    for r in results[:: len(ROWS)]:
        lines.append(f"| {r['shape']} | " + " | ".join(f"{r['bytes'][k]:,}" for k in kinds) + " |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "packed_int4.json").write_text(json.dumps(results, indent=1))
    (RESULTS / "packed_int4.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
