"""Decoding untrusted clips (video.py): the sampled frames come back exact from a lossless clip with the
source's rate and indices; every limit and every kind of bad file is a VideoError saying which."""

from __future__ import annotations

import io
from dataclasses import replace

import av
import numpy as np
import pytest

from tgi_vlm.config import InputLimits
from tgi_vlm.images import make_test_image, png_bytes
from tgi_vlm.video import VideoError, decode_video, encode_clip, make_test_frames

FRAMES = make_test_frames(8, 64, 48, seed=7)
CLIP = encode_clip(FRAMES, 4.0)  # lossless: 8 frames at 4 fps, 2 s
MP4 = encode_clip(FRAMES, 4.0, codec="h264", container="mp4")
LIMITS = InputLimits()


def every_other(total: int, fps: float) -> list[int]:
    return list(range(0, total, 2))


def refused(data: bytes, limits: InputLimits = LIMITS) -> str:
    with pytest.raises(VideoError) as info:
        decode_video(data, limits, every_other)
    return str(info.value)


def test_a_lossless_clip_gives_back_exactly_the_sampled_frames_with_its_rate():
    video = decode_video(CLIP, LIMITS, every_other)
    assert video.indices == (0, 2, 4, 6) and video.total_frames == 8 and video.fps == 4.0
    assert np.array_equal(video.frames, FRAMES[::2])
    assert video.sampled_fps == 2.0 and video.timestamps == [0.0, 0.5, 1.0, 1.5]


def test_an_h264_mp4_decodes_to_the_frames_pyav_gives():
    video = decode_video(MP4, LIMITS, every_other)
    with av.open(io.BytesIO(MP4)) as container:
        reference = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert video.total_frames == 8 and np.array_equal(video.frames, np.stack(reference[::2]))


def zero_frame_mp4() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as out:
        stream = out.add_stream("h264", rate=4)
        stream.width, stream.height = 64, 48
        out.start_encoding()
    return buffer.getvalue()


def unsupported_codec_clip() -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mov") as out:
        stream = out.add_stream("qtrle", rate=4)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "rgb24"
        for pixels in FRAMES[:2]:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        out.mux(stream.encode())
    return buffer.getvalue()


BAD = {
    "empty": (lambda: b"", LIMITS, "empty"),
    "truncated": (lambda: MP4[: len(MP4) // 2], LIMITS, "corrupt, truncated or not a video"),
    "not_a_video": (lambda: b"plain text, not a clip " * 20, LIMITS, "corrupt, truncated or not a video"),
    "an_image": (lambda: png_bytes(make_test_image(30, 30)), LIMITS, "codec 'png' is not accepted"),
    "zero_frames": (zero_frame_mp4, LIMITS, "no video stream"),
    "unsupported_codec": (unsupported_codec_clip, LIMITS, "codec 'qtrle' is not accepted"),
    "over_bytes": (lambda: CLIP, replace(LIMITS, max_video_bytes=1000), "over the limit of 1000"),
    "over_frames": (lambda: CLIP, replace(LIMITS, max_video_source_frames=5), "more than 5 frames"),
    "over_seconds": (lambda: CLIP, replace(LIMITS, max_video_seconds=1.5), "2.0 s long, over the limit of 1.5 s"),
    "over_sampled_frames": (lambda: CLIP, replace(LIMITS, max_video_frames=3), "keeps 4 frames, over the limit of 3"),
    "over_pixels": (lambda: CLIP, replace(LIMITS, max_video_pixels=4 * 64 * 48 - 1), "decoded pixels, over"),
    "over_time": (lambda: CLIP, replace(LIMITS, video_decode_timeout_s=1e-9), "decode time limit"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_clip_is_refused_saying_why(case):
    make, limits, reason = BAD[case]
    assert reason in refused(make(), limits)


def test_a_tiny_file_declaring_huge_frames_is_refused_before_any_frame_is_decoded():
    """A decompression bomb: a 4096x2304 frame of one colour compresses to a few kB; the header's size is checked first."""
    bomb = encode_clip(np.zeros((1, 2304, 4096, 3), np.uint8), 1.0, codec="mpeg4", container="matroska")
    assert len(bomb) < 200_000
    assert "4096x2304 = 9437184 pixels, over the limit of 8847360 pixels per frame" in refused(bomb)
