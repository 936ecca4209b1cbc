"""Sampling semantics end to end: the tiny llama engine, driven like TGI's router, against
transformers' own `generate` and its LogitsProcessor classes run over transformers' logits.

Each test pins one rule with exact ids (and, where ids alone could hide the bug, exact logprobs):
which tokens are the penalties' history, what the frequency penalty divides by, which token seeds
the watermark's green list, that seeded sampling is TGI's exponential race over transformers'
warpers, and how finish reasons and generated_tokens are reported.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from tgi_vlm.generation import FinishReason
from tgi_vlm.testing import tiny_model_path
from tgi_vlm.testing.harness import Runner, make_batch, make_request

REPEATS = "this this this this"  # greedy continues with tokens the prompt already holds
SHORT = "hello world this is"
WATERMARK_HASH_KEY = 15485863  # Kirchenbauer et al.'s prime, as in TGI's utils/watermark.py


@pytest.fixture(scope="module")
def arch():
    return "llama"


@pytest.fixture(scope="module")
def hf(arch):
    path = tiny_model_path(arch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def plain_greedy(hf):
    """transformers' unpenalised greedy ids of each prompt, computed once: {text: ids}."""
    return {text: hf_generate(hf, prompt_ids(hf, text), 12) for text in (REPEATS, SHORT)}


def prompt_ids(hf, text: str) -> list[int]:
    return hf[1](text)["input_ids"]


def next_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' raw logits [V] for the token after `ids`."""
    with torch.inference_mode():
        return hf[0](input_ids=torch.tensor([ids])).logits[0, -1].float()


def hf_generate(hf, ids: list[int], n: int, **kwargs) -> list[int]:
    """transformers' greedy `generate` for exactly n tokens (EOS neither stops nor is masked)."""
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = hf[0].generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            eos_token_id=None,
            do_sample=False,
            **kwargs,
        )
    return out[0, len(ids) :].tolist()


def run(runner: Runner, request) -> Runner:
    runner.prefill([request])
    runner.run()
    return runner


def reported_logprobs(runner: Runner, rid: int = 1) -> list[float]:
    return [g.tokens.logprobs[0] for g in runner.generations[rid]]


def hand_loop(hf, ids: list[int], n: int, process) -> tuple[list[int], list[float]]:
    """Greedy over transformers' logits after `process(scores, history)`; history = prompt + generated so far."""
    history, chosen, logprobs = list(ids), [], []
    for _ in range(n):
        scores = process(next_logits(hf, history), history)
        token = int(scores.argmax())
        chosen.append(token)
        logprobs.append(torch.log_softmax(scores, -1)[token].item())
        history.append(token)
    return chosen, logprobs


# ----- repetition penalty: the prompt counts as history --------------------------------------------


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_greedy_equals_transformers_generate(runner, hf, plain_greedy, penalty):
    ids, n = prompt_ids(hf, REPEATS), 10
    expected = hf_generate(hf, ids, n, repetition_penalty=penalty)
    got = run(runner, make_request(1, REPEATS, max_new_tokens=n, repetition_penalty=penalty)).tokens[1]
    assert got == expected
    # The penalty acts on this prompt, and a history of the generated tokens alone would choose otherwise.
    assert expected != plain_greedy[REPEATS][:n]
    generated_only = RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=len(ids))
    assert expected != hf_generate(hf, ids, n, logits_processor=LogitsProcessorList([generated_only]))


# ----- frequency penalty: TGI's count / len(prompt + generated so far) ----------------------------


@pytest.mark.parametrize(("text", "penalty"), [(REPEATS, 1.0), (SHORT, -0.8)])
def test_frequency_penalty_divides_counts_by_the_whole_history_length(runner, hf, text, penalty):
    """TGI (HeterogeneousFrequencyPenaltyLogitsProcessor): scores -= penalty × count(id) / len(history),
    history being every id so far, prompt included; the reported logprob is of those scores."""
    ids, n = prompt_ids(hf, text), 8
    vocab = hf[0].config.vocab_size

    def frequency(scores, history):
        counts = torch.bincount(torch.tensor(history), minlength=vocab).float()
        return scores - penalty * counts / len(history)

    expected_ids, expected_logprobs = hand_loop(hf, ids, n, frequency)
    r = run(runner, make_request(1, text, max_new_tokens=n, frequency_penalty=penalty))
    assert r.tokens[1] == expected_ids
    torch.testing.assert_close(
        torch.tensor(reported_logprobs(r)), torch.tensor(expected_logprobs), atol=1e-4, rtol=0
    )


# ----- watermark: the green list of step t is seeded by the token at t-1 ---------------------------


def greenlist(prev_token: int, vocab: int, gamma: float = 0.5) -> torch.Tensor:
    rng = torch.Generator().manual_seed(WATERMARK_HASH_KEY * prev_token)
    return torch.randperm(vocab, generator=rng)[: int(vocab * gamma)]


def watermark_loop(hf, ids: list[int], n: int, previous):
    """The engine's default gamma 0.5 / delta 2.0 (TGI's WATERMARK_GAMMA / WATERMARK_DELTA)."""

    def boost(scores, history):
        scores = scores.clone()
        scores[greenlist(previous(history), scores.shape[-1])] += 2.0
        return scores

    return hand_loop(hf, ids, n, boost)


