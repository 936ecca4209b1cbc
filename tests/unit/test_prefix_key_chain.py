"""The prefix-cache key chain (prefix_hash.py) and what rests on it: block j's key is a function of blocks
0..j (token ids, image hashes and offsets), never of block j alone. So the same 16 tokens after two different
prefixes have different keys, and neither the router driver's cache nor the shard's records ever let one
request reuse KV computed after another prefix. Exact key equalities, counts and block ids."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tgi_vlm.errors import InvalidRequest
from tgi_vlm.media import MediaKind
from tgi_vlm.models.prefix_cache import BlockRecords
from tgi_vlm.prefix_hash import MediaRef, block_keys, chain_key, namespace_root
from tgi_vlm.router.prefix_cache import PrefixCache, prompt_blocks

BS = 16
P1 = list(range(100, 116))  # two different first blocks
P2 = list(range(200, 216))
B = list(range(300, 316))  # one block of tokens that follows either
TAIL = [7, 8, 9]
ROOT = namespace_root()  # the base model's namespace: block 0's parent


# ----- the chain -----

def test_each_key_chains_the_previous_blocks_key():
    ids = P1 + B + TAIL
    keys = block_keys(ids, [], BS, root=ROOT)
    assert keys == [chain_key(ROOT, ids, [], 0, 16), chain_key(keys[0], ids, [], 16, 32)]


def test_the_same_block_after_two_different_prefixes_has_two_different_keys():
    after_p1, after_p2 = block_keys(P1 + B, [], BS, root=ROOT), block_keys(P2 + B, [], BS, root=ROOT)
    assert after_p1[0] != after_p2[0]
    assert after_p1[1] != after_p2[1]
    assert chain_key(ROOT, B, [], 0, 16) not in (after_p1[1], after_p2[1])  # nor the key of B on its own


def test_equal_prefixes_give_equal_keys_whatever_follows():
    assert block_keys(P1 + B + TAIL, [], BS, root=ROOT) == block_keys(P1 + B + [1, 2, 3, 4], [], BS, root=ROOT)
    assert block_keys(P1 + B + B, [], BS, root=ROOT)[:2] == block_keys(P1 + B, [], BS, root=ROOT)


@pytest.mark.parametrize(("n", "limit", "blocks"), [(47, None, 2), (48, None, 3), (15, None, 0), (16, None, 1),
                                                    (48, 32, 2), (48, 31, 1), (48, 33, 2), (20, 99, 1)])
def test_only_full_blocks_below_the_limit_have_keys(n, limit, blocks):
    ids = list(range(n))
    keys = block_keys(ids, [], BS, limit=limit, root=ROOT)
    assert len(keys) == blocks
    assert keys == block_keys(ids, [], BS, root=ROOT)[:blocks]


def test_a_block_is_keyed_on_the_images_that_overlap_it_and_only_those():
    ids = P1 + B + P2
    plain = block_keys(ids, [], BS, root=ROOT)

    def with_image(offset: int, length: int, digest: str = "d1") -> list[bytes]:
        return block_keys(ids, [MediaRef(MediaKind.IMAGE, offset, length, digest)], BS, root=ROOT)

    # [16, 32) is block 1 exactly: blocks 0 and 2 only touch its edges
    touching = with_image(16, 16)
    assert touching[0] == plain[0] and touching[1] != plain[1] and touching[2] != plain[2]  # 2 chains on 1
    assert touching[2] == chain_key(touching[1], ids, [], 32, 48)  # the image is not in block 2's own part
    # one token into block 0 at its end, one token into block 2 at its start
    assert with_image(15, 1)[0] != plain[0] and with_image(32, 1)[:2] == plain[:2]
    assert with_image(32, 1)[2] != plain[2]
    # the digest and the offset are both part of the key
    assert with_image(16, 16, "d2")[1] != touching[1]
    assert with_image(17, 16)[1] != touching[1]  # same length, same blocks touched, one position later


# ----- the router driver's cache: never a block computed after another prefix -----

def served(cache: PrefixCache, tokens: list[int], images=()):
    allocation = cache.allocate(len(tokens) + 2, prompt_blocks(tokens, list(images), None, BS))
    cache.cache_prompt(allocation)
    cache.free(allocation)
    return allocation


def test_the_router_never_gives_a_block_computed_after_another_prefix():
    cache = PrefixCache(32, BS)
    first = served(cache, P1 + B + TAIL)
    second = served(cache, P2 + B + TAIL)  # P2 unknown: nothing matched, both blocks its own
    assert second.cache_len == 0 and set(second.blocks[:2]).isdisjoint(first.blocks[:2])  # (the tail block is reused)
    assert cache.num_cached == 4  # P1, P1+B, P2, P2+B: four keys, four blocks
    third = cache.allocate(len(P2 + B + TAIL) + 2, prompt_blocks(P2 + B + [5, 5], [], None, BS))
    assert third.cache_len == 32
    assert third.blocks[:2] == second.blocks[:2]  # B as computed after P2, not first.blocks[1]


def test_the_router_matches_a_prefix_only_from_the_first_block():
    cache = PrefixCache(32, BS)
    served(cache, P1 + B + TAIL)
    assert cache.cache_len(prompt_blocks(B + TAIL, [], None, BS)) == 0  # B at position 0 is another block
    assert cache.cache_len(prompt_blocks(P1 + B + TAIL, [], None, BS)) == 32
    assert cache.cache_len(prompt_blocks(P1 + P2 + TAIL, [], None, BS)) == 16


# ----- the shard's records: a claim on a block computed after another prefix is refused -----

def computed(records: BlockRecords, tokens: list[int], first_block: int):
    """A sequence whose prompt was computed into blocks first_block, first_block + 1, ...; its blocks recorded."""
    slots = list(range(first_block * BS, first_block * BS + len(tokens)))
    seq = SimpleNamespace(block_keys=[], num_computed=len(tokens), slot_list=slots, all_ids=list(tokens),
                          media_refs=[], adapter_id="")
    records.record_completed([SimpleNamespace(seq=seq)])
    return seq


def whole_blocks(*blocks: int) -> list[int]:
    return [b * BS + i for b in blocks for i in range(BS)]


def test_the_shard_refuses_a_claim_on_a_block_computed_after_another_prefix():
    records = BlockRecords(BS)
    computed(records, P1 + B + TAIL, first_block=1)  # P1 in block 1, B (after P1) in block 2
    computed(records, P2 + TAIL, first_block=5)  # P2 in block 5
    assert len(records) == 3
    prompt = P2 + B + TAIL
    with pytest.raises(InvalidRequest, match="claims block 2 holds positions 16..31 of this prompt"):
        records.verify_claim(9, prompt, [], whole_blocks(5, 2) + [0, 0, 0], 32, adapter_id="")
    accepted = records.verify_claim(9, prompt, [], whole_blocks(5, 2) + [0, 0, 0], 16, adapter_id="")
    assert accepted == block_keys(prompt, [], BS, root=ROOT)[:1]


def test_the_shard_accepts_a_claim_on_the_same_prefix_and_returns_its_keys():
    records = BlockRecords(BS)
    seq = computed(records, P1 + B + TAIL, first_block=3)
    assert seq.block_keys == block_keys(P1 + B + TAIL, [], BS, root=ROOT)
    assert [records.get(b) for b in (3, 4, 5)] == [*seq.block_keys, None]  # the partial block has no record
    prompt = P1 + B + [1, 1]
    accepted = records.verify_claim(4, prompt, [], whole_blocks(3, 4) + [0, 0], 32, adapter_id="")
    assert accepted == block_keys(prompt, [], BS, root=ROOT)
