"""The bf16 parity tests' tie rule (tests/models/reference.py): a token that is not transformers' argmax passes
only within BF16_TIE of its top logit, and equal maxima go to the first index, as greedy generate picks."""

from __future__ import annotations

import pytest
import torch

from tests.models.reference import BF16_TIE, NearTie, Reference, bf16_near_ties


def along(ids: list[int], rows: list[list[float]]) -> Reference:
    return Reference(ids=ids, logits=[torch.tensor(r) for r in rows])


def test_tokens_that_are_the_argmax_everywhere_have_no_ties():
    assert bf16_near_ties([2, 0], along([2, 0], [[0.0, 1.0, 3.0], [5.0, 1.0, 4.0]])) == []


def test_a_runner_up_within_the_tolerance_is_a_recorded_near_tie():
    ties = bf16_near_ties([1, 0], along([1, 0], [[0.0, 2.9, 3.0], [5.0, 1.0, 4.0]]))
    assert len(ties) == 1 and (ties[0].step, ties[0].ours, ties[0].theirs) == (0, 1, 2)
    assert ties[0].margin == pytest.approx(0.1) and ties[0].gap == pytest.approx(0.1)


def test_equal_maxima_go_to_the_first_index():
    assert bf16_near_ties([0], along([0], [[3.0, 3.0, 1.0]])) == []
    assert bf16_near_ties([1], along([1], [[3.0, 3.0, 1.0]])) == [NearTie(0, 1, 0, 0.0, 0.0)]


def test_a_token_further_than_the_tolerance_fails():
    with pytest.raises(AssertionError, match="not a bf16 near tie"):
        bf16_near_ties([0], along([0], [[3.0 - BF16_TIE - 0.01, 1.0, 3.0]]))


def test_a_third_best_token_is_judged_by_its_own_gap_not_the_top_two_margin():
    with pytest.raises(AssertionError, match="gap=0.5"):  # margin 0.1, but ours is 0.5 below the top
        bf16_near_ties([0], along([0], [[2.5, 2.9, 3.0]]))
