"""Paged attention through flashinfer (CUDA only; `pip install tgi-vlm[gpu]`).

Same contract as torch_backend.py (see backend.py): rotary-applied query `[1, Hq, T, D]` and
key/value `[1, Hkv, T, D]`, K/V written at `meta.slots`, `[1, T, Hq, D]` returned. Our cache layout `[num_blocks, block_size, Hkv, D]`
is flashinfer's "NHD" paged layout, with block = page.

Steps are planned, not per layer but per (window, scale, heads, dtype) key:
- decode-only step → `BatchDecodeWithPagedKVCacheWrapper`;
- anything with a prefill chunk → one `BatchPrefillWithPagedKVCacheWrapper` over every sequence
  of the step in row order (decode rows are 1-row queries), causal, sliding windows as
  `window_left = window - 1`; when a span has bidirectional groups (Gemma3 image blocks,
  PaliGemma prefix) the whole step gets a flattened custom mask built by metadata.py's own mask
  functions, window included.
Planning is host work from the metadata's host lengths (no read-back from the device). Eagerly it
happens lazily at the first layer that needs a key; under CUDA graphs `prepare_for_capture` /
`prepare_for_replay` plan every key seen so far on per-size wrappers with fixed buffers, outside
the graph, and the captured layers only `run`.

Chunked attention (Llama4), soft-capped logits and float32 are not expressed here; such layers use
the torch reference. flashinfer is imported lazily, so this module imports on CPU machines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from loguru import logger

from tgi_vlm.layers.attention.backend import AttentionBackend, AttentionPattern
from tgi_vlm.layers.attention.metadata import AttentionMetadata
from tgi_vlm.layers.attention.torch_backend import TorchPagedBackend, write_kv

WORKSPACE_BYTES = 256 << 20  # flashinfer's split-k scratch, shared by every wrapper
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class PlanKey:
    window_left: int  # -1: no sliding window
    sm_scale: float
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


@dataclass
class PagedLayout:
    """The step as flashinfer's CSR page tables. Host tensors except `kv_indices` (device)."""

    qo_indptr: torch.Tensor  # [n+1] int32: query rows of sequence i are [qo_indptr[i], qo_indptr[i+1])
    kv_indptr: torch.Tensor  # [n+1] int32: its pages are kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices: torch.Tensor  # [num_pages] int32 on the device
    last_page_len: torch.Tensor  # [n] int32, 1..page_size
    kv_lens: list[int]
    decode_only: bool
    spans: list  # per sequence: ("decode", row index in the group) or ("span", prefill index)


@dataclass
class StepPlans:
    layout: PagedLayout
    graph_size: int | None  # set for a CUDA-graph's static metadata
    wrappers: dict[PlanKey, object] = field(default_factory=dict)


def flashinfer_available() -> bool:
    """True when CUDA is available and `import flashinfer` works (else the torch backend is used)."""
    if not torch.cuda.is_available():
        return False
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # a missing or broken install (ABI mismatch) must not break the torch path
        logger.debug("flashinfer unavailable: {}", exc)
        return False
    return True