def test_watermark_green_list_is_seeded_by_the_previous_token_starting_with_the_last_prompt_token(
    runner, hf, plain_greedy
):
    ids, n = prompt_ids(hf, SHORT), 8
    assert len(set(ids)) == len(ids)  # every other choice of seeding token gives another green list
    expected_ids, expected_logprobs = watermark_loop(hf, ids, n, lambda h: h[-1])
    r = run(runner, make_request(1, SHORT, max_new_tokens=n, watermark=True))
    assert r.tokens[1] == expected_ids
    torch.testing.assert_close(
        torch.tensor(reported_logprobs(r)), torch.tensor(expected_logprobs), atol=1e-4, rtol=0
    )
    # Seeding by the token before, or by the first token, would report other logprobs from the first step on.
    for wrong in (lambda h: h[-2], lambda h: h[0]):
        assert abs(watermark_loop(hf, ids, 1, wrong)[1][0] - expected_logprobs[0]) > 1e-2
    assert expected_ids != plain_greedy[SHORT][:n]


# ----- warpers: sampling is TGI's exponential race over transformers' warpers ----------------------


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_top_k_1_samples_exactly_transformers_greedy_whatever_the_seed(runner, plain_greedy, seed):
    n = 8
    r = run(runner, make_request(1, SHORT, max_new_tokens=n, top_k=1, seed=seed))
    assert r.tokens[1] == plain_greedy[SHORT][:n]
    assert r.finished[1].seed == seed  # top_k alone switched sampling on


def test_seeded_sampling_is_tgis_exponential_race_over_transformers_warpers(runner, hf, plain_greedy):
    """TGI's Sampling: argmax(softmax(warped) / Exp(1) noise) with one torch.Generator seeded once per request;
    the warpers are transformers' own, in TGI's order temperature, top-k, top-p, typical-p."""
    ids, n, seed = prompt_ids(hf, SHORT), 12, 2024
    warpers = LogitsProcessorList(
        [TemperatureLogitsWarper(0.8), TopKLogitsWarper(30), TopPLogitsWarper(0.9), TypicalLogitsWarper(0.95)]
    )
    rng = torch.Generator().manual_seed(seed)
    history, expected = list(ids), []
    for _ in range(n):
        warped = warpers(torch.tensor([history]), next_logits(hf, history)[None])[0]
        probs = torch.softmax(warped, -1)
        token = int((probs / torch.empty_like(probs).exponential_(1, generator=rng)).argmax())
        expected.append(token)
        history.append(token)
    params = dict(temperature=0.8, top_k=30, top_p=0.9, typical_p=0.95, seed=seed)
    r = run(runner, make_request(1, SHORT, max_new_tokens=n, **params))
    assert r.tokens[1] == expected
    assert expected != plain_greedy[SHORT][:n]  # it did sample


# ----- stopping: length > EOS > stop sequence, with exact generated_tokens -------------------------


@pytest.fixture(scope="module")
def stop_case(engine):
    """Greedy ids/texts of SHORT and a step k whose token text appears for the first time there."""
    r = Runner(engine)
    run(r, make_request(1, SHORT, max_new_tokens=10))
    texts = [g.tokens.texts[0] for g in r.generations[1]]
    k = next(i for i in range(2, 9) if texts[i].strip() and texts[i] not in "".join(texts[:i]))
    return r.tokens[1], texts, k


def finish(engine, runner, k_token: int, **stopping) -> Runner:
    request = make_request(1, SHORT, **stopping)
    batch = engine.batch_from_pb(make_batch(1, [request]))
    batch.seqs[0].stopping.eos_token_ids = {k_token}  # the tiny model never emits its real EOS
    runner.step(batch)
    runner.run()
    return runner


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"max_new_tokens": 10, "ignore_eos": False}, FinishReason.EOS_TOKEN),  # EOS beats the stop sequence
        ({"max_new_tokens": 10, "ignore_eos": True}, FinishReason.STOP_SEQUENCE),  # ignored EOS leaves it
    ],
)
def test_eos_and_stop_sequence_on_one_token_finish_by_priority(engine, runner, stop_case, extra, reason):
    greedy, texts, k = stop_case
    r = finish(engine, runner, greedy[k], stop_sequences=[texts[k]], **extra)
    assert r.tokens[1] == greedy[: k + 1]
    assert (r.finished[1].finish_reason, r.finished[1].generated_tokens) == (reason, k + 1)


def test_last_allowed_token_that_is_eos_and_a_stop_sequence_finishes_with_length(engine, runner, stop_case):
    greedy, texts, k = stop_case
    r = finish(engine, runner, greedy[k], max_new_tokens=k + 1, ignore_eos=False, stop_sequences=[texts[k]])
    assert r.tokens[1] == greedy[: k + 1]
    assert (r.finished[1].finish_reason, r.finished[1].generated_tokens) == (FinishReason.LENGTH, k + 1)
    assert r.finished[1].text == "".join(texts[: k + 1])
