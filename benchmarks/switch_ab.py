"""A switch's worth on a decode step, paired in one process: a module-level switch (e.g.
`tgi_vlm.layers.native_step.ENABLED`, `tgi_vlm.kernels.cpu.ops.DIRECT_CALLS`) on and off in alternating rounds.

Loads a model as a shard does (warmup, the loading thread's OpenMP pool released, the steps on a thread of their
own as the shard's model thread), then for each round prefills `batch` sequences of 128-token prompts and times
`--steps` decode steps with the switch on, and with it off (the order alternating by round). The median of each
round's median step, on and off, and their ratio; every round in the file.

    .venv/bin/python benchmarks/switch_ab.py --model FILE.gguf --batch 1 --switch tgi_vlm.layers.native_step.ENABLED

A switch read when the model loads (`--at-load`, e.g. `tgi_vlm.layers.linear.grouped.PACK_CODES`): two engines are
loaded, one with it on and one off, and the rounds alternate between them.

Writes benchmarks/results/switch_ab-<label>.{json,md}.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from decode_profile import prompts

from tgi_vlm.config import EngineConfig
from tgi_vlm.layers.cpu import release_openmp_threads
from tgi_vlm.models import get_model
from tgi_vlm.models.flash_causal_lm import DEFAULT_PREFILL_BUDGET
from tgi_vlm.router.warmup import warmup_request
from tgi_vlm.testing.harness import make_batch, make_request
from tgi_vlm.testing.machine import machine

RESULTS = Path(__file__).parent / "results"


def rounds(engines: dict, switch_module, attr: str, batch: int, steps: int, count: int) -> dict[bool, list[float]]:
    """`engines`: the engine for each switch value (the same one twice for a switch read at each call)."""
    medians: dict[bool, list[float]] = {True: [], False: []}
    for index in range(count):
        for on in ((True, False) if index % 2 == 0 else (False, True)):
            setattr(switch_module, attr, on)
            engine = engines[on]
            reqs = [make_request(i, p, max_new_tokens=steps + 8)
                    for i, p in enumerate(prompts(engine.tokenizer, batch, seed=batch + index))]
            _, state, _ = engine.generate_token(engine.batch_from_pb(make_batch(2 * index + int(on), reqs)))
            for _ in range(3):  # warm
                _, state, _ = engine.generate_token(state)
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                _, state, _ = engine.generate_token(state)
                times.append((time.perf_counter() - start) * 1e3)
            state.release()
            medians[on].append(statistics.median(times))
    setattr(switch_module, attr, True)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--switch", required=True, help="module.ATTRIBUTE, a bool the code reads at each call")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--label", required=True)
    parser.add_argument("--at-load", action="store_true", help="the switch is read at load: two engines")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    module_name, attr = args.switch.rsplit(".", 1)
    module = importlib.import_module(module_name)
    engines = {}
    for on in ((True, False) if args.at_load else (True,)):
        setattr(module, attr, on)
        engines[on] = get_model(args.model, EngineConfig(device="cpu", dtype=args.dtype, cpu_kv_cache_bytes=1 << 30))
        engines[on].warmup(warmup_request(1024, DEFAULT_PREFILL_BUDGET, 2048))
    engines.setdefault(False, engines[True])
    release_openmp_threads()
    out: dict = {}
    worker = threading.Thread(target=lambda: out.update(medians=rounds(engines, module, attr, args.batch, args.steps,
                                                                       args.rounds)))
    worker.start()
    worker.join()
    on, off = (statistics.median(out["medians"][k]) for k in (True, False))
    result = dict(model=Path(args.model).name, dtype=args.dtype, batch=args.batch, switch=args.switch,
                  at_load=args.at_load, steps=args.steps, rounds_on=out["medians"][True], rounds_off=out["medians"][False], on_ms=on,
                  off_ms=off, ratio=on / off, machine=machine(),
                  date=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    md = (f"# `{args.switch}` on vs off: {result['model']}, {args.dtype}, batch {args.batch}\n\n"
          f"- {args.rounds} alternating rounds of {args.steps} decode steps; {result['date']}; "
          "{cpu}, {cores} cores, load average {load_avg_1m:.2f}\n\n".format(**result["machine"]) +
          "| | median step ms | round medians |\n|---|---:|---|\n"
          f"| on | {on:.2f} | {', '.join(f'{v:.2f}' for v in result['rounds_on'])} |\n"
          f"| off | {off:.2f} | {', '.join(f'{v:.2f}' for v in result['rounds_off'])} |\n\n"
          f"on / off: **{on / off:.3f}**\n")
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"switch_ab-{args.label}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    stem.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
