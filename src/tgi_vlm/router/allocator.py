"""The router's KV block allocator (TGI v3's `SimpleAllocator`): blocks and slots per request.

Block arithmetic and the free list are `tgi_vlm.blocks`, shared with the engine. A request of
`input_len` prompt tokens and `max_new_tokens` gets blocks for `input_len + max_new_tokens - 1`
positions (`tokens_to_reserve`) and one slot per position.

`BlockAllocator` caches nothing (the driver's `prefix_caching=False` mode); `PrefixCache`
(`prefix_cache.py`) extends it with cached prompt blocks. The queue and the router speak to both
through the methods here: `cache_len` (a peek), `allocate`, `cache_prompt`, `distrust`, `free`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tgi_vlm.blocks import BlockPool, blocks_needed, slots_from_blocks, tokens_to_reserve

__all__ = ["Allocation", "BlockAllocator", "PromptBlocks", "tokens_to_reserve"]


@dataclass(frozen=True)
class PromptBlocks:
    """What a prefix cache needs of a prompt: its length, the content key of each whole block
    (`prefix_hash.block_keys`) and its bidirectional groups (a cached prefix never ends inside one)."""

    length: int
    keys: tuple[bytes, ...]
    group_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Allocation:
    blocks: list[int]
    slots: list[int]  # one per position, len == tokens
    cache_len: int = 0  # leading prompt positions whose K/V `blocks` already hold (Request.cache_len)
    prompt: PromptBlocks | None = None  # set when the prompt takes part in prefix caching


class BlockAllocator:
    """Whole-request allocations over a `BlockPool`; `is_full` means nothing is held. Caches nothing."""

    def __init__(self, num_blocks: int, block_size: int):
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks an allocation could get now."""
        return self.pool.num_free

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def is_full(self) -> bool:
        """True when every allocatable block is free again (nothing is held)."""
        return self.pool.num_allocated == 0

    def blocks_for(self, tokens: int) -> int:
        return blocks_needed(tokens, self.block_size)

    def can_allocate(self, tokens: int) -> bool:
        return self.pool.can_allocate(self.blocks_for(tokens))

    def cache_len(self, prompt: PromptBlocks | None) -> int:
        """The cache_len an allocation for `prompt` would get now (nothing is cached here)."""
        return 0

    def allocate(self, tokens: int, prompt: PromptBlocks | None = None) -> Allocation | None:
        """Blocks and slots for `tokens` positions, or None when not enough blocks are free."""
        if not self.can_allocate(tokens):
            return None
        blocks = self.pool.allocate(self.blocks_for(tokens))
        return Allocation(blocks=blocks, slots=slots_from_blocks(blocks, self.block_size, tokens))

    def cache_prompt(self, allocation: Allocation) -> None:
        """The request's prompt is computed: its whole blocks may serve later requests (not here)."""

    def distrust(self, allocation: Allocation) -> None:
        """The shard refused this allocation's cache_len claim (never made here)."""

    def free(self, allocation: Allocation) -> None:
        self.pool.free(allocation.blocks)
