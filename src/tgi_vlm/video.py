"""Videos: decoding untrusted bytes into sampled RGB frames with PyAV, and making deterministic clips.

The engine, the router and the tests all sit above this module (it imports no engine code).

A clip is read in two passes over the in-memory container: the demuxer counts the stream's packets
(no pixels decoded) so the frame sampler knows how many frames there are, then the decoder runs and
only the sampled frames are converted to RGB. Held memory is bounded by the sampled frames:
at most `InputLimits.max_video_pixels` pixels (3 bytes each), whatever the clip's length.

Checks, each refusing the clip with a `VideoError` that says which limit: size in bytes, a video
stream present, its codec in the allowed list (`video_codecs`: FFmpeg's rarer decoders are attack
surface), the frame size from the stream header against `max_video_frame_pixels` before any frame is
decoded (a tiny file can declare a huge frame), duration, source frame count, total sampled pixels,
and the decode deadline (`video_decode_timeout_s`, checked between packets and frames).

The mimetype is ignored: the container is sniffed from the bytes, as for images.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from tgi_vlm.config import InputLimits

# (source frame count, source fps) → the indices of the frames to keep, ascending. The architecture's
# processor decides (`VlmPrompt.frame_sampler`); the decoder only enforces the limits around it.
FrameSampler = Callable[[int, float], list[int]]


class VideoError(ValueError):
    """The bytes are not an acceptable video; the message says why."""


@dataclass(frozen=True)
class DecodedVideo:
    """The sampled frames of a clip and the facts needed to place them in time."""

    frames: np.ndarray  # [T, H, W, 3] uint8 RGB, T = len(indices)
    indices: tuple[int, ...]  # positions of the kept frames among the source's frames, ascending
    total_frames: int  # frames in the source stream
    fps: float  # the source's frame rate

    @property
    def sampled_fps(self) -> float:
        """Frames kept per second of clip: with uniform sampling, T / total_frames * fps (what Qwen2.5-VL's
        `second_per_grid_ts = temporal_patch_size / sampled_fps` needs; never rounded)."""
        return len(self.indices) / self.total_frames * self.fps

    @property
    def timestamps(self) -> list[float]:
        """Seconds from the clip's start of each kept frame."""
        return [i / self.fps for i in self.indices]

    @property
    def nbytes(self) -> int:
        return int(self.frames.nbytes)


def decode_video(data: bytes, limits: InputLimits, sample: FrameSampler) -> DecodedVideo:
    """The frames `sample` picks out of the clip in `data`; VideoError for anything unacceptable."""
    import av  # the `video` extra; imported here so image-only installs never need it

    if not data:
        raise VideoError("video is empty (0 bytes)")
    if len(data) > limits.max_video_bytes:
        raise VideoError(f"video is {len(data)} bytes, over the limit of {limits.max_video_bytes}")
    deadline = time.monotonic() + limits.video_decode_timeout_s
    try:
        total, fps, (width, height) = _probe(av, data, limits, deadline)
        indices = _checked_indices(sample(total, fps), total)
        if len(indices) > limits.max_video_frames:  # a processor configured with its own num_frames ignores the cap
            raise VideoError(f"frame sampling keeps {len(indices)} frames, over the limit of {limits.max_video_frames}")
        pixels = len(indices) * width * height
        if pixels > limits.max_video_pixels:
            raise VideoError(f"video needs {len(indices)} frames of {width}x{height} = {pixels} decoded pixels, over "
                             f"the limit of {limits.max_video_pixels}; send a shorter or smaller clip")
        frames = _decode_frames(av, data, indices, (width, height), deadline, limits)
    except VideoError:
        raise
    except av.FFmpegError as exc:
        raise VideoError(f"corrupt or truncated video: {exc}") from None
    except (OSError, ValueError, EOFError, MemoryError) as exc:
        raise VideoError(f"cannot decode video: {type(exc).__name__}: {exc}") from None
    return DecodedVideo(frames=frames, indices=tuple(indices), total_frames=total, fps=fps)


def _open(av, data: bytes):
    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except av.FFmpegError as exc:
        raise VideoError(f"cannot read the container (corrupt, truncated or not a video): {exc}") from None
    if not container.streams.video:
        container.close()
        raise VideoError("the file holds no video stream (a track without frames is none)")
    return container


