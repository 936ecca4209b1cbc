"""Gemma3: each image's soft tokens attend to each other both ways (not across images); the
text model mixes sliding-window and full layers (the sliding window arrives as a keyword)."""

from __future__ import annotations

import torch

from tgi_vlm.media import MediaKind
from tgi_vlm.models.architectures.base import VlmAdapter, VlmPrompt
from tgi_vlm.models.architectures.registry import register


class Gemma3Prompt(VlmPrompt):
    def placeholder(self, kind: MediaKind) -> str:
        return self.processor.boi_token  # the processor expands <start_of_image> into the full block

    def bidirectional_groups(self, processed: dict, input_ids: list[int], spans: list) -> torch.Tensor | None:
        groups = torch.full((len(input_ids),), -1, dtype=torch.long)
        for span in spans:  # transformers groups contiguous runs of image tokens; one run per image
            groups[span.offset : span.end][span.is_embed] = span.index
        return groups


@register
class Gemma3Adapter(VlmAdapter):
    model_types = ("gemma3",)
    prompt_type = Gemma3Prompt
