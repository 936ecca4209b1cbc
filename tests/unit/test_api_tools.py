"""Chat tools, response formats and best_of without a shard: which grammar a request gets, how a
reply is read back (whole and streamed), what bad tools and schemas answer, TGI's best_of rule."""

from __future__ import annotations

import json

import llguidance
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from tgi_vlm.api import chat as chat_module
from tgi_vlm.api.chat import ChatTemplate
from tgi_vlm.api.errors import ApiError
from tgi_vlm.api.grammar import grammar_fields, response_format_grammar
from tgi_vlm.api.infer import Generation
from tgi_vlm.api.reply_stream import ReplyStream
from tgi_vlm.api.responses import best_of
from tgi_vlm.api.routes.openai import chat_parameters
from tgi_vlm.api.schemas import ChatMessage, ChatRequest
from tgi_vlm.api.tools import CONTENT_SCHEMA, Reply, plan_tools, read_reply
from tgi_vlm.api.tools import finish_reason as tool_finish_reason
from tgi_vlm.generation.grammar_compiler import JSON_WHITESPACE
from tgi_vlm.router.requests import FinalEvent, TokenEvent
from tgi_vlm.testing import tiny_model_path

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "noop"}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**fields) -> ChatRequest:
    return ChatRequest.model_validate({"messages": USER, **fields})


def refusal(**fields) -> tuple[int, str]:
    with pytest.raises(ApiError) as caught:
        plan_tools(chat(**fields))
    return caught.value.status, caught.value.error


