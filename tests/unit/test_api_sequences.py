"""Several sequences of one prompt (chat and completions `n`, /generate `best_of`) through the real app
and router driver over a stub shard (tests/unit/test_api_validation_limits.py): what reaches the shard
(how many requests, their seeds, the cached prompt length each claims) and the answers' shapes."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.unit.test_api_validation_limits import serving
from tgi_vlm.router.router import Router

BLOCK = 16  # the stub shard's block size
PROMPT = "The quick brown fox jumps over the lazy dog " * 3


def run(body: dict, path: str, *, prefix_caching: bool = True, arch: str = "llama", shard_view=None):
    async def scenario():
        async with serving(prefix_caching, max_input=200, max_total=256, arch=arch) as (client, shard):
            response = await client.post(path, json=body)
            return response, shard.requests if shard_view is None else shard_view(shard)

    return asyncio.run(scenario())


def metric(text: str, name: str) -> float:
    """A counter's value in /metrics' text (0 when absent)."""
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    return values[0] if values else 0.0


def cached_prefix(prompt_len: int) -> int:
    full = prompt_len // BLOCK * BLOCK
    return full if full < prompt_len else prompt_len - 1


def test_best_of_samples_that_many_sequences_and_the_later_ones_reuse_the_first_ones_prompt_blocks():
    response, sent = run({"inputs": PROMPT, "parameters": {"best_of": 2, "do_sample": True, "max_new_tokens": 3,
                                                          "details": True}}, "/generate")
    assert response.status_code == 200, response.text
    prompt_len = int(response.headers["x-prompt-tokens"])
    assert [r.cache_len for r in sent] == [0, cached_prefix(prompt_len)] and cached_prefix(prompt_len) >= BLOCK
    assert len({r.parameters.seed for r in sent}) == 2  # a seed per sequence, none given
    details = response.json()["details"]
    assert list(details) == ["finish_reason", "generated_tokens", "seed", "prefill", "tokens", "best_of_sequences"]
    assert [list(s) for s in details["best_of_sequences"]] == [
        ["generated_text", "finish_reason", "generated_tokens", "seed", "prefill", "tokens"]]
    assert {details["seed"], details["best_of_sequences"][0]["seed"]} == {r.parameters.seed for r in sent}


def test_without_the_prefix_cache_the_sequences_are_queued_together_and_each_computes_its_prompt():
    response, sent = run({"inputs": PROMPT, "parameters": {"best_of": 2, "do_sample": True, "max_new_tokens": 3}},
                         "/generate", prefix_caching=False)
    assert response.status_code == 200, response.text
    assert [r.cache_len for r in sent] == [0, 0]


def test_chat_n_gives_n_choices_seeded_from_the_request_seed_and_computes_the_prompt_once():
    body = {"messages": [{"role": "user", "content": PROMPT}], "n": 4, "seed": 7, "max_tokens": 2}
    response, sent = run(body, "/v1/chat/completions", arch="qwen2_vl")
    assert response.status_code == 200, response.text
    out = response.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert sorted(r.parameters.seed for r in sent) == [7, 8, 9, 10]
    prompt_len = out["usage"]["prompt_tokens"]
    assert [r.cache_len for r in sent] == [0] + [cached_prefix(prompt_len)] * 3
    assert out["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 4, "total_tokens": prompt_len + 4}


def test_a_streamed_chat_with_n_names_each_choice_and_finishes_each():
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 1, "stream": True}
    response, sent = run(body, "/v1/chat/completions", arch="qwen2_vl")
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    assert sorted((e["choices"][0]["index"], e["choices"][0]["finish_reason"]) for e in events) == [
        (0, "length"), (1, "length")]
    assert len(sent) == 2 and response.text.endswith("data: [DONE]\n\n")


def test_completions_n_numbers_choices_prompt_by_prompt():
    response, sent = run({"prompt": ["a b", "c d"], "n": 2, "max_tokens": 1, "seed": 3}, "/v1/completions")
    assert response.status_code == 200, response.text
    assert [c["index"] for c in response.json()["choices"]] == [0, 1, 2, 3]
    assert sorted(r.parameters.seed for r in sent) == [3, 3, 4, 4]


def test_n_past_max_client_batch_size_is_refused_before_anything_runs():
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 5}
    response, sent = run(body, "/v1/chat/completions", arch="qwen2_vl")
    assert (response.status_code, response.json(), sent) == (422, {
        "error": "`n` = 5 exceeds the maximum allowed batch size of 4 (--max-client-batch-size)",
        "error_type": "batch size exceeded"}, [])


def test_completions_bound_prompts_times_n_by_max_client_batch_size():
    response, sent = run({"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1}, "/v1/completions")
    assert (response.status_code, response.json(), sent) == (422, {
        "error": "3 prompts × `n` = 2 is 6 sequences, which exceeds the maximum allowed batch size of 4 "
                 "(--max-client-batch-size)", "error_type": "batch size exceeded"}, [])
    response, sent = run({"prompt": ["a", "b"], "n": 2, "max_tokens": 1}, "/v1/completions")
    assert response.status_code == 200 and len(sent) == 4


def test_the_params_of_each_sequence_differ_only_in_their_seed():
    _, sent = run({"inputs": PROMPT, "parameters": {"best_of": 2, "top_k": 3, "max_new_tokens": 2}}, "/generate")
    a, b = sent
    a.parameters.seed = b.parameters.seed = 0
    a.cache_len = b.cache_len = 0
    a.id = b.id = 0
    del a.blocks[:], b.blocks[:], a.slots[:], b.slots[:]
    assert a == b


@pytest.mark.parametrize(("path", "body"), [
    ("/generate", {"inputs": PROMPT, "parameters": {"best_of": 2, "do_sample": True, "max_new_tokens": 2}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 2}),
], ids=["best_of", "chat-n"])
def test_a_request_with_several_sequences_is_counted_once_as_tgi_counts_an_http_request(path, body):
    async def scenario():
        async with serving(True, max_input=200, max_total=256, arch="qwen2_vl") as (client, shard):
            response = await client.post(path, json=body)
            return response, shard.requests, (await client.get("/metrics")).text

    response, sent, metrics = asyncio.run(scenario())
    assert response.status_code == 200, response.text
    assert len(sent) == 2
    assert (metric(metrics, "tgi_request_count"), metric(metrics, "tgi_request_success")) == (1, 1)
    assert metric(metrics, "tgi_request_generated_tokens_count") == 1  # one observation, for the request


def test_an_unexpected_failure_of_one_sequence_propagates_instead_of_an_incomplete_generation(monkeypatch):
    submit, calls = Router.submit, []

    async def failing_second(self, params, **kwargs):
        calls.append(params.seed)
        if len(calls) == 2:
            raise RuntimeError("router broke")
        return await submit(self, params, **kwargs)

    monkeypatch.setattr(Router, "submit", failing_second)
    with pytest.raises(RuntimeError, match="router broke"):
        run({"inputs": PROMPT, "parameters": {"best_of": 2, "do_sample": True, "max_new_tokens": 2}}, "/generate")


def test_with_decoder_input_details_the_sequences_do_not_wait_for_a_prefix_cache_they_cannot_use():
    body = {"inputs": PROMPT, "parameters": {"best_of": 2, "do_sample": True, "max_new_tokens": 2,
                                             "decoder_input_details": True, "details": True}}
    response, prefills = run(body, "/generate", shard_view=lambda shard: shard.prefills)
    assert response.status_code == 200, response.text
    assert len(prefills) == 1 and len(prefills[0]) == 2  # queued together: one prefill for both
    _, cached_prefills = run({**body, "parameters": {**body["parameters"], "decoder_input_details": False}},
                             "/generate", shard_view=lambda shard: shard.prefills)
    assert [len(p) for p in cached_prefills] == [1, 1]  # the cache serves the follower: it waits for the first
