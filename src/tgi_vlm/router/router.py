"""The continuous-batching loop TGI's v3 router runs (`backends/v3/src/backend.rs::batching_task`).

Startup: ClearCache → Info → Warmup, then the block allocator is sized from the shard's answer.
Loop: Prefill(batch) → stream → FilterBatch/ClearCache → while the batch lives: with chunking,
`Prefill(new, cached_batch)` (the new requests share the forward with the running ones, prefill
budget minus the running batch's `current_tokens`); without, `Prefill(new)` then
`Decode([old, new])` → `Decode`.

Failures: a Prefill refused with INVALID_ARGUMENT naming request ids fails just those requests;
the shard left the cached batch unchanged, so the good ones are resent with it. A request refused
for its `cache_len` claim is not failed: its cached match is dropped (`distrust`) and it goes back
to the front of the queue without prefix caching (cache_len=0). Any other RPC error clears the
batches involved and fails their requests. A request's blocks are freed whenever it leaves a batch
(finished, cancelled, failed, requeued).

Prefix caching (`RouterConfig.prefix_caching`, default on): the allocator is a `PrefixCache`; a
request's prompt blocks are keyed at submit (token ids + media content hashes, from
`TokenCounter.tokenize`, in the namespace of its adapter_id) and entered into the cache once its first token arrives. VLM shards answer
Info.use_prefix_caching=false (TGI's router is blind to images); this driver does not need that
permission, because its keys see images and the shard verifies every claim.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from loguru import logger

from tgi_vlm.lora.specs import unknown_adapter_message
from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.router.allocator import BlockAllocator, PromptBlocks
from tgi_vlm.router.client import ShardClient
from tgi_vlm.router.prefix_cache import PrefixCache, PrefixStats, prompt_blocks
from tgi_vlm.router.queue import Entry, NextBatch, Queue, min_batch_size
from tgi_vlm.router.requests import Event, FinalEvent, RequestParams, TokenEvent, tokens_from_pb
from tgi_vlm.router.tokens import PromptTokens
from tgi_vlm.router.warmup import warmup_request

_BAD_REQUEST = re.compile(r"request (\d+):")
_REASON = re.compile(r"request (\d+): (.*?)(?=; request \d+: |$)", re.S)
MAX_STEP_RECORDS = 100_000  # a long-running server keeps the latest steps only


@dataclass(frozen=True)
class RouterConfig:
    """TGI launcher flags of the same names."""

    max_input_tokens: int = 1024
    max_total_tokens: int = 2048
    max_batch_prefill_tokens: int = 2048
    max_batch_total_tokens: int | None = None  # None: what Warmup says the KV cache holds
    max_batch_size: int | None = None
    waiting_served_ratio: float = 0.3
    max_waiting_tokens: int = 20
    # The driver's own: reuse cached prompt blocks (keyed on token ids + media; the shard verifies).
    prefix_caching: bool = True
    # Ranks of the shard a session starts (`serve --sharded`, one process each); the Router itself
    # sees one client whatever the number (ServiceDiscovery decides when connecting to a running shard).
    num_shard: int = 1


@dataclass(frozen=True)
class StepRecord:
    """One Prefill/Decode as seen by the router (wall clock) and as reported by the shard."""

    kind: str  # "prefill" | "prefill+cached" | "decode"
    size: int  # requests in the resulting batch
    wall_s: float
    forward_ns: int
    decode_ns: int
    total_ns: int
    concat_ns: int


@dataclass(frozen=True)
class ShardInfo:
    info: pb.InfoResponse
    max_supported_total_tokens: int
    max_input_tokens: int
    max_total_tokens: int


class Stream:
    """The events of one request: TokenEvents, then exactly one FinalEvent."""

    def __init__(self, entry: Entry):
        self.entry = entry

    @property
    def request_id(self) -> int:
        return self.entry.id

    def ready(self) -> bool:
        """True when the next event is already queued: the router sends a request's last token and
        its FinalEvent together, so a caller can attach the final to that token without waiting."""
        return not self.entry.events.empty()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        while True:
            event = await self.entry.events.get()
            yield event
            if isinstance(event, FinalEvent):
                return

    async def final(self) -> tuple[list[TokenEvent], FinalEvent]:
        """Drain the stream: (token events, final event)."""
        tokens = []
        async for event in self:
            if isinstance(event, TokenEvent):
                tokens.append(event)
            else:
                return tokens, event
        raise AssertionError("stream ended without a final event")


def bad_request_ids(error: grpc.aio.AioRpcError, candidates: set[int]) -> set[int]:
    """The requests an INVALID_ARGUMENT Prefill error names ("... request <id>: <reason>; ...")."""
    if error.code() != grpc.StatusCode.INVALID_ARGUMENT:
        return set()
    return {int(m) for m in _BAD_REQUEST.findall(error.details() or "")} & candidates


def refusal_reasons(details: str) -> dict[int, str]:
    """Request id → reason, from "... request <id>: <reason>; request <id>: <reason>"."""
    return {int(rid): reason for rid, reason in _REASON.findall(details or "")}


def cacheable_prompt(prompt: PromptTokens | int, params: RequestParams, block_size: int) -> PromptBlocks | None:
    """The prompt's block keys for the prefix cache, or None: a bare length cannot be keyed, and
    requests with prefill logprobs get no lookup and no insert (as in TGI: cached positions would
    have no logprobs)."""
    if not isinstance(prompt, PromptTokens) or params.prefill_logprobs:
        return None
    return prompt_blocks(prompt.ids, prompt.media, prompt.group_ids, block_size, adapter_id=params.adapter_id)


def is_cache_claim_refusal(entry: Entry, reason: str) -> bool:
    """The shard refused what the prefix cache offered, not the request itself."""
    return entry.allocation is not None and entry.allocation.cache_len > 0 and "cache_len" in reason


class Router:
    """Plays TGI's v3 router against one shard (a ShardClient, or a ShardedClient over its ranks).
    `run()` is the loop; `submit()` feeds it."""

    def __init__(self, client: ShardClient, count_tokens: Callable[[pb.Request], PromptTokens | int],
                 config: RouterConfig | None = None):
        """`count_tokens`: `TokenCounter.tokenize` (ids and media: prefix caching can key the prompt) or
        anything giving the prompt length alone (such requests are neither looked up nor cached)."""
        self.client = client
        self.count_tokens = count_tokens
        self.config = config or RouterConfig()
        self.shard: ShardInfo | None = None
        self.allocator: BlockAllocator | None = None
        self.queue: Queue | None = None
        self.calls: Counter[str] = Counter()  # RPCs sent, e.g. "prefill+cached", "decode"
        self.steps: deque[StepRecord] = deque(maxlen=MAX_STEP_RECORDS)
        self.step_listeners: list[Callable[[StepRecord], None]] = []  # called after every Prefill/Decode
        self.prefix_stats = PrefixStats()
        self._ids = itertools.count(1)
        self._running: dict[int, Entry] = {}
        self._wake = asyncio.Event()
        self._started = asyncio.Event()
        self._start_lock = asyncio.Lock()
        self._stopping = False
        self._counting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tgi-vlm-count")

    # ----- startup -----
    async def start(self) -> ShardInfo:
        """ClearCache → Info → Warmup; sizes the block allocator. Idempotent."""
        async with self._start_lock:
            if self.shard is None:
                await self._start()
        return self.shard

    async def _start(self) -> None:
        cfg = self.config
        await self.client.clear_cache(None)
        info = await self.client.info()
        if info.requires_padding:
            raise RuntimeError("the shard requires padding; this router drives paged (v3) shards only")
        warm = await self.client.warmup(warmup_request(cfg.max_input_tokens, cfg.max_batch_prefill_tokens,
                                                       cfg.max_total_tokens, cfg.max_batch_size))
        supported = warm.max_supported_total_tokens if warm.HasField("max_supported_total_tokens") else None
        total = cfg.max_batch_total_tokens or supported
        if total is None:
            raise RuntimeError("the shard did not report max_supported_total_tokens; set max_batch_total_tokens")
        self.shard = ShardInfo(info, total, warm.max_input_tokens, warm.max_total_tokens)
        blocks = total // info.block_size
        self.allocator = (PrefixCache(blocks, info.block_size, self.prefix_stats) if cfg.prefix_caching
                          else BlockAllocator(blocks, info.block_size))
        self.queue = Queue(self.allocator)
        self._started.set()
        logger.debug("shard ready: block_size {}, {} blocks, chunking {}, prefix caching {}", info.block_size,
                     self.allocator.num_blocks, info.support_chunking, cfg.prefix_caching)

    # ----- public API -----
    async def submit(self, params: RequestParams, *, input_len: int | PromptTokens | None = None) -> Stream:
        """Queue a request; its events arrive on the returned stream (errors as a failed FinalEvent).
        `input_len`: the prompt's token count, or its `PromptTokens` (what the prefix cache keys on),
        when the caller has already counted it."""
        await self._started.wait()
        entry = Entry(id=next(self._ids), params=params, input_len=0, submitted=time.perf_counter(),
                      speculate=self.shard.info.speculate)
        try:
            prompt = input_len
            # The prefix cache needs the prompt's ids and media, not only its length.
            if input_len is None or (self.config.prefix_caching and not isinstance(input_len, PromptTokens)):
                prompt = await asyncio.get_running_loop().run_in_executor(
                    self._counting, self.count_tokens, params.to_pb(entry.id))
        except ValueError as exc:
            return self._refuse(entry, str(exc))
        entry.input_len = len(prompt) if isinstance(prompt, PromptTokens) else prompt
        if self.config.prefix_caching:
            entry.prompt = cacheable_prompt(prompt, params, self.allocator.block_size)
        problem = self._validate(entry)
        if problem:
            return self._refuse(entry, f"request {entry.id}: {problem}")
        if self._stopping:
            return self._refuse(entry, "the router is stopping", refused=False)
        self.queue.append(entry)
        self._wake.set()
        return Stream(entry)

    def cancel(self, request_id: int) -> bool:
        """Cancel a queued or running request; its blocks are freed at the next step boundary."""
        for entry in list(self.queue.waiting):
            if entry.id == request_id:
                self.queue.remove(entry)
                self._finish(entry, FinalEvent.failed(entry.id, "cancelled", cancelled=True))
                return True
        entry = self._running.get(request_id)
        if entry is None or entry.done:
            return False
        entry.cancelled = True
        return True

    async def run(self) -> None:
        """Serve until `stop()`. Fails whatever is still queued or running when it returns."""
        await self.start()
        try:
            while not self._stopping:
                batch = self._next_batch(None)
                if batch is None:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await self._serve(batch)
        finally:
            self.queue.fail_all("the router stopped")
            self._counting.shutdown(wait=False)
            if self.config.prefix_caching:
                logger.info(self.prefix_stats.summary())

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    # ----- the loop -----
    async def _serve(self, first: NextBatch) -> None:
        """One batch's life: prefill, then decode while requests join, until none is left."""
        entries: dict[int, Entry] = {}
        cached = await self._prefill(first, None, entries)
        waiting_steps = 1
        while cached is not None:
            if self._stopping:
                await self._clear([cached.id], entries, "the router stopped")
                return
            batches = [cached]
            new = self._next_batch(cached, waiting_steps)
            if new is not None:
                if self.shard.info.support_chunking:
                    # The new requests are concatenated after the running ones in the same forward.
                    joined = await self._prefill(new, cached, entries)
                    batches = [joined] if joined is not None else []
                else:
                    new_entries: dict[int, Entry] = {}
                    new_cached = await self._prefill(new, None, new_entries)
                    entries.update(new_entries)
                    if new_cached is not None:
                        batches.append(new_cached)
                waiting_steps = 1
            if not batches:
                return
            cached = await self._decode(batches, entries)
            waiting_steps += 1

    def _next_batch(self, cached: pb.CachedBatch | None, waiting_steps: int = 0) -> NextBatch | None:
        cfg = self.config
        chunking = self.shard.info.support_chunking
        if cached is None:
            return self.queue.next_batch(min_size=None, max_size=cfg.max_batch_size,
                                         prefill_budget=cfg.max_batch_prefill_tokens, chunking=chunking)
        if chunking:
            budget = cfg.max_batch_prefill_tokens - cached.current_tokens
            return self.queue.next_batch(min_size=None, max_size=None, prefill_budget=budget, chunking=True)
        min_size = None if waiting_steps >= cfg.max_waiting_tokens else min_batch_size(cached.size, cfg.waiting_served_ratio)
        max_size = None if cfg.max_batch_size is None else cfg.max_batch_size - cached.size
        return self.queue.next_batch(min_size=min_size, max_size=max_size,
                                     prefill_budget=cfg.max_batch_prefill_tokens, chunking=False)

    async def _prefill(self, new: NextBatch, cached: pb.CachedBatch | None,
                       entries: dict[int, Entry]) -> pb.CachedBatch | None:
        """Prefill(new[, cached]); `entries` (the running ones) gains the new requests."""
        entries.update(new.entries)
        self._running.update(new.entries)
        kind = "prefill+cached" if cached is not None else "prefill"
        while True:
            try:
                self.calls[kind] += 1
                start = time.perf_counter()
                response = await self.client.prefill(new.batch, cached)
                break
            except grpc.aio.AioRpcError as exc:
                bad = bad_request_ids(exc, set(new.entries))
                if not bad:
                    ids = [new.batch.id] + ([cached.id] if cached is not None else [])
                    await self._clear(ids, entries, f"Prefill failed: {exc.code().name}: {exc.details()}")
                    return None
                self._drop_refused(new, bad, entries, exc.details())
                if not new.entries:
                    return cached  # the shard left the cached batch as it was
        self._record(kind, response, start)
        for entry in new.entries.values():
            self.prefix_stats.count_prefill(entry.input_len, entry.allocation.cache_len)
        self._send(response.generations, entries)
        return await self._filter(response.batch if response.HasField("batch") else None, entries)

    def _drop_refused(self, new: NextBatch, bad: set[int], entries: dict[int, Entry], details: str) -> None:
        reasons = refusal_reasons(details)
        for rid in bad:
            entry = new.entries.pop(rid)
            entries.pop(rid, None)
            if is_cache_claim_refusal(entry, reasons.get(rid, "")):
                self._retry_without_cache(entry, reasons[rid])
            else:
                self._finish(entry, FinalEvent.failed(rid, f"refused by the shard: {details}", refused=True))
        kept = [r for r in new.batch.requests if r.id not in bad]
        del new.batch.requests[:]
        new.batch.requests.extend(kept)
        new.batch.size = len(kept)

    def _retry_without_cache(self, entry: Entry, reason: str) -> None:
        """A cache miss never fails a request: drop its cached match, queue it first with cache_len=0."""
        logger.info("request {}: the shard refused its cached prefix ({}); resending with cache_len=0", entry.id, reason)
        self.prefix_stats.refused_claims += 1
        self.allocator.distrust(entry.allocation)
        self.allocator.free(entry.allocation)
        self._running.pop(entry.id, None)
        entry.allocation, entry.chunk_len, entry.prompt = None, None, None
        self.queue.push_front(entry)

    async def _decode(self, batches: list[pb.CachedBatch], entries: dict[int, Entry]) -> pb.CachedBatch | None:
        try:
            self.calls["decode"] += 1
            start = time.perf_counter()
            response = await self.client.decode(batches)
        except grpc.aio.AioRpcError as exc:
            await self._clear([b.id for b in batches], entries, f"Decode failed: {exc.code().name}: {exc.details()}")
            return None
        self._record("decode", response, start)
        self._send(response.generations, entries)
        return await self._filter(response.batch if response.HasField("batch") else None, entries)

    def _record(self, kind: str, response, start: float) -> None:
        size = response.batch.size if response.HasField("batch") else 0
        record = StepRecord(kind, size, time.perf_counter() - start, response.forward_ns,
                            response.decode_ns, response.total_ns, response.concat_ns)
        self.steps.append(record)
        for listener in self.step_listeners:
            listener(record)

    def _send(self, generations, entries: dict[int, Entry]) -> None:
        now = time.perf_counter()
        for g in generations:
            entry = entries.get(g.request_id)
            if entry is None or entry.cancelled:
                continue
            if not entry.prompt_cached:  # its first token: the shard has recorded its prompt blocks
                entry.prompt_cached = True
                self.allocator.cache_prompt(entry.allocation)
            if g.HasField("prefill_tokens"):
                entry.prefill = tokens_from_pb(g.prefill_tokens)
            for i, token in enumerate(tokens_from_pb(g.tokens)):
                top = tokens_from_pb(g.top_tokens[i]) if i < len(g.top_tokens) else ()
                entry.events.put_nowait(TokenEvent(entry.id, token.id, token.text, token.logprob, token.special, now,
                                                   top))
            if g.HasField("generated_text"):
                del entries[entry.id]
                self._finish(entry, FinalEvent.from_pb(entry.id, g.generated_text, input_length=entry.input_len,
                                                       prefill=entry.prefill))

    async def _filter(self, batch: pb.CachedBatch | None, entries: dict[int, Entry]) -> pb.CachedBatch | None:
        """Drop cancelled requests; FilterBatch when the shard's batch holds others, ClearCache when empty."""
        for entry in [e for e in entries.values() if e.cancelled]:
            del entries[entry.id]
            self._finish(entry, FinalEvent.failed(entry.id, "cancelled", cancelled=True))
        if batch is None:
            for entry in list(entries.values()):
                self._finish(entry, FinalEvent.failed(entry.id, "the shard dropped the batch without finishing it"))
            entries.clear()
            return None
        if not entries:
            await self._clear([batch.id], entries, "")
            return None
        if set(batch.request_ids) == set(entries):
            return batch
        try:
            self.calls["filter"] += 1
            return await self.client.filter_batch(batch.id, list(entries))
        except grpc.aio.AioRpcError as exc:
            await self._clear([batch.id], entries, f"FilterBatch failed: {exc.code().name}: {exc.details()}")
            return None

    async def _clear(self, batch_ids: list[int], entries: dict[int, Entry], error: str) -> None:
        for entry in list(entries.values()):
            self._finish(entry, FinalEvent.failed(entry.id, error or "cleared"))
        entries.clear()
        for batch_id in batch_ids:
            try:
                self.calls["clear"] += 1
                await self.client.clear_cache(batch_id)
            except grpc.aio.AioRpcError as exc:
                logger.warning("ClearCache({}) failed: {}", batch_id, exc.details())
        if error:
            logger.warning("batch(es) {} cleared: {}", batch_ids, error)

    def _finish(self, entry: Entry, event: FinalEvent) -> None:
        if entry.done:
            return
        entry.done = True
        self._running.pop(entry.id, None)
        if entry.allocation is not None:
            self.allocator.free(entry.allocation)
            entry.allocation = None
        entry.events.put_nowait(event)

    def _refuse(self, entry: Entry, error: str, *, refused: bool = True) -> Stream:
        self._finish(entry, FinalEvent.failed(entry.id, error, refused=refused))
        return Stream(entry)

    def _validate(self, entry: Entry) -> str | None:
        shard, cfg = self.shard, self.config
        n, new = entry.input_len, entry.params.max_new_tokens
        if new < 1:
            return "max_new_tokens must be at least 1"
        adapter = entry.params.adapter_id
        if adapter and adapter not in shard.info.lora_adapters:  # the shard would refuse it too (by request)
            return unknown_adapter_message(adapter, shard.info.lora_adapters)
        if n > shard.max_input_tokens:
            return f"{n} input tokens exceed max_input_tokens {shard.max_input_tokens}; shorten the prompt or set truncate"
        if n + new > shard.max_total_tokens:
            return f"{n} input tokens + max_new_tokens {new} exceed max_total_tokens {shard.max_total_tokens}"
        if not self.shard.info.support_chunking and n > cfg.max_batch_prefill_tokens:
            return f"{n} input tokens exceed max_batch_prefill_tokens {cfg.max_batch_prefill_tokens} (no chunking)"
        if self.allocator.blocks_for(entry.tokens_needed) > self.allocator.capacity:
            return f"needs {entry.tokens_needed} KV slots; the KV cache holds {self.allocator.capacity * self.allocator.block_size}"
        return None
