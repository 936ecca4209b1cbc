"""A CPU stand-in for `flashinfer`'s two paged-KV wrappers, to test what tgi_vlm plans.

Tests put this module in `sys.modules["flashinfer"]` with `install(monkeypatch)`. Signatures are flashinfer-python 0.7.4's, read from the
PyPI wheel (`flashinfer/decode.py` `BatchDecodeWithPagedKVCacheWrapper`, `flashinfer/prefill.py`
`BatchPrefillWithPagedKVCacheWrapper`): the constructors, `plan` (decode: the optional arguments
after `page_size` keyword-only, positional ones merged with a DeprecationWarning as 0.7.4 does;
prefill: positional-or-keyword) and `run(q, paged_kv_cache)`.

What is kept from the real wrappers, so planning mistakes show up as wrong numbers or errors:
- `plan` checks and snapshots the CSR page tables (int32 `indptr` / `indices` / `last_page_len`);
  with `use_cuda_graph=True` it copies them into the caller's fixed buffers (batch size fixed by
  the buffers, indices must fit) and `run` reads those buffers, as a captured kernel would: a
  replay without a re-plan attends over the old tables.
- `run` attends from the PLANNED tables only. Request i has kv length
  `(pages_i - 1) * page_size + last_page_len[i]`; its query rows `qo_indptr[i]..qo_indptr[i+1]`
  are its last positions (bottom-right aligned). `causal` applies only without `custom_mask`;
  `custom_mask` is the row-major `[q_len_i, kv_len_i]` masks concatenated; `window_left >= 0`
  keeps keys `k >= q - window_left`, with or without a mask; `sm_scale` defaults to
  `head_dim ** -0.5`; `logits_soft_cap` caps the scaled logits. Math in float32, output in
  `o_data_type`; a row with no visible key is zero.
- `run` refuses q / cache dtypes other than the planned ones (`_check_cached_qkv_data_type`) and a
  `window_left` other than the planned one.
- `plan` copies `qo_indptr` / `paged_kv_indptr` / `paged_kv_last_page_len` to the host (0.7.4
  does, for its scheduler): `read_backs` names those that were not host tensors, i.e. a sync.
Not modelled, and refused (NotImplementedError): rope inside the kernel, fp8 scales, sinks, lse,
packed masks, multi-token decode, non-default backends and JIT variants. Any device is accepted;
on the `meta` device (shape-only tensors) plan skips the value checks and run returns an empty
output, so a test can show planning never reads a device value.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

__version__ = "0.7.4"  # the release whose signatures this mirrors

created: list = []  # every wrapper constructed since `reset()`, for tests to inspect

# flashinfer 0.7.4 decode.py: optional plan() arguments that may still come positionally.
_BATCH_DECODE_PLAN_LEGACY_POS_ARGS = (
    "pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type", "kv_data_type", "o_data_type",
    "data_type", "sm_scale", "rope_scale", "rope_theta", "non_blocking", "block_tables", "seq_lens",
    "fixed_split_size", "disable_split_kv", "q_len_per_req",
)  # fmt: skip


def reset() -> None:
    created.clear()


def install(monkeypatch, *, float32: bool = True):
    """`import flashinfer` gives this module for one test (and `created` starts empty).

    CPU-only torch cannot answer `torch.cuda.is_current_stream_capturing` (it raises without a
    driver), so it answers False. `float32=True` lets the backend take float32 layers, so it can be
    compared with the torch reference exactly instead of within bf16 tolerance."""
    import sys

    from tgi_vlm.layers.attention import flashinfer_backend

    reset()
    module = sys.modules[__name__]
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(flashinfer_backend, "WORKSPACE_BYTES", 1024)  # not 256 MiB of CPU memory per backend
    if float32:
        dtypes = (torch.float16, torch.bfloat16, torch.float32)
        monkeypatch.setattr(flashinfer_backend, "SUPPORTED_DTYPES", dtypes)
    return module


@dataclass
class Planned:
    """What one `plan` fixed. In CUDA-graph mode the tensors are the wrapper's fixed buffers."""

    qo_indptr: torch.Tensor  # [batch+1] int32
    kv_indptr: torch.Tensor  # [batch+1] int32
    kv_indices: torch.Tensor  # [>= kv_indptr[-1]] int32
    last_page_len: torch.Tensor  # [batch] int32
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    causal: bool
    custom_mask: torch.Tensor | None  # flattened bool
    window_left: int
    sm_scale: float
    logits_soft_cap: float
    q_data_type: torch.dtype
    kv_data_type: torch.dtype
    o_data_type: torch.dtype


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None,
        paged_kv_indptr_buf: torch.Tensor | None = None,
        paged_kv_indices_buf: torch.Tensor | None = None,
        paged_kv_last_page_len_buf: torch.Tensor | None = None,
        custom_mask_buf: torch.Tensor | None = None,
        mask_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args: list[Any] | None = None,
        jit_kwargs: dict[str, Any] | None = None,
        variant_owns_mask: bool = False,
        max_total_num_rows: int | None = None,
    ) -> None:
        _check_init(float_workspace_buffer, kv_layout, backend, jit_args)
        if use_cuda_graph:
            fixed = len(paged_kv_last_page_len_buf) if torch.is_tensor(paged_kv_last_page_len_buf) else -1
            _check_graph_buffers(fixed, qo_indptr_buf=qo_indptr_buf, paged_kv_indptr_buf=paged_kv_indptr_buf,
                                 paged_kv_indices_buf=paged_kv_indices_buf,
                                 paged_kv_last_page_len_buf=paged_kv_last_page_len_buf)
        self.device = float_workspace_buffer.device
        self.kv_layout = kv_layout
        self.use_cuda_graph = use_cuda_graph
        self.buffers = (qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf, paged_kv_last_page_len_buf)
        self.plan_calls = 0
        self.planned: Planned | None = None
        self.read_backs: list[str] = []  # the last plan's tables that were not on the host
        created.append(self)

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: int | None = None,
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type: str | torch.dtype = "float16",
        kv_data_type: str | torch.dtype | None = None,
        o_data_type: str | torch.dtype | None = None,
        non_blocking: bool = True,
        prefix_len_ptr: torch.Tensor | None = None,
        token_pos_in_items_ptr: torch.Tensor | None = None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        seq_lens_q: torch.Tensor | None = None,
        block_tables: torch.Tensor | None = None,
        max_token_per_sequence: int | None = None,
        max_sequence_kv: int | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
        uniform_q_len: int | None = None,
        use_token_head_sf: bool = False,
    ) -> None:
        _unsupported(pos_encoding_mode=pos_encoding_mode, packed_custom_mask=packed_custom_mask,
                     prefix_len_ptr=prefix_len_ptr, token_pos_in_items_ptr=token_pos_in_items_ptr,
                     seq_lens=seq_lens, block_tables=block_tables, use_token_head_sf=use_token_head_sf)
        if head_dim_vo not in (None, head_dim_qk):
            raise NotImplementedError("fake flashinfer: head_dim_vo != head_dim_qk")
        batch = len(qo_indptr) - 1
        tables = _check_tables(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, batch, page_size)
        self.read_backs = _read_backs(qo_indptr=qo_indptr, paged_kv_indptr=paged_kv_indptr,
                                      paged_kv_last_page_len=paged_kv_last_page_len)
        if custom_mask is not None and _readable(tables):
            expected = int(sum(q * k for q, k in zip(_lengths(tables[0]), _kv_lens(tables, page_size))))
            if custom_mask.dtype != torch.bool or custom_mask.numel() != expected:
                raise ValueError(f"custom_mask must be a flat bool tensor of sum(q_len*kv_len) = {expected} "
                                 f"elements, got {custom_mask.dtype} {tuple(custom_mask.shape)}")
        if custom_mask is not None:
            custom_mask = custom_mask.reshape(-1).clone()
        tables = _store(self, tables, batch)
        self.planned = _planned(tables, num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal=causal,
                                custom_mask=custom_mask, window_left=window_left, sm_scale=sm_scale,
                                logits_soft_cap=logits_soft_cap, q_data_type=q_data_type,
                                kv_data_type=kv_data_type, o_data_type=o_data_type)
        self.plan_calls += 1

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        *args,
        q_scale: float | torch.Tensor | None = None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        lse_base: str = "log2",
        lse_layout: str = "NH",
        enable_pdl: bool | None = None,
        window_left: int | None = None,
        sinks: torch.Tensor | None = None,
        kv_cache_sf: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        skip_softmax_threshold_scale_factor: float | None = None,
        use_fp16_softmax: bool | None = None,
        uses_spcompress: bool | None = None,
    ) -> torch.Tensor:
        _unsupported_run(args, q_scale, k_scale, v_scale, lse, return_lse, sinks, kv_cache_sf)
        return _run(self, q, paged_kv_cache, out, window_left)


