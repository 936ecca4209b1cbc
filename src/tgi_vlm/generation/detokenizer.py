"""Incremental detokenization for streaming, with TGI's prefix/read offsets.

Decoding one token at a time breaks in two ways: byte-level BPE splits a multi-byte character
across tokens (each half decodes to U+FFFD), and SentencePiece decodes a token's leading space
differently without context. So each step decodes `ids[prefix:read]` and `ids[prefix:]` and emits
the difference, holding text back while it ends in U+FFFD (an incomplete character).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_INCOMPLETE = "\ufffd"
# Tokens of prompt context decoded before the first generated token (TGI uses 5).
_PROMPT_CONTEXT = 5


def _decode(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool) -> str:
    # No cleanup: it rewrites " ." style spaces depending on the following token, so the decoded
    # prefix would not be stable from one step to the next.
    return tokenizer.decode(
        list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


class IncrementalDetokenizer:
    """Turns one request's growing token list into text deltas; one instance per request.

    Invariant: text for `ids[:read_offset]` has been emitted; `ids[prefix_offset:read_offset]` is
    the context the next delta is measured against.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prompt_ids = list(prompt_ids)
        self.prefix_offset = max(len(self.prompt_ids) - _PROMPT_CONTEXT, 0)
        self.read_offset = len(self.prompt_ids)

    def step(self, all_ids: Sequence[int]) -> str:
        """all_ids = prompt + every generated id so far → the new complete text ("" if none yet)."""
        prefix_text = _decode(
            self.tokenizer, all_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens
        )
        text = _decode(self.tokenizer, all_ids[self.prefix_offset :], self.skip_special_tokens)
        if len(text) <= len(prefix_text) or text.endswith(_INCOMPLETE):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(all_ids)
        return text[len(prefix_text) :]

    def full_text(self, generated_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The whole generated text (for GeneratedText; TGI skips special tokens there).

        The last prompt token is decoded along as context so a leading space survives, as in TGI.
        """
        if not generated_ids:
            return ""
        context = self.prompt_ids[-1:]
        prefix_text = _decode(self.tokenizer, context, skip_special_tokens)
        text = _decode(self.tokenizer, [*context, *generated_ids], skip_special_tokens)
        if prefix_text and text.startswith(prefix_text):
            return text[len(prefix_text) :]
        return _decode(self.tokenizer, generated_ids, skip_special_tokens)


def token_text(tokenizer: Any, token_id: int) -> str:
    """One token's own text (special tokens kept), for per-token `texts` and top-n entries."""
    return _decode(tokenizer, [token_id], skip_special_tokens=False)


def token_texts(tokenizer: Any, token_ids: Sequence[int]) -> list[str]:
    """`token_text` for many ids in one tokenizer call (prefill tokens, top-n lists)."""
    return tokenizer.batch_decode(
        [[i] for i in token_ids], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
