"""One forward per pre-norm decoder layer on CPU: transformers' arithmetic with fewer calls (part of
layers/cpu.py's speed-ups).

On a 2-core CPU a bf16 decode step of the bench model spends about a third of its time outside the
matrix products and attention, in the ~70 small operations and ~15 module calls per layer that
transformers' Llama-family layers make. For layers whose q/k/v and gate/up projections were fused
(layers/linear/fused.py), this forward computes the same values with fewer steps:

- the fused q/k/v product is sliced directly (no per-member split and bookkeeping);
- rotary is applied to the query and key heads in one pass over their joint block (the same
  element-wise `x * cos + rotate_half(x) * sin` as transformers' `apply_rotary_pos_emb`); with the torch
  backend's native library (CPU), that pass and the K/V store into the cache are one C call with the same
  roundings (`NativeDecodeAttention.rotary_and_store`);
- RMSNorm is one C call with the torch backend's native library (`NativeDecodeAttention.rms_norm`, native/rms_norm.c:
  transformers' steps, except that the sum of squares is accumulated in double, so an output may differ from
  torch's in its last places (within 4 ulps); torch runs it as ~6 operations of ~10-30 us each on a decode batch:
  paired, bf16 decode step 29.1 -> 26.8 ms and prefill 102 -> 94 ms, float32 0.94 both); without the library
  (or with `NATIVE_NORM` off), `F.rms_norm` on float32 followed by the weight, bit-equal to transformers'
  RMSNorm (tests/unit/test_cpu_decoder.py checks both);
- the submodules' forwards are called directly, without `Module.__call__` or transformers'
  argument-deprecation wrappers (the layers carry no hooks when installed, which `install_lean_layers`
  checks; a hook added on a submodule later would not run: `remove_lean_layers` first).

With torch's RMSNorm every operation is transformers' own in the same order, so outputs are bit-equal to the
layer's own forward (tests/models/test_lean_layer_parity.py compares logits exactly on every covered
architecture); with the native norm (the default on CPU), logits agree to float32 rounding and tokens are
transformers' (the same file, and every float32 parity suite, which runs the default). Measured on the bench model (bf16, 13 decoding sequences, paired in one process):
decode step 28.9 -> 27.1 ms, a prefill step with two new prompts 93.0 -> 90.7 ms.

Covered: the layer classes in LEAN_LAYER_CLASSES, whose forward (residual, input norm, attention
with standard rotary, residual, post-attention norm, gated MLP) this reproduces. Any other layer,
or one whose projections were not fused, keeps transformers' forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tgi_vlm.layers.attention.backend import paged_attention
from tgi_vlm.layers.attention.torch_backend import TorchPagedBackend
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
_PARTS_ATTR = "_tgi_vlm_lean_parts"


@dataclass(frozen=True)
class LeanParts:
    qkv: FusedProjections
    gate_up: FusedProjections
    q_heads: int
    kv_heads: int
    head_dim: int
    sliding_window: int | None

    @property
    def qk_width(self) -> int:
        return (self.q_heads + self.kv_heads) * self.head_dim


NATIVE_NORM = True  # benchmarks/cpu_paths.py and the bit-exact parity tests turn it off


def rms_norm(norm: torch.nn.Module, x: torch.Tensor, native=None) -> torch.Tensor:
    """transformers' Llama-family RMSNorm: float32 normalization, cast back, times the weight. With `native` (the torch backend's native library, `_native_library`): one C call, the same steps except
    the sum of squares (in double there), so within a few ulps of torch's; else torch's operations, bit-equal."""
    if native is not None and NATIVE_NORM:
        normed = native.rms_norm(x, norm.weight, norm.variance_epsilon)
        if normed is not None:
            return normed
    normed = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=norm.variance_epsilon)
    return norm.weight * normed.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin` (transformers' rotary, element for element)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


NATIVE_ROTARY = True  # benchmarks/cpu_paths.py turns it off to measure what the fused pass buys


def _native_library(meta):
    """The torch backend's native library (CPU, where it loaded and `TGI_VLM_NATIVE_ATTENTION` is not 0), or None."""
    backend = getattr(meta, "backend", None)
    return getattr(backend, "native", None) if isinstance(backend, TorchPagedBackend) else None


def _rotates_natively(library, k_cache: torch.Tensor | None, qkv: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> bool:
    """Whether the native library (`_native_library`) rotates this layer's heads and stores its K/V (CPU, float32 or
    bfloat16 matching the cache, one packed row of tokens); else torch's operations run."""
    return NATIVE_ROTARY and library is not None and library.can_rotate(qkv, cos, sin, k_cache)


def _lean_forward(self: torch.nn.Module, hidden_states: torch.Tensor, attention_mask=None, position_ids=None,
                  position_embeddings=None, **kwargs) -> torch.Tensor:
    parts: LeanParts = self.__dict__[_PARTS_ATTR]
    attn, mlp = self.self_attn, self.mlp
    bsz, q_len, _ = hidden_states.shape
    meta = kwargs.get("attn_metadata")
    library = _native_library(meta)
    x = rms_norm(self.input_layernorm, hidden_states, library)
    qkv = parts.qkv.product(x)  # [bsz, q_len, (Hq + 2 Hkv) D]
    cos, sin = position_embeddings  # [bsz, q_len, D]
    k_cache, v_cache = meta.kv_cache.flat(attn.layer_idx) if library is not None else (None, None)
    if _rotates_natively(library, k_cache, qkv, cos, sin):  # one C pass, bit-equal to the torch operations below
        query, key, value = library.rotary_and_store(qkv, cos, sin, parts.q_heads, k_cache, v_cache, meta.slots,
                                                     meta.max_slot())
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
    gate_up = parts.gate_up.product(rms_norm(self.post_attention_layernorm, hidden_states, library))
    gate, up = gate_up.split(parts.gate_up.widths, dim=-1)
    return hidden_states + mlp.down_proj.forward(mlp.act_fn(gate) * up)


def _parts(layer: torch.nn.Module) -> LeanParts | None:
    """The fused groups and head counts of a covered layer, or None when it does not qualify."""
    if _PARTS_ATTR in layer.__dict__:
        return None  # already lean
    window_of = LEAN_LAYER_CLASSES.get(type(layer).__name__)
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
    return LeanParts(qkv, gate_up, qkv.widths[0] // head_dim, qkv.widths[1] // head_dim, head_dim, window_of(attn))


_LEAN_CLASSES: dict[type, type] = {}


def _lean_class(cls: type) -> type:
    """`cls` with the lean forward: a subclass made once per layer class (the instance keeps everything else)."""
    if cls not in _LEAN_CLASSES:
        _LEAN_CLASSES[cls] = type(f"Lean{cls.__name__}", (cls,), {"forward": _lean_forward, "_lean_base": cls})
    return _LEAN_CLASSES[cls]


def install_lean_layers(language_model: torch.nn.Module) -> int:
    """Give every covered, fused decoder layer of `language_model` the lean forward (its class becomes the lean
    subclass of its own: parameters, hooks and place in the model unchanged); returns the count."""
    count = 0
    for layer in language_model.modules():
        parts = _parts(layer)
        if parts is None:
            continue
        layer.__dict__[_PARTS_ATTR] = parts
        layer.__class__ = _lean_class(type(layer))
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
