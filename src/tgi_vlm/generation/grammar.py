"""Grammar-constrained decoding at run time: one request's matcher state, one batched mask per step.

A request with a grammar owns a `GrammarState` (an llguidance matcher in that grammar, copied from
the compiled grammar's start state at intake). It starts at the first generated token — the prompt
is never matched — and is advanced with every token the request generates (`advance`, called by
`Sequence.append_token`).

Each step, `GrammarMasker.allowed` turns the states of the rows being sampled into one
`[B, V]` bool mask: one bitmask filled for all grammar rows at once (llguidance's thread pool,
GIL released), unpacked on the host and moved to the logits' device. Rows without a grammar are
all True. The chooser applies it after the penalties and before the warpers (TGI's order).

What the mask allows (llguidance, as TGI's outlines FSM did): tokens whose text keeps the output a
prefix of some string of the grammar; never special tokens; EOS only where the output so far is
already a complete match. When no continuation is possible EOS is the only allowed token, so a
grammar request ends with EOS (finish reason EOS_TOKEN) as soon as its grammar is complete.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from enum import IntEnum

import llguidance
import numpy as np
import torch


class GrammarType(IntEnum):
    """`NextTokenChooserParameters.grammar_type`; the values are TGI's v3 wire values."""

    NONE = 0
    JSON = 1  # a JSON Schema (TGI's router compiles schemas to REGEX before they reach a shard)
    REGEX = 2  # matched against the whole output (anchored at both ends), TGI's dialect


class GrammarState:
    """One request's position in its grammar. Lives as long as the request's `Sequence`."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    @property
    def is_complete(self) -> bool:
        """No token but EOS can follow (the grammar is matched and cannot be extended, or it failed)."""
        return self.matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete match: EOS is allowed now."""
        return self.matcher.is_accepting()

    @property
    def error(self) -> str:
        """Why the matcher stopped working (empty when it did not); it then allows only EOS."""
        return self.matcher.get_error()

    def advance(self, token_id: int) -> bool:
        """Consume a generated token; False if the grammar did not allow it (the state then allows only EOS)."""
        return self.matcher.consume_token(token_id)

    def accepted_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (e.g. a speculative draft) the grammar accepts in order from here,
        without advancing: a draft token past that count must never be accepted."""
        return self.matcher.validate_tokens(list(tokens))


class GrammarMasker:
    """Builds one step's allowed-token mask for a batch. One per model (owns llguidance's thread pool).

    The mask is built on the host with numpy (one unpack, no torch ops: torch's intra-op thread
    pool would add a barrier per small op) and moved to the logits' device once, `[B, V]` bool.
    """

    def __init__(self, vocab_size: int, mask_words: int, eos_token_ids: Iterable[int], threads: int) -> None:
        """`vocab_size`: the logits' width; `mask_words`: int32 words per llguidance mask row
        (its vocabulary may be wider than the logits; the extra ids are cut off)."""
        if sys.byteorder != "little":
            raise RuntimeError("token bitmasks are unpacked assuming a little-endian host")
        if mask_words * 32 < vocab_size:
            raise ValueError(f"{mask_words} mask words cannot cover a {vocab_size}-token vocabulary")
        self.vocab_size = vocab_size
        self.words = mask_words
        self.eos_token_ids = sorted(i for i in eos_token_ids if i < vocab_size)
        self.executor = llguidance.LLExecutor(threads)

    def allowed(self, states: Sequence[GrammarState | None], device: torch.device | str) -> torch.Tensor | None:
        """[B, V] bool, True where row i's grammar allows the token; None when no row has a grammar."""
        rows = [i for i, state in enumerate(states) if state is not None]
        if not rows:
            return None
        bitmask = np.empty((len(rows), self.words), dtype=np.int32)  # [G, W]
        jobs = [(states[i].matcher, k) for k, i in enumerate(rows)]
        self.executor.unsafe_compute_mask_ptr(jobs, bitmask.ctypes.data, self.words * 4, len(rows))
        allowed = np.ones((len(states), self.vocab_size), dtype=bool)
        allowed[rows] = self._never_empty(self.unpack(bitmask))
        return torch.from_numpy(allowed).to(device, non_blocking=True)

    def unpack(self, bitmask: np.ndarray) -> np.ndarray:
        """[G, W] int32 bitmask (bit j of word w = token 32w + j) → [G, V] bool."""
        bits = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")  # little-endian words
        return bits[:, : self.vocab_size].astype(bool)

    def _never_empty(self, allowed: np.ndarray) -> np.ndarray:
        """A row with nothing allowed would sample from NaNs; llguidance always allows EOS when it
        allows nothing else, so this only guards the invariant: such a row gets EOS."""
        empty = ~allowed.any(axis=-1)
        if self.eos_token_ids and empty.any():
            allowed[np.ix_(empty.nonzero()[0], self.eos_token_ids)] = True
        return allowed
