"""Each packed format read into a `GroupedInt8Weight` holds exactly the checkpoint's values, checked against readers
and writers that are not the shard's:

- compressed-tensors `pack-quantized` (the compressed-tensors package, a dev dependency): tensors its own compressor
  packs are read back equal, bit for bit, to its own decompression (scales in float32, so its product is one float32
  rounding, as ours), symmetric and asymmetric, per group and per channel; and its decompressor reads what
  tgi_vlm.testing.quantized_checkpoints writes to the same values;
- GPTQ: a formula written here from the format's definition (element by element, numpy) on the test writer's
  tensors, 4 and 8 bits, symmetric and asymmetric, classic (zeros stored minus one) and v2, activation order (g_idx);
  and AutoAWQ's own AWQ -> GPTQ/ExLlama repacking (`unpack_reorder_pack`, zeros minus one) read equal to AutoAWQ's
  de-quantization of the source (skipped without autoawq);
- AWQ GEMM: the definition formula (the interleaved nibble table) and AutoAWQ's `dequantize_gemm` (skipped without
  autoawq);
- what does not match is refused naming the file and tensor: codes declared 4-bit in 8-bit tensors, a group size
  that does not divide the inputs, groups of a g_idx that are not equal in size; configs the shard does not serve
  (W8A8, other methods, AWQ GEMV, 3-bit GPTQ, Marlin) are refused naming the config file and what to use.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tgi_vlm.quantization.packed_config import LayerScheme, PackedCheckpointError, PackedQuantization
from tgi_vlm.quantization.packed_formats import (
    PackedLayer,
    decode_awq,
    decode_compressed_tensors,
    decode_gptq,
)
from tgi_vlm.testing.quantized_checkpoints import packed_tensors, quantize

OUT, IN = 48, 128
AWQ_NIBBLE_OF_OUTPUT = (0, 4, 1, 5, 2, 6, 3, 7)  # AWQ GEMM: output 8c + j sits in nibble AWQ_NIBBLE_OF_OUTPUT[j]


def layer(tensors: dict[str, torch.Tensor], prefix: str = "model.layers.0.mlp.up_proj") -> PackedLayer:
    return PackedLayer(prefix, tensors, dict.fromkeys(tensors, "model.safetensors"))


def weight(seed: int = 0) -> torch.Tensor:
    return torch.randn(OUT, IN, generator=torch.Generator().manual_seed(seed))


def autoawq_packing():
    """AutoAWQ's packing helpers (awq/utils/packing_utils.py, torch only), loaded without `awq/__init__` (which
    imports its CUDA / datasets stack)."""
    spec = importlib.util.find_spec("awq")
    if spec is None:
        pytest.skip("autoawq is not installed (make install adds it: pip install --no-deps autoawq==0.2.9)")
    path = Path(next(iter(spec.submodule_search_locations))) / "utils" / "packing_utils.py"
    module_spec = importlib.util.spec_from_file_location("autoawq_packing_utils", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


# compressed-tensors ---------------------------------------------------------------------------------------------

def ct_scheme(symmetric: bool, group: int | None, bits: int = 4):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy="group" if group else "channel",
                            group_size=group)
    return QuantizationScheme(targets=["Linear"], weights=args)


def ct_packed_by_the_library(w: torch.Tensor, symmetric: bool, group: int | None, bits: int = 4,
                             scale_dtype: torch.dtype = torch.float32):
    """compressed-tensors' own qparams (min/max) and compressor: the tensors a compressed-tensors checkpoint holds."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = ct_scheme(symmetric, group, bits)
    g = group or w.shape[1]
    groups = w.view(w.shape[0], -1, g)
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    state = {"weight": w, "weight_scale": scale.to(scale_dtype), "weight_zero_point": zero.to(torch.int8)}
    return PackedQuantizationCompressor.compress(state, scheme), scheme


def ct_decompressed_by_the_library(tensors: dict[str, torch.Tensor], scheme) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    state = {**tensors, "weight_scale": tensors["weight_scale"].float()}  # its product in float32: one rounding
    return PackedQuantizationCompressor.decompress(state, scheme)["weight"]


