"""TGI's request validation at the exact edge of every limit, through the real HTTP app in process.

The app is `build_app` over a started router driver (its queue, allocator and own checks) whose shard is a
stub: Warmup reports the limits under test, and every Prefill finishes each request with one token. So a
request either comes back 422 with TGI's exact body, or reaches the shard, where the test reads what it was
sent (max_new_tokens, truncate, top_n_tokens, ...). TGI accepts a limit at its value and refuses one past it
(router/src/validation.rs): `input + max_new_tokens <= max_total_tokens`, `input <= max_input_tokens`,
`truncate <= max_input_tokens`, `top_n_tokens <= max_top_n_tokens`, `len(stop) <= max_stop_sequences`; a
request without `max_new_tokens` gets `max_total_tokens - input`.

Both ways the validator counts the prompt are run: ids and images in one pass (the router's prefix cache
keys on them, `tgi-vlm launch`'s default) and the bare count (prefix caching off)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import re
from dataclasses import dataclass, field

import httpx
import pytest

from tgi_vlm.api.app import build_app
from tgi_vlm.api.config import ApiConfig
from tgi_vlm.api.state import ApiState
from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.router.requests import RequestParams
from tgi_vlm.router.router import Router, RouterConfig
from tgi_vlm.router.tokens import TokenCounter
from tgi_vlm.testing import tiny_model_path

MAX_INPUT, MAX_TOTAL = 12, 20


def counter(arch: str = "llama") -> TokenCounter:
    return _counter(arch)


@functools.lru_cache(maxsize=2)
def _counter(arch: str) -> TokenCounter:
    return TokenCounter(str(tiny_model_path(arch)))


def prompt_of(tokens: int) -> str:
    """A prompt the tiny llama counts as exactly `tokens` tokens: BOS and `tokens - 1` times " a"."""
    text = " ".join(["a"] * (tokens - 1))
    assert length_of(text) == tokens
    return text


def length_of(text: str) -> int:
    return len(counter().input_ids(RequestParams([text]).to_pb(0)))


@dataclass
class StubShard:
    """Enough of a shard for the router driver: Warmup reports the limits, Prefill finishes every request."""

    max_input_tokens: int
    max_total_tokens: int
    requests: list[pb.Request] = field(default_factory=list)
    prefills: list[list[int]] = field(default_factory=list)  # the request ids of each Prefill, in order

    async def clear_cache(self, _batch_id):
        return None

    async def health(self):
        return pb.HealthResponse()

    async def info(self):
        return pb.InfoResponse(block_size=16, support_chunking=True)

    async def warmup(self, _request):
        return pb.WarmupResponse(max_supported_total_tokens=4096, max_input_tokens=self.max_input_tokens,
                                 max_total_tokens=self.max_total_tokens)

    async def prefill(self, batch, _cached=None):
        self.requests.extend(batch.requests)
        self.prefills.append([r.id for r in batch.requests])
        return pb.PrefillResponse(generations=[
            pb.Generation(request_id=r.id, tokens=pb.Tokens(ids=[7], logprobs=[-0.5], texts=["x"], is_special=[False]),
                          generated_text=pb.GeneratedText(text="x", generated_tokens=1,
                                                          finish_reason=pb.FINISH_REASON_LENGTH, seed=r.parameters.seed))
            for r in batch.requests])


@contextlib.asynccontextmanager
async def serving(prefix_caching: bool, max_input: int = MAX_INPUT, max_total: int = MAX_TOTAL, arch: str = "llama"):
    """(HTTP client of the app, the stub shard): limits as Warmup settles them, TGI's flag defaults."""
    shard = StubShard(max_input, max_total)
    router = Router(shard, counter(arch).tokenize, RouterConfig(max_input_tokens=max_input,
                                                                 max_total_tokens=max_total,
                                                                 prefix_caching=prefix_caching))
    await router.start()
    loop = asyncio.create_task(router.run())
    state = ApiState.create(ApiConfig(model_id=f"tiny-{arch}"), router, counter(arch))
    transport = httpx.ASGITransport(app=build_app(state))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client, shard
    finally:
        router.stop()
        await loop
        await state.close()


def post(body: dict, *, prefix_caching: bool = True, path: str = "/generate", **serve) -> tuple[httpx.Response, list]:
    async def scenario():
        async with serving(prefix_caching, **serve) as (client, shard):
            return await client.post(path, json=body), shard.requests

    return asyncio.run(scenario())


def refused(message: str) -> dict:
    return {"error": f"Input validation error: {message}", "error_type": "validation"}


COUNTING = pytest.mark.parametrize("prefix_caching", [True, False], ids=["ids-and-images", "bare-count"])


# ----- max_new_tokens and max_total_tokens -----