def accepts(schema: dict, text: str) -> bool:
    """Whether the shard's engine (same options) accepts `text` under `schema` (bytes, no vocabulary)."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_pattern": JSON_WHITESPACE})
    tokenizer = llguidance.LLTokenizer("byte")
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


# ----- which grammar ------------------------------------------------------------------------------

def test_no_tools_or_tool_choice_none_means_free_text():
    assert plan_tools(chat()) is None
    assert plan_tools(chat(tools=TOOLS, tool_choice="none")) is None


def test_required_allows_a_call_to_any_tool_and_nothing_else():
    plan = plan_tools(chat(tools=TOOLS, tool_choice="required"))
    assert plan.choice == "required" and len(plan.schema["anyOf"]) == 2
    assert accepts(plan.schema, '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}')
    assert accepts(plan.schema, '{"name": "noop", "arguments": {}}')
    assert not accepts(plan.schema, '{"name": "get_weather", "arguments": {"city": "Paris"}}')  # days required
    assert not accepts(plan.schema, '{"content": "hello"}')


def test_a_named_choice_allows_only_that_function_and_tgi_bare_names_work_too():
    for choice in ({"type": "function", "function": {"name": "noop"}}, "noop"):
        plan = plan_tools(chat(tools=TOOLS, tool_choice=choice))
        assert plan.choice == "function" and [t.function.name for t in plan.tools] == ["noop"]  # shown alone
        assert accepts(plan.schema, '{"name": "noop", "arguments": {}}')
        assert not accepts(plan.schema, '{"name": "get_weather", "arguments": {"city": "a", "days": 1}}')


def test_auto_is_the_default_with_tools_and_allows_a_call_or_content():
    plan = plan_tools(chat(tools=TOOLS))
    assert plan.choice == "auto" and plan.schema["anyOf"][-1] == CONTENT_SCHEMA
    assert accepts(plan.schema, '{"content": "It is sunny."}')
    assert accepts(plan.schema, '{"name": "noop", "arguments": {}}')


# ----- bad tools ------------------------------------------------------------------------------------

def test_a_choice_naming_an_unknown_function_is_tgis_tool_error():
    status, message = refusal(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}})
    assert status == 422 and message == "Tool error: Tool with name fly not found (offered: get_weather, noop)"


def test_an_invalid_tool_schema_is_a_422_naming_the_function_and_the_problem():
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "strnig"}}}}}]
    assert refusal(tools=bad, tool_choice="required") == (
        422, "Input validation error: grammar is not valid: Invalid schema for function 'f': Invalid type: strnig")


def test_a_keyword_the_engine_cannot_enforce_is_refused_by_name():
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "tags": {"type": "array", "uniqueItems": True}}}}}]
    status, message = refusal(tools=bad)
    assert status == 422 and "Invalid schema for function 'f': the keyword `uniqueItems` cannot be enforced" in message


@pytest.mark.parametrize(("name", "ok"), [("get_weather-2", True), ("A" * 64, True), ("A" * 65, False), ("", False),
                                          ("mod.fn", False), ("a b", False), ("café", False)])
def test_function_names_follow_openais_rule_exactly(name, ok):
    tools = [{"type": "function", "function": {"name": name}}]
    if ok:
        assert chat(tools=tools).tools[0].function.name == name
    else:
        with pytest.raises(pydantic.ValidationError, match="should match pattern"):
            chat(tools=tools)


@pytest.mark.parametrize("choice", ["required", "auto", "noop", {"type": "function", "function": {"name": "fly"}}])
def test_tool_choice_without_tools_is_ignored_as_tgi_does(choice):
    assert plan_tools(chat(tool_choice=choice)) is None
    assert plan_tools(chat(tools=[], tool_choice=choice)) is None


def test_duplicate_function_names_are_refused():
    assert refusal(tools=[TOOLS[1], TOOLS[1]])[1] == "Tool error: function name noop is given twice"


# ----- response_format ----------------------------------------------------------------------------

def test_a_text_response_format_goes_with_tools_and_a_json_one_is_tgis_mutual_exclusion_error():
    request = chat(tools=TOOLS, tool_choice="required", response_format={"type": "text"})
    plan = plan_tools(request)
    assert chat_parameters(request, plan).grammar == plan.grammar()
    request = chat(tools=TOOLS, response_format={"type": "json_object"})
    with pytest.raises(ApiError) as caught:
        chat_parameters(request, plan_tools(request))
    assert (caught.value.status, caught.value.error) == (
        422, "Tool error: Grammar and tools are mutually exclusive: give `response_format` or `tools`, not both")


def test_response_formats_in_openais_and_tgis_shapes_become_json_grammars():
    any_object = grammar_fields(response_format_grammar({"type": "json_object"}))
    assert any_object == ('{"type": "object"}', 1)
    openai = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}
    tgi = {"type": "json", "value": WEATHER}
    assert grammar_fields(response_format_grammar(openai)) == grammar_fields(response_format_grammar(tgi)) == (
        json.dumps(WEATHER), 1)


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "free"}},
    {"type": "json_schema", "json_schema": {"name": "free", "description": "anything", "strict": True}},
    {"type": "json_schema", "value": {"name": "free"}},
], ids=["openai", "openai-strict", "tgi-value"])
def test_a_json_schema_wrapper_without_a_schema_asks_for_any_json_object_not_for_the_wrapper(response_format):
    assert grammar_fields(response_format_grammar(response_format)) == (json.dumps({"type": "object"}), 1)


def test_tgis_json_schema_value_may_still_be_a_bare_schema():
    assert grammar_fields(response_format_grammar({"type": "json_schema", "value": WEATHER})) == (
        json.dumps(WEATHER), 1)
    assert grammar_fields({"type": "json_schema", "value": {"name": "w", "schema": WEATHER}}) == (
        json.dumps(WEATHER), 1)


@pytest.mark.parametrize(("schema", "problem"), [
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
     "strict mode needs `additionalProperties: false` at #"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False},
     "strict mode needs every property in `required` at #; missing a"),
    ({**WEATHER, "properties": {**WEATHER["properties"], "tags": {"type": "array", "contains": {"type": "string"}}},
      "required": ["city", "days", "tags"]}, "the keyword `contains` cannot be enforced"),
], ids=["open-object", "optional-property", "contains"])
def test_strict_schemas_follow_openais_rules_and_unenforceable_keywords_are_named(schema, problem):
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    with pytest.raises(ApiError) as caught:
        grammar_fields(response_format_grammar(response_format))
    assert caught.value.status == 422 and problem in caught.value.error


# ----- reading replies back ----------------------------------------------------------------------

def test_a_call_keeps_its_arguments_as_the_json_text_generated():
    reply = read_reply('{"name": "get_weather", "arguments": {"city" : "Paris","days": 2} }', "call_1")
    assert reply.content is None and reply.tool_calls == [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city" : "Paris","days": 2}'}}]


def test_content_is_decoded_whole_or_cut_short_and_other_text_is_returned_as_is():
    assert read_reply('{"content": "caf\\u00e9 \\"ok\\""}', "c") .content == 'café "ok"'
    assert read_reply('{"content": "half \\u00', "c").content == "half "



def test_a_reply_cut_short_is_a_partial_call_or_partial_content_or_nothing_yet():
    cut_call = read_reply('{"name": "get_weather", "arguments": {"city": "Pa', "call_1")
    assert (cut_call.content, cut_call.complete) == (None, False)
    assert cut_call.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}
    assert [tool_finish_reason(r, cut_call) for r in ("length", "stop")] == ["length", "stop"]
    whole_call = read_reply('{"name": "noop", "arguments": {}', "call_1")  # arguments whole, `}` cut
    assert whole_call.complete and tool_finish_reason("eos_token", whole_call) == "tool_calls"
    assert read_reply('{"content": ""}', "c") == Reply("", None)
    for undecided in ("", " ", '{"na', '{"name": "get_wea', '{"content":'):
        assert read_reply(undecided, "c") == Reply(None, None)


CALL_TEXT = st.builds(
    lambda city, days, spaces: (f'{{"name"{spaces[0]}:{spaces[1]}"get_weather",{spaces[2]}"arguments":'
                                f'{spaces[3]}{{"city":{json.dumps(city)},"days":{days}}}{spaces[4]}}}'),
    st.text(max_size=12), st.integers(1, 10**9), st.lists(st.sampled_from(["", " "]), min_size=5, max_size=5))


def pieces(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


def streamed(text: str, cuts: list[int]) -> tuple[str | None, str, str]:
    reader, content, arguments, name = ReplyStream("call_1"), None, "", None
    for piece in pieces(text, cuts):
        for delta in reader.feed(piece):
            if "content" in delta and delta["content"] is not None:
                content = (content or "") + delta["content"]
            for call in delta.get("tool_calls", []):
                name = call["function"].get("name", name)
                arguments += call["function"]["arguments"]
    return content, arguments, name


@settings(max_examples=60, deadline=None)
@given(CALL_TEXT, st.lists(st.integers(0, 200), max_size=12))
def test_streamed_call_fragments_concatenate_to_the_whole_reply_wherever_the_tokens_split(text, cuts):
    whole = read_reply(text, "call_1").tool_calls[0]["function"]
    assert streamed(text, cuts) == (None, whole["arguments"], whole["name"])


CONTENT_TEXT = st.builds(lambda value, space, ascii_only: '{"content":' + space + json.dumps(value, ensure_ascii=ascii_only)
                         + "}", st.text(max_size=12), st.sampled_from(["", " "]), st.booleans())


def reassembled(deltas: list[dict]) -> tuple[str | None, list[dict] | None]:
    """The message a client accumulates from `deltas` (the openai SDK's rule: strings concatenate)."""
    content, calls = None, {}
    for delta in deltas:
        if delta.get("content") is not None:
            content = (content or "") + delta["content"]
        for part in delta.get("tool_calls", []):
            call = calls.setdefault(part["index"], {"function": {"arguments": ""}})
            call.update({k: part[k] for k in ("id", "type") if k in part})
            if "name" in part["function"]:
                call["function"]["name"] = part["function"]["name"]
            call["function"]["arguments"] += part["function"]["arguments"]
    return content, [{"id": c["id"], "type": c["type"], "function": {
        "name": c["function"]["name"], "arguments": c["function"]["arguments"]}} for c in calls.values()] or None


@settings(max_examples=150, deadline=None)
@given(st.one_of(CALL_TEXT, CONTENT_TEXT), st.integers(0, 400), st.lists(st.integers(0, 200), max_size=12))
def test_any_prefix_streams_to_what_the_non_streamed_reader_makes_of_it(text, cut, cuts):
    prefix = text[: cut % (len(text) + 1)]  # the output cut short (max_tokens) anywhere, or whole
    reader = ReplyStream("call_1")
    deltas = [d for piece in pieces(prefix, cuts) for d in reader.feed(piece)] + [reader.close()]
    deltas = [d for d in deltas if d]
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:] if "tool_calls" in d)
    whole = read_reply(prefix, "call_1")
    assert reassembled(deltas) == (whole.content, whole.tool_calls)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=20), st.lists(st.integers(0, 200), max_size=12))
