"""The cross-request encoder cache's byte accounting (models/encoder_cache.py): entries of different sizes and
dtypes, an entry exactly the size of the budget, one byte-size past it, eviction oldest first until the kept
bytes fit, and counters that count each lookup once. The budget is in bytes (numel x element size) and only
the entry's own bytes count (a view of a batched vision output is copied, never the whole batch kept)."""

from __future__ import annotations

import torch

from tgi_vlm.models.encoder_cache import EncoderCache


def features(nbytes: int, dtype: torch.dtype = torch.float32, fill: float = 1.0) -> torch.Tensor:
    size = torch.tensor([], dtype=dtype).element_size()
    assert nbytes % size == 0
    return torch.full((nbytes // size,), fill, dtype=dtype)


def kept(cache: EncoderCache, names: str) -> str:
    """Which of `names` the cache holds (each checked once; a hit makes it the most recent)."""
    return "".join(n for n in names if cache.lookup(n) is not None)


def test_entries_of_different_sizes_fill_the_budget_exactly_and_evict_oldest_first_until_they_fit():
    cache = EncoderCache(shared_bytes=100)
    cache.remember("a", features(40))
    cache.remember("b", features(20))
    cache.remember("c", features(40))  # 100 of 100 bytes: nothing evicted
    cache.remember("d", features(20))  # 120: "a" (40) goes, 80 left
    cache.remember("e", features(20))  # 100 again: nothing evicted
    assert kept(cache, "abcde") == "bcde"
    assert (cache.hits, cache.misses) == (4, 1)


def test_one_large_entry_evicts_as_many_older_ones_as_it_needs_and_no_more():
    cache = EncoderCache(shared_bytes=100)
    for name in "abcd":
        cache.remember(name, features(20))  # 80 bytes
    cache.remember("big", features(60))  # 140: "a" and "b" go (100 left), "c" and "d" stay
    assert kept(cache, ["a", "b", "c", "d", "big"]) == "cdbig"


def test_an_entry_exactly_the_size_of_the_budget_is_kept_alone():
    cache = EncoderCache(shared_bytes=100)
    cache.remember("a", features(40))
    whole = features(100)
    cache.remember("whole", whole)
    assert cache.lookup("whole") is whole and cache.lookup("a") is None
    cache.remember("small", features(4))  # 104 bytes: the whole-budget entry goes
    assert kept(cache, ["whole", "small"]) == "small"


def test_an_entry_one_element_past_the_budget_is_not_kept_and_evicts_nothing():
    cache = EncoderCache(shared_bytes=100)
    cache.remember("a", features(40))
    cache.remember("too big", features(104))
    assert kept(cache, ["too big", "a"]) == "a"


def test_bytes_are_element_size_times_count_whatever_the_dtype():
    cache = EncoderCache(shared_bytes=100)
    cache.remember("bf16", features(100, torch.bfloat16))  # 50 elements of 2 bytes: exactly the budget
    assert cache.lookup("bf16") is not None
    cache.remember("f64", features(96, torch.float64))  # 12 elements of 8 bytes; 196 in all: "bf16" goes
    assert kept(cache, ["bf16", "f64"]) == "f64"
    cache.remember("bf16 again", features(4, torch.bfloat16))  # 100 bytes: both fit
    assert kept(cache, ["f64", "bf16 again"]) == "f64bf16 again"


def test_remembering_a_kept_hash_again_adds_no_bytes():
    cache = EncoderCache(shared_bytes=80)
    first = features(40, fill=1.0)
    cache.remember("a", first)
    cache.remember("a", features(40, fill=2.0))  # kept already: neither counted nor replaced
    cache.remember("b", features(40))  # 80 of 80
    assert cache.lookup("a") is first
    assert kept(cache, "ab") == "ab"


def test_a_view_is_kept_as_its_own_copy_and_counted_by_its_own_bytes():
    batch = torch.arange(1000, dtype=torch.float32)  # 4000 bytes: one batched vision call
    cache = EncoderCache(shared_bytes=100)
    cache.remember("one image", batch[10:35])  # 25 elements, 100 bytes: exactly the budget
    got = cache.lookup("one image")
    assert got is not None and got.untyped_storage().nbytes() == 100
    assert torch.equal(got, torch.arange(10, 35, dtype=torch.float32))
    whole = features(100)
    cache.remember("same storage size", whole)  # not a view: kept as given
    assert cache.lookup("same storage size") is whole


def test_clearing_forgets_the_bytes_too():
    cache = EncoderCache(shared_bytes=100)
    cache.remember("a", features(60))
    cache.clear_shared()
    cache.remember("whole", features(100))
    assert kept(cache, ["a", "whole"]) == "whole"


def test_hits_and_misses_count_every_lookup():
    cache = EncoderCache(shared_bytes=100)
    assert (cache.hits, cache.misses) == (0, 0)
    cache.lookup("x")
    cache.lookup("y")
    cache.remember("x", features(8))
    cache.lookup("x")
    cache.lookup("x")
    cache.lookup("z")
    assert (cache.hits, cache.misses) == (2, 3)


def test_a_lookup_makes_an_entry_the_most_recent():
    cache = EncoderCache(shared_bytes=60)
    for name in "abc":
        cache.remember(name, features(20))
    cache.lookup("a")
    cache.remember("d", features(20))  # "b" is now the oldest
    assert kept(cache, "abcd") == "acd"


def test_per_request_keys_are_distinct_and_entries_independent_of_the_shared_store():
    cache = EncoderCache(shared_bytes=100)
    keys = [cache.new_key() for _ in range(3)]
    assert len(set(keys)) == 3
    for key in keys:
        cache.put(key, features(400))  # per-request entries are not held to the shared budget
    assert cache.num_entries == 3 and all(k in cache for k in keys)
    assert cache.lookup(str(keys[0])) is None
    cache.pop(keys[1])
    assert cache.num_entries == 2 and keys[1] not in cache and torch.equal(cache.get(keys[0]), features(400))