@pytest.mark.parametrize("symmetric,group", [(True, 32), (False, 32), (True, None), (False, 16)])
def test_compressed_tensors_packed_by_its_own_compressor_read_equal_to_its_decompression(symmetric, group):
    tensors, scheme = ct_packed_by_the_library(weight(), symmetric, group)
    assert ("weight_zero_point" in tensors) == (not symmetric)
    ours = decode_compressed_tensors(layer(tensors), LayerScheme(4, group or -1, symmetric), OUT, IN, source="ct")
    theirs = ct_decompressed_by_the_library(tensors, scheme)
    assert torch.equal(ours.dequantize(), theirs)
    assert ours.offsets is None and int(ours.codes.abs().max()) <= 15  # q - z: 4-bit codes minus their zero


@pytest.mark.parametrize("symmetric,group", [(True, 32), (False, 64), (True, -1)])
def test_compressed_tensors_decompressor_reads_the_test_writers_tensors_as_the_shard_does(symmetric, group):
    qw = quantize(weight(1), 4, group, symmetric=symmetric, scale_dtype=torch.float32)
    tensors = packed_tensors("compressed-tensors", qw, 4)
    theirs = ct_decompressed_by_the_library(tensors, ct_scheme(symmetric, group if group > 0 else None))
    ours = decode_compressed_tensors(layer(tensors), LayerScheme(4, group, symmetric), OUT, IN, source="ct")
    assert torch.equal(ours.dequantize(), theirs)
    assert torch.equal(theirs, qw.dequantize(IN if group == -1 else group))


def test_compressed_tensors_8_bit_asymmetric_weights_read_equal_to_the_librarys_decompression():
    """q - z spans 9 bits here: the codes are q and the zero an offset, two float32 products that are exact for
    16-bit scales (as checkpoints store them; float32 scales: within one float32 rounding)."""
    tensors, scheme = ct_packed_by_the_library(weight(2), False, 32, bits=8, scale_dtype=torch.bfloat16)
    ours = decode_compressed_tensors(layer(tensors), LayerScheme(8, 32, False), OUT, IN, source="ct")
    assert torch.equal(ours.dequantize(), ct_decompressed_by_the_library(tensors, scheme))


# GPTQ -----------------------------------------------------------------------------------------------------------

