"""The text engine's generation features, checked against transformers on tiny models:
router-shaped warmup, prefill logprobs (also chunked), top-n tokens, seeded sampling, every stop
reason, per-request parameters in a mixed batch, and left truncation."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.models.reference import hf_greedy
from tgi_vlm.errors import InvalidBatch
from tgi_vlm.generation import FinishReason
from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.testing import make_test_image, png_bytes, tiny_model_path
from tgi_vlm.testing.harness import Runner, make_batch, make_request

PROMPT = "the quick brown fox jumps over the lazy dog and then some more words follow here"
SHORT = "hello world this is"
SAMPLED = dict(do_sample=True, seed=42, temperature=0.7, top_k=20)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def hf(arch):
    path = tiny_model_path(arch)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def generate(engine, *requests: pb.Request) -> Runner:
    """All requests in one batch, run to completion."""
    r = Runner(engine)
    r.prefill(list(requests))
    r.run()
    return r


def prompt_ids(hf, text: str) -> list[int]:
    return hf[1](text)["input_ids"]


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' raw logits [T, V] over a prompt."""
    with torch.inference_mode():
        return hf[0](input_ids=torch.tensor([ids])).logits[0].float()


def reference(hf, ids: list[int], n: int) -> list[int]:
    inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    return hf_greedy(hf[0], inputs, n).ids


# ----- warmup -----------------------------------------------------------------------------------


def router_warmup(max_input: int | None, max_prefill: int, max_total: int | None) -> pb.WarmupRequest:
    """The WarmupRequest TGI's v3 router builds (backends/v3/src/client/grpc_client.rs, `warmup`)."""
    image = png_bytes(make_test_image(20, 20))
    requests, n_tokens = [], 0
    while n_tokens < max_prefill:
        truncate = max_prefill - n_tokens if max_input is None else min(max_input, max_prefill - n_tokens)
        chunks = [pb.InputChunk(text="_test " * truncate)]
        if n_tokens == 0:
            chunks.append(pb.InputChunk(image=pb.Image(data=image, mimetype="image/jpeg;base64")))
        requests.append(pb.Request(
            id=0,  # every warmup request has id 0
            inputs="_test " * truncate,
            input_chunks=pb.Input(chunks=chunks),
            truncate=truncate,
            add_special_tokens=True,
            parameters=pb.NextTokenChooserParameters(
                temperature=0.9, top_k=10, top_p=0.9, typical_p=0.9, do_sample=False, seed=0,
                repetition_penalty=1.2, frequency_penalty=0.1, watermark=True,
            ),
            stopping_parameters=pb.StoppingCriteriaParameters(
                max_new_tokens=1 if max_total is None else max_total - truncate, ignore_eos_token=True,
            ),
            prefill_logprobs=True,
            top_n_tokens=20,
        ))
        n_tokens += truncate
    batch = pb.Batch(id=0, requests=requests, size=len(requests), max_tokens=max_input or 0, max_blocks=0)
    return pb.WarmupRequest(batch=batch, max_input_tokens=max_input, max_prefill_tokens=max_prefill,
                            max_total_tokens=max_total)


@pytest.fixture
def warmed(engine):
    yield engine
    engine.prefill_budget = 4096  # warmup sets it to max_prefill_tokens


def test_router_shaped_warmup_runs_its_batch_and_returns_the_limits_it_was_given(warmed, hf):
    request = router_warmup(max_input=32, max_prefill=80, max_total=64)
    assert [r.truncate for r in request.batch.requests] == [32, 32, 16]
    assert len(prompt_ids(hf, request.batch.requests[0].inputs)) > 32  # the server truncates
    supported, max_input, max_total = warmed.warmup(request)
    assert (max_input, max_total) == (32, 64)
    assert supported == warmed.kv_cache.num_blocks * warmed.config.block_size
    assert warmed.kv_cache.num_blocks == (32 << 20) // warmed.kv_spec.bytes_per_block
    assert warmed.prefill_budget == 80


