"""Content keys of full KV blocks, for media-aware prefix caching (shard records and driver cache).

Block j of a prompt covers positions [j·B, (j+1)·B). Its key chains the previous block's key, the
block's token ids and, for every media item (an image) whose span overlaps the block, the item's
content hash (sha256 of its bytes), its offset and its length — so two prompts whose token ids agree
(every image expands to the same placeholder ids) but whose images differ get different keys from
the first block that holds an image token. Keys are sha256: a prefix cache keyed by a weak hash can
be made to collide. Only full blocks have keys; a partial last block is never shared.

Every item's record names its kind first (`media_record`): the same bytes as an image and as another
kind give different features, so different K/V.

The chain starts from a namespace, `namespace_root(adapter_id, salt)`: everything besides the tokens
and media that changes what a block's K/V hold (a LoRA adapter changes every layer's K and V; a
tenant's cache salt keeps tenants apart). Equal token ids under two namespaces share no block, at
any position, because every key chains the root. Keys are process-local values (never sent on the
wire): the shard's records and the driver's cache agree because both call these functions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from tgi_vlm.media import MediaKind

KEY_VERSION = b"tgi-vlm-prefix-v2"  # change it when the key layout changes


@dataclass(frozen=True)
class MediaRef:
    """A media item's place in the prompt: tokens [offset, offset + length), its content hash (hex)
    and its kind. The shard (`MediaSpan.ref`) and the router driver (`TokenCounter.tokenize`) make
    them from the same spans."""

    kind: MediaKind
    offset: int
    length: int
    digest: str

    @property
    def end(self) -> int:
        return self.offset + self.length


def namespace_root(adapter_id: str = "", salt: str = "") -> bytes:
    """The parent of block 0's key for requests run with `adapter_id` ("" = base model) and cache
    `salt` ("" = none): sha256 of KEY_VERSION and the length-prefixed fields, so ("", "") is one fixed
    root and no two field tuples give the same bytes."""
    h = hashlib.sha256(KEY_VERSION)
    for name, value in (("adapter", adapter_id), ("salt", salt)):
        data = value.encode()
        h.update(f"|{name}:{len(data)}:".encode() + data)
    return h.digest()


def block_keys(ids: Sequence[int], media: Sequence[MediaRef], block_size: int, limit: int | None = None, *,
               root: bytes) -> list[bytes]:
    """Keys of the full blocks of `ids[:limit]` (limit defaults to all ids), in order, chained from
    `root` (a `namespace_root`; required, so no caller forgets the adapter)."""
    n = len(ids) if limit is None else min(limit, len(ids))
    keys: list[bytes] = []
    for start in range(0, n - n % block_size, block_size):
        keys.append(chain_key(keys[-1] if keys else root, ids, media, start, start + block_size))
    return keys


def chain_key(parent: bytes, ids: Sequence[int], media: Sequence[MediaRef], start: int, end: int) -> bytes:
    """Key of the block holding positions [start, end) of `ids`, after the block keyed `parent` (for
    block 0, the request's `namespace_root`)."""
    h = hashlib.sha256(parent)
    h.update(b"t" + ",".join(map(str, ids[start:end])).encode())
    for ref in media:
        if ref.offset < end and ref.end > start:
            h.update(media_record(ref))
    return h.digest()


def media_record(ref: MediaRef) -> bytes:
    """What a block key takes from an item overlapping it: its kind first, so no record of one kind reads
    as one of another, then its place and content hash."""
    return f"m{ref.kind.value}:{ref.offset}:{ref.length}:{ref.digest}".encode()
