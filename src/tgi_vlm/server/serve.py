"""Process lifecycle of one shard: join the shard group, load the model, bind the unix socket,
serve until a signal (or, sharded, until another rank leaves).

The launcher polls for the socket file to know the shard is ready, so the socket is bound only
after the model is loaded. The socket is owner-only (0600): whoever can connect can run the model.

Sharded (`--sharded`, WORLD_SIZE > 1): the process group is joined before loading (the model's
weights and collectives need it) and left at exit. A rank whose peer has left cannot serve (every
forward needs every rank), so it stops as well (`peers.py`). On the way out a rank removes its
socket first, which is how its peers tell an orderly exit from a crash. The in-flight call gets
`shutdown_grace_s`; a sharded model thread still busy after a second grace is taken to be blocked
in a collective whose peer has gone (NCCL waits for its own timeout; gloo fails at once), and the
process is ended without waiting for it (`ModelThreadBusy`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import stat
from collections.abc import Callable

import grpc
import torch.distributed as dist
from loguru import logger

from tgi_vlm import distributed
from tgi_vlm.config import ServerConfig
from tgi_vlm.distributed import ShardGroup
from tgi_vlm.models.types import ShardModel
from tgi_vlm.pb import generate_pb2_grpc
from tgi_vlm.server.peers import PeerGone, PeerWatch
from tgi_vlm.server.service import TextGenerationService
from tgi_vlm.sockets import remove_socket

ModelFactory = Callable[[ServerConfig], ShardModel]


class PeerLost(RuntimeError):
    """Another rank died while this one served; the shard stopped (exit code 1)."""


class ModelThreadBusy(RuntimeError):
    """The model thread did not finish its work within the grace period after the server stopped.
    The thread cannot be interrupted, so the process must end without waiting for it."""


def serve(config: ServerConfig, model_factory: ModelFactory) -> None:
    """Load the model, then serve on `unix://{uds}-{rank}` until SIGTERM/SIGINT (returns normally)
    or, sharded, until another rank leaves: in order (returns normally) or by dying (PeerLost)."""
    if config.otlp_endpoint:
        setup_tracing(config.otlp_endpoint, config.otlp_service_name)
    group = distributed.initialize(config.rank, config.world_size, config.master_addr, config.master_port,
                                   config.engine.device, timeout_s=config.dist_timeout_s)
    leave = True
    try:
        model = model_factory(config)
        if config.engine.device.startswith("cpu"):  # the model thread runs it from here on (see release_openmp_threads)
            from tgi_vlm.layers.cpu import release_openmp_threads

            release_openmp_threads()
        asyncio.run(_serve_until_stopped(config, model, group))
    except ModelThreadBusy:
        leave = False  # destroying the group could wait on the very collective the thread is stuck in
        raise
    finally:
        if leave and dist.is_initialized():
            dist.destroy_process_group()
            logger.info("rank {} left the process group", group.rank)


async def start_server(config: ServerConfig, model: ShardModel,
                       group: ShardGroup | None = None) -> tuple[grpc.aio.Server, TextGenerationService]:
    """Bind and start the gRPC server for an already loaded model."""
    urls = [config.socket_url(rank) for rank in range(config.world_size)]
    service = TextGenerationService(model, urls, group=group)
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
    ]
    server = grpc.aio.server(options=options)
    generate_pb2_grpc.add_TextGenerationServiceServicer_to_server(service, server)
    path = config.socket_path()
    _remove_stale_socket(path)
    previous_umask = os.umask(0o177)  # no window in which the socket is group/world accessible
    try:
        server.add_insecure_port(config.socket_url())
    finally:
        os.umask(previous_umask)
    await server.start()
    os.chmod(path, 0o600)
    logger.info("Server started at {}", config.socket_url())
    return server, service


async def _serve_until_stopped(config: ServerConfig, model: ShardModel, group: ShardGroup) -> None:
    server, service = await start_server(config, model, group)
    gone = None
    try:
        gone = await _wait_for_stop(config, group)
        # Removed first: peers watching this socket see an orderly exit, and no new client connects.
        remove_socket(config.socket_path())
        if gone is None:
            logger.info("Signal received; no new calls, letting the in-flight one finish")
        else:
            logger.warning("{}; a sharded model needs every rank, so rank {} stops too", gone, group.rank)
        await server.stop(config.shutdown_grace_s)
    finally:
        finished = await asyncio.to_thread(service.close, config.shutdown_grace_s if group.sharded else None)
        remove_socket(config.socket_path())
        if not finished:
            raise ModelThreadBusy(f"rank {group.rank}: the model thread is still busy {config.shutdown_grace_s:g} s "
                                  "after the server stopped (blocked in a collective with a rank that left?)")
        logger.info("Server stopped")
    if gone is not None and not gone.in_order:
        raise PeerLost(f"rank {group.rank} stopped: {gone}")


async def _wait_for_stop(config: ServerConfig, group: ShardGroup) -> PeerGone | None:
    """Until SIGTERM/SIGINT (None) or, sharded, until another rank leaves (which one, and how)."""
    signalled = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, signalled.set)
    waiters = {asyncio.create_task(signalled.wait())}
    if group.sharded:
        peers = {rank: config.socket_path(rank) for rank in range(group.world_size) if rank != group.rank}
        waiters.add(asyncio.create_task(PeerWatch(peers).until_one_leaves()))
    done, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    results = [task.result() for task in done]
    return None if signalled.is_set() else next(r for r in results if isinstance(r, PeerGone))


def _remove_stale_socket(path: str) -> None:
    if not os.path.lexists(path):
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it (choose another --uds-path)")
    logger.warning("removing stale socket {}", path)
    os.unlink(path)



def setup_tracing(endpoint: str, service_name: str) -> None:
    """Export spans over OTLP/gRPC when the optional SDK is installed (extra `otel`)."""
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        logger.warning("--otlp-endpoint {} ignored: opentelemetry-sdk and its OTLP exporter are not installed "
                       "(pip install 'tgi-vlm[otel]')", endpoint)
        return
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    trace.set_tracer_provider(provider)
    logger.info("exporting traces to {} as {}", endpoint, service_name)
