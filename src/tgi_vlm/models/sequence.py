"""One request's state inside the engine.

There is no prefill/decode phase: a sequence brings `num_computed` (tokens whose K/V are in the
cache) up to `len(all_ids)`. While `num_computed < prompt_len` it is prefilling (possibly in
chunks); afterwards each step feeds the last generated token. A step samples a token only when
the step's window reaches the end of `all_ids`.

State moves only through the named transitions: `advance(n)` after a forward computed n more
tokens, `append_token(id)` when a token is sampled (advance the grammar, detokenize, check stopping, maybe
finish),
`take_prefill_logprobs()` once when the first token is reported.

Ownership: the intake (`models/intake.py`) creates a sequence and its KV slots (server-allocated
blocks when the router gave none; `owns_blocks`); the model's `release_sequences` frees those
blocks and the sequence's encoder-cache entries, on filter, on release of its batch, or when a
forward fails.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch
from loguru import logger

from tgi_vlm.generation import (
    FinishReason,
    GrammarState,
    IncrementalDetokenizer,
    StoppingCriteria,
    TokenChooser,
)
from tgi_vlm.models.media_spans import MediaSpan
from tgi_vlm.prefix_hash import MediaRef

MAX_DRAFT_SKIP = 64


@dataclass
class MultimodalState:
    """A VLM sequence's media-side state (text-only models leave `Sequence.mm` as None).

    media: spans (images) in prompt order, each with its own encoder-cache key (assigned at intake).
    adapter_state: whatever the architecture's adapter keeps per sequence (Qwen2-VL: MropePositions).
    bidirectional_groups: `[prompt_len]` long on the model's device, for attention masks: positions
    sharing a group id >= 0 attend both ways (Gemma3 image blocks, PaliGemma's prefix); -1 causal.
    group_ids: the same on the host, for scheduling without device reads.
    """

    media: list[MediaSpan] = field(default_factory=list)
    adapter_state: object | None = None
    bidirectional_groups: torch.Tensor | None = None
    group_ids: list[int] | None = None

    def media_pending(self, num_computed: int) -> bool:
        """Some media token is not yet in the KV cache."""
        return bool(self.media) and num_computed < self.media[-1].end

    def extend_to_group_end(self, end: int, prompt_len: int) -> int:
        """`end`, moved forward so that it does not fall inside a bidirectional group."""
        groups = self.group_ids
        if groups is None or end >= prompt_len:
            return end
        group = groups[end - 1]
        while group >= 0 and end < prompt_len and groups[end] == group:
            end += 1
        return end


_uids = itertools.count(1)


@dataclass
class Sequence:
    request_id: int
    all_ids: list[int]  # prompt (after truncation) followed by generated tokens
    prompt_len: int
    max_new_tokens: int
    chooser: TokenChooser
    stopping: StoppingCriteria
    detokenizer: IncrementalDetokenizer
    block_table: list[int]
    # [max positions] long, on the model's device: cache slot of every position the request may
    # write (router-given `slots`, or derived from the server-allocated block table).
    slot_tensor: torch.Tensor
    slot_list: list[int]  # the same slots on the host (block records, no device reads)
    owns_blocks: bool  # blocks came from the server's pool and go back to it
    mm: MultimodalState | None = None  # None for text-only models
    # The LoRA adapter the request names (`Request.adapter_id`, "" for none) and its index in the
    # model's AdapterTable (0 = base model): what the step context tells every layer, and the
    # namespace of the request's prefix-cache keys (prefix_hash.namespace_root).
    adapter_id: str = ""
    adapter_index: int = 0
    # The request's grammar, from its first generated token on (the prompt is never matched);
    # advanced by append_token. None without a grammar.
    grammar: GrammarState | None = None
    num_computed: int = 0  # tokens whose K/V are in the cache
    first_chunk_len: int | None = None  # router's chunk_len for the first prefill
    started: bool = False  # a forward has run for this sequence (later chunks are sized by the server)
    prefill_logprobs: bool = False
    top_n_tokens: int = 0
    prefill_logprob_values: list[float] = field(default_factory=list)  # accumulated across chunks
    prefill_reported: bool = False
    finished: bool = False
    # Content keys of the full blocks computed so far (prefix_hash.block_keys), prompt and generated.
    block_keys: list[bytes] = field(default_factory=list)
    # Speculation: draft tokens fed after the last token in the current step (set before scheduling,
    # cleared after the step). Their K/V are written but only the accepted ones are ever `advance`d over.
    draft: list[int] = field(default_factory=list)
    # Drafting backs off after runs that accepted nothing: skip `draft_skip` steps (4^misses, at most
    # MAX_DRAFT_SKIP) so a request whose drafts keep failing costs almost nothing extra.
    draft_misses: int = 0
    draft_skip: int = 0
    # Unique for the process's life (request ids are the router's and may repeat across batches):
    # what per-sequence device state outside the batch (the decode mirror's rows) is keyed by.
    uid: int = field(default_factory=lambda: next(_uids))

    # ----- queries -----
    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prompt_len

    @property
    def remaining_prompt(self) -> int:
        return self.prompt_len - self.num_computed

    @property
    def generated_ids(self) -> list[int]:
        return self.all_ids[self.prompt_len :]

    @property
    def max_total_tokens(self) -> int:
        return self.prompt_len + self.max_new_tokens

    @property
    def max_draft(self) -> int:
        """Drafts that fit: the last token a request may emit is never fed back, so a draft row may
        only use positions below prompt_len + max_new_tokens - 1 (the slots the router gave)."""
        return max(0, self.max_new_tokens - len(self.generated_ids) - 1)

    def window_ids(self, start: int, end: int) -> list[int]:
        """Token ids of positions [start, end): known tokens, then draft tokens (no full-list copy)."""
        ids = self.all_ids[start:end]
        if end > len(self.all_ids):
            ids += self.draft[max(start - len(self.all_ids), 0) : end - len(self.all_ids)]
        return ids

    @property
    def media(self) -> list[MediaSpan]:
        return self.mm.media if self.mm is not None else []

    @property
    def media_refs(self) -> list[MediaRef]:
        return [s.ref for s in self.media]

    @property
    def media_pending(self) -> bool:
        return self.mm is not None and self.mm.media_pending(self.num_computed)

    def align_chunk(self, n: int) -> int:
        """A prefill chunk of n tokens, extended so it never ends inside a bidirectional block
        (its earlier tokens must see its later ones)."""
        if self.mm is None:
            return n
        return self.mm.extend_to_group_end(self.num_computed + n, self.prompt_len) - self.num_computed

    # ----- transitions -----
    def advance(self, n: int) -> None:
        """A forward wrote the K/V of the next n tokens."""
        if n < 1 or self.num_computed + n > len(self.all_ids):
            raise ValueError(f"request {self.request_id}: cannot advance {n} from {self.num_computed}/{len(self.all_ids)}")
        self.num_computed += n
        self.started = True  # the router's chunk_len applies to the first prefill only

    def append_token(self, token_id: int) -> tuple[str, FinishReason | None]:
        """Add a sampled token: (its new text, the finish reason if it ends the request)."""
        self.all_ids.append(token_id)
        if self.grammar is not None and not self.grammar.advance(token_id):
            # Never for a masked choice; a matcher over its per-step budget ends here (EOS only from now).
            logger.warning("request {}: its grammar stopped at token {}: {}", self.request_id, token_id,
                           self.grammar.error or "token not allowed")
        new_text = self.detokenizer.step(self.all_ids)
        reason = self.stopping(token_id, new_text)
        if reason is not None:
            self.finished = True
        return new_text, reason

    def record_verified_run(self, accepted: int) -> None:
        """After a forward that verified this sequence's draft: back off when nothing was accepted."""
        if accepted:
            self.draft_misses = 0
            return
        self.draft_misses += 1
        self.draft_skip = min(4**self.draft_misses, MAX_DRAFT_SKIP)

    def wants_draft(self) -> bool:
        """Whether to draft this step (consumes one skipped step when backing off)."""
        if self.draft_skip:
            self.draft_skip -= 1
            return False
        return True

    def take_prefill_logprobs(self) -> list[float] | None:
        """The prompt's logprobs (NaN for the first token) the first time they are due, else None."""
        if not self.prefill_logprobs or self.prefill_reported:
            return None
        self.prefill_reported = True
        missing = self.prompt_len - len(self.prefill_logprob_values)
        return [math.nan] * missing + self.prefill_logprob_values
