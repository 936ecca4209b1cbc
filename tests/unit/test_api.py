"""The HTTP front end's pieces that need no shard: markdown images, error mapping, metric names,
chat templating, request bodies, and the guards in front of the routes."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException

from tgi_vlm.api.chat import ChatTemplate
from tgi_vlm.api.errors import ApiError
from tgi_vlm.api.guards import Guards
from tgi_vlm.api.images import FetchLimits, ImageResolver, decode_data_uri, split_markdown
from tgi_vlm.api.infer import own_reason, request_error
from tgi_vlm.api.metrics import CounterSet
from tgi_vlm.api.schemas import ChatMessage, ChatRequest, CompletionRequest, GenerateRequest
from tgi_vlm.media import MediaKind
from tgi_vlm.router.requests import FinalEvent

IMAGE, VIDEO = MediaKind.IMAGE, MediaKind.VIDEO


def test_markdown_images_split_the_prompt_in_order_without_empty_text():
    assert split_markdown("![](a.png)Describe ![](data:x;base64,AA) and ![](b)") == [
        ("a.png", IMAGE), "Describe ", ("data:x;base64,AA", IMAGE), " and ", ("b", IMAGE)]
    assert split_markdown("no images ![alt](x.png) here") == ["no images ![alt](x.png) here"]  # TGI: empty alt only


def test_a_clip_is_markdown_with_the_alt_text_video():
    assert split_markdown("Watch ![video](data:video/mp4;base64,AA) then ![](i.png)") == [
        "Watch ", ("data:video/mp4;base64,AA", VIDEO), " then ", ("i.png", IMAGE)]


def test_a_clip_for_a_model_without_video_is_a_422_before_anything_is_fetched():
    resolver = ImageResolver(FetchLimits(1000, 1.0))
    with pytest.raises(ApiError) as info:
        asyncio.run(resolver.chunks("see ![video](https://example.invalid/clip.mp4)", (IMAGE,)))
    assert info.value.status == 422 and "this model takes no video inputs; it takes: image" in str(info.value)


def test_a_chat_video_url_part_becomes_video_markdown():
    message = ChatMessage.model_validate({"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AA"}}, {"type": "text", "text": "What?"}]})
    assert message.text() == "![video](data:video/mp4;base64,AA)What?"


def test_data_uris_decode_or_say_what_is_wrong():
    assert decode_data_uri("data:image/png;base64," + base64.b64encode(b"\x89PNG").decode()) == b"\x89PNG"
    with pytest.raises(ApiError, match="invalid image content: image/png,AAAA"):
        decode_data_uri("data:image/png,AAAA")
    with pytest.raises(ApiError, match="base64 encoding is invalid"):
        decode_data_uri("data:image/png;base64,@@@")


def test_a_failed_request_keeps_only_its_own_part_of_a_batch_wide_shard_message():
    message = "refused by the shard: request 3: image 1 is corrupt; request 7: top_p 1.5 out of range"
    assert own_reason(message, 7) == "top_p 1.5 out of range"
    assert own_reason(message, 3) == "image 1 is corrupt"
    assert own_reason("Decode failed: UNAVAILABLE: socket closed", 3) == "Decode failed: UNAVAILABLE: socket closed"


def test_refused_requests_are_422_validation_and_failed_ones_424_generation():
    refused = request_error(FinalEvent.failed(7, "refused by the shard: request 7: bad image", refused=True))
    failed = request_error(FinalEvent.failed(7, "Prefill failed: INTERNAL: boom"))
    assert (refused.status, refused.body()) == (422, {"error": "Input validation error: bad image",
                                                      "error_type": "validation"})
    assert (failed.status, failed.body()) == (424, {"error": "Request failed during generation: Prefill failed: "
                                                             "INTERNAL: boom", "error_type": "generation"})


def test_counters_render_under_tgis_bare_names():
    counters = CounterSet({"tgi_request_count": "requests", "tgi_request_failure": "failures"})
    counters.inc("tgi_request_count")
    counters.inc("tgi_request_count")
    counters.inc("tgi_request_failure", err="validation")
    text = generate_latest(counters).decode()
    assert "# TYPE tgi_request_count untyped\ntgi_request_count 2.0\n" in text
    assert 'tgi_request_failure{err="validation"} 1.0' in text


class Tokenizer:
    """Renders like a ChatML template, enough to check what is handed to it."""

    chat_template = "chatml"

    def apply_chat_template(self, conversation, *, chat_template, tokenize, add_generation_prompt):
        assert (chat_template, tokenize, add_generation_prompt) == ("chatml", False, True)
        turns = "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in conversation)
        return turns + "<|assistant|>"


def test_chat_images_become_markdown_before_the_template_and_an_assistant_turn_is_continued():
    messages = [ChatMessage.model_validate({"role": "user", "content": [
        {"type": "text", "text": "What is "}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]})]
    assert ChatTemplate(Tokenizer()).apply(messages) == (
        "<|user|>What is ![](data:image/png;base64,AA)<|end|><|assistant|>")
    messages.append(ChatMessage(role="assistant", content="It is a"))
    assert ChatTemplate(Tokenizer()).apply(messages).endswith("<|assistant|>It is a")


def test_a_model_without_a_chat_template_answers_422_template_error():
    class Plain:
        chat_template = None

    with pytest.raises(ApiError) as error:
        ChatTemplate(Plain(), None).apply([ChatMessage(role="user", content="hi")])
    assert (error.value.status, error.value.error_type) == (422, "template_error")


def test_request_bodies_accept_what_clients_send():
    assert GenerateRequest.model_validate({"inputs": "x"}).parameters.do_sample is True  # TGI: no parameters → sample
    nulls = GenerateRequest.model_validate({"inputs": "x", "parameters": {"do_sample": None, "stop": None, "x": 1}})
    assert (nulls.parameters.do_sample, nulls.parameters.stop) == (False, [])
    chat = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3,
                                       "stop": "END"})
    assert (chat.max_tokens, chat.stop) == (3, ["END"])
    assert CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompts() == ["a", "b"]


def run_guarded(guards: Guards, path: str, headers: dict[str, str], chunks: list[bytes]) -> list[dict]:
    """Call the guards with a request body sent in `chunks`; the inner app reads the body and answers 200."""
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path,
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    asyncio.run(guards(scope, receive, send))
    return sent


async def reading_app(scope, receive, send):
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def test_guards_check_the_bearer_token_on_generation_routes_only():
    guards = Guards(reading_app, api_key="Secret", payload_limit=100)
    assert run_guarded(guards, "/generate", {}, [b"{}"])[0]["status"] == 401
    assert run_guarded(guards, "/generate", {"Authorization": "Bearer nope"}, [b"{}"])[0]["status"] == 401
    assert run_guarded(guards, "/generate", {"Authorization": "bearer secret"}, [b"{}"])[0]["status"] == 200
    assert run_guarded(guards, "/info", {}, [b""])[0]["status"] == 200


def test_guards_refuse_a_body_past_the_limit_by_its_length_or_while_it_streams_in():
    guards = Guards(reading_app, api_key=None, payload_limit=100)
    sent = run_guarded(guards, "/generate", {"Content-Length": "101"}, [b"x" * 101])
    assert sent[0]["status"] == 413 and json.loads(sent[1]["body"])["error_type"] == "payload_limit"
    assert run_guarded(guards, "/generate", {"Content-Length": "100"}, [b"x" * 100])[0]["status"] == 200
    with pytest.raises(HTTPException) as error:  # no Content-Length: counted as it arrives (the app answers 413)
        run_guarded(guards, "/generate", {}, [b"x" * 60, b"x" * 60])
    assert error.value.status_code == 413