class FlashinferBackend(AttentionBackend):
    """flashinfer's paged wrappers, planned on the host; the torch reference for what it can't express."""

    name = "flashinfer"

    def __init__(self, pattern: AttentionPattern | None = None):
        super().__init__(pattern)
        self.fallback = TorchPagedBackend(self.pattern)
        self.keys: set[PlanKey] = set()  # every key seen; CUDA-graph plans cover all of them
        self._workspace: torch.Tensor | None = None
        self._eager: dict[tuple[bool, PlanKey], object] = {}  # (decode, key) → wrapper, reused across steps
        # (size, page capacity, key) → decode wrapper with fixed buffers; a re-capture with wider static
        # inputs (a second Warmup, larger max_total_tokens) needs room for more pages than the old one had.
        self._graph: dict[tuple[int, int, PlanKey], object] = {}

    def forward(self, layer_idx, query, key, value, meta: AttentionMetadata, *, scaling, sliding_window,
                softcap=None) -> torch.Tensor:
        if self.pattern.chunk_size(layer_idx) or softcap or query.dtype not in SUPPORTED_DTYPES:
            return self.fallback.forward(layer_idx, query, key, value, meta, scaling=scaling,
                                         sliding_window=sliding_window, softcap=softcap)
        k_cache, v_cache = meta.kv_cache.flat(layer_idx)  # [slots, Hkv, D]
        write_kv(k_cache, v_cache, key, value, meta.slots)
        q = query[0].transpose(0, 1).contiguous()  # [T, Hq, D]
        plan_key = PlanKey(
            window_left=sliding_window - 1 if sliding_window else -1,
            sm_scale=float(scaling if scaling is not None else q.shape[-1] ** -0.5),
            num_qo_heads=q.shape[1],
            num_kv_heads=key.shape[1],
            head_dim=q.shape[2],
            dtype=q.dtype,
        )
        wrapper = self._wrapper(meta, plan_key)
        cache = (meta.kv_cache.keys[layer_idx], meta.kv_cache.values[layer_idx])
        return wrapper.run(q, cache)[None]  # [1, T, Hq, D]

    # ----- lifecycle (host side, outside any graph) -----
    def plan(self, meta: AttentionMetadata) -> None:
        """The step's page tables; wrappers are planned per key at the first layer that needs one."""
        meta.backend_state = StepPlans(build_layout(meta), graph_size=None)

    def prepare_for_replay(self, meta: AttentionMetadata, size: int) -> None:
        """Re-plan every known key on this size's fixed-buffer wrappers from the refilled static metadata."""
        plans = StepPlans(build_layout(meta), graph_size=size)
        meta.backend_state = plans
        for plan_key in self.keys:
            plans.wrappers[plan_key] = self._plan(meta, plans, plan_key)

    # ----- planning -----
    def _wrapper(self, meta: AttentionMetadata, plan_key: PlanKey):
        plans: StepPlans | None = meta.backend_state
        if plans is None:
            self.plan(meta)
            plans = meta.backend_state
        wrapper = plans.wrappers.get(plan_key)
        if wrapper is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"flashinfer: attention key {plan_key} first seen inside CUDA-graph capture; "
                                   "run one eager forward first (warmup does)")
            self.keys.add(plan_key)
            wrapper = plans.wrappers[plan_key] = self._plan(meta, plans, plan_key)
        return wrapper

    def _plan(self, meta: AttentionMetadata, plans: StepPlans, plan_key: PlanKey):
        layout = plans.layout
        page_size = meta.kv_cache.spec.block_size
        common = dict(sm_scale=plan_key.sm_scale, q_data_type=plan_key.dtype, kv_data_type=plan_key.dtype)
        heads = (plan_key.num_qo_heads, plan_key.num_kv_heads, plan_key.head_dim, page_size)
        if layout.decode_only:
            wrapper = self._decode_wrapper(meta, plans.graph_size, plan_key)
            wrapper.plan(layout.kv_indptr, layout.kv_indices, layout.last_page_len, *heads,
                         window_left=plan_key.window_left, **common)
            return wrapper
        if plans.graph_size is not None:
            raise RuntimeError("flashinfer: CUDA graphs capture decode-only steps")
        wrapper = self._prefill_wrapper(meta, plan_key)
        mask = custom_mask(meta, layout, plan_key.window_left)
        qo_indptr, kv_indptr, last_page_len = layout.qo_indptr, layout.kv_indptr, layout.last_page_len
        if mask is not None:
            # flashinfer <= 0.6.17 packs the mask with an indptr derived from qo_indptr's device, and its
            # segment_packbits kernel requires that indptr on the mask's (CUDA) device.
            device = mask.device
            qo_indptr, kv_indptr, last_page_len = (t.to(device) for t in (qo_indptr, kv_indptr, last_page_len))
        wrapper.plan(qo_indptr, kv_indptr, layout.kv_indices, last_page_len, *heads,
                     custom_mask=mask, causal=mask is None,
                     window_left=-1 if mask is not None else plan_key.window_left, **common)
        return wrapper

    def _workspace_for(self, device: torch.device) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace

    def _prefill_wrapper(self, meta: AttentionMetadata, plan_key: PlanKey):
        import flashinfer

        index = (False, plan_key)
        if index not in self._eager:
            workspace = self._workspace_for(meta.slots.device)
            self._eager[index] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        return self._eager[index]

    def _decode_wrapper(self, meta: AttentionMetadata, graph_size: int | None, plan_key: PlanKey):
        import flashinfer

        workspace = self._workspace_for(meta.slots.device)
        if graph_size is None:
            index = (True, plan_key)
            if index not in self._eager:
                self._eager[index] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    workspace, "NHD", use_tensor_cores=True)
            return self._eager[index]
        max_pages = graph_size * _pages(meta.decode.slot_index.shape[1], meta.kv_cache.spec.block_size)
        index = (graph_size, max_pages, plan_key)
        if index not in self._graph:
            device = meta.slots.device
            int32 = dict(dtype=torch.int32, device=device)
            self._graph[index] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.zeros(graph_size + 1, **int32),
                paged_kv_indices_buffer=torch.zeros(max_pages, **int32),
                paged_kv_last_page_len_buffer=torch.zeros(graph_size, **int32),
            )
        return self._graph[index]


