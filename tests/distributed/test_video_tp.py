"""Qwen2-VL video split across two gloo ranks: a clip's span cut by chunked prefill, joined and filtered, gives
one shard's and transformers' tokens on both ranks; a clip only one rank would refuse (its lower limit) is
refused by both with that rank's message."""

from __future__ import annotations

from dataclasses import replace

from tests.distributed.checks import assert_matches_transformers, assert_ranks_agree_with_single
from tests.distributed.conftest import ShardedModel
from tests.models.video_reference import video_reference
from tgi_vlm.config import InputLimits
from tgi_vlm.media import VideoBytes
from tgi_vlm.testing.harness import make_request
from tgi_vlm.video import encode_clip, make_test_frames

CLIP = VideoBytes(encode_clip(make_test_frames(6, 56, 42, seed=8), 2.0), "video/x-matroska")
FIRST = ("Watch ", CLIP, " and describe it")
SECOND = ("just some text without any clip at all",)
THIRD = ("First ", VideoBytes(encode_clip(make_test_frames(4, 84, 56, seed=9), 4.0)), " then a question about it")


def test_a_clip_cut_by_chunks_joined_and_filtered_matches_one_shard_and_transformers(ranks):
    model = ShardedModel.load(ranks, "qwen2_vl")
    clip = model.single.tokenize_request(make_request(2, *THIRD)).media[0]
    sharded, single = model.run("join_and_filter", first=FIRST, second=SECOND, third=THIRD, budget=3)
    assert_ranks_agree_with_single(sharded, single)
    prefilled = sharded[0].facts["prefilled"]
    assert [n for n in prefilled if clip.offset < n < clip.end], prefilled  # a chunk ended inside the clip
    assert_matches_transformers(sharded[0], 0, video_reference("qwen2_vl", FIRST, 8))
    assert_matches_transformers(sharded[0], 2, video_reference("qwen2_vl", THIRD, 6))


def test_a_clip_only_one_rank_would_refuse_is_refused_by_both_with_that_ranks_message(ranks):
    limits = replace(InputLimits(), max_video_seconds=1.0)  # THIRD is 4 frames at 4 fps: 1 s; FIRST is 3 s
    model = ShardedModel.load(ranks, "qwen2_vl", key="qwen2_vl-rank1-video-limit", per_rank=[{}, {"limits": limits}])
    sharded, single = model.run("refuse_then_continue", running=THIRD, good=THIRD, bad=FIRST)
    expected = ("batch rejected (1 invalid request(s)): request 2: video 0: video is 3.0 s long, over the limit of "
                "1.0 s")
    assert [t.refusals for t in sharded] == [[expected], [expected]]
    assert single.refusals == []
    assert sharded[0].tokens == sharded[1].tokens
