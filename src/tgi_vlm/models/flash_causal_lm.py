"""FlashCausalLMBatch and FlashCausalLM: the paged, continuously-batched engine every model shares.

This file is shared by every model and never reads `model_type`; add lines reluctantly. Request
intake lives in `intake.py`, output building in `outputs.py`, step planning in `step.py`, the
Warmup RPC in `warmup.py`. Subclasses (`vlm_causal_lm.py`) extend it through the hooks
`tokenize_request`, `make_sequence`, `embed_step`, `position_ids`, `after_step` and
`release_sequences`.
"""

from __future__ import annotations

import time

import torch
from loguru import logger

from tgi_vlm.blocks import BlockPool
from tgi_vlm.config import EngineConfig
from tgi_vlm.errors import InvalidArgument, InvalidBatch, InvalidRequest
from tgi_vlm.generation import (
    GrammarCompiler,
    GrammarMasker,
    NgramDrafter,
    accepts,
    choose_tokens,
    prefill_logprobs,
    top_n,
)
from tgi_vlm.layers.attention import AttentionPattern, KVCacheSpec, PagedKVCache, make_backend
from tgi_vlm.layers.step_context import using
from tgi_vlm.models import intake
from tgi_vlm.models.adapter_table import AdapterTable
from tgi_vlm.models.intake import TokenizedPrompt
from tgi_vlm.models.outputs import EmittedToken, OutputBuilder
from tgi_vlm.models.prefix_cache import BlockRecords
from tgi_vlm.models.rank_agreement import RankAgreement, Refusal
from tgi_vlm.models.sequence import Sequence
from tgi_vlm.models.step import SeqWindow, StepInputs, build_step, schedule
from tgi_vlm.models.tensor_parallel import ShardLayout, head_dim
from tgi_vlm.models.types import Generation, ShardModel, StepTimings
from tgi_vlm.pb import generate_pb2

DEFAULT_PREFILL_BUDGET = 4096  # until Warmup tells us the router's max_prefill_tokens
LIVENESS_BATCH_ID = 2**64 - 1  # TGI's health-check prefill writes to block 0

LOGPROB_CHUNK_ROWS = 256  # prompt rows whose logits are computed at once for prefill logprobs


class FlashCausalLMBatch:
    """The requests of one cached batch. Contract: from_pb / filter / concatenate / to_pb / len."""

    def __init__(self, batch_id: int, seqs: list[Sequence], model: FlashCausalLM):
        self.batch_id = batch_id
        self.seqs = seqs
        self.model = model

    @classmethod
    def from_pb(cls, pb: generate_pb2.Batch, model: FlashCausalLM, *, warmup: bool = False) -> FlashCausalLMBatch:
        """Validate and tokenize every request before allocating anything; all errors are reported together.
        Sharded, every rank refuses the same requests with the same messages (`rank_agreement.py`)."""
        if not pb.requests:
            raise InvalidArgument(f"batch {pb.id} has no requests")
        intake.start_grammars(model, pb.requests)  # compile off the model thread while we tokenize
        model.start_media(pb.requests)  # VLMs: decode videos off the model thread too
        seen: set[int] = set()

        def tokenize(request: generate_pb2.Request) -> TokenizedPrompt:
            if request.id in seen and not warmup:  # TGI's router gives every warmup request id 0
                raise InvalidRequest(request.id, "duplicate request id in the batch")
            seen.add(request.id)
            return model.tokenize_request(request, warmup=warmup)

        prompts = _each_request(model, f"batch {pb.id} (tokenize)", pb.requests, tokenize)
        liveness = pb.id == LIVENESS_BATCH_ID
        seqs = _each_request(
            model, f"batch {pb.id} (sequences)", list(zip(pb.requests, prompts)),
            lambda item: model.make_sequence(item[0], item[1], liveness=liveness, warmup=warmup),
            undo=lambda built: cls(pb.id, built, model).release(),  # nothing built so far may keep its blocks
        )
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


def _each_request(model: FlashCausalLM, what: str, items: list, build, undo=None) -> list:
    """`build(item)` for every request's item; the refusals (InvalidRequest) are collected, agreed on
    by every rank, and raised together as InvalidBatch after `undo(built)`."""
    built, refusals, failure = [], [], None
    try:
        try:
            for position, item in enumerate(items):
                try:
                    built.append(build(item))
                except InvalidRequest as exc:
                    refusals.append(Refusal(position, exc))
        except Exception as exc:  # not a refusal: the other ranks must hear of it before failing too
            failure = exc
        errors = model.ranks.agree(what, refusals, failure)  # raises `failure`, or another rank's
        if errors:
            raise InvalidBatch(errors)
    except BaseException:
        if undo is not None:
            undo(built)
        raise
    return built


