"""The n-gram drafter's choice of match (generation/speculative.py) where the most recent occurrence of the last
token is not the longest match, its edge cases, and the speculation counters' periodic log line."""

from __future__ import annotations

import pytest
from loguru import logger

from tgi_vlm.generation import NgramDrafter
from tgi_vlm.generation.speculative import accepts
from tgi_vlm.models.flash_causal_lm import SpeculationStats


def test_the_longest_suffix_match_wins_over_a_more_recent_shorter_one():
    ids = [1, 2, 3, 9, 7, 3, 5, 1, 2, 3]  # suffix 1 2 3: at 0..2 (then 9, 7, 3); the 3 at 5 matches one token only
    assert NgramDrafter().propose(ids, 3) == [9, 7, 3]
    assert NgramDrafter(max_ngram=1).propose(ids, 3) == [5, 1, 2]  # one-token suffixes: the most recent wins


def test_a_match_needs_min_ngram_tokens():
    ids = [4, 8, 6, 3, 4]  # only the last token repeats
    assert NgramDrafter(min_ngram=2).propose(ids, 2) == []
    assert NgramDrafter(min_ngram=1).propose(ids, 2) == [8, 6]


@pytest.mark.parametrize(("ids", "max_tokens"), [([], 3), ([5], 3), ([5, 5], 0), ([5, 5], -1)])
def test_nothing_is_proposed_without_an_earlier_token_or_room(ids, max_tokens):
    assert NgramDrafter().propose(ids, max_tokens) == []


def test_a_draft_row_is_accepted_only_while_its_token_equals_the_choice_before_it():
    assert accepts([7, 8], 0, 7) and accepts([7, 8], 1, 8)
    assert not accepts([7, 8], 0, 8) and not accepts([7, 8], 2, 8)  # past the last draft: nothing to accept


def test_every_log_every_verified_runs_the_counters_are_logged(monkeypatch):
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(message.record["message"]), level="INFO")
    monkeypatch.setattr(SpeculationStats, "LOG_EVERY", 4)
    try:
        stats = SpeculationStats()
        for drafted, accepted in ((4, 4), (4, 0), (2, 1), (3, 3)):
            stats.record(drafted, accepted)
    finally:
        logger.remove(sink)
    assert (stats.runs, stats.drafted, stats.accepted) == (4, 13, 8)
    assert stats.acceptance_rate == 8 / 13
    assert lines == ["speculation: 4 verified runs, acceptance 61.5%, 3.00 tokens per run"]
    assert SpeculationStats().acceptance_rate == 0.0