@COUNTING
def test_a_request_without_max_new_tokens_gets_the_rest_of_max_total_tokens(prefix_caching):
    text = prompt_of(5)
    response, sent = post({"inputs": text, "parameters": {"temperature": 0.5}}, prefix_caching=prefix_caching)
    assert response.status_code == 200, response.text
    assert response.headers["x-prompt-tokens"] == "5"
    assert [r.stopping_parameters.max_new_tokens for r in sent] == [MAX_TOTAL - 5]


def test_a_request_without_parameters_samples_and_gets_the_rest_of_max_total_tokens():
    response, sent = post({"inputs": prompt_of(6)})
    assert response.status_code == 200, response.text
    assert [(r.stopping_parameters.max_new_tokens, r.parameters.do_sample) for r in sent] == [(MAX_TOTAL - 6, True)]


def test_a_prompt_at_max_total_tokens_without_max_new_tokens_is_refused_by_the_router_with_a_422():
    """The default is max_total - input = 0 here: the validator lets it through (0 + input is within the limit,
    as in TGI) and the router driver refuses it, since a request must be able to generate one token: 422,
    and nothing reaches the shard."""
    response, sent = post({"inputs": prompt_of(8), "parameters": {}}, max_input=8, max_total=8)
    assert response.status_code == 422, response.text
    assert response.json() == refused("max_new_tokens must be at least 1")
    assert sent == []


@COUNTING
def test_input_plus_max_new_tokens_equal_to_max_total_tokens_is_accepted(prefix_caching):
    response, sent = post({"inputs": prompt_of(5), "parameters": {"max_new_tokens": MAX_TOTAL - 5}},
                          prefix_caching=prefix_caching)
    assert response.status_code == 200, response.text
    assert [r.stopping_parameters.max_new_tokens for r in sent] == [MAX_TOTAL - 5]


@COUNTING
def test_input_plus_max_new_tokens_one_past_max_total_tokens_is_refused(prefix_caching):
    response, sent = post({"inputs": prompt_of(5), "parameters": {"max_new_tokens": MAX_TOTAL - 4}},
                          prefix_caching=prefix_caching)
    assert response.status_code == 422
    assert response.json() == refused(f"`inputs` tokens + `max_new_tokens` must be <= {MAX_TOTAL}. "
                                      f"Given: 5 `inputs` tokens and {MAX_TOTAL - 4} `max_new_tokens`")
    assert sent == []


def test_max_new_tokens_zero_is_refused_and_one_is_accepted():
    zero, _ = post({"inputs": prompt_of(5), "parameters": {"max_new_tokens": 0}})
    one, sent = post({"inputs": prompt_of(5), "parameters": {"max_new_tokens": 1}})
    assert (zero.status_code, zero.json()) == (422, refused("`max_new_tokens` must be strictly positive"))
    assert one.status_code == 200 and [r.stopping_parameters.max_new_tokens for r in sent] == [1]


# ----- max_input_tokens and truncate -----

@COUNTING
def test_a_prompt_of_exactly_max_input_tokens_is_accepted_and_one_more_is_refused(prefix_caching):
    at, sent = post({"inputs": prompt_of(MAX_INPUT), "parameters": {"max_new_tokens": 2}}, prefix_caching=prefix_caching)
    past, _ = post({"inputs": prompt_of(MAX_INPUT + 1), "parameters": {"max_new_tokens": 2}},
                   prefix_caching=prefix_caching)
    assert at.status_code == 200, at.text
    assert at.headers["x-prompt-tokens"] == str(MAX_INPUT) and len(sent) == 1
    assert (past.status_code, past.json()) == (422, refused(f"`inputs` must have less than {MAX_INPUT} tokens. "
                                                            f"Given: {MAX_INPUT + 1}"))


@COUNTING
def test_truncate_equal_to_max_input_tokens_is_accepted_and_counts_only_the_kept_tokens(prefix_caching):
    long = prompt_of(MAX_INPUT + 2)
    response, sent = post({"inputs": long, "parameters": {"truncate": MAX_INPUT, "max_new_tokens": 3}},
                          prefix_caching=prefix_caching)
    assert response.status_code == 200, response.text
    assert response.headers["x-prompt-tokens"] == str(MAX_INPUT)
    assert [(r.truncate, r.stopping_parameters.max_new_tokens) for r in sent] == [(MAX_INPUT, 3)]


def test_truncate_one_past_max_input_tokens_or_zero_is_refused():
    for truncate in (MAX_INPUT + 1, 0):
        response, sent = post({"inputs": prompt_of(5), "parameters": {"truncate": truncate}})
        assert response.status_code == 422
        assert response.json() == refused(f"`truncate` must be strictly positive and less than {MAX_INPUT}. "
                                          f"Given: {truncate}")
        assert sent == []