def test_streamed_content_decodes_to_the_whole_reply_wherever_the_tokens_split(value, cuts):
    text = '{"content": ' + json.dumps(value) + "}"  # ASCII escapes, surrogate pairs included
    assert streamed(text, cuts) == (value, "", None)


# ----- templates ----------------------------------------------------------------------------------

def test_a_template_without_tools_gets_them_appended_to_the_last_message_as_tgi_does():
    template = ChatTemplate(AutoTokenizer.from_pretrained(tiny_model_path("qwen2_vl")))
    assert not template.takes_tools
    plan = plan_tools(chat(tools=TOOLS, tool_choice="required"))
    rendered = template.apply([ChatMessage.model_validate(USER[0])], plan)
    offered = json.dumps([{"type": "function", "function": {"name": t["function"]["name"], "description": "",
                                                             "parameters": t["function"].get("parameters", {
                                                                 "type": "object", "properties": {}})}} for t in TOOLS])
    assert f"Weather in Paris?\n---\n{offered}\n{plan.prompt(None)}<|im_end|>\n<|im_start|>assistant\n" in rendered


TOOLS_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %}"
                  "[call {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}{% endfor %}"
                  "{% if tools %}<tools>{{ tools | map(attribute='function.name') | join(',') }}{% endif %}<assistant>")


