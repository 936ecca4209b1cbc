"""The router driver's prefix cache: a media-aware block allocator (TGI v3's `RadixAllocator`,
keyed on content instead of a radix tree of token ids).

Keys are `prefix_hash.block_keys`, the shard's own function: block j's key chains blocks 0..j's
token ids and the content hash + offset of every media item (image) overlapping them, from the
namespace of the request's `adapter_id` (`namespace_root`, as the shard derives it). A match is
therefore a run of whole blocks from the start of the prompt, two prompts whose ids agree but whose
images differ part at the first block holding an image token, and requests of two adapters share no
block.

Every allocatable block is in exactly one state:
  free      in the pool;
  held      `refs[b] > 0`: listed by that many live allocations (cached or not);
  idle      cached (in the index) with no reference: in `_lru`, oldest first; a match takes it
            back, an allocation short of free blocks evicts it (then it is free).

Lifecycle of one allocation (the router calls each at most once, `free` exactly once):
  `allocate`      cached blocks for the longest run of the prompt's keys in the index, then fresh
                  ones; cache_len = matched·B, or prompt_len − 1 when the whole prompt was found
                  (the shard must compute one token to sample from), backed off to a block boundary
                  before any bidirectional group it would end inside (Gemma3 image, PaliGemma prefix).
  `cache_prompt`  once the prompt is computed (its first token came back, so the shard recorded its
                  blocks): the prompt's whole blocks enter the index. Never the block of position
                  prompt_len (generated tokens are written there and after), never a block whose key
                  is already indexed (another request computed the same content first).
  `distrust`      the shard refused the claim: the claimed blocks leave the index (they do not hold
                  what the index says; stale after a failed forward, say).
  `free`          refs − 1; a block at 0 goes idle if indexed, else back to the pool.
Requests with prefill logprobs get no `prompt` (no lookup, no insert), as in TGI.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass

from tgi_vlm.blocks import slots_from_blocks
from tgi_vlm.prefix_hash import MediaRef, block_keys, namespace_root
from tgi_vlm.router.allocator import Allocation, BlockAllocator, PromptBlocks


@dataclass
class PrefixStats:
    """Prefix-cache counters of one router. The router counts prefills the shard accepted; the cache
    counts its blocks."""

    requests: int = 0  # requests whose Prefill the shard accepted
    prompt_tokens: int = 0  # their prompt tokens
    cached_tokens: int = 0  # of which taken from the cache (sum of accepted cache_len)
    hits: int = 0  # requests sent with cache_len > 0 and accepted
    refused_claims: int = 0  # cache_len claims the shard refused (each request resent with cache_len=0)
    blocks_cached: int = 0  # blocks in the index now (held or idle)
    inserted: int = 0  # blocks ever entered into the index
    evictions: int = 0  # idle blocks evicted to make room

    @property
    def hit_rate(self) -> float:
        """Prompt tokens reused / prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def count_prefill(self, prompt_len: int, cache_len: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_len
        self.cached_tokens += cache_len
        self.hits += cache_len > 0

    def reset_counters(self) -> None:
        """Zero the counters (`blocks_cached` is state, not a counter: it stays)."""
        blocks = self.blocks_cached
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)
        self.blocks_cached = blocks

    def to_dict(self) -> dict:
        return asdict(self) | {"hit_rate": self.hit_rate}

    def summary(self) -> str:
        return (f"prefix cache: hit rate {self.hit_rate:.1%} ({self.cached_tokens}/{self.prompt_tokens} prompt tokens, "
                f"{self.hits}/{self.requests} requests), {self.blocks_cached} blocks cached, {self.inserted} inserted, "
                f"{self.evictions} evicted, {self.refused_claims} claims refused")


def prompt_blocks(ids: list[int], media: list[MediaRef], group_ids: list[int] | None, block_size: int, *,
                  adapter_id: str = "") -> PromptBlocks:
    """The prompt as the cache keys it: keys in the namespace of the request's `adapter_id`."""
    keys = block_keys(ids, media, block_size, root=namespace_root(adapter_id))
    return PromptBlocks(len(ids), tuple(keys), None if group_ids is None else tuple(group_ids))


