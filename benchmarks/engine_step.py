"""Engine vs transformers on the ~100M-parameter bench llama (CPU; float32 or bfloat16, both sides alike).

The engine starts as a shard does: the router's Warmup first (which also builds the CPU kernels).

1. Decode step: one `generate_token` of our engine vs one bare transformers forward with a
   DynamicCache (one new token per sequence, past ~128), at batch 1/8/32. Median over steps
   after warm-up; the ratio is engine ÷ bare forward (target ≤ 1.05 at batch 8 and 32).
2. End to end: 32 requests of mixed prompt lengths (16-256) and max_new_tokens (16-64,
   ignore_eos) through the engine with continuous batching (all arrive at once, finished ones
   filtered out) vs `generate` in static left-padded batches of 8. Each static batch runs to
   the largest max_new_tokens among its requests, but only each request's own tokens count.
   Greedy outputs are compared request by request (target: ≥ 2× tokens/s).

    .venv/bin/python benchmarks/engine_step.py [--quick] [--threads 2] [--dtype bfloat16]

Writes benchmarks/results/engine_step.{json,md} (--quick: engine_step-quick.{json,md}; bfloat16:
engine_step-bfloat16.{json,md}).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from tgi_vlm.config import EngineConfig
from tgi_vlm.models import get_model
from tgi_vlm.models.flash_causal_lm import DEFAULT_PREFILL_BUDGET
from tgi_vlm.router.warmup import warmup_request
from tgi_vlm.testing import tiny_model_path
from tgi_vlm.testing.harness import Runner, make_batch, make_request
from tgi_vlm.testing.machine import machine

RESULTS = Path(__file__).parent / "results"
STEP_PROMPT_TOKENS = 128


def make_prompts(tokenizer, lengths: list[int], seed: int) -> list[str]:
    """Texts of about `lengths[i]` tokens, decoded from random non-special ids."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    return [tokenizer.decode([rng.choice(vocab) for _ in range(n)]) for n in lengths]


# ----- 1. one decode step -----------------------------------------------------------------------


class EngineDecode:
    """`len(prompts)` sequences prefilled in our engine; `step()` times one decode `generate_token`."""

    def __init__(self, engine, prompts: list[str], num_steps: int):
        requests = [make_request(i, p, max_new_tokens=num_steps + 2) for i, p in enumerate(prompts)]
        self.engine = engine
        _, self.batch, _ = engine.generate_token(engine.batch_from_pb(make_batch(1, requests)))  # prefill

    def step(self) -> tuple[float, float]:
        """(ms of the whole step, ms of its forward part)."""
        start = time.perf_counter()
        _, self.batch, timings = self.engine.generate_token(self.batch)
        return (time.perf_counter() - start) * 1e3, timings.forward_ns / 1e6


class BareDecode:
    """The same model in transformers: a DynamicCache, one new token per sequence per forward."""

    def __init__(self, model, input_ids: torch.Tensor):
        self.model = model
        self.cache = DynamicCache()
        with torch.inference_mode():
            out = model(input_ids=input_ids, past_key_values=self.cache, use_cache=True)
        self.next_ids = out.logits[:, -1:].argmax(-1)  # [B, 1]

    def step(self) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model(input_ids=self.next_ids, past_key_values=self.cache, use_cache=True)
            self.next_ids = out.logits[:, -1:].argmax(-1)
        return (time.perf_counter() - start) * 1e3


def bench_decode_step(engine, model, tokenizer, batch_sizes, warmup: int, steps: int) -> list[dict]:
    """Steps of the two alternate, so load from other processes hits both alike."""
    rows = []
    for bs in batch_sizes:
        ours = EngineDecode(engine, make_prompts(tokenizer, [STEP_PROMPT_TOKENS] * bs, seed=bs), warmup + steps)
        ids = torch.randint(0, model.config.vocab_size, (bs, STEP_PROMPT_TOKENS),
                            generator=torch.Generator().manual_seed(bs))
        bare = BareDecode(model, ids)
        totals, forwards, bares = [], [], []
        for i in range(warmup + steps):
            total, forward = ours.step()
            bare_ms = bare.step()
            if i >= warmup:
                totals.append(total)
                forwards.append(forward)
                bares.append(bare_ms)
        ours.batch.release()
        engine_ms, hf_ms = statistics.median(totals), statistics.median(bares)
        rows.append(dict(batch=bs, engine_ms=engine_ms, engine_forward_ms=statistics.median(forwards),
                         hf_forward_ms=hf_ms, ratio=engine_ms / hf_ms))
    return rows


# ----- 2. end to end ----------------------------------------------------------------------------


def e2e_workload(tokenizer, n: int, quick: bool) -> tuple[list[str], list[int]]:
    rng = random.Random(0)
    top = 96 if quick else 256
    lengths = [rng.randint(16, top) for _ in range(n)]
    max_new = [rng.randint(16, 32 if quick else 64) for _ in range(n)]
    return make_prompts(tokenizer, lengths, seed=1), max_new


def run_engine(engine, prompts: list[str], max_new: list[int]) -> tuple[float, dict[int, list[int]]]:
    runner = Runner(engine)
    engine.logits_observer = None  # the runner's observer copies every logits row; not part of serving
    start = time.perf_counter()
    runner.prefill([make_request(i, p, max_new_tokens=n) for i, (p, n) in enumerate(zip(prompts, max_new))])
    runner.run()
    return time.perf_counter() - start, dict(runner.tokens)