def gptq_by_definition(t: dict[str, torch.Tensor], bits: int, minus_one: bool) -> np.ndarray:
    """W[o, k] = scales[g, o] * (q[k, o] - z[g, o]), g = g_idx[k]; q: bits of qweight[k // per, o] from bit
    bits * (k % per); z: bits of qzeros[g, o // per] from bit bits * (o % per), plus one in the classic format."""
    per, mask = 32 // bits, (1 << bits) - 1
    qweight = t["qweight"].numpy().view(np.uint32).astype(np.int64)
    qzeros = t["qzeros"].numpy().view(np.uint32).astype(np.int64)
    scales, g_idx = t["scales"].float().numpy(), t["g_idx"].numpy().astype(np.int64)
    k = np.arange(qweight.shape[0] * per)[None, :]
    o = np.arange(qweight.shape[1])[:, None]
    q = (qweight[k // per, o] >> (bits * (k % per))) & mask
    g = g_idx[k]
    z = ((qzeros[g, o // per] >> (bits * (o % per))) & mask) + (1 if minus_one else 0)
    return scales[g, o] * (q - z).astype(np.float32)


GPTQ_CASES = {  # bits, group, symmetric, act order, classic format (zeros minus one)
    "4-bit g32 sym": (4, 32, True, False, True),
    "4-bit g32 asym": (4, 32, False, False, True),
    "4-bit g32 asym act-order": (4, 32, False, True, True),
    "4-bit row sym act-order": (4, -1, True, True, True),
    "4-bit g64 asym v2": (4, 64, False, False, False),
    "8-bit g32 sym": (8, 32, True, False, True),
    "8-bit g32 asym v2": (8, 32, False, False, False),
}


@pytest.mark.parametrize("case", GPTQ_CASES)
def test_gptq_tensors_read_equal_to_the_formats_definition(case):
    bits, group, symmetric, act_order, minus_one = GPTQ_CASES[case]
    qw = quantize(weight(3), bits, group, symmetric=symmetric, scale_dtype=torch.float16, act_order=act_order,
                  min_zero=1 if minus_one else 0)
    tensors = packed_tensors("gptq", qw, bits, zeros_minus_one=minus_one)
    ours = decode_gptq(layer(tensors), LayerScheme(bits, group, symmetric, act_order), OUT, IN,
                       zeros_minus_one=minus_one, source="gptq")
    expected = torch.from_numpy(gptq_by_definition(tensors, bits, minus_one))
    assert torch.equal(ours.dequantize(), expected)
    assert (ours.input_order is not None) == (act_order and group != -1)  # one group per row: no order to keep
    if ours.input_order is not None:  # the kernel's view: x's columns gathered in the stored order meet contiguous groups
        x = torch.randn(3, IN, dtype=torch.float64)
        stored = ours.dequantize(stored_order=True).double()
        assert torch.allclose(x[:, ours.input_order] @ stored.t(), x @ expected.double().t(), atol=1e-9)


def test_gptq_written_by_autoawqs_repacking_reads_equal_to_autoawqs_dequantization():
    awq = autoawq_packing()
    qw = quantize(weight(4), 4, 32, symmetric=False, scale_dtype=torch.float16, min_zero=1)  # classic: zero >= 1
    source = packed_tensors("awq", qw, 4)
    qweight, qzeros = awq.unpack_reorder_pack(source["qweight"], source["qzeros"], 4)  # AWQ -> GPTQ (zeros - 1)
    g_idx = torch.arange(IN, dtype=torch.int32) // 32
    gptq = {"qweight": qweight, "qzeros": qzeros, "scales": source["scales"], "g_idx": g_idx}
    ours = decode_gptq(layer(gptq), LayerScheme(4, 32, False), OUT, IN, zeros_minus_one=True, source="gptq")
    theirs = awq.dequantize_gemm(source["qweight"], source["qzeros"], source["scales"].float(), 4, 32)
    assert torch.equal(ours.dequantize(), theirs.t())


# AWQ ------------------------------------------------------------------------------------------------------------

def awq_by_definition(t: dict[str, torch.Tensor], group: int) -> np.ndarray:
    qweight = t["qweight"].numpy().view(np.uint32).astype(np.int64)
    qzeros = t["qzeros"].numpy().view(np.uint32).astype(np.int64)
    nibble = np.array(AWQ_NIBBLE_OF_OUTPUT)
    k = np.arange(qweight.shape[0])[None, :]
    o = np.arange(qweight.shape[1] * 8)[:, None]
    q = (qweight[k, o // 8] >> (4 * nibble[o % 8])) & 15
    z = (qzeros[k // group, o // 8] >> (4 * nibble[o % 8])) & 15
    return t["scales"].float().numpy()[k // group, o] * (q - z).astype(np.float32)


def test_awq_tensors_read_equal_to_the_formats_definition_with_its_interleaved_nibbles():
    qw = quantize(weight(5), 4, 64, symmetric=False, scale_dtype=torch.float16)
    tensors = packed_tensors("awq", qw, 4)
    ours = decode_awq(layer(tensors), LayerScheme(4, 64, False), OUT, IN, source="awq")
    assert torch.equal(ours.dequantize(), torch.from_numpy(awq_by_definition(tensors, 64)))
    plain_order = packed_tensors("gptq", qw, 4, zeros_minus_one=False)["qzeros"]  # not interleaved: differs
    assert not torch.equal(plain_order, tensors["qzeros"])


def test_awq_tensors_read_equal_to_autoawqs_dequantization():
    awq = autoawq_packing()
    qw = quantize(weight(6), 4, 32, symmetric=False, scale_dtype=torch.float16)
    tensors = packed_tensors("awq", qw, 4)
    ours = decode_awq(layer(tensors), LayerScheme(4, 32, False), OUT, IN, source="awq")
    theirs = awq.dequantize_gemm(tensors["qweight"], tensors["qzeros"], tensors["scales"].float(), 4, 32)
    assert torch.equal(ours.dequantize(), theirs.t())


# Refusals -------------------------------------------------------------------------------------------------------

def test_codes_declared_4_bit_in_8_bit_tensors_are_refused_naming_file_and_tensor():
    qw = quantize(weight(), 8, 32, symmetric=True, scale_dtype=torch.float16)
    tensors = packed_tensors("gptq", qw, 8)
    message = ("model.safetensors: tensor model.layers.0.mlp.up_proj.qweight is [32, 48], not [16, 48] as 4-bit "
               "codes of a 48 x 128 layer take: the quantization config does not match the weights")
    with pytest.raises(PackedCheckpointError, match=f"^{re.escape(message)}$"):
        decode_gptq(layer(tensors), LayerScheme(4, 32, True), OUT, IN, zeros_minus_one=True, source="gptq")


def test_a_group_size_that_does_not_divide_the_inputs_is_refused_naming_file_and_tensor():
    tensors = packed_tensors("compressed-tensors", quantize(weight(), 4, 32, symmetric=True,
                                                            scale_dtype=torch.bfloat16), 4)
    message = ("model.safetensors: tensor model.layers.0.mlp.up_proj.weight_scale: group_size 48 does not divide the "
               "layer's 128 inputs")
    with pytest.raises(PackedCheckpointError, match=f"^{re.escape(message)}$"):
        decode_compressed_tensors(layer(tensors), LayerScheme(4, 48, True), OUT, IN, source="ct")


def test_a_g_idx_whose_groups_differ_in_size_is_refused_naming_it():
    qw = quantize(weight(), 4, 32, symmetric=True, scale_dtype=torch.float16)
    tensors = packed_tensors("gptq", qw, 4)
    tensors["g_idx"] = tensors["g_idx"].flip(0).clone()
    tensors["g_idx"][0] = 0  # group 0 now holds 33 inputs, group 3 31
    with pytest.raises(PackedCheckpointError, match=r"tensor model\.layers\.0\.mlp\.up_proj\.g_idx: its groups are not "
                                                    r"4 groups of 32 inputs each"):
        decode_gptq(layer(tensors), LayerScheme(4, 32, True, True), OUT, IN, zeros_minus_one=True, source="gptq")


CONFIG_REFUSALS = {
    "W8A8": ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}},
        "config_groups.group_0: compressed-tensors format 'int-quantized' is not served"),
    "W8A8 packed": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}},
        r"quantized input activations \(W8A8 / W4A8: int8 activations per token at run time\) are not served"),
    "exl2": ({"quant_method": "exl2"}, "quant_method 'exl2' is not served"),
    "bitsandbytes": ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not served"),
    "AWQ GEMV": ({"quant_method": "awq", "version": "gemv", "bits": 4}, "AWQ version 'gemv' is not served"),
    "GPTQ 3-bit": ({"quant_method": "gptq", "bits": 3}, "GPTQ with 3-bit codes is not served"),
    "GPTQ marlin": ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
                    "GPTQ checkpoint_format 'marlin' is not served"),
    "GPTQ marlin (format key)": ({"quant_method": "gptq", "bits": 4, "format": "marlin"},
                                 "GPTQ checkpoint_format 'marlin' is not served"),
    "GPTQ group_size null": ({"quant_method": "gptq", "bits": 4, "group_size": None},
                             "group_size None is not an integer"),
    "GPTQ dynamic 3-bit": ({"quant_method": "gptq", "bits": 4, "dynamic": {"+:.*": {"bits": 3}}},
                           r"dynamic\['\+:\.\*'\]: GPTQ with 3-bit codes is not served"),
    "CT online transforms": ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                              "transform_config": {"config_groups": {"r": {"type": "hadamard"}}}, "config_groups": {}},
                             "transform_config: online transforms"),
    "CT sparse storage": ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                           "sparsity_config": {"format": "sparse-24-bitmask"}, "config_groups": {}},
                          "sparsity_config: sparse weight storage"),
    "CT group_size null": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": None}}}},
        "config_groups.g: group_size None is not an integer"),
}


