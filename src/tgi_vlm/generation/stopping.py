"""When a request stops, in the order checked: max_new_tokens, an EOS token, a stop sequence in its text."""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum
from typing import Any


class FinishReason(IntEnum):
    """Why a request stopped; the values are TGI's v3 `FinishReason` wire values."""

    LENGTH = 0
    EOS_TOKEN = 1
    STOP_SEQUENCE = 2


class StoppingCriteria:
    """Called once per generated token, in order; `current_tokens` counts the tokens seen.

    Checks run in TGI's order: length, then EOS (unless `ignore_eos`), then stop sequence. A stop sequence
    matches anywhere in the text produced so far (TGI only checks the end of the text, which misses
    a stop string followed by more characters in the same token's text). Only a tail of
    (longest stop sequence - 1) characters is kept between calls: every longer window was already
    searched.
    """

    def __init__(
        self,
        eos_token_ids: Iterable[int],
        max_new_tokens: int,
        stop_sequences: Iterable[str] = (),
        ignore_eos: bool = False,
    ) -> None:
        self.eos_token_ids = set(eos_token_ids)
        self.max_new_tokens = max_new_tokens
        self.stop_sequences = [s for s in stop_sequences if s]  # "" would match every text
        self.ignore_eos = ignore_eos
        self.current_tokens = 0
        self._tail_chars = max((len(s) for s in self.stop_sequences), default=1) - 1
        self._tail = ""

    @classmethod
    def from_params(cls, stopping: Any, eos_token_ids: Iterable[int]) -> StoppingCriteria:
        """From a StoppingCriteriaParameters-like object."""
        return cls(
            eos_token_ids,
            max_new_tokens=stopping.max_new_tokens,
            stop_sequences=list(stopping.stop_sequences),
            ignore_eos=stopping.ignore_eos_token,
        )

    def __call__(self, token_id: int, new_text: str) -> FinishReason | None:
        # TGI's order: the length limit wins over an EOS or stop sequence on the last allowed token.
        self.current_tokens += 1
        if self.current_tokens >= self.max_new_tokens:
            return FinishReason.LENGTH
        if not self.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.EOS_TOKEN
        if self.stop_sequences and self._stop_sequence_found(new_text):
            return FinishReason.STOP_SEQUENCE
        return None

    def _stop_sequence_found(self, new_text: str) -> bool:
        window = self._tail + new_text
        self._tail = window[-self._tail_chars :] if self._tail_chars else ""
        return any(stop in window for stop in self.stop_sequences)
