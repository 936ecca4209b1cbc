"""Load and soak: many short random requests through the router driver against one shard process.

    python benchmarks/soak.py                          # ~5 minutes on the tiny Qwen2-VL
    python benchmarks/soak.py --requests 300 --minutes 0   # a fixed number of requests (tests/e2e/test_soak.py)

Requests mix random images (sizes 1..96 px, drawn from a pool so some repeat), text-only prompts,
prompt and output lengths, greedy and seeded sampling settings, stop sequences and cancellations
(queued or mid-decode; the router then sends FilterBatch). Concurrency is held at `--concurrency`.
The shard's resident memory (VmRSS from /proc/<pid>/status) is sampled over time; growth is
measured from the end of a warm-up phase to the end of the run. At the end the router's block
allocator must be full again and the shard's batch cache empty (Warmup, which the shard refuses
while any batch is cached, succeeds). Results go to benchmarks/results/soak.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tgi_vlm.router import (
    FinalEvent,
    RequestParams,
    Router,
    RouterConfig,
    ShardClient,
    ShardProcess,
    TokenCounter,
    TokenEvent,
)
from tgi_vlm.router.warmup import warmup_request
from tgi_vlm.testing import jpeg_bytes, make_test_image, png_bytes, tiny_model_path

SHARD_ENV = {"TGI_VLM_CPU_KV_CACHE_GB": "0.05", "TGI_VLM_DEVICE": "cpu", "ATTENTION": "paged", "PREFIX_CACHING": "0"}
CONFIG = RouterConfig(max_input_tokens=200, max_total_tokens=300, max_batch_prefill_tokens=256)
WORDS = "the a cat sat on mat sky blue red green hill sea look describe what where why picture image".split()
RESULTS = Path(__file__).parent / "results" / "soak.json"


@dataclass(frozen=True)
class SoakConfig:
    requests: int = 300  # total, warm-up included; 0 = until `minutes` pass
    minutes: float = 0.0  # 0 = until `requests` are done
    concurrency: int = 16
    warmup_requests: int = 48  # RSS growth is measured from the end of these
    cancel_fraction: float = 0.1
    sample_every_s: float = 2.0
    seed: int = 0


@dataclass
class SoakResult:
    requests: int = 0
    outcomes: Counter = field(default_factory=Counter)  # ok | cancelled | error
    errors: Counter = field(default_factory=Counter)  # error message, digits masked → count
    invariant_failures: list[str] = field(default_factory=list)
    rss_samples: list[tuple[float, int, float]] = field(default_factory=list)  # (seconds, requests done, VmRSS MB)
    rss_after_warmup_mb: float = 0.0
    rss_end_mb: float = 0.0
    calls: dict[str, int] = field(default_factory=dict)  # RPCs the router sent
    allocator_full: bool = False
    shard_cache_empty: bool = False
    duration_s: float = 0.0

    @property
    def rss_growth_mb(self) -> float:
        return self.rss_end_mb - self.rss_after_warmup_mb

    def to_json(self) -> dict:
        data = asdict(self)
        data["outcomes"], data["errors"] = dict(self.outcomes), dict(self.errors)
        data["rss_growth_mb"] = round(self.rss_growth_mb, 1)
        return data


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Workload:
    """Random requests; images come from a pool so some repeat (the cross-request encoder cache's case)."""

    def __init__(self, seed: int, cancel_fraction: float):
        self.rng = random.Random(seed)
        self.cancel_fraction = cancel_fraction
        self.images = [self._image(i) for i in range(24)]

    def _image(self, i: int) -> bytes:
        w, h = self.rng.randint(1, 96), self.rng.randint(1, 96)  # aspect ratio stays under Qwen2-VL's 200
        img = make_test_image(w, h, seed=1000 + i)
        return jpeg_bytes(img) if i % 3 == 0 else png_bytes(img)

    def _text(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(1, 30)))

    def next(self) -> tuple[RequestParams, int | None]:
        """A request and, for some, the number of tokens after which it is cancelled (0: right away)."""
        r = self.rng
        chunks: list[str | bytes] = [self._text()]
        for _ in range(r.choice((0, 1, 1, 1, 2))):
            chunks.insert(r.randint(0, len(chunks)), r.choice(self.images))
        params = RequestParams(chunks, max_new_tokens=r.randint(1, 16), ignore_eos=r.random() < 0.7)
        style = r.random()
        if style < 0.4:
            params.do_sample, params.seed = True, r.randint(0, 2**31)
            params.temperature = r.choice((0.5, 0.8, 1.3))
            params.top_k, params.top_p = r.choice((0, 5, 50)), r.choice((1.0, 0.9, 0.5))
        elif style < 0.55:
            params.repetition_penalty, params.frequency_penalty = 1.3, 0.2
        elif style < 0.65:
            params.stop_sequences = [r.choice(WORDS)]
        if r.random() < 0.1:
            params.top_n_tokens, params.prefill_logprobs = 3, True
        cancel = r.randint(0, 3) if r.random() < self.cancel_fraction else None
        return params, cancel


def classify(final: FinalEvent) -> str:
    if final.ok:
        return "ok"
    return "cancelled" if final.cancelled else "error"


