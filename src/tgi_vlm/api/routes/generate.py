"""POST /generate, /generate_stream and / (TGI's compat route: `stream` chooses, the answer is a list)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tgi_vlm.api import openapi, sse
from tgi_vlm.api.disconnect import unless_disconnected
from tgi_vlm.api.errors import ApiError
from tgi_vlm.api.infer import Generation
from tgi_vlm.api.responses import best_of as best_of_index
from tgi_vlm.api.responses import generate_response, stream_response
from tgi_vlm.api.schemas import CompatGenerateRequest, GenerateRequest
from tgi_vlm.api.state import ApiState
from tgi_vlm.api.validation import ValidRequest

router = APIRouter()


def state_of(request: Request) -> ApiState:
    return request.app.state.api


@router.post("/generate", responses=openapi.GENERATE_RESPONSES)
async def generate(body: GenerateRequest, request: Request) -> JSONResponse:
    response, valid, chosen = await generated(state_of(request), body, request)
    headers = {"x-prompt-tokens": str(valid.input_length), "x-generated-tokens": str(chosen.final.generated_tokens)}
    return JSONResponse(response, headers=headers)


async def generated(state: ApiState, body: GenerateRequest, request: Request) -> tuple[dict, ValidRequest, Generation]:
    """TGI's GenerateResponse (and the sequence it reports); `best_of` > 1 samples that many sequences
    (the prompt computed once) and answers with the best by TGI's rule, the others in
    `details.best_of_sequences`."""
    best_of = body.parameters.best_of or 1
    if best_of <= 1:
        generation, valid = await unless_disconnected(request, state.infer.generate(body.inputs, body.parameters))
        return generate_response(generation, valid), valid, generation
    state.infer.validator.check_best_of(best_of)
    generations, valid = await unless_disconnected(
        request, state.infer.generate_many(body.inputs, body.parameters, [None] * best_of))
    chosen = best_of_index(generations)
    others = [g for i, g in enumerate(generations) if i != chosen]
    return generate_response(generations[chosen], valid, others), valid, generations[chosen]


@router.post("/generate_stream", response_class=sse.EventStream, responses=openapi.STREAM_RESPONSES)
async def generate_stream(body: GenerateRequest, request: Request) -> Response:
    return sse.response(tgi_events(state_of(request), body))


@router.post("/", responses=openapi.COMPAT_RESPONSES)
async def compat_generate(body: CompatGenerateRequest, request: Request) -> Response:
    state = state_of(request)
    if body.parameters.return_full_text is None:
        # TGI's default from the hub pipeline tag: full text for "text-generation" models only
        body.parameters.return_full_text = not state.takes_images
    if body.stream:
        return sse.response(tgi_events(state, body))
    response, _, _ = await generated(state, body, request)
    return JSONResponse([response])


async def tgi_events(state: ApiState, body: GenerateRequest) -> AsyncIterator[bytes]:
    """TGI's stream: one event per token, the last with generated_text (and details); errors as events."""
    try:
        async with aclosing(state.infer.stream(body.inputs, body.parameters)) as steps:
            async for step in steps:
                yield sse.event(stream_response(step.index, step.token, step.final, step.valid))
    except ApiError as error:
        yield sse.event(error.body())
