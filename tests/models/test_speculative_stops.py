"""Speculative decoding when a stop sequence or EOS falls inside an accepted run and the drafts go on past it.

test_speculative.py's drafter proposes the plain run's own output, which already ends at the stop, so its
drafts end there too. Here the drafter proposes the continuation of a run with no stop at all: the verified
run accepts drafts up to the stop and the drafts continue beyond it. The request must still end exactly where
the plain run ends (tokens, finish reason, count), nothing past the stop is emitted or advanced over, the
other requests of the batch are unaffected, and the speculation counters count what was verified:
for one request, generated = 1 (from prefill) + verified runs + accepted drafts."""

from __future__ import annotations

import pytest

from tests.conftest import load_engine
from tests.models.test_speculative import TEXT, outputs, run
from tgi_vlm.testing.harness import make_request

K = 4  # speculation depth under test
LONG = 24


class ContinuingDrafter:
    """Proposes what followed `ids` in runs that never stopped (`wrong`: each proposal's first token off by
    one); records every `max_tokens` it was asked for."""

    def __init__(self, continuations: list[list[int]], wrong: bool = False):
        self.continuations = continuations
        self.wrong = wrong
        self.asked: list[int] = []
        self.proposed_past: list[int] = []  # for each proposal: the position its last draft token stands for

    def propose(self, ids, max_tokens):
        self.asked.append(max_tokens)
        for full in self.continuations:
            if full[: len(ids)] == list(ids):
                draft = full[len(ids) : len(ids) + max_tokens]
                if self.wrong and draft:
                    draft[0] = (draft[0] + 1) % 500
                self.proposed_past.append(len(ids) + len(draft))
                return draft
        return []


@pytest.fixture(scope="module")
def engines():
    return load_engine("llama"), load_engine("llama", speculate=K)


@pytest.fixture(scope="module")
def continuation(engines):
    """The prompt's ids and the plain greedy tokens of a run that never stops."""
    plain, _ = engines
    request = make_request(1, *TEXT, max_new_tokens=LONG)
    tokens = run(plain, [request]).tokens[1]
    return list(plain.tokenize_request(request).ids), tokens


def speculating(engine, drafter, requests):
    """Run `requests` with `drafter`: (runner, (runs, drafted, accepted) added to the engine's counters)."""
    before = (engine.speculation.runs, engine.speculation.drafted, engine.speculation.accepted)
    engine.drafter, kept = drafter, engine.drafter
    try:
        runner = run(engine, requests)
    finally:
        engine.drafter = kept
    after = (engine.speculation.runs, engine.speculation.drafted, engine.speculation.accepted)
    return runner, tuple(a - b for a, b in zip(after, before))