def _pages(tokens: int, page_size: int) -> int:
    return (tokens + page_size - 1) // page_size


def build_layout(meta: AttentionMetadata) -> PagedLayout:
    """Page tables for the step, sequences in row order, from host lengths only (no device read-back).
    Assumes block-aligned slots (TGI's router and our allocator both give whole blocks): position p
    of a sequence is in page slot_index[p] // bs."""
    page_size = meta.kv_cache.spec.block_size
    entries = []  # (q_start, q_len, kv_len, slot_index [kv_len], origin)
    if meta.decode is not None:
        group = meta.decode
        for i, (row, n) in enumerate(zip(group.row_list, group.kv_len_list)):
            entries.append((row, 1, n, group.slot_index[i, :n], ("decode", i)))
    for index, span in enumerate(meta.prefills):
        entries.append((span.q_start, span.q_len, span.kv_len, span.slot_index[: span.kv_len], ("span", index)))
    entries.sort(key=lambda e: e[0])
    q_lens = [e[1] for e in entries]
    kv_lens = [e[2] for e in entries]
    pages = [_pages(n, page_size) for n in kv_lens]
    kv_indices = torch.cat([e[3][::page_size] // page_size for e in entries]).to(torch.int32)
    return PagedLayout(
        qo_indptr=_indptr(q_lens),
        kv_indptr=_indptr(pages),
        kv_indices=kv_indices,
        last_page_len=torch.tensor([n - (p - 1) * page_size for n, p in zip(kv_lens, pages)], dtype=torch.int32),
        kv_lens=kv_lens,
        decode_only=not meta.prefills,
        spans=[e[4] for e in entries],
    )


def _indptr(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return out


def custom_mask(meta: AttentionMetadata, layout: PagedLayout, window_left: int) -> torch.Tensor | None:
    """Flattened `[sum(q_len_i * kv_len_i)]` bool mask when some span has bidirectional groups, else None.

    Built from metadata.py's masks, so flashinfer and the torch reference see the same pattern."""
    if not any(span.bidirectional_groups is not None for span in meta.prefills):
        return None
    window = window_left + 1 if window_left >= 0 else None
    parts = []
    for (kind, index), kv_len in zip(layout.spans, layout.kv_lens):
        if kind == "span":
            parts.append(meta.prefill_mask(index, window, None).reshape(-1))
        else:  # a decode row: its last position sees every key in the window
            k_pos = torch.arange(kv_len, device=meta.slots.device)
            parts.append(k_pos > kv_len - 1 - window if window else torch.ones_like(k_pos, dtype=torch.bool))
    return torch.cat(parts)
