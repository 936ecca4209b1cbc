r"""vLLM (CPU build) on `tgi-vlm bench`'s requests, measured the way `tgi-vlm bench` measures.

    VLLM_PYTHON benchmarks/peers/vllm_runner.py WORKLOAD_DIR MODEL_DIR --dtype float32 --json OUT.json

Runs with the interpreter of vLLM's own virtualenv (setup_vllm_cpu.sh); it never imports tgi_vlm. The
requests come from a workload directory written by export_workload.py (checked against its digest on read).

What is measured, as `tgi-vlm bench`'s driver target does it (tgi_vlm.benchmarking):
- one warm-up request first (its own image of the first request's size, "warm up", 2 new tokens), untimed;
- then a closed loop: `concurrency` requests in flight (the workload's, 16 by default); as one finishes the
  next is added, until all are done. Greedy, EOS ignored, exactly `max_new_tokens` per request (checked);
- per request, `submitted` is taken before its image is decoded and it is handed to the engine (vLLM's
  input processing, like tgi-vlm's tokenizing and processor run, counts towards its TTFT); every token
  is stamped when the engine step that produced it returns to this loop. TTFT = first token - submitted;
  inter-token latencies are the gaps between a request's consecutive tokens, pooled over requests;
  p50/p90/p99 by numpy.percentile (as benchmarking.results.percentiles); out tok/s and req/s over the loop's wall time.

The engine is vLLM's LLMEngine (add_request / step; the engine core runs in its own process, vLLM's
default, as `LLM` does), with tgi-vlm's limits: max_num_batched_tokens 2048 (tgi-vlm's prefill budget),
max_model_len 2048, max_num_seqs = concurrency, chunked prefill on, KV cache VLLM_CPU_KVCACHE_SPACE=1 GB
(tgi-vlm's CPU KV cache), OpenMP threads bound to every CPU this process may use (tgi-vlm's shard uses
them all; vLLM's `auto` would keep one back for its scheduler), eager mode unless --compile.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from token_times import TokenTimes, percentiles  # noqa: E402
from workload_file import PeerRequest, Workload, read_workload  # noqa: E402


@dataclass
class RequestTiming(TokenTimes):
    tokens: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None  # the engine's, once it reports them


# Engine steps of the last closed loop and how many sequences got a token in them (tgi-vlm bench reports
# its steps and mean decode batch; these are the nearest vLLM figures).
STEP_STATS = {"steps": 0, "sequences_with_a_token": 0}


def run_closed_loop(engine, count: int, concurrency: int, engine_request: Callable[[int], tuple],
                    clock: Callable[[], float] = time.perf_counter) -> tuple[list[RequestTiming], float]:
    """Requests 0..count-1 through `engine` (vLLM's LLMEngine interface: add_request(id, prompt, params),
    step() -> outputs with request_id, outputs[0].token_ids (new tokens only), finished, prompt_token_ids),
    `concurrency` in flight. `engine_request(i)` -> (prompt, params); it runs after `submitted` is taken.
    Returns the timings in request order and the wall time from the first submission to the last token."""
    timings: list[RequestTiming | None] = [None] * count
    in_flight: dict[str, int] = {}
    next_index = 0

    def fill() -> None:
        nonlocal next_index
        while next_index < count and len(in_flight) < concurrency:
            i, next_index = next_index, next_index + 1
            timings[i] = RequestTiming(clock())
            prompt, params = engine_request(i)
            engine.add_request(str(i), prompt, params)
            in_flight[str(i)] = i

    start = clock()
    fill()
    while in_flight:
        outputs = engine.step()
        STEP_STATS["steps"] += 1
        STEP_STATS["sequences_with_a_token"] += sum(1 for out in outputs if out.outputs and out.outputs[0].token_ids)
        now = clock()
        for out in outputs:
            i = in_flight[out.request_id]
            timing = timings[i]
            new = list(out.outputs[0].token_ids)
            timing.tokens += new
            timing.token_times += [now] * len(new)
            if out.finished:
                timing.prompt_token_ids = list(out.prompt_token_ids or [])
                del in_flight[out.request_id]
        fill()
    return timings, clock() - start


def serving_summary(timings: list[RequestTiming], wall_s: float, requests: list[PeerRequest]) -> dict:
    """The `serving` block of tgi-vlm bench's report, plus the checks: exact output lengths, prompt ids."""
    wrong_lengths = [i for i, (t, r) in enumerate(zip(timings, requests)) if len(t.tokens) != r.max_new_tokens]
    differing = [i for i, (t, r) in enumerate(zip(timings, requests)) if t.prompt_token_ids != r.prompt_token_ids]
    return {
        "wall_s": wall_s,
        "failed": len(wrong_lengths),
        "req_per_s": (len(timings) - len(wrong_lengths)) / wall_s,
        "out_tok_per_s": sum(len(t.tokens) for t in timings) / wall_s,
        "ttft_s": percentiles([t.ttft_s for t in timings if t.ttft_s is not None]),
        "itl_s": percentiles([x for t in timings for x in t.itl_s]),
        "output_tokens": sum(len(t.tokens) for t in timings),
        "wrong_output_lengths": wrong_lengths,  # requests that did not produce exactly max_new_tokens
        "prompt_check": prompt_check(timings, requests, differing),
        "engine_steps": STEP_STATS["steps"],
        "mean_sequences_per_step": STEP_STATS["sequences_with_a_token"] / max(STEP_STATS["steps"], 1),
    }