def perfect_runs(generated: int) -> tuple[int, int, int]:
    """(runs, drafted, accepted) of one request whose drafts are all right: each run emits K + 1 tokens, the
    last one fewer when the request ends inside it (and max_new_tokens leaves room for K drafts throughout)."""
    runs = -(-(generated - 1) // (K + 1))
    return runs, runs * K, generated - 1 - runs


def first_new_token(tokens: list[int], at_least: int) -> int:
    """Index of the first token at `at_least` or later that does not occur before it."""
    return next(i for i in range(at_least, len(tokens)) if tokens[i] not in tokens[:i])


def test_a_stop_sequence_inside_an_accepted_run_ends_the_request_where_the_plain_run_ends(engines, continuation):
    plain, spec = engines
    prompt, tokens = continuation
    stop_at = first_new_token(tokens, 8)
    stop = plain.tokenizer.decode(tokens[stop_at - 1 : stop_at + 1])
    request = lambda: make_request(1, *TEXT, max_new_tokens=LONG, stop_sequences=[stop])  # noqa: E731
    expected = outputs(run(plain, [request()]))
    _, reason, count, _ = expected[1]
    assert (reason, count) == (2, stop_at + 1)  # FINISH_REASON_STOP_SEQUENCE, on the stop's last token
    drafter = ContinuingDrafter([prompt + tokens])
    got, counters = speculating(spec, drafter, [request()])
    assert outputs(got) == expected
    assert max(drafter.proposed_past) > len(prompt) + count  # the drafts did go past the stop
    assert counters == perfect_runs(count)


def test_eos_inside_an_accepted_run_ends_the_request_where_the_plain_run_ends(engines, continuation, monkeypatch):
    plain, spec = engines
    prompt, tokens = continuation
    eos_at = first_new_token(tokens, 6)
    for engine in (plain, spec):  # the sampled token at eos_at is the model's EOS for this test
        monkeypatch.setattr(engine, "eos_token_ids", {tokens[eos_at]})
    request = lambda: make_request(1, *TEXT, max_new_tokens=LONG, ignore_eos=False)  # noqa: E731
    expected = outputs(run(plain, [request()]))
    assert expected[1][1:3] == (1, eos_at + 1)  # FINISH_REASON_EOS_TOKEN, the EOS counted
    drafter = ContinuingDrafter([prompt + tokens])
    got, counters = speculating(spec, drafter, [request()])
    assert outputs(got) == expected
    assert max(drafter.proposed_past) > len(prompt) + eos_at + 1
    assert counters == perfect_runs(eos_at + 1)


def test_a_request_stopping_inside_a_run_leaves_the_others_of_its_batch_as_they_were(engines, continuation):
    plain, spec = engines
    prompt, tokens = continuation
    stop_at = first_new_token(tokens, 4)
    stop = plain.tokenizer.decode(tokens[stop_at : stop_at + 1])
    requests = lambda: [  # noqa: E731
        make_request(1, *TEXT, max_new_tokens=LONG),
        make_request(2, *TEXT, max_new_tokens=LONG, stop_sequences=[stop]),
        make_request(3, *TEXT, max_new_tokens=9),
        make_request(4, *TEXT, max_new_tokens=12, top_n_tokens=2, prefill_logprobs=True),
    ]
    expected = outputs(run(plain, requests()))
    assert [expected[r][1:3] for r in (1, 2, 3, 4)] == [(0, LONG), (2, stop_at + 1), (0, 9), (0, 12)]
    got, _ = speculating(spec, ContinuingDrafter([prompt + tokens]), requests())
    assert outputs(got) == expected
    for rid, generations in got.generations.items():  # what a verified run emits for each accepted row
        texts = [text for g in generations for text in g.tokens.texts]
        assert "".join(texts) == got.finished[rid].text == plain.tokenizer.decode(got.tokens[rid]), rid
    with_extras = got.generations[4]
    assert [top.ids[0] for g in with_extras for top in g.top_tokens] == tokens[:12]  # greedy: the best of its row
    assert all(len(top.ids) == 2 for g in with_extras for top in g.top_tokens)
    assert list(with_extras[0].prefill_tokens.ids) == prompt  # the prompt's logprobs, once, at prefill


def test_drafts_rejected_at_their_first_token_back_off_and_are_counted_as_nothing_accepted(engines, continuation):
    plain, spec = engines
    prompt, tokens = continuation
    request = lambda: make_request(1, *TEXT, max_new_tokens=16)  # noqa: E731
    expected = outputs(run(plain, [request()]))
    got, counters = speculating(spec, ContinuingDrafter([prompt + tokens], wrong=True), [request()])
    assert outputs(got) == expected
    # decode step 1 drafts and misses (4 steps skipped), step 6 drafts and misses (16 skipped: to the end)
    assert counters == (2, 2 * K, 0)


def test_the_drafter_is_asked_for_no_more_tokens_than_fit_before_max_new_tokens(engines, continuation):
    plain, spec = engines
    prompt, tokens = continuation
    drafter = ContinuingDrafter([prompt + tokens])
    got, counters = speculating(spec, drafter, [make_request(1, *TEXT, max_new_tokens=8)])
    assert got.tokens[1] == tokens[:8]
    # after prefill 1 token: min(K, 8 - 1 - 1) = 4; the run emits 5 (6 in all): min(K, 8 - 6 - 1) = 1; 2 more: done
    assert drafter.asked == [4, 1]
    assert counters == (2, 5, 5)
