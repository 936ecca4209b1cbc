"""POST /v1/chat/completions, POST /v1/completions, GET /v1/models (TGI's OpenAI-compatible routes).

Chat: the messages go through the model's chat template (images as markdown), sent with
add_special_tokens=false; completions send true. Temperature 0 means greedy; no temperature means
sampling at 1 (TGI). presence_penalty p becomes repetition_penalty p + 2 (TGI). Streams end with
the literal `data: [DONE]`; errors inside a stream are OpenAI-style error events.

`tools` / `tool_choice` hold the reply to a call grammar and read it back as `tool_calls`
(api/tools.py, api/reply_stream.py); `n` runs n sequences of the prompt (api/infer.py `stream_many`),
choice i seeded `seed + i` when a seed is given.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tgi_vlm.api import openapi, sse
from tgi_vlm.api.disconnect import unless_disconnected
from tgi_vlm.api.errors import ApiError, tool_error
from tgi_vlm.api.grammar import response_format_grammar
from tgi_vlm.api.infer import StreamStep
from tgi_vlm.api.reply_stream import ReplyStream
from tgi_vlm.api.responses import OpenAiBodies, openai_finish_reason
from tgi_vlm.api.routes.generate import state_of
from tgi_vlm.api.schemas import ChatRequest, CompletionRequest, Parameters
from tgi_vlm.api.state import ApiState
from tgi_vlm.api.tools import ToolPlan, new_call_id, plan_tools, read_reply
from tgi_vlm.api.tools import finish_reason as tool_finish_reason
from tgi_vlm.router.requests import FinalEvent

router = APIRouter()


def sampling(temperature: float | None) -> dict:
    return {"do_sample": False, "temperature": None} if temperature == 0 else {"do_sample": True,
                                                                               "temperature": temperature}


def chat_parameters(body: ChatRequest, tools: ToolPlan | None) -> Parameters:
    grammar = response_format_grammar(body.response_format)  # None for no format and for {"type": "text"}
    if tools is not None and grammar is not None:
        raise tool_error("Grammar and tools are mutually exclusive: give `response_format` or `tools`, not both")
    return Parameters(
        repetition_penalty=None if body.presence_penalty is None else body.presence_penalty + 2.0,
        frequency_penalty=body.frequency_penalty, top_p=body.top_p, max_new_tokens=body.max_tokens,
        stop=body.stop or [], details=True, seed=body.seed, top_n_tokens=body.top_logprobs,
        grammar=tools.grammar() if tools is not None else grammar,
        **sampling(body.temperature),
    )


def sequence_seeds(seed: int | None, n: int) -> list[int | None]:
    """n sequences of one request: seed, seed + 1, ... when a seed is given (reproducible choices
    that differ), else a random seed each (as TGI draws one per sequence)."""
    return [None] * n if seed is None else [seed + i for i in range(n)]


def check_n(n: int, state: ApiState) -> None:
    if n > state.config.max_client_batch_size:
        raise ApiError(422, f"`n` = {n} exceeds the maximum allowed batch size of "
                            f"{state.config.max_client_batch_size} (--max-client-batch-size)", "batch size exceeded")


@router.post("/v1/chat/completions", responses=openapi.CHAT_RESPONSES)
async def chat_completions(body: ChatRequest, request: Request) -> Response:
    state = state_of(request)
    n = body.n or 1
    check_n(n, state)
    tools = plan_tools(body)
    inputs = state.chat_template.apply(body.messages, tools, body.tool_prompt)
    params = chat_parameters(body, tools)
    params.adapter_id = state.adapter_for(body.model) or None
    chat = ChatRun(state.openai_for(body.model), inputs, params, sequence_seeds(body.seed, n), bool(body.logprobs),
                   tools)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return sse.response(chat_events(chat, state, usage))
    generations, _ = await unless_disconnected(request, state.infer.generate_many(
        chat.inputs, chat.params, chat.seeds, add_special_tokens=False))
    replies = None if tools is None else [read_reply(g.final.text, new_call_id()) for g in generations]
    return JSONResponse(chat.bodies.chat_completion(generations, chat.logprobs, replies))


@dataclass(frozen=True)
class ChatRun:
    bodies: OpenAiBodies
    inputs: str
    params: Parameters
    seeds: list[int | None]
    logprobs: bool
    tools: ToolPlan | None


async def chat_events(chat: ChatRun, state: ApiState, usage: bool) -> AsyncIterator[bytes]:
    readers = [ReplyStream(new_call_id()) for _ in chat.seeds] if chat.tools is not None else None
    finals: list[FinalEvent] = []
    try:
        async with aclosing(state.infer.stream_many(chat.inputs, chat.params, chat.seeds, add_special_tokens=False,
                                                    stream=True)) as steps:
            async for index, step in steps:
                for chunk in chat_chunks(chat, index, step, readers):
                    yield sse.event(chunk)
                if step.final is not None:
                    finals.append(step.final)
        if usage and finals:
            yield sse.event(chat.bodies.chat_usage_chunk(finals))
    except ApiError as error:
        yield sse.event(error.openai_body())
    yield sse.DONE


def chat_chunks(chat: ChatRun, index: int, step: StreamStep, readers: list[ReplyStream] | None) -> list[dict]:
    """A step's chunks: its token's (free text), or the deltas a tool reply's text makes sendable."""
    bodies = chat.bodies
    if readers is None:
        return [bodies.chat_chunk(step.token, step.final, chat.logprobs, index)]
    reader = readers[index]
    deltas = reader.feed("" if step.token.special else step.token.text)
    chunks = [bodies.chat_chunk(step.token, None, chat.logprobs, index, delta) for delta in deltas]
    if step.final is not None:
        reason = tool_finish_reason(openai_finish_reason(step.final), read_reply(reader.text, reader.call_id))
        chunks.append(bodies.chat_chunk(step.token, step.final, False, index, reader.close(), reason))
    return chunks


