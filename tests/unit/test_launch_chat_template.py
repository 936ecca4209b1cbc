"""`tgi-vlm launch --chat-template FILE`: the file's template replaces the model's (or supplies one the
model lacks); without one, chat answers TGI's template error naming the way out."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tgi_vlm.api.chat import ChatTemplate
from tgi_vlm.api.errors import ApiError
from tgi_vlm.api.schemas import ChatMessage
from tgi_vlm.cli import app
from tgi_vlm.testing import tiny_model_path

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "


class NoTemplate:
    chat_template = None

    def apply_chat_template(self, conversation, *, chat_template, tokenize, add_generation_prompt):
        from jinja2 import Template

        return Template(chat_template).render(messages=conversation, add_generation_prompt=add_generation_prompt)


def test_launch_reads_the_template_file_into_the_servers_config(tmp_path, monkeypatch):
    seen = {}

    async def fake_launch(config):
        seen["template"] = config.api.chat_template

    monkeypatch.setattr("tgi_vlm.api.launch.launch", fake_launch)
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    result = CliRunner().invoke(app, ["launch", str(tiny_model_path("llama")), "--chat-template", str(path)])
    assert result.exit_code == 0, result.output
    assert seen == {"template": TEMPLATE}


def test_a_template_file_that_cannot_be_read_stops_launch_with_its_name(tmp_path):
    missing = tmp_path / "none.jinja"
    result = CliRunner().invoke(app, ["launch", str(tiny_model_path("llama")), "--chat-template", str(missing)])
    assert result.exit_code != 0 and f"--chat-template {missing}: cannot read it" in result.output


def test_a_model_without_a_template_gets_one_from_the_flag_and_otherwise_a_clear_422():
    messages = [ChatMessage(role="user", content="hi")]
    assert ChatTemplate(NoTemplate(), template=TEMPLATE).apply(messages) == "[user] hi\n[assistant] "
    with pytest.raises(ApiError) as caught:
        ChatTemplate(NoTemplate()).apply(messages)
    assert (caught.value.status, caught.value.error) == (422, "Template error: template not found (the model has no "
                                                              "chat template; use /generate, or start the server "
                                                              "with --chat-template FILE)")
