"""Paged attention: KV cache, per-step metadata, and backends the model owns.

One dispatcher is registered with transformers under ATTENTION_NAME (backend.py); the backend
object itself is created per model (`make_backend`) from `EngineConfig.attention` (TGI's
ATTENTION variable) and carried by each step's metadata.
"""

from __future__ import annotations

from loguru import logger

from tgi_vlm.layers.attention import native_decode
from tgi_vlm.layers.attention.backend import (
    ATTENTION_NAME,
    AttentionBackend,
    AttentionPattern,
    paged_attention,
    register_paged_attention,
)
from tgi_vlm.layers.attention.flashinfer_backend import FlashinferBackend, flashinfer_available
from tgi_vlm.layers.attention.kv_cache import KVCacheSpec, PagedKVCache
from tgi_vlm.layers.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSpan
from tgi_vlm.layers.attention.torch_backend import TorchPagedBackend

# TGI's ATTENTION values → our backend. "paged" and "flashdecoding" are TGI's own CUDA kernels;
# here they map to the paged torch reference, which implements the same paged semantics.
BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchPagedBackend, "flashinfer": FlashinferBackend}
ALIASES = {"paged": "torch", "flashdecoding": "torch"}


def resolve_backend(requested: str, device: str) -> str:
    """The backend that will actually run for TGI's ATTENTION value on `device` (Info reports it)."""
    name = ALIASES.get(requested, requested)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {requested!r}; known: {', '.join(sorted(BACKENDS) + sorted(ALIASES))}")
    if name == "flashinfer":
        if not device.startswith("cuda"):
            logger.info("ATTENTION=flashinfer needs CUDA; using the torch paged backend on {}", device)
            return "torch"
        if not flashinfer_available():
            logger.warning("ATTENTION=flashinfer but the flashinfer backend is unavailable; using torch")
            return "torch"
    return name


def make_backend(name: str, pattern: AttentionPattern | None = None, *, decode_mirror: float = 0.0,
                 native_attention: bool = False) -> AttentionBackend:
    """A new backend instance for one model (`name` as returned by resolve_backend). `decode_mirror`: the
    torch backend's dense decode copy may take up to this share of the KV cache's bytes (0: off).
    `native_attention`: the torch backend decodes through the C kernel (native_decode.py) where it loads."""
    if name == "torch":
        native = native_decode.load() if native_attention else None
        return TorchPagedBackend(pattern, decode_mirror=decode_mirror, native=native)
    return BACKENDS[name](pattern)


__all__ = [
    "ATTENTION_NAME",
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionPattern",
    "DecodeGroup",
    "FlashinferBackend",
    "KVCacheSpec",
    "PagedKVCache",
    "PrefillSpan",
    "TorchPagedBackend",
    "make_backend",
    "paged_attention",
    "register_paged_attention",
    "resolve_backend",
]
