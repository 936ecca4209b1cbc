"""One layer's packed tensors (AWQ, GPTQ, compressed-tensors) -> a `GroupedInt8Weight` holding exactly its values.

Each format stores W[o, k] = s[o, g] * (q[o, k] - z[o, g]) with integer codes q, zero points z (0 or none when
symmetric) and a float16/bfloat16 scale s per group g of inputs; they differ in how the integers are packed:

- GPTQ: `qweight` [in * bits / 32, out] int32, inputs packed along the rows (input k of row r at bits
  (k - r * per_word) * bits); `qzeros` [groups, out * bits / 32] outputs packed along the columns; `scales` [groups,
  out]; `g_idx` [in] names each input's group (activation order: not k // group). The classic format
  (checkpoint_format "gptq") stores z - 1 (so a stored 15 means 16), gptq_v2 stores z.
- AWQ (GEMM): `qweight` [in, out / 8] and `qzeros` [groups, out / 8], outputs packed along the columns in an
  interleaved order: the word's nibble i holds output 8c + AWQ_PACK_ORDER[i]; z as stored; `scales` [groups, out].
- compressed-tensors `pack-quantized`: `weight_packed` [out, in * bits / 32] (inputs along the columns, element i of
  a row at bit i * bits), codes stored as q + 2^(bits-1) (q signed); `weight_zero_point` (asymmetric) packed the same
  way along the outputs, [out * bits / 32, groups]; `weight_scale` [out, groups]; `weight_shape` [2];
  `weight_g_idx` with actorder "group".

The integers become int8 codes q - z with the scale kept (float32, exact from float16 / bfloat16), no offset: so
`dequantize` computes s * (q - z) in one float32 product, which for a 16-bit scale and codes of at most 9 bits is
exact, the format's value itself. Where q - z does not fit int8 (8-bit asymmetric codes) the codes are
q - 2^(bits-1) with offset (z - 2^(bits-1)) * s (exact for 16-bit scales too; float32 scales: within one float32
rounding, two products instead of one). Every shape is checked against the
layer and the config; a mismatch is refused naming the file and tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tgi_vlm.quantization.grouped import GroupedInt8Weight
from tgi_vlm.quantization.packed_config import LayerScheme, PackedCheckpointError

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: nibble i of a word holds output 8c + AWQ_PACK_ORDER[i]


@dataclass(frozen=True)
class PackedLayer:
    """One layer's tensors from the checkpoint (suffix -> tensor) and where they are, for messages."""

    prefix: str  # checkpoint name of the layer: "model.layers.0.mlp.up_proj"
    tensors: dict[str, torch.Tensor]
    files: dict[str, str]  # suffix -> the safetensors file holding it

    def where(self, suffix: str) -> str:
        return f"{self.files.get(suffix, '?')}: tensor {self.prefix}.{suffix}"

    def need(self, suffix: str) -> torch.Tensor:
        if suffix not in self.tensors:
            raise PackedCheckpointError(f"{self.files.get(next(iter(self.files), ''), '?')}: layer {self.prefix} has "
                                        f"no {suffix} (holds {', '.join(sorted(self.tensors))})")
        return self.tensors[suffix]

    def check_shape(self, suffix: str, expected: tuple[int, ...], why: str) -> torch.Tensor:
        t = self.need(suffix)
        if tuple(t.shape) != tuple(expected):
            raise PackedCheckpointError(f"{self.where(suffix)} is {list(t.shape)}, not {list(expected)} as {why}: the "
                                        "quantization config does not match the weights")
        return t


