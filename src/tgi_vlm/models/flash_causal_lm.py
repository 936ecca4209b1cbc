"""FlashCausalLMBatch and FlashCausalLM: the paged, continuously-batched engine every model shares.

This file is model-agnostic: it never reads `model_type`. Rarer features live in helpers or in
subclasses (`vlm_causal_lm.py`) through the hooks `tokenize_request`, `make_sequence`,
`embed_step`, `position_ids` and `after_step`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from loguru import logger

from tgi_vlm.config import EngineConfig
from tgi_vlm.errors import InvalidArgument, InvalidBatch, InvalidRequest
from tgi_vlm.generation import (
    IncrementalDetokenizer,
    StoppingCriteria,
    TokenChooser,
    choose_tokens,
    prefill_logprobs,
    token_texts,
    top_n,
    validate_parameters,
)
from tgi_vlm.layers.attention import BlockAllocator, KVCacheSpec, PagedKVCache, blocks_needed
from tgi_vlm.models.sequence import Sequence, slots_from_blocks
from tgi_vlm.models.step import StepInputs, build_step, schedule
from tgi_vlm.models.types import GeneratedText, Generation, ShardModel, StepTimings, Tokens
from tgi_vlm.pb import generate_pb2

DEFAULT_PREFILL_BUDGET = 4096  # until Warmup tells us the router's max_prefill_tokens
LIVENESS_BATCH_ID = 2**64 - 1  # TGI's health-check prefill writes to block 0


@dataclass
class TokenizedPrompt:
    ids: list[int]


class FlashCausalLMBatch:
    """The requests of one cached batch. Contract: from_pb / filter / concatenate / to_pb / len."""

    def __init__(self, batch_id: int, seqs: list[Sequence], model: FlashCausalLM):
        self.batch_id = batch_id
        self.seqs = seqs
        self.model = model

    @classmethod
    def from_pb(cls, pb: generate_pb2.Batch, model: FlashCausalLM, *, warmup: bool = False) -> FlashCausalLMBatch:
        """Validate and tokenize every request before allocating anything; all errors are reported together."""
        errors: list[InvalidRequest] = []
        prepared = []
        seen: set[int] = set()
        for request in pb.requests:
            try:
                if request.id in seen and not warmup:  # TGI's router gives every warmup request id 0
                    raise InvalidRequest(request.id, "duplicate request id in the batch")
                seen.add(request.id)
                prepared.append((request, model.tokenize_request(request, warmup=warmup)))
            except InvalidRequest as exc:
                errors.append(exc)
        if not errors and not prepared:
            raise InvalidArgument(f"batch {pb.id} has no requests")
        if errors:
            raise InvalidBatch(errors)
        seqs: list[Sequence] = []
        errors = []
        for request, prompt in prepared:
            try:
                seqs.append(model.make_sequence(request, prompt, liveness=pb.id == LIVENESS_BATCH_ID, warmup=warmup))
            except InvalidRequest as exc:
                errors.append(exc)
            except BaseException:
                cls(pb.id, seqs, model).release()  # nothing built so far may keep its blocks
                raise
        if errors:
            cls(pb.id, seqs, model).release()
            raise InvalidBatch(errors)
        return cls(pb.id, seqs, model)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def request_ids(self) -> list[int]:
        return [s.request_id for s in self.seqs]

    def filter(self, request_ids: list[int]) -> FlashCausalLMBatch:
        keep = set(request_ids)
        unknown = keep - set(self.request_ids)
        if unknown:
            raise InvalidArgument(f"FilterBatch: request ids {sorted(unknown)} are not in batch {self.batch_id}")
        self.model.release_sequences([s for s in self.seqs if s.request_id not in keep])
        self.seqs = [s for s in self.seqs if s.request_id in keep]
        return self

    @classmethod
    def concatenate(cls, batches: list[FlashCausalLMBatch]) -> FlashCausalLMBatch:
        seqs = [s for b in batches for s in b.seqs]
        return cls(batches[0].batch_id, seqs, batches[0].model)

    def release(self) -> None:
        """Give back server-owned KV blocks (and, in subclasses, encoder entries)."""
        self.model.release_sequences(self.seqs)
        self.seqs = []

    def to_pb(self) -> generate_pb2.CachedBatch:
        sizes = schedule(self.seqs, self.model.prefill_budget)
        return generate_pb2.CachedBatch(
            id=self.batch_id,
            request_ids=self.request_ids,
            size=len(self.seqs),
            max_tokens=sum(s.max_total_tokens for s in self.seqs),
            current_tokens=sum(sizes),
        )


class FlashCausalLM(ShardModel):
    """A transformers causal LM run on our paged KV cache with packed ragged batches."""

    batch_type = FlashCausalLMBatch

    def __init__(self, model: torch.nn.Module, tokenizer, config: EngineConfig, *, model_id: str = ""):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config
        self.model_id = model_id
        self.device = torch.device(config.device)
        self.dtype = next(model.parameters()).dtype
        self.text_config = model.config.get_text_config()
        self.language_model = self.find_language_model()
        self.embed_tokens = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = int(self.text_config.vocab_size)
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self.special_ids = set(tokenizer.all_special_ids)
        self.kv_spec = _kv_spec(self.text_config, config.block_size, self.dtype)
        self.prefill_budget: int | None = DEFAULT_PREFILL_BUDGET if config.prefill_chunking else None
        self.kv_cache: PagedKVCache | None = None
        self.allocator: BlockAllocator | None = None
        # TGI's vocabulary: our torch backend is paged attention ("paged"); flashinfer is itself.
        self.attention_impl = "flashinfer" if config.attention == "flashinfer" else "paged"
        self.max_total_tokens: int | None = None  # set by Warmup; longer requests are refused
        # Test/debug hook: called as observer(request_ids, logits[B, V]) with every sampled step's logits.
        self.logits_observer = None
        self.graphs = None  # DecodeGraphs (models/cuda_graphs.py) once warmup captured them; tied to kv_cache

    # ----- loading-dependent accessors (overridden by VlmCausalLM) -----
    def find_language_model(self) -> torch.nn.Module:
        return self.model.get_decoder()

    # ----- KV cache -----
    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = None  # drop the old tensors before making new ones
        self.graphs = None  # captured graphs point at the old cache tensors
        self.kv_cache = PagedKVCache(self.kv_spec, num_blocks, self.device)
        self.allocator = BlockAllocator(num_blocks)

    def ensure_kv_cache(self) -> None:
        if self.kv_cache is None:
            self.allocate_kv_cache(self.default_num_blocks())

    def default_num_blocks(self, reclaimable_blocks: int = 0) -> int:
        """KV blocks that fit. GPU: TGI's rule, (free − (1 − CUDA_MEMORY_FRACTION)·total)·wiggle room,
        less the cross-request encoder cache's budget, plus blocks of a cache about to be dropped."""
        if self.device.type != "cuda":
            return max(2, int(self.config.cpu_kv_cache_bytes // self.kv_spec.bytes_per_block))
        free, total = torch.cuda.mem_get_info(self.device)
        usable = max(0.0, free - (1 - self.config.cuda_memory_fraction) * total)
        budget = usable * self.config.wiggle_room - self.config.encoder_cache_bytes
        return max(2, int(budget // self.kv_spec.bytes_per_block) + reclaimable_blocks)

    @property
    def kv_blocks_in_use(self) -> int:
        """Server-allocated blocks currently held (tests assert it returns to zero)."""
        return 0 if self.allocator is None else self.allocator.num_allocated

    def release_sequences(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.owns_blocks and seq.block_table:
                self.allocator.free(seq.block_table)
                seq.block_table = []
                seq.owns_blocks = False

    # ----- building requests -----
    def batch_from_pb(self, pb: generate_pb2.Batch, *, warmup: bool = False) -> FlashCausalLMBatch:
        self.ensure_kv_cache()
        return self.batch_type.from_pb(pb, self, warmup=warmup)

    def concatenate(self, batches: list[FlashCausalLMBatch]) -> FlashCausalLMBatch:
        return self.batch_type.concatenate(batches)

    def tokenize_request(self, request: generate_pb2.Request, *, warmup: bool = False) -> TokenizedPrompt:
        text = self.request_text(request, warmup=warmup)
        ids = self.tokenizer(text, add_special_tokens=request.add_special_tokens)["input_ids"]
        return TokenizedPrompt(ids=self.truncate(request, ids))

    def request_text(self, request: generate_pb2.Request, *, warmup: bool) -> str:
        if not request.HasField("input_chunks") or not request.input_chunks.chunks:
            return request.inputs
        parts = []
        for chunk in request.input_chunks.chunks:
            kind = chunk.WhichOneof("chunk")
            if kind == "text":
                parts.append(chunk.text)
            elif kind == "image" and not warmup:
                # TGI's router adds an image to every warmup, even for text-only models; elsewhere it is an error.
                raise InvalidRequest(request.id, f"model {self.model_id or 'loaded'} is text-only and cannot take image inputs")
        return "".join(parts)

    def truncate(self, request: generate_pb2.Request, ids: list[int]) -> list[int]:
        """Keep the last `truncate` tokens, as TGI does (truncation_side="left")."""
        if request.truncate and len(ids) > request.truncate:
            return ids[-request.truncate :]
        return ids

    def make_sequence(
        self, request: generate_pb2.Request, prompt: TokenizedPrompt, *, liveness: bool = False, warmup: bool = False
    ) -> Sequence:
        ids = prompt.ids
        rid = request.id
        if not ids:
            raise InvalidRequest(rid, "empty input: the prompt has no tokens")
        stopping = request.stopping_parameters
        problems = validate_parameters(request.parameters, stopping, self.vocab_size)
        if problems:
            raise InvalidRequest(rid, "; ".join(problems))
        if request.cache_len:
            # Info says use_prefix_caching=false, so nothing is cached to reuse: trusting cache_len would
            # attend over stale slots (and skip its images' encoding).
            raise InvalidRequest(rid, f"cache_len={request.cache_len} but prefix caching is not enabled on this shard")
        if self.max_total_tokens and len(ids) + stopping.max_new_tokens > self.max_total_tokens:
            raise InvalidRequest(
                rid,
                f"{len(ids)} prompt tokens + max_new_tokens {stopping.max_new_tokens} exceed "
                f"max_total_tokens {self.max_total_tokens}",
            )
        # Warmup runs a single forward, so it reserves the prompt plus one token, not max_new_tokens.
        total = len(ids) + (1 if warmup else stopping.max_new_tokens)
        needed_slots = total - 1  # the last generated token is never fed back
        block_table, owns, slots = self._slots_for(request, total)
        if liveness and slots and max(slots) < self.config.block_size:
            # TGI's health check writes only into reserved block 0 (blocks=[0]); its output is discarded.
            slots = [slots[i % len(slots)] for i in range(needed_slots)]
        if len(slots) < needed_slots:
            raise InvalidRequest(
                rid,
                f"needs {needed_slots} KV slots ({len(ids)} prompt tokens + max_new_tokens {stopping.max_new_tokens} - 1) "
                f"but the router gave {len(slots)}",
            )
        highest = max(slots[:needed_slots])  # every position the request will write, not only the prompt's
        if highest >= self.kv_cache.num_slots:
            raise InvalidRequest(rid, f"slot {highest} is outside the KV cache ({self.kv_cache.num_slots} slots)")
        return Sequence(
            request_id=rid,
            all_ids=list(ids),
            prompt_len=len(ids),
            max_new_tokens=stopping.max_new_tokens,
            chooser=TokenChooser.from_params(
                request.parameters,
                device=self.device,
                watermark_gamma=self.config.watermark_gamma,
                watermark_delta=self.config.watermark_delta,
            ),
            stopping=StoppingCriteria(
                eos_token_ids=self.eos_token_ids,
                max_new_tokens=stopping.max_new_tokens,
                stop_sequences=list(stopping.stop_sequences),
                ignore_eos=stopping.ignore_eos_token,
            ),
            detokenizer=IncrementalDetokenizer(self.tokenizer, list(ids)),
            block_table=block_table,
            slot_tensor=torch.tensor(slots[:needed_slots], dtype=torch.long, device=self.device),
            owns_blocks=owns,
            first_chunk_len=request.chunk_len if request.HasField("chunk_len") else None,
            prefill_logprobs=request.prefill_logprobs,
            top_n_tokens=request.top_n_tokens,
        )

    def _slots_for(self, request, total: int) -> tuple[list[int], bool, list[int]]:
        bs = self.config.block_size
        if request.slots:
            return list(request.blocks), False, list(request.slots)
        if request.blocks:
            return list(request.blocks), False, slots_from_blocks(list(request.blocks), bs)
        n = blocks_needed(total, bs)
        if not self.allocator.can_allocate(n):
            raise InvalidRequest(request.id, f"KV cache full: needs {n} blocks, {self.allocator.num_free} free")
        blocks = self.allocator.allocate(n)
        return blocks, True, slots_from_blocks(blocks, bs)

    # ----- the step -----
    def generate_token(self, batch: FlashCausalLMBatch) -> tuple[list[Generation], FlashCausalLMBatch | None, StepTimings]:
        start = time.perf_counter_ns()
        sizes = schedule(batch.seqs, self.prefill_budget)
        step = build_step(batch.seqs, sizes, self.kv_cache, self.device)
        with torch.inference_mode():
            hidden = self.forward(batch, step)  # [T, H]
            forward_done = time.perf_counter_ns()
            generations = self.sample(step, hidden)
        self.after_step(batch, step)
        end = time.perf_counter_ns()
        timings = StepTimings(forward_ns=forward_done - start, decode_ns=end - forward_done, total_ns=end - start)
        if all(s.finished for s in batch.seqs):
            batch.release()
            return generations, None, timings
        return generations, batch, timings

    def forward(self, batch: FlashCausalLMBatch, step: StepInputs) -> torch.Tensor:
        embeds = self.embed_step(batch, step)  # [T, H]
        positions = self.position_ids(batch, step)
        plan = None if self.graphs is None else self.graphs.plan(step.metadata)
        if plan is not None:  # decode-only step that fits a captured batch size
            return self.graphs.replay(plan, embeds, positions, step.metadata)
        out = self.language_model(
            inputs_embeds=embeds[None],
            position_ids=positions,
            attn_metadata=step.metadata,
            use_cache=False,
        )
        return out.last_hidden_state[0]

    def embed_step(self, batch: FlashCausalLMBatch, step: StepInputs) -> torch.Tensor:
        return self.embed_tokens(step.input_ids)

    def position_ids(self, batch: FlashCausalLMBatch, step: StepInputs) -> torch.Tensor:
        return step.positions[None]  # [1, T]

    def after_step(self, batch: FlashCausalLMBatch, step: StepInputs) -> None:
        """Hook for per-step bookkeeping in subclasses (e.g. freeing consumed encoder outputs)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = getattr(self.text_config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def sample(self, step: StepInputs, hidden: torch.Tensor) -> list[Generation]:
        samplers = [w for w in step.windows if w.samples]
        with_prefill_lp = [w for w in step.windows if w.seq.prefill_logprobs and w.start < w.seq.prompt_len]
        for w in with_prefill_lp:
            self._accumulate_prefill_logprobs(w, hidden)
        for w in step.windows:
            w.seq.num_computed = w.end
            w.seq.started = True  # the router's chunk_len applies to the first prefill only
        if not samplers:
            return []
        last_rows = torch.tensor([w.row + w.end - w.start - 1 for w in samplers], device=hidden.device)
        logits = self.compute_logits(hidden[last_rows])[:, : self.vocab_size]  # [B, V]
        if self.logits_observer is not None:
            self.logits_observer([w.seq.request_id for w in samplers], logits)
        chosen = choose_tokens(logits, [w.seq.chooser for w in samplers], [w.seq.all_ids for w in samplers])
        generations = []
        for i, w in enumerate(samplers):
            top = None
            if w.seq.top_n_tokens and chosen.logprob_rows is not None:
                top = top_n(chosen.logprob_rows[i], w.seq.top_n_tokens)
            generations.append(self._emit(w.seq, chosen.ids[i], chosen.logprobs[i], top))
        return generations

    def _accumulate_prefill_logprobs(self, w, hidden: torch.Tensor, rows_per_chunk: int = 256) -> None:
        seq = w.seq
        last = min(w.end, seq.prompt_len - 1)  # rows predicting prompt tokens start+1 .. last
        # Row chunks keep the float32 [rows, vocab] logits small (262k-token vocabularies exist).
        for start in range(w.start, last, rows_per_chunk):
            end = min(start + rows_per_chunk, last)
            logits = self.compute_logits(hidden[w.row + start - w.start : w.row + end - w.start])
            seq.prefill_logprob_values.extend(prefill_logprobs(logits, seq.all_ids[start + 1 : end + 1]))

    def _emit(self, seq: Sequence, token_id: int, logprob: float, top) -> Generation:
        prefill_tokens = None
        if seq.prefill_logprobs and not seq.prefill_reported:
            prompt = seq.all_ids[: seq.prompt_len]
            values = [math.nan] * (seq.prompt_len - len(seq.prefill_logprob_values)) + seq.prefill_logprob_values
            prefill_tokens = self._tokens(prompt, values, token_texts(self.tokenizer, prompt))
            seq.prefill_reported = True
        seq.all_ids.append(token_id)
        new_text = seq.detokenizer.step(seq.all_ids)
        reason = seq.stopping(token_id, new_text)
        generated = None
        if reason is not None:
            seq.finished = True
            generated = GeneratedText(
                text=seq.detokenizer.full_text(seq.generated_ids),
                generated_tokens=len(seq.generated_ids),
                finish_reason=reason,
                seed=seq.chooser.seed if seq.chooser.do_sample else None,
            )
        top_tokens = []
        if top is not None:
            ids, lps = top
            top_tokens = [self._tokens(ids, lps, token_texts(self.tokenizer, ids))]
        return Generation(
            request_id=seq.request_id,
            prefill_tokens=prefill_tokens,
            tokens=self._tokens([token_id], [logprob], [new_text]),
            generated_text=generated,
            top_tokens=top_tokens,
        )

    def _tokens(self, ids: list[int], logprobs: list[float], texts: list[str]) -> Tokens:
        return Tokens(ids=list(ids), logprobs=list(logprobs), texts=texts, is_special=[i in self.special_ids for i in ids])

    # ----- warmup and info -----
    def warmup(self, request: generate_pb2.WarmupRequest) -> tuple[int | None, int, int]:
        from tgi_vlm.models.warmup import run_warmup

        return run_warmup(self, request)

    def info(self) -> generate_pb2.InfoResponse:
        return generate_pb2.InfoResponse(
            requires_padding=False,
            dtype=str(self.dtype).removeprefix("torch."),
            device_type=self.device.type,
            window_size=None,
            speculate=0,
            support_chunking=self.config.prefill_chunking,
            use_prefix_caching=False,
            attention_impl=self.attention_impl,
            block_size=self.config.block_size,
        )


def _eos_token_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = getattr(model.config.get_text_config(), "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if not ids:
        logger.warning("no EOS token id found; generation stops only on length or stop sequences")
    return ids


def _kv_spec(text_config, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return KVCacheSpec(
        num_layers=text_config.num_hidden_layers,
        kv_heads=getattr(text_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
