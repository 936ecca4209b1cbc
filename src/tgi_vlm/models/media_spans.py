"""Where each media item (an image) sits in a request's token ids, and which of its tokens take
encoder embeddings.

A media span covers `[offset, offset + length)` of the prompt: from its first to its last
embedding token. Structure tokens inside it (Idefics3 row/column markers, tile separators)
have `is_embed` False and keep their text embedding. `embed_index[i]` is the encoder-output row
for span position i (-1 for structure tokens).

`spans_overlapping` is the one loop that both encoding (which items does this step need?) and
gathering (which rows go where?) use.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from tgi_vlm.media import MediaKind
from tgi_vlm.prefix_hash import MediaRef


@dataclass
class MediaSpan:
    kind: MediaKind
    index: int  # position among the request's media items, in prompt order
    offset: int
    length: int
    embed_index: torch.Tensor  # [length] long, -1 where the token is not an embedding row
    num_embed: int
    content_hash: str  # sha256 of the item's bytes: with the kind, the encoder-cache and prefix-cache key
    pixel_inputs: dict  # this item alone through the processor (CPU tensors): what `encode(kind, ...)` takes
    cache_key: int = field(default=-1)  # per-request encoder-cache entry id, assigned on creation

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def is_embed(self) -> torch.Tensor:
        return self.embed_index >= 0

    @property
    def feature_key(self) -> tuple[MediaKind, str]:
        """The cross-request encoder-cache key: the same bytes as another kind give other features."""
        return self.kind, self.content_hash

    @property
    def ref(self) -> MediaRef:
        """What prefix-block keys take from this span (the shard's records and the router driver's cache)."""
        return MediaRef(self.kind, self.offset, self.length, self.content_hash)


def locate_spans(input_ids: list[int], kind: MediaKind, token_id: int, counts: list[int]
                 ) -> list[tuple[int, int, torch.Tensor]]:
    """(offset, length, embed_index) per item of one kind, from the prompt ids, the kind's token id
    and each item's embedding count.

    Items are assigned their kind's tokens in prompt order: item i owns the next `counts[i]` of them.
    Raises ValueError when the prompt holds a different number of those tokens than the items need.
    """
    positions = [p for p, t in enumerate(input_ids) if t == token_id]
    if len(positions) != sum(counts):
        raise ValueError(f"prompt has {len(positions)} {kind.value} tokens but its {kind.plural} need {sum(counts)}")
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


def spans_overlapping(spans: list[MediaSpan], start: int, end: int) -> Iterator[tuple[MediaSpan, int, int]]:
    """(span, s, e) for every span meeting the window [start, end); [s, e) is the overlap."""
    for span in spans:
        s, e = max(start, span.offset), min(end, span.end)
        if s < e:
            yield span, s, e
