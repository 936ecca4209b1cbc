"""`step.schedule`: how many tokens each sequence feeds in the next forward, with exact counts.

Rules: a finished sequence feeds 0; a decoding one 1 + its drafts; a first prefill the router's
`chunk_len` (else all that is left of the prompt), whatever the budget; a later chunk what the budget
leaves after every decode token and every earlier sequence's tokens, in batch order, at least 1;
no budget (chunking off) means whole prompts; a chunk never ends inside a bidirectional group."""

from __future__ import annotations

import pytest

from tests.unit.step_sequences import decoding, make_seq
from tgi_vlm.models.step import schedule


def later_chunk(prompt_len: int, computed: int, **kw):
    """A sequence past its first prefill, `prompt_len - computed` prompt tokens still to compute."""
    return make_seq(prompt_len, computed=computed, started=True, **kw)


# ----- decoding and finished sequences -----

def test_a_finished_sequence_feeds_nothing_and_takes_no_budget():
    assert schedule([decoding(finished=True), later_chunk(20, 15)], prefill_budget=3) == [0, 3]


@pytest.mark.parametrize("budget", [None, 1, 4096])
def test_a_decoding_sequence_feeds_its_last_token(budget):
    assert schedule([decoding(), decoding(9)], budget) == [1, 1]


def test_a_drafting_sequence_feeds_its_last_token_and_every_draft():
    assert schedule([decoding(draft=(5, 6)), decoding(draft=(7,)), decoding()], 4096) == [3, 2, 1]


# ----- the first prefill: the router sized it -----

def test_a_first_prefill_without_chunk_len_feeds_its_whole_prompt_even_over_the_budget():
    assert schedule([make_seq(12)], prefill_budget=4) == [12]


@pytest.mark.parametrize(("chunk_len", "size"), [(5, 5), (12, 12), (20, 12), (1, 1)])
def test_a_first_prefill_feeds_chunk_len_at_most_the_prompt(chunk_len, size):
    assert schedule([make_seq(12, chunk_len=chunk_len)], prefill_budget=4) == [size]


def test_a_first_prefill_after_a_cache_hit_feeds_the_uncached_rest():
    assert schedule([make_seq(12, computed=8, started=False)], prefill_budget=2) == [4]


def test_chunk_len_applies_to_the_first_prefill_only():
    assert schedule([later_chunk(12, 5, chunk_len=2)], prefill_budget=100) == [7]


# ----- later chunks share the budget -----

def test_later_chunks_share_what_the_budget_leaves_after_the_decode_tokens_in_batch_order():
    seqs = [decoding(), decoding(draft=(1,)), later_chunk(10, 4), later_chunk(30, 20)]
    assert schedule(seqs, prefill_budget=12) == [1, 2, 6, 3]  # 12 - 3 decode = 9: 6 to the first, 3 left


def test_a_first_prefill_takes_its_tokens_out_of_the_budget_of_later_chunks():
    assert schedule([make_seq(7), later_chunk(20, 12)], prefill_budget=10) == [7, 3]


def test_a_chunk_that_fits_exactly_the_remaining_budget_is_fed_whole():
    assert schedule([decoding(), later_chunk(10, 3)], prefill_budget=8) == [1, 7]


def test_with_no_budget_left_a_later_chunk_still_feeds_one_token():
    assert schedule([decoding(), later_chunk(10, 3), later_chunk(9, 4)], prefill_budget=8) == [1, 7, 1]


def test_decode_tokens_over_the_budget_leave_every_chunk_one_token():
    seqs = [decoding(), decoding(), decoding(), later_chunk(9, 4), later_chunk(9, 4)]
    assert schedule(seqs, prefill_budget=2) == [1, 1, 1, 1, 1]


def test_without_a_budget_later_chunks_feed_the_whole_rest_of_the_prompt():
    assert schedule([decoding(), later_chunk(20, 4), later_chunk(9, 1)], prefill_budget=None) == [1, 16, 8]


# ----- bidirectional groups stay whole -----

GROUPS = [-1, -1, -1, 0, 0, 0, 0, -1, -1, -1, -1, -1]  # positions 3..6 attend both ways


@pytest.mark.parametrize(("budget", "size"), [
    (1, 1),  # ends at position 3, before the group: unchanged
    (2, 5),  # would end inside the group (after position 3): extended to its end, position 7
    (4, 5),  # would end after position 5: extended too
    (5, 5),  # ends exactly at the group's end
    (6, 6),  # past the group
])
def test_a_chunk_never_ends_inside_a_bidirectional_group(budget, size):
    assert schedule([later_chunk(12, 2, groups=GROUPS)], prefill_budget=budget) == [size]


def test_an_extended_chunk_takes_its_whole_size_out_of_the_budget():
    assert schedule([later_chunk(12, 2, groups=GROUPS), later_chunk(9, 4)], prefill_budget=2) == [5, 1]


def test_a_first_prefill_chunk_len_ending_inside_a_group_is_extended():
    assert schedule([make_seq(12, chunk_len=4, groups=GROUPS)], prefill_budget=100) == [7]


def test_a_chunk_is_extended_to_the_end_of_its_own_group_not_into_the_next():
    groups = [0, 0, 0, 1, 1, 1, -1, -1]
    assert schedule([later_chunk(8, 0, groups=groups)], prefill_budget=2) == [3]


# ----- purity -----

def test_schedule_is_pure_and_changes_no_sequence():
    seqs = [decoding(draft=(3,)), later_chunk(12, 2, groups=GROUPS), make_seq(7, chunk_len=3)]
    before = [(s.num_computed, s.started, list(s.draft)) for s in seqs]
    assert schedule(seqs, 6) == schedule(seqs, 6) == [2, 5, 3]
    assert [(s.num_computed, s.started, list(s.draft)) for s in seqs] == before
