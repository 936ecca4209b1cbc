"""A real grpc.aio server on a short unix socket, driving a FakeModel."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc

from tgi_vlm.config import ServerConfig
from tgi_vlm.distributed import ShardGroup
from tgi_vlm.pb import generate_pb2, generate_pb2_grpc
from tgi_vlm.server.serve import start_server
from tgi_vlm.server.service import TextGenerationService


@dataclass
class Shard:
    stub: generate_pb2_grpc.TextGenerationServiceStub
    service: TextGenerationService
    config: ServerConfig


@asynccontextmanager
async def running_shard(model, world_size: int = 1, rank: int = 0) -> AsyncIterator[Shard]:
    """One rank's server (rank `rank` of `world_size`; no process group: the fake model needs none)."""
    directory = tempfile.mkdtemp(dir="/tmp", prefix="tv-")  # unix socket paths must stay short
    config = ServerConfig(model_id="fake", uds_path=f"{directory}/s", world_size=world_size, rank=rank,
                          sharded=world_size > 1)
    server, service = await start_server(config, model, ShardGroup(rank, world_size))
    channel = grpc.aio.insecure_channel(config.socket_url())
    try:
        yield Shard(generate_pb2_grpc.TextGenerationServiceStub(channel), service, config)
    finally:
        await channel.close()
        await server.stop(None)
        service.close()
        shutil.rmtree(directory, ignore_errors=True)


def run(scenario: Callable[[], Awaitable[None]], timeout: float = 30.0) -> None:
    asyncio.run(asyncio.wait_for(scenario(), timeout))


def make_batch(batch_id: int, request_ids: list[int], max_new_tokens: int = 3, inputs: str = "hi") -> generate_pb2.Batch:
    requests = [
        generate_pb2.Request(
            id=rid, inputs=inputs, truncate=100,
            stopping_parameters=generate_pb2.StoppingCriteriaParameters(max_new_tokens=max_new_tokens),
        )
        for rid in request_ids
    ]
    return generate_pb2.Batch(id=batch_id, requests=requests, size=len(requests), max_tokens=100)


def cached(batch_id: int) -> generate_pb2.CachedBatch:
    return generate_pb2.CachedBatch(id=batch_id)


async def rpc_error(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    """Await a call that must fail; return its error."""
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the call succeeded")
