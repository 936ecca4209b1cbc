"""Encoder cache: per-request entries and the byte-bounded cross-request LRU."""

from __future__ import annotations

import torch

from tgi_vlm.models.encoder_cache import EncoderCache


def test_entries_are_put_and_popped():
    cache = EncoderCache()
    key = cache.new_key()
    cache.put(key, torch.zeros(4, 8))
    assert key in cache and cache.num_entries == 1
    cache.pop(key)
    cache.pop(key)  # popping twice is harmless (filter after finish)
    assert cache.num_entries == 0


def test_lru_evicts_oldest_when_over_budget_and_counts_hits():
    row_bytes = 8 * 4
    cache = EncoderCache(shared_bytes=3 * 4 * row_bytes)  # room for three [4, 8] float32 tensors
    for name in "abc":
        cache.remember(name, torch.zeros(4, 8))
    assert cache.lookup("a") is not None  # "a" becomes the most recent
    cache.remember("d", torch.zeros(4, 8))
    assert cache.lookup("b") is None  # the oldest went
    assert cache.lookup("a") is not None and cache.lookup("d") is not None
    assert (cache.hits, cache.misses) == (3, 1)


def test_disabled_lru_keeps_nothing():
    cache = EncoderCache(shared_bytes=0)
    cache.remember("a", torch.zeros(2, 2))
    assert cache.lookup("a") is None
