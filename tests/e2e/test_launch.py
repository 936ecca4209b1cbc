"""`tgi-vlm launch` on a tiny Qwen2-VL, driven by the clients people use: huggingface_hub's
InferenceClient, the openai SDK, TGI's own `text-generation` client, and plain HTTP.

One launch process serves the module (API key on, 64 concurrent requests, small limits so the
error paths are cheap to reach). The last test kills the shard, so it runs last.
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import socket
import time
from contextlib import AsyncExitStack

import httpx
import pytest
import text_generation
from huggingface_hub import InferenceClient
from huggingface_hub import errors as hub_errors
from openai import OpenAI
from transformers import AutoTokenizer

from tests.conftest import FLOAT32_SHARD_ARGS
from tests.e2e.launching import ImageServer, Launch
from tests.models.video_reference import video_reference
from tests.models.vlm_reference import hf_reference
from tgi_vlm.api.images import split_markdown
from tgi_vlm.media import VideoBytes
from tgi_vlm.testing import make_test_image, png_bytes, tiny_model_path
from tgi_vlm.video import encode_clip, make_test_frames

KEY = "sk-test-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
N = 8  # new tokens per parity request
IMAGE = png_bytes(make_test_image(56, 42, seed=1))
PROMPT = "Describe the picture."
MAX_INPUT, MAX_TOTAL, PAYLOAD_LIMIT, FETCH_LIMIT = 400, 512, 1_000_000, 100_000
TIMEOUT = 120


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def markdown(png: bytes) -> str:
    return f"![]({data_uri(png)})"


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model_path("qwen2_vl"))


@pytest.fixture(scope="module")
def launch(model):
    server = Launch(model, "--max-input-tokens", str(MAX_INPUT), "--max-total-tokens", str(MAX_TOTAL),
                    "--max-batch-prefill-tokens", "1024", "--max-concurrent-requests", "64",
                    "--payload-limit", str(PAYLOAD_LIMIT), "--api-key", KEY,
                    "--max-image-fetch-size", str(FETCH_LIMIT), "--image-fetch-timeout", "1", *FLOAT32_SHARD_ARGS)
    yield server
    assert server.stop() == 0, "".join(server.output[-30:])
    assert "tgi-vlm: stopped\n" in server.output


@pytest.fixture(scope="module")
def images():
    server = ImageServer(IMAGE, big_bytes=2 * FETCH_LIMIT, slow_s=3.0)
    yield server
    server.close()


def post(launch: Launch, path: str, body: dict, headers: dict | None = AUTH) -> httpx.Response:
    return httpx.post(f"{launch.url}{path}", json=body, headers=headers, timeout=TIMEOUT)


def generate(launch: Launch, inputs: str, **parameters) -> dict:
    response = post(launch, "/generate", {"inputs": inputs, "parameters": {"details": True, **parameters}})
    assert response.status_code == 200, response.text
    return response.json()


def ids(details: dict) -> list[int]:
    return [t["id"] for t in details["tokens"]]


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of a server-sent event stream (JSON, or the literal [DONE])."""
    import json

    return [line[5:].strip() if line[5:].strip() == "[DONE]" else json.loads(line[5:])
            for line in response.text.splitlines() if line.startswith("data:")]


def assert_like_transformers(chunks: tuple, got: list[int], finish_reason: str) -> None:
    """transformers' greedy ids (EOS ignored) start with ours; ours stop early only at EOS."""
    reference = hf_reference("qwen2_vl", chunks, N).ids
    assert got == reference[: len(got)]
    assert len(got) == N or finish_reason in ("eos_token", "stop")


# ----- plain HTTP --------------------------------------------------------------------------------

def test_the_banner_names_the_dtype_launch_passed_to_the_shard(launch):
    banner = next(line for line in launch.output if line.startswith("tgi-vlm: serving "))
    assert f" on {launch.url} (float32 on cpu, max_input_tokens {MAX_INPUT}, " in banner, banner