def outside_groups(cache_len: int, group_ids: tuple[int, ...] | None, block_size: int) -> int:
    """`cache_len`, moved back to a block boundary until it does not end inside a bidirectional group
    (the group's earlier tokens attended to its later ones when they were computed)."""
    while group_ids is not None and 0 < cache_len < len(group_ids):
        group = group_ids[cache_len - 1]
        if group < 0 or group_ids[cache_len] != group:
            break
        start = cache_len - 1
        while start > 0 and group_ids[start - 1] == group:
            start -= 1
        cache_len = start - start % block_size
    return cache_len


class PrefixCache(BlockAllocator):
    """Reference-counted blocks, an index of cached prompt blocks by content key, LRU eviction."""

    def __init__(self, num_blocks: int, block_size: int, stats: PrefixStats | None = None):
        super().__init__(num_blocks, block_size)
        self.stats = stats or PrefixStats()
        self._index: dict[bytes, int] = {}  # key → block
        self._key_of: dict[int, bytes] = {}  # block → key (inverse of _index)
        self._refs: dict[int, int] = {}  # held blocks only
        self._lru: OrderedDict[int, None] = OrderedDict()  # idle blocks, least recently used first

    # ----- queries -----
    @property
    def num_free(self) -> int:
        return self.pool.num_free + len(self._lru)

    @property
    def is_full(self) -> bool:
        return self.pool.num_allocated == len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._index)

    def can_allocate(self, tokens: int) -> bool:
        return self.blocks_for(tokens) <= self.num_free

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)

    def idle_blocks(self) -> list[int]:
        """Idle cached blocks, next to be evicted first."""
        return list(self._lru)

    def cache_len(self, prompt: PromptBlocks | None) -> int:
        return self._match(prompt)[1]

    # ----- the lifecycle -----
    def allocate(self, tokens: int, prompt: PromptBlocks | None = None) -> Allocation | None:
        cached, cache_len = self._match(prompt)
        fresh = self.blocks_for(tokens) - len(cached)
        idle_taken = sum(1 for b in cached if b in self._lru)
        if fresh > self.pool.num_free + len(self._lru) - idle_taken:
            return None
        for b in cached:
            self._lru.pop(b, None)
            self._refs[b] = self._refs.get(b, 0) + 1
        self._evict(fresh - self.pool.num_free)
        new = self.pool.allocate(fresh)
        for b in new:
            self._refs[b] = 1
        blocks = cached + new
        return Allocation(blocks, slots_from_blocks(blocks, self.block_size, tokens), cache_len, prompt)

    def cache_prompt(self, allocation: Allocation) -> None:
        prompt = allocation.prompt
        if prompt is None:
            return
        for key, block in zip(prompt.keys, allocation.blocks):  # keys: whole prompt blocks only
            if key in self._index or block in self._key_of:
                continue
            self._index[key] = block
            self._key_of[block] = key
            self.stats.inserted += 1
        self.stats.blocks_cached = len(self._index)

    def distrust(self, allocation: Allocation) -> None:
        claimed = -(-allocation.cache_len // self.block_size)
        for block in allocation.blocks[:claimed]:
            self._unindex(block)
        self.stats.blocks_cached = len(self._index)

    def free(self, allocation: Allocation) -> None:
        for block in allocation.blocks:
            refs = self._refs[block] - 1
            if refs:
                self._refs[block] = refs
                continue
            del self._refs[block]
            if block in self._key_of:
                self._lru[block] = None  # youngest
            else:
                self.pool.free([block])

    # ----- helpers -----
    def _match(self, prompt: PromptBlocks | None) -> tuple[list[int], int]:
        """(cached blocks to reuse, cache_len) for `prompt`; no state changes."""
        if prompt is None:
            return [], 0
        cached: list[int] = []
        for key in prompt.keys:
            block = self._index.get(key)
            if block is None:
                break
            cached.append(block)
        bs = self.block_size
        cache_len = len(cached) * bs
        if cache_len == prompt.length:
            cache_len -= 1  # the whole prompt was found: the shard recomputes its last token
        cache_len = outside_groups(cache_len, prompt.group_ids, bs)
        return cached[: -(-cache_len // bs)], cache_len

    def _evict(self, n: int) -> None:
        for _ in range(max(n, 0)):
            block, _ = self._lru.popitem(last=False)
            self._unindex(block)
            self.pool.free([block])
            self.stats.evictions += 1
        self.stats.blocks_cached = len(self._index)

    def _unindex(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._index[key]
        if block in self._lru:  # idle and no longer cached: free
            del self._lru[block]
            self.pool.free([block])
