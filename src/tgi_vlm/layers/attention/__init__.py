"""Attention backends, registered with transformers' AttentionInterface under one name.

The engine loads models with `attn_implementation=ATTENTION_NAME` for the text sub-config; the
backend behind that name is chosen from `EngineConfig.attention` (TGI's ATTENTION variable).
"""

from __future__ import annotations

from collections.abc import Callable

from loguru import logger
from transformers import AttentionInterface

from tgi_vlm.layers.attention.flashinfer_backend import flashinfer_backend
from tgi_vlm.layers.attention.kv_cache import BlockAllocator, KVCacheSpec, PagedKVCache, blocks_needed
from tgi_vlm.layers.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSpan
from tgi_vlm.layers.attention.torch_backend import torch_paged_attention

ATTENTION_NAME = "tgi_vlm_paged"

# TGI's ATTENTION values → our backend. "paged" and "flashdecoding" are TGI's own CUDA kernels;
# here they map to the paged torch reference, which implements the same paged semantics.
BACKENDS: dict[str, Callable] = {"torch": torch_paged_attention}
ALIASES = {"paged": "torch", "flashdecoding": "torch"}
_flashinfer = flashinfer_backend()  # None without CUDA or without a working `import flashinfer`
if _flashinfer is not None:
    BACKENDS["flashinfer"] = _flashinfer


def resolve_backend(requested: str, device: str) -> str:
    name = ALIASES.get(requested, requested)
    if name == "flashinfer":
        if not device.startswith("cuda"):
            logger.info("ATTENTION=flashinfer needs CUDA; using the torch paged backend on {}", device)
            return "torch"
        if "flashinfer" not in BACKENDS:
            logger.warning("ATTENTION=flashinfer but the flashinfer backend is unavailable; using torch")
            return "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {requested!r}; known: {', '.join(sorted(BACKENDS) + sorted(ALIASES))}")
    return name


def register_attention(backend: str) -> str:
    """Register `backend` under ATTENTION_NAME and return that name for `attn_implementation`."""
    AttentionInterface.register(ATTENTION_NAME, BACKENDS[backend])
    return ATTENTION_NAME


__all__ = [
    "ATTENTION_NAME",
    "AttentionMetadata",
    "BlockAllocator",
    "DecodeGroup",
    "KVCacheSpec",
    "PagedKVCache",
    "PrefillSpan",
    "blocks_needed",
    "register_attention",
    "resolve_backend",
]
