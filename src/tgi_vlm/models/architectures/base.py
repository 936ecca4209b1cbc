"""The per-architecture adapter: everything that differs between VLMs, and nothing else.

Two halves, so that code holding only a processor (the router's token counter) never builds a
model-side object (nor imports the attention backends: the model half imports them where it uses them):
- `VlmPrompt` (no weights): the media kinds it takes, the placeholder of one item of a kind and
  the token its embeddings fill, the prompt layout, the processor on the whole prompt and on each
  item alone, bidirectional attention groups.
- `VlmAdapter` (the loaded model): encoder features per kind, the language model, per-sequence
  adapter state (e.g. mrope positions), position ids, the per-layer attention pattern. It owns a
  `VlmPrompt` as `.prompt`.
The defaults fit most `*ForConditionalGeneration` classes of transformers v5; an architecture
overrides only what differs. Every per-kind method refuses a kind the architecture does not take
(`UnsupportedMediaKind`, naming the kind and the architecture); images everywhere, videos where
an architecture lists `MediaKind.VIDEO` (Qwen2-VL / Qwen2.5-VL).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from tgi_vlm.media import MediaKind

if TYPE_CHECKING:
    from tgi_vlm.layers.attention import AttentionPattern
    from tgi_vlm.models.step import StepInputs

# Processor outputs that are not pixel inputs of the vision tower.
TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "labels")

# A request's prompt in order: text, or the kind of the media item that goes there.
PromptPart = str | MediaKind


class UnsupportedMediaKind(ValueError):
    """An architecture was asked for a kind of media it does not take; the message names both."""


class VlmPrompt:
    """The prompt side of an architecture: needs the processor and the config, never the weights."""

    media_kinds: ClassVar[tuple[MediaKind, ...]] = (MediaKind.IMAGE,)  # what the architecture takes

    def __init__(self, processor, hf_config):
        self.processor = processor
        self.config = hf_config
        self.tokenizer = processor.tokenizer
        token_id = getattr(hf_config, "image_token_id", None)
        self.media_token_ids = {MediaKind.IMAGE: int(token_id if token_id is not None else hf_config.image_token_index)}

    def require(self, kind: MediaKind) -> None:
        """Raises UnsupportedMediaKind unless the architecture takes `kind`."""
        if kind not in self.media_kinds:
            name = getattr(kind, "value", kind)
            raise UnsupportedMediaKind(
                f"model_type {self.config.model_type!r} ({type(self).__name__}) takes no {name} inputs; "
                f"it takes: {', '.join(k.value for k in self.media_kinds)}"
            )

    def media_token_id(self, kind: MediaKind) -> int:
        """The token id whose positions take the encoder rows of `kind` items (the processor expands
        each placeholder into them). Kinds are checked once, at intake (`vlm_intake.prompt_parts`)."""
        return self.media_token_ids[kind]

    def placeholder(self, kind: MediaKind) -> str:
        """Text standing for one item of `kind` in the prompt; the processor expands it."""
        return self.processor.image_token

    def build_prompt(self, parts: list[PromptPart]) -> str:
        """Prompt text from the request's parts in order (a MediaKind marks where an item goes)."""
        return "".join(p if isinstance(p, str) else self.placeholder(p) for p in parts)

    def process(self, text: str, items: list, add_special_tokens: bool = True,
                kinds: list[MediaKind] | None = None) -> dict:
        """The processor on the whole prompt: token ids (placeholders expanded) and side inputs.

        `items` are the prompt's decoded items, `kinds` their kinds (None: all images).
        `add_special_tokens` is the request's flag: TGI's chat route sends False because the chat
        template already holds <bos>.
        """
        kwargs = self.processor_kwargs(kinds or [MediaKind.IMAGE] * len(items), items)
        return dict(
            self.processor(text=[text], return_tensors="pt", add_special_tokens=add_special_tokens, **kwargs)
        )

    def processor_kwargs(self, kinds: list[MediaKind], items: list) -> dict:
        """The processor's keyword arguments for decoded items of the given kinds (prompt order)."""
        images = [item for kind, item in zip(kinds, items) if kind is MediaKind.IMAGE]
        return {"images": images} if images else {}

    def frame_sampler(self, limits):
        """`video.FrameSampler` for this architecture's processor (only architectures taking videos have one)."""
        raise UnsupportedMediaKind(f"{type(self).__name__} samples no video frames")

    def expanded_ids(self, parts: list[PromptPart], items: list, add_special_tokens: bool = True
                     ) -> tuple[list[int], list[int]] | None:
        """The prompt's ids and each item's token count without running the processor's pixel work,
        for counting only (the router); None where the architecture needs the processor for that (the
        default). An override must give exactly `process(...)["input_ids"]` and the counts
        `media_inputs` gives."""
        return None

    def only_media_inputs(self, kind: MediaKind, processed: dict) -> dict:
        """The pixel inputs of a prompt's only item, out of the whole-prompt processor output: with one
        item every non-text output belongs to it (what `media_inputs` would compute again)."""
        return {k: v for k, v in processed.items() if k not in TEXT_KEYS}

    def media_inputs(self, kind: MediaKind, item) -> tuple[dict, int]:
        """This item alone through the processor: (pixel inputs, number of embedding tokens).

        The count comes from the processor's own expansion, so it cannot drift from the prompt.
        """
        placeholder, token_id = self.placeholder(kind), self.media_token_id(kind)
        out = self.processor(text=[placeholder], return_tensors="pt", **self.processor_kwargs([kind], [item]))
        count = int((out["input_ids"] == token_id).sum())
        return {k: v for k, v in out.items() if k not in TEXT_KEYS}, count

    def bidirectional_groups(self, processed: dict, input_ids: list[int], spans: list) -> torch.Tensor | None:
        """[prompt_len] group id per position (-1 = causal), or None when the model is plain causal.

        Prompt-side (no weights): the engine's attention masks and the router driver's prefix cache
        (a cached prefix never ends inside a group) read the same groups.
        """
        return None


