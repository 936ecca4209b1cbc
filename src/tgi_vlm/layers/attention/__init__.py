"""Paged attention: KV cache, per-step metadata, and backends the model owns.

One dispatcher is registered with transformers under ATTENTION_NAME (backend.py); the backend
object itself is created per model (`make_backend`) from `EngineConfig.attention` (TGI's
ATTENTION variable) and carried by each step's metadata. ATTENTION=torch is the reference
(torch_backend.py) on GPU and the CPU production backend (cpu_backend.py, its subclass) on CPU.
"""

from __future__ import annotations

from loguru import logger

from tgi_vlm.config import KernelSettings
from tgi_vlm.kernels import cpu as cpu_kernels
from tgi_vlm.layers.attention.backend import (
    ATTENTION_NAME,
    AttentionBackend,
    AttentionPattern,
    paged_attention,
    register_paged_attention,
)
from tgi_vlm.layers.attention.cpu_backend import CpuPagedBackend, NativeDecodeStep
from tgi_vlm.layers.attention.flashinfer_backend import FlashinferBackend, flashinfer_available
from tgi_vlm.layers.attention.kv_cache import KVCacheSpec, PagedKVCache
from tgi_vlm.layers.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSpan
from tgi_vlm.layers.attention.torch_backend import TorchPagedBackend

# TGI's ATTENTION values → our backend. "paged" and "flashdecoding" are TGI's own CUDA kernels;
# here they map to the paged torch backend, which implements the same paged semantics (on CPU,
# `make_backend` gives its CPU subclass).
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


def make_backend(name: str, pattern: AttentionPattern | None = None, *, device: str | None = None,
                 decode_mirror: float = 0.0, kernels: KernelSettings | None = None) -> AttentionBackend:
    """A new backend instance for one model (`name` as returned by resolve_backend). "torch" on a CPU `device` is
    the CPU backend: its dense decode copy may take up to `decode_mirror` of the KV cache's bytes (0: off), and it
    decodes through `tgi_vlm::decode_attention` where `kernels.native_attention` is on and the kernel loads
    (EngineConfig.native_attention_on: CPU only). Elsewhere (`device` None or a GPU) "torch" is the reference."""
    if name == "torch" and device is not None and device.startswith("cpu"):
        return CpuPagedBackend(pattern, decode_mirror=decode_mirror, decode_kernel=_decode_kernel(kernels))
    return BACKENDS[name](pattern)


def _decode_kernel(kernels: KernelSettings | None) -> bool:
    """Whether the CPU backend decodes through the native kernel: switched on, and loaded (built on first use)."""
    return kernels is not None and kernels.native_attention and cpu_kernels.load(kernels).available("decode_attention")


__all__ = [
    "ATTENTION_NAME",
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionPattern",
    "CpuPagedBackend",
    "DecodeGroup",
    "FlashinferBackend",
    "KVCacheSpec",
    "NativeDecodeStep",
    "PagedKVCache",
    "PrefillSpan",
    "TorchPagedBackend",
    "make_backend",
    "paged_attention",
    "register_paged_attention",
    "resolve_backend",
]
