"""Videos on Qwen2-VL and Qwen2.5-VL, against transformers' own processor, get_rope_index and generate: prompt
ids and mrope positions equal for clips of 2, 4, 6 and 5 (odd) frames at 1, 2 and 4 fps; greedy tokens and
float32 logits (1e-4) equal alone, batched with image and text requests, with chunked prefill splitting the
clip, and on a second turn served from the prefix cache; Qwen2.5-VL's temporal positions strictly increase
at 4 fps (their spacing is the true seconds per temporal patch, never truncated)."""

from __future__ import annotations

import pytest

from tests.models.prefix_routing import common_blocks
from tests.models.reference import assert_matches
from tests.models.video_reference import rope_index, video_inputs, video_reference
from tgi_vlm.media import MediaKind, VideoBytes
from tgi_vlm.testing import make_test_image, png_bytes
from tgi_vlm.testing.harness import make_request
from tgi_vlm.video import encode_clip, make_test_frames

BS = 16


def clip(frames: int, fps: float, width: int = 56, height: int = 42, seed: int = 0) -> VideoBytes:
    """A lossless clip of noise frames (ffv1 in Matroska)."""
    return VideoBytes(encode_clip(make_test_frames(frames, width, height, seed=seed), fps), "video/x-matroska")


CLIPS = {(n, fps): clip(n, fps, seed=10 * n + fps) for n in (2, 4, 6) for fps in (1, 2, 4)}
ODD = clip(5, 2, width=84, height=56, seed=5)
IMG = png_bytes(make_test_image(40, 30, seed=3))


def ask(video: VideoBytes) -> tuple:
    return ("Watch ", video, " and say what happens.")


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def arch(request):
    return request.param


def check(runner, arch, request_id, chunks, n):
    assert_matches(runner, request_id, video_reference(arch, chunks, n))


@pytest.mark.parametrize("frames_fps", [*CLIPS, "odd"], ids=[*(f"{n}f{fps}fps" for n, fps in CLIPS), "5f2fps"])
def test_prompt_ids_and_mrope_positions_equal_the_processor_and_get_rope_index(engine, arch, frames_fps):
    chunks = ask(ODD if frames_fps == "odd" else CLIPS[frames_fps])
    prompt = engine.tokenize_request(make_request(0, *chunks))
    reference = video_inputs(arch, chunks)
    assert prompt.ids == reference["input_ids"][0].tolist()
    assert [s.kind for s in prompt.media] == [MediaKind.VIDEO]
    assert prompt.media[0].num_embed == prompt.ids.count(engine.adapter.prompt.media_token_id(MediaKind.VIDEO))
    assert (prompt.mm.adapter_state.rows == rope_index(arch, reference)).all()


@pytest.mark.parametrize("key", [(2, 1), (4, 4), (6, 2), "odd"], ids=["2f1fps", "4f4fps", "6f2fps", "5f2fps"])
def test_a_clip_alone_gives_transformers_tokens_and_logits(runner, arch, key):
    chunks = ask(ODD if key == "odd" else CLIPS[key])
    runner.prefill([make_request(0, *chunks, max_new_tokens=5)])
    runner.run()
    check(runner, arch, 0, chunks, 5)


def test_a_clip_batched_with_image_text_and_image_plus_clip_requests(runner, arch):
    prompts = [ask(CLIPS[(4, 2)]), ("Look ", IMG, " here"), ("only words in this one",),
               ("Picture ", IMG, " then clip ", CLIPS[(6, 4)], " compare."), ask(CLIPS[(4, 2)])]
    runner.prefill([make_request(i, *p, max_new_tokens=4 + i % 2) for i, p in enumerate(prompts)])
    runner.run()
    for i, p in enumerate(prompts):
        check(runner, arch, i, p, 4 + i % 2)


