"""Request intake: a `generate_pb2.Request` becomes a validated `Sequence` with its KV slots.

Two stages, so that a batch is validated completely before anything is allocated:
1. tokenize (`FlashCausalLM.tokenize_request`; VLMs: `vlm_intake.py`) → `TokenizedPrompt`;
2. `make_sequence`: parameters, lengths and slots checked, the grammar's state taken from its
   compiled form, the request's `adapter_id` resolved to an index (`adapter_table.py`; one not loaded is refused); server
   blocks claimed only if the router gave none. Every refusal is an
   `InvalidRequest` naming the request.
Grammars compile off the model thread: `start_grammars` starts every request's compile when its
batch arrives, and `make_sequence` waits for its own at most until the compile deadline.
A request's chunks and left truncation come from `request_input.py` (re-exported here for the engine),
which the router's token counter imports without the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tgi_vlm.blocks import blocks_needed, slots_from_blocks
from tgi_vlm.errors import InvalidRequest
from tgi_vlm.generation import (
    GrammarError,
    GrammarState,
    IncrementalDetokenizer,
    StoppingCriteria,
    TokenChooser,
    validate_parameters,
)
from tgi_vlm.models.adapter_table import UnknownAdapter
from tgi_vlm.models.request_input import request_chunks, truncate_ids  # noqa: F401 - the engine's names
from tgi_vlm.models.sequence import MultimodalState, Sequence
from tgi_vlm.pb import generate_pb2

if TYPE_CHECKING:
    from tgi_vlm.models.flash_causal_lm import FlashCausalLM


@dataclass
class TokenizedPrompt:
    ids: list[int]  # after truncation
    mm: MultimodalState | None = None  # VLMs: spans, adapter state, groups (host tensors)

    @property
    def media(self) -> list:
        return self.mm.media if self.mm is not None else []


def start_grammars(model: FlashCausalLM, requests) -> None:
    """Start compiling the grammar of every request that has one (returns at once)."""
    for request in requests:
        if request.parameters.grammar:
            model.grammars.start(request.parameters.grammar_type, request.parameters.grammar)


def grammar_state(model: FlashCausalLM, request: generate_pb2.Request) -> GrammarState | None:
    """The request's grammar in its start state (waits for its compile); None without a grammar."""
    params = request.parameters
    if not params.grammar:
        return None
    try:
        return model.grammars.state_for(params.grammar_type, params.grammar)
    except GrammarError as exc:
        raise InvalidRequest(request.id, str(exc)) from None


def make_sequence(model: FlashCausalLM, request: generate_pb2.Request, prompt: TokenizedPrompt, *,
                  liveness: bool = False, warmup: bool = False) -> Sequence:
    ids, rid = prompt.ids, request.id
    stopping = request.stopping_parameters
    check_request(model, request, len(ids))
    adapter_index = adapter_index_of(model, request)
    if prompt.mm is None:
        check_token_ids(rid, ids, model.vocab_size)
    grammar = grammar_state(model, request)
    criteria = StoppingCriteria.from_params(stopping, model.eos_token_ids)
    if grammar is not None:
        criteria.ignore_eos = False  # its grammar allows EOS only once complete, and nothing after it
    # Warmup runs a single forward, so it reserves the prompt plus one token, not max_new_tokens.
    total = len(ids) + (1 if warmup else stopping.max_new_tokens)
    needed_slots = total - 1  # the last generated token is never fed back
    block_table, owns, slots = claim_slots(model, request, total)
    if liveness and slots and max(slots) < model.config.block_size:
        # TGI's health check writes only into reserved block 0 (blocks=[0]); its output is discarded.
        slots = [slots[i % len(slots)] for i in range(needed_slots)]
    try:
        check_slots(rid, slots, needed_slots, len(ids), stopping.max_new_tokens, model.kv_cache.num_slots)
        cached_keys = check_cached_prefix(model, request, prompt, slots) if request.cache_len else []
    except InvalidRequest:
        if owns:
            model.pool.free(block_table)
        raise
    return Sequence(
        request_id=rid,
        all_ids=list(ids),
        prompt_len=len(ids),
        max_new_tokens=stopping.max_new_tokens,
        chooser=TokenChooser.from_params(request.parameters, device=model.device,
                                         watermark_gamma=model.config.watermark_gamma,
                                         watermark_delta=model.config.watermark_delta),
        stopping=criteria,
        detokenizer=IncrementalDetokenizer(model.tokenizer, list(ids)),
        block_table=block_table,
        slot_tensor=torch.tensor(slots[:needed_slots], dtype=torch.long, device=model.device),
        slot_list=list(slots[:needed_slots]),
        owns_blocks=owns,
        mm=prompt.mm,
        adapter_id=request.adapter_id,  # "" when unset (proto3 optional string)
        adapter_index=adapter_index,
        num_computed=request.cache_len,  # verified: those positions' K/V are already in the cache
        block_keys=cached_keys,
        grammar=grammar,
        first_chunk_len=request.chunk_len if request.HasField("chunk_len") else None,
        prefill_logprobs=request.prefill_logprobs,
        top_n_tokens=request.top_n_tokens,
    )


