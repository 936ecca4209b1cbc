"""Process lifecycle of one shard: load the model, bind the unix socket, serve until a signal.

The launcher polls for the socket file to know the shard is ready, so the socket is bound only
after the model is loaded. The socket is owner-only (0600): whoever can connect can run the model.
"""

from __future__ import annotations

import asyncio
import os
import signal
import stat
from collections.abc import Callable

import grpc
from loguru import logger

from tgi_vlm.config import ServerConfig
from tgi_vlm.models.types import ShardModel
from tgi_vlm.pb import generate_pb2_grpc
from tgi_vlm.server.service import TextGenerationService

ModelFactory = Callable[[ServerConfig], ShardModel]


def serve(config: ServerConfig, model_factory: ModelFactory) -> None:
    """Load the model, then serve on `unix://{uds}-{rank}` until SIGTERM/SIGINT (returns normally)."""
    if config.otlp_endpoint:
        setup_tracing(config.otlp_endpoint, config.otlp_service_name)
    model = model_factory(config)
    asyncio.run(_serve_until_signal(config, model))


async def start_server(config: ServerConfig, model: ShardModel) -> tuple[grpc.aio.Server, TextGenerationService]:
    """Bind and start the gRPC server for an already loaded model."""
    urls = [config.socket_url(rank) for rank in range(config.world_size)]
    service = TextGenerationService(model, urls)
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


async def _serve_until_signal(config: ServerConfig, model: ShardModel) -> None:
    server, service = await start_server(config, model)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
        logger.info("Signal received; no new calls, letting the in-flight one finish")
        await server.stop(config.shutdown_grace_s)
    finally:
        await asyncio.to_thread(service.close)
        _remove_socket(config.socket_path())
        logger.info("Server stopped")


def _remove_stale_socket(path: str) -> None:
    if not os.path.lexists(path):
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it (choose another --uds-path)")
    logger.warning("removing stale socket {}", path)
    os.unlink(path)


def _remove_socket(path: str) -> None:
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass


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
