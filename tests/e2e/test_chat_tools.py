"""`tgi-vlm launch` on a tiny Qwen2-VL, driven by the openai SDK, huggingface_hub's InferenceClient and
TGI's `text-generation` client: tool calls (named, required, auto, streamed, two turns), response
formats, n and best_of, and their errors.

A tiny random model writes noise: every call and every JSON object here comes from the grammar the
server builds, which is what is under test. Its template (Qwen2-VL-Instruct's) takes no `tools`, so the
tools reach it as TGI sends them: JSON and an instruction appended to the last message.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import llguidance
import openai
import pytest
import text_generation
from huggingface_hub import InferenceClient
from openai import OpenAI
from openai.types.chat import ChatCompletion, ChatCompletionMessageToolCall
from transformers import AutoTokenizer

from tests.conftest import FLOAT32_SHARD_ARGS
from tests.e2e.launching import Launch
from tgi_vlm.api.chat import ChatTemplate
from tgi_vlm.api.schemas import ChatRequest
from tgi_vlm.api.tools import plan_tools
from tgi_vlm.generation.grammar_compiler import JSON_WHITESPACE
from tgi_vlm.testing import tiny_model_path
from tgi_vlm.testing.schemas import ADD, WEATHER

TIMEOUT = 120
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
USER = [{"role": "user", "content": "What is the weather in Paris for three days?"}]
BLOCK = 16


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model_path("qwen2_vl"))


@pytest.fixture(scope="module")
def launch(model):
    server = Launch(model, "--max-input-tokens", "1500", "--max-total-tokens", "2048",
                    "--max-batch-prefill-tokens", "2048", "--max-best-of", "3", *FLOAT32_SHARD_ARGS)
    yield server
    assert server.stop() == 0, "".join(server.output[-30:])


@pytest.fixture(scope="module")
def client(launch) -> OpenAI:
    return OpenAI(base_url=f"{launch.url}/v1", api_key="-", timeout=TIMEOUT)


def check_call(call, name: str | None = None) -> dict:
    """The SDK's own type, a function the request offered, arguments: a JSON string matching its schema."""
    assert isinstance(call, ChatCompletionMessageToolCall) and call.type == "function" and call.id.startswith("call_")
    assert call.function.name == name if name else call.function.name in SCHEMAS
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


# ----- tool calls ---------------------------------------------------------------------------------

@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_required_and_named_calls_parse_with_the_sdks_types_and_follow_the_schema(client, choice):
    out = client.chat.completions.create(model="tgi", messages=USER, tools=TOOLS, tool_choice=choice, seed=1,
                                         max_tokens=100)
    assert isinstance(out, ChatCompletion)
    message = out.choices[0].message
    assert (out.choices[0].finish_reason, message.content, len(message.tool_calls)) == ("tool_calls", None, 1)
    check_call(message.tool_calls[0], None if choice == "required" else "add")


