"""The shard's record of what each KV block holds, so a `cache_len` claim is verified, never trusted.

TGI's router (text models) and our driver (any model) send `cache_len` with blocks whose first
positions they believe hold this prompt's prefix already. The shard keeps, per block it wrote, the
content key of the full block (`tgi_vlm.prefix_hash.block_keys`: chained token ids + media hashes
and offsets, from the namespace of the request's adapter). A claim is accepted only when every block holding a position < cache_len is a full
block of this prompt, mapped slot for slot, whose record equals the prompt's key. Keys chain from
`namespace_root(adapter_id)`, the request's own `adapter_id` (the driver keys its cache the same way),
so a claim on blocks another adapter's request computed is refused.

Records are forgotten before a forward writes into a block (so a failed forward never leaves a
stale record) and written after the step that completes a block. They live as long as the KV cache.
"""

from __future__ import annotations

from tgi_vlm.errors import InvalidRequest
from tgi_vlm.prefix_hash import MediaRef, block_keys, chain_key, namespace_root


class BlockRecords:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self._keys: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def get(self, block: int) -> bytes | None:
        return self._keys.get(block)

    def forget_written(self, windows) -> None:
        """Before a forward: the blocks it writes no longer hold what was recorded."""
        bs = self.block_size
        for w in windows:
            # Every slot counts (a router may give scattered slots), but each block is popped once.
            for block in {slot // bs for slot in w.seq.slot_list[w.start : w.end]}:
                self._keys.pop(block, None)

    def record_completed(self, windows) -> None:
        """After a step: record every block its sequences have now fully computed."""
        bs = self.block_size
        for w in windows:
            seq = w.seq
            while (len(seq.block_keys) + 1) * bs <= seq.num_computed:
                j = len(seq.block_keys)
                seq.block_keys.append(next_block_key(seq, j, bs))
                self._keys[seq.slot_list[j * bs] // bs] = seq.block_keys[j]

    def verify_claim(self, request_id: int, ids: list[int], media: list[MediaRef], slots: list[int],
                     cache_len: int, *, adapter_id: str) -> list[bytes]:
        """Raise InvalidRequest unless the first `cache_len` positions are in recorded blocks with this
        prompt's content under `adapter_id`; return the keys of the blocks fully inside the prefix."""
        bs = self.block_size
        claimed = -(-cache_len // bs)
        if claimed * bs > len(ids):
            raise InvalidRequest(request_id, f"cache_len={cache_len} ends in a partial block of a {len(ids)}-token "
                                             f"prompt (block size {bs}); only whole prompt blocks are shared")
        keys = block_keys(ids, media, bs, limit=claimed * bs, root=namespace_root(adapter_id))
        for j, key in enumerate(keys):
            block = slots[j * bs] // bs
            if slots[j * bs : (j + 1) * bs] != list(range(block * bs, (block + 1) * bs)):
                raise InvalidRequest(request_id, f"cache_len={cache_len}: positions {j * bs}..{(j + 1) * bs - 1} "
                                                 "are not one whole block")
            if self._keys.get(block) != key:
                raise InvalidRequest(request_id, f"cache_len={cache_len} claims block {block} holds positions "
                                                 f"{j * bs}..{(j + 1) * bs - 1} of this prompt, but it holds other "
                                                 "content (or nothing); resend with cache_len=0")
        return keys[: cache_len // bs]


def next_block_key(seq, j: int, block_size: int) -> bytes:
    """Key of block j of `seq` (prompt or generated tokens), chained on `seq.block_keys[j - 1]`
    (block 0 on the namespace of the sequence's adapter)."""
    parent = seq.block_keys[j - 1] if j else namespace_root(seq.adapter_id)
    return chain_key(parent, seq.all_ids, seq.media_refs, j * block_size, (j + 1) * block_size)
