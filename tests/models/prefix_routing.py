"""Router-shaped prefix-cache requests for in-process tests: blocks and slots as TGI's v3 router
gives them (cached blocks first, then fresh ones; one slot per position) and a `cache_len`."""

from __future__ import annotations

from tgi_vlm.blocks import blocks_needed, slots_from_blocks, tokens_to_reserve
from tgi_vlm.router.allocator import BlockAllocator
from tgi_vlm.testing.harness import make_request


class RoutedBlocks:
    """Hands out router blocks from an engine's KV cache (the engine's own pool is left alone)."""

    def __init__(self, engine):
        engine.ensure_kv_cache()
        self.engine = engine
        self.block_size = engine.config.block_size
        # Router blocks come from the top half of the cache, server-pool blocks from the bottom.
        half = engine.kv_cache.num_blocks // 2
        self.allocator = BlockAllocator(half, self.block_size)
        self.offset = half

    def prompt_ids(self, chunks) -> list[int]:
        return self.engine.tokenize_request(make_request(0, *chunks)).ids

    def request(self, request_id: int, chunks, max_new_tokens: int, *, prefix_blocks=(), cache_len: int = 0, **kw):
        """A request whose first blocks are `prefix_blocks` (already holding a prefix) and the rest fresh."""
        tokens = tokens_to_reserve(len(self.prompt_ids(chunks)), max_new_tokens)
        fresh = blocks_needed(tokens, self.block_size) - len(prefix_blocks)
        blocks = list(prefix_blocks) + [b + self.offset for b in self.allocator.pool.allocate(max(fresh, 0))]
        request = make_request(request_id, *chunks, max_new_tokens=max_new_tokens, **kw)
        request.blocks.extend(blocks)
        request.slots.extend(slots_from_blocks(blocks, self.block_size, tokens))
        request.cache_len = cache_len
        return request


def common_blocks(a: list[int], b: list[int], block_size: int) -> int:
    """Whole blocks of the longest common prefix of two prompts (what a radix match finds)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n // block_size