class BatchDecodeWithPagedKVCacheWrapper:
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args: list[Any] | None = None,
        jit_kwargs: dict[str, Any] | None = None,
    ) -> None:
        _check_init(float_workspace_buffer, kv_layout, backend, jit_args)
        qo_indptr_buf = None
        if use_cuda_graph:
            fixed = len(paged_kv_last_page_len_buffer) if torch.is_tensor(paged_kv_last_page_len_buffer) else -1
            _check_graph_buffers(fixed, paged_kv_indptr_buffer=paged_kv_indptr_buffer,
                                 paged_kv_indices_buffer=paged_kv_indices_buffer,
                                 paged_kv_last_page_len_buffer=paged_kv_last_page_len_buffer)
            qo_indptr_buf = torch.arange(fixed + 1, dtype=torch.int32, device=float_workspace_buffer.device)
        self.device = float_workspace_buffer.device
        self.kv_layout = kv_layout
        self.use_cuda_graph = use_cuda_graph
        self.use_tensor_cores = use_tensor_cores
        self.buffers = (qo_indptr_buf, paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self.plan_calls = 0
        self.planned: Planned | None = None
        self.read_backs: list[str] = []  # the last plan's tables that were not on the host
        created.append(self)

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *deprecated_positional_args: Any,
        **kwargs: Any,
    ) -> None:
        if deprecated_positional_args:
            if len(deprecated_positional_args) > len(_BATCH_DECODE_PLAN_LEGACY_POS_ARGS):
                raise TypeError("BatchDecodeWithPagedKVCacheWrapper.plan() accepts at most "
                                f"{len(_BATCH_DECODE_PLAN_LEGACY_POS_ARGS)} deprecated optional positional arguments")
            for name, value in zip(_BATCH_DECODE_PLAN_LEGACY_POS_ARGS, deprecated_positional_args):
                if name in kwargs:
                    raise TypeError(f"BatchDecodeWithPagedKVCacheWrapper.plan() got multiple values for argument {name!r}")
                kwargs[name] = value
            warnings.warn("Passing optional arguments to BatchDecodeWithPagedKVCacheWrapper.plan() positionally is "
                          "deprecated", DeprecationWarning, stacklevel=2)
        self._plan_impl(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kwargs)

    def _plan_impl(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        window_right: int = 0,
        logits_soft_cap: float | None = None,
        q_data_type: str | torch.dtype | None = "float16",
        kv_data_type: str | torch.dtype | None = None,
        o_data_type: str | torch.dtype | None = None,
        data_type: str | torch.dtype | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        non_blocking: bool = True,
        block_tables: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
        q_len_per_req: int = 1,
        is_causal: bool | None = None,
        use_token_head_sf: bool = False,
    ) -> None:
        _unsupported(pos_encoding_mode=pos_encoding_mode, block_tables=block_tables, seq_lens=seq_lens,
                     use_token_head_sf=use_token_head_sf)
        if window_right != 0 or q_len_per_req != 1 or is_causal:
            raise NotImplementedError("fake flashinfer: decode is one query per request, window_right 0")
        if data_type is not None:
            q_data_type = q_data_type if q_data_type is not None else data_type
            kv_data_type = kv_data_type if kv_data_type is not None else data_type
        batch = len(last_page_len)
        qo_indptr = torch.arange(batch + 1, dtype=torch.int32)
        tables = _check_tables(qo_indptr, indptr, indices, last_page_len, batch, page_size)
        self.read_backs = _read_backs(indptr=indptr, last_page_len=last_page_len)
        tables = _store(self, tables, batch)
        self.planned = _planned(tables, num_qo_heads, num_kv_heads, head_dim, page_size, causal=False,
                                custom_mask=None, window_left=window_left, sm_scale=sm_scale,
                                logits_soft_cap=logits_soft_cap, q_data_type=q_data_type,
                                kv_data_type=kv_data_type, o_data_type=o_data_type)
        self.plan_calls += 1

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        *args,
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        enable_pdl: bool | None = None,
        window_left: int | None = None,
        sinks: torch.Tensor | None = None,
        q_len_per_req: int | None = None,
        skip_softmax_threshold_scale_factor: float | None = None,
        kv_cache_sf: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        _unsupported_run(args, q_scale, k_scale, v_scale, lse, return_lse, sinks, kv_cache_sf)
        return _run(self, q, paged_kv_cache, out, window_left)


