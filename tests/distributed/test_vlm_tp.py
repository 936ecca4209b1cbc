"""Vision-language models split across two gloo ranks. The language model is sharded as a text
model is; the vision tower is replicated on every rank (Qwen2-VL, Gemma3, Idefics3) or sharded by
transformers' own plan (Llama4). Qwen2-VL brings 3-row mrope positions, Gemma3 bidirectional
image blocks that a chunk never splits, Idefics3 row/column markers inside an image's span,
Llama4 chunked attention and MoE layers."""

from __future__ import annotations

import pytest

from tests.distributed.checks import assert_matches_transformers, assert_ranks_agree_with_single
from tests.distributed.conftest import ShardedModel
from tests.models.vlm_reference import hf_reference
from tgi_vlm.config import InputLimits
from tgi_vlm.testing import make_test_image, png_bytes
from tgi_vlm.testing.harness import make_request

IMG_A = png_bytes(make_test_image(20, 20, seed=1))
IMG_B = png_bytes(make_test_image(37, 53, seed=2))

FIRST = ("Look at ", IMG_A, " and describe it")
SECOND = ("just some text without any picture at all",)
THIRD = ("First ", IMG_B, " then a question about it")

ARCHS = ("qwen2_vl", "gemma3", "idefics3", "llama4")


@pytest.fixture(scope="module", params=ARCHS)
def vlm(request, ranks):
    return ShardedModel.load(ranks, request.param)


def test_join_with_chunked_prefill_through_an_image_and_filter_match_one_shard_and_transformers(vlm):
    prompt = vlm.single.tokenize_request(make_request(2, *THIRD))
    image = prompt.media[0]
    sharded, single = vlm.run("join_and_filter", first=FIRST, second=SECOND, third=THIRD, budget=3)
    assert_ranks_agree_with_single(sharded, single)
    prefilled = sharded[0].facts["prefilled"]  # request 2's prompt positions computed after each step
    assert len(prefilled) > 3 and prefilled[-1] == len(prompt.ids)
    inside = [n for n in prefilled if image.offset < n < image.end]
    if vlm.arch == "gemma3":  # its image block is bidirectional: computed whole, never cut by a chunk
        assert inside == [] and image.end in prefilled, prefilled
    else:  # chunks of at most 3 tokens ended inside the image
        assert inside, prefilled
    assert_matches_transformers(sharded[0], 0, hf_reference(vlm.arch, FIRST, 8))
    assert_matches_transformers(sharded[0], 2, hf_reference(vlm.arch, THIRD, 6))


def test_a_malformed_image_is_refused_on_every_rank_and_the_others_go_on(ranks):
    model = ShardedModel.load(ranks, "qwen2_vl")
    bad = ("broken ", b"\x89PNG\r\n\x1a\n not really a png", " image")
    sharded, single = model.run("refuse_then_continue", running=FIRST, good=THIRD, bad=bad)
    assert_ranks_agree_with_single(sharded, single)
    (refusal,) = sharded[0].refusals
    assert refusal.startswith("batch rejected (1 invalid request(s)): request 2: image 0: cannot decode image")
    assert sorted(sharded[0].tokens) == [0, 1] and len(sharded[0].tokens[1]) == 5


def test_a_request_only_one_rank_would_refuse_is_refused_by_both_with_that_ranks_message(ranks):
    # rank 1 alone runs with a lower image-size limit, which request 2's image exceeds
    limit = len(IMG_B) - 1
    model = ShardedModel.load(ranks, "qwen2_vl", key="qwen2_vl-rank1-limit",
                              per_rank=[{}, {"limits": InputLimits(max_image_bytes=limit)}])
    sharded, single = model.run("refuse_then_continue", running=FIRST, good=FIRST, bad=THIRD)
    expected = (f"batch rejected (1 invalid request(s)): request 2: image 0: image is {len(IMG_B)} bytes, "
                f"over the limit of {limit}")
    assert [t.refusals for t in sharded] == [[expected], [expected]]
    assert single.refusals == []  # an unsharded engine with rank 0's limits takes it
    assert sharded[0].tokens == sharded[1].tokens
    assert sharded[0].tokens[0] == single.tokens[0] and sharded[0].tokens[1] == single.tokens[1]
