"""What grammar-constrained decoding costs the engine, on the ~100M-parameter bench llama (CPU).

1. Decode step at batch 16 and 64: every row under a realistic JSON Schema (`PERSON`: ten fields,
   a nested object, an array, an enum, formats and patterns) sent as TGI's router sends it (the
   regex outlines-core compiles) and as a JSON Schema (GRAMMAR_TYPE_JSON), vs the same batch with
   no grammar. Steps of the three batches alternate, so load from other processes hits all alike;
   median over steps after warm-up. Also the part of a step spent building the mask (llguidance's
   batched fill + unpacking on the host). Target: overhead ≤ 10 % of the step.
2. Compile time per schema, cold (a fresh compiler) and cached (the same grammar again), and the
   one-off vocabulary build at model load.

    .venv/bin/python benchmarks/grammar_overhead.py [--quick] [--threads 2]

Writes benchmarks/results/grammar_overhead.{json,md} (--quick: grammar_overhead-quick.{json,md}).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_step import make_prompts  # noqa: E402

from tgi_vlm.config import EngineConfig, GrammarLimits  # noqa: E402
from tgi_vlm.generation import GrammarCompiler, GrammarType  # noqa: E402
from tgi_vlm.generation.grammar_compiler import build_vocabulary  # noqa: E402
from tgi_vlm.models import get_model  # noqa: E402
from tgi_vlm.testing import tiny_model_path  # noqa: E402
from tgi_vlm.testing.harness import make_batch, make_request  # noqa: E402
from tgi_vlm.testing.machine import machine  # noqa: E402
from tgi_vlm.testing.schemas import BADGE, PERSON, PROFILE, router_regex  # noqa: E402

RESULTS = Path(__file__).parent / "results"
PROMPT_TOKENS = 128
MODES = ("none", "router_regex", "json_schema")


class TimedMasker:
    """Wraps the engine's GrammarMasker.allowed to record its milliseconds per call."""

    def __init__(self, masker):
        self.masker, self.inner, self.ms = masker, masker.allowed, []
        masker.allowed = self

    def __call__(self, states, device):
        start = time.perf_counter()
        out = self.inner(states, device)
        if out is not None:
            self.ms.append((time.perf_counter() - start) * 1e3)
        return out


def grammar_params(mode: str) -> dict:
    if mode == "router_regex":
        return dict(grammar=router_regex(PERSON), grammar_type=int(GrammarType.REGEX))
    if mode == "json_schema":
        return dict(grammar=json.dumps(PERSON), grammar_type=int(GrammarType.JSON))
    return {}


def start_batch(engine, prompts: list[str], mode: str, batch_id: int, max_new: int):
    requests = [make_request(i, p, max_new_tokens=max_new, ignore_eos=False, **grammar_params(mode))
                for i, p in enumerate(prompts)]
    _, batch, _ = engine.generate_token(engine.batch_from_pb(make_batch(batch_id, requests)))  # prefill
    return batch


def bench_step(engine, tokenizer, batch_size: int, warmup: int, steps: int) -> dict:
    prompts = make_prompts(tokenizer, [PROMPT_TOKENS] * batch_size, seed=batch_size)
    batches = {m: start_batch(engine, prompts, m, i + 1, warmup + steps + 2) for i, m in enumerate(MODES)}
    timer = TimedMasker(engine.grammar_masker)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    masks: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(warmup + steps):
        for mode in MODES:
            timer.ms.clear()
            start = time.perf_counter()
            _, batches[mode], _ = engine.generate_token(batches[mode])
            if i >= warmup:
                times[mode].append((time.perf_counter() - start) * 1e3)
                masks[mode].append(sum(timer.ms))
            assert batches[mode] is not None and len(batches[mode]) == batch_size, "a request finished early"
    for batch in batches.values():
        batch.release()
    engine.grammar_masker.allowed = timer.inner
    base = statistics.median(times["none"])
    row = dict(batch=batch_size, none_ms=base)
    for mode in MODES[1:]:
        step = statistics.median(times[mode])
        row[mode] = dict(step_ms=step, mask_ms=statistics.median(masks[mode]), overhead=(step - base) / base,
                         mask_share=statistics.median(masks[mode]) / step)
    return row