@pytest.mark.parametrize("case", CONFIG_REFUSALS)
def test_quantization_configs_the_shard_does_not_serve_are_refused_naming_the_file(case):
    config, message = CONFIG_REFUSALS[case]
    with pytest.raises(PackedCheckpointError, match=f"^m/config.json quantization_config.*{message}"):
        PackedQuantization.from_config(config, "m/config.json quantization_config")


def test_each_methods_exclusions_keep_those_layers_unquantized():
    awq = PackedQuantization.from_config({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm",
                                          "modules_to_not_convert": ["visual"]}, "c")
    assert awq.scheme_for("visual.blocks.0.attn.qkv") is None
    assert awq.scheme_for("model.layers.0.mlp.up_proj") == LayerScheme(4, 128, False)
    gptq = PackedQuantization.from_config({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True,
                                           "dynamic": {r"-:.*\.mlp\.down_proj": {},
                                                       r"+:.*layers\.1\..*": {"bits": 8, "group_size": 32}}}, "c")
    assert gptq.scheme_for("model.layers.0.mlp.down_proj") is None
    assert gptq.scheme_for("model.layers.1.self_attn.q_proj") == LayerScheme(8, 32, True)
    assert gptq.scheme_for("model.layers.0.self_attn.q_proj") == LayerScheme(4, 128, True)
    blocks = PackedQuantization.from_config({"quant_method": "gptq", "bits": 4, "modules_in_block_to_quantize": [
        ["self_attn.q_proj"], ["mlp.up_proj"]]}, "c")
    assert blocks.scheme_for("model.layers.0.mlp.up_proj") is not None
    assert blocks.scheme_for("model.layers.0.mlp.down_proj") is None
    ct = PackedQuantization.from_config({"quant_method": "compressed-tensors", "format": "pack-quantized",
                                         "ignore": ["lm_head", "re:.*visual.*"], "config_groups": {"g": {
                                             "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                                                                                "strategy": "group", "group_size": 32,
                                                                                "symmetric": True}}}}, "c")
    assert ct.scheme_for("lm_head") is None and ct.scheme_for("visual.merger.mlp.0") is None
    assert ct.scheme_for("model.visual.blocks.0.attn.qkv") is None
    assert ct.scheme_for("model.layers.0.mlp.up_proj") == LayerScheme(4, 32, True)


