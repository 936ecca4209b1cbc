"""Idefics2, Idefics3 and SmolVLM: `<image>` expands to tiles wrapped in `<fake_token_around_image>`
(Idefics3 adds `<row_i_col_j>` and `<global-img>` markers). Those markers sit inside an image's span
with is_embed False; the vision output rows follow the order of the image tokens."""

from __future__ import annotations

from tgi_vlm.models.architectures.base import VlmAdapter
from tgi_vlm.models.architectures.registry import register


@register
class IdeficsAdapter(VlmAdapter):
    model_types = ("idefics2", "idefics3", "smolvlm")
