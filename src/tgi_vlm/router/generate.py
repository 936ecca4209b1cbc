"""`tgi-vlm generate`: one request through a shard, streamed to the terminal, with timings."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

from tgi_vlm.router.requests import FinalEvent, RequestParams, TokenEvent
from tgi_vlm.router.router import RouterConfig
from tgi_vlm.router.session import router_session

DEMO_PROMPT = "Describe this image in one sentence."


def demo_image() -> bytes:
    from tgi_vlm.images import make_test_image, png_bytes

    return png_bytes(make_test_image(224, 160, seed=0))


@dataclass
class GenerateResult:
    final: FinalEvent
    tokens: list[TokenEvent]
    startup_s: float
    submitted: float
    shard: str = ""  # what runs, from the shard's Info: "bfloat16 on cpu"

    @property
    def ttft_s(self) -> float | None:
        return self.tokens[0].time - self.submitted if self.tokens else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        if len(self.tokens) < 2:
            return None
        return (len(self.tokens) - 1) / max(self.tokens[-1].time - self.tokens[0].time, 1e-9)


async def generate(model_id: str, params: RequestParams, *, uds_path: str | None = None,
                   config: RouterConfig | None = None, shard_args: Sequence[str] = (), out: TextIO | None = None,
                   err: TextIO | None = None) -> GenerateResult:
    """`shard_args`: extra `serve` flags for a shard this starts (e.g. --dtype)."""
    # The streams of this call, not of whenever the module was imported (a test runner swaps them).
    out, err = out or sys.stdout, err or sys.stderr
    start = time.perf_counter()
    print(f"starting {'or connecting to ' if uds_path else ''}the shard for {model_id} ...", file=err, flush=True)
    async with router_session(model_id, uds_path=uds_path, shard_args=shard_args, config=config) as session:
        startup_s = time.perf_counter() - start
        where = "started" if session.shard is not None else "connected to"
        info = session.router.shard.info
        shard = f"{info.dtype} on {info.device_type}"
        print(f"{where} {session.socket} in {startup_s:.1f} s ({shard})", file=err, flush=True)
        submitted = time.perf_counter()
        stream = await session.router.submit(params)
        tokens: list[TokenEvent] = []
        async for event in stream:
            if isinstance(event, TokenEvent):
                tokens.append(event)
                out.write(event.text)
                out.flush()
            else:
                final = event
        out.write("\n")
    return GenerateResult(final, tokens, startup_s, submitted, shard)


def timing_lines(result: GenerateResult) -> list[str]:
    n = len(result.tokens)
    lines = [f"tokens: {n} ({result.final.finish_reason or 'failed'})"]
    if result.ttft_s is not None:
        lines.append(f"TTFT: {result.ttft_s * 1000:.1f} ms")
    if result.decode_tokens_per_s is not None:
        total = result.tokens[-1].time - result.submitted
        lines.append(f"decode: {result.decode_tokens_per_s:.1f} tokens/s; end to end: {n / total:.1f} tokens/s")
    lines.append(f"shard startup: {result.startup_s:.1f} s" + (f" ({result.shard})" if result.shard else ""))
    return lines
