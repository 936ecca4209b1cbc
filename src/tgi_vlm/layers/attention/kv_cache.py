"""Paged KV cache tensors (block arithmetic and the free list: `tgi_vlm.blocks`).

Layout per layer: K and V are `[num_blocks, block_size, kv_heads, head_dim]`; token position p of
a sequence lives at slot `block_table[p // block_size] * block_size + p % block_size`. Block 0 is
reserved: TGI's liveness prefill and CUDA-graph padding write there, so it is never handed out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.kv_heads * self.head_dim * element


class PagedKVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str):
        if num_blocks < 2:
            raise ValueError(f"a KV cache needs at least 2 blocks (block 0 is reserved), got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (num_blocks, spec.block_size, spec.kv_heads, spec.head_dim)
        self.keys = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self.values = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as `[num_slots, kv_heads, head_dim]` views."""
        k, v = self.keys[layer], self.values[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.spec.block_size
