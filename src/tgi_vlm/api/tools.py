"""Chat `tools` / `tool_choice`: which tools a request offers, the grammar its reply must follow,
and the reply read back into OpenAI's `tool_calls`.

The model writes one JSON object, held to it by the shard's grammar engine:
- a call: `{"name": NAME, "arguments": ARGS}` (`name` first, then `arguments`, the engine keeps the
  schema's property order), ARGS following that function's `parameters` schema;
- under `auto` only, plain content: `{"content": TEXT}`.
`required` allows a call to any offered function, a named choice a call to that one, `auto` either
a call or content, `none` (the default without tools) no grammar at all. `auto` is a grammar
rather than TGI's synthetic `no_tool` function or vLLM's per-model parsers: an output that cannot
be read back is impossible, and the content branch is returned as ordinary `message.content`.

`arguments` is returned as the JSON text the model generated (a string, as OpenAI's SDK expects),
cut from the output, so a streamed call's `arguments` fragments concatenate to exactly the
non-streamed string. A reply cut short is read by the same rule streamed or not (`read_reply`): a
started call is reported with its partial `arguments` and the generation's finish_reason.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from tgi_vlm.api.errors import tool_error, validation_error
from tgi_vlm.api.grammar import check_schema
from tgi_vlm.api.schemas import ChatRequest, NamedToolChoice, Tool

EMPTY_PARAMETERS = {"type": "object", "properties": {}}
CONTENT_SCHEMA = {"type": "object", "properties": {"content": {"type": "string"}}, "required": ["content"],
                  "additionalProperties": False}
# Our words (TGI's `tool_prompt` default says the same in its own): what the model is asked to write.
CALL_PROMPT = ('Call one of the functions above: reply with a single JSON object {"name": <function name>, '
               '"arguments": <an object of its arguments>} and nothing else.')
AUTO_PROMPT = ('Either call one of the functions above with a single JSON object {"name": <function name>, '
               '"arguments": <an object of its arguments>}, or answer directly with {"content": <your answer>}.')
CALL_HEAD = re.compile(r' ?\{ ?"name" ?: ?"((?:[^"\\]|\\.)*)" ?, ?"arguments" ?: ?')
CONTENT_HEAD = re.compile(r' ?\{ ?"content" ?: ?"')


@dataclass(frozen=True)
class ToolPlan:
    """What a request with tools asks of its reply."""

    choice: str  # "auto" | "required" | "function"
    tools: list[Tool]  # the functions shown to the template: all of them, or the named one
    schema: dict  # the reply's JSON Schema

    def grammar(self) -> dict:
        return {"type": "json", "value": self.schema}

    def prompt(self, tool_prompt: str | None) -> str:
        return tool_prompt or (AUTO_PROMPT if self.choice == "auto" else CALL_PROMPT)


def plan_tools(body: ChatRequest) -> ToolPlan | None:
    """None when the reply is free text (no tools, or `tool_choice: "none"`); 422 on bad tools.
    Without tools `tool_choice` is ignored, whatever it names (TGI applies it only to tools given)."""
    tools = body.tools or []
    if not tools:
        return None
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        choice = NamedToolChoice(function={"name": choice})  # TGI takes a bare function name
    if choice == "none":
        return None
    _check_tools(tools)
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise tool_error(f"Tool with name {choice.function.name} not found (offered: "
                             f"{', '.join(t.function.name for t in tools)})")
        return ToolPlan("function", chosen, call_schema(chosen[0]))  # TGI shows the template this one only
    calls = [call_schema(t) for t in tools]
    branches = [*calls, CONTENT_SCHEMA] if choice == "auto" else calls
    return ToolPlan(choice, tools, branches[0] if len(branches) == 1 else {"anyOf": branches})


def _check_tools(tools: list[Tool]) -> None:
    seen: set[str] = set()
    for tool in tools:
        name = tool.function.name
        if name in seen:
            raise tool_error(f"function name {name} is given twice")
        seen.add(name)
        parameters = tool.function.parameters
        if parameters is not None and parameters.get("type", "object") != "object":
            raise validation_error(f"grammar is not valid: Invalid schema for function '{name}': `parameters` "
                                   f"must be an object schema, got type {parameters.get('type')!r}")
        check_schema(parameters or EMPTY_PARAMETERS, f"Invalid schema for function '{name}'",
                     strict=bool(tool.function.strict))


def call_schema(tool: Tool) -> dict:
    return {"type": "object",
            "properties": {"name": {"const": tool.function.name}, "arguments": tool.function.parameters or EMPTY_PARAMETERS},
            "required": ["name", "arguments"], "additionalProperties": False}


def template_tools(tools: list[Tool]) -> list[dict]:
    """The tools as chat templates take them (OpenAI's shape, `parameters` named so)."""
    return [{"type": "function", "function": {"name": t.function.name, "description": t.function.description or "",
                                              "parameters": t.function.parameters or EMPTY_PARAMETERS}}
            for t in tools]


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tool_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass(frozen=True)
class Reply:
    content: str | None
    tool_calls: list[dict] | None
    complete: bool = True  # False: a call whose `arguments` were cut short


def read_reply(text: str, call_id: str) -> Reply:
    """The generated text (whole or cut short by `max_tokens` / a stop sequence) as OpenAI's message,
    by one rule that api/reply_stream.py follows token by token, so both agree on every prefix:
    - once the name and `"arguments":` are out, a call, its `arguments` the JSON text so far
      (`complete` once that value is whole);
    - once `{"content": "` is out, content: the string decoded so far (an escape still incomplete is
      left out);
    - before either (`{"na`, or nothing), neither: `content` null and no `tool_calls`."""
    call = CALL_HEAD.match(text)
    if call:
        end = value_end(text, call.end())
        arguments = text[call.end(): len(text) if end is None else end]
        return Reply(None, [tool_call(call_id, json.loads(f'"{call.group(1)}"'), arguments)], end is not None)
    content = CONTENT_HEAD.match(text)
    if content:
        body = text[content.end():]
        return Reply(json.loads(f'"{body[: decodable(body)]}"'), None)
    return Reply(None, None)


def value_end(text: str, start: int) -> int | None:
    """Where the JSON value starting at `start` ends (exclusive), None while it is incomplete."""
    try:
        _, end = json.JSONDecoder().raw_decode(text, start)
    except json.JSONDecodeError:
        return None
    return end


def decodable(raw: str) -> int:
    """How much of a JSON string body `raw` (after its opening quote) decodes on its own: up to its
    closing quote, else up to an escape still incomplete (a `\\uD83D` waits for its low surrogate)."""
    i = 0
    while i < len(raw):
        char = raw[i]
        if char == '"':
            return i
        if char != "\\":
            i += 1
            continue
        step = 6 if raw[i + 1: i + 2] == "u" else 2
        if raw[i + 1: i + 2] == "u" and raw[i + 2: i + 4].lower() in ("d8", "d9", "da", "db"):
            step = 12  # a high surrogate travels with its low one
        if i + step > len(raw):
            return i
        i += step
    return i


def finish_reason(reason: str, reply: Reply) -> str:
    """OpenAI's: a call with whole arguments ends with "tool_calls" (TGI omits it, #2794); one cut
    short keeps the generation's reason ("length")."""
    whole_call = bool(reply.tool_calls) and reply.complete
    return "tool_calls" if whole_call and reason in ("stop", "eos_token", "stop_sequence") else reason


def message_for_template(message: Any, takes_tools: bool) -> dict:
    """A conversation turn for the chat template: an assistant's earlier calls as the template expects
    them (`tool_calls` with object arguments) or, for a template that knows no tools, as the JSON the
    model was asked to write; a `tool` turn keeps its role and its `tool_call_id`."""
    turn: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        turn["name"] = message.name
    if not message.tool_calls:
        return turn
    calls = [{"name": c.function.name, "arguments": _arguments_object(c.function.arguments)} for c in message.tool_calls]
    if takes_tools:
        turn["tool_calls"] = [{"id": c.id, "type": "function", "function": call}
                              for c, call in zip(message.tool_calls, calls)]
    else:
        turn["content"] = (turn["content"] or "") + "".join(json.dumps(call, ensure_ascii=False) for call in calls)
    return turn


def _arguments_object(arguments: str | dict) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
