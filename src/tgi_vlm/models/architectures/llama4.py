"""Llama4: images become tiles of `<|patch|>` tokens between `<|image_start|>`/`<|image_end|>`;
the vision model's output goes through the multi-modal projector; the text layers marked
"chunked_attention" in `layer_types` attend only within `attention_chunk_size` positions."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch

from tgi_vlm.media import MediaKind
from tgi_vlm.models.architectures.base import VlmAdapter, _to, flatten_features
from tgi_vlm.models.architectures.registry import register

if TYPE_CHECKING:
    from tgi_vlm.layers.attention import AttentionPattern


@register
class Llama4Adapter(VlmAdapter):
    model_types = ("llama4",)
    batch_encode = False  # its vision model flattens tiles across images; one call per image keeps rows apart

    def _encode_one(self, kind: MediaKind, pixels: dict) -> torch.Tensor:  # images only (`encode` checked)
        device, dtype = self.vision_device_dtype()
        model = self.model
        kwargs = {}
        if "vision_feature_select_strategy" in inspect.signature(model.get_image_features).parameters:
            # transformers 5.17 requires it; 5.24 dropped the parameter.
            kwargs["vision_feature_select_strategy"] = self.config.vision_config.vision_feature_select_strategy
        out = model.get_image_features(pixel_values=_to(pixels["pixel_values"], device, dtype), **kwargs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        hidden = hidden.reshape(-1, hidden.shape[-1])
        return flatten_features(model.multi_modal_projector(hidden))

    def language_model(self) -> torch.nn.Module:
        # Llama4's get_decoder() returns the causal-LM wrapper; we need its inner text model.
        return self.model.language_model.model

    def attention_pattern(self) -> AttentionPattern:
        from tgi_vlm.layers.attention import AttentionPattern  # model side only (base.py)

        text = self.config.get_text_config()
        layer_types = getattr(text, "layer_types", None) or []
        size = getattr(text, "attention_chunk_size", None)
        chunked = {i: size for i, kind in enumerate(layer_types) if kind == "chunked_attention" and size}
        return AttentionPattern(chunk_sizes=chunked)


def enable_transformers_generate() -> None:
    """transformers 5.24 bug: Llama4ForConditionalGeneration.forward reads `outputs.image_outputs`
    from the MoeCausalLMOutputWithPast its language model returns, which has no such field, so every
    dict-returning forward (and `generate`) raises AttributeError. Our engine never calls that
    forward, so the shard does not patch anything; code that runs transformers' own `generate` as a
    reference (tests, `bench`) calls this first. It sets a class-level default, nothing else."""
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    if not hasattr(MoeCausalLMOutputWithPast, "image_outputs"):
        MoeCausalLMOutputWithPast.image_outputs = None