@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_chunked_prefill_splits_the_clip_span(engine, runner, arch, chunk):
    """First chunks of 1, 3 and 5 tokens, then 6 per step: some step ends inside the clip's span."""
    chunks = ask(CLIPS[(6, 2)])
    span = engine.tokenize_request(make_request(0, *chunks)).media[0]
    engine.prefill_budget = 6
    runner.prefill([make_request(0, *chunks, max_new_tokens=4, chunk_len=chunk)])
    seq = runner.batch.seqs[0]
    while seq.num_computed < span.end:  # some step leaves the clip half prefilled
        if span.offset < seq.num_computed < span.end:
            break
        runner.step()
    assert span.offset < seq.num_computed < span.end
    runner.run()
    check(runner, arch, 0, chunks, 4)


def test_a_second_turn_reuses_the_clips_cached_blocks(engine, runner, routed, arch, computed):
    turn1 = (*ask(CLIPS[(4, 1)]), " Describe it carefully and in detail, please, every frame.")
    turn2 = (*turn1, " Now say which frame was brightest.")
    first = routed.request(1, turn1, 3)
    runner.prefill([first])
    runner.run()
    k = common_blocks(routed.prompt_ids(turn1), routed.prompt_ids(turn2), BS)
    span = engine.tokenize_request(make_request(0, *turn2)).media[0]
    assert span.end <= k * BS  # the whole clip lies in the reused blocks
    encoded: list = []
    real = engine.adapter.encode
    engine.adapter.encode = lambda kind, pixels: encoded.append(kind) or real(kind, pixels)
    engine.encoder_cache.clear_shared()
    try:
        computed.clear()
        runner.prefill([routed.request(2, turn2, 4, prefix_blocks=list(first.blocks)[:k], cache_len=k * BS)])
        assert computed == [len(routed.prompt_ids(turn2)) - k * BS]
        runner.run()
    finally:
        del engine.adapter.encode
    assert encoded == []  # the clip's K/V came from the cache: no vision tower
    check(runner, arch, 2, turn2, 4)


def test_the_same_ids_with_another_clip_never_reuse_the_first_clips_blocks(engine, runner, routed, arch):
    turn1 = (*ask(CLIPS[(4, 1)]), " Describe it carefully and in detail, please, every frame.")
    twin = (turn1[0], clip(4, 1, seed=99), *turn1[2:])
    assert routed.prompt_ids(twin) == routed.prompt_ids(turn1)
    first = routed.request(1, turn1, 3)
    runner.prefill([first])
    runner.run()
    k = common_blocks(routed.prompt_ids(turn1), routed.prompt_ids(twin), BS)
    from tgi_vlm.errors import InvalidBatch
    from tgi_vlm.testing.harness import make_batch

    with pytest.raises(InvalidBatch, match="request 2.*holds other content"):
        engine.batch_from_pb(make_batch(9, [routed.request(2, twin, 3, prefix_blocks=list(first.blocks)[:k],
                                                           cache_len=k * BS)]))


def test_temporal_positions_strictly_increase_for_a_4_fps_clip(engine, arch):
    """Qwen2.5-VL: a 4 fps clip keeps all 4 frames, 0.5 s per temporal patch; truncated to an int (transformers
    PR #48669) that was 0 and every patch had the same temporal position. Qwen2-VL counts patches."""
    chunks = ask(CLIPS[(4, 4)])
    prompt = engine.tokenize_request(make_request(0, *chunks))
    span = prompt.media[0]
    grid_t, grid_h, grid_w = span.pixel_inputs["video_grid_thw"][0].tolist()
    assert grid_t == 2
    per_patch = grid_h * grid_w // 4  # tokens per temporal patch after the 2×2 merge
    temporal = prompt.mm.adapter_state.rows[0, span.offset : span.end]
    starts = [int(temporal[t * per_patch]) for t in range(grid_t)]
    assert all(b > a for a, b in zip(starts, starts[1:])), starts
    if arch == "qwen2_5_vl":
        seconds = float(span.pixel_inputs["second_per_grid_ts"][0])
        assert seconds == pytest.approx(2 / 4)
        step = engine.adapter.config.vision_config.tokens_per_second * seconds
        assert [s - starts[0] for s in starts] == [int(t * step) for t in range(grid_t)]
    else:
        assert [s - starts[0] for s in starts] == list(range(grid_t))
