"""The router's KV block allocator (TGI v3's `SimpleAllocator`): blocks and slots per request.

Block 0 is never handed out: TGI's liveness prefill and CUDA-graph padding write there. A request
of `input_len` prompt tokens and `max_new_tokens` gets blocks for `input_len + max_new_tokens - 1`
positions (the last generated token is never fed back), and one slot per position:
`slot = block * block_size + offset`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Allocation:
    blocks: list[int]
    slots: list[int]  # one per position, len == tokens


def tokens_to_allocate(input_len: int, max_new_tokens: int) -> int:
    return max(input_len + max_new_tokens - 1, 1)


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"need at least 2 blocks (block 0 is reserved) of size >= 1, got {num_blocks} × {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() hands out 1, 2, ...

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Blocks that can ever be handed out (all but the reserved block 0)."""
        return self.num_blocks - 1

    @property
    def is_full(self) -> bool:
        """True when every allocatable block is free again (nothing is held)."""
        return len(self._free) == self.capacity

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_allocate(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= len(self._free)

    def allocate(self, tokens: int) -> Allocation | None:
        """Blocks and slots for `tokens` positions, or None when not enough blocks are free."""
        n = self.blocks_for(tokens)
        if n > len(self._free):
            return None
        blocks = [self._free.pop() for _ in range(n)]
        bs = self.block_size
        slots = [blocks[p // bs] * bs + p % bs for p in range(tokens)]
        return Allocation(blocks=blocks, slots=slots)

    def free(self, allocation: Allocation) -> None:
        self._free.extend(reversed(allocation.blocks))
