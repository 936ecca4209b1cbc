"""Where each image sits in a request's token ids, and which of its tokens take vision embeddings.

An image span covers `[offset, offset + length)` of the prompt: from its first to its last
embedding token. Structure tokens inside it (Idefics3 row/column markers, tile separators)
have `is_embed` False and keep their text embedding. `embed_index[i]` is the vision-output row
for span position i (-1 for structure tokens).

`spans_overlapping` is the one loop that both encoding (which images does this step need?) and
gathering (which rows go where?) use.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass
class ImageSpan:
    index: int  # position among the request's images
    offset: int
    length: int
    embed_index: torch.Tensor  # [length] long, -1 where the token is not an embedding row
    num_embed: int
    content_hash: str  # of the image bytes: cross-request encoder cache and prefix-cache key
    pixel_inputs: dict  # this image alone through the image processor (CPU tensors)
    cache_key: int = field(default=-1)  # per-request encoder-cache entry id, assigned on creation

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def is_embed(self) -> torch.Tensor:
        return self.embed_index >= 0


def locate_spans(input_ids: list[int], image_token_id: int, counts: list[int]) -> list[tuple[int, int, torch.Tensor]]:
    """(offset, length, embed_index) per image, from the prompt ids and each image's embedding count.

    Images are assigned image tokens in prompt order: image i owns the next `counts[i]` of them.
    Raises ValueError when the prompt holds a different number of image tokens than the images need.
    """
    positions = [p for p, t in enumerate(input_ids) if t == image_token_id]
    if len(positions) != sum(counts):
        raise ValueError(f"prompt has {len(positions)} image tokens but its images need {sum(counts)}")
    spans = []
    cursor = 0
    for count in counts:
        own = positions[cursor : cursor + count]
        cursor += count
        offset, end = own[0], own[-1] + 1
        embed_index = torch.full((end - offset,), -1, dtype=torch.long)
        embed_index[torch.tensor(own) - offset] = torch.arange(count)
        spans.append((offset, end - offset, embed_index))
    return spans


def spans_overlapping(spans: list[ImageSpan], start: int, end: int) -> Iterator[tuple[ImageSpan, int, int]]:
    """(span, s, e) for every span meeting the window [start, end); [s, e) is the overlap."""
    for span in spans:
        s, e = max(start, span.offset), min(end, span.end)
        if s < e:
            yield span, s, e