def test_gptq_v2_named_by_the_format_key_keeps_its_zero_points_as_stored():
    """GPTQModel writes `"format": "gptq_v2"` (no checkpoint_format): zeros as stored, not stored minus one."""
    v2 = PackedQuantization.from_config({"quant_method": "gptq", "bits": 4, "format": "gptq_v2"}, "c")
    classic = PackedQuantization.from_config({"quant_method": "gptq", "bits": 4}, "c")
    assert not v2.gptq_zeros_minus_one and classic.gptq_zeros_minus_one


def test_compressed_tensors_groups_rank_a_named_layer_over_a_pattern_over_the_class_name():
    """compressed-tensors' precedence, whatever the groups' order: a mixed-precision config's "Linear" group listed
    first must not take the layers a later group names."""
    def group(bits, targets):
        return {"targets": targets, "weights": {"num_bits": bits, "type": "int", "strategy": "group",
                                                "group_size": 32, "symmetric": True}}
    ct = PackedQuantization.from_config({"quant_method": "compressed-tensors", "format": "pack-quantized",
                                         "config_groups": {"all": group(4, ["Linear"]),
                                                           "down": group(8, ["re:.*down_proj"]),
                                                           "one": group(8, ["model.layers.0.self_attn.q_proj"])}}, "c")
    assert ct.scheme_for("model.layers.0.mlp.up_proj").bits == 4
    assert ct.scheme_for("model.layers.3.mlp.down_proj").bits == 8
    assert ct.scheme_for("model.layers.0.self_attn.q_proj").bits == 8


def test_activation_order_without_its_group_index_is_refused_naming_the_tensor():
    tensors = packed_tensors("gptq", quantize(weight(), 4, 32, symmetric=True, scale_dtype=torch.float16), 4)
    tensors.pop("g_idx", None)
    with pytest.raises(PackedCheckpointError, match=r"up_proj\.g_idx: the config says activation order"):
        decode_gptq(layer(tensors), LayerScheme(4, 32, True, True), OUT, IN, zeros_minus_one=True, source="gptq")


def test_non_zero_zero_points_under_a_symmetric_scheme_are_refused():
    """An asymmetric checkpoint whose config says symmetric would otherwise be read without its zero points."""
    tensors = packed_tensors("compressed-tensors", quantize(weight(), 4, 32, symmetric=False,
                                                            scale_dtype=torch.bfloat16), 4)
    assert "weight_zero_point" in tensors
    with pytest.raises(PackedCheckpointError, match="weight_zero_point: non-zero zero points for a symmetric scheme"):
        decode_compressed_tensors(layer(tensors), LayerScheme(4, 32, True), OUT, IN, source="ct")


def test_inputs_that_do_not_fill_whole_words_are_refused_naming_the_tensor():
    tensors = packed_tensors("compressed-tensors", quantize(weight(), 4, 32, symmetric=True,
                                                            scale_dtype=torch.bfloat16), 4)
    tensors["weight_shape"] = torch.tensor([OUT, IN + 4])  # a layer of 132 inputs: not a whole number of words
    with pytest.raises(PackedCheckpointError, match="weight_packed: the layer's 132 inputs do not fill whole 32-bit"):
        decode_compressed_tensors(layer(tensors), LayerScheme(4, -1, True), OUT, IN + 4, source="ct")
