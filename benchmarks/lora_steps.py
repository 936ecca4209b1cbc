"""Multi-LoRA step cost on the ~100M-parameter bench llama (CPU): decode and prefill steps of a 16-sequence batch
with 0, 1, 4 and 16 distinct adapters (rank 16, all seven projections of every layer) against the base model
alone (an engine with no adapter loaded: every layer's extra term None).

Configurations, each its own 16-sequence batch in the same process:
  base          engine without --lora-adapters
  lora-0        engine with 16 adapters loaded, every sequence on the base model
  lora-1/4/16   the same engine, sequences spread round-robin over 1, 4 or 16 adapters
Decode: one `generate_token` per configuration in turn (so load from other processes hits all alike), median over
steps after warm-up, prompts of 64 tokens. Prefill: the 16 prompts (64 tokens each, 1,024 rows) in one step, the
configurations in turn, median of the repeats. The goal (issue 30): 4 adapters cost <= 15% over base at decode.

    .venv/bin/python benchmarks/lora_steps.py [--dtype float32|bfloat16] [--steps 8] [--threads 2]

Writes benchmarks/results/lora-<dtype>.{json,md}. The adapters are random peft-format files written here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors.torch import save_file

from tgi_vlm.config import EngineConfig
from tgi_vlm.lora import AdapterSpec
from tgi_vlm.models import get_model
from tgi_vlm.models.flash_causal_lm import DEFAULT_PREFILL_BUDGET
from tgi_vlm.router.warmup import warmup_request
from tgi_vlm.testing import tiny_model_path
from tgi_vlm.testing.harness import make_batch, make_request
from tgi_vlm.testing.machine import machine

RESULTS = Path(__file__).parent / "results"
RANK, SEQS, PROMPT_TOKENS, ADAPTERS = 16, 16, 64, 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DISTINCT = (0, 1, 4, 16)


def write_adapters(engine, root: Path, count: int) -> tuple[AdapterSpec, ...]:
    """`count` random rank-RANK adapters in peft's file format over every targeted linear of the language model."""
    names = {id(m): n for n, m in engine.model.named_modules()}
    layers = [(names[id(m)], m) for m in engine.language_model.modules()
              if names.get(id(m), "").rsplit(".", 1)[-1] in TARGETS]
    specs = []
    for i in range(count):
        generator = torch.Generator().manual_seed(i)
        tensors = {}
        for name, layer in layers:
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(RANK, layer.in_features, generator=generator) * 0.02
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(layer.out_features, RANK, generator=generator) * 0.02
        path = root / f"adapter-{i}"
        path.mkdir()
        save_file(tensors, path / "adapter_model.safetensors")
        (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK,
                                                              "target_modules": list(TARGETS)}))
        specs.append(AdapterSpec(f"adapter-{i}", str(path)))
    return tuple(specs)


def load(path: Path, dtype: str, specs: tuple[AdapterSpec, ...] = ()):
    engine = get_model(str(path), EngineConfig(device="cpu", dtype=dtype, cpu_kv_cache_bytes=1 << 30,
                                               lora_adapters=specs))
    engine.warmup(warmup_request(1024, DEFAULT_PREFILL_BUDGET, 2048))
    engine.logits_observer = None
    return engine


def requests(first_id: int, distinct: int, max_new_tokens: int, tokenizer) -> list:
    out = []
    for i in range(SEQS):
        words = " ".join(f"word{(first_id + i * 7 + k) % 97}" for k in range(PROMPT_TOKENS))
        ids = tokenizer(words)["input_ids"][:PROMPT_TOKENS]
        request = make_request(first_id + i, tokenizer.decode(ids, skip_special_tokens=True),
                               max_new_tokens=max_new_tokens)
        if distinct:
            request.adapter_id = f"adapter-{i % distinct}"
        out.append(request)
    return out


def timed(engine, batch) -> tuple[float, object]:
    start = time.perf_counter()
    _, batch, _ = engine.generate_token(batch)
    return (time.perf_counter() - start) * 1e3, batch


def configurations(base, lora) -> dict[str, tuple[object, int]]:
    return {"base": (base, 0), **{f"lora-{k}": (lora, k) for k in DISTINCT}}


def bench_prefill(configs, tokenizer, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in configs}
    for r in range(repeats):
        for c, (name, (engine, distinct)) in enumerate(configs.items()):
            batch = engine.batch_from_pb(make_batch(1, requests(10_000 * (r + 1) + 100 * c, distinct, 2, tokenizer)))
            ms, batch = timed(engine, batch)
            times[name].append(ms)
            batch.release()
    return summary(times)


def summary(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Median and fastest step per configuration (on a shared machine the fastest is the least disturbed)."""
    return {name: {"median": statistics.median(v), "min": min(v)} for name, v in times.items()}


def bench_decode(configs, tokenizer, warmup: int, steps: int) -> dict[str, float]:
    batches = {}
    for c, (name, (engine, distinct)) in enumerate(configs.items()):
        batch = engine.batch_from_pb(make_batch(c + 1, requests(1000 * (c + 1), distinct, warmup + steps + 2, tokenizer)))
        _, batches[name], _ = engine.generate_token(batch)  # the prefill
    times: dict[str, list[float]] = {name: [] for name in configs}
    for step in range(warmup + steps):
        for name, (engine, _) in configs.items():
            ms, batches[name] = timed(engine, batches[name])
            if step >= warmup:
                times[name].append(ms)
    for batch in batches.values():
        batch.release()
    return summary(times)


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# lora_steps ({result['dtype']}) — {result['timestamp']}", "",
             f"bench llama, {SEQS} sequences of {PROMPT_TOKENS}-token prompts, {ADAPTERS} adapters loaded (rank {RANK}, "
             f"{', '.join(TARGETS)} of every layer); CPU: {m['cpu']}, {m['cores']} cores, torch threads "
             f"{m['torch_threads']}, 1-minute load average at start {m['load_avg_1m']:.1f}, torch {m['torch']}", "",
             f"Decode: {result['steps']} steps; prefill: {result['repeats']} steps of {SEQS * PROMPT_TOKENS} rows; "
             "each as median / fastest. Ratios: over the base model alone (no adapter loaded).", "",
             "| configuration | decode step ms | x base | prefill step ms | x base |", "|---|---:|---:|---:|---:|"]
    decode, prefill = result["decode_ms"], result["prefill_ms"]

    def cell(values: dict, name: str) -> str:
        own, base = values[name], values["base"]
        return (f"{own['median']:.1f} / {own['min']:.1f} | {own['median'] / base['median']:.2f} / "
                f"{own['min'] / base['min']:.2f}")

    for name in decode:
        lines.append(f"| {name} | {cell(decode, name)} | {cell(prefill, name)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = tiny_model_path("llama", size="bench")
    base = load(path, args.dtype)
    with tempfile.TemporaryDirectory() as root:
        lora = load(path, args.dtype, write_adapters(base, Path(root), ADAPTERS))
    configs = configurations(base, lora)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    result = dict(timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"), machine=machine(),
                  dtype=args.dtype, steps=args.steps, repeats=args.repeats,
                  decode_ms=bench_decode(configs, tokenizer, 2, args.steps),
                  prefill_ms=bench_prefill(configs, tokenizer, args.repeats))
    report = markdown(result)
    print(report)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"lora-{args.dtype}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"lora-{args.dtype}.md").write_text(report)


if __name__ == "__main__":
    main()
