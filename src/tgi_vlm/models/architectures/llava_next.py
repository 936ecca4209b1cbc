"""LLaVA-NeXT (anyres): the defaults fit. The processor expands `<image>` to the packed grid
(base features + tiles + row newlines); `get_image_features` returns the same packing per image."""

from __future__ import annotations

from tgi_vlm.models.architectures.base import VlmAdapter
from tgi_vlm.models.architectures.registry import register


@register
class LlavaNextAdapter(VlmAdapter):
    model_types = ("llava_next",)