def test_warmup_without_limits_derives_them_from_the_cache_and_the_position_limit(warmed):
    supported, max_input, max_total = warmed.warmup(router_warmup(max_input=None, max_prefill=64, max_total=None))
    assert supported == warmed.kv_cache.num_blocks * warmed.config.block_size
    assert max_total == min(supported, warmed.text_config.max_position_embeddings) == 4096
    assert max_input == max_total - 1


def test_the_engine_generates_correctly_after_warmup(warmed, hf):
    warmed.warmup(router_warmup(max_input=32, max_prefill=64, max_total=64))
    warmed.prefill_budget = 4096
    r = generate(warmed, make_request(1, SHORT, max_new_tokens=5))
    assert r.tokens[1] == reference(hf, prompt_ids(hf, SHORT), 5)
    assert warmed.kv_blocks_in_use == 0


# ----- logprobs ---------------------------------------------------------------------------------


def expected_prefill_logprobs(hf, ids: list[int]) -> torch.Tensor:
    logprobs = torch.log_softmax(hf_logits(hf, ids), dim=-1)  # [T, V]
    return logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]  # logprob of token t+1 given ≤ t


def assert_prefill_tokens(tokens, hf, ids: list[int]) -> None:
    assert tokens.ids == ids
    assert len(tokens.logprobs) == len(ids) and len(tokens.texts) == len(ids)
    assert math.isnan(tokens.logprobs[0])
    torch.testing.assert_close(torch.tensor(tokens.logprobs[1:]), expected_prefill_logprobs(hf, ids),
                               atol=1e-4, rtol=0)


def test_prefill_logprobs_are_log_softmax_of_the_prompt_logits_with_nan_first(runner, hf):
    runner.prefill([make_request(1, PROMPT, max_new_tokens=3, prefill_logprobs=True)])
    runner.run()
    first, *rest = runner.generations[1]
    assert_prefill_tokens(first.prefill_tokens, hf, prompt_ids(hf, PROMPT))
    assert all(g.prefill_tokens is None for g in rest)