# ----- planning -----
def _check_init(workspace, kv_layout: str, backend: str, jit_args) -> None:
    if not torch.is_tensor(workspace):
        raise TypeError("float_workspace_buffer must be a torch.Tensor")
    if kv_layout not in ("NHD", "HND"):
        raise KeyError(f"Invalid kv_layout {kv_layout}")
    if backend != "auto" or jit_args is not None:
        raise NotImplementedError("fake flashinfer: only backend='auto' without jit_args")


def _check_graph_buffers(batch: int, **buffers) -> None:
    for name, buf in buffers.items():
        if not torch.is_tensor(buf):
            raise ValueError(f"{name} should be a torch.Tensor in cudagraph mode")
    for name, buf in buffers.items():
        if "indptr" in name and len(buf) != batch + 1:
            raise ValueError(f"The size of {name} should be batch_size + 1")


def _check_tables(qo_indptr, kv_indptr, kv_indices, last_page_len, batch: int, page_size: int):
    tables = (qo_indptr, kv_indptr, kv_indices, last_page_len)
    for name, t in zip(("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"), tables):
        if t.dtype != torch.int32 or t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D int32 tensor, got {t.dtype} {tuple(t.shape)}")
    if len(kv_indptr) != batch + 1 or len(last_page_len) != batch or len(qo_indptr) != batch + 1:
        raise ValueError(f"indptr/last_page_len lengths {len(qo_indptr)}, {len(kv_indptr)}, {len(last_page_len)} "
                         f"do not describe {batch} requests")
    if not _readable(tables):
        return tables
    pages = _lengths(kv_indptr)
    if int(kv_indptr[0]) != 0 or min(pages, default=0) < 1 or len(kv_indices) < int(kv_indptr[-1]):
        raise ValueError(f"paged_kv_indptr {kv_indptr.tolist()} is not a CSR index over {len(kv_indices)} pages "
                         "with at least one page per request")
    if int(qo_indptr[0]) != 0 or min(_lengths(qo_indptr), default=0) < 0:
        raise ValueError(f"qo_indptr {qo_indptr.tolist()} is not a CSR index")
    if any(not 1 <= n <= page_size for n in last_page_len.tolist()):
        raise ValueError(f"last_page_len {last_page_len.tolist()} must lie in 1..page_size={page_size}")
    return tables