def test_info_health_models_and_metrics_answer_without_a_key(launch, model):
    assert httpx.get(f"{launch.url}/health").status_code == 200
    info = httpx.get(f"{launch.url}/info").json()
    assert list(info) == ["model_id", "model_sha", "model_pipeline_tag", "max_concurrent_requests", "max_best_of",
                          "max_stop_sequences", "max_input_tokens", "max_total_tokens", "validation_workers",
                          "max_client_batch_size", "router", "version", "sha", "docker_label", "media",
                          "lora_adapters"]  # the last two: tgi-vlm's own (media kinds; LoRA adapter ids requests may name)
    assert info["media"] == ["image", "video"]
    assert (info["model_id"], info["model_pipeline_tag"], info["max_concurrent_requests"], info["max_best_of"],
            info["max_input_tokens"], info["max_total_tokens"]) == (model, "image-text-to-text", 64, 2, MAX_INPUT,
                                                                     MAX_TOTAL)
    assert httpx.get(f"{launch.url}/v1/models").json() == {
        "object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": model}]}
    metrics = httpx.get(f"{launch.url}/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    for line in ("# TYPE tgi_request_duration histogram", "# TYPE tgi_queue_size gauge",
                 "# TYPE tgi_batch_current_size gauge", "# TYPE tgi_request_count untyped"):
        assert line in metrics.text


def test_generation_routes_refuse_a_missing_or_wrong_key_with_401(launch):
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 1}}
    for path in ("/generate", "/generate_stream", "/", "/tokenize"):
        assert post(launch, path, body, headers=None).status_code == 401
        assert post(launch, path, body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert post(launch, "/v1/chat/completions", chat, headers=None).status_code == 401
    with pytest.raises(Exception, match="401"):
        OpenAI(base_url=f"{launch.url}/v1", api_key="wrong").chat.completions.create(model="tgi", **chat)


# ----- the same greedy tokens everywhere -------------------------------------------------------

def test_greedy_tokens_are_the_same_on_every_generate_route_and_client_and_equal_transformers(launch):
    inputs = markdown(IMAGE) + PROMPT
    base = generate(launch, inputs, max_new_tokens=N)
    want, text = ids(base["details"]), base["generated_text"]
    assert_like_transformers((IMAGE, PROMPT), want, base["details"]["finish_reason"])

    hub = InferenceClient(base_url=launch.url, api_key=KEY, timeout=TIMEOUT)
    out = hub.text_generation(inputs, max_new_tokens=N, details=True)
    assert ([t.id for t in out.details.tokens], out.generated_text) == (want, text)
    streamed = list(hub.text_generation(inputs, max_new_tokens=N, details=True, stream=True))
    assert [e.token.id for e in streamed] == want
    assert [e.generated_text for e in streamed] == [None] * (len(want) - 1) + [text]
    assert streamed[-1].details.generated_tokens == len(want)

    tgi = text_generation.Client(launch.url, headers=AUTH, timeout=TIMEOUT)
    out = tgi.generate(inputs, max_new_tokens=N)
    assert ([t.id for t in out.details.tokens], out.generated_text) == (want, text)
    streamed = list(tgi.generate_stream(inputs, max_new_tokens=N))
    assert ([e.token.id for e in streamed], streamed[-1].generated_text) == (want, text)

    raw = post(launch, "/generate_stream", {"inputs": inputs, "parameters": {"max_new_tokens": N, "details": True}})
    events = sse_events(raw)
    assert [e["token"]["id"] for e in events] == want
    assert events[-1]["details"]["input_length"] == post(launch, "/tokenize", {"inputs": inputs}).json().__len__()
    completion = post(launch, "/v1/completions", {"prompt": inputs, "max_tokens": N, "temperature": 0}).json()
    assert completion["choices"][0]["text"] == text
    assert completion["usage"]["completion_tokens"] == len(want)


def chat_messages(png: bytes, text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(png)}},
                                         {"type": "text", "text": text}]}]


