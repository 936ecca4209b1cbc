"""The attention backend interface: an object each model owns, not a process-wide registration.

transformers calls attention through its registry by name. We register ONE function under
ATTENTION_NAME (`paged_attention`), once, and it forwards to the backend carried by the step's
`AttentionMetadata` — so two models in one process never share a backend, and a CUDA graph
replays with the backend of the model that captured it.

Lifecycle of a backend (all host work is outside the layers and outside captured graphs):
- `plan(meta)`: once per eager step, on the host, before the forward (may precompute per-step state
  in `meta.backend_state`). Must not read device tensors back (no host sync): every length it
  needs is in the metadata's host fields.
- `forward(...)`: per layer, inside the model's forward (and inside a captured graph).
- `prepare_for_capture(meta, size)` / `prepare_for_replay(meta, size)`: on the host, before a
  CUDA graph of batch size `size` is captured / replayed over the static metadata `meta`.
  What a captured graph may hold: the static metadata's tensors and whatever device buffers the
  backend planned into for that size; never Python lists or per-step tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from tgi_vlm.layers.attention.metadata import AttentionMetadata

ATTENTION_NAME = "tgi_vlm_paged"


@dataclass(frozen=True)
class AttentionPattern:
    """Per-layer attention facts the model (its adapter) declares; the backend never reads configs.

    `chunk_sizes[layer]`: the layer attends only within fixed position chunks of that size
    (Llama4's chunked-attention layers). Sliding windows arrive from transformers per call.
    """

    chunk_sizes: dict[int, int] = field(default_factory=dict)

    def chunk_size(self, layer_idx: int) -> int | None:
        return self.chunk_sizes.get(layer_idx)


class AttentionBackend(ABC):
    name: ClassVar[str]
    # forward takes `kv_written=True`: the caller stored the step's K/V at `meta.slots` itself (the lean CPU
    # layer's fused rotary + store); backends that cannot skip their own write leave this False.
    takes_written_kv: ClassVar[bool] = False

    def __init__(self, pattern: AttentionPattern | None = None):
        self.pattern = pattern or AttentionPattern()

    def plan(self, meta: AttentionMetadata) -> None:
        """Host-side preparation for one eager step (default: nothing)."""
        return None

    @abstractmethod
    def forward(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                meta: AttentionMetadata, *, scaling: float | None, sliding_window: int | None,
                softcap: float | None = None) -> torch.Tensor:
        """Write this step's K/V at `meta.slots`, attend; query `[1, Hq, T, D]`, K/V `[1, Hkv, T, D]`
        (rotary applied) → `[1, T, Hq, D]`."""

    def release_idle(self) -> None:
        """No sequence is left: give back state kept between steps (default: nothing)."""
        return None

    def prepare_for_capture(self, meta: AttentionMetadata, size: int) -> None:
        self.prepare_for_replay(meta, size)

    def prepare_for_replay(self, meta: AttentionMetadata, size: int) -> None:
        """Host work before a replay of the graph of batch size `size` (default: nothing)."""
        return None


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    sliding_window: int | None = None, softcap: float | None = None,
                    attn_metadata: AttentionMetadata | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """The function transformers calls (registered under ATTENTION_NAME): dispatch to the step's backend."""
    if attn_metadata is None:
        raise RuntimeError("tgi_vlm paged attention called without attn_metadata (use the engine's forward)")
    out = attn_metadata.backend.forward(module.layer_idx, query, key, value, attn_metadata,
                                        scaling=scaling, sliding_window=sliding_window, softcap=softcap)
    return out, None


def register_paged_attention() -> str:
    """Register the dispatcher with transformers (idempotent); the name goes in `attn_implementation`."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    return ATTENTION_NAME
