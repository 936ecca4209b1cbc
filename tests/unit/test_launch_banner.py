"""`tgi-vlm launch`'s banner suggests only what the model answers: with a chat template, the chat and OpenAI lines;
without one (a GGUF file that carries none), /generate and a note instead of a chat line that would fail."""

from __future__ import annotations

from types import SimpleNamespace

from tgi_vlm.api.launch import banner


def state(template: str | None):
    return SimpleNamespace(
        config=SimpleNamespace(api_key=None, model_id="m.gguf"), takes_images=False,
        router=SimpleNamespace(shard=SimpleNamespace(info=SimpleNamespace(dtype="bfloat16", device_type="cpu"))),
        lengths=SimpleNamespace(max_input_tokens=100, max_total_tokens=200),
        chat_template=SimpleNamespace(template=template))


def test_a_model_with_a_chat_template_is_offered_chat_and_the_openai_sdk():
    text = banner(state("{{ messages }}"), "http://127.0.0.1:3000")
    assert "/v1/chat/completions -H" in text and "OpenAI(base_url=" in text and "/generate -H" in text


def test_a_model_without_a_chat_template_is_offered_generate_and_told_why_not_chat():
    text = banner(state(None), "http://127.0.0.1:3000")
    lines = text.splitlines()
    assert "/generate -H" in text and "/v1/chat/completions -H" not in text and "OpenAI(" not in text
    assert any(line.startswith("  (no chat template in this model") for line in lines)
    assert lines[-2] == "" and lines[-1].startswith("Also: http://127.0.0.1:3000/info")
