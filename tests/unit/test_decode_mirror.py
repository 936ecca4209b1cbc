"""The decode mirror (layers/attention/decode_mirror.py): after every step, each decoding sequence's
mirror row holds exactly what the reference path gathers from the paged cache, while only the
positions a row lacks are copied."""

from __future__ import annotations

import random

import pytest
import torch

from tgi_vlm.layers.attention import DecodeGroup, KVCacheSpec, PagedKVCache
from tgi_vlm.layers.attention.decode_mirror import DecodeMirror

BLOCK = 4
SPEC = KVCacheSpec(num_layers=3, kv_heads=2, head_dim=8, block_size=BLOCK, dtype=torch.float32)


class FakeSeq:
    """A sequence with a block table in a shared paged cache; `advance` writes its next position."""

    def __init__(self, uid: int, blocks: list[int], length: int, cache: PagedKVCache):
        self.uid, self.blocks, self.len, self.cache = uid, blocks, 0, cache
        for _ in range(length):
            self.advance()

    def slots(self) -> torch.Tensor:
        return torch.tensor([self.blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(self.len)])

    def advance(self) -> None:
        slot = self.blocks[self.len // BLOCK] * BLOCK + self.len % BLOCK
        for layer in range(SPEC.num_layers):
            k, v = self.cache.flat(layer)
            k[slot] = torch.randn(SPEC.kv_heads, SPEC.head_dim)
            v[slot] = torch.randn(SPEC.kv_heads, SPEC.head_dim)
        self.len += 1


def decode_group(seqs: list[FakeSeq]) -> DecodeGroup:
    slot_index = torch.nn.utils.rnn.pad_sequence([s.slots() for s in seqs], batch_first=True)
    return DecodeGroup.build(list(range(len(seqs))), [s.len for s in seqs], slot_index, len(seqs),
                             keys=[s.uid for s in seqs])


def run_step(mirror: DecodeMirror, seqs: list[FakeSeq], cache: PagedKVCache, layers: int | None = None):
    """One decode step: every sequence writes its new position (as the layer's write_kv does), then the
    mirror plans and syncs `layers` layers (all by default). Returns the plan."""
    for s in seqs:
        s.advance()
    group = decode_group(seqs)
    step = mirror.plan(group, cache)
    if step is None:
        return None
    for layer in range(SPEC.num_layers if layers is None else layers):
        k, v = mirror.sync_layer(layer, *cache.flat(layer))
        assert_rows_match_cache(k, v, step, group, seqs, cache, layer)
    return step


def assert_rows_match_cache(k, v, step, group, seqs, cache, layer):
    """Mirror row r = the sequence whose packed row is step.token_rows[r]; its first kv_len positions
    are exactly the cache's values at its slots (what the gather path reads)."""
    k_cache, v_cache = cache.flat(layer)
    assert k.shape[0] == len(seqs) and k.shape[2] == max(s.len for s in seqs)
    for r, token_row in enumerate(step.token_rows.tolist()):
        seq = seqs[token_row]
        slots = seq.slots()
        torch.testing.assert_close(k[r, :, : seq.len], k_cache[slots].transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(v[r, :, : seq.len], v_cache[slots].transpose(0, 1), rtol=0, atol=0)
        mask = step.masks.get((None, None))
        assert mask is None or mask[r, 0, 0].sum().item() == seq.len


@pytest.fixture
def cache():
    torch.manual_seed(0)
    return PagedKVCache(SPEC, num_blocks=256, device="cpu")


def make_seqs(cache, lengths, first_uid=1):
    """Sequences on blocks no other sequence of `cache` holds, in shuffled order (as a router's pool)."""
    if not hasattr(cache, "free_blocks"):
        cache.free_blocks = list(range(1, cache.num_blocks))
        random.Random(0).shuffle(cache.free_blocks)
    free = cache.free_blocks
    seqs = []
    for i, n in enumerate(lengths):
        blocks = [free.pop() for _ in range((n + 80) // BLOCK)]
        seqs.append(FakeSeq(first_uid + i, blocks, n, cache))
    return seqs


def test_first_step_copies_whole_contexts_later_steps_copy_only_the_new_position(cache):
    mirror = DecodeMirror(budget_bytes=1 << 30)
    seqs = make_seqs(cache, [5, 9, 3])
    first = run_step(mirror, seqs, cache)
    assert first.copy_slots.numel() == sum(s.len for s in seqs)
    for _ in range(6):  # crosses block boundaries
        step = run_step(mirror, seqs, cache)
        assert step.copy_slots.numel() == len(seqs)
        assert step.moves == [] and step.new_shape is None


def test_a_leaver_s_row_is_taken_by_the_last_row_and_a_newcomer_is_copied_in_full(cache):
    mirror = DecodeMirror(budget_bytes=1 << 30)
    seqs = make_seqs(cache, [5, 9, 3, 7])
    run_step(mirror, seqs, cache)
    stayers = [seqs[0], seqs[2], seqs[3]]
    step = run_step(mirror, stayers, cache)  # seqs[1] left: the sequence in row 3 moves to row 1
    assert step.moves == [(3, 1)]
    assert step.copy_slots.numel() == 3
    newcomer = make_seqs(cache, [6], first_uid=100)[0]
    step = run_step(mirror, [newcomer, *stayers], cache)
    assert step.copy_slots.numel() == 3 + newcomer.len


def test_a_sequence_absent_for_a_step_is_copied_again_when_it_returns(cache):
    """Absent = prefilling, speculating (several query rows) or in another batch: the mirror forgets it."""
    mirror = DecodeMirror(budget_bytes=1 << 30)
    seqs = make_seqs(cache, [5, 9])
    run_step(mirror, seqs, cache)
    run_step(mirror, seqs[:1], cache)
    seqs[1].advance()  # it went on without the mirror (e.g. a speculative step)
    step = run_step(mirror, seqs, cache)
    assert step.copy_slots.numel() == 1 + seqs[1].len


def test_growing_past_the_capacity_keeps_what_rows_held(cache):
    mirror = DecodeMirror(budget_bytes=1 << 30)
    seqs = make_seqs(cache, [60, 2])
    run_step(mirror, seqs, cache)
    capacity = mirror.shape[1]
    steps = []
    while mirror.shape[1] == capacity:
        steps.append(run_step(mirror, seqs, cache))  # each checks every row against the cache
    assert steps[-1].new_shape == mirror.shape and mirror.shape[1] > seqs[0].len
    assert all(step.copy_slots.numel() == 2 for step in steps)
    assert all(step.new_shape is None for step in steps[:-1])


def test_over_budget_the_step_gathers_and_the_mirror_gives_its_memory_back(cache):
    seqs = make_seqs(cache, [5, 9])
    mirror = DecodeMirror(budget_bytes=1 << 30)
    run_step(mirror, seqs, cache)
    assert mirror.nbytes > 0
    mirror.budget_bytes = mirror.nbytes - 1
    assert run_step(mirror, seqs, cache) is None
    assert mirror.nbytes == 0


def test_a_forward_that_stopped_between_layers_makes_the_next_step_start_from_empty(cache):
    mirror = DecodeMirror(budget_bytes=1 << 30)
    seqs = make_seqs(cache, [5, 9])
    run_step(mirror, seqs, cache)
    run_step(mirror, seqs, cache, layers=1)  # the forward raised after layer 0
    step = run_step(mirror, seqs, cache)
    assert step.copy_slots.numel() == sum(s.len for s in seqs)


def test_groups_without_sequence_keys_take_the_gather_path(cache):
    mirror = DecodeMirror(budget_bytes=1 << 30)
    seqs = make_seqs(cache, [5])
    group = decode_group(seqs)
    group.keys = None  # CUDA-graph static inputs
    assert mirror.plan(group, cache) is None


def test_the_mask_covers_each_row_s_own_positions_with_windows_and_chunks(cache):
    mirror = DecodeMirror(budget_bytes=1 << 30)
    seqs = make_seqs(cache, [5, 9])
    step = run_step(mirror, seqs, cache)
    lens = [seqs[row].len for row in step.token_rows.tolist()]
    plain = mirror.mask(step, None, None)[:, 0, 0]
    assert plain.sum(-1).tolist() == lens
    window = mirror.mask(step, 4, None)[:, 0, 0]
    assert window.sum(-1).tolist() == [min(4, n) for n in lens]
    chunked = mirror.mask(step, None, 8)[:, 0, 0]
    assert chunked.sum(-1).tolist() == [n - ((n - 1) // 8) * 8 for n in lens]


def test_another_batch_s_one_token_step_gathers_and_leaves_the_rows(cache):
    """TGI's liveness Prefill is a one-token batch of its own: it must not evict the running batch."""
    mirror = DecodeMirror(budget_bytes=1 << 30)
    seqs = make_seqs(cache, [5, 9])
    run_step(mirror, seqs, cache)
    probe = make_seqs(cache, [0], first_uid=500)
    assert run_step(mirror, probe, cache) is None
    step = run_step(mirror, seqs, cache)
    assert step.copy_slots.numel() == len(seqs) and step.new_shape is None


def test_two_foreign_steps_in_a_row_replace_the_rows(cache):
    mirror = DecodeMirror(budget_bytes=1 << 30)
    run_step(mirror, make_seqs(cache, [5, 9]), cache)
    newcomers = make_seqs(cache, [4, 6], first_uid=700)
    assert run_step(mirror, newcomers, cache) is None
    step = run_step(mirror, newcomers, cache)
    assert step.copy_slots.numel() == sum(s.len for s in newcomers)
    assert set(mirror.row_of) == {s.uid for s in newcomers}


def test_a_plan_that_fails_half_way_leaves_nothing_to_trust(cache, monkeypatch):
    mirror = DecodeMirror(budget_bytes=1 << 30)
    seqs = make_seqs(cache, [5, 9, 3])
    run_step(mirror, seqs, cache)

    def fail(*args, **kwargs):
        raise MemoryError("no memory for the copy plan")

    monkeypatch.setattr(mirror, "_copies", fail)
    with pytest.raises(MemoryError):
        run_step(mirror, seqs[1:], cache)
    monkeypatch.undo()
    step = run_step(mirror, seqs[1:], cache)  # rows are checked against the cache inside run_step
    assert step.copy_slots.numel() == sum(s.len for s in seqs[1:])
