"""`tgi-vlm bench --url`: the serving workload against a running `tgi-vlm launch` (or TGI) over HTTP.

Each request is a POST /generate_stream with the prompt's images as markdown data URIs, greedy,
and `max_new_tokens` of the work item; token times are when each server-sent event arrives. The
result has the shape of the router benchmark's (`router.bench.ServingResult`), without the step
records the HTTP API does not expose. TGI's API has no ignore_eos: compare with a direct run of
the same workload built with ignore_eos off (`--no-ignore-eos`), whose greedy outputs are the same.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time

import httpx

from tgi_vlm.router.bench import RequestResult, ServingResult
from tgi_vlm.router.requests import RequestParams
from tgi_vlm.router.workload import WorkItem, WorkloadSpec


def request_body(params: RequestParams) -> dict:
    inputs = "".join(c if isinstance(c, str) else f"![](data:image/png;base64,{base64.b64encode(c).decode()})"
                     for c in params.chunks)
    return {"inputs": inputs, "parameters": {"max_new_tokens": params.max_new_tokens, "do_sample": False}}


async def stream_one(client: httpx.AsyncClient, url: str, params: RequestParams) -> RequestResult:
    submitted = time.perf_counter()
    tokens, times, error = [], [], None
    async with client.stream("POST", f"{url}/generate_stream", json=request_body(params)) as response:
        if response.status_code != 200:
            await response.aread()
            return RequestResult([], submitted, [], f"HTTP {response.status_code}: {response.text}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                error = str(event["error"])
                break
            tokens.append(event["token"]["id"])
            times.append(time.perf_counter())
    return RequestResult(tokens, submitted, times, error)


async def run_serving_http(url: str, items: list[WorkItem], spec: WorkloadSpec, *, api_key: str | None = None,
                           progress=None) -> ServingResult:
    if items and items[0].params.ignore_eos:
        raise ValueError("the HTTP API has no ignore_eos: build the workload with it off (--no-ignore-eos)")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=(spec.concurrency or len(items)) + 4)
    async with httpx.AsyncClient(timeout=None, headers=headers, limits=limits) as client:
        warm = items[0].params
        await stream_one(client, url, RequestParams(warm.chunks, max_new_tokens=2))
        results: list[RequestResult | None] = [None] * len(items)
        limit = asyncio.Semaphore(spec.concurrency or len(items))
        start = time.perf_counter()

        async def one(i: int, item: WorkItem) -> None:
            if spec.rate:
                await asyncio.sleep(max(0.0, start + item.arrival_s - time.perf_counter()))
            async with limit:
                results[i] = await stream_one(client, url, item.params)
            if progress is not None:
                progress()

        await asyncio.gather(*[one(i, item) for i, item in enumerate(items)])
        return ServingResult(time.perf_counter() - start, results, [], {})
