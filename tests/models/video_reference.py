"""transformers' own path for a prompt with clips, built apart from the engine's: the test decodes the clip
with its own PyAV loop (every frame), and the processor samples the frames itself (`do_sample_frames=True` at
the server's rate), so the engine's decoder, frame sampler and metadata are checked, not reused."""

from __future__ import annotations

import io
from functools import lru_cache

import av
import numpy as np
import torch
from PIL import Image
from transformers.video_utils import VideoMetadata

from tests.models.reference import Reference, hf_greedy
from tests.models.vlm_reference import reference_model
from tgi_vlm.config import InputLimits
from tgi_vlm.media import MediaKind, VideoBytes


def all_frames(data: bytes) -> tuple[np.ndarray, float]:
    """([N, H, W, 3] uint8 every frame, the stream's average rate)."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        return np.stack(frames), float(stream.average_rate)


def kind_of(chunk) -> MediaKind | str:
    if isinstance(chunk, str):
        return chunk
    return MediaKind.VIDEO if isinstance(chunk, VideoBytes) else MediaKind.IMAGE


def video_inputs(arch: str, chunks: tuple, fps: float = InputLimits.video_fps) -> dict:
    """The processor's tensors for text (str) / image (bytes) / clip (VideoBytes) chunks."""
    _, processor, prompt = reference_model(arch)
    text = prompt.build_prompt([kind_of(c) for c in chunks])
    images = [Image.open(io.BytesIO(c)).convert("RGB") for c in chunks if isinstance(c, bytes)]
    decoded = [all_frames(c.data) for c in chunks if isinstance(c, VideoBytes)]
    kwargs = {"images": images} if images else {}
    if decoded:
        kwargs.update(videos=[frames for frames, _ in decoded], do_sample_frames=True, fps=fps,
                      video_metadata=[VideoMetadata(total_num_frames=len(f), fps=rate) for f, rate in decoded])
    inputs = dict(processor(text=[text], return_tensors="pt", **kwargs))
    return {k: v for k, v in inputs.items() if k != "labels"}


def rope_index(arch: str, inputs: dict) -> torch.Tensor:
    """[3, prompt_len] mrope positions from the model's own get_rope_index."""
    model = reference_model(arch)[0]
    extra = {k: inputs[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in inputs}
    positions, _ = model.model.get_rope_index(input_ids=inputs["input_ids"],
                                              mm_token_type_ids=inputs["mm_token_type_ids"], **extra)
    return positions[:, 0, :]


@lru_cache(maxsize=32)  # clips are hashable (VideoBytes): a scenario's reference is computed once
def video_reference(arch: str, chunks: tuple, max_new_tokens: int) -> Reference:
    return hf_greedy(reference_model(arch)[0], video_inputs(arch, chunks), max_new_tokens)