def test_chat_with_an_image_gives_the_same_tokens_in_both_sdks_streamed_or_not_as_generate_on_the_template(
        launch, model):
    messages = chat_messages(IMAGE, PROMPT)
    # TGI's rule: the image becomes markdown in the message text, then the model's template applies.
    templated = AutoTokenizer.from_pretrained(model).apply_chat_template(
        [{"role": "user", "content": markdown(IMAGE) + PROMPT}], tokenize=False, add_generation_prompt=True)
    base = generate(launch, templated, max_new_tokens=N)
    want = [t["text"] for t in base["details"]["tokens"]]
    chunks = tuple(c if isinstance(c, str) else IMAGE for c in split_markdown(templated))
    assert_like_transformers(chunks, ids(base["details"]), base["details"]["finish_reason"])
    finish = "stop" if base["details"]["finish_reason"] == "eos_token" else base["details"]["finish_reason"]
    prompt_tokens = post(launch, "/generate", {"inputs": templated, "parameters": {"max_new_tokens": 1}}).headers[
        "x-prompt-tokens"]

    openai = OpenAI(base_url=f"{launch.url}/v1", api_key=KEY, timeout=TIMEOUT)
    args = dict(model="tgi", messages=messages, max_tokens=N, temperature=0, logprobs=True, top_logprobs=2)
    out = openai.chat.completions.create(**args)
    choice = out.choices[0]
    assert ([t.token for t in choice.logprobs.content], choice.message.content) == (want, base["generated_text"])
    assert [len(t.top_logprobs) for t in choice.logprobs.content] == [2] * len(want)
    assert (choice.finish_reason, out.usage.prompt_tokens, out.usage.completion_tokens) == (
        finish, int(prompt_tokens), len(want))
    chunks = list(openai.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    tokens = [c.choices[0].logprobs.content[0].token for c in chunks if c.choices]
    assert (tokens, [c.choices[0].finish_reason for c in chunks if c.choices][-1]) == (want, finish)
    assert chunks[-1].usage.completion_tokens == len(want)

    hub = InferenceClient(base_url=launch.url, api_key=KEY, timeout=TIMEOUT)
    out = hub.chat_completion(messages, max_tokens=N, temperature=0, logprobs=True)
    assert [t.token for t in out.choices[0].logprobs.content] == want
    streamed = list(hub.chat_completion(messages, max_tokens=N, temperature=0, logprobs=True, stream=True))
    assert [c.choices[0].logprobs.content[0].token for c in streamed] == want


CLIP = encode_clip(make_test_frames(4, 56, 42, seed=2), 2.0, codec="h264", container="mp4")


def test_a_chat_video_url_gives_transformers_tokens_and_a_bad_clip_is_a_422(launch):
    clip_uri = "data:video/mp4;base64," + base64.b64encode(CLIP).decode()
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": clip_uri}},
                                             {"type": "text", "text": "What happens?"}]}]
    templated = AutoTokenizer.from_pretrained(tiny_model_path("qwen2_vl")).apply_chat_template(
        [{"role": "user", "content": f"![video]({clip_uri})What happens?"}], tokenize=False, add_generation_prompt=True)
    chunks = tuple(c if isinstance(c, str) else VideoBytes(CLIP) for c in split_markdown(templated))
    want = video_reference("qwen2_vl", chunks, N).ids
    generated = generate(launch, templated, max_new_tokens=N, decoder_input_details=False)
    assert ids(generated["details"]) == want[: len(ids(generated["details"]))]
    out = post(launch, "/v1/chat/completions", {"model": "tgi", "messages": messages, "max_tokens": N,
                                                "temperature": 0})
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["message"]["content"] == generated["generated_text"]
    bad = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}]
    refused = post(launch, "/v1/chat/completions", {"model": "tgi", "messages": bad, "max_tokens": 2})
    assert refused.status_code == 422 and refused.json()["error_type"] == "validation"
    assert "video 0: cannot read the container" in refused.json()["error"], refused.json()


def test_the_raw_chat_stream_ends_with_the_literal_done_event_and_echoes_the_model_name(launch):
    response = post(launch, "/v1/chat/completions", {"messages": chat_messages(IMAGE, PROMPT), "max_tokens": 2,
                                                     "temperature": 0, "stream": True, "model": "my-vlm"})
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("data: [DONE]\n\n")
    events = sse_events(response)
    assert [(e["object"], e["model"]) for e in events[:-1]] == [("chat.completion.chunk", "my-vlm")] * (len(events) - 1)


# ----- parameters ---------------------------------------------------------------------------------

