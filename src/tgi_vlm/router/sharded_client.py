"""TGI's sharded client (`backends/v3/src/client/sharded_client.rs`): every RPC goes to every rank,
and the answers are merged as TGI's router merges them.

Every rank of `serve --sharded` gets the same calls and keeps the same batches; each answers
Generations only for the requests it owns (`id % world_size == rank`). The rules, rank by rank
in the order ServiceDiscovery listed them (the last rank is the last url):

- Info, Health, FilterBatch: the last rank's answer (or its error); the others' are not looked at.
- ClearCache: every rank's; the first error in rank order is raised.
- Warmup: the smallest answer, comparing (max_supported_total_tokens, max_input_tokens,
  max_total_tokens) in that order with "not reported" below every number; the first error in
  rank order is raised.
- Prefill, Decode: the last rank's cached batch; Generations are the last rank's followed by the
  others' in rank order; the timings of the rank with the largest `total_ns`; the first error in
  rank order is raised.
- The liveness Prefill TGI's health check sends goes to every rank like any Prefill.

`connect()` asks rank 0 for every rank's url (ServiceDiscovery) and gives a plain `ShardClient`
when there is one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.router.client import ShardClient, liveness_batch, socket_url

T = TypeVar("T")
StepResponse = TypeVar("StepResponse", pb.PrefillResponse, pb.DecodeResponse)


class ShardedClient:
    """The ShardClient interface over several ranks (`clients[r]` talks to rank r)."""

    def __init__(self, clients: Sequence[ShardClient]):
        if not clients:
            raise ValueError("a sharded client needs at least one rank")
        self.clients = list(clients)
        self.url = self.clients[0].url

    async def close(self) -> None:
        await asyncio.gather(*(client.close() for client in self.clients))

    async def _every_rank(self, call: Callable[[ShardClient], Awaitable[T]]) -> list[T | BaseException]:
        """Each rank's answer or error, in rank order, once every rank has answered (TGI's join_all)."""
        return await asyncio.gather(*(call(client) for client in self.clients), return_exceptions=True)

    async def _all_succeed(self, call: Callable[[ShardClient], Awaitable[T]]) -> list[T]:
        results = await self._every_rank(call)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    async def _last(self, call: Callable[[ShardClient], Awaitable[T]]) -> T:
        result = (await self._every_rank(call))[-1]
        if isinstance(result, BaseException):
            raise result
        return result

    async def info(self) -> pb.InfoResponse:
        return await self._last(lambda c: c.info())

    async def health(self) -> pb.HealthResponse:
        return await self._last(lambda c: c.health())

    async def service_discovery(self) -> list[str]:
        return await self.clients[0].service_discovery()

    async def clear_cache(self, batch_id: int | None = None) -> None:
        await self._all_succeed(lambda c: c.clear_cache(batch_id))

    async def filter_batch(self, batch_id: int, request_ids: list[int]) -> pb.CachedBatch:
        return await self._last(lambda c: c.filter_batch(batch_id, request_ids))

    async def warmup(self, request: pb.WarmupRequest) -> pb.WarmupResponse:
        return min(await self._all_succeed(lambda c: c.warmup(request)), key=warmup_order)

    async def prefill(self, batch: pb.Batch, cached_batch: pb.CachedBatch | None = None) -> pb.PrefillResponse:
        return merge_steps(await self._all_succeed(lambda c: c.prefill(batch, cached_batch)))

    async def decode(self, batches: list[pb.CachedBatch]) -> pb.DecodeResponse:
        return merge_steps(await self._all_succeed(lambda c: c.decode(batches)))

    async def liveness(self) -> pb.PrefillResponse:
        return await self.prefill(liveness_batch())


def warmup_order(response: pb.WarmupResponse) -> tuple[int, int, int]:
    """Rust orders None before Some(_): a rank that reports no max_supported_total_tokens is the minimum."""
    supported = response.max_supported_total_tokens if response.HasField("max_supported_total_tokens") else -1
    return supported, response.max_input_tokens, response.max_total_tokens


def merge_steps(responses: list[StepResponse]) -> StepResponse:
    """The last rank's batch; its Generations, then the other ranks' in rank order; the slowest timings."""
    *others, last = responses
    merged = type(last)()
    merged.CopyFrom(last)
    for response in others:
        merged.generations.extend(response.generations)
    # TGI starts from the last rank and switches to a strictly slower one; max keeps the first of equals.
    slowest = max([last, *others], key=lambda r: r.total_ns)
    merged.forward_ns, merged.decode_ns, merged.total_ns = slowest.forward_ns, slowest.decode_ns, slowest.total_ns
    if slowest.HasField("concat_ns"):
        merged.concat_ns = slowest.concat_ns
    else:
        merged.ClearField("concat_ns")
    return merged


async def connect(path_or_url: str) -> ShardClient | ShardedClient:
    """Ask the shard at `path_or_url` (rank 0) for every rank's url, as TGI's router does at startup."""
    master = ShardClient(path_or_url)
    try:
        urls = await master.service_discovery()
    except BaseException:
        await master.close()
        raise
    if len(urls) <= 1:
        return master
    await master.close()
    return ShardedClient([ShardClient(socket_url(url)) for url in urls])