class VlmAdapter:
    """The model side of an architecture. `prompt_type` names its prompt half."""

    model_types: ClassVar[tuple[str, ...]] = ()
    prompt_type: ClassVar[type[VlmPrompt]] = VlmPrompt
    position_rows: ClassVar[int] = 1  # rows of position ids per token (Qwen2-VL's mrope: 3)
    position_offset: ClassVar[int] = 0  # PaliGemma counts positions from 1

    def __init__(self, model: torch.nn.Module, processor, hf_config):
        self.model = model
        self.config = hf_config
        self.prompt = self.prompt_type(processor, hf_config)

    # ----- encoders -----
    # The model's encoder entry point per kind (on `model.model`, the inner multimodal model).
    encoder_methods: ClassVar[dict[MediaKind, str]] = {MediaKind.IMAGE: "get_image_features",
                                                       MediaKind.VIDEO: "get_video_features"}
    batch_encode: ClassVar[bool] = True  # items of one kind with same-shaped pixel inputs share one encoder call

    def encode(self, kind: MediaKind, inputs: list[dict]) -> list[torch.Tensor]:
        """Encoder features `[num_embed_i, hidden]` for each item of `kind` (its pixel inputs), in order."""
        if not self.batch_encode:
            return [self._encode_one(kind, p) for p in inputs]
        groups: dict[tuple, list[int]] = {}
        for i, pixels in enumerate(inputs):
            groups.setdefault(_shape_key(pixels), []).append(i)
        features: list[torch.Tensor | None] = [None] * len(inputs)
        for members in groups.values():
            batch = {k: torch.cat([inputs[i][k] for i in members]) for k in inputs[members[0]]}
            for i, f in zip(members, self._encode_batch(kind, batch, len(members))):
                features[i] = f
        return features

    def _encode_batch(self, kind: MediaKind, pixels: dict, count: int) -> list[torch.Tensor]:
        """One encoder call for `count` items stacked on dim 0; per-item rows in order."""
        device, dtype = self.vision_device_dtype()
        kwargs = {k: _to(v, device, dtype) for k, v in pixels.items()}
        out = self._encoder(kind)(**kwargs, return_dict=True).pooler_output
        per_item = list(out) if isinstance(out, (list, tuple)) and len(out) == count else torch.chunk(out, count)
        return [flatten_features(f) for f in per_item]

    def _encode_one(self, kind: MediaKind, pixels: dict) -> torch.Tensor:
        device, dtype = self.vision_device_dtype()
        kwargs = {k: _to(v, device, dtype) for k, v in pixels.items()}
        features = self._encoder(kind)(**kwargs, return_dict=True).pooler_output
        return flatten_features(features)

    def _encoder(self, kind: MediaKind):
        return getattr(self.model.model, self.encoder_methods[kind])

    def vision_device_dtype(self) -> tuple[torch.device, torch.dtype]:
        param = next(self.model.parameters())
        return param.device, param.dtype

    # ----- language model -----
    def language_model(self) -> torch.nn.Module:
        """The text decoder (called directly with packed inputs_embeds)."""
        return self.model.get_decoder()

    def attention_pattern(self) -> AttentionPattern:
        """Per-layer attention facts of the language model (default: none beyond sliding windows)."""
        from tgi_vlm.layers.attention import AttentionPattern  # model side only: the prompt half stays light

        return AttentionPattern()

    def adapter_state(self, processed: dict, input_ids: list[int], spans: list) -> object | None:
        """Per-sequence state the adapter needs later (e.g. mrope positions); kept in `seq.mm`."""
        return None

    def bidirectional_groups(self, processed: dict, input_ids: list[int], spans: list) -> torch.Tensor | None:
        """The prompt half's groups (`VlmPrompt.bidirectional_groups`)."""
        return self.prompt.bidirectional_groups(processed, input_ids, spans)

    def position_ids(self, step: StepInputs) -> torch.Tensor:
        """Position ids `[position_rows, T]`-shaped for the language model; default absolute (+ offset)."""
        return (step.positions + self.position_offset)[None]


def _shape_key(pixels: dict) -> tuple:
    """Items whose pixel inputs agree beyond dim 0 can be concatenated (and give equal row counts)."""
    if not all(isinstance(v, torch.Tensor) for v in pixels.values()):
        return (id(pixels),)  # something unusual: encode alone
    return tuple(sorted((k, tuple(v.shape[1:]), v.dtype) for k, v in pixels.items()))


def flatten_features(features) -> torch.Tensor:
    if isinstance(features, (list, tuple)):
        features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
    return features.reshape(-1, features.shape[-1])


def _to(value, device, dtype):
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_floating_point():
        return value.to(device=device, dtype=dtype)
    return value.to(device=device)
