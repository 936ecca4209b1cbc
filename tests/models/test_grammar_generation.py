"""Grammar-constrained generation through the engine (tiny Llama): every output of a grammar
request matches its regex or validates against its schema — greedy and sampled, in a mixed batch
with chunked prefill, beside requests whose tokens stay transformers' own — TGI's router-shaped
regex accepted, bad grammars refused alone, the mask placed in TGI's processor order, and the
request ending with EOS once its grammar is complete."""

from __future__ import annotations

import json
import math
import re
import time

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.models.reference import hf_greedy
from tgi_vlm.config import GrammarLimits
from tgi_vlm.errors import InvalidBatch
from tgi_vlm.generation import FinishReason, GrammarCompiler, GrammarType
from tgi_vlm.testing import tiny_model_path
from tgi_vlm.testing.harness import Runner, make_batch, make_request
from tgi_vlm.testing.schemas import BADGE, router_regex

REGEX, JSON = int(GrammarType.REGEX), int(GrammarType.JSON)
PLAIN_PROMPT = "the quick brown fox jumps over the lazy dog"
ANSWER = r"(yes|no|maybe), [a-z]{2,6} [0-9]{1,3}"  # a client's own regex, as in TGI's docs


@pytest.fixture(scope="module")
def arch():
    return "llama"


@pytest.fixture(scope="module")
def badge_regex() -> str:
    return router_regex(BADGE)  # what TGI's router sends for a `json` grammar with this schema


def grammar_request(rid: int, grammar: str, kind: int, *, max_new_tokens: int = 120, prompt: str = "answer as json",
                    **params) -> object:
    """A request as TGI's router sends grammars: ignore_eos_token false."""
    return make_request(rid, prompt, max_new_tokens=max_new_tokens, ignore_eos=False, grammar=grammar,
                        grammar_type=kind, **params)


def valid_badge(text: str) -> bool:
    jsonschema.validate(json.loads(text), BADGE)  # raises with the reason
    return True


