"""Chat messages → prompt text, TGI's way (router/src/infer/chat_template.rs).

Each message's content becomes one string, images as markdown `![](url)` in place, before the
model's chat template (`launch --chat-template FILE`, else the tokenizer's, else the processor's) is
applied with `add_generation_prompt=True`. The markdown images are then loaded like any /generate
input. When the last message is the assistant's, the prompt stops at the end of its content
(continuation).

Tools, as TGI: a template that reads a `tools` variable gets them (OpenAI's shape) and the last
message gets `\\n---\\n` and the tool prompt appended; a template that does not gets the tools' JSON
and the prompt appended to the last message instead. Whether a template reads `tools` is found by
parsing it in transformers' own environment (loop controls, `{% generation %}`); a template that
does not parse is logged once and treated as taking none.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tgi_vlm.api.errors import template_error
from tgi_vlm.api.schemas import ChatMessage
from tgi_vlm.api.tools import ToolPlan, message_for_template, template_tools

log = logging.getLogger(__name__)


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


@functools.lru_cache(maxsize=8)
def _variables(template: str) -> frozenset[str]:
    """The variables `template` reads, parsed as transformers compiles it (its environment: loop
    controls, `{% generation %}`); one the parser still refuses reads none, said once per template
    (applying it then fails with jinja's message)."""
    try:
        return frozenset(meta.find_undeclared_variables(_environment(template).parse(template)))
    except jinja2.TemplateError as exc:
        log.warning("the chat template does not parse (%s: %s): it is treated as taking no `tools`",
                    type(exc).__name__, exc)
        return frozenset()


def _environment(template: str) -> jinja2.Environment:
    """transformers' own environment for `template` when its compile function is importable (it
    caches the compiled template, which apply_chat_template then reuses), else an equivalent one."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template(template).environment
    except ImportError:
        pass
    except jinja2.TemplateError:
        raise
    except Exception:  # noqa: BLE001 - a private function whose signature may change: fall back
        log.debug("transformers' chat template compiler is unusable here; parsing with an equivalent environment")
    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                         extensions=[_GenerationTag, jinja2.ext.loopcontrols])


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks the assistant's tokens), for
    parsing only: the block's body is rendered as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)