async def one_request(router: Router, params: RequestParams, cancel_after: int | None, result: SoakResult) -> None:
    stream = await router.submit(params)
    if cancel_after == 0:
        router.cancel(stream.request_id)
    tokens = 0
    async for event in stream:
        if isinstance(event, TokenEvent):
            tokens += 1
            if cancel_after is not None and tokens == cancel_after:
                router.cancel(stream.request_id)
            continue
        kind = classify(event)
        result.outcomes[kind] += 1
        if kind == "error":
            result.errors[re.sub(r"\d+", "N", event.error)[:160]] += 1
        elif kind == "ok" and not (tokens == event.generated_tokens <= params.max_new_tokens):
            result.invariant_failures.append(
                f"request {stream.request_id}: {tokens} tokens streamed, {event.generated_tokens} reported, "
                f"max_new_tokens {params.max_new_tokens}")
    result.requests += 1


async def run_soak(router: Router, shard_pid: int, config: SoakConfig, log=print) -> SoakResult:
    """Drive the workload through a started router (its loop running); returns what was measured."""
    result = SoakResult()
    workload = Workload(config.seed, config.cancel_fraction)
    start = time.perf_counter()
    deadline = start + config.minutes * 60 if config.minutes else None
    issued = 0
    warmed = asyncio.Event()

    def more() -> bool:
        if config.requests and issued >= config.requests:
            return False
        return deadline is None or time.perf_counter() < deadline

    async def worker() -> None:
        nonlocal issued
        while more():
            issued += 1
            params, cancel = workload.next()
            await one_request(router, params, cancel, result)
            if result.requests >= config.warmup_requests and not warmed.is_set():
                warmed.set()
                result.rss_after_warmup_mb = rss_mb(shard_pid)

    async def sampler() -> None:
        while True:
            result.rss_samples.append((round(time.perf_counter() - start, 1), result.requests, round(rss_mb(shard_pid), 1)))
            if log and len(result.rss_samples) % 15 == 1:
                log(f"{result.rss_samples[-1][0]:7.1f} s  {result.requests:6d} requests  VmRSS {result.rss_samples[-1][2]:.1f} MB")
            await asyncio.sleep(config.sample_every_s)

    sampling = asyncio.create_task(sampler())
    try:
        await asyncio.gather(*[worker() for _ in range(config.concurrency)])
    finally:
        sampling.cancel()
    result.duration_s = round(time.perf_counter() - start, 1)
    result.rss_end_mb = rss_mb(shard_pid)
    result.rss_samples.append((result.duration_s, result.requests, round(result.rss_end_mb, 1)))
    if not warmed.is_set():
        result.rss_after_warmup_mb = result.rss_samples[0][2]
    result.calls = dict(router.calls)
    result.allocator_full = router.allocator.is_full
    return result


async def shard_cache_is_empty(socket: str) -> bool:
    """Warmup is refused while the shard holds any batch: a probe that needs no Prefill."""
    import grpc

    client = ShardClient(socket)
    try:
        await client.warmup(warmup_request(CONFIG.max_input_tokens, CONFIG.max_batch_prefill_tokens,
                                           CONFIG.max_total_tokens))
        return True
    except grpc.aio.AioRpcError:
        return False
    finally:
        await client.close()


async def soak(shard: ShardProcess, counter: TokenCounter, config: SoakConfig, log=print) -> SoakResult:
    client = ShardClient(shard.socket)
    router = Router(client, counter.count, CONFIG)
    await router.start()
    loop = asyncio.create_task(router.run())
    try:
        result = await run_soak(router, shard.processes[0].pid, config, log)
    finally:
        router.stop()
        await loop
        await client.close()
    result.shard_cache_empty = await shard_cache_is_empty(shard.socket)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="model directory (default: the tiny Qwen2-VL)")
    parser.add_argument("--requests", type=int, default=0, help="stop after N requests (0: no limit)")
    parser.add_argument("--minutes", type=float, default=5.0, help="stop after M minutes (0: no limit)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--warmup-requests", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not args.requests and not args.minutes:
        parser.error("give --requests or --minutes")
    model = args.model or str(tiny_model_path("qwen2_vl"))
    config = SoakConfig(requests=args.requests, minutes=args.minutes, concurrency=args.concurrency,
                        warmup_requests=args.warmup_requests, seed=args.seed)

    async def run() -> SoakResult:
        counter = await asyncio.to_thread(TokenCounter, model)
        with ShardProcess(model, env=SHARD_ENV) as shard:
            return await soak(shard, counter, config)

    result = asyncio.run(run())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": Path(str(model)).name, "config": asdict(config), **result.to_json()}, indent=1))
    print(f"{result.requests} requests in {result.duration_s} s: {dict(result.outcomes)}; errors {dict(result.errors)}")
    print(f"VmRSS after warm-up {result.rss_after_warmup_mb:.1f} MB, at the end {result.rss_end_mb:.1f} MB "
          f"(growth {result.rss_growth_mb:+.1f} MB); allocator full: {result.allocator_full}; "
          f"shard cache empty: {result.shard_cache_empty}; calls {result.calls}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