def bench_compile(engine, schemas: dict[str, dict]) -> list[dict]:
    rows = []
    for name, schema in schemas.items():
        for kind, text in ((GrammarType.REGEX, router_regex(schema)), (GrammarType.JSON, json.dumps(schema))):
            compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids, GrammarLimits())
            start = time.perf_counter()
            compiler.state_for(kind, text)
            cold = (time.perf_counter() - start) * 1e3
            start = time.perf_counter()
            compiler.state_for(kind, text)
            cached = (time.perf_counter() - start) * 1e3
            rows.append(dict(schema=name, type=kind.name, grammar_bytes=len(text), cold_ms=cold, cached_ms=cached))
    return rows


def bench_vocabulary(engine, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        build_vocabulary(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"# grammar_overhead — {result['timestamp']}",
        "",
        f"bench llama ({result['vocab_size']}-token vocabulary), float32, CPU: {m['cpu']}, {m['cores']} cores, "
        f"torch threads {m['torch_threads']}, torch {m['torch']}; llguidance {result['llguidance']}, "
        f"grammar threads {result['grammar_threads']}" + (" (--quick)" if result["quick"] else ""),
        "",
        f"## Decode step, every row under the PERSON schema (prompt {PROMPT_TOKENS} tokens, "
        f"median of {result['steps']} steps)",
        "",
        "| batch | no grammar ms | router regex ms (mask ms) | overhead | JSON Schema ms (mask ms) | overhead |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["decode_step"]:
        rr, js = r["router_regex"], r["json_schema"]
        lines.append(f"| {r['batch']} | {r['none_ms']:.1f} | {rr['step_ms']:.1f} ({rr['mask_ms']:.2f}) | "
                     f"{rr['overhead']:+.1%} | {js['step_ms']:.1f} ({js['mask_ms']:.2f}) | {js['overhead']:+.1%} |")
    lines += [
        "",
        "Overhead = (grammar step − plain step) ÷ plain step; target ≤ 10 %. The mask column is the part of the "
        "grammar step spent filling and unpacking the batch's token mask.",
        "",
        f"## Compile time (vocabulary built once at model load: {result['vocabulary_ms']:.1f} ms)",
        "",
        "| schema | grammar type | grammar bytes | cold ms | cached ms |",
        "|---|---|---:|---:|---:|",
    ]
    for r in result["compile"]:
        lines.append(f"| {r['schema']} | {r['type']} | {r['grammar_bytes']} | {r['cold_ms']:.2f} | {r['cached_ms']:.3f} |")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 16 only, fewer steps")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import llguidance

    # float32, as results/grammar_overhead.md was measured (the default is bfloat16 on a CPU with native bf16)
    engine = get_model(str(tiny_model_path("llama", size="bench")), EngineConfig(device="cpu", dtype="float32"))
    tokenizer = engine.tokenizer
    warmup, steps = (2, 5) if args.quick else (3, 10)
    sizes = [16] if args.quick else [16, 64]
    result = dict(
        timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        quick=args.quick,
        machine=machine(),
        llguidance=llguidance.__version__ if hasattr(llguidance, "__version__") else "?",
        grammar_threads=engine.config.grammar.threads,
        vocab_size=engine.vocab_size,
        steps=steps,
        decode_step=[bench_step(engine, tokenizer, bs, warmup, steps) for bs in sizes],
        compile=bench_compile(engine, {"PERSON": PERSON, "PROFILE": PROFILE, "BADGE": BADGE}),
        vocabulary_ms=bench_vocabulary(engine),
    )
    RESULTS.mkdir(exist_ok=True)
    stem = "grammar_overhead-quick" if args.quick else "grammar_overhead"
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
