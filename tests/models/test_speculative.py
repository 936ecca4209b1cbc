"""Speculative decoding (`--speculate N`): the emitted tokens, logprobs and finish reasons are
exactly those of the run without speculation (and transformers' greedy tokens), for text and every
VLM, alone and batched, through chunked prefill and a join mid-decode; seeded sampling too.

The tiny random-weight models never repeat themselves, so n-gram drafts are (correctly) rejected
and would leave the acceptance path untested. The parity tests therefore also run with a drafter
that knows the plain run's output and proposes it with every third draft token corrupted: runs are
accepted in part, rejected at known points, and must still give exactly the plain tokens."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from tests.conftest import load_engine
from tests.models.reference import assert_matches
from tests.models.vlm_reference import hf_reference
from tgi_vlm.generation import NgramDrafter
from tgi_vlm.testing import VLM_ARCHS, make_test_image, png_bytes
from tgi_vlm.testing.harness import Runner, make_request

IMG = png_bytes(make_test_image(40, 28, seed=5))
# Repetitive prompts: the tiny random models fall into loops, and n-gram drafts find them.
TEXT = ("one two three one two three one two three one two",)
WITH_IMAGE = ("Look ", IMG, " and say it again: red blue red blue red blue red blue")
N = 16
# Every depth on llama and Qwen2-VL (mrope); one depth elsewhere, to keep the suite's time in check.
DEPTHS = {"llama": (1, 2, 4), "qwen2_vl": (1, 2, 4)}
# Batching/sampling scenarios on the architectures with their own positions or masks.
SCENARIO_ARCHS = ("llama", "qwen2_vl", "gemma3", "llama4", "paligemma")


def test_the_ngram_drafter_proposes_what_followed_the_most_recent_match_of_the_longest_suffix():
    drafter = NgramDrafter()
    assert drafter.propose([5, 6, 7, 9, 5, 6, 7, 8, 1, 5, 6, 7], 3) == [8, 1, 5]  # suffix 5 6 7, latest match
    assert drafter.propose([1, 2, 3, 4], 2) == []  # no earlier occurrence of any suffix
    assert drafter.propose([4, 9, 4], 5) == [9, 4]  # shorter suffix, as many tokens as follow
    assert drafter.propose([4, 9, 4], 0) == []


ARCHS = ["llama", *VLM_ARCHS]
GREEDY_CASES = [(a, k) for a in ARCHS for k in DEPTHS.get(a, (2,))]


@functools.lru_cache(maxsize=1)
def engines_for(arch: str):
    """(plain engine, {depth: speculating engine}) for one architecture at a time."""
    plain = load_engine(arch)
    return plain, {k: load_engine(arch, speculate=k) for k in DEPTHS.get(arch, (2,))}


def chunks_for(arch):
    return TEXT if arch == "llama" else WITH_IMAGE


def run(engine, requests, *, chunk: int | None = None, join_after: int | None = None, late=None):
    engine.prefill_budget = chunk or 4096
    runner = Runner(engine)
    runner.prefill(requests)
    if late is not None:
        for _ in range(join_after):
            runner.step()
        runner.prefill(late, batch_id=2)
    runner.run()
    assert engine.kv_blocks_in_use == 0
    engine.prefill_budget = 4096
    return runner


def outputs(runner):
    """Per request: (tokens, finish reason, count, top-n ids per token), and logprobs to compare to 1e-4
    (a verified draft row is computed in a multi-row forward: the same math, other float rounding)."""
    return {rid: ([tok for g in gens for tok in g.tokens.ids], runner.finished[rid].finish_reason,
                  runner.finished[rid].generated_tokens, [t.ids for g in gens for t in g.top_tokens])
            for rid, gens in runner.generations.items()}


def logprobs(runner):
    return {rid: [lp for g in gens for lp in g.tokens.logprobs] for rid, gens in runner.generations.items()}


def assert_same(got, expected):
    assert outputs(got) == outputs(expected)
    for rid, values in logprobs(expected).items():
        assert logprobs(got)[rid] == pytest.approx(values, abs=1e-4), f"request {rid} logprobs"


class KnowingDrafter:
    """Proposes the continuation the plain run produced, with every third proposed token wrong."""

    def __init__(self, runner, requests):
        self.full = [list(r.ids) + runner.tokens[req.id] for req, r in requests]

    def propose(self, ids, max_tokens):
        for full in self.full:
            if full[: len(ids)] == list(ids):
                draft = full[len(ids) : len(ids) + max_tokens]
                return [t if (i + 1) % 3 else (t + 1) % 600 for i, t in enumerate(draft)]
        return []


def knowing(engine, runner, requests):
    return KnowingDrafter(runner, [(r, engine.tokenize_request(r)) for r in requests])


def counting_steps(engine, monkeypatch) -> list[int]:
    steps: list[int] = []
    real = engine.generate_token
    monkeypatch.setattr(engine, "generate_token", lambda batch: steps.append(1) or real(batch))
    return steps


@pytest.mark.parametrize(("arch", "k"), GREEDY_CASES)
def test_greedy_tokens_and_logprobs_equal_the_plain_run_and_transformers(arch, k, monkeypatch):
    plain, spec = engines_for(arch)
    chunks = chunks_for(arch)
    requests = [make_request(1, *chunks, max_new_tokens=N)]
    expected = run(plain, requests)
    assert_same(run(spec[k], [make_request(1, *chunks, max_new_tokens=N)]), expected)  # n-gram drafts
    monkeypatch.setattr(spec[k], "drafter", knowing(spec[k], expected, requests))
    steps = counting_steps(spec[k], monkeypatch)
    got = run(spec[k], [make_request(1, *chunks, max_new_tokens=N)])
    assert_same(got, expected)
    if arch != "llama":
        assert_matches(got, 1, hf_reference(arch, chunks, N))
    # k=1: runs of 2 tokens, every third draft wrong; k>=2: two accepted of every three drafted.
    assert len(steps) <= {1: 12, 2: 9, 4: 9}[k]


@pytest.mark.parametrize("arch", SCENARIO_ARCHS)
def test_batched_with_chunked_prefill_and_a_join_mid_decode(arch):
    plain, spec = engines_for(arch)
    k = max(spec)
    chunks = chunks_for(arch)
    requests = lambda: [make_request(1, *chunks, max_new_tokens=N), make_request(2, *TEXT, max_new_tokens=9)]  # noqa: E731
    late = lambda: [make_request(3, *chunks, max_new_tokens=12, chunk_len=4)]  # noqa: E731
    expected = run(plain, requests(), chunk=5, join_after=3, late=late())
    assert_same(run(spec[k], requests(), chunk=5, join_after=3, late=late()), expected)
    spec[k].drafter = knowing(spec[k], expected, requests() + late())
    try:
        got = run(spec[k], requests(), chunk=5, join_after=3, late=late())
    finally:
        spec[k].drafter = NgramDrafter()
    assert_same(got, expected)


@pytest.mark.parametrize("arch", SCENARIO_ARCHS)
def test_seeded_sampling_and_stop_conditions_inside_an_accepted_run_match_the_plain_run(arch):
    plain, spec = engines_for(arch)
    k = max(spec)
    chunks = chunks_for(arch)
    requests = lambda: [  # noqa: E731
        make_request(1, *chunks, max_new_tokens=N, do_sample=True, seed=7, temperature=0.7, top_k=5),
        make_request(2, *chunks, max_new_tokens=N, repetition_penalty=1.3, top_n_tokens=3),
        make_request(3, *chunks, max_new_tokens=N, ignore_eos=False, stop_sequences=["two three", "blue red"]),
    ]
    expected = run(plain, requests())
    assert_same(run(spec[k], requests()), expected)
    spec[k].drafter = knowing(spec[k], expected, requests())
    try:
        assert_same(run(spec[k], requests()), expected)
    finally:
        spec[k].drafter = NgramDrafter()


def test_info_reports_the_speculation_depth():
    plain, spec = engines_for("llama")
    assert (plain.info().speculate, spec[2].info().speculate) == (0, 2)


@pytest.mark.parametrize("arch", ["llama", "qwen2_vl"])
def test_drafts_never_need_slots_beyond_prompt_plus_max_new_tokens(arch):
    """Router-shaped: exactly prompt + max_new_tokens - 1 slots (no speculate extra) still works."""
    _, spec = engines_for(arch)
    engine = spec[max(spec)]
    engine.ensure_kv_cache()
    chunks = chunks_for(arch)
    prompt_len = len(engine.tokenize_request(make_request(0, *chunks)).ids)
    base = engine.kv_cache.num_blocks - 8
    request = make_request(1, *chunks, max_new_tokens=N)
    request.slots.extend(range(base * 16, base * 16 + prompt_len + N - 1))
    plain = run(engines_for(arch)[0], [make_request(1, *chunks, max_new_tokens=N)])
    assert_same(run(engine, [request]), plain)


def test_the_config_default_is_off():
    from tgi_vlm.config import EngineConfig

    assert dataclasses.replace(EngineConfig()).speculate == 0
