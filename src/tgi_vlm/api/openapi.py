"""What /openapi.json promises, route by route: every status the server can answer, with the
content type and body it answers with (tests/unit/test_openapi_conformance.py holds the server to it).

Only the documentation uses these models; handlers build their bodies as dicts (responses.py).
Common to every POST route: 400 (a body that is not JSON), 413 (past --payload-limit), 422 (a body
that does not deserialize, or validation), all `{"error", "error_type"}`; 401 with an empty body
when --api-key is set. Streams answer `text/event-stream`; errors found after the 200 are events.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorBody(BaseModel):
    error: str
    error_type: str


class Token(BaseModel):
    id: int
    text: str
    logprob: float | None
    special: bool


class PrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None


class SequenceDetails(BaseModel):
    """What TGI's `Details` and `BestOfSequence` share (documentation only: properties are not ordered here)."""

    finish_reason: str
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = None


class BestOfSequence(SequenceDetails):
    generated_text: str


class Details(SequenceDetails):
    best_of_sequences: list[BestOfSequence] | None = None


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None


class TokenizedToken(BaseModel):
    id: int
    text: str
    start: int
    stop: int


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: str
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: str
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None
    finish_reason: str


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _OpenAiHead(BaseModel):
    object: str
    id: str
    created: int
    model: str
    system_fingerprint: str


class ChatCompletion(_OpenAiHead):
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Any = None
    finish_reason: str


class Completion(_OpenAiHead):
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


class Info(BaseModel):
    model_id: str
    model_sha: str | None
    model_pipeline_tag: str | None
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_input_tokens: int
    max_total_tokens: int
    validation_workers: int
    max_client_batch_size: int
    router: str
    version: str
    sha: str | None
    docker_label: str | None


def _error(description: str) -> dict:
    return {"model": ErrorBody, "description": description}


EVENT_STREAM = {"text/event-stream": {"schema": {"type": "string", "description": "server-sent events, `data: <json>`"}}}
_UNAUTHORIZED = {"description": "--api-key is set and the bearer token is missing or wrong (empty body)",
                 "content": {"text/plain": {"schema": {"type": "string", "maxLength": 0}}}}
_BODY_ERRORS = {
    400: _error("The body is not JSON"),
    401: _UNAUTHORIZED,
    413: _error("The body is past --payload-limit"),
    422: _error("The body does not deserialize, or a parameter is invalid (TGI's validation error)"),
}
_GENERATION_ERRORS = {
    **_BODY_ERRORS,
    424: _error("Generation failed in the shard"),
    429: _error("Past --max-concurrent-requests"),
    500: _error("Incomplete generation"),
}


def _with_stream(model: type[BaseModel], description: str) -> dict:
    return {"model": model, "description": description, "content": EVENT_STREAM}


GENERATE_RESPONSES: dict[int | str, dict] = {200: {"model": GenerateResponse, "description": "The generated text"},
                                             **_GENERATION_ERRORS}
_ERROR_JSON = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
STREAM_RESPONSES: dict[int | str, dict] = {
    200: {"description": "Tokens as server-sent events (errors too, as events)", "content": EVENT_STREAM},
    # a stream route's own media type is text/event-stream: its JSON errors are spelled out
    **{status: {"description": r["description"], "content": _ERROR_JSON} if "model" in r else r
       for status, r in _BODY_ERRORS.items()},
}
COMPAT_RESPONSES: dict[int | str, dict] = {
    200: _with_stream(list[GenerateResponse], "A one-element list, or with `stream` server-sent events"),
    **_GENERATION_ERRORS}
CHAT_RESPONSES: dict[int | str, dict] = {
    200: _with_stream(ChatCompletion, "The completion, or with `stream` its chunks as server-sent events"),
    **_GENERATION_ERRORS}
COMPLETION_RESPONSES: dict[int | str, dict] = {
    200: _with_stream(Completion, "The completions, or with `stream` their chunks as server-sent events"),
    **_GENERATION_ERRORS}
TOKENIZE_RESPONSES: dict[int | str, dict] = {200: {"model": list[TokenizedToken], "description": "The prompt's tokens"},
                                             **_BODY_ERRORS}
HEALTH_RESPONSES: dict[int | str, dict] = {200: {"description": "Healthy (empty body)"},
                                           503: _error("The shard does not answer")}
METRICS_RESPONSES: dict[int | str, dict] = {
    200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}}
