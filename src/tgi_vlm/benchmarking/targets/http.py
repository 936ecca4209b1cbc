"""The "http" target: TGI's HTTP API of a running `tgi-vlm launch` (or TGI) at --url.

Each request is a POST /generate_stream with the prompt's images as markdown data URIs, greedy,
and `max_new_tokens` of the work item; token times are when each server-sent event arrives. The
warm-up is the first request with 2 new tokens. The result has the shape of the driver's, without
the step records, CPU times and dtype the HTTP API does not expose. TGI's API has no ignore_eos:
compare with a direct run of the same workload built with ignore_eos off (`--no-ignore-eos`), whose
greedy outputs are the same.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tgi_vlm.benchmarking.load import Load
from tgi_vlm.benchmarking.options import BenchError, BenchOptions
from tgi_vlm.benchmarking.results import RequestResult, ServingResult
from tgi_vlm.benchmarking.targets import register
from tgi_vlm.benchmarking.targets.base import Session, Target
from tgi_vlm.media import VideoBytes
from tgi_vlm.router.requests import RequestParams


@register
@dataclass
class HttpTarget(Target):
    name = "http"

    url: str
    api_key: str | None = None
    connections: int = 20  # at most this many requests in flight (the load's concurrency, plus a few)

    @classmethod
    def from_options(cls, options: BenchOptions) -> HttpTarget:
        if not options.url:
            raise BenchError("--target http: give the server's --url")
        if options.load.ignore_eos:
            raise BenchError("--url: TGI's HTTP API has no ignore_eos; add --no-ignore-eos (and use it for the "
                             "direct run you compare with, so both send the same requests)")
        load = options.load
        in_flight = load.concurrency or load.num_requests  # the open loop may have every request in flight
        return cls(options.url.rstrip("/"), options.api_key, in_flight + 4)

    @property
    def transport(self) -> str:
        return f"HTTP {self.url}"

    @asynccontextmanager
    async def session(self, *, prefix_caching: bool | None = None,
                      profile_to: Path | None = None) -> AsyncIterator[HttpSession]:
        if prefix_caching is not None:
            raise BenchError(f"{self.transport}: the server's prefix cache cannot be switched from here")
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limits = httpx.Limits(max_connections=self.connections)
        async with httpx.AsyncClient(timeout=None, headers=headers, limits=limits) as client:
            yield HttpSession(client, self.url)


class HttpSession(Session):
    def __init__(self, client: httpx.AsyncClient, url: str) -> None:
        self.client = client
        self.url = url

    async def warm_up(self, load: Load) -> None:
        if load.first_request.ignore_eos:
            raise BenchError("the HTTP API has no ignore_eos: build the workload with it off (--no-ignore-eos)")
        await self.submit(RequestParams(load.first_request.chunks, max_new_tokens=2))

    async def submit(self, params: RequestParams) -> RequestResult:
        return await stream_one(self.client, self.url, params)

    def end(self, wall_s: float, results: list[RequestResult]) -> ServingResult:
        return ServingResult(wall_s, results, [], {})


def request_body(params: RequestParams) -> dict:
    inputs = "".join(_markdown(c) for c in params.chunks)
    return {"inputs": inputs, "parameters": {"max_new_tokens": params.max_new_tokens, "do_sample": False}}


def _markdown(chunk) -> str:
    """Text as is; an image or a clip as its markdown data URI (`![video](...)`: api/images.py)."""
    if isinstance(chunk, str):
        return chunk
    if isinstance(chunk, VideoBytes):
        return f"![video](data:{chunk.mimetype};base64,{base64.b64encode(chunk.data).decode()})"
    return f"![](data:image/png;base64,{base64.b64encode(chunk).decode()})"


async def stream_one(client: httpx.AsyncClient, url: str, params: RequestParams) -> RequestResult:
    submitted = time.perf_counter()
    tokens, times, error, text = [], [], None, ""
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
            text = event.get("generated_text") or text  # the last event carries the whole text
    return RequestResult(tokens, submitted, times, error, text=text)