def test_prefill_logprobs_accumulate_across_chunks_and_are_reported_once(engine, runner, hf):
    engine.prefill_budget = 3
    ids = prompt_ids(hf, PROMPT)
    runner.prefill([make_request(1, PROMPT, max_new_tokens=3, prefill_logprobs=True, chunk_len=3)])
    steps = 1
    while 1 not in runner.generations:
        runner.step()
        steps += 1
    assert steps == -(-len(ids) // 3)
    runner.run()
    first, *rest = runner.generations[1]
    assert_prefill_tokens(first.prefill_tokens, hf, ids)
    assert all(g.prefill_tokens is None for g in rest)


def test_top_n_tokens_are_the_true_top_n_of_the_first_token(runner, hf):
    runner.prefill([make_request(1, PROMPT, max_new_tokens=2, top_n_tokens=5)])
    runner.run()
    (top,) = runner.generations[1][0].top_tokens
    expected = torch.topk(torch.log_softmax(hf_logits(hf, prompt_ids(hf, PROMPT))[-1], dim=-1), 5)
    assert top.ids == expected.indices.tolist()
    torch.testing.assert_close(torch.tensor(top.logprobs), expected.values, atol=1e-4, rtol=0)
    assert runner.generations[1][0].tokens.ids == [top.ids[0]]  # greedy picks the best one
    assert len(runner.generations[1][1].top_tokens) == 1


# ----- sampling ---------------------------------------------------------------------------------


def test_seeded_sampling_reproduces_across_runs(engine):
    first = generate(engine, make_request(1, SHORT, max_new_tokens=12, **SAMPLED))
    second = generate(engine, make_request(1, SHORT, max_new_tokens=12, **SAMPLED))
    assert first.tokens[1] == second.tokens[1]
    assert first.finished[1].seed == 42


def test_seeded_sampling_is_the_same_alone_and_in_a_batch_with_other_settings(engine):
    alone = generate(engine, make_request(1, SHORT, max_new_tokens=12, **SAMPLED))
    batched = generate(
        engine,
        make_request(2, PROMPT, max_new_tokens=5),
        make_request(3, "a", max_new_tokens=9, do_sample=True, seed=7, top_p=0.8),
        make_request(1, SHORT, max_new_tokens=12, **SAMPLED),
        make_request(4, SHORT, max_new_tokens=12, repetition_penalty=1.3, typical_p=0.5),
    )
    assert batched.tokens[1] == alone.tokens[1]


def test_different_seeds_give_different_tokens(engine):
    r = generate(engine, make_request(1, SHORT, max_new_tokens=12, **SAMPLED),
                 make_request(2, SHORT, max_new_tokens=12, **{**SAMPLED, "seed": 43}))
    assert r.tokens[1] != r.tokens[2]
    assert (r.finished[1].seed, r.finished[2].seed) == (42, 43)


def test_greedy_requests_report_no_seed(engine):
    r = generate(engine, make_request(1, SHORT, max_new_tokens=3, seed=5))
    assert r.finished[1].seed is None


# ----- stopping ---------------------------------------------------------------------------------


def test_max_new_tokens_stops_with_length(engine):
    r = generate(engine, make_request(1, SHORT, max_new_tokens=4))
    assert (r.finished[1].finish_reason, r.finished[1].generated_tokens) == (FinishReason.LENGTH, 4)
    assert len(r.tokens[1]) == 4


def test_an_eos_token_stops_with_eos_token(engine, runner):
    greedy = generate(engine, make_request(1, SHORT, max_new_tokens=8)).tokens[1]
    step = next(i for i in range(2, 8) if greedy[i] not in greedy[:i])  # first occurrence, at least step 3
    batch = engine.batch_from_pb(make_batch(1, [make_request(1, SHORT, max_new_tokens=8, ignore_eos=False)]))
    batch.seqs[0].stopping.eos_token_ids = {greedy[step]}
    runner.step(batch)
    runner.run()
    assert runner.tokens[1] == greedy[: step + 1]
    assert (runner.finished[1].finish_reason, runner.finished[1].generated_tokens) == (FinishReason.EOS_TOKEN, step + 1)


def test_ignore_eos_token_keeps_generating_past_eos(engine, runner):
    greedy = generate(engine, make_request(1, SHORT, max_new_tokens=6)).tokens[1]
    batch = engine.batch_from_pb(make_batch(1, [make_request(1, SHORT, max_new_tokens=6, ignore_eos=True)]))
    batch.seqs[0].stopping.eos_token_ids = {greedy[2]}
    runner.step(batch)
    runner.run()
    assert (runner.finished[1].finish_reason, runner.tokens[1]) == (FinishReason.LENGTH, greedy)


def test_a_stop_sequence_in_the_output_stops_with_stop_sequence(engine):
    full = generate(engine, make_request(1, SHORT, max_new_tokens=10))
    texts = [g.tokens.texts[0] for g in full.generations[1]]
    # The first step (from the 2nd) whose text is new: it cannot have matched earlier.
    step = next(i for i in range(1, 9) if texts[i].strip() and texts[i] not in "".join(texts[:i]))
    r = generate(engine, make_request(1, SHORT, max_new_tokens=10, stop_sequences=[texts[step]]))
    assert r.tokens[1] == full.tokens[1][: step + 1]
    assert (r.finished[1].finish_reason, r.finished[1].generated_tokens) == (FinishReason.STOP_SEQUENCE, step + 1)
    assert r.finished[1].text.endswith(texts[step])


# ----- per-request parameters -------------------------------------------------------------------


def test_penalties_and_watermark_change_only_their_own_request(engine):
    penalized = dict(repetition_penalty=3.0, frequency_penalty=2.0, watermark=True)
    alone = generate(engine, make_request(1, SHORT, max_new_tokens=10)).tokens[1]
    r = generate(engine, make_request(1, SHORT, max_new_tokens=10), make_request(2, SHORT, max_new_tokens=10, **penalized),
                 make_request(3, PROMPT, max_new_tokens=10, **SAMPLED))
    assert r.tokens[1] == alone
    assert r.tokens[2] != alone  # the settings do act, on their own request


# ----- logit_bias -------------------------------------------------------------------------------


def test_a_large_logit_bias_makes_greedy_choose_that_token_every_step(engine, hf):
    natural = reference(hf, prompt_ids(hf, SHORT), 6)
    target = next(t for t in range(engine.vocab_size - 1, 0, -1) if t not in natural and t not in engine.outputs.special_ids)
    r = generate(engine, make_request(1, SHORT, max_new_tokens=6, logit_bias={str(target): 100}))
    assert r.tokens[1] == [target] * 6
    for raw, generation in zip(r.logits[1], r.generations[1]):  # logprobs are of the biased scores, as TGI's
        biased = raw.clone()
        biased[target] += 100
        assert generation.tokens.logprobs == pytest.approx([torch.log_softmax(biased, -1)[target].item()], abs=1e-5)


def test_logit_bias_matches_transformers_sequence_bias_and_stays_in_its_request(engine, hf):
    ids = prompt_ids(hf, PROMPT)
    natural = reference(hf, ids, 8)
    # Ban the first two natural choices, favour two more tokens a little: the output changes but not to one token.
    bias = {natural[0]: -100, natural[1]: -100, natural[2]: 2, 20: 3}
    with torch.inference_mode():
        out = hf[0].generate(
            input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=8, eos_token_id=None, do_sample=False,
            sequence_bias={(token,): float(b) for token, b in bias.items()},
            output_logits=True, output_scores=True, return_dict_in_generate=True,
        )
    expected = out.sequences[0, len(ids):].tolist()
    assert expected != natural and len(set(expected)) > 1

    r = generate(engine, make_request(1, PROMPT, max_new_tokens=8, logit_bias={str(t): b for t, b in bias.items()}),
                 make_request(2, PROMPT, max_new_tokens=8))
    assert r.tokens[1] == expected
    assert r.tokens[2] == natural  # the unbiased neighbour is untouched
    for step in range(8):
        torch.testing.assert_close(r.logits[1][step], out.logits[step][0], atol=1e-4, rtol=0)  # raw logits
        chosen_logprob = torch.log_softmax(out.scores[step][0], -1)[expected[step]].item()  # processed scores
        assert r.generations[1][step].tokens.logprobs[0] == pytest.approx(chosen_logprob, abs=1e-4)


def test_logit_bias_keys_must_be_token_ids_in_the_vocabulary(engine):
    requests = [
        make_request(4, SHORT, max_new_tokens=2, logit_bias={"5": 1}),
        make_request(5, SHORT, max_new_tokens=2, logit_bias={"hello": 1}),
        make_request(6, SHORT, max_new_tokens=2, logit_bias={str(engine.vocab_size): -5}),
    ]
    with pytest.raises(InvalidBatch) as caught:
        engine.batch_from_pb(make_batch(1, requests))
    assert [str(e) for e in caught.value.errors] == [
        "request 5: logit_bias key 'hello' is not a token id (a non-negative decimal integer)",
        f"request 6: logit_bias key '{engine.vocab_size}' is outside the vocabulary "
        f"(token ids 0..{engine.vocab_size - 1})",
    ]
    assert engine.kv_blocks_in_use == 0


# ----- truncation -------------------------------------------------------------------------------


def test_truncate_keeps_the_last_tokens(engine, hf):
    ids = prompt_ids(hf, PROMPT)
    r = generate(engine, make_request(1, PROMPT, max_new_tokens=6, truncate=7, prefill_logprobs=True))
    assert r.generations[1][0].prefill_tokens.ids == ids[-7:]
    assert r.tokens[1] == reference(hf, ids[-7:], 6)


def test_truncate_longer_than_the_input_changes_nothing(engine, hf):
    ids = prompt_ids(hf, PROMPT)
    r = generate(engine, make_request(1, PROMPT, max_new_tokens=6, truncate=len(ids) + 50),
                 make_request(2, PROMPT, max_new_tokens=6))
    assert r.tokens[1] == r.tokens[2] == reference(hf, ids, 6)


def test_a_cache_len_the_shard_cannot_verify_is_refused(engine):
    """Trusting it would attend over whatever the slots hold (tests/models/test_prefix_caching.py has the rest)."""
    request = make_request(3, SHORT, max_new_tokens=2)
    request.cache_len = 2
    with pytest.raises(InvalidBatch, match="request 3: cache_len=2 ends in a partial block"):
        engine.batch_from_pb(make_batch(1, [request]))
    assert engine.kv_blocks_in_use == 0
