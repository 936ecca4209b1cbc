"""What the HTTP layer of `tgi-vlm launch` costs, per request and per token, apart from the model.

The same requests go (a) straight to the router driver and (b) over HTTP (/generate_stream, SSE) to the
launch front end, both over an instant in-process stand-in for the shard (no model: every Prefill/Decode
answers at once), so what is left is routing (a) or routing + HTTP (b). CPU time is measured per process
(/proc/PID/stat for the server), which holds up on a busy machine where wall clock does not; wall-clock
tokens/s are printed too. The difference (b − a) is the HTTP layer's cost; compare it with a real step.

    PYTHONPATH=src python benchmarks/http_overhead.py [--requests 256] [--concurrency 16] [--tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.router import RequestParams, Router, RouterConfig, TokenCounter
from tgi_vlm.testing import make_test_image, png_bytes, tiny_model_path

CONFIG = RouterConfig(max_input_tokens=1024, max_total_tokens=2048, max_batch_prefill_tokens=4096)
TICKS = os.sysconf("SC_CLK_TCK")


class InstantShard:
    """Answers the router's RPCs at once: one token per request per Prefill/Decode, finished at max_new_tokens."""

    def __init__(self):
        self.batches: dict[int, dict[int, list[int]]] = {}  # batch id → request id → [generated, max_new]

    async def info(self) -> pb.InfoResponse:
        return pb.InfoResponse(requires_padding=False, dtype="float32", device_type="cpu", block_size=16,
                               support_chunking=True, attention_impl="paged")

    async def warmup(self, request: pb.WarmupRequest) -> pb.WarmupResponse:
        return pb.WarmupResponse(max_supported_total_tokens=1 << 20, max_input_tokens=request.max_input_tokens,
                                 max_total_tokens=request.max_total_tokens)

    async def health(self) -> None:
        return None

    async def clear_cache(self, batch_id: int | None = None) -> None:
        if batch_id is None:
            self.batches.clear()
        else:
            self.batches.pop(batch_id, None)

    async def filter_batch(self, batch_id: int, request_ids: list[int]) -> pb.CachedBatch:
        batch = self.batches[batch_id]
        self.batches[batch_id] = {r: batch[r] for r in request_ids}
        return self._cached(batch_id)

    async def prefill(self, batch: pb.Batch, cached: pb.CachedBatch | None = None) -> pb.PrefillResponse:
        batch_id = cached.id if cached is not None else batch.id
        live = self.batches.setdefault(batch_id, {})
        live.update({r.id: [0, r.stopping_parameters.max_new_tokens] for r in batch.requests})
        return pb.PrefillResponse(generations=self._step(live), **self._batch_field(batch_id))

    async def decode(self, batches: list[pb.CachedBatch]) -> pb.DecodeResponse:
        batch_id = batches[0].id
        for other in batches[1:]:
            self.batches[batch_id].update(self.batches.pop(other.id))
        return pb.DecodeResponse(generations=self._step(self.batches[batch_id]), **self._batch_field(batch_id))

    async def close(self) -> None:
        pass

    def _step(self, live: dict[int, list[int]]) -> list[pb.Generation]:
        out = []
        for rid, state in list(live.items()):
            if state[0] >= state[1]:
                continue
            state[0] += 1
            g = pb.Generation(request_id=rid, tokens=pb.Tokens(ids=[100 + state[0] % 50], logprobs=[-1.0],
                                                               texts=[" tok"], is_special=[False]))
            if state[0] == state[1]:
                g.generated_text.CopyFrom(pb.GeneratedText(text=" tok" * state[1], generated_tokens=state[1]))
            out.append(g)
        return out

    def _batch_field(self, batch_id: int) -> dict:
        live = self.batches.get(batch_id, {})
        return {"batch": self._cached(batch_id)} if any(s[0] < s[1] for s in live.values()) else {}

    def _cached(self, batch_id: int) -> pb.CachedBatch:
        ids = list(self.batches[batch_id])
        return pb.CachedBatch(id=batch_id, request_ids=ids, size=len(ids), max_tokens=len(ids) * 64,
                              current_tokens=len(ids))


def workload(n: int, tokens: int) -> list[RequestParams]:
    image = png_bytes(make_test_image(56, 56, seed=0))
    return [RequestParams([image, f"request {i}: describe the picture in a few words"], max_new_tokens=tokens)
            for i in range(n)]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