def prompt_check(timings: list[RequestTiming], requests: list[PeerRequest], differing: list[int]) -> dict:
    """How vLLM's prompt token ids compare with tgi-vlm's (same tokenizer and processor config)."""
    ours = sum(len(r.prompt_token_ids) for r in requests)
    theirs = sum(len(t.prompt_token_ids or []) for t in timings)
    first = None
    if differing:
        i = differing[0]
        a, b = requests[i].prompt_token_ids, timings[i].prompt_token_ids or []
        at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        first = {"request": i, "position": at, "tgi_vlm_len": len(a), "vllm_len": len(b),
                 "tgi_vlm_ids": a[max(0, at - 3):at + 3], "vllm_ids": b[max(0, at - 3):at + 3]}
    return {"identical": not differing, "requests_differing": len(differing), "tgi_vlm_prompt_tokens": ours,
            "vllm_prompt_tokens": theirs, "first_difference": first}


def cpu_list() -> str:
    """Every CPU this process may run on, as VLLM_CPU_OMP_THREADS_BIND takes it ("0-3,6")."""
    cpus = sorted(os.sched_getaffinity(0))
    ranges, start = [], cpus[0]
    for prev, cur in zip(cpus, cpus[1:] + [None]):
        if cur != prev + 1:
            ranges.append(f"{start}-{prev}" if prev > start else str(start))
            start = cur
    return ",".join(ranges)


def build_engine(a: argparse.Namespace, model: str, images_per_request: int, concurrency: int):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    args = EngineArgs(model=model, dtype=a.dtype, enforce_eager=not a.compile, seed=0,
                      max_model_len=a.max_model_len, max_num_seqs=concurrency,
                      max_num_batched_tokens=a.max_num_batched_tokens, enable_chunked_prefill=True,
                      enable_prefix_caching=a.prefix_caching,
                      **({"limit_mm_per_prompt": {"image": images_per_request, "video": 0}} if images_per_request else {}),
                      disable_log_stats=True)
    return LLMEngine.from_engine_args(args)