def _probe(av, data: bytes, limits: InputLimits, deadline: float) -> tuple[int, float, tuple[int, int]]:
    """(source frame count, fps, (width, height)) from the header and the demuxer alone."""
    with _open(av, data) as container:
        stream = container.streams.video[0]
        codec = stream.codec_context.name
        if codec not in limits.video_codecs:
            raise VideoError(f"video codec {codec!r} is not accepted; accepted: {', '.join(limits.video_codecs)}")
        width, height = stream.codec_context.width, stream.codec_context.height
        if width <= 0 or height <= 0:
            raise VideoError(f"video stream declares no frame size ({width}x{height})")
        if width * height > limits.max_video_frame_pixels:
            raise VideoError(f"video frames are {width}x{height} = {width * height} pixels, over the limit of "
                             f"{limits.max_video_frame_pixels} pixels per frame")
        total, first, last = 0, None, None
        for packet in container.demux(stream):
            if packet.size == 0:  # the demuxer's end-of-stream marker
                continue
            total += 1
            if packet.pts is not None:
                first = packet.pts if first is None else min(first, packet.pts)
                last = packet.pts if last is None else max(last, packet.pts)
            if total > limits.max_video_source_frames:
                raise VideoError(f"video has more than {limits.max_video_source_frames} frames (the frame limit)")
            _check_deadline(deadline, limits)
        if total == 0:
            raise VideoError("video has no frames")
        fps = _frame_rate(stream, total, first, last)
        seconds = total / fps
        if seconds > limits.max_video_seconds:
            raise VideoError(f"video is {seconds:.1f} s long, over the limit of {limits.max_video_seconds} s")
        return total, fps, (width, height)


def _frame_rate(stream, total: int, first_pts: int | None, last_pts: int | None) -> float:
    """The stream's declared average rate; else frames over the pts span."""
    rate = stream.average_rate or stream.guessed_rate
    if rate and float(rate) > 0:
        return float(rate)
    if first_pts is not None and last_pts is not None and last_pts > first_pts and stream.time_base and total > 1:
        return (total - 1) / float((last_pts - first_pts) * stream.time_base)
    raise VideoError("video declares no frame rate and its timestamps give none")


def _checked_indices(indices: list[int], total: int) -> list[int]:
    indices = [int(i) for i in indices]
    if not indices:
        raise VideoError("frame sampling kept no frames")
    if any(b <= a for a, b in zip(indices, indices[1:])) or indices[0] < 0 or indices[-1] >= total:
        raise VideoError(f"frame sampling gave indices outside 0..{total - 1} or out of order")  # a sampler bug
    return indices


def _decode_frames(av, data: bytes, indices: list[int], size: tuple[int, int], deadline: float,
                   limits: InputLimits) -> np.ndarray:
    """[len(indices), H, W, 3] uint8: the frames at `indices`, converted only where kept."""
    width, height = size
    out = np.empty((len(indices), height, width, 3), dtype=np.uint8)
    wanted = iter(enumerate(indices))
    slot, target = next(wanted)
    with _open(av, data) as container:
        stream = container.streams.video[0]
        for position, frame in enumerate(container.decode(stream)):
            _check_deadline(deadline, limits)
            if position != target:
                continue
            if (frame.width, frame.height) != (width, height):
                raise VideoError(f"frame {position} is {frame.width}x{frame.height}, the stream declared "
                                 f"{width}x{height} (frame size changes are not accepted)")
            out[slot] = frame.to_ndarray(format="rgb24")
            nxt = next(wanted, None)
            if nxt is None:
                return out
            slot, target = nxt
    raise VideoError(f"corrupt or truncated video: only {slot} of its {len(indices)} sampled frames decoded")


def _check_deadline(deadline: float, limits: InputLimits) -> None:
    if time.monotonic() > deadline:
        raise VideoError(f"video took longer than {limits.video_decode_timeout_s} s to decode (the decode time limit)")


# ----- deterministic clips for workloads, demos and tests -----
def make_test_frames(num_frames: int, width: int, height: int, seed: int = 0) -> np.ndarray:
    """[num_frames, height, width, 3] uint8 noise; the same seed gives the same pixels."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(num_frames, height, width, 3), dtype=np.uint8)


def encode_clip(frames: np.ndarray, fps: float, *, codec: str = "ffv1", container: str = "matroska") -> bytes:
    """The frames `[T, H, W, 3]` uint8 as a clip at `fps`; the default ffv1-in-Matroska is lossless, so
    decoding gives the frames back exactly (h264 / mp4 for realistic, lossy clips)."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=Fraction(fps).limit_denominator(1000))
        stream.height, stream.width = frames.shape[1], frames.shape[2]
        stream.pix_fmt = "bgr0" if codec == "ffv1" else "yuv420p"
        for pixels in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buffer.getvalue()
