"""The engine with its attention backend swapped for FlashinferBackend, over the fake `flashinfer`
(tests/fakes, attention computed from what was planned), gives the torch backend's tokens and
logits: mistral with a sliding window (8) shorter than its prompts, gemma3 with image blocks
(a custom mask); each through a request joining mid-decode (a mixed prefill+decode step) and
through the CUDA-graph stand-in (`DecodeGraphs.eager`), whose replays re-plan flashinfer."""

from __future__ import annotations

import pytest
from transformers import AutoConfig, AutoTokenizer

from tests.conftest import load_engine
from tests.fakes import flashinfer as fake_flashinfer
from tgi_vlm.layers.attention import FlashinferBackend
from tgi_vlm.models.cuda_graphs import DecodeGraphs
from tgi_vlm.testing import make_test_image, png_bytes, tiny_model_path
from tgi_vlm.testing.harness import Runner, make_request

IMG = png_bytes(make_test_image(20, 20, seed=1))
PROMPTS = {
    "mistral": [("the quick brown fox jumps over the lazy dog and then some more words follow here",),
                ("hello world this is",), ("numbers 1 2 3 and 4 and 5",)],
    "gemma3": [("Look at ", IMG, " and describe it"), ("just text",), (IMG, " what is this")],
}
MAX_NEW = 6
# window_left of every planned layer: mistral's layers all slide (window 8); gemma3 alternates
# sliding (window 32) and full layers.
WINDOWS_LEFT = {"mistral": {7}, "gemma3": {31, -1}}
# Graph replays per captured size in `_generate`: 2 decode steps of 2 sequences; after the join,
# 2 of 3 (padded to 4); then the joiner alone for its last 3 tokens.
REPLAYS_BY_SIZE = {2: 2, 4: 2, 1: 3}


@pytest.fixture(scope="module", params=sorted(PROMPTS))
def engine(request):
    model = load_engine(request.param)
    model.arch = request.param
    model.ensure_kv_cache()
    return model


@pytest.fixture
def flashinfer(engine, monkeypatch):
    """The fake installed and the engine's backend swapped for FlashinferBackend for one test."""
    fake = fake_flashinfer.install(monkeypatch)
    monkeypatch.setattr(engine, "attention", FlashinferBackend(engine.attention.pattern))
    return fake


def _generate(engine) -> tuple[dict, dict]:
    """Two requests, two decode steps, then a third joins (one mixed step), then decode to the end."""
    prompts = PROMPTS[engine.arch]
    runner = Runner(engine)
    runner.prefill([make_request(i, *p, max_new_tokens=MAX_NEW) for i, p in enumerate(prompts[:2])])
    runner.step()
    runner.step()
    runner.prefill([make_request(2, *prompts[2], max_new_tokens=MAX_NEW)], batch_id=2)
    runner.run()
    assert engine.kv_blocks_in_use == 0
    return dict(runner.tokens), dict(runner.logits)


def _assert_same(result, reference) -> None:
    tokens, logits = result
    ref_tokens, ref_logits = reference
    assert tokens == ref_tokens
    for rid in ref_tokens:
        for step, (a, b) in enumerate(zip(logits[rid], ref_logits[rid])):
            assert (a - b).abs().max().item() < 1e-4, f"request {rid} step {step}"


@pytest.fixture(scope="module")
def reference(engine):
    return _generate(engine)


def test_mistrals_window_is_shorter_than_its_longest_prompt():
    path = tiny_model_path("mistral")
    prompt_len = len(AutoTokenizer.from_pretrained(path)(PROMPTS["mistral"][0][0])["input_ids"])
    assert prompt_len > 2 * AutoConfig.from_pretrained(path).sliding_window


def test_flashinfer_decodes_the_torch_tokens(engine, reference, flashinfer):
    _assert_same(_generate(engine), reference)
    planned = [w.planned for w in flashinfer.created]
    assert {p.window_left for p in planned} == WINDOWS_LEFT[engine.arch]
    kinds = {type(w).__name__ for w in flashinfer.created}
    assert kinds == {"BatchPrefillWithPagedKVCacheWrapper", "BatchDecodeWithPagedKVCacheWrapper"}
    masked = any(p.custom_mask is not None for p in planned)
    assert masked == (engine.arch == "gemma3")  # image blocks attend both ways


def test_flashinfer_through_the_graph_stand_in_decodes_the_torch_tokens(engine, reference, flashinfer):
    engine.graphs = DecodeGraphs.eager(engine, (1, 2, 4), max_kv_len=64)
    try:
        _assert_same(_generate(engine), reference)
    finally:
        engine.graphs = None
    graph_wrappers = [w for w in flashinfer.created if w.use_cuda_graph]
    keys = len(WINDOWS_LEFT[engine.arch])  # one fixed-buffer wrapper per (size, key), re-planned at every replay
    expected = sorted((size, replays) for size, replays in REPLAYS_BY_SIZE.items() for _ in range(keys))
    assert sorted((len(w.buffers[3]), w.plan_calls) for w in graph_wrappers) == expected
