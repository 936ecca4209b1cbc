"""An async client for one shard's unix socket: the eight v3 RPCs, message limits raised."""

from __future__ import annotations

import grpc

from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.pb import generate_pb2_grpc

MAX_MESSAGE_BYTES = 2**31 - 1  # images can be megabytes; TGI uses i32::MAX


def socket_url(path_or_url: str) -> str:
    return path_or_url if path_or_url.startswith("unix:") else f"unix://{path_or_url}"


class ShardClient:
    """Thin wrapper over the generated stub; every method is one unary call (errors: grpc.aio.AioRpcError)."""

    def __init__(self, path_or_url: str):
        self.url = socket_url(path_or_url)
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
        self.channel = grpc.aio.insecure_channel(self.url, options=options)
        self.stub = generate_pb2_grpc.TextGenerationServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def info(self) -> pb.InfoResponse:
        return await self.stub.Info(pb.InfoRequest())

    async def health(self) -> pb.HealthResponse:
        return await self.stub.Health(pb.HealthRequest())

    async def service_discovery(self) -> list[str]:
        return list((await self.stub.ServiceDiscovery(pb.ServiceDiscoveryRequest())).urls)

    async def clear_cache(self, batch_id: int | None = None) -> None:
        await self.stub.ClearCache(pb.ClearCacheRequest(id=batch_id))

    async def filter_batch(self, batch_id: int, request_ids: list[int]) -> pb.CachedBatch:
        return (await self.stub.FilterBatch(pb.FilterBatchRequest(batch_id=batch_id, request_ids=request_ids))).batch

    async def warmup(self, request: pb.WarmupRequest) -> pb.WarmupResponse:
        return await self.stub.Warmup(request)

    async def prefill(self, batch: pb.Batch, cached_batch: pb.CachedBatch | None = None) -> pb.PrefillResponse:
        return await self.stub.Prefill(pb.PrefillRequest(batch=batch, cached_batch=cached_batch))

    async def decode(self, batches: list[pb.CachedBatch]) -> pb.DecodeResponse:
        return await self.stub.Decode(pb.DecodeRequest(batches=batches))