def test_a_request_without_truncate_reaches_the_shard_untruncated():
    response, sent = post({"inputs": prompt_of(7), "parameters": {"max_new_tokens": 2}})
    assert response.status_code == 200 and [r.truncate for r in sent] == [0]
    assert response.headers["x-prompt-tokens"] == "7"


# ----- top_n_tokens and stop sequences -----

def test_top_n_tokens_equal_to_max_top_n_tokens_is_accepted_and_one_more_is_refused():
    limit = ApiConfig(model_id="x").max_top_n_tokens
    at, sent = post({"inputs": prompt_of(5), "parameters": {"top_n_tokens": limit, "max_new_tokens": 2}})
    past, none_sent = post({"inputs": prompt_of(5), "parameters": {"top_n_tokens": limit + 1}})
    assert at.status_code == 200 and [r.top_n_tokens for r in sent] == [limit]
    assert (past.status_code, past.json()) == (422, refused(f"`top_n_tokens` must be >= 0 and <= {limit}. "
                                                            f"Given: {limit + 1}"))
    assert none_sent == []


def test_a_request_without_top_n_tokens_asks_for_none():
    response, sent = post({"inputs": prompt_of(5), "parameters": {"max_new_tokens": 2}})
    assert response.status_code == 200 and [r.top_n_tokens for r in sent] == [0]


def test_as_many_stop_sequences_as_allowed_are_sent_and_one_more_is_refused():
    limit = ApiConfig(model_id="x").max_stop_sequences
    stops = [f"s{i}" for i in range(limit + 1)]
    at, sent = post({"inputs": prompt_of(5), "parameters": {"stop": stops[:limit], "max_new_tokens": 2}})
    past, _ = post({"inputs": prompt_of(5), "parameters": {"stop": stops}})
    assert at.status_code == 200 and [list(r.stopping_parameters.stop_sequences) for r in sent] == [stops[:limit]]
    assert (past.status_code, past.json()) == (422, refused(f"`stop` supports up to {limit} stop sequences. "
                                                            f"Given: {limit + 1}"))


# ----- sampling parameters: what reaches the shard, and each range at its edges -----

def test_parameters_left_out_reach_the_shard_as_tgis_defaults():
    response, sent = post({"inputs": prompt_of(5), "parameters": {"max_new_tokens": 2}})
    assert response.status_code == 200
    (request,) = sent
    p = request.parameters
    assert (p.temperature, p.top_k, p.top_p, p.typical_p, p.repetition_penalty, p.frequency_penalty, p.do_sample,
            p.watermark) == (1.0, 0, 1.0, 1.0, 1.0, 0.0, False, False)
    assert (list(request.stopping_parameters.stop_sequences), request.prefill_logprobs, request.top_n_tokens) == (
        [], False, 0)


def test_parameters_given_reach_the_shard_as_given():
    parameters = {"temperature": 0.5, "top_k": 3, "top_p": 0.75, "typical_p": 0.25, "repetition_penalty": 1.5,
                  "frequency_penalty": -0.5, "do_sample": True, "seed": 42, "watermark": True, "max_new_tokens": 2,
                  "decoder_input_details": True, "top_n_tokens": 2}
    response, sent = post({"inputs": prompt_of(5), "parameters": parameters})
    assert response.status_code == 200, response.text
    (request,) = sent
    p = request.parameters
    assert (p.temperature, p.top_k, p.top_p, p.typical_p, p.repetition_penalty, p.frequency_penalty, p.do_sample,
            p.seed, p.watermark) == (0.5, 3, 0.75, 0.25, 1.5, -0.5, True, 42, True)
    assert (request.prefill_logprobs, request.top_n_tokens) == (True, 2)
    assert response.json()["details"]["seed"] == 42  # decoder_input_details implies details, as in TGI


def test_details_are_returned_only_when_asked_for():
    plain, _ = post({"inputs": prompt_of(5), "parameters": {"max_new_tokens": 2}})
    detailed, _ = post({"inputs": prompt_of(5), "parameters": {"max_new_tokens": 2, "details": True}})
    assert "details" not in plain.json()
    assert detailed.json()["details"]["generated_tokens"] == 1


EDGES = [
    # (parameters, TGI's message when refused, or None when accepted)
    ({"temperature": 0.0}, "`temperature` must be strictly positive"),
    ({"temperature": 1e-6}, None),
    ({"repetition_penalty": 0.0}, "`repetition_penalty` must be strictly positive"),
    ({"repetition_penalty": 1e-6}, None),
    ({"frequency_penalty": -2.0}, None),
    ({"frequency_penalty": 2.0}, None),
    ({"frequency_penalty": -2.001}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"frequency_penalty": 2.001}, "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"top_p": 0.0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"top_p": 0.999}, None),
    ({"typical_p": 1.0}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"typical_p": 0.0}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"typical_p": 0.001}, None),
    ({"top_k": 0}, "`top_k` must be strictly positive"),
    ({"top_k": 1}, None),
    ({"best_of": 1}, None),
    ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
    ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),  # --max-best-of 2 (TGI's)
    ({"best_of": 2, "top_k": 5, "seed": 1}, "`seed` must not be set when `best_of` > 1"),  # top_k alone samples
]