def _readable(tables) -> bool:
    return all(t.device.type != "meta" for t in tables)


def _read_backs(**tables: torch.Tensor) -> list[str]:
    return [name for name, t in tables.items() if t.device.type != "cpu"]


def _store(wrapper, tables, batch: int):
    """Snapshot the tables (eager) or copy them into the fixed buffers (CUDA graph), as flashinfer does."""
    if not wrapper.use_cuda_graph:
        return tuple(t.to(wrapper.device, copy=True) for t in tables)
    bufs = wrapper.buffers
    if batch != len(bufs[3]):
        raise ValueError(f"The batch size should be fixed in cudagraph mode, the runtime batch size {batch} "
                         f"mismatches the batch size set during initialization {len(bufs[3])}")
    if len(tables[2]) > len(bufs[2]):
        raise ValueError("The size of indices should be less than or equal to the allocated buffer")
    bufs[0].copy_(tables[0])
    bufs[1].copy_(tables[1])
    bufs[2][: len(tables[2])].copy_(tables[2])
    bufs[3].copy_(tables[3])
    return bufs


def _planned(tables, num_qo_heads, num_kv_heads, head_dim, page_size, *, causal, custom_mask, window_left,
             sm_scale, logits_soft_cap, q_data_type, kv_data_type, o_data_type) -> Planned:
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads {num_qo_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    q_dtype = _dtype(q_data_type)
    kv_dtype = _dtype(kv_data_type) if kv_data_type is not None else q_dtype
    return Planned(*tables, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   page_size=page_size, causal=causal, custom_mask=custom_mask, window_left=int(window_left),
                   sm_scale=float(sm_scale) if sm_scale is not None else head_dim**-0.5,
                   logits_soft_cap=float(logits_soft_cap or 0.0), q_data_type=q_dtype, kv_data_type=kv_dtype,
                   o_data_type=_dtype(o_data_type) if o_data_type is not None else q_dtype)


def _dtype(value: str | torch.dtype) -> torch.dtype:
    return value if isinstance(value, torch.dtype) else getattr(torch, value)


def _lengths(indptr: torch.Tensor) -> list[int]:
    values = indptr.tolist()
    return [b - a for a, b in zip(values, values[1:])]


def _kv_lens(tables, page_size: int) -> list[int]:
    return [max(p - 1, 0) * page_size + n for p, n in zip(_lengths(tables[1]), tables[3].tolist())]


def _unsupported(**options) -> None:
    defaults = {"pos_encoding_mode": "NONE", "use_token_head_sf": False}
    for name, value in options.items():
        if (value != defaults[name]) if name in defaults else (value is not None):
            raise NotImplementedError(f"fake flashinfer: {name}={value!r} is not modelled")


def _unsupported_run(args, q_scale, k_scale, v_scale, lse, return_lse, sinks, kv_cache_sf) -> None:
    if args or lse is not None or return_lse or sinks is not None or kv_cache_sf is not None:
        raise NotImplementedError("fake flashinfer: run() takes q and paged_kv_cache (and out) only")
    if any(s not in (None, 1.0) for s in (q_scale, k_scale, v_scale)):
        raise NotImplementedError("fake flashinfer: fp8 scales are not modelled")


# ----- attention from the plan -----
def _run(wrapper, q: torch.Tensor, paged_kv_cache, out: torch.Tensor | None, window_left: int | None) -> torch.Tensor:
    plan: Planned | None = wrapper.planned
    if plan is None:
        raise RuntimeError("run() before plan()")
    if window_left is not None and window_left != plan.window_left:
        raise ValueError(f"run(window_left={window_left}) differs from the planned {plan.window_left}")
    if q.device.type == "meta":
        return torch.empty(q.shape, dtype=plan.o_data_type, device="meta")
    k_cache, v_cache = _unpack(paged_kv_cache, wrapper.kv_layout)  # [pages, page_size, Hkv, D]
    if q.dtype != plan.q_data_type:
        raise ValueError(f"The dtype of q {q.dtype} does not match the q_data_type {plan.q_data_type} "
                         "specified in plan function.")
    if k_cache.dtype != plan.kv_data_type:
        raise ValueError(f"The dtype of k {k_cache.dtype} does not match the kv_data_type {plan.kv_data_type} "
                         "specified in plan function.")
    qo = plan.qo_indptr.tolist()
    expected_q = (qo[-1], plan.num_qo_heads, plan.head_dim)
    expected_kv = (plan.page_size, plan.num_kv_heads, plan.head_dim)
    if tuple(q.shape) != expected_q or tuple(k_cache.shape[1:]) != expected_kv:
        raise ValueError(f"q {tuple(q.shape)} / cache pages {tuple(k_cache.shape[1:])} do not match the plan "
                         f"{expected_q} / {expected_kv}")
    result = torch.zeros(q.shape, dtype=plan.o_data_type, device=q.device)
    mask_offset = 0
    for i, kv_len in enumerate(_kv_lens((plan.qo_indptr, plan.kv_indptr, None, plan.last_page_len), plan.page_size)):
        rows = slice(qo[i], qo[i + 1])
        q_len = qo[i + 1] - qo[i]
        allowed = _allowed(plan, q_len, kv_len, mask_offset)
        mask_offset += q_len * kv_len
        k, v = _gather(plan, i, k_cache, v_cache, kv_len)
        result[rows] = _attend(plan, q[rows], k, v, allowed).to(plan.o_data_type)
    if out is not None:
        out.copy_(result)
        return out
    return result


def _unpack(paged_kv_cache, kv_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(paged_kv_cache, tuple):
        k, v = paged_kv_cache
    else:
        k, v = paged_kv_cache.unbind(dim=1)
    if k.dim() != 4:
        raise ValueError(f"paged k/v cache must be 4-D per tensor, got {tuple(k.shape)}")
    if kv_layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k, v


def _gather(plan: Planned, i: int, k_cache, v_cache, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values `[kv_len, Hq, D]` float32 of request i, GQA heads expanded."""
    start, end = int(plan.kv_indptr[i]), int(plan.kv_indptr[i + 1])
    pages = plan.kv_indices[start:end].long()
    if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= k_cache.shape[0]):
        raise ValueError(f"request {i}: page indices {pages.tolist()} outside the cache's {k_cache.shape[0]} pages")
    group = plan.num_qo_heads // plan.num_kv_heads

    def rows(cache):
        return cache[pages].reshape(-1, plan.num_kv_heads, plan.head_dim)[:kv_len].float().repeat_interleave(group, 1)

    return rows(k_cache), rows(v_cache)


def _allowed(plan: Planned, q_len: int, kv_len: int, mask_offset: int) -> torch.Tensor:
    """`[q_len, kv_len]` bool: which keys each query row of the request sees."""
    q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    k_pos = torch.arange(kv_len)[None, :]
    if plan.custom_mask is not None:
        allowed = plan.custom_mask[mask_offset : mask_offset + q_len * kv_len].reshape(q_len, kv_len).cpu()
    elif plan.causal:
        allowed = k_pos <= q_pos
    else:
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool)
    if plan.window_left >= 0:
        allowed = allowed & (k_pos >= q_pos - plan.window_left)
    return allowed


def _attend(plan: Planned, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """q `[L, Hq, D]`, k/v `[kv, Hq, D]` → `[L, Hq, D]` float32."""
    scores = torch.einsum("lhd,khd->hlk", q.float(), k) * plan.sm_scale
    if plan.logits_soft_cap > 0:
        scores = plan.logits_soft_cap * torch.tanh(scores / plan.logits_soft_cap)
    scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees nothing outputs zeros
    return torch.einsum("hlk,khd->lhd", probs, v)