def unpack_along_columns(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [r, c] -> int32 [r, c * 32 / bits]: element j of word c at column c * per_word + j (bits j * bits)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(words.shape[0], -1)


def unpack_along_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [r, c] -> int32 [r * 32 / bits, c]: element j of word r at row r * per_word + j."""
    return unpack_along_columns(words.t().contiguous(), bits).t().contiguous()


def grouped_weight(q: torch.Tensor, zeros: torch.Tensor | None, scales: torch.Tensor, group: int, bits: int,
                   source: str, input_order: torch.Tensor | None = None, *, signed: bool = False) -> GroupedInt8Weight:
    """q [out, in] and zeros [out, groups] (integers, None: 0; `signed`: both in -2^(bits-1)..2^(bits-1)-1, else
    0..2^bits-1), scales [out, groups] -> W = s * (q - z) as codes."""
    scales = scales.to(torch.float32).contiguous()
    q = q.to(torch.int32)
    if zeros is None:
        return GroupedInt8Weight(q.to(torch.int8).contiguous(), scales, None, group, source, input_order)
    zeros = zeros.to(torch.int32)
    diff = q - zeros.repeat_interleave(group, dim=1)
    if int(diff.min()) >= -128 and int(diff.max()) <= 127:
        return GroupedInt8Weight(diff.to(torch.int8).contiguous(), scales, None, group, source, input_order)
    center = 0 if signed else 1 << (bits - 1)  # 8-bit asymmetric: q - 128 fits, its zero goes into the offset
    return GroupedInt8Weight((q - center).to(torch.int8).contiguous(), scales, ((zeros - center) * scales).contiguous(),
                             group, source, input_order)


def _group_size(layer: PackedLayer, scheme: LayerScheme, in_features: int, scale_suffix: str) -> int:
    group = in_features if scheme.group == -1 else scheme.group
    if group <= 0 or in_features % group:
        raise PackedCheckpointError(f"{layer.where(scale_suffix)}: group_size {scheme.group} does not divide the "
                                    f"layer's {in_features} inputs")
    return group


def _divides(layer: PackedLayer, suffix: str, count: int, per_word: int, what: str) -> None:
    if count % per_word:
        raise PackedCheckpointError(f"{layer.where(suffix)}: the layer's {count} {what} do not fill whole 32-bit words "
                                    f"of {per_word} codes")


def _act_order_index(layer: PackedLayer, scheme: LayerScheme, suffix: str) -> None:
    if scheme.act_order and suffix not in layer.tensors:
        raise PackedCheckpointError(f"{layer.where(suffix)}: the config says activation order (desc_act / actorder "
                                    f"group) but the layer has no {suffix} to say which group each input is in")


def _in_group_order(layer: PackedLayer, suffix: str, q: torch.Tensor, group: int,
                    groups: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The codes `q` `[out, in]` with their columns in group order where the layer has a group index `suffix` (an
    activation-order checkpoint), and that order (None: already in order, or no index)."""
    if suffix not in layer.tensors:
        return q, None
    g_idx = layer.check_shape(suffix, (q.shape[1],), "one group index per input")
    order = _input_order(layer, suffix, g_idx, group, groups)
    return (q, None) if order is None else (q[:, order], order)


def _input_order(layer: PackedLayer, suffix: str, groups_of_inputs: torch.Tensor, group: int,
                 groups: int) -> torch.Tensor | None:
    """The column order that makes each group contiguous (None: already in order); refused unless every group then
    holds exactly `group` inputs, in turn."""
    g_idx = groups_of_inputs.to(torch.int64)
    contiguous = torch.arange(g_idx.numel()) // group
    if torch.equal(g_idx, contiguous):
        return None
    order = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[order], contiguous) or int(g_idx.max()) >= groups:
        raise PackedCheckpointError(f"{layer.where(suffix)}: its groups are not {groups} groups of {group} inputs each")
    return order