@pytest.mark.parametrize(("parameters", "message"), EDGES, ids=[str(p) for p, _ in EDGES])
def test_each_parameter_range_at_its_edges(parameters, message):
    response, sent = post({"inputs": prompt_of(5), "parameters": {"max_new_tokens": 2, **parameters}})
    if message is None:
        assert response.status_code == 200, response.text
        assert len(sent) == 1
    else:
        assert (response.status_code, response.json()) == (422, refused(message))
        assert sent == []


def test_an_empty_prompt_is_refused():
    response, sent = post({"inputs": "", "parameters": {"max_new_tokens": 2}})
    assert (response.status_code, response.json(), sent) == (422, refused("`inputs` cannot be empty"), [])


def test_streaming_refuses_best_of_and_decoder_input_details_as_an_event():
    for parameters, message in (({"best_of": 2, "do_sample": True}, "`best_of` != 1 is not supported when streaming "
                                 "tokens"),
                                ({"decoder_input_details": True}, "`decoder_input_details` == true is not supported "
                                 "when streaming tokens")):
        response, sent = post({"inputs": prompt_of(5), "parameters": {"max_new_tokens": 2, **parameters}},
                              path="/generate_stream")
        assert response.status_code == 200 and sent == []
        assert response.text == "data: " + json.dumps(refused(message), separators=(",", ":")) + "\n\n"


@COUNTING
def test_a_prompt_the_shard_could_not_count_is_a_422_with_the_counters_reason_without_its_request_prefix(
        prefix_caching):
    """The counter runs the shard's own intake and names the request ("request 0: ..."); the client's error
    says what was wrong with its input only, as TGI's does."""
    not_an_image = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    response, sent = post({"inputs": f"Look ![]({not_an_image}) here", "parameters": {"max_new_tokens": 2}},
                          prefix_caching=prefix_caching, arch="qwen2_vl")
    assert response.status_code == 422 and sent == []
    assert response.json()["error_type"] == "validation"
    assert re.fullmatch(r"Input validation error: image 0: cannot decode image: cannot identify image file .*",
                        response.json()["error"])


def test_return_full_text_puts_the_prompt_before_the_generated_text():
    full, _ = post({"inputs": prompt_of(5), "parameters": {"max_new_tokens": 2, "return_full_text": True}})
    plain, _ = post({"inputs": prompt_of(5), "parameters": {"max_new_tokens": 2}})
    assert (full.json()["generated_text"], plain.json()["generated_text"]) == (prompt_of(5) + "x", "x")


@COUNTING
def test_a_request_is_tokenized_once_between_validation_and_the_router(prefix_caching, monkeypatch):
    """With prefix caching the validator's ids and images go to the router (it keys its cache on them), else
    the bare count does: either way the processor runs once per request."""
    text = prompt_of(5)  # (counted here, before the count of calls starts)
    calls: list[str] = []
    for name in ("tokenize", "input_ids"):
        real = getattr(counter(), name)
        monkeypatch.setattr(counter(), name, lambda request, real=real, name=name: calls.append(name) or real(request))
    response, _ = post({"inputs": text, "parameters": {"max_new_tokens": 2}}, prefix_caching=prefix_caching)
    assert response.status_code == 200 and response.headers["x-prompt-tokens"] == "5"
    assert calls == (["tokenize"] if prefix_caching else ["input_ids"])


# ----- seeds -----

def test_a_sampling_request_without_a_seed_gets_a_fresh_random_one_and_a_given_seed_is_kept():
    """TGI draws a random 64-bit seed for every sampling request that names none (so two such requests do not
    sample alike) and reports it in `details.seed`; a given seed reaches the shard unchanged."""

    async def scenario():
        async with serving(True) as (client, shard):
            bodies = [{"inputs": prompt_of(4), "parameters": {"do_sample": True, "details": True, "max_new_tokens": 1}}
                      for _ in range(2)]
            bodies.append({"inputs": prompt_of(4), "parameters": {"do_sample": True, "details": True, "seed": 5,
                                                                   "max_new_tokens": 1}})
            responses = [await client.post("/generate", json=body) for body in bodies]
            return responses, shard.requests

    responses, sent = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [200, 200, 200]
    seeds = [r.parameters.seed for r in sent]
    assert seeds[2] == 5
    assert seeds[0] != seeds[1] and 0 < seeds[0] < 2 ** 64 and 0 < seeds[1] < 2 ** 64
    assert [r.json()["details"]["seed"] for r in responses] == seeds
