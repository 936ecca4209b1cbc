"""GrammarCompiler: TGI's regex dialect as its router writes it, JSON Schemas, the cache, the
limits, and every kind of bad grammar refused with a reason."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from tgi_vlm.config import GrammarLimits
from tgi_vlm.generation.grammar import GrammarType
from tgi_vlm.generation.grammar_compiler import GrammarCompiler, GrammarError
from tgi_vlm.testing import tiny_model_path
from tgi_vlm.testing.schemas import PERSON, PROFILE, person_instance, router_regex

REGEX, JSON = GrammarType.REGEX, GrammarType.JSON

# Schemas with every construct outlines-core 0.1.20 (TGI's router) turns into regex syntax:
# formats, patterns, enums, const, anyOf, $ref, arrays with bounds, nested objects, null.
ROUTER_SCHEMAS = {
    "person": PERSON,
    "profile": PROFILE,
    "choices": {
        "type": "object",
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
        "properties": {
            "kind": {"const": "shape"},
            "when": {"type": "string", "format": "date"},
            "at": {"type": "string", "format": "time"},
            "value": {"anyOf": [{"type": "integer"}, {"type": "null"}, {"type": "string", "maxLength": 3}]},
            "points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 2},
            "level": {"type": "string", "enum": ["low", "high"]},
        },
        "required": ["kind", "when", "at", "value", "points", "level"],
    },
}
# Regexes in TGI's documentation style (GRAMMAR_TYPE_REGEX sent by a client directly).
DOC_REGEXES = [
    r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)",
    r"\d{3}-\d{4}",
    r"(?:yes|no|maybe)",
    r"[A-Z][a-z]+ [A-Z][a-z]+",
    r"\w+@\w+\.com",
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_model_path("llama"))


def make_compiler(tokenizer, **limits) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, GrammarLimits(**limits))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return make_compiler(tokenizer)


def accepts(compiler, tokenizer, kind: GrammarType, grammar: str, text: str) -> bool:
    """Fed token by token (as the model would write it), does `text` end in an accepting state?"""
    state = compiler.state_for(kind, grammar)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return all(state.advance(t) for t in ids) and state.is_accepting


def near_misses(text: str) -> list[str]:
    """Strings one edit away from `text`, most of them outside its language."""
    middle = len(text) // 2
    return [text[:-1], text + " ", text + "x", text[:middle] + text[middle + 1 :], text[:middle] + "\n" + text[middle:]]


# ----- dialect -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ROUTER_SCHEMAS))
def test_router_compiled_schemas_compile(compiler, name):
    assert compiler.state_for(REGEX, router_regex(ROUTER_SCHEMAS[name])).is_accepting is False


def test_router_regex_accepts_exactly_what_python_re_fullmatch_accepts(compiler, tokenizer):
    regex = router_regex(PERSON)
    texts = [person_instance(i) for i in range(4)] + [m for i in range(2) for m in near_misses(person_instance(i))]
    expected = [re.fullmatch(regex, t) is not None for t in texts]
    assert True in expected and False in expected
    assert [accepts(compiler, tokenizer, REGEX, regex, t) for t in texts] == expected


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_strings_drawn_from_router_and_doc_regexes_are_judged_like_python_re(compiler, tokenizer, data):
    regex = data.draw(st.sampled_from([router_regex(s) for s in ROUTER_SCHEMAS.values()] + DOC_REGEXES))
    # ASCII draws: Python's `re` counts Unicode "other numbers" such as '²' as \w, the Rust regex
    # semantics llguidance follows (and TGI's router writes for) do not; the oracle holds on ASCII.
    text = data.draw(st.from_regex(regex, fullmatch=True, alphabet=st.characters(codec="ascii")))
    assert accepts(compiler, tokenizer, REGEX, regex, text), f"{text!r} matches {regex!r} but was refused"
    for miss in near_misses(text):
        expected = re.fullmatch(regex, miss) is not None
        assert accepts(compiler, tokenizer, REGEX, regex, miss) == expected, f"{miss!r} vs {regex!r}"


def test_json_schema_grammar_takes_valid_documents_only(compiler, tokenizer):
    schema = json.dumps(PROFILE)
    good = '{"name": "ann", "age": 31, "role": "user", "active": true, "address": {"zip": "12345"}}'
    assert accepts(compiler, tokenizer, JSON, schema, good)
    assert accepts(compiler, tokenizer, JSON, schema, good.replace(": ", ":"))  # spaces optional, as the router's
    for bad in (good.replace('"12345"', '"1234"'), good.replace("user", "root"), good.replace(', "age": 31', ""),
                good[:-1] + ', "extra": 1}', good.replace(": ", ":  ")):
        assert not accepts(compiler, tokenizer, JSON, schema, bad), bad


# ----- cache and limits --------------------------------------------------------------------------


def counting(compiler: GrammarCompiler, delay: float = 0.0) -> list[str]:
    """Make compiles slow by `delay` and record each one's grammar text."""
    calls: list[str] = []
    inner = compiler._compile

    def compile_(kind, text):
        calls.append(text)
        time.sleep(delay)
        return inner(kind, text)

    compiler._compile = compile_
    return calls


