"""Warmup: run the router's warmup batch once, then size the KV cache.

The warmup forward runs on a temporary cache just large enough for the batch, so that on a GPU
the free memory measured afterwards already accounts for activations. The real cache is then
sized from free memory × CUDA_MEMORY_FRACTION × TGI_WIGGLE_ROOM (GPU) or from the CPU byte
budget, and the router's limits are filled in the way TGI's router expects.
"""

from __future__ import annotations

import time

import torch
from loguru import logger

from tgi_vlm.blocks import blocks_needed
from tgi_vlm.errors import InvalidArgument
from tgi_vlm.layers.linear.plan import prime_packed_kernels
from tgi_vlm.models.cuda_graphs import setup_decode_graphs
from tgi_vlm.models.flash_causal_lm import LOGPROB_CHUNK_ROWS
from tgi_vlm.pb import generate_pb2


def run_warmup(model, request: generate_pb2.WarmupRequest) -> tuple[int, int, int]:
    max_prefill = request.max_prefill_tokens
    model.reset_limits()
    _run_warmup_batch(model, request.batch, max_prefill)
    if model.device.type == "cpu":
        _build_cpu_kernels(model, max_prefill)
    if model.device.type == "cuda":
        # Measure while the warmup's peak activations are still reserved by the caching allocator and
        # its temporary cache is still held (its blocks are added back), as TGI does.
        torch.cuda.synchronize(model.device)
    temporary_blocks = model.kv_cache.num_blocks if model.kv_cache is not None else 0
    num_blocks = model.default_num_blocks(reclaimable_blocks=temporary_blocks)
    model.allocate_kv_cache(num_blocks)
    supported = num_blocks * model.config.block_size
    model.set_prefill_budget(max_prefill)

    max_total = request.max_total_tokens if request.HasField("max_total_tokens") else None
    max_input = request.max_input_tokens if request.HasField("max_input_tokens") else None
    if max_total is None:
        limits = [supported, _max_positions(model)]
        max_total = min(v for v in limits if v)
    if max_input is None:
        max_input = max_total - 1
    if max_input >= max_total:
        raise InvalidArgument(f"max_input_tokens ({max_input}) must be below max_total_tokens ({max_total})")
    model.set_max_total_tokens(max_total)
    model.graphs = setup_decode_graphs(model, max_total)  # None unless on CUDA with CUDA_GRAPHS set
    logger.info("KV cache: {} blocks of {} tokens ({} tokens)", num_blocks, model.config.block_size, supported)
    return supported, max_input, max_total


def _build_cpu_kernels(model, max_prefill: int) -> None:
    """After the warmup batch (which packed the weights it used): oneDNN's kernels for every row count a
    prefill step up to the budget can bring, built now rather than in the first serving steps."""
    start = time.perf_counter()
    # the lm-head meets one row per sequence, or logprob chunks (FlashCausalLM.record_prefill_logprobs)
    caps = {model.lm_head: LOGPROB_CHUNK_ROWS} if model.lm_head is not None else {}
    products, rows = prime_packed_kernels(model.model, max(max_prefill, 1), row_caps=caps)
    if products:
        logger.info("CPU: kernels for {} packed products (row buckets up to {}) built in {:.1f} s", products, rows,
                    time.perf_counter() - start)


def _run_warmup_batch(model, pb_batch: generate_pb2.Batch, max_prefill: int) -> None:
    if not pb_batch.requests:
        return
    model.set_prefill_budget(max(max_prefill, 1))
    bs = model.config.block_size
    lengths = [len(model.tokenize_request(r, warmup=True).ids) for r in pb_batch.requests]
    model.allocate_kv_cache(1 + sum(blocks_needed(n + 1, bs) for n in lengths))  # + reserved block 0
    batch = model.batch_from_pb(pb_batch, warmup=True)
    try:
        model.generate_token(batch)
    finally:
        batch.release()


def _max_positions(model) -> int | None:
    value = getattr(model.text_config, "max_position_embeddings", None)
    tok_max = getattr(model.tokenizer, "model_max_length", None)
    candidates = [v for v in (value, tok_max) if isinstance(v, int) and 0 < v < 10**8]
    return min(candidates) if candidates else None