class FlashCausalLM(ShardModel):
    """A transformers causal LM run on our paged KV cache with packed ragged batches.

    Owns: the KV cache and its block pool (server-allocated blocks), the attention backend, the
    limits Warmup sets (`max_total_tokens`, `prefill_budget`), the captured decode graphs and the
    LoRA adapter table (`adapter_table`).
    """

    batch_type = FlashCausalLMBatch

    def __init__(self, model: torch.nn.Module, tokenizer, config: EngineConfig, *, model_id: str = "",
                 layout: ShardLayout | None = None):
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
        self.outputs = OutputBuilder(tokenizer, set(tokenizer.all_special_ids))
        # Built once per model: the tokenizer's llguidance vocabulary, the compile pool and cache.
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids, config.grammar)
        self.grammar_masker = GrammarMasker(self.vocab_size, self.grammars.mask_words, self.eos_token_ids,
                                            config.grammar.threads)
        # Tensor parallelism: this rank's share of the attention heads; refusals agreed on by every rank.
        self.layout = layout or ShardLayout.unsharded(self.text_config)
        self.ranks = RankAgreement(self.layout.world_size)
        self.kv_spec = _kv_spec(self.text_config, config.block_size, self.dtype, self.layout.kv_heads)
        self.attention = make_backend(config.attention, self.attention_pattern(), device=config.device,
                                      decode_mirror=config.decode_mirror_share, kernels=config.kernels)
        self.prefill_budget: int | None = DEFAULT_PREFILL_BUDGET if config.prefill_chunking else None
        self.kv_cache: PagedKVCache | None = None
        self.pool: BlockPool | None = None
        self.block_records = BlockRecords(config.block_size)  # what each KV block holds (cache_len checks)
        self.adapter_table = AdapterTable()  # LoRA adapters by name ("" → 0); get_model attaches --lora-adapters
        # TGI's vocabulary: our torch backend is paged attention ("paged"); flashinfer is itself.
        self.attention_impl = "flashinfer" if config.attention == "flashinfer" else "paged"
        self.max_total_tokens: int | None = None  # set by Warmup; longer requests are refused
        # Test/debug hook: called as observer(request_ids, logits[B, V]) with every sampled step's logits.
        self.logits_observer = None
        self.graphs = None  # DecodeGraphs (models/cuda_graphs.py) once warmup captured them; tied to kv_cache
        self.drafter = NgramDrafter() if config.speculate else None
        self.speculation = SpeculationStats()

    # ----- what the model is (subclasses answer through their adapter) -----
    def find_language_model(self) -> torch.nn.Module:
        return self.model.get_decoder()

    def attention_pattern(self) -> AttentionPattern:
        """Chunked-attention layers as transformers declares them (`layer_types`, e.g. Llama4 text)."""
        layer_types = getattr(self.text_config, "layer_types", None) or []
        size = getattr(self.text_config, "attention_chunk_size", None)
        return AttentionPattern({i: size for i, t in enumerate(layer_types) if t == "chunked_attention" and size})

    @property
    def position_rows(self) -> int:
        """Rows of position ids per token (3 for multimodal rotary)."""
        return 1

    @property
    def router_prefix_caching(self) -> bool:
        """Info.use_prefix_caching: whether TGI's router may send cache_len (PREFIX_CACHING)."""
        return self.config.prefix_caching

    # ----- KV cache -----
    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = None  # drop the old tensors before making new ones
        self.graphs = None  # captured graphs point at the old cache tensors
        self.kv_cache = PagedKVCache(self.kv_spec, num_blocks, self.device)
        self.pool = BlockPool(num_blocks)
        self.block_records = BlockRecords(self.config.block_size)

    def ensure_kv_cache(self) -> None:
        if self.kv_cache is None:
            self.allocate_kv_cache(self.default_num_blocks())

    def default_num_blocks(self, reclaimable_blocks: int = 0) -> int:
        """KV blocks that fit. GPU: TGI's rule, (free − (1 − CUDA_MEMORY_FRACTION)·total)·wiggle room,
        less the cross-request encoder cache's budget, plus blocks of a cache about to be dropped.
        Sharded: the fewest that fit on any rank, so every rank reports the same limits to Warmup
        and refuses the same requests for lack of blocks."""
        if self.device.type != "cuda":
            return self.ranks.minimum(max(2, int(self.config.cpu_kv_cache_bytes // self.kv_spec.bytes_per_block)))
        free, total = torch.cuda.mem_get_info(self.device)
        usable = max(0.0, free - (1 - self.config.cuda_memory_fraction) * total)
        budget = usable * self.config.wiggle_room - self.config.encoder_cache_bytes
        return self.ranks.minimum(max(2, int(budget // self.kv_spec.bytes_per_block) + reclaimable_blocks))

    @property
    def kv_blocks_in_use(self) -> int:
        """Server-allocated blocks currently held (tests assert it returns to zero)."""
        return 0 if self.pool is None else self.pool.num_allocated

    def release_sequences(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.owns_blocks and seq.block_table:
                self.pool.free(seq.block_table)
                seq.block_table = []
                seq.owns_blocks = False

    # ----- limits (set by warmup.py) -----
    def reset_limits(self) -> None:
        """Before a warmup batch: it is checked against the new limits, not old ones."""
        self.max_total_tokens = None

    def set_prefill_budget(self, max_prefill_tokens: int | None) -> None:
        """The router's max_batch_prefill_tokens sizes later chunks (when chunking is on)."""
        if self.config.prefill_chunking and max_prefill_tokens:
            self.prefill_budget = max_prefill_tokens

    def set_max_total_tokens(self, max_total_tokens: int) -> None:
        self.max_total_tokens = max_total_tokens

    # ----- building requests (intake.py) -----
    def batch_from_pb(self, pb: generate_pb2.Batch, *, warmup: bool = False) -> FlashCausalLMBatch:
        self.ensure_kv_cache()
        return self.batch_type.from_pb(pb, self, warmup=warmup)

    def concatenate(self, batches: list[FlashCausalLMBatch]) -> FlashCausalLMBatch:
        return self.batch_type.concatenate(batches)

    def start_media(self, requests) -> None:
        """Start decoding media that decode off the model thread (VLMs: videos); text models take none."""

    def tokenize_request(self, request: generate_pb2.Request, *, warmup: bool = False) -> TokenizedPrompt:
        parts = []
        for chunk in intake.request_chunks(request):
            if isinstance(chunk, str):
                parts.append(chunk)
            elif not warmup:
                # TGI's router adds an image to every warmup, even for text-only models; elsewhere it is an error.
                raise InvalidRequest(request.id, f"model {self.model_id or 'loaded'} is text-only and cannot take "
                                                 f"{chunk.kind.value} inputs")
        ids = self.tokenizer("".join(parts), add_special_tokens=request.add_special_tokens)["input_ids"]
        return TokenizedPrompt(ids=intake.truncate_ids(ids, request.truncate))

    def make_sequence(self, request: generate_pb2.Request, prompt: TokenizedPrompt, *, liveness: bool = False,
                      warmup: bool = False) -> Sequence:
        return intake.make_sequence(self, request, prompt, liveness=liveness, warmup=warmup)

    # ----- the step -----
    def generate_token(self, batch: FlashCausalLMBatch) -> tuple[list[Generation], FlashCausalLMBatch | None, StepTimings]:
        start = time.perf_counter_ns()
        self.propose_drafts(batch.seqs)
        try:
            sizes = schedule(batch.seqs, self.prefill_budget)
            step = build_step(batch.seqs, sizes, self.kv_cache, self.attention, self.device)
            self.block_records.forget_written(step.windows)  # before the forward: a failed one leaves no stale record
            with torch.inference_mode():
                hidden = self.forward(batch, step)  # [T, H]
                forward_done = time.perf_counter_ns()
                self.record_prefill_logprobs(step, hidden)
                for w in step.windows:
                    if not w.seq.draft:  # a verified run advances by what it accepted (in sample)
                        w.seq.advance(w.num_tokens)
                generations = self.sample(step, hidden)
                self.block_records.record_completed(step.windows)
        finally:
            for seq in batch.seqs:
                seq.draft = []
        self.after_step(batch, step)
        end = time.perf_counter_ns()
        timings = StepTimings(forward_ns=forward_done - start, decode_ns=end - forward_done, total_ns=end - start)
        if all(s.finished for s in batch.seqs):
            batch.release()
            return generations, None, timings
        return generations, batch, timings

    def release_idle(self) -> None:
        self.attention.release_idle()  # the CPU decode mirror

    def propose_drafts(self, seqs: list[Sequence]) -> None:
        """Speculation (`--speculate N`): up to N draft tokens for every decoding sequence."""
        if self.drafter is None:
            return
        for seq in seqs:
            if not seq.finished and not seq.prefilling and seq.wants_draft():
                seq.draft = self.drafter.propose(seq.all_ids, min(self.config.speculate, seq.max_draft))

    def forward(self, batch: FlashCausalLMBatch, step: StepInputs) -> torch.Tensor:
        embeds = self.embed_step(batch, step)  # [T, H]
        positions = self.position_ids(batch, step)
        plan = None if self.graphs is None else self.graphs.plan(step.metadata)
        if plan is not None:  # decode-only step that fits a captured batch size
            return self.graphs.replay(plan, embeds, positions, step.metadata, step.context)
        self.attention.plan(step.metadata)
        with using(step.context):  # layers read who each row belongs to (layers/step_context.py)
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

    def record_prefill_logprobs(self, step: StepInputs, hidden: torch.Tensor,
                                rows_per_chunk: int = LOGPROB_CHUNK_ROWS) -> None:
        """Accumulate the logprobs of the prompt tokens this step's windows predict (before `advance`)."""
        for w in step.windows:
            seq = w.seq
            if not seq.prefill_logprobs or w.start >= seq.prompt_len:
                continue
            last = min(w.end, seq.prompt_len - 1)  # rows predicting prompt tokens start+1 .. last
            # Row chunks keep the float32 [rows, vocab] logits small (262k-token vocabularies exist).
            for start in range(w.start, last, rows_per_chunk):
                end = min(start + rows_per_chunk, last)
                logits = self.compute_logits(hidden[w.row + start - w.start : w.row + end - w.start])
                seq.prefill_logprob_values.extend(prefill_logprobs(logits, seq.all_ids[start + 1 : end + 1]))

    def sample(self, step: StepInputs, hidden: torch.Tensor) -> list[Generation]:
        """Choose the next token of every window that reached the end of its sequence; with drafts,
        keep choosing from the following rows while each chosen token equals the next draft
        (generation/speculative.py: the emitted tokens are exactly the non-speculative ones)."""
        samplers: list[SeqWindow] = [w for w in step.windows if w.samples]
        first_rows = [w.first_sample_row for w in samplers]
        emitted: list[list[EmittedToken]] = [[] for _ in samplers]
        reasons = [None] * len(samplers)
        prefill_values = [w.seq.take_prefill_logprobs() for w in samplers]
        active, level = list(range(len(samplers))), 0
        while active:
            rows = torch.tensor([first_rows[i] + level for i in active], device=hidden.device)
            logits = self.compute_logits(hidden[rows])[:, : self.vocab_size]  # [B, V]
            seqs = [samplers[i].seq for i in active]
            if self.logits_observer is not None:
                self.logits_observer([s.request_id for s in seqs], logits)
            # Masks follow each grammar as tokens are appended, so a later row sees the accepted ones.
            allowed = self.grammar_masker.allowed([s.grammar for s in seqs], logits.device)  # [B, V] | None
            chosen = choose_tokens(logits, [s.chooser for s in seqs], [s.all_ids for s in seqs], allowed=allowed,
                                   keep_logprob_rows=any(s.top_n_tokens for s in seqs))
            still = []
            for j, (i, seq) in enumerate(zip(active, seqs)):
                token = chosen.ids[j]
                top = None
                if seq.top_n_tokens and chosen.logprob_rows is not None:
                    top = top_n(chosen.logprob_rows[j], seq.top_n_tokens)
                text, reasons[i] = seq.append_token(token)
                emitted[i].append(EmittedToken(token, chosen.logprobs[j], text, top))
                if reasons[i] is None and accepts(seq.draft, level, token):
                    still.append(i)
            active, level = still, level + 1
        for w, tokens in zip(samplers, emitted):
            if w.seq.draft:
                w.seq.advance(len(tokens))  # rows 0..len-1 held the last token and the accepted drafts
                w.seq.record_verified_run(len(tokens) - 1)
                self.speculation.record(len(w.seq.draft), len(tokens) - 1)
        return [self.outputs.generation(w.seq, tokens, reason, values)
                for w, tokens, reason, values in zip(samplers, emitted, reasons, prefill_values)]

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
            speculate=self.config.speculate,
            support_chunking=self.config.prefill_chunking,
            use_prefix_caching=self.router_prefix_caching,
            attention_impl=self.attention_impl,
            block_size=self.config.block_size,
            lora_adapters=list(self.adapter_table.names),
        )


class SpeculationStats:
    """Drafted and accepted tokens since start (logged every LOG_EVERY verified runs)."""

    LOG_EVERY = 200

    def __init__(self):
        self.runs = self.drafted = self.accepted = 0

    def record(self, drafted: int, accepted: int) -> None:
        self.runs += 1
        self.drafted += drafted
        self.accepted += accepted
        if self.runs % self.LOG_EVERY == 0:
            logger.info("speculation: {} verified runs, acceptance {:.1%}, {:.2f} tokens per run", self.runs,
                        self.acceptance_rate, 1 + self.accepted / self.runs)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


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


def _kv_spec(text_config, block_size: int, dtype: torch.dtype, kv_heads: int) -> KVCacheSpec:
    """`kv_heads`: the heads this rank's attention sees (all of them unsharded)."""
    return KVCacheSpec(
        num_layers=text_config.num_hidden_layers,
        kv_heads=kv_heads,
        head_dim=head_dim(text_config),
        block_size=block_size,
        dtype=dtype,
    )
