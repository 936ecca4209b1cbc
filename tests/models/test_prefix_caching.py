"""Prefix caching, shard side: a verified `cache_len` skips recomputing the cached positions and the
tokens stay exactly transformers' (logits within 1e-4); a claim whose blocks hold other content is
refused naming the request, and nothing else is disturbed."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.models.prefix_routing import common_blocks
from tests.models.reference import assert_matches, hf_greedy
from tgi_vlm.errors import InvalidBatch
from tgi_vlm.testing import tiny_model_path
from tgi_vlm.testing.harness import make_batch

SYSTEM = ("You are a helpful assistant that answers questions about pictures and words. "
          "Keep every answer short, kind and correct. ")
Q1, Q2, Q3 = "What is the color of the sky?", "Tell me about dogs please.", "Numbers one two three"


@pytest.fixture(scope="module")
def arch():
    return "llama"


@pytest.fixture(scope="module")
def reference():
    path = tiny_model_path("llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return lambda text, n: hf_greedy(model, dict(tokenizer(text, return_tensors="pt")), n)




def first_run(runner, routed, rid, text, n=4):
    request = routed.request(rid, (text,), n)
    runner.prefill([request])
    runner.run()
    return list(request.blocks)


def test_a_shared_system_prompt_is_not_recomputed_and_gives_transformers_tokens(runner, routed, reference, computed):
    blocks = first_run(runner, routed, 1, SYSTEM + Q1)
    k = common_blocks(routed.prompt_ids((SYSTEM + Q1,)), routed.prompt_ids((SYSTEM + Q2,)), routed.block_size)
    assert k >= 2
    computed.clear()
    prompt_len = len(routed.prompt_ids((SYSTEM + Q2,)))
    runner.prefill([routed.request(2, (SYSTEM + Q2,), 6, prefix_blocks=blocks[:k], cache_len=k * 16)])
    runner.run()
    assert computed[0] == prompt_len - k * 16  # only the uncached suffix went through the model
    assert_matches(runner, 2, reference(SYSTEM + Q2, 6))


def test_a_hit_on_blocks_whose_owner_is_still_decoding(runner, routed, reference, computed):
    owner = routed.request(1, (SYSTEM + Q1,), 10)
    runner.prefill([owner])
    runner.step()
    k = common_blocks(routed.prompt_ids((SYSTEM + Q1,)), routed.prompt_ids((SYSTEM + Q3,)), 16)
    computed.clear()
    runner.prefill([routed.request(2, (SYSTEM + Q3,), 5, prefix_blocks=list(owner.blocks)[:k], cache_len=k * 16)],
                   batch_id=2)
    assert computed == [1 + len(routed.prompt_ids((SYSTEM + Q3,))) - k * 16]  # the owner's decode + the suffix
    runner.run()
    assert_matches(runner, 1, reference(SYSTEM + Q1, 10))
    assert_matches(runner, 2, reference(SYSTEM + Q3, 5))


def test_the_whole_prompt_found_recomputes_only_its_last_token(runner, routed, reference, computed):
    text = SYSTEM
    while len(routed.prompt_ids((text,))) % 16:
        text += "x"
    prompt_len = len(routed.prompt_ids((text,)))
    blocks = first_run(runner, routed, 1, text)
    computed.clear()
    # TGI's queue.rs: when the radix tree holds the whole prompt, cache_len = input_length - 1.
    runner.prefill([routed.request(2, (text,), 5, prefix_blocks=blocks[: prompt_len // 16], cache_len=prompt_len - 1)])
    runner.run()
    assert computed[0] == 1
    assert_matches(runner, 2, reference(text, 5))


@pytest.mark.parametrize("chunk", [1, 5])
def test_chunked_prefill_after_a_hit(engine, runner, routed, reference, computed, chunk):
    blocks = first_run(runner, routed, 1, SYSTEM + Q1)
    k = common_blocks(routed.prompt_ids((SYSTEM + Q1,)), routed.prompt_ids((SYSTEM + Q2,)), 16)
    engine.prefill_budget = chunk
    computed.clear()
    runner.prefill([routed.request(2, (SYSTEM + Q2,), 4, prefix_blocks=blocks[:k], cache_len=k * 16, chunk_len=chunk)])
    runner.run()
    suffix = len(routed.prompt_ids((SYSTEM + Q2,))) - k * 16
    assert computed[0] == chunk and sum(computed) == suffix + 3  # the suffix in chunks, then 3 decode steps
    assert_matches(runner, 2, reference(SYSTEM + Q2, 4))


def test_a_prefix_ending_inside_a_block_is_served_when_that_block_holds_the_same_tokens(runner, routed, reference,
                                                                                       computed):
    blocks = first_run(runner, routed, 1, SYSTEM + Q1)
    k = common_blocks(routed.prompt_ids((SYSTEM + Q1,)), routed.prompt_ids((SYSTEM + Q2,)), 16)
    computed.clear()
    runner.prefill([routed.request(2, (SYSTEM + Q2,), 4, prefix_blocks=blocks[:k], cache_len=k * 16 - 5)])
    assert computed == [len(routed.prompt_ids((SYSTEM + Q2,))) - (k * 16 - 5)]
    runner.run()
    assert_matches(runner, 2, reference(SYSTEM + Q2, 4))


def refused(engine, request) -> str:
    with pytest.raises(InvalidBatch) as info:
        engine.batch_from_pb(make_batch(9, [request]))
    return str(info.value)


def test_a_claim_on_blocks_holding_other_tokens_is_refused_and_the_running_batch_is_untouched(
        engine, runner, routed, reference):
    other = first_run(runner, routed, 1, "Completely different words fill these blocks " * 3)
    running = routed.request(3, (SYSTEM + Q1,), 8)
    runner.prefill([running], batch_id=3)
    runner.step()
    message = refused(engine, routed.request(4, (SYSTEM + Q2,), 4, prefix_blocks=other[:2], cache_len=32))
    assert "request 4" in message and "holds other content" in message and "request 3" not in message
    runner.run()
    assert_matches(runner, 3, reference(SYSTEM + Q1, 8))


def test_a_claim_on_blocks_never_written_is_refused(engine, routed):
    message = refused(engine, routed.request(5, (SYSTEM + Q2,), 4, prefix_blocks=[routed.offset + 900], cache_len=16))
    assert "request 5" in message and "holds other content (or nothing)" in message


def test_a_claim_on_a_block_the_failed_or_later_write_changed_is_refused(engine, runner, routed, reference):
    blocks = first_run(runner, routed, 1, SYSTEM + Q1)
    # Another request is given block blocks[0] afresh and overwrites it (a router reusing a freed block).
    reuse = routed.request(2, ("Other text entirely, long enough to fill a whole block or two",), 2)
    reuse.blocks[0] = blocks[0]
    reuse.slots[:16] = list(range(blocks[0] * 16, blocks[0] * 16 + 16))
    runner.prefill([reuse])
    runner.run()
    message = refused(engine, routed.request(3, (SYSTEM + Q2,), 4, prefix_blocks=blocks[:2], cache_len=32))
    assert "request 3" in message and f"block {blocks[0]}" in message


@pytest.mark.parametrize(("cache_len", "reason"), [(10_000, "leaves nothing to compute"),
                                                   (16, "with prefill_logprobs")])
def test_impossible_claims_are_refused(engine, routed, cache_len, reason):
    request = routed.request(6, (SYSTEM + Q2,), 4, prefix_blocks=[routed.offset + 901], cache_len=cache_len,
                             prefill_logprobs=cache_len == 16)
    message = refused(engine, request)
    assert "request 6" in message and reason in message


def test_info_offers_prefix_caching_to_the_router_only_when_the_launcher_asks(engine, monkeypatch):
    assert engine.info().use_prefix_caching is False  # tests load with PREFIX_CACHING off
    monkeypatch.setattr(engine, "config", engine.config.__class__(**{**engine.config.__dict__, "prefix_caching": True}))
    assert engine.info().use_prefix_caching is True
