"""Speculative decoding: who proposes draft tokens, and the rule that accepts them.

Drafting (`Drafter`): a decoding sequence may feed its last token plus up to N draft tokens in one
forward; the step builder only knows "k query rows for this sequence". `NgramDrafter` is prompt
lookup over the request's own ids (prompt and generated): the longest suffix of 3, 2 or 1 tokens
that occurred earlier, most recent occurrence first, proposes the tokens that followed it; no match
means no draft (the sequence feeds one row, as without speculation). Model-based drafters
(Medusa/MLP-speculator heads, EAGLE) implement the same `propose`.

Acceptance (exact, for greedy AND sampling): row i of a verified run is chosen exactly as a
non-speculative step would choose it — the same processors over the same history (prompt +
everything accepted so far), the request's own generator drawing once per emitted token. Draft
i+1 is accepted only if it equals the token chosen from row i. So the emitted tokens are the ones a
run without speculation emits, token for token and, for seeded sampling, draw for draw; drafts only
change how many forwards it takes. (Rejection-sampling speculative decoding would preserve only the
distribution, not the seeded tokens; with a drafter that has no probabilities of its own, this rule
loses nothing.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Drafter(Protocol):
    def propose(self, ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens likely to follow `ids` (may be empty)."""


class NgramDrafter:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, ids: Sequence[int], max_tokens: int) -> list[int]:
        if max_tokens <= 0:
            return []
        for n in range(min(self.max_ngram, len(ids) - 1), self.min_ngram - 1, -1):
            suffix = list(ids[-n:])
            # Most recent earlier occurrence of the suffix that has at least one token after it.
            for start in range(len(ids) - n - 1, -1, -1):
                if list(ids[start : start + n]) == suffix:
                    return list(ids[start + n : start + n + max_tokens])
        return []


def accepts(draft: Sequence[int], level: int, chosen: int) -> bool:
    """After choosing `chosen` from row `level`, is the next draft row's input that same token?"""
    return level < len(draft) and draft[level] == chosen
