"""A started router over a shard: spawned as the launcher would (`RouterConfig.num_shard` ranks), or an
existing socket; either way ServiceDiscovery on rank 0 finds every rank, as TGI's router does."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from tgi_vlm.config import InputLimits
from tgi_vlm.router.client import ShardClient
from tgi_vlm.router.router import Router, RouterConfig
from tgi_vlm.router.shard import ShardProcess
from tgi_vlm.router.sharded_client import ShardedClient, connect
from tgi_vlm.router.tokens import TokenCounter


@dataclass
class Session:
    router: Router
    counter: TokenCounter
    shard: ShardProcess | None  # None when we connected to a running shard
    socket: str


def existing_socket(uds_path: str | None) -> str | None:
    """`uds_path` itself when it is a socket, else the launcher's `{uds_path}-0`, else None."""
    if not uds_path:
        return None
    for candidate in (uds_path, f"{uds_path}-0"):
        if os.path.exists(candidate) and not os.path.isdir(candidate):
            return candidate
    return None


@asynccontextmanager
async def router_session(model_id: str, *, uds_path: str | None = None, shard_env: Mapping[str, str] | None = None,
                         shard_args: Sequence[str] = (), config: RouterConfig | None = None,
                         wrap_client: Callable[[ShardClient | ShardedClient], ShardClient] | None = None,
                         ) -> AsyncIterator[Session]:
    """Yield a warmed-up router whose loop is running; on exit stop it and SIGTERM the shard we started."""
    config = config or RouterConfig()
    # Loads while the shard starts; counts under the limits the shard reads from the same environment.
    limits = InputLimits.from_env(overrides=shard_env)
    counting = asyncio.create_task(asyncio.to_thread(TokenCounter, model_id, limits=limits))
    socket = existing_socket(uds_path)
    shard = None
    try:
        if socket is None:
            shard = ShardProcess(model_id, uds_path=uds_path, env=shard_env, extra_args=list(shard_args),
                                 num_shard=config.num_shard)
            await asyncio.to_thread(shard.start)
            socket = shard.socket
        counter = await counting
        client = await connect(socket)
    except BaseException:
        if shard is not None:
            await asyncio.to_thread(shard.stop)
        raise
    if wrap_client is not None:
        client = wrap_client(client)
    # Prefix caching keys prompts on ids + media (`tokenize`, which also runs the processor per image);
    # without it the length is enough (`count`).
    router = Router(client, counter.tokenize if config.prefix_caching else counter.count, config)
    task = None
    try:
        await router.start()
        task = asyncio.create_task(router.run())
        yield Session(router, counter, shard, socket)
    finally:
        router.stop()
        if task is not None:
            await task
        await client.close()
        if shard is not None:
            await asyncio.to_thread(shard.stop)
