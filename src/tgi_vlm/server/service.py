"""The `generate.v3.TextGenerationService` servicer: protobuf in, engine calls, protobuf out.

Invariants:
- Every call that touches the model or the batch cache runs on one worker thread, under one
  asyncio.Lock: two clients can never interleave forwards, and the event loop stays free, so
  Health answers while a forward runs.
- A new batch is validated (`batch_from_pb`) before any cached batch is touched; a refused batch
  leaves the cache exactly as it was.
- When a step (concatenate, forward, filter) raises, the batches of that call are released and
  never put back; the shard keeps serving.
- Sharded (`serve --sharded`): every rank gets every RPC and does the same work; a rank answers
  Generations only for the requests it owns (`ShardGroup.owns`, TGI's `id % world_size == rank`)
  and the router merges them. Nothing else here depends on the rank: errors, cached batches and
  the batch cache are the same on every rank.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import grpc
from loguru import logger
from opentelemetry import trace

from tgi_vlm.distributed import ShardGroup
from tgi_vlm.errors import (
    BatchNotFound,
    ForwardFailed,
    InvalidArgument,
    InvalidBatch,
    InvalidRequest,
    TgiVlmError,
)
from tgi_vlm.models.types import ShardModel
from tgi_vlm.pb import generate_pb2, generate_pb2_grpc
from tgi_vlm.server.batch_cache import BatchCache, CacheableBatch, release_quietly

tracer = trace.get_tracer(__name__)
T = TypeVar("T")
StepResponse = generate_pb2.PrefillResponse | generate_pb2.DecodeResponse


def is_out_of_memory(exc: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA), or a RuntimeError saying so (older torch, other backends)."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a handler's exception travels as."""
    if isinstance(exc, (InvalidRequest, InvalidBatch, InvalidArgument)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, BatchNotFound):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, ForwardFailed):
        oom = exc.__cause__ is not None and is_out_of_memory(exc.__cause__)
        return (grpc.StatusCode.RESOURCE_EXHAUSTED if oom else grpc.StatusCode.INTERNAL), str(exc)
    if isinstance(exc, TgiVlmError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if is_out_of_memory(exc):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of memory: {exc}"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def _rpc(handler: Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[T]]):
    """Map exceptions escaping a handler to a gRPC status (logging the ones that are our fault)."""

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        try:
            return await handler(self, request, context)
        except Exception as exc:
            code, message = status_for(exc)
            if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.RESOURCE_EXHAUSTED):
                logger.opt(exception=exc).error("{} failed: {}", handler.__name__, message)
            else:
                logger.info("{} refused: {}", handler.__name__, message)
        await context.abort(code, message)

    return wrapper


@contextmanager
def _released_on_failure(batches: list[CacheableBatch], what: str) -> Iterator[None]:
    """Release `batches` if the body raises; engine failures become ForwardFailed."""
    try:
        yield
    except BaseException as exc:
        for batch in batches:
            release_quietly(batch)
        if isinstance(exc, TgiVlmError) or not isinstance(exc, Exception):
            raise
        ids = [batch.batch_id for batch in batches]
        raise ForwardFailed(f"{what} of batch(es) {ids} failed ({type(exc).__name__}: {exc}); "
                            "those batches were released") from exc


