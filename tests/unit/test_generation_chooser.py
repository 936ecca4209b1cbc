"""TokenChooser and choose_tokens: greedy fast path, TGI-style seeded sampling, reported logprobs."""

import pytest
import torch

from tgi_vlm.generation.chooser import TokenChooser, choose_tokens
from tgi_vlm.generation.logits_process import apply_repetition_penalty, apply_temperature, apply_top_k
from tgi_vlm.pb.generate_pb2 import NextTokenChooserParameters

VOCAB = 53


def chooser(**params: object) -> TokenChooser:
    return TokenChooser.from_params(NextTokenChooserParameters(**params), device="cpu")


def step_logits(step: int, rows: int = 1) -> torch.Tensor:
    """The same logits for a given step, whatever else is in the batch."""
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(1000 + step)) * 2


def test_proto3_zeros_give_a_plain_greedy_chooser() -> None:
    c = chooser()
    assert c.is_greedy_plain and not c.do_sample
    assert c.pipeline.temperature == 1.0 and c.pipeline.top_p == 1.0 and c.pipeline.repetition_penalty == 1.0


def test_warpers_penalties_and_watermark_each_leave_the_plain_path() -> None:
    assert chooser(temperature=0.5).do_sample  # TGI: any warper implies sampling
    assert chooser(top_k=5).do_sample
    assert chooser(top_p=0.9).do_sample and chooser(typical_p=0.9).do_sample
    assert not chooser(repetition_penalty=1.2).is_greedy_plain
    assert not chooser(frequency_penalty=0.3).is_greedy_plain
    assert not chooser(watermark=True).is_greedy_plain
    assert not chooser(repetition_penalty=1.2).do_sample
    assert chooser(top_p=1.0, typical_p=1.0, temperature=1.0).is_greedy_plain


def test_logit_bias_leaves_the_plain_path_but_stays_greedy() -> None:
    c = chooser(logit_bias={"4": 1})
    assert not c.is_greedy_plain and not c.do_sample
    assert chooser(logit_bias={}).is_greedy_plain


def test_greedy_with_logit_bias_picks_and_reports_the_biased_scores() -> None:
    """TGI: the choice and the reported logprobs come from the processed (biased) scores."""
    logits = step_logits(2, rows=2)
    target = int(logits[0].argmin())
    chosen = choose_tokens(logits, [chooser(logit_bias={str(target): 100}), chooser()], [[1], [1]])
    biased = logits[0].clone()
    biased[target] += 100
    assert chosen.ids == [target, int(logits[1].argmax())]
    torch.testing.assert_close(chosen.logprob_rows[0], torch.log_softmax(biased, -1))
    torch.testing.assert_close(chosen.logprob_rows[1], torch.log_softmax(logits[1], -1))


def test_seed_is_kept_as_given() -> None:
    assert chooser(do_sample=True, seed=0).seed == 0
    assert chooser(do_sample=True, seed=2**63 + 5).seed == 2**63 + 5


def test_greedy_fast_path_equals_per_row_results() -> None:
    logits = step_logits(0, rows=5)
    batch = choose_tokens(logits, [chooser() for _ in range(5)], [[1]] * 5)
    assert batch.ids == logits.argmax(-1).tolist()
    expected_rows = torch.log_softmax(logits, -1)
    torch.testing.assert_close(batch.logprob_rows, expected_rows)
    for i in range(5):
        alone = choose_tokens(logits[i : i + 1], [chooser()], [[1]])
        assert alone.ids == [batch.ids[i]]
        assert alone.logprobs[0] == batch.logprobs[i]


def test_greedy_row_is_unchanged_when_batched_with_sampling_rows() -> None:
    logits = step_logits(1, rows=3)
    mixed = choose_tokens(logits, [chooser(), chooser(do_sample=True, seed=3), chooser()], [[1]] * 3)
    plain = choose_tokens(logits, [chooser()] * 3, [[1]] * 3)
    assert [mixed.ids[0], mixed.ids[2]] == [plain.ids[0], plain.ids[2]]
    torch.testing.assert_close(mixed.logprob_rows[[0, 2]], plain.logprob_rows[[0, 2]])


def test_sampling_is_tgi_exponential_race_with_a_generator_seeded_once() -> None:
    c = chooser(do_sample=True, seed=1234)
    rng = torch.Generator().manual_seed(1234)
    for step in range(5):
        logits = step_logits(step)
        probs = torch.softmax(logits[0], -1)
        expected = (probs / torch.empty_like(probs).exponential_(1, generator=rng)).argmax().item()
        assert choose_tokens(logits, [c], [[1]]).ids == [expected]


def run_request(seed: int, companions: int, steps: int = 20) -> list[int]:
    target = chooser(do_sample=True, seed=seed, temperature=0.9, top_k=30)
    others = [chooser(do_sample=True, seed=seed + 1 + j, top_p=0.8) for j in range(companions)]
    tokens = []
    for step in range(steps):
        rows = torch.cat([step_logits(step), step_logits(500 + step, rows=companions)])
        tokens.append(choose_tokens(rows, [target, *others], [[1]] * (1 + companions)).ids[0])
    return tokens


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch() -> None:
    alone = run_request(seed=7, companions=0)
    assert alone == run_request(seed=7, companions=0)
    assert alone == run_request(seed=7, companions=3)
    assert alone != run_request(seed=8, companions=0)