def test_generation_parameters_do_what_tgi_documents(launch):
    prompt = "The sea and the sky"
    greedy = generate(launch, prompt, max_new_tokens=N, decoder_input_details=True, top_n_tokens=3)
    details = greedy["details"]
    n_prompt = len(post(launch, "/tokenize", {"inputs": prompt}).json())
    assert [len(p) for p in details["top_tokens"]] == [3] * len(details["tokens"])
    assert [top[0]["id"] for top in details["top_tokens"]] == ids(details)  # greedy picks the most likely
    assert len(details["prefill"]) == n_prompt and details["prefill"][0]["logprob"] is None
    assert details["seed"] is None  # greedy: TGI reports no seed

    full = generate(launch, prompt, max_new_tokens=N, return_full_text=True)
    assert full["generated_text"] == prompt + greedy["generated_text"]
    assert generate(launch, prompt, max_new_tokens=N, truncate=2)["details"]["prefill"] == []

    sampled = [generate(launch, prompt, max_new_tokens=N, do_sample=True, seed=42, top_k=20, temperature=0.9)
               for _ in range(2)]
    assert sampled[0]["details"]["seed"] == 42 and sampled[0]["generated_text"] == sampled[1]["generated_text"]

    stop = greedy["generated_text"][:3]  # stops at the token that completes it: a prefix of the greedy ids
    assert stop, greedy
    stopped = generate(launch, prompt, max_new_tokens=N, stop=[stop])
    assert stopped["details"]["finish_reason"] == "stop_sequence"
    assert ids(stopped["details"]) == ids(details)[: len(stopped["details"]["tokens"])]


def test_compat_route_returns_a_list_and_streams_on_request(launch):
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 3}}
    plain = post(launch, "/", body).json()
    assert isinstance(plain, list) and len(plain) == 1 and set(plain[0]) == {"generated_text"}
    streamed = sse_events(post(launch, "/", {**body, "stream": True}))
    assert streamed[-1]["generated_text"] == plain[0]["generated_text"]


# ----- errors --------------------------------------------------------------------------------------

VALIDATION = [
    ({"temperature": 0.0}, "`temperature` must be strictly positive"),
    ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"top_k": 0}, "`top_k` must be strictly positive"),
    ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"repetition_penalty": 0.0}, "`repetition_penalty` must be strictly positive"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
    ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ({"truncate": MAX_INPUT + 1}, f"`truncate` must be strictly positive and less than {MAX_INPUT}. Given: 401"),
    ({"max_new_tokens": MAX_TOTAL}, f"`inputs` tokens + `max_new_tokens` must be <= {MAX_TOTAL}. "
                                    f"Given: 1 `inputs` tokens and {MAX_TOTAL} `max_new_tokens`"),
    ({"best_of": 3, "do_sample": True}, "`best_of` must be > 0 and <= 2. Given: 3"),
    ({"grammar": {"type": "regex", "value": ""}}, "grammar of type `regex` needs a non-empty string `value`"),
    ({"grammar": {"type": "yaml", "value": "a"}}, "unknown grammar type 'yaml': use `json`, `json_schema` or `regex`"),
]


@pytest.mark.parametrize(("parameters", "message"), VALIDATION)
def test_invalid_parameters_are_422_with_tgi_validation_body(launch, parameters, message):
    response = post(launch, "/generate", {"inputs": "a", "parameters": parameters})
    assert (response.status_code, response.json()) == (
        422, {"error": f"Input validation error: {message}", "error_type": "validation"})


PHONE = r"\d{3}-\d{4}"
SCHEMA = {"type": "object", "properties": {"animal": {"type": "string", "enum": ["cat", "dog"]},
                                           "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
          "required": ["animal", "legs"], "additionalProperties": False}


def test_a_regex_grammar_shapes_generate_output(launch):
    import re

    out = generate(launch, "Phone number?", max_new_tokens=30, grammar={"type": "regex", "value": PHONE})
    assert re.fullmatch(PHONE, out["generated_text"]), out["generated_text"]
    assert out["details"]["finish_reason"] == "eos_token"


@pytest.mark.parametrize("response_format", [
    {"type": "json_object", "value": SCHEMA},  # TGI's shape
    {"type": "json_schema", "json_schema": {"name": "animal", "schema": SCHEMA}},  # OpenAI's shape
], ids=["tgi", "openai"])
def test_chat_response_format_gives_json_that_validates(launch, response_format):
    import json

    import jsonschema

    body = {"model": "tgi", "messages": [{"role": "user", "content": "Which animal? Answer in JSON."}],
            "max_tokens": 60, "response_format": response_format}
    response = post(launch, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), SCHEMA)