def test_streamed_deltas_reassemble_to_the_non_streamed_call(client):
    args = dict(model="tgi", messages=USER, tools=TOOLS, tool_choice="required", seed=5, max_tokens=100)
    whole = client.chat.completions.create(**args).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(**args, stream=True))
    calls = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert calls[0].index == 0 and calls[0].id.startswith("call_") and calls[0].type == "function"
    assert all(c.index == 0 and c.id is None for c in calls[1:])
    assert (calls[0].function.name, "".join(c.function.arguments for c in calls)) == (
        whole.function.name, whole.function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_huggingface_hub_chat_completion_with_tools_parses_the_call(launch):
    hub = InferenceClient(base_url=launch.url, timeout=TIMEOUT)
    out = hub.chat_completion(USER, tools=TOOLS, tool_choice="required", seed=2, max_tokens=100)
    call = out.choices[0].message.tool_calls[0]
    assert out.choices[0].finish_reason == "tool_calls" and call.function.name in SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    streamed = list(hub.chat_completion(USER, tools=TOOLS, tool_choice="required", seed=2, max_tokens=100,
                                        stream=True))
    pieces = [c.choices[0].delta.tool_calls for c in streamed if c.choices and c.choices[0].delta.tool_calls]
    assert "".join(p[0].function.arguments for p in pieces) == call.function.arguments


def test_auto_answers_with_content_or_a_call_as_the_grammar_lets_the_model_choose(launch, client, model):
    """Both branches: a call that ended as one ("tool_calls", arguments valid), and content that is the decoded
    JSON string of what the model wrote under the same grammar and seed (/generate gives the raw text). The
    random model never closes its content string within bounded tokens, so content ends by `max_tokens`."""
    kinds = set()
    for seed in range(16):
        choice = client.chat.completions.create(model="tgi", messages=USER, tools=TOOLS, seed=seed,
                                                max_tokens=60).choices[0]
        if choice.message.tool_calls:
            assert choice.message.content is None and choice.finish_reason in ("tool_calls", "length")
            if choice.finish_reason == "tool_calls":
                check_call(choice.message.tool_calls[0])
                kinds.add("call")
        elif "content" not in kinds:
            raw = raw_auto_reply(launch, model, seed, 60)
            assert CONTENT_OPENING.match(raw), raw  # the content branch, not a call nor raw JSON passed through
            assert choice.message.content == decoded_prefix(raw[CONTENT_OPENING.match(raw).end():])
            assert choice.finish_reason == ("stop" if raw.rstrip().endswith("}") else "length")
            kinds.add("content")
        if kinds == {"call", "content"}:
            break
    assert kinds == {"call", "content"}


CONTENT_OPENING = re.compile(r' ?\{ ?"content" ?: ?"')


def raw_auto_reply(launch: Launch, model: str, seed: int, max_tokens: int) -> str:
    """The text the model writes for USER under `auto`'s grammar, from /generate (same prompt, seed, sampling)."""
    request = ChatRequest.model_validate({"messages": USER, "tools": TOOLS})
    plan = plan_tools(request)
    prompt = ChatTemplate(AutoTokenizer.from_pretrained(model)).apply(request.messages, plan)
    out = httpx.post(f"{launch.url}/generate", timeout=TIMEOUT, json={"inputs": prompt, "parameters": {
        "seed": seed, "do_sample": True, "max_new_tokens": max_tokens, "grammar": plan.grammar()}})
    assert out.status_code == 200, out.text
    return out.json()["generated_text"]


def decoded_prefix(body: str) -> str:
    """The longest start of a JSON string body that decodes on its own (up to its closing quote)."""
    for end in range(len(body), -1, -1):
        try:
            return json.loads(f'"{body[:end]}"')
        except json.JSONDecodeError:
            continue
    raise AssertionError(body)


def test_a_reply_cut_short_reads_the_same_streamed_and_not(client):
    """Cut inside the call's arguments: a call with partial arguments both ways; cut before the name: neither a
    call nor content both ways; finish_reason "length" in both, the role always streamed."""
    args = dict(model="tgi", messages=USER, tools=TOOLS, tool_choice="required", seed=5)
    full = client.chat.completions.create(**args, max_tokens=100)
    full_arguments = full.choices[0].message.tool_calls[0].function.arguments
    for max_tokens, named in ((full.usage.completion_tokens - 6, True), (3, False)):
        whole = client.chat.completions.create(**args, max_tokens=max_tokens).choices[0]
        chunks = [c for c in client.chat.completions.create(**args, max_tokens=max_tokens, stream=True) if c.choices]
        deltas = [c.choices[0].delta for c in chunks]
        calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
        streamed = (calls[0].function.name, "".join(c.function.arguments for c in calls)) if calls else None
        expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        assert (deltas[0].role, [streamed] if calls else [], whole.finish_reason) == ("assistant", expected, "length")
        assert chunks[-1].choices[0].finish_reason == "length" and bool(expected) == named
        assert whole.message.content is None and not any(d.content for d in deltas)
        if named:  # the cut fell inside the arguments: a strict start of the whole call's
            partial = expected[0][1]
            assert full_arguments.startswith(partial) and len(partial) < len(full_arguments), (partial, full_arguments)


def test_a_two_turn_tool_conversation_feeds_the_call_and_its_result_to_the_template(launch, client, model):
    first = client.chat.completions.create(model="tgi", messages=USER, tools=TOOLS, tool_choice="required", seed=3,
                                           max_tokens=100).choices[0].message
    call = first.tool_calls[0]
    arguments = check_call(call)
    history = [*USER, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"}]
    second = client.chat.completions.create(model="tgi", messages=history, tools=TOOLS, tool_choice="none",
                                            temperature=0, max_tokens=6)
    # The template knows no tools: the earlier call is the JSON the model was asked to write.
    expected = AutoTokenizer.from_pretrained(model).apply_chat_template(
        [*USER, {"role": "assistant", "content": json.dumps({"name": call.function.name, "arguments": arguments})},
         {"role": "tool", "content": "18 degrees"}], tokenize=False, add_generation_prompt=True)
    generate = httpx.post(f"{launch.url}/generate", timeout=TIMEOUT, json={
        "inputs": expected, "parameters": {"max_new_tokens": 6, "details": True}}).json()
    assert second.usage.prompt_tokens == len(httpx.post(f"{launch.url}/tokenize", json={"inputs": expected}).json())
    assert second.choices[0].message.content == generate["generated_text"]
    assert second.choices[0].message.tool_calls is None


# ----- response_format ------------------------------------------------------------------------------

def test_json_schema_output_validates_for_16_seeds_and_json_object_gives_an_object(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    for seed in (0, 4, 8, 12):  # n=4: seeds seed..seed+3
        out = client.chat.completions.create(model="tgi", messages=USER, response_format=response_format, n=4,
                                             seed=seed, max_tokens=60)
        assert len(out.choices) == 4
        for choice in out.choices:
            jsonschema.validate(json.loads(choice.message.content), WEATHER)
    anything = client.chat.completions.create(model="tgi", messages=USER, response_format={"type": "json_object"},
                                              seed=1, max_tokens=60).choices[0]
    if anything.finish_reason == "length":  # cut short: still a prefix the any-object grammar allows
        assert anything.message.content.lstrip().startswith("{") and grammar_allows_prefix(anything.message.content)
    else:
        assert isinstance(json.loads(anything.message.content), dict)
    tgi = httpx.post(f"{client.base_url}chat/completions", timeout=TIMEOUT, json={
        "messages": USER, "response_format": {"type": "json", "value": ADD}, "seed": 2, "max_tokens": 60}).json()
    jsonschema.validate(json.loads(tgi["choices"][0]["message"]["content"]), ADD)


def grammar_allows_prefix(text: str) -> bool:
    """Whether the shard's engine takes `text` as the start of a JSON object (bytes; same options)."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                            overrides={"whitespace_pattern": JSON_WHITESPACE})
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer("byte"), grammar)
    return matcher.consume_tokens(list(text.encode()))


# ----- n and best_of ----------------------------------------------------------------------------------

def prefix_figures(launch: Launch) -> dict[str, float]:
    return {k.removeprefix("tgi_vlm_prefix_cache_"): v for k, v in launch.metrics().items()
            if k.startswith("tgi_vlm_prefix_cache_")}


def test_n_4_returns_4_choices_and_computes_the_prompt_once(launch, client):
    before = prefix_figures(launch)
    messages = [{"role": "system", "content": "Unique system prompt 4242 for this test."}, *USER]
    out = client.chat.completions.create(model="tgi", messages=messages, n=4, seed=11, max_tokens=4)
    after = prefix_figures(launch)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    length = out.usage.prompt_tokens
    cached = length // BLOCK * BLOCK if length % BLOCK else length - 1
    delta = {k: after[k] - before[k] for k in after}
    assert delta == {"requests": 4, "prompt_tokens": 4 * length, "cached_tokens": 3 * cached, "hits": 3}


def test_best_of_3_answers_tgis_details_with_the_best_sequence_by_mean_logprob(launch):
    tgi = text_generation.Client(launch.url, timeout=TIMEOUT)
    out = tgi.generate("Hello there", best_of=3, do_sample=True, max_new_tokens=5)
    others = out.details.best_of_sequences
    assert len(others) == 2 and len({out.details.seed, *(s.seed for s in others)}) == 3

    def mean(tokens) -> float:
        return sum(t.logprob for t in tokens) / len(tokens)

    assert all(mean(out.details.tokens) >= mean(s.tokens) for s in others)


def test_best_of_without_details_answers_the_text_alone_and_counts_one_request(launch):
    before = launch.metrics()
    out = httpx.post(f"{launch.url}/generate", timeout=TIMEOUT, json={
        "inputs": "Hello there", "parameters": {"best_of": 3, "do_sample": True, "max_new_tokens": 3}})
    after = launch.metrics()
    assert out.status_code == 200 and list(out.json()) == ["generated_text"]
    assert after["tgi_request_count"] - before["tgi_request_count"] == 1
    assert after["tgi_vlm_prefix_cache_requests"] - before["tgi_vlm_prefix_cache_requests"] == 3  # three sequences


def test_best_of_streamed_is_tgis_validation_error(launch):
    response = httpx.post(f"{launch.url}/generate_stream", timeout=TIMEOUT, json={
        "inputs": "Hello there", "parameters": {"best_of": 2, "do_sample": True, "max_new_tokens": 3}})
    events = [json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data:")]
    assert events == [{"error": "Input validation error: `best_of` != 1 is not supported when streaming tokens",
                       "error_type": "validation"}]


# ----- bad input ----------------------------------------------------------------------------------

def refused(client: OpenAI, **args) -> tuple[int, str]:
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="tgi", messages=USER, max_tokens=4, **args)
    return caught.value.status_code, caught.value.body  # the SDK keeps the body's "error", TGI's message


def test_bad_tools_n_best_of_and_formats_get_tgis_status_and_message(launch, client):
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "strnig"}}}}}]
    assert refused(client, tools=bad_schema, tool_choice="required") == (
        422, "Input validation error: grammar is not valid: Invalid schema for function 'f': Invalid type: strnig")
    assert refused(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}}) == (
        422, "Tool error: Tool with name fly not found (offered: get_weather, add)")
    assert refused(client, n=5) == (
        422, "`n` = 5 exceeds the maximum allowed batch size of 4 (--max-client-batch-size)")
    status, message = refused(client, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}})
    assert status == 422 and "the keyword `uniqueItems` cannot be enforced" in message
    greedy = httpx.post(f"{launch.url}/generate", timeout=TIMEOUT, json={
        "inputs": "hi", "parameters": {"best_of": 2, "max_new_tokens": 2}})
    assert (greedy.status_code, greedy.json()) == (422, {
        "error": "Input validation error: you must use sampling when `best_of` is > 1", "error_type": "validation"})
