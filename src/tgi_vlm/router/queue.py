"""Waiting requests and the next-batch decision (TGI v3's `Queue::next_batch`).

A request enters a batch only with its KV blocks allocated. Prefill tokens (prompt minus the
cached prefix the allocator found, `cache_len`) are bounded by the budget; with chunking, the
request that crosses it joins with `chunk_len` = what is left of the budget (the shard prefills the
rest in later steps), otherwise it waits.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass, field

from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.router.allocator import Allocation, BlockAllocator, PromptBlocks, tokens_to_reserve
from tgi_vlm.router.requests import Event, FinalEvent, RequestParams, Token


@dataclass(eq=False)
class Entry:
    """One request's router-side state, from submit until its final event."""

    id: int
    params: RequestParams
    input_len: int
    submitted: float
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    prompt: PromptBlocks | None = None  # block keys for the prefix cache; None: no lookup, no insert
    allocation: Allocation | None = None
    chunk_len: int | None = None
    speculate: int = 0  # the shard's Info.speculate: TGI's router reserves that many more slots
    prompt_cached: bool = False  # its prompt blocks were offered to the prefix cache (first token received)
    cancelled: bool = False
    done: bool = False
    prefill: tuple[Token, ...] = ()  # prompt tokens with logprobs, once the shard sent them

    @property
    def tokens_needed(self) -> int:
        return tokens_to_reserve(self.input_len, self.params.max_new_tokens, self.speculate)

    def to_pb(self) -> pb.Request:
        return self.params.to_pb(self.id, self.allocation, self.chunk_len)


@dataclass
class NextBatch:
    entries: dict[int, Entry]
    batch: pb.Batch


class Queue:
    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self.waiting: deque[Entry] = deque()
        self._next_batch_id = 1

    def __len__(self) -> int:
        return len(self.waiting)

    def append(self, entry: Entry) -> None:
        self.waiting.append(entry)

    def push_front(self, entry: Entry) -> None:
        """Back to the head of the queue (a request the shard refused to take from the cache)."""
        self.waiting.appendleft(entry)

    def remove(self, entry: Entry) -> bool:
        try:
            self.waiting.remove(entry)
        except ValueError:
            return False
        return True

    def next_batch(self, *, min_size: int | None, max_size: int | None, prefill_budget: int,
                   chunking: bool) -> NextBatch | None:
        if not self.waiting or (min_size and len(self.waiting) < min_size) or (max_size is not None and max_size <= 0):
            return None
        chosen: list[Entry] = []
        prefill_tokens = 0
        while self.waiting:
            entry = self.waiting[0]
            room = prefill_budget - prefill_tokens
            to_prefill = entry.input_len - self.allocator.cache_len(entry.prompt)
            if to_prefill > room and (not chunking or room <= 0):
                break
            entry.allocation = self.allocator.allocate(entry.tokens_needed, entry.prompt)
            if entry.allocation is None:
                break
            self.waiting.popleft()
            chosen.append(entry)
            if to_prefill > room:  # chunking: prefill what fits now, the shard does the rest
                entry.chunk_len = room
                break
            prefill_tokens += to_prefill
            if max_size is not None and len(chosen) >= max_size:
                break
        if not chosen or (min_size and len(chosen) < min_size):
            self._put_back(chosen)
            return None
        return NextBatch({e.id: e for e in chosen}, self._batch(chosen))

    def _put_back(self, entries: list[Entry]) -> None:
        for entry in reversed(entries):
            self.allocator.free(entry.allocation)
            entry.allocation, entry.chunk_len = None, None
            self.waiting.appendleft(entry)

    def _batch(self, entries: list[Entry]) -> pb.Batch:
        batch_id = self._next_batch_id
        self._next_batch_id += 1
        requests = [e.to_pb() for e in entries]
        return pb.Batch(
            id=batch_id,
            requests=requests,
            size=len(requests),
            max_tokens=sum(e.input_len + e.params.max_new_tokens for e in entries),
            max_blocks=sum(len(e.allocation.blocks) for e in entries),
        )

    def fail_all(self, error: str) -> None:
        while self.waiting:
            entry = self.waiting.popleft()
            entry.done = True
            entry.events.put_nowait(FinalEvent.failed(entry.id, error))


def min_batch_size(batch_size: int, waiting_served_ratio: float) -> int:
    return math.floor(batch_size * waiting_served_ratio)
