"""Decode attention of one layer, three ways, on the same paged cache: the native kernel (`tgi_vlm::decode_attention`,
kernels/cpu/, as the CPU attention backend calls it), SDPA over a dense padded copy (what the decode mirror feeds
it), and the reference gather + SDPA.

Shapes: 13 decoding sequences of 80-430 positions (the bench workload's), scattered 16-slot blocks in a cache of
4000 blocks; the bench model's heads (12 query, 4 kv, 64) and a Qwen2-VL-2B-like layer (12 query, 2 kv, 128).
Two conditions: warm (calls back to back: the layer's K/V stay in cache) and cold (a 256 MB buffer is written
before each call, as a serving step's weights stream through the caches between one layer's attention and the
next step's). Rounds alternate the three ways; medians of the rounds.

    PYTHONPATH=src .venv/bin/python benchmarks/native_decode_attention.py

Writes benchmarks/results/native_decode_attention.{json,md}.
"""

from __future__ import annotations

import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from tgi_vlm.config import KernelSettings
from tgi_vlm.kernels import cpu as cpu_kernels
from tgi_vlm.kernels.cpu import ops
from tgi_vlm.layers.attention.cpu_backend import NativeDecodeStep
from tgi_vlm.layers.attention.metadata import DecodeGroup, decode_mask

RESULTS = Path(__file__).parent / "results"
BLOCK, NUM_BLOCKS, ROWS, ROUNDS, CALLS, COLD_CALLS = 16, 4000, 13, 7, 50, 8
EVICT = torch.zeros(256 << 18)  # 256 MB of float32
SHAPES = [(12, 4, 64), (12, 2, 128)]


def case(hq: int, hkv: int, head_dim: int, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(80, 431, (ROWS,), generator=gen).tolist()
    k_cache = torch.randn(NUM_BLOCKS * BLOCK, hkv, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(NUM_BLOCKS * BLOCK, hkv, head_dim, generator=gen).to(dtype)
    order = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    width = max(lens)
    slot_index = torch.zeros(ROWS, width, dtype=torch.long)
    for row, n in enumerate(lens):
        blocks = torch.tensor([order.pop() for _ in range(-(-n // BLOCK))])
        slot_index[row, :n] = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:n]
    q = torch.randn(ROWS, hq, head_dim, generator=gen).to(dtype)
    out = torch.empty_like(q)
    group = DecodeGroup.build(list(range(ROWS)), lens, slot_index, ROWS)
    step = NativeDecodeStep(group)
    mask = decode_mask(group.kv_lens, width, None, None)
    capacity = (width // 64 + 1) * 64  # the mirror's aligned capacity
    dense_k = torch.zeros(ROWS, hkv, capacity, head_dim, dtype=dtype)
    dense_v = torch.zeros_like(dense_k)
    for row, n in enumerate(lens):
        dense_k[row, :, :n] = k_cache[slot_index[row, :n]].transpose(0, 1)
        dense_v[row, :, :n] = v_cache[slot_index[row, :n]].transpose(0, 1)

    row_spans = step.row_spans(None, None)

    def kernel():
        ops.decode_attention(q, out, k_cache, v_cache, step.slot_index, row_spans, head_dim ** -0.5)

    def mirror_sdpa():
        F.scaled_dot_product_attention(q[:, :, None], dense_k[:, :, :width], dense_v[:, :, :width], attn_mask=mask,
                                       enable_gqa=True)

    def gather_sdpa():
        k = k_cache.index_select(0, slot_index.reshape(-1)).view(ROWS, width, hkv, head_dim).permute(0, 2, 1, 3)
        v = v_cache.index_select(0, slot_index.reshape(-1)).view(ROWS, width, hkv, head_dim).permute(0, 2, 1, 3)
        F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, enable_gqa=True)

    ways = {"native kernel": kernel, "SDPA over the mirror": mirror_sdpa, "gather + SDPA": gather_sdpa}
    times: dict[tuple[str, str], list[float]] = {(name, c): [] for name in ways for c in ("warm", "cold")}
    for fn in ways.values():
        for _ in range(10):
            fn()
    for round_ in range(ROUNDS):
        names = list(ways) if round_ % 2 == 0 else list(ways)[::-1]
        for name in names:
            start = time.perf_counter()
            for _ in range(CALLS):
                ways[name]()
            times[name, "warm"].append((time.perf_counter() - start) / CALLS * 1e6)
            cold = 0.0
            for _ in range(COLD_CALLS):
                EVICT.add_(1.0)
                start = time.perf_counter()
                ways[name]()
                cold += time.perf_counter() - start
            times[name, "cold"].append(cold / COLD_CALLS * 1e6)
    result = {"dtype": str(dtype).removeprefix("torch."), "heads": f"{hq}/{hkv}x{head_dim}", "positions": sum(lens)}
    result.update({f"{name} {c}": statistics.median(t) for (name, c), t in times.items()})
    return result


def markdown(results: list[dict], when: str) -> str:
    lines = ["| dtype | heads (q/kv x dim) | cache | native kernel us | SDPA over the mirror us | gather + SDPA us | "
             "mirror / native |", "|---|---|---|---:|---:|---:|---:|"]
    for r in results:
        for c in ("warm", "cold"):
            native, mirror, gather = (r[f"{w} {c}"] for w in ("native kernel", "SDPA over the mirror", "gather + SDPA"))
            lines.append(f"| {r['dtype']} | {r['heads']} | {c} | {native:.1f} | {mirror:.1f} | {gather:.1f} | "
                         f"{mirror / native:.2f} |")
    return (f"# Decode attention of one layer ({when})\n\n`benchmarks/native_decode_attention.py`: {ROWS} sequences of "
            f"80-430 positions ({results[0]['positions']} in all) in scattered blocks of a {NUM_BLOCKS}-block cache, "
            f"{torch.get_num_threads()} threads; medians of {ROUNDS} alternating rounds ({CALLS} calls back to back "
            f"for warm, {COLD_CALLS} calls each after writing 256 MB for cold). The mirror's copy itself (one position "
            "per row per step) is not counted.\n\n" + "\n".join(lines) + "\n")


def main() -> None:
    kernels = cpu_kernels.load(KernelSettings.from_env())
    if not kernels.available("decode_attention"):
        raise SystemExit(f"tgi_vlm::decode_attention is not available here: {kernels.reason('decode_attention')}")
    results = [case(hq, hkv, d, dtype) for hq, hkv, d in SHAPES for dtype in (torch.bfloat16, torch.float32)]
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "native_decode_attention.json").write_text(json.dumps({"when": when, "results": results}, indent=2) + "\n")
    (RESULTS / "native_decode_attention.md").write_text(markdown(results, when))
    print(markdown(results, when))


if __name__ == "__main__":
    main()
