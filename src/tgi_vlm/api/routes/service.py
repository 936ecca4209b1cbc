"""GET /info, /health (and GET /, /ping), /metrics; POST /tokenize."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from tgi_vlm import __version__
from tgi_vlm.api import metrics, openapi
from tgi_vlm.api.errors import unhealthy
from tgi_vlm.api.routes.generate import state_of
from tgi_vlm.api.schemas import GenerateRequest
from tgi_vlm.api.state import ApiState
from tgi_vlm.router.requests import RequestParams

router = APIRouter()


def info(state: ApiState) -> dict:
    """TGI's `Info` fields. The pipeline tag is the model's kind (TGI reads it from the hub)."""
    config = state.config
    return {
        "model_id": config.model_id,
        "model_sha": None,
        "model_pipeline_tag": "image-text-to-text" if state.takes_images else "text-generation",
        "max_concurrent_requests": config.max_concurrent_requests,
        "max_best_of": config.max_best_of,
        "max_stop_sequences": config.max_stop_sequences,
        "max_input_tokens": state.lengths.max_input_tokens,
        "max_total_tokens": state.lengths.max_total_tokens,
        "validation_workers": config.validation_workers,
        "max_client_batch_size": config.max_client_batch_size,
        "router": "tgi-vlm",
        "version": __version__,
        "sha": None,
        "docker_label": None,
        # tgi-vlm: the media kinds the model takes in prompts ([] for text-only; "video" for Qwen2-VL / 2.5-VL)
        "media": [kind.value for kind in state.counter.prompt.media_kinds] if state.takes_images else [],
        "lora_adapters": list(state.router.shard.info.lora_adapters),  # beyond TGI's Info: adapter_id values served
    }


@router.get("/info", responses={200: {"model": openapi.Info, "description": "What this server runs"}})
async def get_info(request: Request) -> JSONResponse:
    return JSONResponse(info(state_of(request)))


@router.get("/health", response_class=Response, responses=openapi.HEALTH_RESPONSES)
@router.get("/ping", response_class=Response, responses=openapi.HEALTH_RESPONSES)
@router.get("/", response_class=Response, responses=openapi.HEALTH_RESPONSES)
async def health(request: Request) -> Response:
    """200 with an empty body when the check passes, else 503 (TGI's body). The check is the shards'
    Health RPC, or after a failed generation the liveness Prefill (api/health.py)."""
    state = state_of(request)
    if not await state.infer.health.check(state.router.client):
        raise unhealthy()
    return Response(status_code=200)


@router.get("/metrics", response_class=PlainTextResponse, responses=openapi.METRICS_RESPONSES)
async def get_metrics(request: Request) -> Response:
    return Response(state_of(request).metrics.render(), media_type=metrics.CONTENT_TYPE)


@router.post("/tokenize", responses=openapi.TOKENIZE_RESPONSES)
async def tokenize(body: GenerateRequest, request: Request) -> JSONResponse:
    """Plain text: ids with character offsets. With images: the ids the shard will see (placeholders
    expanded by the processor), without offsets (start = stop = 0), as TGI answers without them."""
    state = state_of(request)
    if state.takes_images and ("![](" in body.inputs or "![video](" in body.inputs):
        chunks = await state.images.chunks(body.inputs, state.counter.prompt.media_kinds)
        ids = await state.infer.validator.input_ids(RequestParams(chunks))
        texts = state.counter.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse([{"id": i, "text": t, "start": 0, "stop": 0} for i, t in zip(ids, texts)])
    tokens = await asyncio.to_thread(state.counter.offsets, body.inputs)
    return JSONResponse([{"id": i, "text": body.inputs[a:b], "start": a, "stop": b} for i, a, b in tokens])