def completion_parameters(body: CompletionRequest) -> Parameters:
    return Parameters(repetition_penalty=body.repetition_penalty, frequency_penalty=body.frequency_penalty,
                      top_p=body.top_p, max_new_tokens=body.max_tokens, stop=body.stop or [], details=True,
                      seed=body.seed, **sampling(body.temperature))


@router.post("/v1/completions", responses=openapi.COMPLETION_RESPONSES)
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = state_of(request)
    if body.suffix is not None:
        raise ApiError(422, "Suffix is not supported and can be achieved by preprocessing the prompt.",
                       "suffix not supported")
    prompts = body.prompts()
    n, limit = body.n or 1, state.config.max_client_batch_size
    if len(prompts) > limit:
        raise ApiError(422, f"Number of prompts exceeds the maximum allowed batch size of {limit}",
                       "batch size exceeded")
    check_n(n, state)
    if len(prompts) * n > limit:  # every prompt's n sequences run at once
        raise ApiError(422, f"{len(prompts)} prompts × `n` = {n} is {len(prompts) * n} sequences, which exceeds the "
                            f"maximum allowed batch size of {limit} (--max-client-batch-size)", "batch size exceeded")
    params, seeds = completion_parameters(body), sequence_seeds(body.seed, n)
    params.adapter_id = state.adapter_for(body.model) or None
    if body.stream:
        return sse.response(completion_events(state.openai_for(body.model), state, prompts, params, seeds))
    results = await unless_disconnected(request, asyncio.gather(
        *[state.infer.generate_many(p, params, seeds) for p in prompts]))
    return JSONResponse(state.openai_for(body.model).completion([generations for generations, _ in results]))


async def completion_events(bodies: OpenAiBodies, state: ApiState, prompts: list[str], params: Parameters,
                            seeds: list[int | None]) -> AsyncIterator[bytes]:
    """Every prompt's streams, interleaved as their tokens come (each chunk names its choice:
    prompt index × n + sequence index)."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()
    n = len(seeds)

    async def one(index: int, prompt: str) -> None:
        try:
            async with aclosing(state.infer.stream_many(prompt, params, seeds, stream=True)) as steps:
                async for sequence, step in steps:
                    await queue.put(sse.event(bodies.completion_chunk(index * n + sequence, step.token, step.final)))
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


@router.get("/v1/models", responses={200: {"model": openapi.ModelList, "description": "The one model served"}})
async def models(request: Request) -> JSONResponse:
    model_id = state_of(request).config.model_id
    return JSONResponse({"object": "list",
                         "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": model_id}]})
