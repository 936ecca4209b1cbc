"""Content keys of full KV blocks, for image-aware prefix caching (shard records and driver cache).

Block j of a prompt covers positions [j·B, (j+1)·B). Its key chains the previous block's key, the
block's token ids and, for every image whose span overlaps the block, the image's content hash
(sha256 of its bytes) and its offset — so two prompts whose token ids agree (every image expands
to the same placeholder ids) but whose images differ get different keys from the first block that
holds an image token. Keys are sha256: a prefix cache keyed by a weak hash can be made to collide.
Only full blocks have keys; a partial last block is never shared.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

ROOT = b"tgi-vlm-prefix-v1"


@dataclass(frozen=True)
class ImageRef:
    """An image's place in the prompt: tokens [offset, offset + length) and its content hash (hex)."""

    offset: int
    length: int
    digest: str

    @property
    def end(self) -> int:
        return self.offset + self.length


def block_keys(ids: Sequence[int], images: Sequence[ImageRef], block_size: int, limit: int | None = None) -> list[bytes]:
    """Keys of the full blocks of `ids[:limit]` (limit defaults to all ids), in order."""
    n = len(ids) if limit is None else min(limit, len(ids))
    keys: list[bytes] = []
    for start in range(0, n - n % block_size, block_size):
        keys.append(chain_key(keys[-1] if keys else ROOT, ids, images, start, start + block_size))
    return keys


def chain_key(parent: bytes, ids: Sequence[int], images: Sequence[ImageRef], start: int, end: int) -> bytes:
    """Key of the block holding positions [start, end) of `ids`, after the block keyed `parent`."""
    h = hashlib.sha256(parent)
    h.update(b"t" + ",".join(map(str, ids[start:end])).encode())
    for image in images:
        if image.offset < end and image.end > start:
            h.update(f"i{image.offset}:{image.length}:{image.digest}".encode())
    return h.digest()