def run_hf(model, tokenizer, prompts: list[str], max_new: list[int], batch_size: int) -> tuple[float, dict[int, list[int]]]:
    tokens: dict[int, list[int]] = {}
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        idx = list(range(first, min(first + batch_size, len(prompts))))
        inputs = tokenizer([prompts[i] for i in idx], return_tensors="pt", padding=True, padding_side="left")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=max(max_new[i] for i in idx), do_sample=False,
                                 eos_token_id=None)  # as ignore_eos: never stop, never mask EOS
        new = out[:, inputs["input_ids"].shape[1] :]
        for row, i in enumerate(idx):
            tokens[i] = new[row, : max_new[i]].tolist()
    return time.perf_counter() - start, tokens


def bench_e2e(engine, model, tokenizer, n: int, quick: bool) -> dict:
    prompts, max_new = e2e_workload(tokenizer, n, quick)
    run_engine(engine, prompts[:2], [4, 4])  # warm both paths once
    run_hf(model, tokenizer, prompts[:2], [4, 4], 2)
    engine_s, ours = run_engine(engine, prompts, max_new)
    hf_s, theirs = run_hf(model, tokenizer, prompts, max_new, batch_size=8)
    total = sum(max_new)
    lengths = [len(tokenizer(p)["input_ids"]) for p in prompts]
    return dict(
        requests=n,
        prompt_tokens=dict(min=min(lengths), max=max(lengths), total=sum(lengths)),
        max_new_tokens=dict(min=min(max_new), max=max(max_new), total=total),
        engine_s=engine_s,
        hf_s=hf_s,
        engine_tok_s=total / engine_s,
        hf_tok_s=total / hf_s,
        ratio=(total / engine_s) / (total / hf_s),
        greedy_match=sum(ours[i] == theirs[i] for i in range(n)),
        hf_note="generate in static batches of 8 (left padding), each run to its batch's largest "
                "max_new_tokens; only each request's own max_new_tokens count",
    )


# ----- report -----------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    m, e2e = result["machine"], result["e2e"]
    lines = [
        f"# engine_step — {result['timestamp']}",
        "",
        f"bench llama ({result['params_m']:.1f}M params), {result['dtype']}, CPU: {m['cpu']}, {m['cores']} cores, "
        f"torch threads {m['torch_threads']}, torch {m['torch']}, transformers {m['transformers']}"
        + (" (--quick)" if result["quick"] else ""),
        "",
        f"## Decode step (prompt {STEP_PROMPT_TOKENS} tokens, median of {result['steps']} steps)",
        "",
        "| batch | engine step ms | engine forward ms | transformers forward ms | ratio (target ≤ 1.05) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in result["decode_step"]:
        lines.append(f"| {r['batch']} | {r['engine_ms']:.1f} | {r['engine_forward_ms']:.1f} | {r['hf_forward_ms']:.1f} "
                     f"| {r['ratio']:.2f} |")
    lines += [
        "",
        f"## End to end ({e2e['requests']} requests, prompts {e2e['prompt_tokens']['min']}-{e2e['prompt_tokens']['max']} "
        f"tokens, max_new_tokens {e2e['max_new_tokens']['min']}-{e2e['max_new_tokens']['max']})",
        "",
        "| | seconds | tokens/s |",
        "|---|---:|---:|",
        f"| engine (continuous batching) | {e2e['engine_s']:.2f} | {e2e['engine_tok_s']:.1f} |",
        f"| transformers generate (static batches of 8) | {e2e['hf_s']:.2f} | {e2e['hf_tok_s']:.1f} |",
        "",
        f"ratio {e2e['ratio']:.2f}× (target ≥ 2×); greedy outputs equal for {e2e['greedy_match']}/{e2e['requests']} requests.",
        f"transformers: {e2e['hf_note']}.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller run for a smoke test")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated")  # transformers 5.x rename
    torch.manual_seed(0)

    path = tiny_model_path("llama", size="bench")
    engine = get_model(str(path), EngineConfig(device="cpu", dtype=args.dtype, cpu_kv_cache_bytes=1 << 30))
    # as a shard starts: the router's Warmup (TGI's default prefill budget, 4096), which also builds the CPU kernels
    engine.warmup(warmup_request(1024, DEFAULT_PREFILL_BUDGET, 2048))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    warmup, steps = (2, 3) if args.quick else (3, 10)

    decode = bench_decode_step(engine, model, tokenizer, [1, 8] if args.quick else [1, 8, 32], warmup, steps)
    e2e = bench_e2e(engine, model, tokenizer, 8 if args.quick else 32, args.quick)
    result = dict(
        timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        machine=machine(),
        model=str(path.name),
        params_m=sum(p.numel() for p in model.parameters()) / 1e6,
        quick=args.quick,
        dtype=args.dtype,
        steps=steps,
        decode_step=decode,
        e2e=e2e,
    )
    report = markdown(result)
    print(report)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "engine_step-quick" if args.quick else "engine_step"  # a smoke run keeps the full results
    if args.dtype != "float32":
        stem += f"-{args.dtype}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(report)


if __name__ == "__main__":
    main()