def test_a_grammar_the_shard_cannot_compile_is_a_422_naming_the_problem(launch):
    response = post(launch, "/generate", {"inputs": "a", "parameters": {"grammar": {"type": "regex", "value": "(a"}}})
    assert response.status_code == 422, response.text
    assert response.json()["error_type"] == "validation"


def test_validation_errors_reach_each_client_as_its_validation_error(launch):
    with pytest.raises(text_generation.errors.ValidationError, match="`inputs` tokens"):
        text_generation.Client(launch.url, headers=AUTH, timeout=TIMEOUT).generate("hi", max_new_tokens=MAX_TOTAL)
    with pytest.raises(hub_errors.ValidationError, match="`inputs` cannot be empty"):
        InferenceClient(base_url=launch.url, api_key=KEY).text_generation("", max_new_tokens=2)
    too_long = post(launch, "/generate", {"inputs": "a " * (MAX_INPUT + 20), "parameters": {"max_new_tokens": 1}})
    assert too_long.status_code == 422 and "`inputs` must have less than 400 tokens" in too_long.json()["error"]
    bad_body = post(launch, "/generate", {"inputs": "a", "parameters": {"max_new_tokens": -1}})
    assert bad_body.status_code == 422 and bad_body.json()["error_type"] == "validation"


def test_streams_report_errors_as_events_as_tgi_does(launch):
    events = sse_events(post(launch, "/generate_stream", {"inputs": "a", "parameters": {"temperature": 0.0}}))
    assert events == [{"error": "Input validation error: `temperature` must be strictly positive",
                       "error_type": "validation"}]
    events = sse_events(post(launch, "/generate_stream", {"inputs": "a", "parameters": {"decoder_input_details": True}}))
    assert events[0]["error"].endswith("`decoder_input_details` == true is not supported when streaming tokens")
    chat = {"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5, "stream": True}
    assert sse_events(post(launch, "/v1/chat/completions", chat)) == [
        {"error": {"message": "Input validation error: `top_p` must be > 0.0 and < 1.0", "http_status_code": 422}},
        "[DONE]"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_image_urls_are_fetched_within_limits_and_refused_clearly_otherwise(launch, images):
    by_url = generate(launch, f"![]({images.url}/ok.png){PROMPT}", max_new_tokens=3)
    assert ids(by_url["details"]) == ids(generate(launch, markdown(IMAGE) + PROMPT, max_new_tokens=3)["details"])
    gone = closed_port()
    cases = {
        f"{images.url}/missing.png": f"Could not fetch image: {images.url}/missing.png answered HTTP 404",
        f"{images.url}/big": f"Image size {2 * FETCH_LIMIT} bytes exceeds maximum allowed size of {FETCH_LIMIT} bytes",
        f"{images.url}/slow": f"Could not fetch image: {images.url}/slow did not answer within 1 s",
        f"http://127.0.0.1:{gone}/a.png": f"Could not fetch image: http://127.0.0.1:{gone}/a.png: ConnectError",
        "file:///etc/passwd": "invalid image content: file:///etc/passwd (expected a data: URI or an http(s) URL)",
        "data:image/png;base64,not base64!": "base64 encoding is invalid",
    }
    for url, message in cases.items():
        response = post(launch, "/generate", {"inputs": f"![]({url}) what?", "parameters": {"max_new_tokens": 2}})
        assert response.status_code == 422 and response.json()["error_type"] == "validation", url
        assert response.json()["error"].startswith(f"Input validation error: {message}"), response.json()
    not_an_image = post(launch, "/generate", {"inputs": markdown(b"GIF89a broken") + "x"})
    assert not_an_image.status_code == 422 and not_an_image.json()["error_type"] == "validation"


def test_a_body_past_the_payload_limit_is_413_with_or_without_a_content_length(launch):
    expected = {"error": f"Failed to buffer the request body: length limit exceeded ({PAYLOAD_LIMIT} bytes, "
                         "--payload-limit)", "error_type": "payload_limit"}
    response = post(launch, "/generate", {"inputs": "a" * PAYLOAD_LIMIT})
    assert (response.status_code, response.json()) == (413, expected)
    body = b'{"inputs": "' + b"a" * PAYLOAD_LIMIT + b'"}'
    chunked = httpx.post(f"{launch.url}/generate", headers=AUTH, timeout=TIMEOUT,
                         content=(body[i: i + 65536] for i in range(0, len(body), 65536)))  # no Content-Length
    assert (chunked.status_code, chunked.json()) == (413, expected)


# ----- load, cancellation, overload ---------------------------------------------------------------

def test_a_client_that_disconnects_mid_stream_frees_its_request(launch):
    before = launch.metrics()
    total = before["tgi_vlm_kv_blocks_total"]
    with httpx.stream("POST", f"{launch.url}/generate_stream", headers=AUTH, timeout=TIMEOUT,
                      json={"inputs": markdown(IMAGE) + PROMPT, "parameters": {"max_new_tokens": 300}}) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert '"generated_text":null' in first
        assert launch.metrics()["tgi_vlm_kv_blocks_free"] < total  # held while it runs
    after = launch.wait_for_metric("tgi_vlm_kv_blocks_free", total)
    assert after["tgi_vlm_kv_blocks_free"] == total
    assert after["tgi_vlm_request_cancelled"] == before["tgi_vlm_request_cancelled"] + 1


def test_a_client_that_gives_up_on_a_non_streaming_request_cancels_it(launch):
    before = launch.metrics()
    # A grammar that allows EOS only after 4000 characters keeps the request busy for all its 400 tokens
    # (hundreds of steps), so giving up after 0.3 s always happens mid-generation, on a fast machine too.
    busy = {"max_new_tokens": 400, "grammar": {"type": "regex", "value": "[a-z ]{4000}"}}
    with pytest.raises(httpx.ReadTimeout):  # httpx closes the connection when it gives up
        httpx.post(f"{launch.url}/generate", headers=AUTH, timeout=httpx.Timeout(30, read=0.3),
                   json={"inputs": markdown(IMAGE) + PROMPT, "parameters": busy})
    after = launch.wait_for_metric("tgi_vlm_request_cancelled", before["tgi_vlm_request_cancelled"] + 1)
    assert after["tgi_vlm_request_cancelled"] == before["tgi_vlm_request_cancelled"] + 1
    assert launch.wait_for_metric("tgi_vlm_kv_blocks_free", after["tgi_vlm_kv_blocks_total"])[
        "tgi_vlm_kv_blocks_free"] == after["tgi_vlm_kv_blocks_total"]


def test_past_max_concurrent_requests_new_requests_are_429_and_64_disconnects_free_everything(launch):
    prompt = {"inputs": "count the stars one by one", "parameters": {"max_new_tokens": 200}}
    solo = generate(launch, prompt["inputs"], max_new_tokens=40)
    assert solo["details"]["finish_reason"] == "length", "pick a prompt whose greedy output runs 40 tokens"
    before = launch.metrics()

    async def scenario():
        async with AsyncExitStack() as stack:
            client = await stack.enter_async_context(httpx.AsyncClient(headers=AUTH, timeout=TIMEOUT))

            readers = []  # kept referenced: a line iterator collected unfinished closes its connection

            async def open_stream():
                response = await stack.enter_async_context(client.stream("POST", f"{launch.url}/generate_stream",
                                                                         json=prompt))
                readers.append(lines := response.aiter_lines())
                async for line in lines:
                    if line.startswith("data:"):
                        return line

            firsts = await asyncio.gather(*[open_stream() for _ in range(64)])
            assert all('"generated_text":null' in line for line in firsts)  # all 64 still running
            refused = await client.post(f"{launch.url}/generate", json=prompt)
            refused_stream = await client.post(f"{launch.url}/generate_stream", json=prompt)
            return refused, refused_stream

    refused, refused_stream = asyncio.run(scenario())
    assert (refused.status_code, refused.json()) == (429, {"error": "Model is overloaded", "error_type": "overloaded"})
    assert sse_events(refused_stream) == [{"error": "Model is overloaded", "error_type": "overloaded"}]
    after = launch.wait_for_metric("tgi_vlm_kv_blocks_free", before["tgi_vlm_kv_blocks_total"])
    assert after["tgi_vlm_kv_blocks_free"] == after["tgi_vlm_kv_blocks_total"]
    assert after["tgi_vlm_request_cancelled"] == before["tgi_vlm_request_cancelled"] + 64
    assert after['tgi_request_failure{err="overloaded"}'] == before.get('tgi_request_failure{err="overloaded"}', 0) + 2


def test_64_concurrent_streaming_clients_with_images_get_their_solo_outputs(launch):
    distinct = [(png_bytes(make_test_image(28 + 4 * k, 56 - 2 * k, seed=100 + k)), f"picture {k}: what is it?")
                for k in range(8)]
    client = text_generation.AsyncClient(launch.url, headers=AUTH, timeout=TIMEOUT)

    async def stream(k: int) -> list[int]:
        png, text = distinct[k]
        return [r.token.id async for r in client.generate_stream(markdown(png) + text, max_new_tokens=6)]

    async def scenario():
        solo = [await stream(k) for k in range(len(distinct))]
        together = await asyncio.gather(*[stream(i % len(distinct)) for i in range(64)])
        return solo, together

    started = time.perf_counter()
    solo, together = asyncio.run(scenario())
    assert together == [solo[i % len(distinct)] for i in range(64)], f"after {time.perf_counter() - started:.1f} s"
    assert launch.wait_for_metric("tgi_vlm_kv_blocks_free", launch.metrics()["tgi_vlm_kv_blocks_total"])[
        "tgi_batch_current_size"] == 0


def test_metrics_count_requests_successes_and_failures_under_tgi_names(launch):
    before = launch.metrics()
    generate(launch, "hi", max_new_tokens=2)
    post(launch, "/generate", {"inputs": "hi", "parameters": {"top_k": -1}})
    after = launch.metrics()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in (
        "tgi_request_count", "tgi_request_success", 'tgi_request_failure{err="validation"}',
        "tgi_request_duration_count", "tgi_request_generated_tokens_sum")}
    assert delta == {"tgi_request_count": 2, "tgi_request_success": 1, 'tgi_request_failure{err="validation"}': 1,
                     "tgi_request_duration_count": 1, "tgi_request_generated_tokens_sum": 2}
    assert after['tgi_batch_inference_count{method="decode"}'] > before['tgi_batch_inference_count{method="decode"}']


def test_bench_url_sends_its_workload_over_http_and_times_every_token(launch, model, tmp_path):
    from typer.testing import CliRunner

    from tgi_vlm.cli import app

    result = CliRunner().invoke(app, ["bench", model, "--url", launch.url, "--api-key", KEY, "--no-ignore-eos",
                                      "--no-hf", "--num-requests", "4", "--concurrency", "2", "--image-min", "28", "--image-max", "56",
                                      "--prompt-max", "24", "--output-min", "2", "--output-max", "4",
                                      "--out-dir", str(tmp_path), "--name", "http"])
    assert result.exit_code == 0, result.output
    report = __import__("json").loads((tmp_path / "http.json").read_text())
    assert report["serving"]["failed"] == 0 and report["transport"] == f"HTTP {launch.url}"
    assert report["serving"]["ttft_s"]["p50"] > 0 and report["serving"]["itl_s"]["p50"] > 0


# ----- last: the shard dies -----------------------------------------------------------------------

def test_zz_when_the_shard_dies_requests_are_424_and_health_is_503(launch):
    os.kill(launch.shard_pid(), signal.SIGKILL)
    response = post(launch, "/generate", {"inputs": "hello", "parameters": {"max_new_tokens": 2}})
    assert response.status_code == 424
    body = response.json()
    assert body["error_type"] == "generation" and body["error"].startswith("Request failed during generation: ")
    health = httpx.get(f"{launch.url}/health", timeout=TIMEOUT)
    assert (health.status_code, health.json()) == (503, {"error": "unhealthy", "error_type": "healthcheck"})