def hf_reference(prompt: str, n: int) -> list[int]:
    path = tiny_model_path("llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(path)(prompt, return_tensors="pt")
    return hf_greedy(model, dict(ids), n).ids


def test_router_schema_json_schema_and_regex_outputs_all_hold_in_one_chunked_batch(engine, runner, badge_regex):
    sampled = [dict(do_sample=True, seed=seed, temperature=0.9) for seed in (1, 2, 3)]
    requests = [
        grammar_request(0, badge_regex, REGEX),
        *(grammar_request(1 + i, badge_regex, REGEX, **s) for i, s in enumerate(sampled)),
        grammar_request(4, json.dumps(BADGE), JSON),
        grammar_request(5, json.dumps(BADGE), JSON, **sampled[0]),
        grammar_request(6, ANSWER, REGEX, prompt="is it so?", repetition_penalty=1.3),
        grammar_request(7, ANSWER, REGEX, prompt="is it so?", **sampled[1]),
        make_request(8, PLAIN_PROMPT, max_new_tokens=12),  # no grammar: transformers' exact tokens
    ]
    engine.prefill_budget = 6  # prompts are prefilled in several chunks, sharing steps with decodes
    runner.prefill([r for r in requests if r.id != 3])
    runner.step()
    runner.prefill([requests[3]], batch_id=2)  # joins mid-flight (concatenate)
    runner.run()
    done = runner.finished
    assert {rid: done[rid].finish_reason for rid in range(8)} == dict.fromkeys(range(8), FinishReason.EOS_TOKEN)
    for rid in range(4):
        assert re.fullmatch(badge_regex, done[rid].text), (rid, done[rid].text)
    for rid in range(6):
        assert valid_badge(done[rid].text)
    for rid in (6, 7):
        assert re.fullmatch(ANSWER, done[rid].text), (rid, done[rid].text)
    assert len({done[rid].text for rid in range(4)}) == 4  # seeds and greedy really differ
    assert runner.tokens[8] == hf_reference(PLAIN_PROMPT, 12)


def test_a_complete_grammar_ends_the_request_with_eos_of_logprob_zero(engine, runner):
    runner.prefill([grammar_request(0, "(cat|dog)s", REGEX)])
    runner.run()
    done, tokens = runner.finished[0], runner.tokens[0]
    assert done.text in ("cats", "dogs") and done.finish_reason == FinishReason.EOS_TOKEN
    assert tokens[-1] in engine.eos_token_ids and done.generated_tokens == len(tokens)
    assert runner.generations[0][-1].tokens.logprobs == [0.0]  # EOS was the only token allowed


def test_a_grammar_request_stops_at_eos_even_with_ignore_eos_token(engine, runner):
    runner.prefill([make_request(0, "go", max_new_tokens=40, ignore_eos=True, grammar="(cat|dog)s", grammar_type=REGEX)])
    runner.run()
    assert runner.finished[0].text in ("cats", "dogs")
    assert runner.finished[0].finish_reason == FinishReason.EOS_TOKEN and len(runner.tokens[0]) < 40


def test_max_new_tokens_cuts_a_grammar_output_short_with_length(engine, runner, badge_regex):
    runner.prefill([grammar_request(0, badge_regex, REGEX, max_new_tokens=5)])
    runner.run()
    done = runner.finished[0]
    assert done.finish_reason == FinishReason.LENGTH and done.generated_tokens == 5
    assert done.text.startswith("{") and not re.fullmatch(badge_regex, done.text)


def test_the_mask_comes_before_the_warpers(engine):
    """TGI's order: penalties, grammar, then temperature/top-k/top-p/typical-p. With top_k=1 after
    the mask, sampling keeps the best allowed token: the greedy grammar output. (Were top-k first,
    its one token would usually be masked out.)"""
    outputs = {}
    for name, params in {"greedy": {}, "top_k_1": dict(top_k=1, seed=7, do_sample=True)}.items():
        runner = Runner(engine)
        runner.prefill([grammar_request(0, ANSWER, REGEX, prompt="is it so?", **params)])
        runner.run()
        outputs[name] = runner.tokens[0]
    assert outputs["top_k_1"] == outputs["greedy"]


def test_every_processor_with_a_grammar_still_yields_a_match(engine, runner):
    settings = [
        dict(repetition_penalty=1.5, frequency_penalty=0.5),
        dict(watermark=True, do_sample=True, seed=3),
        dict(temperature=1.5, top_p=0.9, seed=4),
        dict(typical_p=0.5, seed=5, top_k=30),
    ]
    runner.prefill([grammar_request(i, ANSWER, REGEX, prompt="is it so?", **s) for i, s in enumerate(settings)])
    runner.run()
    for rid in range(len(settings)):
        assert re.fullmatch(ANSWER, runner.finished[rid].text), (settings[rid], runner.finished[rid].text)
        assert all(math.isfinite(g.tokens.logprobs[0]) for g in runner.generations[rid])


def test_a_bad_grammar_joining_a_running_batch_is_refused_alone(engine):
    def start() -> Runner:
        runner = Runner(engine)
        runner.prefill([grammar_request(0, ANSWER, REGEX, prompt="is it so?"), make_request(1, PLAIN_PROMPT)])
        runner.step()
        return runner

    alone = start()
    alone.run()
    runner = start()
    bad = [
        grammar_request(2, "(unclosed", REGEX),
        grammar_request(3, '{"type": "objekt"}', JSON),
        grammar_request(4, "x" * (engine.config.grammar.max_bytes + 1), REGEX),
        grammar_request(5, "[0-9]+", GrammarType.NONE),
    ]
    with pytest.raises(InvalidBatch) as refused:
        engine.batch_from_pb(make_batch(2, [*bad, grammar_request(6, ANSWER, REGEX)]))
    assert refused.value.request_ids == [2, 3, 4, 5]
    message = str(refused.value)
    for reason in ("request 2: invalid REGEX grammar", "request 3: invalid JSON grammar",
                   f"over the limit of {engine.config.grammar.max_bytes} (TGI_VLM_GRAMMAR_MAX_BYTES)",
                   "request 5: a grammar is given with grammar_type NONE"):
        assert reason in message
    runner.prefill([grammar_request(6, ANSWER, REGEX)], batch_id=3)  # the router resends the good one
    runner.run()
    assert runner.tokens[0] == alone.tokens[0] and runner.tokens[1] == alone.tokens[1]
    assert re.fullmatch(ANSWER, runner.finished[6].text)


def test_a_grammar_over_its_compile_deadline_is_refused_without_holding_the_batch_longer(engine, monkeypatch):
    # A compiler of its own (its pool stays busy with the slow compiles after the test).
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids,
                               GrammarLimits(compile_timeout_s=0.5))
    slow = compiler._compile
    compiler._compile = lambda kind, text: time.sleep(3.0) or slow(kind, text)
    monkeypatch.setattr(engine, "grammars", compiler)
    start = time.monotonic()
    with pytest.raises(InvalidBatch) as refused:
        engine.batch_from_pb(make_batch(1, [grammar_request(i, f"slow{i}+", REGEX) for i in range(4)]))
    assert time.monotonic() - start < 1.5  # one deadline (0.5 s) for the batch, not four, nor a compile (3 s)
    assert refused.value.request_ids == [0, 1, 2, 3]
    assert "did not compile within 0.5 s (TGI_VLM_GRAMMAR_COMPILE_TIMEOUT_S)" in str(refused.value)
    assert engine.kv_blocks_in_use == 0
