"""Chat messages → prompt text, TGI's way (router/src/infer/chat_template.rs).

Each message's content becomes one string, images as markdown `![](url)` in place, before the
model's chat template (`launch --chat-template FILE`, else the tokenizer's, else the processor's) is
applied with `add_generation_prompt=True`. The markdown images are then loaded like any /generate
input. When the last message is the assistant's, the prompt stops at the end of its content
(continuation).

Tools, as TGI: a template that reads a `tools` variable gets them (OpenAI's shape) and the last
message gets `\\n---\\n` and the tool prompt appended; a template that does not gets the tools' JSON
and the prompt appended to the last message instead.
"""

from __future__ import annotations

import json
from typing import Any

import jinja2
from jinja2 import meta

from tgi_vlm.api.errors import template_error
from tgi_vlm.api.schemas import ChatMessage
from tgi_vlm.api.tools import ToolPlan, message_for_template, template_tools


class ChatTemplate:
    def __init__(self, tokenizer: Any, processor: Any = None, template: str | None = None):
        self.tokenizer = tokenizer
        self.template: str | None = (template or getattr(tokenizer, "chat_template", None)
                                     or getattr(processor, "chat_template", None))
        self.takes_tools = self.template is not None and "tools" in _variables(self.template)

    def apply(self, messages: list[ChatMessage], tools: ToolPlan | None = None, tool_prompt: str | None = None) -> str:
        if self.template is None:
            raise template_error("template not found (the model has no chat template; use /generate, "
                                 "or start the server with --chat-template FILE)")
        conversation = [message_for_template(m, self.takes_tools) for m in messages]
        extra: dict[str, Any] = {}
        if tools is not None:
            offered = template_tools(tools.tools)
            if self.takes_tools:
                extra["tools"] = offered
                conversation[-1]["content"] += f"\n---\n{tools.prompt(tool_prompt)}"
            else:
                conversation[-1]["content"] += f"\n---\n{json.dumps(offered)}\n{tools.prompt(tool_prompt)}"
        try:
            rendered = self.tokenizer.apply_chat_template(conversation, chat_template=self.template, tokenize=False,
                                                          add_generation_prompt=True, **extra)
        except Exception as exc:  # noqa: BLE001 - jinja's errors (raise_exception in templates, syntax)
            raise template_error(f"{type(exc).__name__}: {exc}") from None
        last = conversation[-1]
        if last["role"] == "assistant" and last["content"] and tools is None:
            cut = rendered.rfind(last["content"])
            if cut >= 0:
                rendered = rendered[: cut + len(last["content"])].rstrip()
        return rendered


def _variables(template: str) -> set[str]:
    try:
        return meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return set()  # a broken template fails when applied, with jinja's message
