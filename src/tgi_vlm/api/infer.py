"""Requests through the router driver (TGI's `Infer`): the concurrency limit, validation, one
request's events, failures mapped to TGI's errors, and cancellation when the caller goes away.

A permit is taken before validation (past `max_concurrent_requests` → 429, as TGI's semaphore)
and held until the request's last event. `stream()` is an async generator: closing it early (the
HTTP client disconnected) cancels the request in the router, which frees its KV blocks at the next
step boundary. Every failure is counted once, as `tgi_request_failure{err=<error_type>}`.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, replace

from tgi_vlm.api.errors import ApiError, generation_error, incomplete_generation, overloaded, validation_error
from tgi_vlm.api.health import BackendHealth
from tgi_vlm.api.metrics import Metrics
from tgi_vlm.api.schemas import Parameters
from tgi_vlm.api.validation import Validator, ValidRequest
from tgi_vlm.router.requests import FinalEvent, TokenEvent
from tgi_vlm.router.router import Router, Stream, cacheable_prompt
from tgi_vlm.router.tokens import PromptTokens


@dataclass
class Generation:
    tokens: list[TokenEvent]
    final: FinalEvent


@dataclass(frozen=True)
class StreamStep:
    """One token of a stream; the last one carries the FinalEvent (TGI's last event has the text)."""

    index: int  # 1-based
    token: TokenEvent
    final: FinalEvent | None
    valid: ValidRequest


class Infer:
    def __init__(self, router: Router, validator: Validator, metrics: Metrics, max_concurrent_requests: int):
        self.router = router
        self.validator = validator
        self.metrics = metrics
        self.max_concurrent_requests = max_concurrent_requests
        self.in_flight = 0
        self.health = BackendHealth()  # /health's check; a failed generation switches it to liveness

    async def generate(self, inputs: str, params: Parameters, *,
                       add_special_tokens: bool = True) -> tuple[Generation, ValidRequest]:
        tokens: list[TokenEvent] = []
        async with aclosing(self._run(inputs, params, add_special_tokens, stream=False)) as steps:
            async for step in steps:
                tokens.append(step.token)
                if step.final is not None:
                    return Generation(tokens, step.final), step.valid
        raise incomplete_generation()

    def stream(self, inputs: str, params: Parameters, *, add_special_tokens: bool = True) -> AsyncIterator[StreamStep]:
        return self._run(inputs, params, add_special_tokens, stream=True)

    async def _run(self, inputs: str, params: Parameters, add_special_tokens: bool,
                   stream: bool) -> AsyncIterator[StreamStep]:
        start = time.perf_counter()
        self.metrics.counters.inc("tgi_request_count")
        try:
            with self._permit():
                valid = await self.validator.validate(inputs, params, add_special_tokens=add_special_tokens,
                                                      stream=stream)
                queued = time.perf_counter()
                routed = await self.router.submit(valid.params, input_len=_prompt_of(valid))
                async for index, token, final in _paired(routed, self.router, self.metrics, self.health):
                    if final is not None:
                        self._done(final.generated_tokens, valid, start, queued)
                    yield StreamStep(index, token, final, valid)
        except ApiError as error:
            self.metrics.counters.inc("tgi_request_failure", err=error.error_type)
            raise

    async def generate_many(self, inputs: str, params: Parameters, seeds: list[int | None], *,
                            add_special_tokens: bool = True) -> tuple[list[Generation], ValidRequest]:
        """`len(seeds)` sequences of one prompt (best_of, n), in order."""
        tokens: list[list[TokenEvent]] = [[] for _ in seeds]
        finals: list[FinalEvent | None] = [None for _ in seeds]
        valid = None
        async with aclosing(self.stream_many(inputs, params, seeds, add_special_tokens=add_special_tokens)) as steps:
            async for index, step in steps:
                tokens[index].append(step.token)
                finals[index], valid = step.final or finals[index], step.valid
        if valid is None or any(f is None for f in finals):
            raise incomplete_generation()
        return [Generation(t, f) for t, f in zip(tokens, finals)], valid

    async def stream_many(self, inputs: str, params: Parameters, seeds: list[int | None], *,
                          add_special_tokens: bool = True, stream: bool = False) -> AsyncIterator[tuple[int, StreamStep]]:
        """(sequence index, step) for several sequences of one prompt, interleaved as they come.

        The prompt is validated once, and the request counted once (`tgi_request_count`, and
        `tgi_request_success` with its histograms when the last sequence ends: TGI's one HTTP request).
        When the prefix cache serves this request (on, the prompt keyed and not asking prefill logprobs,
        at least one whole block), the first sequence is queued alone and the others once its first
        token is back (its prompt blocks are cached then), so they reuse its KV blocks instead of
        computing the prompt again. A seed per sequence: `seeds[i]`, or a random one where None (the
        first keeps the validated request's). Any failure of a sequence ends the whole request with it."""
        start = time.perf_counter()
        self.metrics.counters.inc("tgi_request_count")  # one request, as TGI counts an HTTP request
        try:
            with self._permit(len(seeds)):
                valid = await self.validator.validate(inputs, params, add_special_tokens=add_special_tokens,
                                                      stream=stream)
                copies = [_seeded(valid, seed, first=i == 0) for i, seed in enumerate(seeds)]
                async with aclosing(self._fan_out(copies, start, time.perf_counter())) as steps:
                    async for item in steps:
                        yield item
        except ApiError as error:
            self.metrics.counters.inc("tgi_request_failure", err=error.error_type)
            raise

    async def _fan_out(self, copies: list[ValidRequest], start: float,
                       queued: float) -> AsyncIterator[tuple[int, StreamStep]]:
        items: asyncio.Queue[tuple[int, StreamStep] | Exception | None] = asyncio.Queue()
        prefilled = asyncio.Event()
        share = len(copies) > 1 and self._shares_prompt(copies[0])
        finals: list[FinalEvent] = []

        async def run(i: int, valid: ValidRequest) -> None:
            try:
                if i > 0 and share:
                    await prefilled.wait()
                routed = await self.router.submit(valid.params, input_len=_prompt_of(valid))
                async for index, token, final in _paired(routed, self.router, self.metrics, self.health):
                    prefilled.set()
                    if final is not None:
                        finals.append(final)
                        if len(finals) == len(copies):
                            self._done(sum(f.generated_tokens for f in finals), valid, start, queued)
                    await items.put((i, StreamStep(index, token, final, valid)))
            except Exception as error:  # noqa: BLE001 - handed to the consumer, which raises it (not swallowed)
                await items.put(error)
            finally:
                prefilled.set()
                await items.put(None)

        tasks = [asyncio.create_task(run(i, v)) for i, v in enumerate(copies)]
        try:
            running = len(tasks)
            while running:
                item = await items.get()
                if item is None:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()  # closing a task's stream cancels its request in the router
            await asyncio.gather(*tasks, return_exceptions=True)  # their own errors were handed over above

    def _shares_prompt(self, valid: ValidRequest) -> bool:
        """Whether the followers should wait for the first sequence's prefill: only when the prefix cache
        will serve them its blocks (on, the prompt keyed, no prefill logprobs, one whole block at least)."""
        block_size = self.router.allocator.block_size
        return (self.router.config.prefix_caching and valid.input_length >= block_size
                and cacheable_prompt(_prompt_of(valid), valid.params, block_size) is not None)

    @contextmanager
    def _permit(self, n: int = 1) -> Iterator[None]:
        if self.in_flight + n > self.max_concurrent_requests:
            raise overloaded()
        self.in_flight += n
        try:
            yield
        finally:
            self.in_flight -= n

    def _done(self, generated_tokens: int, valid: ValidRequest, start: float, queued: float) -> None:
        """One request's success (with several sequences, once: their tokens together)."""
        now = time.perf_counter()
        self.metrics.request_done(total_s=now - start, validation_s=queued - start, inference_s=now - queued,
                                  generated_tokens=generated_tokens, input_length=valid.input_length,
                                  max_new_tokens=valid.params.max_new_tokens)


def _prompt_of(valid: ValidRequest) -> PromptTokens | int:
    """What the router keys the prefix cache on: the prompt's tokens, else its bare length."""
    return valid.prompt if valid.prompt is not None else valid.input_length


def _seeded(valid: ValidRequest, seed: int | None, *, first: bool) -> ValidRequest:
    if seed is None and first:
        return valid
    seed = secrets.randbits(64) if seed is None else seed % 2**64
    return replace(valid, params=replace(valid.params, seed=seed))


async def _paired(stream: Stream, router: Router, metrics: Metrics,
                  health: BackendHealth) -> AsyncIterator[tuple[int, TokenEvent, FinalEvent | None]]:
    """(index, token, None) per token, the last with its successful FinalEvent; a failed request raises
    (and, as in TGI, makes the next /health run the model: `health.generation_failed`).
    Closed early (the consumer went away), the request is cancelled in the router."""
    finished = False
    held: TokenEvent | None = None
    index = 0
    try:
        async for event in stream:
            if isinstance(event, FinalEvent):
                finished = True
                if not event.ok:
                    health.generation_failed()
                    raise request_error(event)
                if held is None:
                    raise incomplete_generation()
                yield index + 1, held, event
                return
            if held is not None:
                index += 1
                yield index, held, None
            held = event
            if not stream.ready():  # more tokens to come: the last one arrives with its FinalEvent
                index += 1
                yield index, held, None
                held = None
    finally:
        if not finished and router.cancel(stream.request_id):
            metrics.counters.inc("tgi_vlm_request_cancelled")


def request_error(final: FinalEvent) -> ApiError:
    """A failed FinalEvent as TGI's error: a refused request is a validation error (422), anything
    else a generation error (424). Only this request's part of a batch-wide message is kept."""
    reason = own_reason(final.error or "", final.request_id)
    return validation_error(reason) if final.refused else generation_error(reason)


def own_reason(message: str, request_id: int) -> str:
    message = message.removeprefix("refused by the shard: ")
    own = re.search(rf"request {request_id}: (.*?)(?=; request \d+: |$)", message)
    return own.group(1) if own else message
