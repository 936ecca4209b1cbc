"""Qwen2-VL and Qwen2.5-VL: 3-row mrope positions (temporal, height, width).

Prefill positions come from the model's own `get_rope_index` over the (truncated) prompt; a
generated token at position p gets `p + delta` on all three rows, delta being the gap that the
image grids opened in the text positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgi_vlm.media import MediaKind
from tgi_vlm.models.architectures.base import PromptPart, VlmAdapter, VlmPrompt, _to
from tgi_vlm.models.architectures.registry import register


@dataclass
class MropePositions:
    """A sequence's prompt positions `[3, prompt_len]` (CPU) and the delta for generated tokens."""

    rows: torch.Tensor
    delta: int


class Qwen2VLPrompt(VlmPrompt):
    def placeholder(self, kind: MediaKind) -> str:
        # The chat template wraps the pad token; the processor expands only <|image_pad|>.
        return "<|vision_start|>" + self.processor.image_token + "<|vision_end|>"

    def expanded_ids(self, parts: list[PromptPart], items: list, add_special_tokens: bool = True
                     ) -> tuple[list[int], list[int]] | None:
        """An image's token count depends only on its size here: the processor's own
        `_get_num_multimodal_tokens` (its resize rule, patch and merge sizes, with the settings its call
        would merge, the tokenizer's init kwargs included) gives it, and the processor tokenizes the
        prompt with each <|image_pad|> repeated that many times. Done the same way, without resizing and
        normalizing pixels (~4 ms of the router's ~6 ms per one-image request).
        None (use the processor) when the prompt holds other media than images, or other image or video
        tokens than the placeholders (the processor decides, or refuses), or when the processor does
        not resize."""
        if any(not isinstance(p, str) and p is not MediaKind.IMAGE for p in parts):
            return None
        images = items  # the prompt's media are all images (checked above)
        text = self.build_prompt(parts)
        token, video = self.processor.image_token, getattr(self.processor, "video_token", None)
        if text.count(token) != len(images) or (video and video in text):
            return None
        if getattr(self.processor.image_processor, "do_resize", True) is False:
            return None
        counts = []
        if images:
            counts = self.processor._get_num_multimodal_tokens(
                image_sizes=[(image.height, image.width) for image in images],
                tokenizer_init_kwargs=self.tokenizer.init_kwargs,
            )["num_image_tokens"]
        pieces = text.split(token)  # one more piece than images: the placeholders are the only tokens
        expanded = pieces[0] + "".join(token * int(n) + piece for n, piece in zip(counts, pieces[1:]))
        ids = self.tokenizer(expanded, add_special_tokens=add_special_tokens)["input_ids"]
        return ids, [int(n) for n in counts]


@register
class Qwen2VLAdapter(VlmAdapter):
    model_types = ("qwen2_vl", "qwen2_5_vl")
    prompt_type = Qwen2VLPrompt
    position_rows = 3

    def encode(self, kind: MediaKind, inputs: list[dict]) -> list[torch.Tensor]:
        # One vision call for all images: the tower keeps images apart through cu_seqlens.
        device, dtype = self.vision_device_dtype()
        pixels = torch.cat([p["pixel_values"] for p in inputs])
        grids = torch.cat([p["image_grid_thw"] for p in inputs])
        out = self.model.model.get_image_features(
            pixel_values=_to(pixels, device, dtype), image_grid_thw=grids.to(device), return_dict=True
        )
        return list(out.pooler_output)

    def adapter_state(self, processed: dict, input_ids: list[int], spans: list) -> MropePositions:
        n = len(input_ids)
        if not spans:
            return MropePositions(rows=torch.arange(n).expand(3, n).clone(), delta=0)
        grids = torch.cat([s.pixel_inputs["image_grid_thw"] for s in spans])
        positions, delta = self.model.model.get_rope_index(
            input_ids=torch.tensor([input_ids]),
            mm_token_type_ids=processed["mm_token_type_ids"],
            image_grid_thw=grids,
        )
        return MropePositions(rows=positions[:, 0, :].cpu(), delta=int(delta.reshape(-1)[0]))

    def position_ids(self, step) -> torch.Tensor:
        """[3, 1, T]: prompt windows take their precomputed rows; generated tokens p + delta."""
        device = step.positions.device
        states: list[MropePositions] = [w.seq.mm.adapter_state for w in step.windows]
        lengths = torch.tensor([w.end - w.start for w in step.windows])
        deltas = torch.tensor([0 if w.start < w.seq.prompt_len else st.delta for w, st in zip(step.windows, states)])
        offsets = torch.repeat_interleave(deltas, lengths).to(device)
        rows = (step.positions + offsets).expand(3, -1).clone()
        for w, st in zip(step.windows, states):
            if w.start < w.seq.prompt_len:
                rows[:, w.row : w.row + w.end - w.start] = st.rows[:, w.start : w.end].to(device)
        return rows[:, None, :]