def test_a_grammar_is_compiled_once_and_then_served_from_the_cache(tokenizer):
    compiler = make_compiler(tokenizer)
    calls = counting(compiler)
    for _ in range(3):
        compiler.start(REGEX, "[ab]+")
        compiler.state_for(REGEX, "[ab]+")
    compiler.state_for(JSON, '{"type": "string"}')
    assert calls == ["[ab]+", '{"type": "string"}'] and compiler.num_cached == 2


def test_the_least_recently_used_grammar_leaves_the_cache_first(tokenizer):
    compiler = make_compiler(tokenizer, cache_entries=2)
    calls = counting(compiler)
    for regex in ("a", "b", "a", "c", "a", "b"):
        compiler.state_for(REGEX, regex)
    assert calls == ["a", "b", "c", "b"] and compiler.num_cached == 2


def test_a_slow_compile_is_refused_at_the_deadline_and_not_cached(tokenizer):
    compiler = make_compiler(tokenizer, compile_timeout_s=0.2)
    counting(compiler, delay=3.0)
    start = time.monotonic()
    with pytest.raises(GrammarError, match=r"did not compile within 0.2 s \(TGI_VLM_GRAMMAR_COMPILE_TIMEOUT_S\)"):
        compiler.state_for(REGEX, "[0-9]+")
    assert time.monotonic() - start < 1.5 and compiler.num_cached == 0  # far from the compile's 3 s


def test_one_batch_waits_for_all_its_grammars_one_deadline_at_most(tokenizer):
    compiler = make_compiler(tokenizer, compile_timeout_s=0.5, threads=2)
    counting(compiler, delay=3.0)
    grammars = ["w+", "x+", "y+", "z+"]
    start = time.monotonic()
    for g in grammars:  # the intake starts every request's compile when the batch arrives
        compiler.start(REGEX, g)
    for g in grammars:
        with pytest.raises(GrammarError, match="did not compile"):
            compiler.state_for(REGEX, g)
    assert time.monotonic() - start < 1.5  # one deadline (0.5 s), not four (2 s) nor a compile (3 s)


def test_compiles_run_off_the_calling_thread(tokenizer):
    compiler = make_compiler(tokenizer)
    threads = []
    inner = compiler._compile
    compiler._compile = lambda kind, text: threads.append(threading.current_thread().name) or inner(kind, text)
    compiler.state_for(REGEX, "q+")
    assert threads and threads[0].startswith("tgi-vlm-grammar")


# ----- bad grammars ------------------------------------------------------------------------------

BAD = {
    "unclosed_group": (REGEX, "(ab", "invalid REGEX grammar: "),
    "look_ahead": (REGEX, "(?=a)b", "look-around"),
    "back_reference": (REGEX, r"(a)\1", "backreferences are not supported"),
    "bad_repetition": (REGEX, "a{3,2}", "invalid repetition"),
    "json_not_json": (JSON, "{'type': 'object'}", "invalid JSON grammar: not valid JSON"),
    "json_not_an_object": (JSON, "[1, 2]", "a JSON Schema must be a JSON object, got list"),
    "json_unknown_type": (JSON, '{"type": "objekt"}', "invalid JSON grammar: "),
    "json_unknown_format": (JSON, '{"type": "string", "format": "shoe-size"}', "shoe-size"),
    "json_bad_pattern": (JSON, '{"type": "string", "pattern": "(?<=a)b"}', "look-around"),
    "grammar_type_none": (GrammarType.NONE, "abc", "grammar_type 0 is not JSON (1) or REGEX (2)"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_grammar_is_refused_with_its_reason(compiler, name):
    kind, grammar, reason = BAD[name]
    with pytest.raises(GrammarError) as refused:
        compiler.state_for(kind, grammar)
    assert reason in str(refused.value)
    assert len(str(refused.value)) <= 330 and "\n" not in str(refused.value)


def test_a_grammar_over_the_size_limit_is_refused_before_compiling(tokenizer):
    compiler = make_compiler(tokenizer, max_bytes=100)
    calls = counting(compiler)
    compiler.state_for(REGEX, "a" * 100)
    with pytest.raises(GrammarError, match="the grammar is 101 bytes, over the limit of 100 "
                                           r"\(TGI_VLM_GRAMMAR_MAX_BYTES\)"):
        compiler.state_for(REGEX, "é" * 50 + "a")  # bytes, not characters
    assert calls == ["a" * 100]


def test_failed_compiles_are_not_cached(compiler):
    for _ in range(2):
        with pytest.raises(GrammarError):
            compiler.state_for(REGEX, "(unclosed")
    assert (REGEX, "(unclosed") not in compiler._cache


def test_a_model_without_a_fast_tokenizer_refuses_grammars_with_the_reason():
    compiler = GrammarCompiler(object(), 10, {0}, GrammarLimits())
    with pytest.raises(GrammarError, match="grammars need a fast \\(tokenizers\\) tokenizer; this model has object"):
        compiler.state_for(REGEX, "a")


def test_a_batch_sharing_a_grammar_still_compiling_for_an_earlier_one_waits_its_own_deadline(tokenizer):
    compiler = make_compiler(tokenizer, compile_timeout_s=0.6)
    counting(compiler, delay=1.0)
    compiler.start(REGEX, "v+")  # an earlier batch (its request never waited: refused for another reason)
    time.sleep(0.7)  # that batch's deadline has passed
    compiler.start(REGEX, "v+")  # the next batch brings the same grammar: 0.6 s from now
    assert compiler.state_for(REGEX, "v+").is_accepting is False  # compiled at 1.0 s, inside the new deadline
