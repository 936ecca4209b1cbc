"""The router driver's prefix cache (router/prefix_cache.py), with no shard: whole-block matching on
token ids and images, TGI's cache_len, insert once prefilled, refcounts, LRU eviction, cancel and
refused claims."""

from __future__ import annotations

import pytest

from tgi_vlm.media import MediaKind
from tgi_vlm.prefix_hash import MediaRef
from tgi_vlm.router.prefix_cache import PrefixCache, PrefixStats, outside_groups, prompt_blocks
from tgi_vlm.router.queue import Entry, Queue
from tgi_vlm.router.requests import RequestParams
from tgi_vlm.router.router import cacheable_prompt, is_cache_claim_refusal, refusal_reasons
from tgi_vlm.router.tokens import PromptTokens

BS = 4


def ids(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def keyed(tokens: list[int], media=(), groups=None):
    return prompt_blocks(tokens, list(media), groups, BS)


def served(cache: PrefixCache, tokens: list[int], new: int = 3, media=()):
    """A request that ran to its first token and finished: its prompt blocks are now cached."""
    allocation = cache.allocate(len(tokens) + new - 1, keyed(tokens, media))
    cache.cache_prompt(allocation)
    cache.free(allocation)
    return allocation


# ----- matching -----

def test_a_repeated_prefix_gets_the_cached_blocks_first_then_fresh_ones():
    cache = PrefixCache(num_blocks=32, block_size=BS)
    first = served(cache, ids(10))
    second = cache.allocate(14 + 2 - 1, keyed(ids(10) + ids(4, 900)))
    assert second.cache_len == 8  # two whole blocks of the shared 10 tokens
    assert second.blocks[:2] == first.blocks[:2]
    assert not set(second.blocks[2:]) & set(first.blocks[:2])
    assert second.slots[:8] == [b * BS + j for b in first.blocks[:2] for j in range(BS)]
    assert len(second.slots) == 15


def test_only_whole_blocks_match_and_the_match_stops_at_the_first_difference():
    cache = PrefixCache(num_blocks=32, block_size=BS)
    served(cache, ids(12))
    assert cache.cache_len(keyed(ids(7) + [1, 2, 3, 4, 5])) == 4  # 7 common tokens: one whole block
    assert cache.cache_len(keyed([1] + ids(11)[1:])) == 0  # differs at token 0: later blocks never match alone


def test_the_whole_prompt_found_gives_cache_len_prompt_length_minus_one():
    cache = PrefixCache(num_blocks=32, block_size=BS)
    first = served(cache, ids(8))
    again = cache.allocate(8 + 4 - 1, keyed(ids(8)))
    assert again.cache_len == 7 and again.blocks[:2] == first.blocks[:2]


def test_same_ids_with_a_different_image_stop_before_the_first_block_holding_the_image():
    cache = PrefixCache(num_blocks=32, block_size=BS)
    tokens = ids(16)  # image tokens at 6..9: blocks 1 and 2 overlap it
    served(cache, tokens, media=[MediaRef(MediaKind.IMAGE, 6, 4, "aa" * 32)])
    assert cache.cache_len(keyed(tokens + [7], [MediaRef(MediaKind.IMAGE, 6, 4, "aa" * 32)])) == 16
    assert cache.cache_len(keyed(tokens + [7], [MediaRef(MediaKind.IMAGE, 6, 4, "bb" * 32)])) == 4
    assert cache.cache_len(keyed(tokens + [7], [MediaRef(MediaKind.IMAGE, 5, 4, "aa" * 32)])) == 4  # same image, other place


def test_a_cached_prefix_never_ends_inside_a_bidirectional_group():
    groups = [-1] * 6 + [0] * 8 + [-1] * 6  # one group at 6..13
    assert outside_groups(12, groups, BS) == 4  # 12 is inside 6..13: back to the block holding 6
    assert outside_groups(16, groups, BS) == 16 and outside_groups(14, groups, BS) == 14  # after the group
    assert outside_groups(19, [0] * 20, BS) == 0  # PaliGemma: the whole prompt is one group
    cache = PrefixCache(num_blocks=32, block_size=BS)
    tokens = ids(20)
    first = served(cache, tokens[:12])  # 3 blocks: a prefix of 12 would end inside the group
    allocation = cache.allocate(20, keyed(tokens, groups=groups))
    assert allocation.cache_len == 4 and allocation.blocks[:1] == first.blocks[:1]
    assert not set(allocation.blocks[1:]) & set(first.blocks[:3])


# ----- insert -----

def test_nothing_is_cached_before_the_prompt_is_computed():
    cache = PrefixCache(num_blocks=32, block_size=BS)
    allocation = cache.allocate(12, keyed(ids(10)))
    assert cache.cache_len(keyed(ids(10))) == 0
    cache.free(allocation)  # cancelled or failed before its first token
    assert cache.num_cached == 0 and cache.is_full and cache.num_free == 31


def test_only_whole_prompt_blocks_are_cached_never_the_block_of_generated_tokens():
    cache = PrefixCache(num_blocks=32, block_size=BS)
    allocation = cache.allocate(10 + 6 - 1, keyed(ids(10)))  # positions 0..14: 4 blocks
    cache.cache_prompt(allocation)
    assert cache.num_cached == 2 and cache.stats.inserted == 2
    cache.free(allocation)
    assert sorted(cache.idle_blocks()) == sorted(allocation.blocks[:2])
    assert cache.pool.num_free == 31 - 2


def test_a_block_computed_twice_is_cached_once():
    cache = PrefixCache(num_blocks=32, block_size=BS)
    a = cache.allocate(10, keyed(ids(8)))
    b = cache.allocate(10, keyed(ids(8)))  # arrived together: neither found the other
    cache.cache_prompt(a)
    cache.cache_prompt(b)
    assert cache.num_cached == 2
    cache.free(a)
    cache.free(b)
    assert cache.idle_blocks() == a.blocks[:2] and cache.pool.num_free == 31 - 2


# ----- refcounts and eviction -----

def test_shared_blocks_are_held_until_the_last_holder_frees_them():
    cache = PrefixCache(num_blocks=32, block_size=BS)
    owner = cache.allocate(8 + 4 - 1, keyed(ids(8)))
    cache.cache_prompt(owner)  # still decoding
    sharer = cache.allocate(12 + 2 - 1, keyed(ids(8) + ids(4, 500)))
    assert sharer.blocks[:2] == owner.blocks[:2] and [cache.refs(b) for b in owner.blocks[:2]] == [2, 2]
    cache.free(owner)
    assert [cache.refs(b) for b in owner.blocks[:2]] == [1, 1] and cache.idle_blocks() == []
    assert not cache.is_full
    cache.free(sharer)
    assert cache.idle_blocks() == owner.blocks[:2] and cache.is_full and cache.num_free == 31


def test_idle_blocks_are_evicted_least_recently_used_first():
    cache = PrefixCache(num_blocks=8, block_size=BS)  # 7 allocatable blocks
    a, b, c = (ids(4, start) for start in (100, 200, 300))
    blocks = {name: served(cache, p, new=1).blocks[0] for name, p in (("a", a), ("b", b), ("c", c))}
    served(cache, b + [1], new=1)  # b used again: now the youngest
    assert cache.idle_blocks() == [blocks["a"], blocks["c"], blocks["b"]]
    big = cache.allocate(4 * 6, None)  # 6 blocks: the 4 free ones, then a, then c
    assert big is not None and cache.stats.evictions == 2
    assert cache.idle_blocks() == [blocks["b"]]
    assert cache.cache_len(keyed(a + [1])) == 0 and cache.cache_len(keyed(c + [1])) == 0
    assert cache.cache_len(keyed(b + [1])) == 4
    assert cache.stats.blocks_cached == 1


def test_held_blocks_are_never_evicted_and_a_failed_allocation_changes_nothing():
    cache = PrefixCache(num_blocks=8, block_size=BS)
    owner = cache.allocate(8, keyed(ids(8)))
    cache.cache_prompt(owner)
    served(cache, ids(4, 700), new=1)  # one idle block
    before = (cache.pool.num_free, cache.idle_blocks(), cache.num_cached)
    assert cache.allocate(4 * 6, None) is None  # 4 free + 1 idle < 6; the owner's 2 are held
    assert (cache.pool.num_free, cache.idle_blocks(), cache.num_cached) == before


def test_an_allocation_does_not_evict_the_idle_blocks_it_matched():
    cache = PrefixCache(num_blocks=5, block_size=BS)  # 4 allocatable blocks
    first = served(cache, ids(8), new=1)  # 2 idle blocks
    assert cache.allocate(8 + 12 - 1, keyed(ids(8))) is None  # needs 3 fresh; only 2 free besides its own
    again = cache.allocate(8 + 8 - 1, keyed(ids(8)))  # needs 2 fresh
    assert again.blocks[:2] == first.blocks[:2] and again.cache_len == 7 and cache.stats.evictions == 0


# ----- refused claims -----

def test_a_distrusted_match_leaves_the_cache_and_its_blocks_return_to_the_pool():
    cache = PrefixCache(num_blocks=32, block_size=BS)
    served(cache, ids(12))
    claim = cache.allocate(16, keyed(ids(12) + ids(2, 50)))
    assert claim.cache_len == 12
    cache.distrust(claim)
    cache.free(claim)
    assert cache.cache_len(keyed(ids(12) + ids(2, 50))) == 0
    assert cache.num_cached == 0 and cache.idle_blocks() == [] and cache.pool.num_free == 31


def test_the_router_resends_only_refusals_that_name_the_cache_len_claim():
    details = ("batch rejected (2 invalid request(s)): request 4: cache_len=16 claims block 7 holds positions 0..15 "
               "of this prompt, but it holds other content (or nothing); resend with cache_len=0; "
               "request 9: temperature must be >= 0; top_p must be in [0, 1]")
    reasons = refusal_reasons(details)
    assert reasons == {4: "cache_len=16 claims block 7 holds positions 0..15 of this prompt, but it holds other "
                          "content (or nothing); resend with cache_len=0",
                       9: "temperature must be >= 0; top_p must be in [0, 1]"}
    cache = PrefixCache(num_blocks=32, block_size=BS)
    served(cache, ids(8))
    claimed = entry(4, 10, cache, ids(10))
    claimed.allocation = cache.allocate(12, claimed.prompt)
    assert is_cache_claim_refusal(claimed, reasons[4])
    assert not is_cache_claim_refusal(claimed, reasons[9])
    fresh = entry(9, 10, cache, ids(10, 900))
    fresh.allocation = cache.allocate(12, fresh.prompt)
    assert not is_cache_claim_refusal(fresh, "cache_len=3 leaves nothing to compute")  # it claimed nothing


# ----- what the router keys, and the queue's budget -----

def test_requests_with_prefill_logprobs_or_a_bare_length_are_neither_looked_up_nor_cached():
    prompt = PromptTokens(ids(8), [])
    assert cacheable_prompt(prompt, RequestParams(["x"]), BS) == keyed(ids(8))
    assert cacheable_prompt(prompt, RequestParams(["x"], prefill_logprobs=True), BS) is None
    assert cacheable_prompt(8, RequestParams(["x"]), BS) is None
    cache = PrefixCache(num_blocks=32, block_size=BS)
    served(cache, ids(8))
    plain = cache.allocate(10, None)
    cache.cache_prompt(plain)
    assert plain.cache_len == 0 and cache.num_cached == 2 and cache.stats.inserted == 2


def entry(i: int, input_len: int, cache: PrefixCache, tokens: list[int], max_new_tokens: int = 4) -> Entry:
    return Entry(id=i, params=RequestParams(["x"], max_new_tokens=max_new_tokens), input_len=input_len,
                 submitted=0.0, prompt=keyed(tokens))


def test_only_the_uncached_suffix_counts_against_the_prefill_budget_and_cache_len_is_sent():
    cache = PrefixCache(num_blocks=64, block_size=BS)
    served(cache, ids(24))
    queue = Queue(cache)
    queue.append(entry(0, 30, cache, ids(24) + ids(6, 900)))
    queue.append(entry(1, 8, cache, ids(8, 500)))
    nxt = queue.next_batch(min_size=None, max_size=None, prefill_budget=10, chunking=True)
    first, second = nxt.batch.requests
    assert (first.cache_len, first.HasField("chunk_len")) == (24, False)  # 6 to compute: fits
    assert (second.cache_len, second.chunk_len) == (0, 4)  # 10 - 6 left of the budget
    assert len(first.slots) == 30 + 4 - 1


def test_a_batch_put_back_returns_its_matched_blocks_to_idle():
    cache = PrefixCache(num_blocks=64, block_size=BS)
    served(cache, ids(8))
    queue = Queue(cache)
    queue.append(entry(0, 10, cache, ids(10)))
    assert queue.next_batch(min_size=2, max_size=None, prefill_budget=100, chunking=False) is None
    assert cache.is_full and len(cache.idle_blocks()) == 2 and queue.waiting[0].allocation is None


@pytest.mark.parametrize("prompt, cached, expected", [(100, 0, 0.0), (100, 75, 0.75)])
def test_the_hit_rate_is_reused_prompt_tokens_over_prompt_tokens(prompt, cached, expected):
    stats = PrefixStats()
    stats.count_prefill(prompt, cached)
    assert stats.hit_rate == expected and stats.hits == (cached > 0) and stats.to_dict()["hit_rate"] == expected


def test_a_caller_that_already_tokenized_the_prompt_is_not_tokenized_again():
    """`tgi-vlm launch` validates with PromptTokens; the router must reuse them (one processor run)."""
    import asyncio

    from tgi_vlm.pb import generate_pb2 as pb
    from tgi_vlm.router.requests import RequestParams
    from tgi_vlm.router.router import Router, RouterConfig
    from tgi_vlm.router.tokens import PromptTokens

    class StubShard:
        async def clear_cache(self, _):
            return None

        async def info(self):
            return pb.InfoResponse(block_size=16, support_chunking=True)

        async def warmup(self, _):
            return pb.WarmupResponse(max_supported_total_tokens=1600, max_input_tokens=100, max_total_tokens=200)

    counted: list[int] = []

    def count(request):
        counted.append(request.id)
        return PromptTokens(list(range(20)), [])

    async def scenario():
        router = Router(StubShard(), count, RouterConfig())
        await router.start()
        await router.submit(RequestParams(["hi"], max_new_tokens=4), input_len=PromptTokens(list(range(20)), []))
        assert counted == []
        await router.submit(RequestParams(["hi"], max_new_tokens=4), input_len=20)  # a bare count is not enough
        assert len(counted) == 1
        assert [e.input_len for e in router.queue.waiting] == [20, 20]

    asyncio.run(scenario())
