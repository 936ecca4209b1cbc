"""KV block arithmetic shared by the engine, the router driver and the tests.

A KV cache is `num_blocks` blocks of `block_size` token slots. Block 0 is reserved: TGI's liveness
prefill and CUDA-graph padding write there, so a pool never hands it out. Position p of a request
lives at slot `blocks[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Whole blocks holding `num_tokens` positions."""
    return -(-num_tokens // block_size)


def slots_from_blocks(blocks: list[int], block_size: int, num_tokens: int | None = None) -> list[int]:
    """The slot of each position 0..num_tokens-1 (every slot of the blocks when num_tokens is None)."""
    slots = [b * block_size + j for b in blocks for j in range(block_size)]
    return slots if num_tokens is None else slots[:num_tokens]


def tokens_to_reserve(input_len: int, max_new_tokens: int, speculate: int = 0) -> int:
    """Slots TGI v3's router gives a request: the last generated token is never fed back, and a
    speculating shard gets `speculate` more (queue.rs). Our shard needs no more than
    input_len + max_new_tokens - 1 (its drafts never pass that position), but accepts extra."""
    return max(input_len + max_new_tokens + speculate - 1, 1)


class BlockPool:
    """Free list of blocks 1..num_blocks-1; `allocate` hands out the lowest numbers first.

    Owners: the engine's pool serves requests that arrive without router-given blocks (warmup,
    tests); the router driver's allocator serves every request it schedules. Whoever allocates
    frees; `num_allocated` returning to zero is what leak checks assert.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"a KV cache needs at least 2 blocks (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() hands out 1, 2, ...

    @property
    def capacity(self) -> int:
        """Blocks that can ever be handed out (all but the reserved block 0)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return self.capacity - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise MemoryError(f"KV cache full: {n} blocks requested, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
