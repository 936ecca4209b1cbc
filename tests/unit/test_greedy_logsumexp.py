"""`tgi_vlm::greedy_logsumexp` (kernels/cpu/csrc/greedy.c) and the greedy path of `choose_tokens` that uses it: the
same choice as torch's argmax (the first maximum; the first NaN), the same score, a logsumexp within float32 rounding
of torch's, at a real vocabulary's width; and what it refuses."""

from __future__ import annotations

import re

import pytest
import torch

from tests.unit.kernels_here import needs, op_calls, require
from tgi_vlm.generation.chooser import TokenChooser, choose_tokens
from tgi_vlm.kernels.cpu import ops
from tgi_vlm.pb.generate_pb2 import NextTokenChooserParameters

needs_the_op = needs("greedy_logsumexp")


@needs_the_op
@pytest.mark.parametrize("width", [1, 15, 17, 262_144, 151_936 + 3])
def test_choices_scores_and_logsumexp_equal_torchs_on_random_rows(width):
    require("greedy_logsumexp")
    scores = torch.randn(5, width, generator=torch.Generator().manual_seed(width)) * 8
    ids, chosen, lse = ops.greedy_logsumexp(scores)
    values, indices = scores.max(dim=-1)
    assert torch.equal(ids, scores.argmax(dim=-1)) and torch.equal(ids, indices) and torch.equal(chosen, values)
    exact = torch.logsumexp(scores.double(), dim=-1)
    assert ((lse.double() - exact).abs() <= 4e-7 * exact.abs() + 1e-6).all()


@needs_the_op
def test_ties_take_the_first_maximum_a_nan_wins_and_all_minus_inf_rows_stay_minus_inf():
    require("greedy_logsumexp")
    scores = torch.full((5, 300), -3.0)
    scores[0, [40, 299]] = 2.0  # two equal maxima: the first
    scores[1, 7], scores[1, 200] = float("nan"), 9.0  # a NaN: chosen, and the sums NaN, as torch does
    scores[2] = float("-inf")  # every value -inf: index 0, -inf, -inf
    scores[3, 16], scores[3, 17] = 5.0, 5.0  # across a 16-lane edge
    scores[4, ::2] = float("-inf")  # masked half (a grammar): exp(-inf) adds nothing
    ids, chosen, lse = ops.greedy_logsumexp(scores)
    assert ids.tolist() == scores.argmax(dim=-1).tolist() == [40, 7, 0, 16, 1]
    assert chosen[1].isnan() and lse[1].isnan() and chosen[2] == lse[2] == float("-inf")
    want = torch.logsumexp(scores.double(), dim=-1)
    for row in (0, 3, 4):
        assert lse[row].item() == pytest.approx(want[row].item(), abs=1e-5)


@pytest.mark.parametrize("scores,problem", [
    (torch.randn(2, 8).double(), "CPU float32 [B, V]"),
    (torch.randn(8, 2).T, "rows of V contiguous"),
    (torch.randn(2, 0), "V >= 1"),
    (torch.randn(8), "[B, V]"),
])
def test_the_op_refuses_what_its_loop_cannot_read(scores, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        ops.greedy_logsumexp(scores)
    assert not ops.can_choose_greedily(scores)


@needs_the_op
def test_plain_greedy_rows_without_top_n_take_the_native_pass_and_report_what_torch_would():
    require("greedy_logsumexp")
    plain = TokenChooser.from_params(NextTokenChooserParameters(), device="cpu")
    logits = torch.randn(4, 70_000, generator=torch.Generator().manual_seed(3)) * 4
    with op_calls() as calls:
        got = choose_tokens(logits, [plain] * 4, [[1]] * 4, keep_logprob_rows=False)
    assert calls["tgi_vlm::greedy_logsumexp"] == 1
    assert got.ids == logits.argmax(-1).tolist() and got.logprob_rows is None
    want = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(got.ids)[:, None]).squeeze(-1)
    assert got.logprobs == pytest.approx(want.tolist(), abs=1e-5)
    with op_calls() as calls:  # top-n (log-prob rows kept) goes through torch
        kept = choose_tokens(logits, [plain] * 4, [[1]] * 4, keep_logprob_rows=True)
    assert calls["tgi_vlm::greedy_logsumexp"] == 0 and kept.ids == got.ids
