"""Prefix block keys (prefix_hash.py): the namespace a chain starts from (adapter, salt), and that a
block's key depends on the whole prefix before it, not only on its own tokens."""

from __future__ import annotations

import hashlib

import pytest

from tgi_vlm.media import MediaKind
from tgi_vlm.prefix_hash import KEY_VERSION, MediaRef, block_keys, namespace_root
from tgi_vlm.router.prefix_cache import PrefixCache, prompt_blocks
from tgi_vlm.router.requests import RequestParams, build_request
from tgi_vlm.router.router import cacheable_prompt
from tgi_vlm.router.tokens import PromptTokens

BS = 4
PROMPT = list(range(100, 112))  # three whole blocks


def test_the_base_namespace_is_one_fixed_root():
    expected = hashlib.sha256(KEY_VERSION + b"|adapter:0:" + b"|salt:0:").digest()
    assert namespace_root() == namespace_root("", "") == expected


@pytest.mark.parametrize(("a", "b"), [
    (("", ""), ("lora-a", "")),
    (("lora-a", ""), ("lora-b", "")),
    (("", ""), ("", "tenant-1")),
    (("lora-a", ""), ("", "lora-a")),  # the same text as adapter or as salt
    (("ab", "c"), ("a", "bc")),  # field boundaries count (length-prefixed)
])
def test_every_adapter_and_salt_gives_its_own_root(a, b):
    assert namespace_root(*a) != namespace_root(*b)


def test_the_same_prompt_under_two_adapters_shares_no_block_key():
    base = block_keys(PROMPT, [], BS, root=namespace_root())
    a = block_keys(PROMPT, [], BS, root=namespace_root("lora-a"))
    b = block_keys(PROMPT, [], BS, root=namespace_root("lora-b"))
    assert len(base) == len(a) == len(b) == 3
    assert not set(base) & set(a) and not set(a) & set(b) and not set(base) & set(b)
    assert block_keys(PROMPT, [], BS, root=namespace_root("lora-a")) == a  # and each is reproducible


def test_a_block_key_depends_on_every_block_before_it():
    block = list(range(500, 504))
    after_one = block_keys(list(range(0, 8)) + block, [], BS, root=namespace_root())
    after_other = block_keys(list(range(0, 4)) + list(range(9, 13)) + block, [], BS, root=namespace_root())
    assert after_one[0] == after_other[0]  # the same first block
    assert after_one[1] != after_other[1]  # differing second blocks
    assert after_one[2] != after_other[2]  # the same tokens at the same place, after different prefixes


def test_an_image_changes_the_key_of_its_blocks_and_every_later_one():
    cat, dog = [MediaRef(MediaKind.IMAGE, 5, 2, "cat")], [MediaRef(MediaKind.IMAGE, 5, 2, "dog")]
    with_cat = block_keys(PROMPT, cat, BS, root=namespace_root())
    with_dog = block_keys(PROMPT, dog, BS, root=namespace_root())
    assert with_cat[0] == with_dog[0] and with_cat[1] != with_dog[1] and with_cat[2] != with_dog[2]


# ----- the driver keys requests by their adapter -----

def test_a_request_carries_its_adapter_id_to_the_shard_and_none_leaves_the_field_unset():
    assert RequestParams(["hi"], adapter_id="lora-a").to_pb(3).adapter_id == "lora-a"
    request = RequestParams(["hi"]).to_pb(3)
    assert not request.HasField("adapter_id") and request.adapter_id == ""
    assert build_request(1, ["x"], adapter_id="b").adapter_id == "b"


def _served(cache: PrefixCache, params: RequestParams) -> None:
    """A request that ran to its first token and finished: its prompt blocks are now cached."""
    allocation = cache.allocate(len(PROMPT) + 2, cacheable_prompt(PromptTokens(PROMPT, []), params, BS))
    cache.cache_prompt(allocation)
    cache.free(allocation)


def _cache_len(cache: PrefixCache, params: RequestParams) -> int:
    return cache.cache_len(cacheable_prompt(PromptTokens(PROMPT, []), params, BS))


def test_the_driver_reuses_blocks_only_for_requests_of_the_same_adapter():
    cache = PrefixCache(num_blocks=32, block_size=BS)
    _served(cache, RequestParams(["p"], adapter_id="lora-a"))
    assert _cache_len(cache, RequestParams(["p"], adapter_id="lora-a")) == 11  # whole prompt found: 12 - 1
    assert _cache_len(cache, RequestParams(["p"], adapter_id="lora-b")) == 0
    assert _cache_len(cache, RequestParams(["p"])) == 0


def test_the_driver_keys_a_prompt_as_the_shard_does_in_the_adapters_namespace():
    keys = prompt_blocks(PROMPT, [], None, BS, adapter_id="lora-a").keys
    assert list(keys) == block_keys(PROMPT, [], BS, root=namespace_root("lora-a"))
