"""An async client for one shard's unix socket: the eight v3 RPCs, message limits raised."""

from __future__ import annotations

import grpc

from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.pb import generate_pb2_grpc

MAX_MESSAGE_BYTES = 2**31 - 1  # images can be megabytes; TGI uses i32::MAX
LIVENESS_ID = 2**64 - 1  # u64::MAX, the request and batch id of TGI's liveness Prefill


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

    async def liveness(self) -> pb.PrefillResponse:
        """TGI's model health check: a one-token Prefill (`liveness_batch`)."""
        return await self.prefill(liveness_batch())


def liveness_batch() -> pb.Batch:
    """The request of TGI's `model_health`: id and batch id 2^64-1, one token in, one out, written to
    the reserved block 0 (slot 0); it finishes in its Prefill, so no batch stays cached."""
    request = pb.Request(
        id=LIVENESS_ID,
        inputs="liveness",
        input_chunks=pb.Input(chunks=[pb.InputChunk(text="liveness")]),
        truncate=1,
        add_special_tokens=False,
        parameters=pb.NextTokenChooserParameters(temperature=1.0, top_k=0, top_p=1.0, typical_p=1.0,
                                                 repetition_penalty=1.0),
        stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=1),
        blocks=[0],
        slots=[0],
    )
    return pb.Batch(id=LIVENESS_ID, requests=[request], size=1, max_tokens=2, max_blocks=1)
