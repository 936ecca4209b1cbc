"""transformers' generate on the same prompt and images our engine builds, for parity checks."""

from __future__ import annotations

import io
from functools import lru_cache

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from tests.models.reference import Reference, hf_greedy
from tgi_vlm.media import MediaKind
from tgi_vlm.models.architectures import prompt_for
from tgi_vlm.models.architectures.llama4 import enable_transformers_generate
from tgi_vlm.testing import tiny_model_path


@lru_cache(maxsize=2)
def reference_model(arch: str, dtype: torch.dtype = torch.float32):
    enable_transformers_generate()  # transformers' own Llama4 forward needs it (see llama4.py)
    path = tiny_model_path(arch)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval()
    processor = AutoProcessor.from_pretrained(path)
    return model, processor, prompt_for(model.config.model_type)(processor, model.config)


def hf_inputs(arch: str, chunks: tuple, dtype: torch.dtype = torch.float32) -> dict:
    """The processor's tensors for a request given as text (str) / image (bytes) chunks; floating ones
    (pixel values) in `dtype`, as the engine hands them to the vision tower."""
    model, processor, adapter = reference_model(arch, dtype)
    parts = [c if isinstance(c, str) else MediaKind.IMAGE for c in chunks]
    images = [Image.open(io.BytesIO(c)).convert("RGB") for c in chunks if isinstance(c, bytes)]
    text = adapter.build_prompt(parts)
    inputs = dict(adapter.process(text, images))
    inputs.pop("labels", None)
    return {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}


def hf_reference(arch: str, chunks: tuple, max_new_tokens: int, dtype: torch.dtype = torch.float32,
                 forced: list[int] | None = None) -> Reference:
    """Greedy tokens and logits from transformers for a request given as text (str) / image (bytes) chunks
    (`forced`: transformers' logits along these tokens instead, see hf_greedy)."""
    return hf_greedy(reference_model(arch, dtype)[0], hf_inputs(arch, chunks, dtype), max_new_tokens, forced)
