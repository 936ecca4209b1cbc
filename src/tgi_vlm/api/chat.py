"""Chat messages → prompt text, TGI's way (router/src/infer/chat_template.rs).

Each message's content becomes one string, images as markdown `![](url)` in place, before the
model's chat template (the tokenizer's, else the processor's) is applied with
`add_generation_prompt=True`. The markdown images are then loaded like any /generate input. When
the last message is the assistant's, the prompt stops at the end of its content (continuation).
"""

from __future__ import annotations

from typing import Any

from tgi_vlm.api.errors import template_error
from tgi_vlm.api.schemas import ChatMessage


class ChatTemplate:
    def __init__(self, tokenizer: Any, processor: Any = None):
        self.tokenizer = tokenizer
        self.template: str | None = getattr(tokenizer, "chat_template", None) or getattr(processor, "chat_template", None)

    def apply(self, messages: list[ChatMessage]) -> str:
        if self.template is None:
            raise template_error("template not found (the model has no chat template; use /generate)")
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            rendered = self.tokenizer.apply_chat_template(conversation, chat_template=self.template, tokenize=False,
                                                          add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - jinja's errors (raise_exception in templates, syntax)
            raise template_error(f"{type(exc).__name__}: {exc}") from None
        last = conversation[-1]
        if last["role"] == "assistant" and last["content"]:
            cut = rendered.rfind(last["content"])
            if cut >= 0:
                rendered = rendered[: cut + len(last["content"])].rstrip()
        return rendered
