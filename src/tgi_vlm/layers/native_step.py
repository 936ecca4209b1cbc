"""The lean decoder layers on the native kernels, with their checks made once per step instead of once per call
(part of layers/cpu_decoder.py's lean forward: a layer calls `gemma3_layer` or `llama_layer` where `native_step`
gives a plan, and runs the ops path where it gives none).

Why: Gemma 3 270M's batch-1 decode step (bf16 or the GGUF file) spent ~7 of its ~26 ms outside the matrix products
and attention (py-spy, benchmarks/results/cpu-profile.md): each of its 18 layers made ~12 native op calls, each
through torch's dispatcher (~3-10 us) and its Python checks (~5 us, and as much again in the `can_*` question asked
before it), plus two residual adds, an `empty_like` per norm and the attention backend's own per-layer checks of
indices that are the same for every layer of the step. The Llama-family layers (the bench Qwen2-VL) pay the same
per call, over fewer, smaller products.

What a step checks once (`native_step`): the hidden rows `[1, T, H]` (contiguous, float32 or bfloat16), the slots
this step writes (every one inside the cache), the KV cache (every layer's K/V the same contiguous
`[blocks, block, Hkv, D]` of the step's dtype, D a multiple of 16 up to 256), and, where the step is decode only
through `tgi_vlm::decode_attention` (the CPU backend's `NativeDecodeStep`), the decode rows' slot index (every slot
inside the cache) and, per sliding window, their spans (rows inside T, positions inside the slot index). What each
layer checks (cheap comparisons): its norm weights (dtype, shape, contiguity), its head layout against the cache,
its rotary tables (the pairs a step uses are checked once and then known by identity), and the shape and contiguity
of each product it gets back. With that, every native call reads and writes inside its tensors exactly as the ops'
own entry checks guarantee (kernels/cpu/ops.py); the calls themselves are the same C functions on the same
arguments, so the layers' values are the ops path's bit for bit (tests/models/test_lean_layer_parity.py).

Gemma 3's two sandwich norms that end its blocks, and their residual adds, are one call each (`gemma_rms_norm_add`,
rounded as transformers' `residual + norm(x)`). Products go through the layers' planned kernels as before (their
LoRA extras included). While torch's profiler records, each native call is a `record_function` region under its
op's name, so benchmarks/decode_profile.py still attributes the time.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch

from tgi_vlm.kernels.cpu import library, ops
from tgi_vlm.layers.attention.cpu_backend import NativeDecodeStep

_STATE_KEY = "native-step"
ENABLED = True  # False: every layer through the ops path (tests pin the two to each other; A/B measurements)
_PROFILER = torch.autograd.profiler
_NO_REGION = contextlib.nullcontext()


def _region(name: str):
    return torch.profiler.record_function(name) if _PROFILER._is_profiler_enabled else _NO_REGION


@dataclass
class NativeStep:
    """One step's shared, checked facts (see the module's docstring)."""

    tokens: int
    hidden: int
    dtype: torch.dtype
    code: int  # the C files' dtype code
    threads: int
    portable: library.PortableLibrary
    avx512: library.Avx512Library | None  # None: attention through the backend
    slots: torch.Tensor  # [T] long, contiguous, every slot inside the cache
    kv_heads: int
    head_dim: int
    decode: NativeDecodeStep | None  # a decode-only step through decode_attention, its slot index checked
    _spans: dict = field(default_factory=dict)  # (sliding window, chunk) -> checked [3, B] row spans
    _tables: list = field(default_factory=list)  # (cos, sin) pairs checked this step, held so identity is safe

    def spans(self, sliding_window: int | None, chunk: int | None) -> torch.Tensor:
        key = (sliding_window, chunk)
        spans = self._spans.get(key)
        if spans is None:
            spans = self.decode.row_spans(sliding_window, chunk)
            rows, starts, ends = spans.tolist()
            width = self.decode.slot_index.shape[1]
            if min(rows) < 0 or max(rows) >= self.tokens or min(starts) < 0 or max(ends) > width:
                raise ValueError(f"decode spans outside the step's {self.tokens} rows or {width} positions")
            self._spans[key] = spans
        return spans

    def check_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        for checked_cos, checked_sin in self._tables:
            if cos is checked_cos and sin is checked_sin:
                return True
        shape, stride = cos.shape, cos.stride()
        ok = (cos.is_cpu and sin.is_cpu and cos.dtype == self.dtype and sin.dtype == self.dtype
              and tuple(shape) == (1, self.tokens, self.head_dim) and sin.shape == shape and sin.stride() == stride
              and stride[2] == 1)
        if ok:
            self._tables.append((cos, sin))
        return ok


# A PagedKVCache's tensors are made once, with it, and never replaced: its layout is checked once per dtype, not every
# step (2 x layers tensors: ~30 us a step for Gemma 3 270M).
_CACHES_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cache_fits(kv_cache, dtype: torch.dtype) -> bool:
    checked = _CACHES_CHECKED.setdefault(kv_cache, {})
    if dtype not in checked:
        checked[dtype] = _cache_layout_fits(kv_cache, dtype)
    return checked[dtype]


def _cache_layout_fits(kv_cache, dtype: torch.dtype) -> bool:
    first = kv_cache.keys[0]
    shape = first.shape
    if not (len(shape) == 4 and first.dtype == dtype and 0 < shape[3] <= ops.MAX_HEAD_DIM and shape[3] % 16 == 0
            and shape[2] > 0):
        return False
    return all(t.shape == shape and t.dtype == dtype and t.is_cpu and t.is_contiguous()
               for t in (*kv_cache.keys, *kv_cache.values))


def native_step(meta, hidden_states: torch.Tensor) -> NativeStep | None:
    """The step's plan, made (and checked) by the first layer that asks, or None where these kernels cannot take
    the step (then the layer runs the ops path)."""
    if meta is None or not ENABLED:
        return None
    state = meta.layer_state.get(_STATE_KEY)
    if state is None:
        state = _make_step(meta, hidden_states) or False
        meta.layer_state[_STATE_KEY] = state
    if state and hidden_states.shape == (1, state.tokens, state.hidden) and hidden_states.dtype == state.dtype \
            and hidden_states.is_contiguous():
        return state
    return None


def _make_step(meta, hidden: torch.Tensor) -> NativeStep | None:
    kernels = library.loaded()
    portable = kernels.portable if kernels is not None else None
    if portable is None or not getattr(meta.backend, "takes_written_kv", False):
        return None
    dtype = hidden.dtype
    if not (hidden.is_cpu and dtype in library.DTYPE_CODES and hidden.dim() == 3 and hidden.shape[0] == 1
            and hidden.is_contiguous() and hidden.shape[1] > 0):
        return None
    tokens, width = hidden.shape[1], hidden.shape[2]
    kv_cache = meta.kv_cache
    if not _cache_fits(kv_cache, dtype):
        return None
    slots = meta.slots.contiguous()
    num_slots = kv_cache.keys[0].shape[0] * kv_cache.keys[0].shape[1]
    if not (slots.dtype == torch.long and slots.is_cpu and tuple(slots.shape) == (tokens,)
            and ops.slot_bound(slots, empty=-1) < num_slots):
        return None
    avx512 = kernels.avx512
    decode = meta.backend_state if isinstance(meta.backend_state, NativeDecodeStep) else None
    if not (decode is not None and not meta.prefills and meta.decode.rows_are_all and avx512 is not None
            and dtype in avx512.attention_dtypes and decode.slot_index.dtype == torch.long
            and decode.slot_index.dim() == 2 and decode.slot_index.is_contiguous() and decode.slot_index.is_cpu
            and ops.slot_bound(decode.slot_index, empty=0) < num_slots):
        decode = None
    return NativeStep(tokens, width, dtype, library.DTYPE_CODES[dtype], torch.get_num_threads(), portable,
                            avx512, slots, kv_cache.keys[0].shape[2], kv_cache.keys[0].shape[3], decode)


def _weight_fits(weight: torch.Tensor, size: int, dtype: torch.dtype) -> bool:
    return weight.dtype == dtype and weight.shape == (size,) and weight.is_cpu and weight.is_contiguous()


def _rows_fit(t: torch.Tensor, step: NativeStep, width: int) -> bool:
    return t.shape == (1, step.tokens, width) and t.dtype == step.dtype and t.is_contiguous()


def gemma3_layer(layer: torch.nn.Module, parts, step: NativeStep, hidden: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, meta) -> torch.Tensor | None:
    """Gemma3DecoderLayer's forward on the native kernels for this step, or None (nothing done) where this layer does
    not fit the step's checks (its weights' dtype, its head layout, its rotary tables)."""
    attn, mlp = layer.self_attn, layer.mlp
    tokens, width, dtype, code, threads = step.tokens, step.hidden, step.dtype, step.code, step.threads
    heads, kv_heads, head_dim = parts.q_heads, parts.kv_heads, parts.head_dim
    norms = (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
             layer.post_feedforward_layernorm)
    if not (_layout_fits(parts, attn, step, meta)
            and all(_weight_fits(n.weight, width, dtype) for n in norms)
            and _weight_fits(attn.q_norm.weight, head_dim, dtype) and _weight_fits(attn.k_norm.weight, head_dim, dtype)
            and step.check_tables(cos, sin)):
        return None
    lib = step.portable
    normed = torch.empty_like(hidden)
    with _region("tgi_vlm::gemma_rms_norm"):
        lib.gemma_rms_norm(code, hidden.data_ptr(), width, layer.input_layernorm.weight.data_ptr(), normed.data_ptr(),
                           width, tokens, 1, width, layer.input_layernorm.eps, threads)
    qkv = parts.qkv.product(normed)
    qkv_width = (heads + 2 * kv_heads) * head_dim
    if not _rows_fit(qkv, step, qkv_width):
        raise RuntimeError(f"layer {attn.layer_idx}: the q/k/v product gave {tuple(qkv.shape)} {qkv.dtype}")
    element = qkv.element_size()
    key_ptr = qkv.data_ptr() + heads * head_dim * element
    with _region("tgi_vlm::gemma_rms_norm"):  # the q/k norms, in place on the product's heads
        lib.gemma_rms_norm(code, qkv.data_ptr(), qkv_width, attn.q_norm.weight.data_ptr(), qkv.data_ptr(), qkv_width,
                           tokens, heads, head_dim, attn.q_norm.eps, threads)
    with _region("tgi_vlm::gemma_rms_norm"):
        lib.gemma_rms_norm(code, key_ptr, qkv_width, attn.k_norm.weight.data_ptr(), key_ptr, qkv_width, tokens,
                           kv_heads, head_dim, attn.k_norm.eps, threads)
    attended = _attention(step, parts, attn, qkv, cos, sin, meta)
    residual = torch.empty_like(hidden)
    post = layer.post_attention_layernorm
    with _region("tgi_vlm::gemma_rms_norm_add"):
        lib.gemma_rms_norm_add(code, attended.data_ptr(), post.weight.data_ptr(), hidden.data_ptr(),
                               residual.data_ptr(), tokens, width, post.eps, threads)
    pre = layer.pre_feedforward_layernorm
    with _region("tgi_vlm::gemma_rms_norm"):
        lib.gemma_rms_norm(code, residual.data_ptr(), width, pre.weight.data_ptr(), normed.data_ptr(), width, tokens,
                           1, width, pre.eps, threads)
    gate, up = parts.gate_up.product(normed).split(parts.gate_up.widths, dim=-1)
    down = mlp.down_proj.forward(mlp.act_fn(gate) * up)
    if not _rows_fit(down, step, width):
        raise RuntimeError(f"layer {attn.layer_idx}: down_proj gave {tuple(down.shape)} {down.dtype}")
    post = layer.post_feedforward_layernorm
    with _region("tgi_vlm::gemma_rms_norm_add"):  # in place: the residual is this layer's own tensor
        lib.gemma_rms_norm_add(code, down.data_ptr(), post.weight.data_ptr(), residual.data_ptr(), residual.data_ptr(),
                               tokens, width, post.eps, threads)
    return residual


def _attention(step: NativeStep, parts, attn: torch.nn.Module, qkv: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, meta) -> torch.Tensor:
    """Rotary and the K/V store (one C pass over the product `qkv`, its q/k heads already normalized where the layer
    has q/k norms), attention over the cache, and the output projection: `[1, T, H]`."""
    tokens, dtype = step.tokens, step.dtype
    heads, kv_heads, head_dim = parts.q_heads, parts.kv_heads, parts.head_dim
    query = torch.empty(tokens, heads, head_dim, dtype=dtype)
    key = torch.empty(tokens, kv_heads, head_dim, dtype=dtype)
    k_cache, v_cache = meta.kv_cache.keys[attn.layer_idx], meta.kv_cache.values[attn.layer_idx]
    with _region("tgi_vlm::rotary_and_store"):
        status = step.portable.rotary_kv(step.code, qkv.data_ptr(), qkv.shape[2], tokens, heads, kv_heads, head_dim,
                                         cos.data_ptr(), sin.data_ptr(), cos.stride(1), query.data_ptr(),
                                         key.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), step.slots.data_ptr(),
                                         step.threads)
    if status != 0:
        raise RuntimeError(f"tgi_vlm::rotary_and_store refused dtype {dtype}, head_dim {head_dim}")
    chunk = meta.backend.pattern.chunk_size(attn.layer_idx)
    if step.decode is not None:
        out = _decode_attention(step, attn.scaling, parts.sliding_window, chunk, query, k_cache, v_cache)
    else:
        value = qkv[0, :, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
        out = meta.backend.forward(attn.layer_idx, query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                   value.transpose(0, 1)[None], meta, scaling=attn.scaling,
                                   sliding_window=parts.sliding_window, kv_written=True)[0]
    attended = attn.o_proj.forward(out.reshape(1, tokens, heads * head_dim))
    if not _rows_fit(attended, step, step.hidden):
        raise RuntimeError(f"layer {attn.layer_idx}: o_proj gave {tuple(attended.shape)} {attended.dtype}")
    return attended


def _layout_fits(parts, attn: torch.nn.Module, step: NativeStep, meta) -> bool:
    kv_heads = parts.kv_heads
    return (kv_heads == step.kv_heads and parts.head_dim == step.head_dim and parts.q_heads % kv_heads == 0
            and 0 <= attn.layer_idx < len(meta.kv_cache.keys))


def llama_layer(layer: torch.nn.Module, parts, step: NativeStep, hidden: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, meta) -> torch.Tensor | None:
    """A Llama-family layer's forward (LEAN_LAYER_CLASSES: residual, RMSNorm, attention with standard rotary,
    residual, RMSNorm, gated MLP) on the native kernels for this step, or None (nothing done) where this layer does
    not fit the step's checks."""
    attn, mlp = layer.self_attn, layer.mlp
    tokens, width, dtype, code, threads = step.tokens, step.hidden, step.dtype, step.code, step.threads
    first, second = layer.input_layernorm, layer.post_attention_layernorm
    if not (_layout_fits(parts, attn, step, meta) and _weight_fits(first.weight, width, dtype)
            and _weight_fits(second.weight, width, dtype) and step.check_tables(cos, sin)):
        return None
    lib = step.portable
    normed = torch.empty_like(hidden)
    with _region("tgi_vlm::rms_norm"):
        lib.rms_norm(code, hidden.data_ptr(), width, first.weight.data_ptr(), normed.data_ptr(), width, tokens, width,
                     first.variance_epsilon, threads)
    qkv = parts.qkv.product(normed)
    if not _rows_fit(qkv, step, (parts.q_heads + 2 * parts.kv_heads) * parts.head_dim):
        raise RuntimeError(f"layer {attn.layer_idx}: the q/k/v product gave {tuple(qkv.shape)} {qkv.dtype}")
    hidden = hidden + _attention(step, parts, attn, qkv, cos, sin, meta)
    with _region("tgi_vlm::rms_norm"):
        lib.rms_norm(code, hidden.data_ptr(), width, second.weight.data_ptr(), normed.data_ptr(), width, tokens,
                     width, second.variance_epsilon, threads)
    gate, up = parts.gate_up.product(normed).split(parts.gate_up.widths, dim=-1)
    down = mlp.down_proj.forward(mlp.act_fn(gate) * up)
    if not _rows_fit(down, step, width):
        raise RuntimeError(f"layer {attn.layer_idx}: down_proj gave {tuple(down.shape)} {down.dtype}")
    return hidden + down


def _decode_attention(step: NativeStep, scaling: float, sliding_window: int | None, chunk: int | None,
                      query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """`tgi_vlm::decode_attention` of a decode-only step: every row is a sequence's one query (`rows_are_all`)."""
    tokens, heads, head_dim = query.shape
    out = torch.empty_like(query)
    spans = step.spans(sliding_window, chunk)
    rows, starts, ends = spans
    slot_index = step.decode.slot_index
    with _region("tgi_vlm::decode_attention"):
        status = step.avx512.decode_attention(
            step.code, query.data_ptr(), query.stride(0), query.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
            slot_index.data_ptr(), slot_index.shape[1], rows.data_ptr(), starts.data_ptr(), ends.data_ptr(),
            out.data_ptr(), out.stride(0), out.stride(1), spans.shape[1], heads, step.kv_heads, head_dim,
            scaling if scaling is not None else head_dim ** -0.5, step.threads)
    if status == -2:
        raise MemoryError("tgi_vlm::decode_attention: no memory for a thread's scratch buffers")
    if status != 0:
        raise RuntimeError(f"tgi_vlm::decode_attention refused dtype {query.dtype}, head_dim {head_dim}")
    return out
