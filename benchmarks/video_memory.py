"""Host memory while the shard takes in a clip at the video limits (bench Qwen2-VL, its processor: 448² pixels per
frame at most). Each case in a fresh process: load the engine as a shard does, then `tokenize_request` on one clip
(PyAV decoding of the sampled frames on the media thread, then the processor) while a thread samples the RSS every
2 ms (after one small clip warmed the code paths up); reported: the peak RSS above the RSS before, for decoding
alone (`decode_video`) and for the whole intake (`batch_from_pb`: decoding + the processor), next to the decoded
frames' own bytes.

Cases: a 1280x720 h264 clip sampled to exactly `max_video_pixels` (32 frames of 720p); a 2-minute 30 fps clip (3600
frames, sampled to `max_video_frames`: the RSS does not grow with the clip's length); a 4096x2304 clip refused from
its header (the frame-size guard: nothing decoded).

    .venv/bin/python benchmarks/video_memory.py       # writes results/video_memory.{json,md}
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results"

CASE = r"""
import json, os, sys, threading, time
from tgi_vlm.config import EngineConfig
from tgi_vlm.errors import InvalidBatch
from tgi_vlm.media import VideoBytes
from tgi_vlm.models import get_model
from tgi_vlm.testing.harness import make_batch, make_request
model, clip = sys.argv[1], open(sys.argv[2], "rb").read()
engine = get_model(model, EngineConfig(device="cpu", dtype="bfloat16", cpu_kv_cache_bytes=64 << 20))
page = os.sysconf("SC_PAGE_SIZE")
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page
peak, done = [0], threading.Event()
def watch():
    while not done.is_set():
        peak[0] = max(peak[0], rss()); time.sleep(0.002)
from tgi_vlm.video import decode_video, encode_clip, make_test_frames
warm = encode_clip(make_test_frames(4, 64, 48), 2.0, codec="h264", container="mp4")
engine.batch_from_pb(make_batch(1, [make_request(0, "Watch ", VideoBytes(warm), " what happens?")])).release()
threading.Thread(target=watch, daemon=True).start()
before = rss(); peak[0] = before
try:
    decode_video(clip, engine.config.limits, engine.adapter.prompt.frame_sampler(engine.config.limits))
except ValueError:
    pass
decode_peak = peak[0] - before
time.sleep(0.05); before = rss(); peak[0] = before
start = time.perf_counter(); error = None; frames = 0
try:
    batch = engine.batch_from_pb(make_batch(1, [make_request(0, "Watch ", VideoBytes(clip), " what happens?")]))
    span = batch.seqs[0].mm.media[0]; frames = int(span.pixel_inputs["video_grid_thw"][0][0]) * 2; tokens = span.length
    batch.release()
except InvalidBatch as exc:
    error, tokens = str(exc), 0
seconds = time.perf_counter() - start
done.set(); time.sleep(0.01)
print(json.dumps(dict(rss_before=before, peak_above=peak[0] - before, decode_peak_above=decode_peak, seconds=seconds, sampled_frames=frames,
                      clip_tokens=tokens, clip_bytes=len(clip), error=error)))
"""


def write_clip(path: Path, frames: int, width: int, height: int, fps: int) -> None:
    """Moving gradients (compress like real footage, unlike noise), h264 in mp4."""
    import av
    import numpy as np

    ys, xs = np.mgrid[0:height, 0:width]
    with av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream("h264", rate=fps, options={"preset": "ultrafast"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for t in range(frames):
            pixels = np.stack([(xs + 3 * t) % 256, (ys + 2 * t) % 256, (xs + ys + t) % 256], -1).astype(np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        out.mux(stream.encode())


def main() -> None:
    from tgi_vlm.config import InputLimits
    from tgi_vlm.testing import build_tiny_model

    limits = InputLimits()
    cases = {"720p, 16 s at 30 fps (32 sampled frames = max_video_pixels)": (480, 1280, 720, 30),
             "320x240, 120 s at 30 fps (3600 frames, 32 sampled)": (3600, 320, 240, 30),
             "4096x2304, 1 frame (over max_video_frame_pixels)": (1, 4096, 2304, 1)}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model("qwen2_vl", Path(tmp) / "bench", size="bench")
        for name, (frames, width, height, fps) in cases.items():
            clip = Path(tmp) / "clip.mp4"
            write_clip(clip, frames, width, height, fps)
            out = subprocess.run([sys.executable, "-c", CASE, str(model), str(clip)], capture_output=True, text=True,
                                 check=True).stdout.strip().splitlines()[-1]
            results[name] = {**json.loads(out), "decoded_frame_bytes": 0 if frames == 1 else 32 * width * height * 3}
            print(name, results[name], flush=True)
    lines = ["# Host memory taking in one clip, bench Qwen2-VL (bf16), default video limits", "",
             f"Limits: max_video_pixels {limits.max_video_pixels}, max_video_frames {limits.max_video_frames}, "
             f"max_video_frame_pixels {limits.max_video_frame_pixels}, video_fps {limits.video_fps}.", "",
             "| clip | file MB | sampled frames | clip tokens | decoded frames MB | decoding alone: peak RSS above before MB "
             "| intake (decoding + processor): peak RSS above before MB | intake s | refused |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['clip_bytes'] / 1e6:.2f} | {r['sampled_frames']} | {r['clip_tokens']} | "
                     f"{r['decoded_frame_bytes'] / 1e6:.1f} | {r['decode_peak_above'] / 1e6:.1f} | {r['peak_above'] / 1e6:.1f} | {r['seconds']:.2f} | "
                     f"{'yes' if r['error'] else 'no'} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "video_memory.json").write_text(json.dumps(results, indent=1))
    (RESULTS / "video_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
