"""POST /v1/chat/completions, POST /v1/completions, GET /v1/models (TGI's OpenAI-compatible routes).

Chat: the messages go through the model's chat template (images as markdown), sent with
add_special_tokens=false; completions send true. Temperature 0 means greedy; no temperature means
sampling at 1 (TGI). presence_penalty p becomes repetition_penalty p + 2 (TGI). Streams end with
the literal `data: [DONE]`; errors inside a stream are OpenAI-style error events.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tgi_vlm.api import sse
from tgi_vlm.api.disconnect import unless_disconnected
from tgi_vlm.api.errors import ApiError, tool_error
from tgi_vlm.api.grammar import response_format_grammar
from tgi_vlm.api.responses import OpenAiBodies
from tgi_vlm.api.routes.generate import state_of
from tgi_vlm.api.schemas import ChatRequest, CompletionRequest, Parameters
from tgi_vlm.api.state import ApiState

router = APIRouter()


def sampling(temperature: float | None) -> dict:
    return {"do_sample": False, "temperature": None} if temperature == 0 else {"do_sample": True,
                                                                               "temperature": temperature}


def chat_parameters(body: ChatRequest) -> Parameters:
    return Parameters(
        repetition_penalty=None if body.presence_penalty is None else body.presence_penalty + 2.0,
        frequency_penalty=body.frequency_penalty, top_p=body.top_p, max_new_tokens=body.max_tokens,
        stop=body.stop or [], details=True, seed=body.seed, top_n_tokens=body.top_logprobs,
        grammar=response_format_grammar(body.response_format), **sampling(body.temperature),
    )


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request) -> Response:
    state = state_of(request)
    if body.tools:
        raise tool_error("tools are not supported (tool calls need grammar-constrained generation)")
    inputs = state.chat_template.apply(body.messages)
    params = chat_parameters(body)
    params.adapter_id = state.adapter_for(body.model) or None
    logprobs = bool(body.logprobs)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return sse.response(chat_events(state.openai_for(body.model), state, inputs, params, logprobs, usage))
    generation, _ = await unless_disconnected(request, state.infer.generate(inputs, params, add_special_tokens=False))
    return JSONResponse(state.openai_for(body.model).chat_completion(generation, logprobs))


async def chat_events(bodies: OpenAiBodies, state: ApiState, inputs: str, params: Parameters, logprobs: bool,
                      usage: bool) -> AsyncIterator[bytes]:
    try:
        async with aclosing(state.infer.stream(inputs, params, add_special_tokens=False)) as steps:
            async for step in steps:
                yield sse.event(bodies.chat_chunk(step.token, step.final, logprobs))
                if step.final is not None and usage:
                    yield sse.event(bodies.chat_usage_chunk(step.final))
    except ApiError as error:
        yield sse.event(error.openai_body())
    yield sse.DONE


def completion_parameters(body: CompletionRequest) -> Parameters:
    return Parameters(repetition_penalty=body.repetition_penalty, frequency_penalty=body.frequency_penalty,
                      top_p=body.top_p, max_new_tokens=body.max_tokens, stop=body.stop or [], details=True,
                      seed=body.seed, **sampling(body.temperature))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = state_of(request)
    if body.suffix is not None:
        raise ApiError(422, "Suffix is not supported and can be achieved by preprocessing the prompt.",
                       "suffix not supported")
    prompts = body.prompts()
    if len(prompts) > state.config.max_client_batch_size:
        raise ApiError(422, "Number of prompts exceeds the maximum allowed batch size of "
                            f"{state.config.max_client_batch_size}", "batch size exceeded")
    params = completion_parameters(body)
    params.adapter_id = state.adapter_for(body.model) or None
    if body.stream:
        return sse.response(completion_events(state.openai_for(body.model), state, prompts, params))
    results = await unless_disconnected(request, asyncio.gather(*[state.infer.generate(p, params) for p in prompts]))
    return JSONResponse(state.openai_for(body.model).completion([generation for generation, _ in results]))


async def completion_events(bodies: OpenAiBodies, state: ApiState, prompts: list[str],
                            params: Parameters) -> AsyncIterator[bytes]:
    """Every prompt's stream, interleaved as their tokens come (each chunk names its prompt's index)."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def one(index: int, prompt: str) -> None:
        try:
            async with aclosing(state.infer.stream(prompt, params)) as steps:
                async for step in steps:
                    await queue.put(sse.event(bodies.completion_chunk(index, step.token, step.final)))
        except ApiError as error:
            await queue.put(sse.event(error.openai_body()))
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
    try:
        for _ in tasks:
            while (item := await queue.get()) is not None:
                yield item
        yield sse.DONE
    finally:
        for task in tasks:
            task.cancel()  # the client went away: cancelling a task closes its stream, which cancels it


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    model_id = state_of(request).config.model_id
    return JSONResponse({"object": "list",
                         "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": model_id}]})