async def direct(model: str, requests: list[RequestParams], concurrency: int) -> dict:
    counter = TokenCounter(model)
    router = Router(InstantShard(), counter.count, CONFIG)
    await router.start()
    loop = asyncio.create_task(router.run())
    limit = asyncio.Semaphore(concurrency)

    async def one(params: RequestParams) -> int:
        async with limit:
            tokens, final = await (await router.submit(params)).final()
            assert final.ok, final.error
            return len(tokens)

    await one(requests[0])  # warm
    cpu, wall = time.process_time(), time.perf_counter()
    tokens = sum(await asyncio.gather(*[one(p) for p in requests]))
    result = {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall, "tokens": tokens}
    router.stop()
    await loop
    return result


def http_body(params: RequestParams) -> dict:
    from tgi_vlm.benchmarking.targets.http import request_body

    return request_body(params)


async def over_http(url: str, pid: int, requests: list[RequestParams], concurrency: int) -> dict:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=concurrency + 4)) as client:

        async def one(params: RequestParams) -> int:
            async with limit, client.stream("POST", f"{url}/generate_stream", json=http_body(params)) as response:
                return sum([1 async for line in response.aiter_lines() if line.startswith("data:")])

        await one(requests[0])
        server, cpu, wall = cpu_seconds(pid), time.process_time(), time.perf_counter()
        tokens = sum(await asyncio.gather(*[one(p) for p in requests]))
        return {"cpu_s": cpu_seconds(pid) - server, "client_cpu_s": time.process_time() - cpu,
                "wall_s": time.perf_counter() - wall, "tokens": tokens}


def serve(model: str, port: int) -> None:
    """The launch front end (FastAPI + uvicorn + router driver) over the instant shard."""
    import uvicorn

    from tgi_vlm.api.app import build_app
    from tgi_vlm.api.config import ApiConfig
    from tgi_vlm.api.state import ApiState

    async def main():
        counter = TokenCounter(model)
        router = Router(InstantShard(), counter.count, CONFIG)
        await router.start()
        task = asyncio.create_task(router.run())
        state = ApiState.create(ApiConfig(model, port=port, max_concurrent_requests=1024), router, counter)
        server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning"))
        asyncio.get_running_loop().call_later(1.0, lambda: print("ready", flush=True))
        await server.serve()
        router.stop()
        await task

    asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=3031)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/http_overhead.json"))
    args = parser.parse_args()
    model = str(tiny_model_path("qwen2_vl"))  # only its processor is used (token counting)
    if args.serve:
        serve(model, args.port)
        return
    requests = workload(args.requests, args.tokens)
    a = asyncio.run(direct(model, requests, args.concurrency))
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--port", str(args.port)], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert server.stdout.readline().strip() == "ready"
        b = asyncio.run(over_http(f"http://127.0.0.1:{args.port}", server.pid, requests, args.concurrency))
    finally:
        server.terminate()
        server.wait(30)
    n, t = args.requests, a["tokens"]
    assert b["tokens"] == t, (a, b)
    report = {
        "requests": n, "tokens": t, "concurrency": args.concurrency, "direct": a, "http": b,
        "direct_cpu_us_per_token": a["cpu_s"] / t * 1e6,
        "http_server_cpu_us_per_token": b["cpu_s"] / t * 1e6,
        "http_client_cpu_us_per_token": b["client_cpu_s"] / t * 1e6,
        "http_layer_cpu_us_per_token": (b["cpu_s"] - a["cpu_s"]) / t * 1e6,
        "http_layer_cpu_ms_per_request": (b["cpu_s"] - a["cpu_s"]) / n * 1e3,
        "direct_tok_per_s": t / a["wall_s"], "http_tok_per_s": t / b["wall_s"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"{n} requests × {args.tokens} tokens, concurrency {args.concurrency}, instant shard (no model):")
    print(f"  router driver alone: {report['direct_cpu_us_per_token']:.0f} µs CPU/token, "
          f"{report['direct_tok_per_s']:.0f} tokens/s")
    print(f"  over HTTP (server):  {report['http_server_cpu_us_per_token']:.0f} µs CPU/token, "
          f"{report['http_tok_per_s']:.0f} tokens/s; client {report['http_client_cpu_us_per_token']:.0f} µs/token")
    print(f"  HTTP layer: {report['http_layer_cpu_us_per_token']:.0f} µs CPU per token "
          f"({report['http_layer_cpu_ms_per_request']:.2f} ms per request of {args.tokens} tokens)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