def test_logprob_is_of_the_processed_scores_at_the_chosen_id() -> None:
    logits = step_logits(2)
    history = [3, 3, 9]
    c = chooser(repetition_penalty=1.5, temperature=0.7, top_k=10, do_sample=True, seed=5)
    chosen = choose_tokens(logits, [c], [history])
    processed = apply_top_k(
        apply_temperature(apply_repetition_penalty(logits[0], torch.tensor(history), 1.5), 0.7), 10
    )
    expected_rows = torch.log_softmax(processed, -1)
    torch.testing.assert_close(chosen.logprob_rows[0], expected_rows)
    assert chosen.logprobs[0] == expected_rows[chosen.ids[0]].item()
    assert chosen.logprobs[0] > -float("inf")  # top-k filtered ids are never sampled


def test_repetition_penalty_changes_the_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.9, 0.0]])
    assert choose_tokens(logits, [chooser()], [[1]]).ids == [1]
    assert choose_tokens(logits, [chooser(repetition_penalty=1.2)], [[1]]).ids == [2]


def test_low_precision_logits_choose_like_float32() -> None:
    logits = step_logits(3, rows=4).to(torch.bfloat16)
    chosen = choose_tokens(logits, [chooser()] * 4, [[1]] * 4, keep_logprob_rows=False)
    assert chosen.ids == logits.float().argmax(-1).tolist()
    assert chosen.logprob_rows is None


def test_mismatched_batch_sizes_raise() -> None:
    with pytest.raises(ValueError, match="2 logits rows, 1 choosers"):
        choose_tokens(step_logits(0, rows=2), [chooser()], [[1]])


def test_a_grammar_mask_limits_its_rows_and_leaves_the_others_exact() -> None:
    logits = step_logits(7, rows=3)
    allowed = torch.ones(3, VOCAB, dtype=torch.bool)
    allowed[0] = False
    allowed[0, [5, 9]] = True
    allowed[2] = False
    allowed[2, 2] = True
    for choosers in ([chooser(), chooser(), chooser()], [chooser(), chooser(), chooser(do_sample=True, seed=1)]):
        out = choose_tokens(logits, choosers, [[1]] * 3, allowed=allowed)
        assert out.ids[0] == (5 if logits[0, 5] > logits[0, 9] else 9)
        assert out.ids[1] == int(logits[1].argmax()) and out.ids[2] == 2
        assert out.logprobs[2] == 0.0  # the only allowed token
        assert torch.isfinite(out.logprob_rows[0]).nonzero()[:, 0].tolist() == [5, 9]
        torch.testing.assert_close(out.logprob_rows[1], torch.log_softmax(logits[1], -1), rtol=0, atol=0)


def test_the_chosen_logprob_without_rows_is_one_logsumexp_equal_to_log_softmax() -> None:
    """Without top-n (`keep_logprob_rows=False`) no [B, V] log-probs are made: the chosen token's log-prob is its
    score minus the row's logsumexp, equal to log_softmax's within float32 rounding, for greedy, processed and
    grammar-masked rows alike (a masked -inf score does not turn the sum into a NaN)."""
    logits = step_logits(7, rows=3) * 4
    allowed = torch.ones(3, VOCAB, dtype=torch.bool)
    allowed[1, ::2] = False
    for choosers in ([chooser()] * 3, [chooser(), chooser(repetition_penalty=1.3), chooser(do_sample=True, seed=5)]):
        kept = choose_tokens(logits, choosers, [[1, 2]] * 3, allowed=allowed)
        lean = choose_tokens(logits, choosers, [[1, 2]] * 3, allowed=allowed, keep_logprob_rows=False)
        assert lean.logprob_rows is None and kept.logprob_rows is not None
        assert lean.ids == kept.ids
        want = [float(kept.logprob_rows[i, t]) for i, t in enumerate(kept.ids)]
        assert lean.logprobs == pytest.approx(want, abs=1e-5) and kept.logprobs == pytest.approx(want, abs=0)
        assert all(v <= 0 for v in lean.logprobs)


@pytest.mark.parametrize("keep_rows", [True, False])
def test_greedy_ties_choose_the_first_maximum_as_argmax_does_and_a_nan_row_chooses_the_nan(keep_rows) -> None:
    """The greedy path takes max(dim)'s index: on equal maxima that must be the first, as argmax (and transformers'
    greedy `generate`) chooses, at a real vocabulary's width too; a NaN wins as it does in argmax."""
    logits = torch.zeros(4, 262_144)
    logits[0, [5, 200_000]] = 1.0  # two equal maxima
    logits[1, 7], logits[1, 9] = float("nan"), 5.0
    logits[2] = -2.0  # every score equal
    logits[3, [100, 262_143]] = 3.0
    got = choose_tokens(logits, [chooser()] * 4, [[1]] * 4, keep_logprob_rows=keep_rows)
    assert got.ids == logits.argmax(-1).tolist() == [5, 7, 0, 100]
    want = 1.0 - float(torch.logsumexp(logits[0].double(), -1))  # float32 sums over 262k terms: ~1e-4
    assert got.logprobs[0] == pytest.approx(want, abs=1e-3)