def test_a_template_that_takes_tools_gets_them_and_earlier_calls_and_results_come_back_in_turn():
    template = ChatTemplate(AutoTokenizer.from_pretrained(tiny_model_path("qwen2_vl")), template=TOOLS_TEMPLATE)
    assert template.takes_tools
    messages = [ChatMessage.model_validate(m) for m in [
        *USER, {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]]
    plan = plan_tools(chat(tools=TOOLS))
    assert template.apply(messages, plan, "Use a tool.") == (
        '<user>Weather in Paris?<assistant>[call get_weather {"city": "Paris", "days": 1}]'
        "<tool>sunny\n---\nUse a tool.<tools>get_weather,noop<assistant>")


# ----- best_of ---------------------------------------------------------------------------------------

def generation(logprobs: list[float]) -> Generation:
    tokens = [TokenEvent(0, 1, "a", lp, False, 0.0) for lp in logprobs]
    return Generation(tokens, FinalEvent.failed(0, "unused"))


def test_best_of_picks_the_highest_mean_token_logprob_and_the_first_on_ties():
    assert best_of([generation([-1.0, -3.0]), generation([-1.5]), generation([-0.5, -4.0])]) == 1
    assert best_of([generation([-1.0]), generation([-2.0, 0.0]), generation([-1.0])]) == 0


# Templates as transformers compiles them: loop controls and `{% generation %}` parse, and `tools` is seen.
EXTENDED_TEMPLATES = {
    "break": "{% for m in messages %}{% if loop.index > 9 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
             "{% if tools %}{{ tools | length }}{% endif %}",
    "continue": "{% for m in messages %}{% if m.role == 'x' %}{% continue %}{% endif %}{{ m.content }}{% endfor %}"
                "{% for t in tools or [] %}{{ t.function.name }}{% endfor %}",
    "generation": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                  "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}{{ tools | tojson }}",
}


@pytest.mark.parametrize("name", sorted(EXTENDED_TEMPLATES))
def test_templates_with_transformers_extensions_are_seen_to_take_tools(name):
    chat_module._variables.cache_clear()
    template = ChatTemplate(AutoTokenizer.from_pretrained(tiny_model_path("qwen2_vl")), template=EXTENDED_TEMPLATES[name])
    assert template.takes_tools
    rendered = template.apply([ChatMessage.model_validate(USER[0])], plan_tools(chat(tools=TOOLS)))
    assert "Weather in Paris?" in rendered


@pytest.mark.parametrize("name", sorted(EXTENDED_TEMPLATES))
def test_without_transformers_compile_function_an_equivalent_environment_parses_them(name, monkeypatch):
    import transformers.utils.chat_template_utils as utils

    def unusable(template):
        raise RuntimeError("changed signature")

    monkeypatch.setattr(utils, "_compile_jinja_template", unusable)
    chat_module._variables.cache_clear()
    assert "tools" in chat_module._variables(EXTENDED_TEMPLATES[name])
    chat_module._variables.cache_clear()


def test_a_template_that_does_not_parse_is_said_once_and_taken_as_without_tools(caplog):
    chat_module._variables.cache_clear()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path("qwen2_vl"))
    broken = "{% for m in messages %}{{ m.content }}{% if tools %}"
    with caplog.at_level("WARNING", logger="tgi_vlm.api.chat"):
        first, second = ChatTemplate(tokenizer, template=broken), ChatTemplate(tokenizer, template=broken)
    assert not first.takes_tools and not second.takes_tools
    warnings = [r for r in caplog.records if r.name == "tgi_vlm.api.chat"]
    assert len(warnings) == 1 and "does not parse" in warnings[0].getMessage()
    with pytest.raises(ApiError) as caught:
        first.apply([ChatMessage.model_validate(USER[0])])
    assert caught.value.status == 422
