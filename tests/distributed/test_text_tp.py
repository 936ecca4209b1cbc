"""A text model split across two gloo ranks: heads, MLP and vocabulary sharded, logits gathered.

Llama (4 query / 2 KV heads: one KV head per rank) and the same model with 1 KV head, fewer than
the ranks, where every rank keeps that head whole."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.distributed.checks import assert_matches_transformers, assert_ranks_agree_with_single
from tests.distributed.conftest import ShardedModel
from tests.models.reference import hf_greedy
from tgi_vlm.models.tensor_parallel import local_parameter_bytes
from tgi_vlm.testing import tiny_model_path

FIRST = ("the quick brown fox jumps over the lazy dog and then some more words follow here",)
SECOND = ("numbers 1 2 3 and 4",)
THIRD = ("hello world this is a request that arrives while others decode",)


@pytest.fixture(scope="module", params=[None, 1], ids=["kv2", "kv1"])
def llama(request, ranks):
    return ShardedModel.load(ranks, "llama", kv_heads=request.param)


def transformers_greedy(model: ShardedModel, text: str, n: int):
    path = tiny_model_path(model.arch, kv_heads=model.kv_heads)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf_greedy(hf, dict(AutoTokenizer.from_pretrained(path)(text, return_tensors="pt")), n)


def test_each_rank_caches_the_kv_heads_its_query_heads_use(llama):
    kv_heads = llama.kv_heads or 2
    assert llama.single.kv_spec.kv_heads == kv_heads
    # 2 KV heads: one per rank; 1 KV head (fewer than the ranks): each rank keeps it whole
    assert [r.kv_heads for r in llama.loaded] == [1, 1]
    per_rank = llama.single.kv_spec.bytes_per_block // kv_heads
    assert [r.kv_bytes_per_block for r in llama.loaded] == [per_rank, per_rank]


def test_each_rank_reads_and_holds_only_its_slices_of_the_weights(llama):
    whole = local_parameter_bytes(llama.single.model)
    for rank in llama.loaded:
        assert rank.checkpoint_bytes_read == rank.parameter_bytes  # no tensor read whole and then cut
        # everything but the norms (and, with 1 KV head, k/v) is split in two
        assert 0.5 * whole <= rank.parameter_bytes < 0.52 * whole


def test_join_chunked_prefill_filter_and_seeded_sampling_match_one_shard_and_transformers(llama):
    sharded, single = llama.run("join_and_filter", first=FIRST, second=SECOND, third=THIRD, budget=4)
    assert_ranks_agree_with_single(sharded, single)
    prefilled = sharded[0].facts["prefilled"]
    assert prefilled[0] == 4 and len(prefilled) > 2  # request 2 joined with a 4-token chunk, then more chunks
    assert len(sharded[0].tokens[1]) < 8  # request 1 was filtered out before it finished
    assert_matches_transformers(sharded[0], 0, transformers_greedy(llama, FIRST[0], 8))
    assert_matches_transformers(sharded[0], 2, transformers_greedy(llama, THIRD[0], 6))


def test_a_failure_on_one_rank_fails_the_prefill_on_every_rank_and_the_batch_goes_on(llama):
    sharded, single = llama.run("fail_on_one_rank", running=FIRST, rank_that_fails=1)
    assert sharded[1].refusals == ["RuntimeError: injected failure tokenizing request 1"]
    assert sharded[0].refusals == ["RankFailed: rank 1 failed during batch 2 (tokenize): "
                                   "RuntimeError: injected failure tokenizing request 1"]
    assert single.refusals == [] and sorted(single.tokens) == [0, 1]
    assert sharded[0].tokens == sharded[1].tokens == {0: single.tokens[0]}  # request 0 went on


def test_warmup_sizes_every_ranks_cache_alike_with_half_the_bytes_per_token(llama):
    args = dict(max_input_tokens=16, max_prefill_tokens=32, max_total_tokens=64)
    sharded, single = llama.run("warmup", **args)
    assert_ranks_agree_with_single(sharded, single)
    # the same CPU byte budget holds kv_heads times the blocks when a rank caches 1 of kv_heads heads
    kv_heads = llama.kv_heads or 2
    supported, max_input, max_total = single.facts["limits"]
    assert [t.facts["limits"] for t in sharded] == [(kv_heads * supported, max_input, max_total)] * 2
    assert [t.facts["num_blocks"] for t in sharded] == [kv_heads * single.facts["num_blocks"]] * 2
    assert [t.facts["kv_cache_bytes"] for t in sharded] == [single.facts["kv_cache_bytes"]] * 2
