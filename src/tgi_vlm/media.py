"""Media kinds: what a prompt can hold besides text.

A kind names one modality from end to end: the request chunk it arrives in
(`models/intake.py: CHUNK_KINDS`), how its bytes are decoded (`models/vlm_intake.py: DECODERS`),
the architecture's placeholder text and the token its embedding rows fill
(`VlmPrompt.placeholder(kind)`, `VlmPrompt.media_token_id(kind)`), its encoder call
(`VlmAdapter.encode(kind, inputs)`), its spans (`MediaSpan.kind`) and the keys of work cached for it
(`MediaRef.kind` in prefix-block keys, `MediaSpan.feature_key` in the encoder cache).
Images and videos (Qwen2-VL / Qwen2.5-VL: a clip's sampled frames, `video.py`) go through the same
paths; only the decoder, the processor argument and the encoder call differ per kind.

A plain Enum, not a str one, so that a prompt part (text `str` or a `MediaKind` marking where an
item goes) tells text from media by type. This module imports nothing of the package: every
layer may use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class MediaKind(Enum):
    IMAGE = "image"
    VIDEO = "video"

    @property
    def plural(self) -> str:
        """For messages: "images"."""
        return f"{self.value}s"


@dataclass(frozen=True)
class VideoBytes:
    """An encoded clip among a request's chunks, where plain `bytes` are an image (`router/requests.py`)."""

    data: bytes
    mimetype: str = "video/mp4"  # advisory: the shard sniffs the container