class TextGenerationService(generate_pb2_grpc.TextGenerationServiceServicer):
    def __init__(self, model: ShardModel, server_urls: list[str], cache: BatchCache | None = None,
                 group: ShardGroup | None = None) -> None:
        self.model = model
        self.server_urls = list(server_urls)
        self.group = group or ShardGroup()
        self.cache = cache if cache is not None else BatchCache()
        self._lock = asyncio.Lock()
        # One thread: torch's per-thread state (inference mode, current stream) stays put, and
        # work left running by a cancelled RPC still finishes before the next call starts.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tgi-vlm-model")
        # Cached batches left untouched by a refused Prefill(new, cached). A router that resends the
        # good requests names them in its next call; TGI's router instead fails every request and
        # never names that batch again, so one left unnamed by the next call is released.
        self._suspended: set[int] = set()

    def close(self, timeout_s: float | None = None) -> bool:
        """Stop the worker thread once its in-flight work is done; False if that work is still
        running after `timeout_s` (None: wait as long as it takes)."""
        idle = self._executor.submit(lambda: None)  # one thread: this runs once the current work is done
        self._executor.shutdown(wait=False)
        try:
            idle.result(timeout_s)
        except concurrent.futures.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            return False
        return True

    async def _on_model_thread(self, fn: Callable[..., T], *args: Any) -> T:
        async with self._lock:
            future = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
            try:
                return await asyncio.shield(future)
            except asyncio.CancelledError:
                # The client went away; keep the lock until the thread is done with the model.
                await asyncio.wait([future])
                raise

    @_rpc
    async def Info(self, request, context) -> generate_pb2.InfoResponse:
        return await self._on_model_thread(self.model.info)

    @_rpc
    async def Health(self, request, context) -> generate_pb2.HealthResponse:
        return generate_pb2.HealthResponse()

    @_rpc
    async def ServiceDiscovery(self, request, context) -> generate_pb2.ServiceDiscoveryResponse:
        return generate_pb2.ServiceDiscoveryResponse(urls=self.server_urls)

    @_rpc
    async def ClearCache(self, request, context) -> generate_pb2.ClearCacheResponse:
        batch_id = request.id if request.HasField("id") else None
        await self._on_model_thread(self._clear_cache, batch_id)
        return generate_pb2.ClearCacheResponse()

    @_rpc
    async def FilterBatch(self, request, context) -> generate_pb2.FilterBatchResponse:
        with tracer.start_as_current_span("FilterBatch") as span:
            span.set_attribute("batch.id", request.batch_id)
            span.set_attribute("batch.size", len(request.request_ids))
            cached = await self._on_model_thread(self._filter_batch, request.batch_id, list(request.request_ids))
            return generate_pb2.FilterBatchResponse(batch=cached)

    @_rpc
    async def Warmup(self, request, context) -> generate_pb2.WarmupResponse:
        max_supported, max_input, max_total = await self._on_model_thread(self._warmup, request)
        return generate_pb2.WarmupResponse(
            max_supported_total_tokens=max_supported, max_input_tokens=max_input, max_total_tokens=max_total
        )

    @_rpc
    async def Prefill(self, request, context) -> generate_pb2.PrefillResponse:
        with tracer.start_as_current_span("Prefill") as span:
            span.set_attribute("batch.id", request.batch.id)
            span.set_attribute("batch.size", len(request.batch.requests))
            if request.HasField("cached_batch"):
                span.set_attribute("cached_batch.id", request.cached_batch.id)
            response = await self._on_model_thread(self._prefill, request)
            return _traced(span, response)

    @_rpc
    async def Decode(self, request, context) -> generate_pb2.DecodeResponse:
        if not request.batches:
            raise InvalidArgument("Decode with no batches: list at least one cached batch")
        with tracer.start_as_current_span("Decode") as span:
            span.set_attribute("batch.ids", [b.id for b in request.batches])
            span.set_attribute("batch.size", sum(b.size for b in request.batches))
            response = await self._on_model_thread(self._decode, [b.id for b in request.batches])
            return _traced(span, response)

    # -- model thread ---------------------------------------------------------------------

    def _release_suspended(self, named: set[int]) -> None:
        """Release batches a refused Prefill left behind, unless this call names them."""
        for batch_id in self._suspended - named:
            if self.cache.drop(batch_id):
                logger.info("released batch {}: left by a refused Prefill and not resumed", batch_id)
        self._suspended.clear()

    def _warmup(self, request: generate_pb2.WarmupRequest):
        self._release_suspended(set())
        if len(self.cache):
            # Warmup re-sizes the KV cache, which would invalidate every cached batch's blocks.
            raise InvalidArgument(
                f"Warmup while {len(self.cache)} batch(es) are cached (ids {self.cache.ids()}); send ClearCache first"
            )
        return self.model.warmup(request)

    def _clear_cache(self, batch_id: int | None) -> None:
        self._release_suspended(set() if batch_id is None else {batch_id})
        if batch_id is None:
            released = self.cache.clear()
            logger.debug("cleared {} cached batch(es)", len(released))
        elif not self.cache.drop(batch_id):
            logger.debug("ClearCache: batch {} was not cached", batch_id)
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        """No batch left: per-step state kept between steps (the CPU decode mirror) is given back."""
        if len(self.cache) == 0 and not self._suspended:
            self.model.release_idle()

    def _filter_batch(self, batch_id: int, request_ids: list[int]) -> generate_pb2.CachedBatch:
        self._release_suspended({batch_id})
        batch = self.cache.get(batch_id)
        if not request_ids:
            raise InvalidArgument(f"FilterBatch of batch {batch_id} keeps no request; use ClearCache({batch_id})")
        unknown = sorted(set(request_ids) - set(batch.request_ids))
        if unknown:
            raise InvalidArgument(f"FilterBatch: request id(s) {unknown} are not in batch {batch_id}")
        self.cache.pop(batch_id)
        with _released_on_failure([batch], "filter"):
            filtered = batch.filter(request_ids)
        self.cache.add(filtered)
        return filtered.to_pb()

    def _prefill(self, request: generate_pb2.PrefillRequest) -> generate_pb2.PrefillResponse:
        start = time.perf_counter_ns()
        cached_id = request.cached_batch.id if request.HasField("cached_batch") else None
        self._release_suspended(set() if cached_id is None else {cached_id})
        self._check_new_batch(request.batch, cached_id)
        try:
            new = self.model.batch_from_pb(request.batch)
        except Exception:
            if cached_id is not None:
                self._suspended.add(cached_id)  # left as it was; see _release_suspended
            raise
        batches = [new] if cached_id is None else [self.cache.pop(cached_id), new]
        return self._step(batches, start, generate_pb2.PrefillResponse)

    def _check_new_batch(self, batch: generate_pb2.Batch, cached_id: int | None) -> None:
        """Refuse ids that would make the cache ambiguous, before any work (TGI's router never sends these)."""
        if batch.id in self.cache and batch.id != cached_id:
            raise InvalidArgument(f"Prefill: batch id {batch.id} is already cached; ClearCache({batch.id}) first")
        if cached_id is None:
            return
        shared = sorted(set(self.cache.get(cached_id).request_ids) & {r.id for r in batch.requests})
        if shared:
            raise InvalidArgument(f"Prefill: request id(s) {shared} are already in cached batch {cached_id}")

    def _decode(self, batch_ids: list[int]) -> generate_pb2.DecodeResponse:
        start = time.perf_counter_ns()
        self._release_suspended(set(batch_ids))
        return self._step(self.cache.pop_all(batch_ids), start, generate_pb2.DecodeResponse)

    def _step(self, batches: list[CacheableBatch], start: int, response_type: type[T]) -> T:
        """Concatenate (when several), run one forward, keep the next batch. Owns `batches`."""
        concat_ns = None
        batch = batches[0]
        if len(batches) > 1:
            concat_start = time.perf_counter_ns()
            with _released_on_failure(batches, "concatenate"):
                batch = self.model.concatenate(batches)
            concat_ns = time.perf_counter_ns() - concat_start
        with _released_on_failure([batch], "forward"):
            generations, next_batch, timings = self.model.generate_token(batch)
        if next_batch is None:
            release_quietly(batch)  # every request finished; release is idempotent
            self._release_if_idle()
        else:
            self.cache.add(next_batch)
        return response_type(
            generations=[g.to_pb() for g in generations if self.group.owns(g.request_id)],
            batch=next_batch.to_pb() if next_batch is not None else None,
            forward_ns=timings.forward_ns,
            decode_ns=timings.decode_ns,
            total_ns=time.perf_counter_ns() - start,
            concat_ns=concat_ns,
        )


def _traced(span: trace.Span, response: StepResponse) -> StepResponse:
    span.set_attribute("generations", len(response.generations))
    if response.HasField("batch"):
        span.set_attribute("next_batch.size", response.batch.size)
    return response
