"""One recipe per architecture: its special tokens, its config and its processor.

A recipe's functions receive the trained tokenizer (after the processor has added any tokens it
adds itself, e.g. PaliGemma's `<locXXXX>`), so `vocab_size` and token ids come from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import (
    CLIPVisionConfig,
    Gemma2Config,
    Gemma3Config,
    Gemma3ImageProcessor,
    Gemma3Processor,
    Gemma3TextConfig,
    GPT2Config,
    Idefics2Config,
    Idefics2ImageProcessor,
    Idefics2Processor,
    Idefics3Config,
    Idefics3ImageProcessor,
    Idefics3Processor,
    Llama4Config,
    Llama4ImageProcessor,
    Llama4Processor,
    LlamaConfig,
    LlavaNextConfig,
    LlavaNextImageProcessor,
    LlavaNextProcessor,
    MistralConfig,
    PaliGemmaConfig,
    PaliGemmaProcessor,
    Phi3Config,
    PreTrainedConfig,
    PreTrainedTokenizerFast,
    ProcessorMixin,
    Qwen2_5_VLConfig,
    Qwen2_5_VLProcessor,
    Qwen2Config,
    Qwen2VLConfig,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
    SiglipImageProcessor,
    SmolVLMConfig,
    SmolVLMImageProcessor,
    SmolVLMProcessor,
    SmolVLMVideoProcessor,
)

from tgi_vlm.testing.sizes import Sizes
from tgi_vlm.testing.tokenizer import TokenizerSpec

Tok = PreTrainedTokenizerFast
ConfigFn = Callable[[Tok, Sizes], PreTrainedConfig]
ProcessorFn = Callable[[Tok, Sizes], ProcessorMixin]


@dataclass(frozen=True)
class Recipe:
    tokenizer: TokenizerSpec
    config: ConfigFn
    processor: ProcessorFn | None = None  # None: a text-only causal LM
    chat_template: str | None = None  # saved with the tokenizer and the processor

    @property
    def is_vlm(self) -> bool:
        return self.processor is not None


# ---- shared pieces -------------------------------------------------------------------------


def _ids(tok: Tok) -> dict[str, Any]:
    return {
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }


def _text(tok: Tok, s: Sizes, **overrides: Any) -> dict[str, Any]:
    """A llama-shaped text config dict; architectures override names and extras."""
    return {
        "vocab_size": len(tok),
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "max_position_embeddings": 4096,
        "initializer_range": s.initializer_range,
        "tie_word_embeddings": False,
        **_ids(tok),
        **overrides,
    }


def _vision(s: Sizes, **overrides: Any) -> dict[str, Any]:
    """A SigLIP/CLIP-shaped vision config dict."""
    return {
        "hidden_size": s.vision_hidden,
        "intermediate_size": 2 * s.vision_hidden,
        "num_hidden_layers": s.vision_layers,
        "num_attention_heads": s.vision_heads,
        "patch_size": 14,
        "initializer_range": s.initializer_range,
        **overrides,
    }


def _llama_tokens(**extra: str) -> TokenizerSpec:
    named = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>"}
    return TokenizerSpec(named=named, extra=extra)


def _sp_tokens(**extra: str) -> TokenizerSpec:
    """SentencePiece-era names (Llama 2 / Mistral)."""
    named = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    return TokenizerSpec(named=named, extra=extra)


def _qwen_tokens(**extra: str) -> TokenizerSpec:
    # Qwen has no BOS; pad is the end-of-text token.
    named = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    return TokenizerSpec(named=named, extra=extra, other=("<|im_start|>", "<|im_end|>"), add_bos_token=False)


# GPT-2 has one special token, for BOS, EOS and (here) padding; it adds no BOS to prompts.
_GPT2_TOKENS = TokenizerSpec(
    named={"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    add_bos_token=False,
)


def _gemma_tokens(**extra: str) -> TokenizerSpec:
    named = {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"}
    return TokenizerSpec(named=named, extra=extra, other=("<start_of_turn>", "<end_of_turn>"))


# ---- text-only -------------------------------------------------------------------------------


def _llama_config(tok: Tok, s: Sizes) -> PreTrainedConfig:
    return LlamaConfig(**_text(tok, s))


def _qwen2_config(tok: Tok, s: Sizes) -> PreTrainedConfig:
    return Qwen2Config(**_text(tok, s))


def _text_window(s: Sizes) -> int:
    # A quarter of the VLM window (8 at tiny size): shorter than the parity prompts, so it masks.
    return s.window // 4


def _mistral_config(tok: Tok, s: Sizes) -> PreTrainedConfig:
    return MistralConfig(**_text(tok, s, sliding_window=_text_window(s)))


def _alternating_layers(s: Sizes) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(s.layers)]


def _gemma2_config(tok: Tok, s: Sizes) -> PreTrainedConfig:
    # Small caps and a query scale that is not head_dim**-0.5, so each one changes the logits.
    return Gemma2Config(
        **_text(
            tok,
            s,
            query_pre_attn_scalar=2 * s.head_dim,
            sliding_window=_text_window(s),
            layer_types=_alternating_layers(s),
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
            hidden_activation="gelu_pytorch_tanh",
        )
    )


def _gemma3_text_config(tok: Tok, s: Sizes) -> PreTrainedConfig:
    # Gemma3's text stack alone (Gemma3ForCausalLM): q/k norms, a local rope base on sliding
    # layers, no softcapping (transformers' Gemma3 attention never passes it on).
    return Gemma3TextConfig(
        **_text(
            tok,
            s,
            query_pre_attn_scalar=2 * s.head_dim,
            sliding_window=_text_window(s),
            layer_types=_alternating_layers(s),
        )
    )


def _phi3_config(tok: Tok, s: Sizes) -> PreTrainedConfig:
    # Fused qkv_proj and gate_up_proj; rotary on half of each head (Phi-4-mini style).
    return Phi3Config(**_text(tok, s, partial_rotary_factor=0.5))


def _gpt2_config(tok: Tok, s: Sizes) -> PreTrainedConfig:
    # Learned absolute position embeddings, LayerNorm, fused c_attn (Conv1D), no GQA.
    return GPT2Config(
        vocab_size=len(tok),
        n_positions=1024,  # GPT-2's own; 4096 would make wpe most of the tiny model
        n_embd=s.hidden,
        n_layer=s.layers,
        n_head=s.heads,
        n_inner=s.intermediate,
        initializer_range=s.initializer_range,
        tie_word_embeddings=False,
        **_ids(tok),
    )


# ---- Qwen2-VL / Qwen2.5-VL -------------------------------------------------------------------

_QWEN_VL_TOKENS = _qwen_tokens(
    image_token="<|image_pad|>",
    video_token="<|video_pad|>",
    vision_bos_token="<|vision_start|>",
    vision_eos_token="<|vision_end|>",
)


def _qwen_vl_text(tok: Tok, s: Sizes) -> dict[str, Any]:
    # mrope sections (temporal, height, width) must sum to head_dim / 2: 16 → [2, 3, 3].
    section = [s.head_dim // 8, 3 * s.head_dim // 16, 3 * s.head_dim // 16]
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    return _text(tok, s, rope_parameters=rope)


def _qwen_vl_ids(tok: Tok) -> dict[str, int]:
    return {
        "image_token_id": tok.image_token_id,
        "video_token_id": tok.video_token_id,
        "vision_start_token_id": tok.vision_bos_token_id,
        "vision_end_token_id": tok.vision_eos_token_id,
    }


def _qwen2_vl_config(tok: Tok, s: Sizes) -> PreTrainedConfig:
    vision = {
        "depth": s.vision_layers,
        "embed_dim": s.vision_hidden,
        "hidden_size": s.hidden,  # merger output = text width
        "num_heads": s.vision_heads,
        "initializer_range": s.initializer_range,
    }
    return Qwen2VLConfig(
        text_config=_qwen_vl_text(tok, s), vision_config=vision, **_qwen_vl_ids(tok), **_ids(tok)
    )


def _qwen2_5_vl_config(tok: Tok, s: Sizes) -> PreTrainedConfig:
    vision = {
        "depth": s.vision_layers,
        "hidden_size": s.vision_hidden,
        "intermediate_size": 2 * s.vision_hidden,
        "out_hidden_size": s.hidden,
        "num_heads": s.vision_heads,
        "window_size": 56,  # 2×2 merged patches per window, so small images still use several
        "fullatt_block_indexes": list(range(1, s.vision_layers, 2)),
        "initializer_range": s.initializer_range,
    }
    return Qwen2_5_VLConfig(
        text_config=_qwen_vl_text(tok, s), vision_config=vision, **_qwen_vl_ids(tok), **_ids(tok)
    )


# Qwen2-VL-Instruct's own chat template (ChatML; a system turn when none is given; an image content
# part becomes <|vision_start|><|image_pad|><|vision_end|>, which the processor expands). TGI hands
# templates string contents only, images already written as markdown ![](url) in the text.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _qwen_vl_image_processor(s: Sizes) -> Qwen2VLImageProcessor:
    # Images are resized to multiples of 28 px with 56² ≤ area ≤ image_edge².
    return Qwen2VLImageProcessor(size={"shortest_edge": 56 * 56, "longest_edge": s.image_edge**2})


def _qwen_vl_video_processor(s: Sizes) -> Qwen2VLVideoProcessor:
    return Qwen2VLVideoProcessor(size={"shortest_edge": 56 * 56, "longest_edge": s.image_edge**2})


def _qwen2_vl_processor(tok: Tok, s: Sizes) -> ProcessorMixin:
    return Qwen2VLProcessor(
        image_processor=_qwen_vl_image_processor(s),
        tokenizer=tok,
        video_processor=_qwen_vl_video_processor(s),
    )


def _qwen2_5_vl_processor(tok: Tok, s: Sizes) -> ProcessorMixin:
    return Qwen2_5_VLProcessor(
        image_processor=_qwen_vl_image_processor(s),
        tokenizer=tok,
        video_processor=_qwen_vl_video_processor(s),
    )


# ---- LLaVA-NeXT ------------------------------------------------------------------------------

_LLAVA_TILE = 28  # CLIP input side: 2×2 patches of 14 px
_LLAVA_PINPOINTS = [[28, 56], [56, 28], [56, 56]]  # must match in config and image processor


def _llava_next_config(tok: Tok, s: Sizes) -> PreTrainedConfig:
    vision = CLIPVisionConfig(**_vision(s, image_size=_LLAVA_TILE, projection_dim=s.vision_hidden))
    text = {"model_type": "llama", **_text(tok, s)}
    return LlavaNextConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tok.image_token_id,
        image_grid_pinpoints=_LLAVA_PINPOINTS,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        image_seq_length=(_LLAVA_TILE // 14) ** 2,
        **_ids(tok),
    )


def _llava_next_processor(tok: Tok, s: Sizes) -> ProcessorMixin:
    image_processor = LlavaNextImageProcessor(
        size={"shortest_edge": _LLAVA_TILE},
        crop_size={"height": _LLAVA_TILE, "width": _LLAVA_TILE},
        image_grid_pinpoints=_LLAVA_PINPOINTS,
    )
    return LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS token, dropped by the "default" strategy
    )


# ---- Idefics2 / Idefics3 / SmolVLM -----------------------------------------------------------

_IDEFICS_TILE = 56  # vision input side: 4×4 patches of 14 px
_IDEFICS_IMAGE_SEQ_LEN = 4  # perceiver latents (idefics2) / 16 patches ÷ scale_factor² (idefics3)
_ROW_COL_TOKENS = tuple(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))


def _idefics_tokens(**extra: str) -> TokenizerSpec:
    base = _llama_tokens(
        image_token="<image>",
        fake_image_token="<fake_token_around_image>",
        image_boundary_token="<fake_token_around_image>",
        end_of_utterance_token="<end_of_utterance>",
        global_image_token="<global-img>",
        **extra,
    )
    return TokenizerSpec(named=base.named, extra=base.extra, other=_ROW_COL_TOKENS)


def _idefics2_config(tok: Tok, s: Sizes) -> PreTrainedConfig:
    perceiver = {
        "hidden_size": s.hidden,
        "resampler_n_latents": _IDEFICS_IMAGE_SEQ_LEN,
        "resampler_depth": 1,
        "resampler_n_heads": s.heads,
        "resampler_head_dim": s.head_dim,
        "num_key_value_heads": s.kv_heads,
        "initializer_range": s.initializer_range,
    }
    text = {"model_type": "mistral", "sliding_window": None, **_text(tok, s)}
    return Idefics2Config(
        vision_config=_vision(s, image_size=_IDEFICS_TILE),
        perceiver_config=perceiver,
        text_config=text,
        image_token_id=tok.image_token_id,
        **_ids(tok),
    )


def _idefics2_processor(tok: Tok, s: Sizes) -> ProcessorMixin:
    image_processor = Idefics2ImageProcessor(
        size={"shortest_edge": 28, "longest_edge": _IDEFICS_TILE}, do_image_splitting=False
    )
    return Idefics2Processor(
        image_processor=image_processor, tokenizer=tok, image_seq_len=_IDEFICS_IMAGE_SEQ_LEN
    )


def _idefics3_kwargs(tok: Tok, s: Sizes) -> dict[str, Any]:
    return {
        "vision_config": _vision(s, image_size=_IDEFICS_TILE),
        "text_config": {"model_type": "llama", **_text(tok, s)},
        "image_token_id": tok.image_token_id,
        "scale_factor": 2,
        **_ids(tok),
    }


def _idefics3_config(tok: Tok, s: Sizes) -> PreTrainedConfig:
    return Idefics3Config(**_idefics3_kwargs(tok, s))


def _smolvlm_config(tok: Tok, s: Sizes) -> PreTrainedConfig:
    return SmolVLMConfig(**_idefics3_kwargs(tok, s))


def _splitting_sizes(s: Sizes) -> dict[str, Any]:
    # Resize to ≤ 2 tiles a side, then split into 56 px tiles plus one global tile.
    return {"size": {"longest_edge": 2 * _IDEFICS_TILE}, "max_image_size": {"longest_edge": _IDEFICS_TILE}}


def _idefics3_processor(tok: Tok, s: Sizes) -> ProcessorMixin:
    image_processor = Idefics3ImageProcessor(**_splitting_sizes(s))
    return Idefics3Processor(
        image_processor=image_processor, tokenizer=tok, image_seq_len=_IDEFICS_IMAGE_SEQ_LEN
    )


def _smolvlm_processor(tok: Tok, s: Sizes) -> ProcessorMixin:
    return SmolVLMProcessor(
        image_processor=SmolVLMImageProcessor(**_splitting_sizes(s)),
        tokenizer=tok,
        video_processor=SmolVLMVideoProcessor(**_splitting_sizes(s)),
        image_seq_len=_IDEFICS_IMAGE_SEQ_LEN,
    )


# ---- PaliGemma -------------------------------------------------------------------------------

_PALIGEMMA_SIDE = 28  # 2×2 patches → 4 image tokens


def _paligemma_config(tok: Tok, s: Sizes) -> PreTrainedConfig:
    vision = _vision(s, image_size=_PALIGEMMA_SIDE, projection_dim=s.hidden)
    text = _text(tok, s, model_type="gemma", hidden_activation="gelu_pytorch_tanh")
    return PaliGemmaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tok.image_token_id,
        vocab_size=len(tok),
        projection_dim=s.hidden,
        hidden_size=s.hidden,
        **_ids(tok),
    )


def _paligemma_processor(tok: Tok, s: Sizes) -> ProcessorMixin:
    image_processor = SiglipImageProcessor(size={"height": _PALIGEMMA_SIDE, "width": _PALIGEMMA_SIDE})
    image_processor.image_seq_length = (_PALIGEMMA_SIDE // 14) ** 2
    # The processor adds the 1024 <locXXXX> and 128 <segXXX> tokens to the tokenizer.
    return PaliGemmaProcessor(image_processor=image_processor, tokenizer=tok)


# ---- Gemma 3 ---------------------------------------------------------------------------------

_GEMMA3_SIDE = 56  # 4×4 patches, average-pooled to mm_tokens_per_image (a perfect square)
_GEMMA3_TOKENS_PER_IMAGE = 4


def _gemma3_config(tok: Tok, s: Sizes) -> PreTrainedConfig:
    text = _text(
        tok,
        s,
        query_pre_attn_scalar=s.head_dim,
        sliding_window=s.window,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(s.layers)],
    )
    return Gemma3Config(
        text_config=text,
        vision_config=_vision(s, image_size=_GEMMA3_SIDE),
        mm_tokens_per_image=_GEMMA3_TOKENS_PER_IMAGE,
        boi_token_index=tok.boi_token_id,
        eoi_token_index=tok.eoi_token_id,
        image_token_index=tok.image_token_id,
        initializer_range=s.initializer_range,
        tie_word_embeddings=False,
        **_ids(tok),
    )


def _gemma3_processor(tok: Tok, s: Sizes) -> ProcessorMixin:
    image_processor = Gemma3ImageProcessor(size={"height": _GEMMA3_SIDE, "width": _GEMMA3_SIDE})
    return Gemma3Processor(
        image_processor=image_processor, tokenizer=tok, image_seq_length=_GEMMA3_TOKENS_PER_IMAGE
    )


# ---- Llama 4 ---------------------------------------------------------------------------------

_LLAMA4_TILE = 56  # 4×4 patches, pixel-shuffled (ratio 0.5) to 4 tokens per tile

_LLAMA4_TOKENS = TokenizerSpec(
    named={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot|>", "pad_token": "<|finetune_right_pad|>"},
    extra={"image_token": "<|image|>"},
    other=(
        "<|end_of_text|>",
        "<|image_start|>",
        "<|image_end|>",
        "<|patch|>",
        "<|tile_x_separator|>",
        "<|tile_y_separator|>",
    ),
)


def _llama4_config(tok: Tok, s: Sizes) -> PreTrainedConfig:
    shuffled = 4 * s.vision_hidden  # hidden / pixel_shuffle_ratio²
    vision = {
        **_vision(s, image_size=_LLAMA4_TILE),
        "intermediate_size": shuffled,
        # pixel-shuffle MLP: intermediate → projector dims → (vision_output_dim) → text width
        "vision_output_dim": s.hidden,
        "projector_input_dim": s.hidden,
        "projector_output_dim": s.hidden,
        "pixel_shuffle_ratio": 0.5,
    }
    text = _text(
        tok,
        s,
        intermediate_size_mlp=s.intermediate,
        num_local_experts=2,
        interleave_moe_layer_step=2,  # layers 1, 3, … are MoE
        attention_chunk_size=s.window,
        no_rope_layer_interval=2,
    )
    return Llama4Config(
        vision_config=vision,
        text_config=text,
        boi_token_index=tok.convert_tokens_to_ids("<|image_start|>"),
        eoi_token_index=tok.convert_tokens_to_ids("<|image_end|>"),
        image_token_index=tok.convert_tokens_to_ids("<|patch|>"),
        **_ids(tok),
    )


def _llama4_processor(tok: Tok, s: Sizes) -> ProcessorMixin:
    image_processor = Llama4ImageProcessor(
        size={"height": _LLAMA4_TILE, "width": _LLAMA4_TILE}, max_patches=4
    )
    return Llama4Processor(
        image_processor=image_processor, tokenizer=tok, patch_size=14, pixel_shuffle_ratio=0.5
    )


RECIPES: dict[str, Recipe] = {
    "llama": Recipe(_llama_tokens(), _llama_config),
    "qwen2": Recipe(_qwen_tokens(), _qwen2_config),
    "mistral": Recipe(_sp_tokens(), _mistral_config),
    "gemma2": Recipe(_gemma_tokens(), _gemma2_config),
    "gemma3_text": Recipe(_gemma_tokens(), _gemma3_text_config),
    "phi3": Recipe(_llama_tokens(), _phi3_config),
    "gpt2": Recipe(_GPT2_TOKENS, _gpt2_config),
    "qwen2_vl": Recipe(_QWEN_VL_TOKENS, _qwen2_vl_config, _qwen2_vl_processor, QWEN2_VL_CHAT_TEMPLATE),
    "qwen2_5_vl": Recipe(_QWEN_VL_TOKENS, _qwen2_5_vl_config, _qwen2_5_vl_processor, QWEN2_VL_CHAT_TEMPLATE),
    "llava_next": Recipe(_sp_tokens(image_token="<image>"), _llava_next_config, _llava_next_processor),
    "idefics2": Recipe(_idefics_tokens(), _idefics2_config, _idefics2_processor),
    "idefics3": Recipe(_idefics_tokens(), _idefics3_config, _idefics3_processor),
    "smolvlm": Recipe(_idefics_tokens(video_token="<video>"), _smolvlm_config, _smolvlm_processor),
    "paligemma": Recipe(_gemma_tokens(image_token="<image>"), _paligemma_config, _paligemma_processor),
    "gemma3": Recipe(
        _gemma_tokens(
            image_token="<image_soft_token>", boi_token="<start_of_image>", eoi_token="<end_of_image>"
        ),
        _gemma3_config,
        _gemma3_processor,
    ),
    "llama4": Recipe(_LLAMA4_TOKENS, _llama4_config, _llama4_processor),
}
