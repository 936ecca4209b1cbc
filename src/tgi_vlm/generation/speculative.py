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
        """One backward scan (this runs for every decoding sequence at every step): the most recent
        earlier position holding the last token whose preceding tokens match the longest suffix."""
        if max_tokens <= 0 or len(ids) < 2:
            return []
        last, end = ids[-1], len(ids) - 1
        best_n, best_at = 0, -1
        for at in range(end - 1, -1, -1):
            if ids[at] != last:
                continue
            n = 1
            while n < self.max_ngram and at - n >= 0 and ids[at - n] == ids[end - n]:
                n += 1
            if n > best_n:
                best_n, best_at = n, at
                if n == self.max_ngram:
                    break
        if best_n < self.min_ngram:
            return []
        return list(ids[best_at + 1 : best_at + 1 + max_tokens])


def accepts(draft: Sequence[int], level: int, chosen: int) -> bool:
    """After choosing `chosen` from row `level`, is the next draft row's input that same token?"""
    return level < len(draft) and draft[level] == chosen
