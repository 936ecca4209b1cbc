"""The CPU production attention backend (ATTENTION=torch on CPU): the reference's prefill path, and decode rows
without a whole-context gather per layer.

Decode, in order of preference, chosen once per step on the host (`plan`):
1. the native kernel `tgi_vlm::decode_attention` (kernels/cpu/: AVX-512 C reading each sequence's positions from
   the paged cache through its slot list; no copy, no padding), where it loaded and `KernelSettings.native_attention`
   is on. A layer it cannot take (soft-capped logits, Gemma2) gathers this step, and the backend plans the mirror
   from the next step on (`native_unsuitable`);
2. the decode mirror (decode_mirror.py): a dense per-sequence copy each step only appends to, up to a share of
   the KV cache's bytes (EngineConfig.decode_mirror);
3. the reference gather (torch_backend.py).

Why the kernel: a decode step's attention on CPU was either a gather of every sequence's context per layer, or
SDPA over the mirror's dense copy padded to the longest sequence; both run torch's flash kernel one query row per
head: 420 us per layer for 13 sequences of 80-430 positions on the bench model in bf16, against 183 us for the
kernel, and 465 us against 955 with the cache cold as in a serving step (benchmarks/native_decode_attention.py).
torch offers no block-table-aware CPU attention.

What the kernel computes (tests/unit/test_cpu_backend.py holds it to the reference): for each decode row, the
softmax of scaled q.k over positions [start, end) of its sequence, times V; float32 and bfloat16, head sizes that
are multiples of 16 up to 256, any G = Hq / Hkv. Sums are in float32 in another order than torch's: float32
results differ from SDPA's by ~1e-7, bfloat16 ones by up to one bf16 ulp. Soft-capped logits, other dtypes
(float16, an fp8 cache) keep the torch paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tgi_vlm.kernels.cpu import ops
from tgi_vlm.layers.attention.backend import AttentionPattern
from tgi_vlm.layers.attention.decode_mirror import DecodeMirror, MirrorStep
from tgi_vlm.layers.attention.metadata import AttentionMetadata, DecodeGroup
from tgi_vlm.layers.attention.torch_backend import TorchPagedBackend, attend, gather_decode


@dataclass
class NativeDecodeStep:
    """One step's decode rows for `tgi_vlm::decode_attention` (`AttentionMetadata.backend_state`): made on the host
    once per step and shared by the layers, so a layer's call does no per-step work. Positions [start, end) of
    row b are attended: end = kv_len; start from the sliding window and Llama4's attention chunk, the same positions
    `metadata.decode_mask` lets through. The op checks every index itself (slots against the cache, rows against the
    query, positions against the slot index)."""

    group: DecodeGroup
    slot_index: torch.Tensor = field(init=False)  # [B, width] long, contiguous
    _spans: dict = field(default_factory=dict, init=False, repr=False)  # (window, chunk) -> [3, B] long

    def __post_init__(self):
        self.slot_index = self.group.slot_index.contiguous()
        if max(self.group.kv_len_list, default=0) > self.slot_index.shape[1] or self.slot_index.shape[0] != self.num_rows:
            raise ValueError("decode group: a kv_len exceeds its slot index, or rows and slot index disagree")

    @property
    def num_rows(self) -> int:
        return len(self.group.row_list)

    def row_spans(self, sliding_window: int | None, chunk: int | None) -> torch.Tensor:
        """`[3, B]` long: each sequence's query row, first attended position and end (its kv_len)."""
        key = (sliding_window, chunk)
        if key not in self._spans:
            starts = []
            for length in self.group.kv_len_list:
                start = 0
                if sliding_window:
                    start = max(start, length - sliding_window)
                if chunk:
                    start = max(start, (length - 1) // chunk * chunk)
                starts.append(start)
            self._spans[key] = torch.tensor([self.group.row_list, starts, self.group.kv_len_list], dtype=torch.long)
        return self._spans[key]


class CpuPagedBackend(TorchPagedBackend):
    """`decode_mirror`: the mirror may take up to this share of the KV cache's bytes (0: off). `decode_kernel`:
    decode through `tgi_vlm::decode_attention` (the caller checked that it loaded and is switched on)."""

    def __init__(self, pattern: AttentionPattern | None = None, *, decode_mirror: float = 0.0,
                 decode_kernel: bool = False):
        super().__init__(pattern)
        self.mirror_share = decode_mirror  # of the KV cache's bytes; 0: the reference gather path
        self.mirror: DecodeMirror | None = None
        self.decode_kernel = decode_kernel
        self.native_unsuitable = False  # a layer could not use the kernel (soft-capped, dtype): plan the mirror instead

    def release_idle(self) -> None:
        self.mirror = None  # its tensors hold the last batch's K/V copy; rebuilt by the next decode step

    def plan(self, meta: AttentionMetadata) -> None:
        meta.backend_state = None
        if meta.decode is None:
            return
        if self.decode_kernel and not self.native_unsuitable and ops.can_decode_from(*meta.kv_cache.flat(0)):
            self.mirror = None  # not needed while the kernel reads the cache itself
            meta.backend_state = NativeDecodeStep(meta.decode)
            return
        if not self.mirror_share:
            return
        budget = int(self.mirror_share * meta.kv_cache.spec.bytes_per_block * meta.kv_cache.num_blocks)
        if self.mirror is None or self.mirror.budget_bytes != budget:
            self.mirror = DecodeMirror(budget)
        meta.backend_state = self.mirror.plan(meta.decode, meta.kv_cache)

    def _decode(self, layer_idx, q, out, k_cache, v_cache, meta: AttentionMetadata, scaling, sliding_window, chunk,
                softcap) -> None:
        state = meta.backend_state
        if isinstance(state, NativeDecodeStep) and ops.can_decode(q, k_cache, v_cache, softcap):
            scale = scaling if scaling is not None else q.shape[-1] ** -0.5
            ops.decode_attention(q, out, k_cache, v_cache, state.slot_index, state.row_spans(sliding_window, chunk),
                                 scale)
        elif isinstance(state, NativeDecodeStep):
            self.native_unsuitable = True  # from the next step on, the mirror (this one gathers)
            gather_decode(q, out, k_cache, v_cache, meta, scaling, sliding_window, chunk, softcap)
        elif isinstance(state, MirrorStep):
            self._decode_from_mirror(layer_idx, q, out, k_cache, v_cache, state, scaling, sliding_window, chunk,
                                     softcap)
        else:
            gather_decode(q, out, k_cache, v_cache, meta, scaling, sliding_window, chunk, softcap)

    def _decode_from_mirror(self, layer_idx, q, out, k_cache, v_cache, step: MirrorStep, scaling,
                            sliding_window, chunk, softcap) -> None:
        k, v = self.mirror.sync_layer(layer_idx, k_cache, v_cache)  # [B, Hkv, width, D], mirror row order
        q_dec = q.index_select(0, step.token_rows)[:, :, None, :]  # [B, Hq, 1, D]
        mask = self.mirror.mask(step, sliding_window, chunk)
        o = attend(q_dec, k.to(q.dtype), v.to(q.dtype), mask, scaling, softcap)  # [B, Hq, 1, D]
        out.index_copy_(0, step.token_rows, o[:, :, 0])