def decode_gptq(layer: PackedLayer, scheme: LayerScheme, out_features: int, in_features: int, *,
                zeros_minus_one: bool, source: str) -> GroupedInt8Weight:
    bits, per_word = scheme.bits, 32 // scheme.bits
    group = _group_size(layer, scheme, in_features, "scales")
    groups = in_features // group
    _divides(layer, "qweight", in_features, per_word, "inputs")
    _divides(layer, "qzeros", out_features, per_word, "outputs")
    _act_order_index(layer, scheme, "g_idx")
    words = layer.check_shape("qweight", (in_features // per_word, out_features), f"{bits}-bit codes of a "
                              f"{out_features} x {in_features} layer take")
    scales = layer.check_shape("scales", (groups, out_features), f"{groups} groups of {group} take")
    packed_zeros = layer.check_shape("qzeros", (groups, out_features // per_word), f"{bits}-bit zeros take")
    q = unpack_along_rows(words, bits).t()  # [out, in]
    zeros = unpack_along_columns(packed_zeros, bits).t() + (1 if zeros_minus_one else 0)  # [out, groups]
    q, order = _in_group_order(layer, "g_idx", q, group, groups)
    return grouped_weight(q, zeros, scales.t(), group, bits, source, order)


def decode_awq(layer: PackedLayer, scheme: LayerScheme, out_features: int, in_features: int, *,
               source: str) -> GroupedInt8Weight:
    group = _group_size(layer, scheme, in_features, "scales")
    groups = in_features // group
    _divides(layer, "qweight", out_features, 8, "outputs")
    words = layer.check_shape("qweight", (in_features, out_features // 8), f"4-bit codes of a {out_features} x "
                              f"{in_features} layer take")
    scales = layer.check_shape("scales", (groups, out_features), f"{groups} groups of {group} take")
    packed_zeros = layer.check_shape("qzeros", (groups, out_features // 8), "4-bit zeros take")
    return grouped_weight(_awq_outputs(words).t(), _awq_outputs(packed_zeros).t(), scales.t(), group, 4, source)


def _awq_outputs(words: torch.Tensor) -> torch.Tensor:
    """AWQ's interleaved words [r, c] -> [r, 8c] in output order."""
    nibbles = unpack_along_columns(words, 4).view(words.shape[0], -1, 8)
    outputs = torch.empty_like(nibbles)
    outputs[:, :, list(AWQ_PACK_ORDER)] = nibbles
    return outputs.view(words.shape[0], -1)


def decode_compressed_tensors(layer: PackedLayer, scheme: LayerScheme, out_features: int, in_features: int, *,
                              source: str) -> GroupedInt8Weight:
    bits, per_word = scheme.bits, 32 // scheme.bits
    shape = layer.need("weight_shape")
    if [int(v) for v in shape.reshape(-1)] != [out_features, in_features]:
        raise PackedCheckpointError(f"{layer.where('weight_shape')} says {[int(v) for v in shape.reshape(-1)]}, the "
                                    f"layer is [{out_features}, {in_features}]")
    group = _group_size(layer, scheme, in_features, "weight_scale")
    groups = in_features // group
    _divides(layer, "weight_packed", in_features, per_word, "inputs")
    _act_order_index(layer, scheme, "weight_g_idx")
    words = layer.check_shape("weight_packed", (out_features, in_features // per_word), f"{bits}-bit codes of a "
                              f"{out_features} x {in_features} layer take")
    scales = layer.check_shape("weight_scale", (out_features, groups), f"{groups} groups of {group} take")
    center = 1 << (bits - 1)
    q = unpack_along_columns(words, bits) - center
    zeros = None
    if scheme.symmetric and "weight_zero_point" in layer.tensors:
        # symmetric: the codes are centred and no zero point is stored; one that is stored must say nothing else
        stored = layer.tensors["weight_zero_point"]
        if stored.dtype == torch.int32 and tuple(stored.shape) == (out_features // per_word, groups):
            stored = unpack_along_rows(stored, bits) - center
        if stored.numel() and bool(stored.to(torch.int64).ne(0).any()):
            raise PackedCheckpointError(f"{layer.where('weight_zero_point')}: non-zero zero points for a symmetric "
                                        f"scheme (the config and the weights disagree)")
    if not scheme.symmetric:
        _divides(layer, "weight_zero_point", out_features, per_word, "outputs")
        packed = layer.check_shape("weight_zero_point", (out_features // per_word, groups), f"{bits}-bit zero points "
                                   "packed along the outputs take")
        zeros = unpack_along_rows(packed, bits) - center
    q, order = _in_group_order(layer, "weight_g_idx", q, group, groups)
    return grouped_weight(q, zeros, scales, group, bits, source, order, signed=True)


def decoder_for(method: str) -> Callable[..., GroupedInt8Weight]:
    return {"gptq": decode_gptq, "awq": decode_awq, "compressed-tensors": decode_compressed_tensors}[method]


# The tensor whose presence marks a layer stored packed, and every tensor of such a layer, per method.
MARKERS = {"gptq": "qweight", "awq": "qweight", "compressed-tensors": "weight_packed"}
SUFFIXES = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales"),
            "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")}
