"""The router driver's prefix cache (router/prefix_cache.py) at the edges its own tests leave open: where a
cached prefix is cut back to when it would end inside a bidirectional group (exact positions), a distrusted
match whose blocks are already idle, reference counts of blocks nobody holds, and resetting the counters."""

from __future__ import annotations

import pytest

from tgi_vlm.router.prefix_cache import PrefixCache, PrefixStats, outside_groups, prompt_blocks

BS = 4


@pytest.mark.parametrize(("cache_len", "groups", "expected"), [
    # a group starting on a block boundary: back to its own start, not a block earlier
    (12, [-1] * 8 + [3] * 6 + [-1] * 2, 8),
    # a group starting one position into a block: back to that block's start
    (8, [-1] * 7 + [3] * 5 + [-1] * 4, 4),
    (8, [-1] * 5 + [3] * 7 + [-1] * 4, 4),
    # ending exactly where a group starts, between two groups, or where one ends: nothing to undo
    (8, [-1] * 8 + [3] * 4, 8),
    (4, [1] * 4 + [2] * 4 + [-1] * 4, 4),
    (8, [1] * 4 + [2] * 4 + [-1] * 4, 8),
    # inside the second of two adjacent groups: back to its start, which is already outside the first
    (8, [5] * 4 + [6] * 8, 4),
    # inside a group that covers everything from 0 (PaliGemma's prefix): nothing can be reused
    (8, [0] * 12, 0),
    (0, [0] * 12, 0),
    (12, [-1] * 12, 12),
])
def test_a_cached_prefix_is_cut_back_to_the_block_holding_the_start_of_the_group_it_ends_in(cache_len, groups,
                                                                                           expected):
    assert outside_groups(cache_len, groups, BS) == expected
    assert outside_groups(cache_len, None, BS) == cache_len  # no bidirectional groups: never cut


def served(cache: PrefixCache, tokens: list[int]):
    allocation = cache.allocate(len(tokens) + 2, prompt_blocks(tokens, [], None, BS))
    cache.cache_prompt(allocation)
    cache.free(allocation)
    return allocation


def test_distrusting_a_match_whose_blocks_are_already_idle_returns_them_to_the_pool():
    cache = PrefixCache(16, BS)
    empty = cache.num_free
    tokens = list(range(100, 110))  # two whole blocks and two tokens
    first = served(cache, tokens)
    again = served(cache, tokens)  # matches both blocks; freed, they are idle again
    assert again.cache_len == 8 and again.blocks[:2] == first.blocks[:2]
    assert cache.idle_blocks() == first.blocks[:2] and cache.num_cached == 2
    cache.distrust(again)
    assert (cache.num_cached, cache.idle_blocks(), cache.num_free) == (0, [], empty)
    assert cache.pool.num_free == empty  # in the pool itself, not only counted free
    assert cache.cache_len(prompt_blocks(tokens, [], None, BS)) == 0


def test_a_block_nobody_holds_has_zero_references():
    cache = PrefixCache(16, BS)
    assert cache.refs(5) == 0
    allocation = cache.allocate(6, prompt_blocks(list(range(6)), [], None, BS))
    assert [cache.refs(b) for b in allocation.blocks] == [1, 1]
    cache.cache_prompt(allocation)
    cache.free(allocation)
    assert [cache.refs(b) for b in allocation.blocks] == [0, 0]  # idle (block 0 cached) or free: 0, not None


def test_resetting_the_counters_keeps_the_number_of_blocks_cached():
    stats = PrefixStats(requests=3, prompt_tokens=90, cached_tokens=30, hits=2, refused_claims=1, blocks_cached=7,
                        inserted=9, evictions=4)
    stats.reset_counters()
    assert stats == PrefixStats(blocks_cached=7)
    assert stats.hit_rate == 0.0
