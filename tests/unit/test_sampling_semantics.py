"""TGI's sampling semantics at the processor level, through `TokenChooser` (proto parameters in, processed
scores out) and against transformers' own classes in transformers.generation.logits_process.

What is pinned here: repetition penalty on the whole history, each repeated id once; TGI's frequency
penalty (count / history length, no transformers class exists, so a hand count); each warper alone
equal to transformers' warper; which values switch sampling on and which leave greedy; TGI's processor
order; the watermark's previous-token rule; the order length > EOS > stop sequence.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
    WatermarkLogitsProcessor,
)

from tgi_vlm.generation import FinishReason, StoppingCriteria, TokenChooser
from tgi_vlm.pb.generate_pb2 import NextTokenChooserParameters

VOCAB = 89
EOS = 2
WATERMARK_HASH_KEY = 15485863  # as in TGI's utils/watermark.py
# Prompt + generated ids, with repeats, id 0 among them, and last three ids all different.
HISTORY = [0, 17, 5, 17, 17, 40, 5, 63, 0, 88, 31, 72]


def chooser(**params: object) -> TokenChooser:
    return TokenChooser.from_params(NextTokenChooserParameters(**params), device="cpu")


def scores(seed: int = 0) -> torch.Tensor:
    """[V] logits of both signs, no ties."""
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def hf(processor, history: list[int], row: torch.Tensor) -> torch.Tensor:
    return processor(torch.tensor([history]), row[None].clone())[0]


def assert_same_scores(got: torch.Tensor, expected: torch.Tensor) -> None:
    """The same filtered (-inf) positions and equal values elsewhere."""
    assert torch.equal(got == -torch.inf, expected == -torch.inf)
    kept = expected > -torch.inf
    torch.testing.assert_close(got[kept], expected[kept], atol=1e-6, rtol=0)


# ----- repetition penalty -------------------------------------------------------------------------


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_over_the_history_equals_transformers(penalty: float) -> None:
    row = scores(1)
    expected = hf(RepetitionPenaltyLogitsProcessor(penalty), HISTORY, row)
    assert_same_scores(chooser(repetition_penalty=penalty).process(row, HISTORY), expected)
    assert not torch.equal(expected, row)


def test_a_repeated_history_id_is_penalised_once_and_by_the_sign_of_its_logit() -> None:
    row = torch.tensor([2.0, -2.0, 1.0, 0.5])
    history = [0, 0, 0, 1, 1]
    expected = torch.tensor([1.0, -4.0, 1.0, 0.5])  # positive ÷ 2, negative × 2, unseen untouched
    assert torch.equal(chooser(repetition_penalty=2.0).process(row, history), expected)
    assert torch.equal(hf(RepetitionPenaltyLogitsProcessor(2.0), history, row), expected)


# ----- frequency penalty (TGI's HeterogeneousFrequencyPenaltyLogitsProcessor) ----------------------


@pytest.mark.parametrize("penalty", [0.6, -1.2])
def test_frequency_penalty_subtracts_penalty_times_count_over_the_history_length(penalty: float) -> None:
    row = scores(2)
    counts = Counter(HISTORY)  # id 0 is a token like any other: TGI's flash path counts it
    expected = torch.tensor([row[v].item() - penalty * counts[v] / len(HISTORY) for v in range(VOCAB)])
    got = chooser(frequency_penalty=penalty).process(row, HISTORY)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert abs((row - got)[17].item() - penalty * 3 / 12) < 1e-6  # three 17s in twelve ids


def test_frequency_penalty_depends_on_the_history_length_not_only_the_counts() -> None:
    row = scores(3)
    penalised = chooser(frequency_penalty=1.0)
    shift_short = (row - penalised.process(row, [5, 5]))[5].item()
    shift_long = (row - penalised.process(row, [5, 5, 7, 9]))[5].item()  # the same count, twice the length
    assert abs(shift_short - 1.0) < 1e-6 and abs(shift_long - 0.5) < 1e-6


# ----- warpers: each alone equals transformers' warper --------------------------------------------

WARPERS = [
    pytest.param({"temperature": 0.6}, TemperatureLogitsWarper(0.6), id="temperature"),
    pytest.param({"top_k": 7}, TopKLogitsWarper(7), id="top_k"),
    pytest.param({"top_p": 0.8}, TopPLogitsWarper(0.8), id="top_p"),
    pytest.param({"typical_p": 0.7}, TypicalLogitsWarper(0.7), id="typical_p"),
]


@pytest.mark.parametrize(("params", "warper"), WARPERS)
def test_each_warper_alone_equals_transformers(params: dict, warper) -> None:
    for seed in range(5):
        row = scores(10 + seed)
        expected = hf(warper, HISTORY, row)
        assert_same_scores(chooser(**params).process(row, HISTORY), expected)
        if "temperature" not in params:
            assert 0 < (expected == -torch.inf).sum() < VOCAB - 1  # it filters, and keeps more than one


@pytest.mark.parametrize(
    "params",
    [{"temperature": 0.6}, {"top_k": 7}, {"top_p": 0.8}, {"typical_p": 0.7}],
    ids=["temperature", "top_k", "top_p", "typical_p"],
)
def test_each_warper_alone_switches_sampling_on(params: dict) -> None:
    c = chooser(do_sample=False, seed=9, **params)
    assert c.do_sample and c.generator is not None and not c.is_greedy_plain


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},
        {"top_k": 0},
        {"top_p": 1.0},
        {"typical_p": 1.0},
        {"temperature": 0.0, "top_p": 0.0, "typical_p": 0.0},  # proto3's unset values
        {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "typical_p": 1.0},
    ],
)
def test_neutral_warper_values_leave_plain_greedy(params: dict) -> None:
    c = chooser(**params)
    assert not c.do_sample and c.is_greedy_plain
    row = scores(4)
    assert torch.equal(c.process(row, HISTORY), row)


@pytest.mark.parametrize(
    "params", [{"repetition_penalty": 1.3}, {"frequency_penalty": 0.5}, {"watermark": True}]
)
def test_penalties_and_watermark_alone_stay_greedy(params: dict) -> None:
    c = chooser(**params)
    assert not c.do_sample and not c.is_greedy_plain


# ----- TGI's order: watermark, repetition, frequency, temperature, top-k, top-p, typical-p ---------


def test_penalties_apply_in_tgis_order_before_the_warpers() -> None:
    row = scores(5)
    # The penalised ids are among the best, so the warpers keep them and a wrong order shows.
    row[HISTORY] += 2.0
    penalties = LogitsProcessorList(
        [
            WatermarkLogitsProcessor(VOCAB, "cpu", greenlist_ratio=0.5, bias=2.0),
            RepetitionPenaltyLogitsProcessor(1.3),
        ]
    )
    warpers = LogitsProcessorList(
        [
            TemperatureLogitsWarper(1.5),
            TopKLogitsWarper(40),
            TopPLogitsWarper(0.95),
            TypicalLogitsWarper(0.95),
        ]
    )
    counts = torch.bincount(torch.tensor(HISTORY), minlength=VOCAB).float()
    expected = hf(warpers, HISTORY, hf(penalties, HISTORY, row) - 0.4 * counts / len(HISTORY))
    params = dict(
        watermark=True,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        temperature=1.5,
        top_k=40,
        top_p=0.95,
        typical_p=0.95,
    )
    got = chooser(**params).process(row, HISTORY)
    assert_same_scores(got, expected)
    assert (got[sorted(set(HISTORY))] > -torch.inf).sum() >= 3


def test_warpers_apply_in_tgis_order_temperature_top_k_top_p_typical_p() -> None:
    row = scores(7)
    temperature, top_k, top_p, typical = (
        TemperatureLogitsWarper(2.0),
        TopKLogitsWarper(30),
        TopPLogitsWarper(0.9),
        TypicalLogitsWarper(0.9),
    )
    expected = hf(LogitsProcessorList([temperature, top_k, top_p, typical]), HISTORY, row)
    got = chooser(temperature=2.0, top_k=30, top_p=0.9, typical_p=0.9).process(row, HISTORY)
    assert_same_scores(got, expected)
    # Each of these orders filters other ids on this row, so it cannot pass by accident.
    other_orders = [[temperature, top_k, typical, top_p], [temperature, top_p, top_k, typical]]
    other_orders.append([top_k, top_p, typical, temperature])
    for order in other_orders:
        other = hf(LogitsProcessorList(order), HISTORY, row)
        assert not torch.equal(other == -torch.inf, expected == -torch.inf)


# ----- watermark: the green list is seeded by the previous token ----------------------------------


def greenlist(prev_token: int, gamma: float = 0.5) -> torch.Tensor:
    rng = torch.Generator().manual_seed(WATERMARK_HASH_KEY * prev_token)
    return torch.randperm(VOCAB, generator=rng)[: int(VOCAB * gamma)]


def test_watermark_boosts_exactly_the_green_list_seeded_by_the_last_history_token() -> None:
    row = scores(6)
    bias = chooser(watermark=True).process(row, HISTORY) - row
    expected = torch.zeros(VOCAB)
    expected[greenlist(HISTORY[-1])] = 2.0  # TGI's default WATERMARK_DELTA, on int(V × 0.5) ids
    torch.testing.assert_close(bias, expected, atol=1e-6, rtol=0)
    assert (expected != 0).sum() == VOCAB // 2
    # transformers' lefthash watermark (context width 1) is the same rule
    reference = WatermarkLogitsProcessor(VOCAB, "cpu", greenlist_ratio=0.5, bias=2.0)
    torch.testing.assert_close(hf(reference, HISTORY, row) - row, expected, atol=1e-6, rtol=0)
    # any other token of the history would give another green list
    for other in (HISTORY[-2], HISTORY[0]):
        assert set(greenlist(other).tolist()) != set(greenlist(HISTORY[-1]).tolist())


# ----- stopping: length > EOS > stop sequence -----------------------------------------------------


def test_last_allowed_token_that_is_eos_and_completes_a_stop_sequence_finishes_with_length() -> None:
    stop = StoppingCriteria({EOS}, max_new_tokens=3, stop_sequences=["cd"])
    assert [stop(5, "ab"), stop(6, "c"), stop(EOS, "d")] == [None, None, FinishReason.LENGTH]
    assert stop.current_tokens == 3


def test_eos_that_also_completes_a_stop_sequence_finishes_with_eos_token() -> None:
    stop = StoppingCriteria({EOS}, max_new_tokens=10, stop_sequences=["cd"])
    assert [stop(6, "c"), stop(EOS, "d")] == [None, FinishReason.EOS_TOKEN]


def test_ignored_eos_that_completes_a_stop_sequence_finishes_with_stop_sequence() -> None:
    stop = StoppingCriteria({EOS}, max_new_tokens=10, stop_sequences=["cd"], ignore_eos=True)
    assert [stop(EOS, "c"), stop(EOS, "d")] == [None, FinishReason.STOP_SEQUENCE]
