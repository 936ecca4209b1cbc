"""A Python stand-in for TGI's v3 router, for `launch`, `generate`, the benchmarks (benchmarking/) and
end-to-end tests.

    allocator.py  BlockAllocator: blocks + slots per request, block 0 reserved (no prefix cache)
    prefix_cache.py  PrefixCache: cached prompt blocks keyed on ids + media, refcounts, LRU; PrefixStats
    client.py     ShardClient: the eight v3 RPCs over the unix socket (grpc.aio)
    sharded_client.py  ShardedClient: every RPC to every rank, merged as TGI's router; connect() via ServiceDiscovery
    tokens.py     TokenCounter: prompt lengths / ids + media spans from the shard's own processor code
    requests.py   RequestParams in; TokenEvent / FinalEvent out
    queue.py      waiting requests and the next-batch decision (budgets, chunk_len)
    router.py     Router: warmup and the continuous-batching loop
    warmup.py     the warmup request TGI's router sends
    shard.py      ShardProcess: start a shard's ranks as the launcher does, stop them with SIGTERM

    router = Router(ShardClient(socket), TokenCounter(model_dir).tokenize)
    task = asyncio.create_task(router.run())
    stream = await router.submit(RequestParams([png, "Describe."], max_new_tokens=32))
    async for event in stream: ...
"""

from tgi_vlm.router.allocator import Allocation, BlockAllocator
from tgi_vlm.router.client import ShardClient
from tgi_vlm.router.prefix_cache import PrefixCache, PrefixStats
from tgi_vlm.router.requests import Event, FinalEvent, RequestParams, TokenEvent
from tgi_vlm.router.router import Router, RouterConfig, ShardInfo, Stream
from tgi_vlm.router.shard import ShardProcess
from tgi_vlm.router.sharded_client import ShardedClient
from tgi_vlm.router.tokens import CountError, PromptTokens, TokenCounter

__all__ = [
    "Allocation",
    "BlockAllocator",
    "CountError",
    "Event",
    "FinalEvent",
    "PrefixCache",
    "PrefixStats",
    "PromptTokens",
    "RequestParams",
    "Router",
    "RouterConfig",
    "ShardClient",
    "ShardInfo",
    "ShardProcess",
    "ShardedClient",
    "Stream",
    "TokenCounter",
    "TokenEvent",
]
