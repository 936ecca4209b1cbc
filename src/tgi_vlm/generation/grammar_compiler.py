"""Grammar compilation: one compiler per model, shared by every request.

- The tokenizer's llguidance view (each token's bytes, which tokens are special, EOS) is built once,
  when the model loads.
- A request's grammar compiles on a small thread pool, never on the model thread. `start` is called
  for every request of a batch when the batch arrives; `state_for` then waits for each at most
  until `compile_timeout_s` after its `start`, so one batch never holds the model thread longer
  than that however many grammars it brings. A compile that overruns is abandoned (its result is
  never used) and the request refused.
- Compiled grammars are kept by content (type, text), least recently used out; a request gets a
  copy of the compiled start state (`CompiledGrammar.new_state`).
- Every problem is a `GrammarError` saying what was wrong; the intake turns it into the request's
  INVALID_ARGUMENT.

Threads: only the model thread calls `start` and `state_for` (the cache is not locked); pool threads
only run `_compile`, which touches nothing shared but the immutable vocabulary.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from copy import copy
from dataclasses import dataclass
from typing import Any

import llguidance
from loguru import logger

from tgi_vlm.config import GrammarLimits
from tgi_vlm.generation.grammar import GrammarState, GrammarType

# JSON Schema grammars use the whitespace TGI's router writes (outlines-core): at most one space
# around JSON punctuation. Unbounded whitespace lets a model pad forever instead of finishing.
JSON_WHITESPACE = r"[ ]?"
# The JSON-string character class of outlines-core (TGI's router). Declaring it as a tokenizer
# "slice" lets llguidance take the tokens allowed inside a string from a precomputed set (about
# halves mask time on router-compiled schemas with a 131k vocabulary).
_ROUTER_STRING_CHAR = r'[^"\\\x00-\x1F\x7F-\x9F]'
SLICES = [*llguidance.LLTokenizer.general_slices(), *(_ROUTER_STRING_CHAR + r for r in ("{1,10}", "{1,30}", "+"))]
_MAX_MESSAGE_CHARS = 300


class GrammarError(ValueError):
    """A request's grammar cannot be used; the message says why."""


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated grammar. `start` is a matcher in the start state; it is copied, never advanced."""

    kind: GrammarType
    start: llguidance.LLMatcher

    def new_state(self) -> GrammarState:
        return GrammarState(self.start.deep_copy())


@dataclass
class _Pending:
    future: Future[CompiledGrammar]
    deadline: float  # time.monotonic() after which the model thread stops waiting


class GrammarCompiler:
    """Per model: the vocabulary, the compile pool and the cache of compiled grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int], limits: GrammarLimits) -> None:
        self.limits = limits
        self.vocab: llguidance.LLTokenizer | None = None
        self.unavailable: str | None = None  # why grammars are refused on this model, if they are
        try:
            self.vocab = build_vocabulary(tokenizer, vocab_size, eos_token_ids)
        except GrammarError as exc:
            self.unavailable = str(exc)
        except Exception as exc:  # noqa: BLE001 - a tokenizer llguidance cannot read must not stop the shard
            self.unavailable = f"grammars are unavailable for this model's tokenizer ({type(exc).__name__}: {exc})"
            logger.warning(self.unavailable)
        # Words per mask row: llguidance's vocabulary may be wider than the logits (never narrower).
        self.mask_words = ((self.vocab.vocab_size if self.vocab else vocab_size) + 31) // 32
        self._parser_limits = llguidance.LLParserLimits(verbose_errors=False)
        self._cache: OrderedDict[tuple[GrammarType, str], _Pending] = OrderedDict()
        self._pool = ThreadPoolExecutor(limits.threads, thread_name_prefix="tgi-vlm-grammar")

    def start(self, kind: int, text: str) -> None:
        """Begin compiling unless cached or already compiling; returns at once and never raises
        (`state_for` reports problems)."""
        try:
            key = self._check(kind, text)
        except GrammarError:
            return
        deadline = time.monotonic() + self.limits.compile_timeout_s
        if key in self._cache:
            pending = self._cache[key]
            if not pending.future.done():  # still compiling for an earlier batch: this one waits its own time
                pending.deadline = max(pending.deadline, deadline)
            self._cache.move_to_end(key)
            return
        self._cache[key] = _Pending(self._pool.submit(self._compile, *key), deadline)
        self._evict()

    def state_for(self, kind: int, text: str) -> GrammarState:
        """A fresh state of the grammar, waiting for its compile until its deadline at most."""
        key = self._check(kind, text)
        if key in self._cache:
            self._cache.move_to_end(key)  # the most recently used; its deadline stays its batch's
        else:
            self.start(kind, text)
        pending = self._cache[key]
        try:
            compiled = pending.future.result(timeout=max(0.0, pending.deadline - time.monotonic()))
        except FutureTimeout:
            del self._cache[key]  # abandoned: its result is never used, and a resend compiles afresh
            raise GrammarError(
                f"the grammar did not compile within {self.limits.compile_timeout_s:g} s "
                "(TGI_VLM_GRAMMAR_COMPILE_TIMEOUT_S)"
            ) from None
        except GrammarError:
            del self._cache[key]  # failures are not cached
            raise
        return compiled.new_state()

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def _check(self, kind: int, text: str) -> tuple[GrammarType, str]:
        if self.unavailable is not None:
            raise GrammarError(self.unavailable)
        if kind not in (GrammarType.JSON, GrammarType.REGEX):
            raise GrammarError(f"grammar_type {kind} is not JSON ({GrammarType.JSON}) or REGEX ({GrammarType.REGEX})")
        size = len(text.encode("utf-8"))
        if size > self.limits.max_bytes:
            raise GrammarError(
                f"the grammar is {size} bytes, over the limit of {self.limits.max_bytes} (TGI_VLM_GRAMMAR_MAX_BYTES)"
            )
        return GrammarType(kind), text

    def _compile(self, kind: GrammarType, text: str) -> CompiledGrammar:
        """Runs on a pool thread (llguidance releases the GIL while it builds)."""
        try:
            grammar = _llguidance_grammar(kind, text)
        except ValueError as exc:  # GrammarError, or llguidance refusing the schema's shape
            raise GrammarError(f"invalid {kind.name} grammar: {_short(str(exc))}") from None
        matcher = llguidance.LLMatcher(self.vocab, grammar, log_level=0, limits=self._parser_limits)
        if not matcher.is_error():
            # The first mask, here rather than on the model thread: it builds the start state and
            # shows grammars that fail before their first token.
            matcher.compute_bitmask()
        if matcher.is_error():
            raise GrammarError(f"invalid {kind.name} grammar: {_short(matcher.get_error())}")
        return CompiledGrammar(kind, matcher)

    def _evict(self) -> None:
        """Drop the least recently used finished entries beyond the limit (running ones stay)."""
        excess = len(self._cache) - self.limits.cache_entries
        for key in [k for k, p in self._cache.items() if p.future.done()][: max(0, excess)]:
            del self._cache[key]


def build_vocabulary(tokenizer: Any, vocab_size: int, eos_token_ids: set[int]) -> llguidance.LLTokenizer:
    """llguidance's view of a fast (tokenizers-backed) tokenizer, `vocab_size` wide at least (ids
    past the tokenizer's are never allowed)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GrammarError(f"grammars need a fast (tokenizers) tokenizer; this model has {type(tokenizer).__name__}")
    backend = copy(backend)  # padding/truncation settings must not leak into the serialized copy
    backend.no_padding()
    backend.no_truncation()
    width = max(vocab_size, backend.get_vocab_size(with_added_tokens=True))
    eos = sorted(eos_token_ids) or None
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=width, eos_token=eos, slices=SLICES)


def _llguidance_grammar(kind: GrammarType, text: str) -> str:
    if kind == GrammarType.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(text)
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON Schema must be a JSON object, got {type(schema).__name__}")
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_pattern": JSON_WHITESPACE})


def _short(message: str) -> str:
    """llguidance's error on one line, cut to a readable length."""
    flat = " ".join(message.split())
    return flat if len(flat) <= _MAX_MESSAGE_CHARS else flat[: _MAX_MESSAGE_CHARS - 3] + "..."
