"""POST /generate, /generate_stream and / (TGI's compat route: `stream` chooses, the answer is a list)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tgi_vlm.api import sse
from tgi_vlm.api.disconnect import unless_disconnected
from tgi_vlm.api.errors import ApiError
from tgi_vlm.api.responses import generate_response, stream_response
from tgi_vlm.api.schemas import CompatGenerateRequest, GenerateRequest
from tgi_vlm.api.state import ApiState

router = APIRouter()


def state_of(request: Request) -> ApiState:
    return request.app.state.api


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> JSONResponse:
    state = state_of(request)
    generation, valid = await unless_disconnected(request, state.infer.generate(body.inputs, body.parameters))
    headers = {"x-prompt-tokens": str(valid.input_length), "x-generated-tokens": str(generation.final.generated_tokens)}
    return JSONResponse(generate_response(generation, valid), headers=headers)


@router.post("/generate_stream")
async def generate_stream(body: GenerateRequest, request: Request) -> Response:
    return sse.response(tgi_events(state_of(request), body))


@router.post("/")
async def compat_generate(body: CompatGenerateRequest, request: Request) -> Response:
    state = state_of(request)
    if body.parameters.return_full_text is None:
        # TGI's default from the hub pipeline tag: full text for "text-generation" models only
        body.parameters.return_full_text = not state.takes_images
    if body.stream:
        return sse.response(tgi_events(state, body))
    generation, valid = await unless_disconnected(request, state.infer.generate(body.inputs, body.parameters))
    return JSONResponse([generate_response(generation, valid)])


async def tgi_events(state: ApiState, body: GenerateRequest) -> AsyncIterator[bytes]:
    """TGI's stream: one event per token, the last with generated_text (and details); errors as events."""
    try:
        async with aclosing(state.infer.stream(body.inputs, body.parameters)) as steps:
            async for step in steps:
                yield sse.event(stream_response(step.index, step.token, step.final, step.valid))
    except ApiError as error:
        yield sse.event(error.body())
