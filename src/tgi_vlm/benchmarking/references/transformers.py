"""The transformers reference: the workload's requests in-process through transformers' own `generate`,
as static batches of `batch_size` (left-padded, greedy, EOS neither stopping nor masked, each request's
output cut to its own length), in the dtype the served run used so both sides do the same arithmetic."""

from __future__ import annotations

import io
import time

from tgi_vlm.benchmarking.results import ReferenceResult
from tgi_vlm.benchmarking.synthetic import WorkItem
from tgi_vlm.media import MediaKind, VideoBytes


def _kind(chunk) -> str | MediaKind:
    if isinstance(chunk, str):
        return chunk
    return MediaKind.VIDEO if isinstance(chunk, VideoBytes) else MediaKind.IMAGE


def _video_kwargs(clips: list[VideoBytes]) -> dict:
    """Every frame of each clip (PyAV), sampled by the processor itself at the shard's default rate."""
    if not clips:
        return {}
    import av
    import numpy as np
    from transformers.video_utils import VideoMetadata

    from tgi_vlm.config import InputLimits

    videos, metadata = [], []
    for clip in clips:
        with av.open(io.BytesIO(clip.data)) as container:
            stream = container.streams.video[0]
            videos.append(np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)]))
            metadata.append(VideoMetadata(total_num_frames=len(videos[-1]), fps=float(stream.average_rate)))
    return {"videos": videos, "video_metadata": metadata, "do_sample_frames": True, "fps": InputLimits.video_fps}


def run_reference(model_id: str, items: list[WorkItem], batch_size: int, progress=None,
                  dtype: str = "float32") -> ReferenceResult:
    """`dtype`: the serving run's, so both sides do the same arithmetic."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from tgi_vlm.models.architectures import prompt_for
    from tgi_vlm.models.architectures.llama4 import enable_transformers_generate

    enable_transformers_generate()  # the reference runs transformers' own generate
    model = AutoModelForImageTextToText.from_pretrained(model_id, dtype=getattr(torch, dtype)).eval()
    processor = AutoProcessor.from_pretrained(model_id)
    processor.tokenizer.padding_side = "left"
    prompt = prompt_for(model.config.model_type)(processor, model.config)

    def inputs_for(batch: list[WorkItem]) -> dict:
        texts = [prompt.build_prompt([_kind(c) for c in it.params.chunks]) for it in batch]
        images = [Image.open(io.BytesIO(c)).convert("RGB") for it in batch for c in it.params.chunks if isinstance(c, bytes)]
        kwargs = {"images": images} if images else {}
        kwargs.update(_video_kwargs([c for it in batch for c in it.params.chunks if isinstance(c, VideoBytes)]))
        inputs = dict(processor(text=texts, return_tensors="pt", padding=True, **kwargs))
        inputs.pop("labels", None)
        return inputs

    def generate(inputs: dict, n: int):
        with torch.inference_mode():
            # like ignore_eos_token: EOS neither stops generation nor is masked (min_new_tokens would mask it)
            return model.generate(**inputs, max_new_tokens=n, eos_token_id=None, do_sample=False)

    generate(inputs_for(items[:1]), 2)  # warm
    outputs: list[list[int]] = []
    latencies = []
    start = time.perf_counter()
    for b in range(0, len(items), batch_size):
        batch = items[b : b + batch_size]
        t0 = time.perf_counter()
        inputs = inputs_for(batch)
        n = max(it.params.max_new_tokens for it in batch)
        sequences = generate(inputs, n)[:, inputs["input_ids"].shape[1] :]
        latencies.append(time.perf_counter() - t0)
        outputs += [row[: it.params.max_new_tokens].tolist() for row, it in zip(sequences, batch)]
        if progress is not None:
            progress(len(batch))
    return ReferenceResult(time.perf_counter() - start, outputs, latencies, dtype)


def reference_dtype(model_id: str, serving_dtype: str | None, requested: str | None) -> str:
    """The reference runs on this CPU in the dtype the shard ran in; over HTTP, where the shard's dtype is not
    reported, in `requested` (bench --dtype) or what a shard here would pick by default (tgi_vlm.dtypes)."""
    if serving_dtype:
        return serving_dtype
    from transformers import AutoConfig

    from tgi_vlm.dtypes import checkpoint_dtype, cpu_has_native_bf16, resolve_dtype

    config = AutoConfig.from_pretrained(model_id)
    return resolve_dtype(requested, "cpu", checkpoint_dtype(config), cpu_has_native_bf16(), config.model_type).name
