"""Each processor matches transformers' own LogitsProcessor on random logits; the watermark boosts its green list."""

import pytest
import torch
from transformers import (
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from tgi_vlm.generation.logits_process import (
    WATERMARK_HASH_KEY,
    LogitBias,
    LogitsPipeline,
    Watermark,
    apply_frequency_penalty,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    apply_typical_p,
)

VOCAB = 97


def random_scores(rows: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def random_history(rows: int = 4, length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    scores, history = random_scores(), random_history()
    expected = RepetitionPenaltyLogitsProcessor(penalty)(history, scores.clone())
    torch.testing.assert_close(
        apply_repetition_penalty(scores, history, penalty), expected, atol=1e-6, rtol=0
    )


def test_repetition_penalty_on_one_row_matches_the_batched_form() -> None:
    scores, history = random_scores(1), random_history(1)
    batched = apply_repetition_penalty(scores, history, 1.5)
    torch.testing.assert_close(apply_repetition_penalty(scores[0], history[0], 1.5), batched[0])


def test_frequency_penalty_subtracts_penalty_times_count_over_length() -> None:
    scores = torch.zeros(6)
    history = torch.tensor([1, 1, 1, 4])
    out = apply_frequency_penalty(scores, history, 0.8)
    torch.testing.assert_close(out, torch.tensor([0.0, -0.6, 0.0, 0.0, -0.2, 0.0]))


@pytest.mark.parametrize("temperature", [0.3, 1.7])
def test_temperature_matches_transformers(temperature: float) -> None:
    scores = random_scores()
    expected = TemperatureLogitsWarper(temperature)(None, scores.clone())
    torch.testing.assert_close(apply_temperature(scores, temperature), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("top_k", [1, 5, 40, VOCAB, VOCAB + 10])
def test_top_k_matches_transformers(top_k: int) -> None:
    scores = random_scores()
    expected = TopKLogitsWarper(top_k)(None, scores.clone())
    torch.testing.assert_close(apply_top_k(scores, top_k), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_matches_transformers(top_p: float) -> None:
    scores = random_scores()
    expected = TopPLogitsWarper(top_p)(None, scores.clone())
    torch.testing.assert_close(apply_top_p(scores, top_p), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("mass", [0.05, 0.5, 0.9, 0.999])
def test_typical_p_matches_transformers(mass: float) -> None:
    scores = random_scores()
    expected = TypicalLogitsWarper(mass)(None, scores.clone())
    torch.testing.assert_close(apply_typical_p(scores, mass), expected, atol=1e-6, rtol=0)


def test_warpers_keep_at_least_one_token() -> None:
    scores = random_scores()
    for warped in (apply_top_k(scores, 1), apply_top_p(scores, 1e-9), apply_typical_p(scores, 1e-9)):
        assert (warped > -torch.inf).sum(dim=-1).min().item() >= 1


def test_watermark_adds_delta_exactly_on_the_green_list() -> None:
    scores = random_scores(1)[0]
    prev_token = 42
    out = Watermark(gamma=0.25, delta=3.0, device="cpu")(scores, prev_token)
    rng = torch.Generator().manual_seed(WATERMARK_HASH_KEY * prev_token)
    green = torch.randperm(VOCAB, generator=rng)[: int(VOCAB * 0.25)]
    expected_bias = torch.zeros(VOCAB)
    expected_bias[green] = 3.0
    torch.testing.assert_close(out - scores, expected_bias)
    assert len(green) == 24


def test_watermark_green_list_depends_on_the_previous_token() -> None:
    watermark = Watermark(gamma=0.5, delta=2.0, device="cpu")
    assert not torch.equal(watermark.greenlist(1, VOCAB), watermark.greenlist(2, VOCAB))
    assert torch.equal(watermark.greenlist(1, VOCAB), watermark.greenlist(1, VOCAB))


def test_pipeline_applies_tgi_order_and_leaves_input_untouched() -> None:
    scores, history = random_scores(1)[0], random_history(1)[0]
    original = scores.clone()
    watermark = Watermark(0.5, 2.0, "cpu")
    pipeline = LogitsPipeline(
        watermark=watermark,
        repetition_penalty=1.2,
        frequency_penalty=0.5,
        temperature=0.8,
        top_k=20,
        top_p=0.9,
    )
    expected = watermark(scores, int(history[-1]))
    expected = apply_repetition_penalty(expected, history, 1.2)
    expected = apply_frequency_penalty(expected, history, 0.5)
    expected = apply_top_p(apply_top_k(apply_temperature(expected, 0.8), 20), 0.9)
    torch.testing.assert_close(pipeline(scores, history.tolist()), expected)
    assert torch.equal(scores, original)


def test_logit_bias_adds_each_value_at_its_token_and_nothing_elsewhere() -> None:
    scores = random_scores()
    original = scores.clone()
    out = LogitBias([(3, 5.0), (0, -100.0), (VOCAB - 1, 2.0), (3, 1.0)], "cpu")(scores)  # 3 twice: 6.0
    expected = original.clone()
    expected[:, 3] += 6.0
    expected[:, 0] -= 100.0
    expected[:, VOCAB - 1] += 2.0
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)  # (x + 5) + 1 vs x + 6: rounding only
    assert torch.equal(out[:, 4 : VOCAB - 1], original[:, 4 : VOCAB - 1])
    assert torch.equal(scores, original)
    one_row = LogitBias([(3, 5.0)], "cpu")(scores[1])
    assert one_row[3] == original[1, 3] + 5.0
    assert torch.equal(one_row[4:], original[1, 4:]) and torch.equal(one_row[:3], original[1, :3])


def test_logit_bias_matches_transformers_single_token_sequence_bias() -> None:
    scores, history = random_scores(), random_history()
    pairs = [(5, 3.0), (17, -10.0), (40, 0.5)]
    expected = SequenceBiasLogitsProcessor([[[t], b] for t, b in pairs])(history, scores.clone())
    assert torch.equal(LogitBias(pairs, "cpu")(scores), expected)


def test_logit_bias_comes_after_the_penalties_and_before_the_warpers() -> None:
    """TGI's NextTokenChooser: watermark, repetition, frequency, (grammar,) logit bias, then warpers."""
    scores, history = random_scores(1)[0], random_history(1)[0]
    seen = int(history[0])
    bias = LogitBias([(seen, 4.0), (int(scores.argmin()), 9.0)], "cpu")
    watermark = Watermark(0.5, 2.0, "cpu")
    pipeline = LogitsPipeline(
        watermark=watermark, repetition_penalty=1.5, frequency_penalty=0.5, logit_bias=bias, temperature=0.5
    )
    expected = watermark(scores, int(history[-1]))
    expected = apply_frequency_penalty(apply_repetition_penalty(expected, history, 1.5), history, 0.5)
    expected = apply_temperature(bias(expected), 0.5)
    torch.testing.assert_close(pipeline(scores, history.tolist()), expected)
    assert not LogitsPipeline(logit_bias=bias).is_identity
    assert not LogitsPipeline(logit_bias=bias).needs_history
    torch.testing.assert_close(LogitsPipeline(logit_bias=bias)(scores), bias(scores))


def test_pipeline_with_neutral_settings_is_identity() -> None:
    assert LogitsPipeline().is_identity
    scores = random_scores(1)[0]
    assert torch.equal(LogitsPipeline()(scores), scores)


def test_penalties_without_history_raise() -> None:
    with pytest.raises(ValueError, match="history"):
        LogitsPipeline(repetition_penalty=1.2)(random_scores(1)[0], [])
