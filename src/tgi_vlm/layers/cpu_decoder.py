"""One forward per pre-norm decoder layer on CPU: transformers' arithmetic with fewer calls (part of
layers/cpu.py's speed-ups).

On a 2-core CPU a bf16 decode step of the bench model spends about a third of its time outside the
matrix products and attention, in the ~70 small operations and ~15 module calls per layer that
transformers' Llama-family layers make. For layers whose q/k/v and gate/up projections were fused
(layers/linear/fused.py), this forward computes the same values with fewer steps:

- the fused q/k/v product is sliced directly (no per-member split and bookkeeping);
- rotary is applied to the query and key heads in one pass over their joint block (the same
  element-wise `x * cos + rotate_half(x) * sin` as transformers' `apply_rotary_pos_emb`); with the native
  kernel `tgi_vlm::rotary_and_store` (kernels/cpu/, `KernelSettings.native_rotary`), that pass and the K/V store
  into the cache are one C call with the same roundings, where the attention backend takes K/V written by its
  caller (`takes_written_kv`: the torch backends);
- RMSNorm is one C call with the native kernel `tgi_vlm::rms_norm` (`KernelSettings.native_norm`,
  kernels/cpu/csrc/rms_norm.c: transformers' steps, except that the sum of squares is accumulated in double, so an
  output may differ from torch's in its last places (within 4 ulps); torch runs it as ~6 operations of ~10-30 us
  each on a decode batch: paired, bf16 decode step 29.1 -> 26.8 ms and prefill 102 -> 94 ms, float32 0.94 both);
  without the kernel (switched off, or not loaded), `F.rms_norm` on float32 followed by the weight, bit-equal to
  transformers' RMSNorm (tests/unit/test_cpu_decoder.py checks both);
- the submodules' forwards are called directly, without `Module.__call__` or transformers'
  argument-deprecation wrappers (the layers carry no hooks when installed, which `install_lean_layers`
  checks; a hook added on a submodule later would not run: `remove_lean_layers` first).

Which kernels a layer uses is chosen once, when the lean forward is installed (`install_lean_layers`, from the
settings and what loaded). With torch's RMSNorm every operation is transformers' own in the same order, so outputs
are bit-equal to the layer's own forward (tests/models/test_lean_layer_parity.py compares logits exactly on every
covered architecture); with the native norm (the default where it loads), logits agree to float32 rounding and
tokens are transformers' (the same file, and every float32 parity suite, which runs the default). Measured on the
bench model (bf16, 13 decoding sequences, paired in one process): decode step 28.9 -> 27.1 ms, a prefill step with
two new prompts 93.0 -> 90.7 ms.

Covered: the layer classes in LEAN_LAYER_CLASSES, whose forward (residual, input norm, attention
with standard rotary, residual, post-attention norm, gated MLP) this reproduces, and Gemma 3's
(GEMMA3_LEAN_LAYER_CLASSES: sandwich norms, q/k norms; `_lean_gemma3_forward`, torch's operations only, bit-equal).
Any other layer, or one whose projections were not fused, keeps transformers' forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tgi_vlm.config import KernelSettings
from tgi_vlm.kernels import cpu as cpu_kernels
from tgi_vlm.kernels.cpu import ops
from tgi_vlm.layers import native_step as per_step
from tgi_vlm.layers.attention.backend import paged_attention
from tgi_vlm.layers.linear.fused import FusedProjections, fused_group

# Layers of this exact structure in transformers 5 (pre-norm, q/k/v/o attention with standard rotary
# applied by `apply_rotary_pos_emb`, gated MLP `down(act(gate(x)) * up(x))`). Not here: layers with
# q/k norms (Qwen3), sandwich norms or soft-capping (Gemma), MoE or chunked attention (Llama4).
# Each class with the sliding window its attention hands to the attention function, as its forward does.
LEAN_LAYER_CLASSES: dict[str, Callable[[torch.nn.Module], int | None]] = {
    "LlamaDecoderLayer": lambda attn: None,
    "MistralDecoderLayer": lambda attn: getattr(attn.config, "sliding_window", None),
    "Qwen2DecoderLayer": lambda attn: attn.sliding_window,
    "Qwen2VLDecoderLayer": lambda attn: attn.sliding_window,
    "Qwen2_5_VLDecoderLayer": lambda attn: attn.sliding_window,
}
# Gemma 3's layers (Gemma3DecoderLayer, the text model of Gemma 3 270M and of the Gemma 3 VLMs): sandwich norms
# (post-attention and pre/post-feedforward RMSNorms around each block), per-head q/k RMSNorms before rotary, and
# Gemma's RMSNorm (`x * rsqrt(mean(x^2) + eps) * (1 + w)` in float32, then cast). `_lean_gemma3_forward` calls the
# layer's own norm modules' forwards, so it is the same arithmetic in the same order, with fewer calls.
GEMMA3_LEAN_LAYER_CLASSES: dict[str, Callable[[torch.nn.Module], int | None]] = {
    "Gemma3DecoderLayer": lambda attn: attn.sliding_window,
}
_PARTS_ATTR = "_tgi_vlm_lean_parts"


@dataclass(frozen=True)
class LeanParts:
    qkv: FusedProjections
    gate_up: FusedProjections
    q_heads: int
    kv_heads: int
    head_dim: int
    sliding_window: int | None
    native_norm: bool = False  # tgi_vlm::rms_norm (Gemma 3: gemma_rms_norm) where it takes the input (else torch's)
    native_rotary: bool = False  # tgi_vlm::rotary_and_store where it takes the product and the backend the K/V
    gemma3: bool = False  # Gemma 3's layer structure (`_lean_gemma3_forward`); torch's norms are its own modules'

    @property
    def qk_width(self) -> int:
        return (self.q_heads + self.kv_heads) * self.head_dim


def rms_norm(norm: torch.nn.Module, x: torch.Tensor, native: bool = False) -> torch.Tensor:
    """transformers' Llama-family RMSNorm: float32 normalization, cast back, times the weight. `native`: one call of
    `tgi_vlm::rms_norm` where it takes `x` (the same steps except the sum of squares, in double there, so within a
    few ulps of torch's); else, or where it does not, torch's operations, bit-equal."""
    if native and ops.can_norm(x, norm.weight):
        return ops.rms_norm(x, norm.weight, norm.variance_epsilon)
    normed = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=norm.variance_epsilon)
    return norm.weight * normed.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin` (transformers' rotary, element for element)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _rotate_and_store(parts: LeanParts, layer_idx: int, meta, qkv: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor):
    """Query `[1, Hq, T, D]`, key and value `[1, Hkv, T, D]` with this step's K/V already stored at `meta.slots`
    (`tgi_vlm::rotary_and_store`, bit-equal to `_rotate` and the torch backend's `write_kv`), or None where the
    kernel or the backend cannot take them (then the caller runs torch's operations)."""
    if not (parts.native_rotary and getattr(meta.backend, "takes_written_kv", False)):
        return None
    k_cache, v_cache = meta.kv_cache.flat(layer_idx)
    if not ops.can_rotate(qkv, cos, sin, parts.q_heads, k_cache, v_cache):
        return None
    q, k = ops.rotary_and_store(qkv, cos, sin, parts.q_heads, k_cache, v_cache, meta.slots)  # [T, H, D]
    tokens = qkv.shape[1]
    value = qkv[0, :, parts.qk_width :].view(tokens, parts.kv_heads, parts.head_dim)
    return q.transpose(0, 1)[None], k.transpose(0, 1)[None], value.transpose(0, 1)[None]


def _lean_forward(self: torch.nn.Module, hidden_states: torch.Tensor, attention_mask=None, position_ids=None,
                  position_embeddings=None, **kwargs) -> torch.Tensor:
    parts: LeanParts = self.__dict__[_PARTS_ATTR]
    attn, mlp = self.self_attn, self.mlp
    bsz, q_len, _ = hidden_states.shape
    meta = kwargs.get("attn_metadata")
    if parts.native_norm and parts.native_rotary:  # checks made once per step, the same C calls (layers/native_step.py)
        step = per_step.native_step(meta, hidden_states)
        if step is not None:
            out = per_step.llama_layer(self, parts, step, hidden_states, *position_embeddings, meta)
            if out is not None:
                return out
    x = rms_norm(self.input_layernorm, hidden_states, parts.native_norm)
    qkv = parts.qkv.product(x)  # [bsz, q_len, (Hq + 2 Hkv) D]
    cos, sin = position_embeddings  # [bsz, q_len, D]
    stored = _rotate_and_store(parts, attn.layer_idx, meta, qkv, cos, sin)  # one C pass, bit-equal to the below
    if stored is not None:
        query, key, value = stored
        out = meta.backend.forward(attn.layer_idx, query, key, value, meta, scaling=attn.scaling,
                                   sliding_window=parts.sliding_window, kv_written=True)
    else:
        qk = _rotate(qkv[..., : parts.qk_width].view(bsz, q_len, parts.q_heads + parts.kv_heads, parts.head_dim),
                     cos.unsqueeze(2), sin.unsqueeze(2))
        query = qk[:, :, : parts.q_heads].transpose(1, 2)  # [bsz, Hq, q_len, D]
        key = qk[:, :, parts.q_heads :].transpose(1, 2)
        value = qkv[..., parts.qk_width :].view(bsz, q_len, parts.kv_heads, parts.head_dim).transpose(1, 2)
        out, _ = paged_attention(attn, query, key, value, attention_mask, scaling=attn.scaling,
                                 sliding_window=parts.sliding_window, position_ids=position_ids, **kwargs)
    hidden_states = hidden_states + attn.o_proj.forward(out.reshape(bsz, q_len, -1))
    gate_up = parts.gate_up.product(rms_norm(self.post_attention_layernorm, hidden_states, parts.native_norm))
    gate, up = gate_up.split(parts.gate_up.widths, dim=-1)
    return hidden_states + mlp.down_proj.forward(mlp.act_fn(gate) * up)


def gemma_norm(norm: torch.nn.Module, x: torch.Tensor, native: bool = False) -> torch.Tensor:
    """Gemma's RMSNorm module `norm` applied to `x` `[..., H]`: one call of `tgi_vlm::gemma_rms_norm` when `native`
    and it takes `x` (the same steps except the sum of squares, in double: within a few ulps), else the module's own
    forward (bit-equal)."""
    if native:
        rows = x.view(-1, 1, x.shape[-1]) if x.is_contiguous() else None
        if rows is not None and ops.can_gemma_norm(rows, norm.weight):
            out = torch.empty_like(x)
            ops.gemma_rms_norm(rows, norm.weight, norm.eps, out.view(rows.shape))
            return out
    return norm.forward(x)


def _gemma3_attention_native(parts: LeanParts, attn: torch.nn.Module, meta, qkv: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor) -> torch.Tensor | None:
    """Gemma 3's q/k norms in place on the fused product's query and key heads, then rotary and the K/V store in one
    C pass (as `_rotate_and_store`, with the checks made once, before the product is changed), then the backend's
    attention: `[bsz, Hq, q_len, D]`-shaped output as
    `paged_attention` returns it, or None where a kernel does not take these inputs (nothing was changed then)."""
    if not (parts.native_norm and parts.native_rotary and qkv.shape[0] == 1 and qkv.stride(-1) == 1):
        return None
    tokens, d = qkv.shape[1], parts.head_dim
    q_width = parts.q_heads * d
    query = qkv[0, :, :q_width].view(tokens, parts.q_heads, d)  # views into the product: normalized in place
    key = qkv[0, :, q_width : parts.qk_width].view(tokens, parts.kv_heads, d)
    if not (ops.can_gemma_norm(query, attn.q_norm.weight) and ops.can_gemma_norm(key, attn.k_norm.weight)):
        return None
    if not getattr(meta.backend, "takes_written_kv", False):
        return None
    k_cache, v_cache = meta.kv_cache.flat(attn.layer_idx)
    if not ops.can_rotate(qkv, cos, sin, parts.q_heads, k_cache, v_cache):
        return None
    ops.gemma_rms_norm(query, attn.q_norm.weight, attn.q_norm.eps, query)
    ops.gemma_rms_norm(key, attn.k_norm.weight, attn.k_norm.eps, key)
    query, key = ops.rotary_and_store(qkv, cos, sin, parts.q_heads, k_cache, v_cache, meta.slots)  # [T, H, D]
    value = qkv[0, :, parts.qk_width :].view(tokens, parts.kv_heads, d)
    return meta.backend.forward(attn.layer_idx, query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                value.transpose(0, 1)[None], meta, scaling=attn.scaling,
                                sliding_window=parts.sliding_window, kv_written=True)


def _lean_gemma3_forward(self: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings=None,
                         attention_mask=None, position_ids=None, **kwargs) -> torch.Tensor:
    """Gemma3DecoderLayer's forward (and Gemma3Attention's, Gemma3MLP's) with the fused q/k/v and gate/up products
    sliced directly and every submodule's forward called without `Module.__call__`. Without the native kernels: the
    same operations on the same values in the same order, so bit-equal to transformers'
    (tests/models/test_lean_layer_parity.py). With them (`native_norm` and `native_rotary`): each RMSNorm one C call
    (`gemma_norm`), and the q/k norms, rotary and K/V store three C calls on the fused product
    (`_gemma3_attention_native`), within float32 rounding of transformers' layer."""
    parts: LeanParts = self.__dict__[_PARTS_ATTR]
    attn, mlp, native = self.self_attn, self.mlp, parts.native_norm
    bsz, q_len, _ = hidden_states.shape
    if native and parts.native_rotary:  # checks made once per step, the same C calls (layers/native_step.py)
        meta = kwargs.get("attn_metadata")
        step = per_step.native_step(meta, hidden_states)
        if step is not None:
            out = per_step.gemma3_layer(self, parts, step, hidden_states, *position_embeddings, meta)
            if out is not None:
                return out
    qkv = parts.qkv.product(gemma_norm(self.input_layernorm, hidden_states, native))  # [bsz, q_len, (Hq + 2 Hkv) D]
    cos, sin = position_embeddings  # [bsz, q_len, D]
    out = _gemma3_attention_native(parts, attn, kwargs.get("attn_metadata"), qkv, cos, sin)
    if out is None:
        q_width = parts.q_heads * parts.head_dim
        # transformers normalizes [bsz, H, q_len, D] views of the same values over D: the layout does not change them
        query = attn.q_norm.forward(qkv[..., :q_width].view(bsz, q_len, parts.q_heads, parts.head_dim))
        key = attn.k_norm.forward(qkv[..., q_width : parts.qk_width].view(bsz, q_len, parts.kv_heads, parts.head_dim))
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        query, key = _rotate(query, cos, sin).transpose(1, 2), _rotate(key, cos, sin).transpose(1, 2)
        value = qkv[..., parts.qk_width :].view(bsz, q_len, parts.kv_heads, parts.head_dim).transpose(1, 2)
        out, _ = paged_attention(attn, query, key, value, attention_mask, scaling=attn.scaling,
                                 sliding_window=parts.sliding_window, position_ids=position_ids, **kwargs)
    attended = attn.o_proj.forward(out.reshape(bsz, q_len, -1).contiguous())
    hidden_states = hidden_states + gemma_norm(self.post_attention_layernorm, attended, native)
    gate_up = parts.gate_up.product(gemma_norm(self.pre_feedforward_layernorm, hidden_states, native))
    gate, up = gate_up.split(parts.gate_up.widths, dim=-1)
    return hidden_states + gemma_norm(self.post_feedforward_layernorm, mlp.down_proj.forward(mlp.act_fn(gate) * up),
                                      native)


def _parts(layer: torch.nn.Module, native_norm: bool, native_rotary: bool) -> LeanParts | None:
    """The fused groups and head counts of a covered layer, or None when it does not qualify."""
    if _PARTS_ATTR in layer.__dict__:
        return None  # already lean
    gemma3 = type(layer).__name__ in GEMMA3_LEAN_LAYER_CLASSES
    window_of = (GEMMA3_LEAN_LAYER_CLASSES if gemma3 else LEAN_LAYER_CLASSES).get(type(layer).__name__)
    if window_of is None or not type(layer).__module__.startswith("transformers.models."):
        return None  # not one of transformers' own classes (e.g. remote code reusing the name)
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return None
    qkv = fused_group(attn, ("q_proj", "k_proj", "v_proj"))
    gate_up = fused_group(mlp, ("gate_proj", "up_proj"))
    if qkv is None or gate_up is None:
        return None
    head_dim = getattr(attn, "head_dim", None)
    if not head_dim or any(w % head_dim for w in qkv.widths) or qkv.widths[1] != qkv.widths[2]:
        return None
    if gate_up.widths[0] != gate_up.widths[1]:
        return None
    if any(m._forward_hooks or m._forward_pre_hooks for m in layer.modules()):
        return None  # hooks (e.g. a tensor-parallel plan's) must run: keep transformers' forward
    if gemma3:  # its norms are Gemma's (1 + w) form: the native ones are `gemma_rms_norm`; rotary after the q/k norms
        if getattr(attn, "q_norm", None) is None or getattr(attn, "k_norm", None) is None:
            return None
        if getattr(attn.config, "attn_logit_softcapping", None):  # the lean attention does not soft-cap its scores
            return None
    return LeanParts(qkv, gate_up, qkv.widths[0] // head_dim, qkv.widths[1] // head_dim, head_dim, window_of(attn),
                     native_norm, native_rotary, gemma3)


_LEAN_CLASSES: dict[type, type] = {}


def _lean_class(cls: type, gemma3: bool = False) -> type:
    """`cls` with the lean forward: a subclass made once per layer class (the instance keeps everything else)."""
    if cls not in _LEAN_CLASSES:
        forward = _lean_gemma3_forward if gemma3 else _lean_forward
        _LEAN_CLASSES[cls] = type(f"Lean{cls.__name__}", (cls,), {"forward": forward, "_lean_base": cls})
    return _LEAN_CLASSES[cls]


def install_lean_layers(language_model: torch.nn.Module, kernels: KernelSettings | None = None) -> int:
    """Give every covered, fused decoder layer of `language_model` the lean forward (its class becomes the lean
    subclass of its own: parameters, hooks and place in the model unchanged); layers already lean take these
    settings' kernels. `kernels`: which native kernels the layers use where they loaded (None: `KernelSettings()`'s
    defaults). Returns the count."""
    kernels = kernels or KernelSettings()
    loaded = cpu_kernels.load(kernels) if kernels.native_norm or kernels.native_rotary else None
    native_norm = kernels.native_norm and loaded.available("rms_norm")
    native_gemma_norm = kernels.native_norm and loaded.available("gemma_rms_norm")
    native_rotary = kernels.native_rotary and loaded.available("rotary_and_store")
    count = 0
    for layer in language_model.modules():
        lean = layer.__dict__.get(_PARTS_ATTR)
        if lean is not None:
            norm = native_gemma_norm if lean.gemma3 else native_norm
            layer.__dict__[_PARTS_ATTR] = dataclasses.replace(lean, native_norm=norm, native_rotary=native_rotary)
            count += 1
            continue
        gemma3 = type(layer).__name__ in GEMMA3_LEAN_LAYER_CLASSES
        parts = _parts(layer, native_gemma_norm if gemma3 else native_norm, native_rotary)
        if parts is None:
            continue
        layer.__dict__[_PARTS_ATTR] = parts
        layer.__class__ = _lean_class(type(layer), parts.gemma3)
        count += 1
    return count


def remove_lean_layers(language_model: torch.nn.Module) -> int:
    """Back to transformers' forward (for measurements and parity checks); returns the count."""
    count = 0
    for layer in language_model.modules():
        if layer.__dict__.pop(_PARTS_ATTR, None) is not None:
            layer.__class__ = type(layer)._lean_base
            count += 1
    return count
