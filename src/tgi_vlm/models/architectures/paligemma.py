"""PaliGemma: the prompt is `<image>`×N + `<bos>` + text + `\\n` (the processor builds it when the
images come first), the whole prefix (image + prompt) attends both ways, and positions start at 1."""

from __future__ import annotations

import logging

import torch

from tgi_vlm.media import MediaKind
from tgi_vlm.models.architectures.base import PromptPart, VlmAdapter, VlmPrompt
from tgi_vlm.models.architectures.registry import register


class PaliGemmaPrompt(VlmPrompt):
    def build_prompt(self, parts: list[PromptPart]) -> str:
        # PaliGemma's convention: images first, then the text; the processor adds <bos> and "\n".
        return "".join(p for p in parts if isinstance(p, str))

    def __init__(self, processor, hf_config):
        super().__init__(processor, hf_config)
        # The processor warns on every call whose text has no <image> tokens, which is the convention
        # it documents for building "<image>"*n + <bos> + text + "\n" itself: keep our logs quiet.
        logging.getLogger("transformers.models.paligemma.processing_paligemma").setLevel(logging.ERROR)

    def process(self, text: str, images: list, add_special_tokens: bool = True,
                kinds: list[MediaKind] | None = None) -> dict:
        # Every item is an image (intake refused any other kind). PaliGemma's prompt layout always carries <bos> after the images (TGI forces it too).
        if not images:  # text-only: the same layout without image tokens
            ids = self.tokenizer(self.tokenizer.bos_token + text + "\n", add_special_tokens=False, return_tensors="pt")
            return {"input_ids": ids["input_ids"], "token_type_ids": torch.zeros_like(ids["input_ids"])}
        out = dict(self.processor(text=[text], images=[images], return_tensors="pt"))
        out.pop("labels", None)  # returned even without a suffix
        return out

    def only_media_inputs(self, kind: MediaKind, processed: dict) -> dict:
        return {"pixel_values": processed["pixel_values"]}

    def media_inputs(self, kind: MediaKind, item) -> tuple[dict, int]:
        token_id = self.media_token_id(kind)  # refuses a kind PaliGemma does not take
        out = self.processor(text=[""], images=[item], return_tensors="pt")
        count = int((out["input_ids"] == token_id).sum())
        return {"pixel_values": out["pixel_values"]}, count

    def bidirectional_groups(self, processed: dict, input_ids: list[int], spans: list) -> torch.Tensor | None:
        token_types = processed.get("token_type_ids")
        if token_types is None:
            return torch.zeros(len(input_ids), dtype=torch.long)  # the whole prompt is prefix
        return torch.where(token_types[0] == 0, 0, -1).long()


@register
class PaliGemmaAdapter(VlmAdapter):
    model_types = ("paligemma",)
    prompt_type = PaliGemmaPrompt
    position_offset = 1
