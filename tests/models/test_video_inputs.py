"""Video requests at the shard: a bad clip, too many clips, a truncation through a clip, or a clip sent to a
model without video refuse that request only (named, with the reason) while the rest of the batch goes on;
clips decode on the media threads, not the model thread; the encoder cache accounts a clip's feature bytes."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from tests.conftest import load_engine
from tests.models.reference import assert_matches
from tests.models.video_reference import video_reference
from tgi_vlm.config import InputLimits
from tgi_vlm.errors import InvalidBatch
from tgi_vlm.media import MediaKind, VideoBytes
from tgi_vlm.testing.harness import Runner, make_batch, make_request
from tgi_vlm.video import encode_clip, make_test_frames

CLIP = VideoBytes(encode_clip(make_test_frames(4, 56, 42, seed=1), 2.0), "video/x-matroska")
CLIP_KIND = MediaKind.VIDEO
GOOD = ("Watch ", CLIP, " and say what happens.")


@pytest.fixture(scope="module")
def arch():
    return "qwen2_vl"


def set_limits(engine, monkeypatch, **changes) -> None:
    limits = replace(InputLimits(), **changes)
    monkeypatch.setattr(engine, "config", replace(engine.config, limits=limits))
    monkeypatch.setattr(engine.media_prefetch, "limits", limits)


BAD = {
    "corrupt": (encode_clip(make_test_frames(4, 56, 42), 2.0, codec="h264", container="mp4")[:900],
                "corrupt, truncated or not a video"),
    "not_a_video": (b"plain text, not a clip " * 10, "corrupt, truncated or not a video"),
    "over_the_frame_limit": (encode_clip(make_test_frames(40, 28, 28), 2.0), "more than 32 frames"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_clip_is_refused_naming_the_request_and_the_batch_goes_on(engine, arch, case, monkeypatch):
    data, reason = BAD[case]
    set_limits(engine, monkeypatch, max_video_source_frames=32)
    runner = Runner(engine)
    runner.prefill([make_request(0, *GOOD, max_new_tokens=5)])
    with pytest.raises(InvalidBatch) as info:
        engine.batch_from_pb(make_batch(2, [make_request(7, *GOOD), make_request(8, "bad ", VideoBytes(data), " clip")]))
    assert info.value.request_ids == [8]
    assert "request 8: video 0:" in str(info.value) and reason in str(info.value), str(info.value)
    runner.prefill([make_request(7, *GOOD, max_new_tokens=4)], batch_id=2)  # the router resends the good one
    runner.run()
    assert_matches(runner, 0, video_reference(arch, GOOD, 5))
    assert_matches(runner, 7, video_reference(arch, GOOD, 4))
    assert engine.kv_blocks_in_use == 0 and engine.encoder_cache.num_entries == 0


def test_clips_decode_on_the_media_threads_not_the_model_thread(engine, monkeypatch):
    import tgi_vlm.models.vlm_intake as intake

    threads: list[str] = []
    real = intake.DECODERS[CLIP_KIND].decode
    monkeypatch.setitem(intake.DECODERS, CLIP_KIND, replace(
        intake.DECODERS[CLIP_KIND],
        decode=lambda *a: threads.append(threading.current_thread().name) or real(*a)))
    batch = engine.batch_from_pb(make_batch(3, [make_request(1, *GOOD), make_request(2, "two ", CLIP, CLIP)]))
    batch.release()
    assert len(threads) == 3 and all(t.startswith("tgi-vlm-media") for t in threads), threads


def test_too_many_clips_and_a_truncation_through_a_clip_are_refused(engine, monkeypatch):
    set_limits(engine, monkeypatch, max_videos_per_request=1)
    span = engine.tokenize_request(make_request(0, *GOOD)).media[0]
    cut = len(engine.tokenize_request(make_request(0, *GOOD)).ids) - (span.offset + 1)
    with pytest.raises(InvalidBatch) as info:
        engine.batch_from_pb(make_batch(4, [make_request(5, "a ", CLIP, " b ", CLIP), make_request(6, *GOOD, truncate=cut)]))
    assert info.value.request_ids == [5, 6]
    assert "request 5: more than 1 videos in one request" in str(info.value)
    assert "request 6: truncate=" in str(info.value) and "would cut video 0" in str(info.value)


def test_the_encoder_cache_accounts_a_clips_feature_bytes(engine, runner):
    engine.encoder_cache.clear_shared()
    runner.prefill([make_request(0, *GOOD, max_new_tokens=2)])
    runner.run()
    span = engine.tokenize_request(make_request(0, *GOOD)).media[0]
    hidden = engine.adapter.config.get_text_config().hidden_size
    assert engine.encoder_cache.shared_bytes == span.num_embed * hidden * 4  # float32 rows, one per clip token


def test_a_model_without_video_refuses_a_clip_naming_the_request():
    engine = load_engine("llava_next")
    with pytest.raises(InvalidBatch) as info:
        engine.batch_from_pb(make_batch(1, [make_request(3, *GOOD)]))
    assert info.value.request_ids == [3]
    assert "request 3: model_type 'llava_next'" in str(info.value) and "takes no video inputs" in str(info.value)