def check_request(model: FlashCausalLM, request: generate_pb2.Request, prompt_len: int) -> None:
    """Everything about a request except its slots; raises InvalidRequest naming it."""
    rid, stopping = request.id, request.stopping_parameters
    if not prompt_len:
        raise InvalidRequest(rid, "empty input: the prompt has no tokens")
    problems = validate_parameters(request.parameters, stopping, model.vocab_size)
    if problems:
        raise InvalidRequest(rid, "; ".join(problems))
    if request.cache_len and request.prefill_logprobs:
        # The cached positions were computed by another request: their logprobs are not here (TGI's
        # router never looks up requests that want prefill logprobs).
        raise InvalidRequest(rid, f"cache_len={request.cache_len} with prefill_logprobs: prompt logprobs need "
                                  "the whole prompt computed; send cache_len=0")
    if request.cache_len >= prompt_len:
        raise InvalidRequest(rid, f"cache_len={request.cache_len} leaves nothing to compute of a "
                                  f"{prompt_len}-token prompt (at most {prompt_len - 1})")
    if model.max_total_tokens and prompt_len + stopping.max_new_tokens > model.max_total_tokens:
        raise InvalidRequest(
            rid,
            f"{prompt_len} prompt tokens + max_new_tokens {stopping.max_new_tokens} exceed "
            f"max_total_tokens {model.max_total_tokens}",
        )


def adapter_index_of(model: FlashCausalLM, request: generate_pb2.Request) -> int:
    """The index of the request's LoRA adapter (0: none named); an adapter that is not loaded refuses this request
    only (the router drops it and resends the rest of the batch)."""
    try:
        return model.adapter_table.resolve(request.adapter_id)
    except UnknownAdapter as exc:
        raise InvalidRequest(request.id, str(exc)) from None


def check_token_ids(rid: int, ids, rows: int) -> None:
    """Every prompt id of a text request is a row of the embedding. A tokenizer can hold more ids than the model has
    rows: transformers' GGUF byte-level tokenizer adds GPT-2's `<|endoftext|>` past a file's own tokens, so a prompt
    with that text gets an id the model never learnt. Requests with media are not checked (their placeholder ids are
    replaced by features); a VLM's text-only request is (an id past the text vocabulary was clamped before and
    served a wrong row)."""
    highest = max(ids) if len(ids) else 0
    if highest >= rows:
        raise InvalidRequest(rid, f"token id {highest} is outside the model's {rows}-token vocabulary (the tokenizer "
                                  "holds ids the model does not: remove the special-token text from the prompt)")


def check_slots(rid: int, slots: list[int], needed: int, prompt_len: int, max_new_tokens: int, num_slots: int) -> None:
    """Enough slots for every position, and each inside the cache: an out-of-range slot would be an
    out-of-bounds KV write on the device."""
    if len(slots) < needed:
        raise InvalidRequest(
            rid,
            f"needs {needed} KV slots ({prompt_len} prompt tokens + max_new_tokens {max_new_tokens} - 1) "
            f"but the router gave {len(slots)}",
        )
    highest = max(slots[:needed])
    if highest >= num_slots:
        raise InvalidRequest(rid, f"slot {highest} is outside the KV cache ({num_slots} slots)")


def check_cached_prefix(model: FlashCausalLM, request: generate_pb2.Request, prompt: TokenizedPrompt,
                        slots: list[int]) -> list[bytes]:
    """A `cache_len` claim, verified against the shard's block records (models/prefix_cache.py)."""
    cache_len = request.cache_len
    groups = prompt.mm.group_ids if prompt.mm is not None else None
    if groups is not None and groups[cache_len - 1] >= 0 and groups[cache_len] == groups[cache_len - 1]:
        # Earlier tokens of a bidirectional block attended to its later ones when they were cached.
        raise InvalidRequest(request.id, f"cache_len={cache_len} ends inside a bidirectional attention block "
                                         "(an image or the prefix); the prefix must end at its boundary")
    refs = [s.ref for s in prompt.media]
    return model.block_records.verify_claim(request.id, prompt.ids, refs, slots, cache_len,
                                            adapter_id=request.adapter_id)


def claim_slots(model: FlashCausalLM, request: generate_pb2.Request, total: int) -> tuple[list[int], bool, list[int]]:
    """(block table, owned by the server?, slots): the router's slots or blocks when given, else
    blocks from the server's pool (warmup, tests)."""
    bs = model.config.block_size
    if request.slots:
        return list(request.blocks), False, list(request.slots)
    if request.blocks:
        return list(request.blocks), False, slots_from_blocks(list(request.blocks), bs)
    n = blocks_needed(total, bs)
    if not model.pool.can_allocate(n):
        raise InvalidRequest(request.id, f"KV cache full: needs {n} blocks, {model.pool.num_free} free")
    blocks = model.pool.allocate(n)
    return blocks, True, slots_from_blocks(blocks, bs)