def request_maker(engine, workload: Workload, requests: list[PeerRequest]) -> Callable[[int], tuple]:
    """Request i as LLMEngine.add_request takes it: the prompt rendered (tokenized, images processed) by
    the engine's renderer, as `LLM.generate` does, and greedy sampling parameters streaming new tokens."""
    from PIL import Image
    from vllm import SamplingParams
    from vllm.renderers.inputs.preprocess import parse_model_prompt
    from vllm.sampling_params import RequestOutputKind

    renderer = engine.renderer

    def make(i: int) -> tuple:
        r = requests[i]
        images = [Image.open(io.BytesIO(workload.image_bytes(f))).convert("RGB") for f in r.images]
        raw = {"prompt": r.prompt, "multi_modal_data": {"image": images}} if images else {"prompt": r.prompt}
        (prompt,) = renderer.render_cmpl([parse_model_prompt(engine.model_config, raw)],
                                         renderer.default_cmpl_tok_params)
        # ignore_eos: EOS neither ends the request nor is masked, as tgi-vlm's ignore_eos_token
        params = SamplingParams(temperature=0.0, max_tokens=r.max_new_tokens, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        return prompt, params

    return make


def run(a: argparse.Namespace) -> dict:
    workload = read_workload(a.workload)
    concurrency = a.concurrency or workload.spec.get("concurrency") or 16
    images_per_request = workload.spec.get("images_per_request", 1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = a.cpus or cpu_list()  # read by the engine core process
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(a.kv_cache_gb)

    t0 = time.perf_counter()
    engine = build_engine(a, a.model, images_per_request, concurrency)
    t_loaded = time.perf_counter()
    warm, _ = run_closed_loop(engine, 1, 1, request_maker(engine, workload, [workload.warmup]))
    t_warm = time.perf_counter()
    STEP_STATS.update(steps=0, sequences_with_a_token=0)  # the warm-up's steps do not count
    timings, wall = run_closed_loop(engine, len(workload.requests), concurrency,
                                    request_maker(engine, workload, workload.requests))
    serving = serving_summary(timings, wall, workload.requests)
    return {
        "system": "vllm",
        "model": workload.model,
        "workload": workload.spec,
        "workload_digest": workload.digest,
        "serving": serving,
        "config": engine_config(a, engine, concurrency),
        "versions": versions(),
        "setup_s": {"engine_load": t_loaded - t0, "warmup": t_warm - t_loaded},
        "warmup_tokens": len(warm[0].tokens),
        "output_token_ids": [t.tokens for t in timings],
    }


def engine_config(a: argparse.Namespace, engine, concurrency: int) -> dict:
    model_config = engine.vllm_config.model_config
    cache_config = engine.vllm_config.cache_config
    return {"dtype_requested": a.dtype, "dtype": str(model_config.dtype).removeprefix("torch."),
            "eager": not a.compile, "max_num_seqs": concurrency, "max_num_batched_tokens": a.max_num_batched_tokens,
            "max_model_len": a.max_model_len, "prefix_caching": bool(cache_config.enable_prefix_caching),
            "chunked_prefill": True, "kv_cache_gb": a.kv_cache_gb,
            "omp_threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
            "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"}


def versions() -> dict:
    import importlib.metadata as metadata

    import torch
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "transformers": metadata.version("transformers")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("workload", type=Path, help="directory written by export_workload.py")
    p.add_argument("model", help="the model directory the workload was exported for")
    p.add_argument("--dtype", default="auto", help="auto (vLLM's default: bfloat16 on a CPU with it), float32, "
                                                   "bfloat16")
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight (default: the workload's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tgi-vlm's max_batch_prefill_tokens")
    p.add_argument("--max-model-len", type=int, default=2048, help="tgi-vlm's max_total_tokens")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="vLLM's prefix caching (its default: on)")
    p.add_argument("--compile", action="store_true", help="let vLLM compile the model (default: enforce_eager)")
    p.add_argument("--kv-cache-gb", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (tgi-vlm's CPU KV cache: 1)")
    p.add_argument("--cpus", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: every CPU we may use)")
    p.add_argument("--json", type=Path, help="write the report here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    report = run(a)
    s = report["serving"]
    ms = lambda p: "/".join("-" if v is None else f"{v * 1000:.0f}" for v in p.values())  # noqa: E731
    print(f"vllm {report['versions']['vllm']} {report['config']['dtype']}: {s['out_tok_per_s']:.1f} out tok/s, "
          f"{s['req_per_s']:.2f} req/s, TTFT p50/p90/p99 {ms(s['ttft_s'])} ms, ITL {ms(s['itl_s'])} ms, "
          f"wall {s['wall_s']:.1f} s, workload {report['workload_digest']}")
    check = s["prompt_check"]
    print("prompt ids: " + ("identical to tgi-vlm's" if check["identical"] else
                            f"{check['requests_differing']} requests differ from tgi-vlm's; first: {check['first_difference']}"))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=1))
    if s["wrong_output_lengths"]:
        raise SystemExit(f"requests {s['wrong_output_lengths'][:10]} did not produce exactly max_new_tokens")


if __name__ == "__main__":  # vLLM starts its engine core as a separate process: keep the work under this guard
    main()
