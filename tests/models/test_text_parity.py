"""The text engine produces exactly transformers' greedy tokens (logits within 1e-4) under batching,
joining, filtering and chunked prefill, and gives every KV block back.

Every text architecture runs the core scenarios (one request, a batch of different lengths, a
request joining mid-decode, a small prefill chunk); llama and qwen2 also run the rest. The others
each bring an attention or config path llama lacks: mistral a sliding window shorter than the
prompts, gemma2 sliding/full layers with attention-logit and final-logit softcapping and a
query_pre_attn_scalar scale, gemma3_text q/k norms and per-layer-type rope, phi3 fused qkv with
partial rotary, gpt2 learned absolute positions and LayerNorm.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tests.models.reference import Reference, assert_matches, hf_greedy
from tgi_vlm.testing import TEXT_ARCHS, tiny_model_path
from tgi_vlm.testing.harness import Runner, make_request

PROMPTS = [
    "hello world this is",
    "the quick brown fox jumps over the lazy dog and then some more words follow here",
    "a",
    "numbers 1 2 3 and 4",
]


REF_TOKENS = 10  # the most any test here generates

# Architectures that run every scenario here; the rest run the core ones (see the docstring).
FULL = ("llama", "qwen2")
only_full = pytest.mark.parametrize("arch", FULL, indirect=True)


@pytest.fixture(scope="module", params=TEXT_ARCHS)
def arch(request):
    return request.param


def test_sliding_windows_are_shorter_than_the_long_prompt():
    """Otherwise mistral's and gemma2's windows would never mask anything in these tests."""
    for name in ("mistral", "gemma2", "gemma3_text"):
        path = tiny_model_path(name)
        window = AutoConfig.from_pretrained(path).sliding_window
        assert window < len(AutoTokenizer.from_pretrained(path)(PROMPTS[1])["input_ids"]) // 2, name


@pytest.fixture(scope="module")
def reference(arch):
    path = tiny_model_path(arch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    cache = {}

    def ref(text: str, n: int) -> Reference:
        # Greedy: the first n of REF_TOKENS tokens (and their logits) are what n alone would give.
        assert n <= REF_TOKENS
        if text not in cache:
            cache[text] = hf_greedy(model, dict(tokenizer(text, return_tensors="pt")), REF_TOKENS)
        return Reference(ids=cache[text].ids[:n], logits=cache[text].logits[:n])

    return ref


def test_one_request(runner, reference):
    runner.prefill([make_request(0, PROMPTS[0], max_new_tokens=10)])
    runner.run()
    assert_matches(runner, 0, reference(PROMPTS[0], 10))
    assert runner.finished[0].generated_tokens == 10


def test_four_requests_of_different_lengths_in_one_batch(runner, reference):
    lengths = [5, 9, 3, 7]
    runner.prefill([make_request(i, p, max_new_tokens=n) for i, (p, n) in enumerate(zip(PROMPTS, lengths))])
    runner.run()
    for i, (p, n) in enumerate(zip(PROMPTS, lengths)):
        assert_matches(runner, i, reference(p, n))


def test_request_joins_decoding_batch_through_prefill_with_cached_batch(runner, reference):
    runner.prefill([make_request(0, PROMPTS[1], max_new_tokens=8)])
    runner.step()
    runner.step()
    runner.prefill([make_request(1, PROMPTS[0], max_new_tokens=6)], batch_id=2)  # one forward: decode + prefill
    runner.run()
    assert_matches(runner, 0, reference(PROMPTS[1], 8))
    assert_matches(runner, 1, reference(PROMPTS[0], 6))


@only_full
def test_request_joins_through_separate_prefill_then_decode_of_both(engine, runner, reference):
    runner.prefill([make_request(0, PROMPTS[1], max_new_tokens=8)])
    runner.step()
    other = Runner(engine)
    other.logits = runner.logits  # one observer records both batches
    other.tokens = runner.tokens
    other.prefill([make_request(1, PROMPTS[3], max_new_tokens=5)], batch_id=2)  # Prefill(new) alone
    runner.batch = engine.concatenate([runner.batch, other.batch])  # Decode([old, new])
    engine.logits_observer = runner._observe
    runner.run()
    assert_matches(runner, 0, reference(PROMPTS[1], 8))
    assert_matches(runner, 1, reference(PROMPTS[3], 5))


@only_full
def test_filter_drops_a_request_mid_decode(runner, reference):
    runner.prefill([make_request(i, p, max_new_tokens=8) for i, p in enumerate(PROMPTS[:3])])
    runner.step()
    runner.filter([0, 2])
    runner.run()
    assert_matches(runner, 0, reference(PROMPTS[0], 8))
    assert_matches(runner, 2, reference(PROMPTS[2], 8))
    assert len(runner.tokens[1]) == 2


@only_full
def test_filter_drops_a_request_mid_prefill(engine, runner, reference):
    engine.prefill_budget = 4
    runner.prefill([make_request(0, PROMPTS[0], max_new_tokens=6), make_request(1, PROMPTS[1], max_new_tokens=6, chunk_len=4)])
    assert 1 not in runner.tokens  # still prefilling: no generation yet
    runner.filter([0])
    runner.run()
    assert_matches(runner, 0, reference(PROMPTS[0], 6))


def test_chunked_prefill_with_a_small_chunk(engine, runner, reference):
    check_chunked_prefill(engine, runner, reference, 3)


@only_full
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_prefill(engine, runner, reference, chunk):
    check_chunked_prefill(engine, runner, reference, chunk)


def check_chunked_prefill(engine, runner, reference, chunk):
    engine.prefill_budget = chunk
    prompt = PROMPTS[1]
    runner.prefill([make_request(0, prompt, max_new_tokens=6, chunk_len=chunk)])
    prompt_len = len(engine.tokenizer(prompt)["input_ids"])
    steps_without_output = 0
    while 0 not in runner.tokens:
        steps_without_output += 1
        runner.step()
    assert steps_without_output == -(-prompt_len // chunk) - 1 if chunk < prompt_len else steps_without_output == 0
    runner.run()
    assert_matches(runner, 0, reference(prompt, 6))


@only_full
def test_current_tokens_reports_the_next_forward(engine, runner):
    engine.prefill_budget = 5
    runner.prefill([make_request(0, PROMPTS[1], max_new_tokens=4, chunk_len=3), make_request(1, PROMPTS[0], max_new_tokens=4)])
    # request 1 prefilled and decodes (1 token); request 0 continues with 5 - 1 = 4 tokens
    assert runner.batch.to_pb().current_tokens == 1 + 4


# Prompts whose greedy continuation on the tiny model emits EOS at step 3.
EOS_PROMPTS = {"llama": "the quick brown fox jumps over the lazy dog", "qwen2": "the brown then"}


@only_full
def test_ignore_eos_generation_continues_through_an_emitted_eos(engine, runner, reference, arch):
    """With ignore_eos both sides go on past the EOS the greedy continuation emits."""
    prompt = EOS_PROMPTS[arch]
    assert engine.eos_token_ids & set(reference(prompt, 8).ids[:-1]), "no EOS to go past: the test proves nothing"
    runner.prefill([make_request(0, prompt, max_new_tokens=8, ignore_eos=True)])
    runner.run()
    assert_matches(runner, 0, reference(prompt, 8))
    assert runner.finished[0].generated_tokens == 8
