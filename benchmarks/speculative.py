"""Speculative decoding (`--speculate N`) vs none, in one run, on the ~95M-parameter bench llama.

Workloads (16 requests decoded together, greedy, 48 new tokens each, EOS ignored, float32 CPU):
- normal: prompts of 20-60 random words. With random weights the model never repeats itself, so
  n-gram drafts are rejected: this row measures what speculation costs when it does not help.
- repetitive: each prompt asks to continue a passage it already contains twice; n-gram drafts
  come from the prompt (what OCR-like extraction looks like).
- known continuation: the drafter proposes the plain run's own output (every draft right). Not a
  real drafter: it shows the speed of the verification path when drafts are accepted, i.e. the
  ceiling a repetitive workload approaches on a trained model.

Every speculative run's tokens are checked equal to the plain run's. Reports decode tokens/s
(tokens ÷ time of the steps after every prompt is in), acceptance rate and tokens per verified run.

    .venv/bin/python benchmarks/speculative.py [--depth 4] [--threads 2] [--repeat 3]

Writes benchmarks/results/speculative.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from tgi_vlm.config import EngineConfig
from tgi_vlm.models import get_model
from tgi_vlm.testing import tiny_model_path
from tgi_vlm.testing.harness import Runner, make_request

RESULTS = Path(__file__).parent / "results"
WORDS = "the of and to in is was for on that with as by at from it be this are or which have not".split()
NEW_TOKENS = 48
REQUESTS = 16


def prompts(kind: str, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(REQUESTS):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))
        out.append(words if kind == "normal" else f"{words} . {words} . {words}")
    return out


class KnownContinuation:
    def __init__(self, full: list[list[int]]):
        self.full = full

    def propose(self, ids, max_tokens):
        for seq in self.full:
            if seq[: len(ids)] == list(ids):
                return seq[len(ids) : len(ids) + max_tokens]
        return []


def run(engine, texts: list[str]) -> tuple[dict[int, list[int]], float, int]:
    """(tokens per request, decode seconds, decode steps) with every request prefilled first."""
    runner = Runner(engine)
    runner.prefill([make_request(i, t, max_new_tokens=NEW_TOKENS) for i, t in enumerate(texts)])
    start, steps = time.perf_counter(), 0
    while runner.batch is not None:
        runner.step()
        steps += 1
    return dict(runner.tokens), time.perf_counter() - start, steps


def measure(plain, spec, texts: list[str], repeat: int, known: bool) -> dict:
    """The run with the median speedup of `repeat` alternating plain/speculative pairs."""
    pairs = []
    for _ in range(repeat):
        ref, t_plain, s_plain = run(plain, texts)
        if known:
            spec.drafter = KnownContinuation([plain.tokenize_request(make_request(0, t)).ids + ref[i]
                                              for i, t in enumerate(texts)])
        before = (spec.speculation.drafted, spec.speculation.accepted, spec.speculation.runs)
        got, t_spec, s_spec = run(spec, texts)
        drafted, accepted, runs = (a - b for a, b in zip(
            (spec.speculation.drafted, spec.speculation.accepted, spec.speculation.runs), before))
        assert got == ref, "speculation changed the tokens"
        decoded = sum(len(v) - 1 for v in ref.values())  # the first token of each comes from prefill
        row = dict(plain_tok_s=decoded / t_plain, spec_tok_s=decoded / t_spec, plain_steps=s_plain, spec_steps=s_spec,
                   acceptance=accepted / drafted if drafted else 0.0, tokens_per_run=1 + accepted / runs if runs else 1.0)
        row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
        pairs.append(row)
    pairs.sort(key=lambda r: r["speedup"])
    return {**pairs[len(pairs) // 2], "speedups": [round(r["speedup"], 3) for r in pairs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = str(tiny_model_path("llama", size="bench"))
    config = EngineConfig(device="cpu", dtype="float32", cpu_kv_cache_bytes=1 << 30)
    plain = get_model(path, config)
    spec = get_model(path, EngineConfig(**{**config.__dict__, "speculate": args.depth}))
    from tgi_vlm.generation import NgramDrafter

    rows = {}
    for name, kind, known in [("normal", "normal", False), ("repetitive", "repetitive", False),
                              ("known continuation", "normal", True)]:
        spec.drafter = NgramDrafter()
        rows[name] = measure(plain, spec, prompts(kind), args.repeat, known)
    result = dict(timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"), depth=args.depth,
                  threads=args.threads, requests=REQUESTS, new_tokens=NEW_TOKENS, rows=rows)
    lines = [f"# speculative decoding — {result['timestamp']}", "",
             f"bench llama (~95M), float32 CPU, {args.threads} threads, {REQUESTS} requests x {NEW_TOKENS} tokens, "
             f"--speculate {args.depth}; tokens identical to the plain run in every row; median of {args.repeat} "
             "alternating plain/speculative pairs (all speedups in the JSON).", "",
             "| workload | plain tok/s | speculative tok/s | speedup | decode steps plain/spec | acceptance | tokens per verified run |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['plain_steps']}/{r['spec_steps']} | {r['acceptance']:.1%} | {r['tokens_per_run']:.2f} |")
    report = "\n".join(lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "speculative.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "speculative.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
