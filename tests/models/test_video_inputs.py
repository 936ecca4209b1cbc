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
from tests.unit.test_video_decoding import unsupported_codec_clip, zero_frame_mp4
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


def huge_frame_clip() -> bytes:
    """A decompression bomb: one 4096x2304 frame of one colour, a few kB."""
    import numpy as np

    return encode_clip(np.zeros((1, 2304, 4096, 3), np.uint8), 1.0, codec="mpeg4")


# case → (clip bytes, limits changed for the case, what the refusal says)
BAD = {
    "corrupt": (lambda: encode_clip(make_test_frames(4, 56, 42), 2.0, codec="h264", container="mp4")[:900], {},
                "corrupt, truncated or not a video"),
    "not_a_video": (lambda: b"plain text, not a clip " * 10, {}, "corrupt, truncated or not a video"),
    "zero_frames": (zero_frame_mp4, {}, "no video stream"),
    "unsupported_codec": (unsupported_codec_clip, {}, "codec 'qtrle' is not accepted"),
    "over_the_frame_limit": (lambda: encode_clip(make_test_frames(40, 28, 28), 2.0), {"max_video_source_frames": 32},
                             "more than 32 frames"),
    "over_the_byte_limit": (lambda: CLIP.data, {"max_video_bytes": 1000}, "over the limit of 1000"),
    "over_the_pixel_limit": (lambda: CLIP.data, {"max_video_pixels": 1000}, "decoded pixels, over the limit of 1000"),
    "over_the_length_limit": (lambda: CLIP.data, {"max_video_seconds": 1.0}, "2.0 s long, over the limit of 1.0 s"),
    "over_the_time_limit": (lambda: CLIP.data, {"video_decode_timeout_s": 1e-9}, "decode time limit"),
    "decompression_bomb": (huge_frame_clip, {}, "4096x2304 = 9437184 pixels, over the limit"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_clip_is_refused_naming_the_request_and_the_batch_goes_on(engine, arch, case, monkeypatch):
    make, changes, reason = BAD[case]
    runner = Runner(engine)
    runner.prefill([make_request(0, *GOOD, max_new_tokens=5)])  # running before the bad batch, under the defaults
    set_limits(engine, monkeypatch, **changes)
    with pytest.raises(InvalidBatch) as info:
        engine.batch_from_pb(make_batch(2, [make_request(7, "text only"), make_request(8, "bad ", VideoBytes(make()),
                                                                                        " clip")]))
    assert info.value.request_ids == [8]
    assert "request 8: video 0:" in str(info.value) and reason in str(info.value), str(info.value)
    monkeypatch.undo()
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
