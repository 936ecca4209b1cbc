"""Qwen2-VL and Qwen2.5-VL: images and videos, 3-row mrope positions (temporal, height, width).

Prefill positions come from the model's own `get_rope_index` over the (truncated) prompt; a
generated token at position p gets `p + delta` on all three rows, delta being the gap that the
image and video grids opened in the text positions.

Videos arrive decoded and sampled (`video.DecodedVideo`: the processor's own `sample_frames` chose the
frames, `frame_sampler`); the processor gets the kept frames with their metadata and
`do_sample_frames=False`, so Qwen2.5-VL's `second_per_grid_ts` is `temporal_patch_size / sampled_fps`
from the clip's true rate (never rounded), and its temporal positions advance
`tokens_per_second * second_per_grid_ts` per grid step. An odd frame count is the processor's to pad.
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
    media_kinds = (MediaKind.IMAGE, MediaKind.VIDEO)

    def __init__(self, processor, hf_config):
        super().__init__(processor, hf_config)
        self.media_token_ids[MediaKind.VIDEO] = int(hf_config.video_token_id)

    def placeholder(self, kind: MediaKind) -> str:
        # The chat template wraps the pad token; the processor expands only the pad token.
        token = self.processor.video_token if kind is MediaKind.VIDEO else self.processor.image_token
        return "<|vision_start|>" + token + "<|vision_end|>"

    def processor_kwargs(self, kinds: list[MediaKind], items: list) -> dict:
        kwargs = super().processor_kwargs(kinds, items)
        videos = [item for kind, item in zip(kinds, items) if kind is MediaKind.VIDEO]
        if videos:
            from transformers.video_utils import VideoMetadata

            kwargs["videos"] = [v.frames for v in videos]
            kwargs["video_metadata"] = [
                VideoMetadata(total_num_frames=v.total_frames, fps=v.fps, frames_indices=list(v.indices),
                              height=v.frames.shape[1], width=v.frames.shape[2]) for v in videos
            ]
            kwargs["do_sample_frames"] = False  # sampled at decoding, by `frame_sampler`
        return kwargs

    def frame_sampler(self, limits):
        """The video processor's own `sample_frames` at the server's rate (`video_fps`), with at most
        `max_video_frames`; a clip shorter than one temporal patch keeps all its frames (the processor
        pads them by repeating the last)."""
        from transformers.video_utils import VideoMetadata

        video_processor = self.processor.video_processor
        patch = video_processor.temporal_patch_size
        max_frames = max(patch, min(video_processor.max_frames, limits.max_video_frames) // patch * patch)

        def sample(total: int, fps: float) -> list[int]:
            if total < patch:  # the processor's rule keeps none of a clip shorter than one temporal patch
                return list(range(total))
            metadata = VideoMetadata(total_num_frames=total, fps=fps)
            indices = video_processor.sample_frames(metadata, fps=limits.video_fps, max_frames=max_frames)
            return [int(i) for i in indices]

        return sample

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

    # kind → (pixel key, grid key) of the processor's outputs and of the encoder's arguments
    _INPUT_KEYS = {MediaKind.IMAGE: ("pixel_values", "image_grid_thw"),
                   MediaKind.VIDEO: ("pixel_values_videos", "video_grid_thw")}

    def encode(self, kind: MediaKind, inputs: list[dict]) -> list[torch.Tensor]:
        # One vision call for all items of a kind: the tower keeps them apart through cu_seqlens (a clip's
        # frames are grid_t temporal patches of one item).
        device, dtype = self.vision_device_dtype()
        pixel_key, grid_key = self._INPUT_KEYS[kind]
        pixels = torch.cat([p[pixel_key] for p in inputs])
        grids = torch.cat([p[grid_key] for p in inputs])
        out = self._encoder(kind)(**{pixel_key: _to(pixels, device, dtype), grid_key: grids.to(device)},
                                  return_dict=True)
        return list(out.pooler_output)

    def adapter_state(self, processed: dict, input_ids: list[int], spans: list) -> MropePositions:
        n = len(input_ids)
        if not spans:
            return MropePositions(rows=torch.arange(n).expand(3, n).clone(), delta=0)
        kwargs = {}
        for kind, (_, grid_key) in self._INPUT_KEYS.items():
            own = [s for s in spans if s.kind is kind]  # spans are in prompt order: so are their grids
            if own:
                kwargs[grid_key] = torch.cat([s.pixel_inputs[grid_key] for s in own])
        videos = [s for s in spans if s.kind is MediaKind.VIDEO]
        if videos and "second_per_grid_ts" in videos[0].pixel_inputs:  # Qwen2.5-VL: seconds per temporal patch
            kwargs["second_per_grid_ts"] = torch.cat([_seconds(s.pixel_inputs["second_per_grid_ts"]) for s in videos])
        positions, delta = self.model.model.get_rope_index(
            input_ids=torch.tensor([input_ids]),
            mm_token_type_ids=processed["mm_token_type_ids"],
            **kwargs,
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


def _seconds(value) -> torch.Tensor:
    """[n] seconds per temporal patch exactly as the processor gave them (a float tensor): never cast to an
    int (transformers PR #48669 truncated them above 2 fps and the temporal index collapsed)."""
    seconds = torch.as_tensor(value).reshape(-1)
    if not seconds.is_floating_point():
        raise TypeError(f"second_per_grid_ts must be fractional seconds, got {seconds.dtype}")
    return seconds
