"""Behaviours the mutation run (benchmarks/results/mutation-after.md) found unpinned, each pinned
exactly: error mapping, attention masks per window/chunk, prompt logprobs of nothing, and the
engine's request refusals checked in process."""

from __future__ import annotations

import grpc
import pytest
import torch

from tgi_vlm.errors import InvalidBatch
from tgi_vlm.generation import prefill_logprobs
from tgi_vlm.layers.attention import AttentionMetadata, DecodeGroup, KVCacheSpec, PagedKVCache, PrefillSpan
from tgi_vlm.server.service import is_out_of_memory, status_for
from tgi_vlm.testing.harness import make_batch, make_request


def test_a_plain_memory_error_is_out_of_memory_and_travels_as_resource_exhausted():
    assert is_out_of_memory(MemoryError("KV cache full"))
    assert status_for(MemoryError("x"))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


def test_prompt_logprobs_of_no_tokens_are_empty():
    assert prefill_logprobs(torch.zeros(0, 7), []) == []


def _meta(kv_lens: list[int], spans: list[PrefillSpan] = ()) -> AttentionMetadata:
    cache = PagedKVCache(KVCacheSpec(1, 1, 2, 4, torch.float32), 16, "cpu")
    width = max(kv_lens) if kv_lens else 1
    slot_index = torch.zeros(len(kv_lens), width, dtype=torch.long)
    decode = DecodeGroup.build(list(range(len(kv_lens))), kv_lens, slot_index, len(kv_lens)) if kv_lens else None
    return AttentionMetadata(kv_cache=cache, slots=torch.zeros(1, dtype=torch.long), decode=decode, prefills=list(spans))


def test_decode_masks_are_cached_per_window_and_chunk_not_shared_between_them():
    meta = _meta([6])
    full, window, chunk = meta.decode_mask(None), meta.decode_mask(2), meta.decode_mask(None, 4)
    assert full[0, 0, 0].tolist() == [True] * 6
    assert window[0, 0, 0].tolist() == [False] * 4 + [True] * 2  # the query at 5 sees 4 and 5
    assert chunk[0, 0, 0].tolist() == [False] * 4 + [True] * 2  # chunk [4, 8) holds 4 and 5
    assert meta.decode_mask(3)[0, 0, 0].tolist() == [False] * 3 + [True] * 3


def test_chunked_prefill_masks_stay_causal_inside_their_chunk():
    span = PrefillSpan(q_start=0, q_end=6, kv_len=6, slot_index=torch.arange(6))
    mask = _meta([], [span]).prefill_mask(0, None, 4)[0, 0].int().tolist()
    assert mask == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0],
                    [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 1, 1]]


@pytest.fixture(scope="module")
def engine():
    from tests.conftest import load_engine

    return load_engine("llama")


def refusal(engine, request) -> str:
    with pytest.raises(InvalidBatch) as info:
        engine.batch_from_pb(make_batch(3, [make_request(1, "fine", max_new_tokens=1), request]))
    message = str(info.value)
    assert "request 1" not in message
    return message


def test_an_empty_prompt_is_refused_naming_the_request(engine):
    assert "request 7: empty input: the prompt has no tokens" in refusal(
        engine, make_request(7, "", add_special_tokens=False))


def test_max_total_tokens_refuses_one_token_past_it_and_accepts_it_exactly(engine):
    prompt_len = len(engine.tokenize_request(make_request(0, "four words of text")).ids)
    engine.set_max_total_tokens(prompt_len + 5)
    try:
        message = refusal(engine, make_request(8, "four words of text", max_new_tokens=6))
        assert f"request 8: {prompt_len} prompt tokens + max_new_tokens 6 exceed max_total_tokens {prompt_len + 5}" \
            in message
        batch = engine.batch_from_pb(make_batch(4, [make_request(9, "four words of text", max_new_tokens=5)]))
        batch.release()
    finally:
        engine.max_total_tokens = None
    assert engine.kv_blocks_in_use == 0
