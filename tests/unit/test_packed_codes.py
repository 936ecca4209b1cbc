"""Codes of 4 or 5 bits held packed (quantization/packed_codes.py): packing is lossless, takes the fewest bits the
codes' range needs, and the packed ops give bit for bit what the int8 ops give on the same codes, at every row count
(FMA loop, AMX tiles for bf16 12..32 rows), group size, with and without offsets; refusals come before any C runs; a
planned layer holds its codes packed, shares them with an embedding, and fuses packed siblings without unpacking."""

from __future__ import annotations

import pytest
import torch

from tests.unit.kernels_here import needs, require
from tgi_vlm.kernels.cpu import ops
from tgi_vlm.layers.linear.grouped import GroupedInt8Linear
from tgi_vlm.layers.linear.kernels import PlainWeights
from tgi_vlm.quantization.grouped import GroupedInt8Weight
from tgi_vlm.quantization.packed_codes import PackedCodes

needs_packed = needs("grouped_packed_linear")


def random_codes(out: int, in_features: int, low: int, high: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (out, in_features), dtype=torch.int8, generator=g)


@pytest.mark.parametrize("low,high,bits,zero", [(0, 16, 4, 0), (-8, 8, 4, 8), (0, 32, 5, 0), (-16, 16, 5, 16),
                                                 (-3, 2, 4, 8), (-9, 0, 5, 16)])
def test_packing_is_lossless_in_the_fewest_bits_the_range_takes(low, high, bits, zero):
    codes = random_codes(7, 96, low, high, seed=bits + zero)
    packed = PackedCodes.pack(codes)
    assert (packed.bits, packed.zero) == (bits, zero)
    assert packed.shape == (7, 96) and packed.nibbles.shape == (7, 48)
    assert packed.nbytes == 7 * 48 + (7 * 3 * 4 if bits == 5 else 0)
    assert torch.equal(packed.unpack(), codes)
    assert torch.equal(packed.rows(torch.tensor([5, 0])).unpack(), codes[[5, 0]])


def test_the_layout_is_a_gguf_q5_0_blocks_nibbles_and_high_bits():
    codes = torch.zeros(1, 32, dtype=torch.int8) - 16  # stored values 0 ...
    codes[0, 1], codes[0, 17], codes[0, 31] = -16 + 5, -16 + 9, 15  # value 5 at 1, 9 at 17, 31 at 31
    packed = PackedCodes.pack(codes)
    assert packed.nibbles[0, 1] == 5 | (9 << 4) and packed.nibbles[0, 15] == 0x0F << 4
    assert packed.high[0, 0] == -(1 << 31)  # only value 31 (input 31) has bit 4 set: the word's top bit


@pytest.mark.parametrize("low,high", [(-17, 15), (0, 32), (-16, 16), (-128, 127)])
def test_codes_wider_than_5_bits_or_rows_not_in_32s_stay_int8(low, high):
    codes = torch.zeros(2, 64, dtype=torch.int8)
    codes[0, 5], codes[1, 40] = low, high  # the range's two ends: 33 values or more
    assert PackedCodes.pack(codes) is None
    assert PackedCodes.pack(random_codes(3, 48, 0, 16, seed=2)) is None  # 48 inputs: not a multiple of 32


def grouped(codes: torch.Tensor, group: int, offsets: bool, seed: int) -> GroupedInt8Weight:
    g = torch.Generator().manual_seed(seed)
    out, groups = codes.shape[0], codes.shape[1] // group
    return GroupedInt8Weight(codes=codes, scales=torch.rand(out, groups, generator=g) * 0.02,
                             offsets=torch.rand(out, groups, generator=g) * 0.1 if offsets else None, group=group,
                             source="test")


@needs_packed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out,in_features,group,offsets,low,high", [
    (640, 1024, 32, True, 0, 16), (100, 640, 32, False, -16, 16), (33, 96, 32, True, 0, 32),
    (17, 256, 128, False, -8, 8), (1, 64, 64, True, -16, 16), (48, 160, 16, True, 0, 16)])
def test_packed_products_are_the_int8_products_bit_for_bit(out, in_features, group, offsets, low, high, dtype):
    require("grouped_packed_linear")
    weight = grouped(random_codes(out, in_features, low, high, seed=out), group, offsets, seed=in_features)
    packed = PackedCodes.pack(weight.codes)
    for rows in (1, 2, 3, 4, 5, 8, 9, 12, 16, 17, 32, 33):  # FMA loop; AMX tiles (bf16, 12..32); FMA
        x = torch.randn(rows, in_features).to(dtype)
        want = ops.grouped_int8_linear(x, weight.codes, weight.scales, weight.offsets, group)
        got = ops.grouped_packed_linear(x, packed.nibbles, packed.high, packed.zero, weight.scales, weight.offsets,
                                        group)
        assert torch.equal(got, want), (rows, dtype)
    want = ops.grouped_int8_dequantize(weight.codes, weight.scales, weight.offsets, group, dtype)
    got = ops.grouped_packed_dequantize(packed.nibbles, packed.high, packed.zero, weight.scales, weight.offsets, group,
                                        dtype)
    assert torch.equal(got, want)


@needs_packed
@pytest.mark.parametrize("change,message", [
    (lambda p: dict(p, nibbles=p["nibbles"][:, :24].contiguous()), "multiple of 32"),
    (lambda p: dict(p, nibbles=p["nibbles"].to(torch.int8)), "uint8 nibbles"),
    (lambda p: dict(p, zero=3), "zero 0, 8"),
    (lambda p: dict(p, high=p["high"][:, :1].contiguous()), "high bits must be"),
    (lambda p: dict(p, high=p["high"].to(torch.int64)), "high bits must be"),
    (lambda p: dict(p, x=torch.randn(1, 96)), "inconsistent inputs"),
    (lambda p: dict(p, scales=p["scales"][:, :1].contiguous()), "scales must be"),
])
def test_packed_inputs_it_cannot_take_are_refused_before_any_c_runs(change, message):
    require("grouped_packed_linear")
    packed = PackedCodes.pack(random_codes(4, 64, -16, 16, seed=3))
    args = change(dict(x=torch.randn(2, 64), nibbles=packed.nibbles, high=packed.high, zero=packed.zero,
                       scales=torch.rand(4, 2), offsets=None, group=32))
    with pytest.raises(ValueError, match=message):
        ops.grouped_packed_linear(**args)


def linear_with(weight: GroupedInt8Weight) -> torch.nn.Linear:
    out, in_features = weight.shape
    return torch.nn.Linear(in_features, out, bias=False, device="meta")


@needs_packed
def test_a_native_layer_holds_its_codes_packed_and_computes_what_the_int8_layer_computes(monkeypatch):
    require("grouped_packed_linear")
    codes = random_codes(64, 128, -16, 16, seed=4)
    weight = grouped(codes.clone(), 32, False, seed=5)
    kernel = GroupedInt8Linear(PlainWeights((linear_with(weight),)), weight, native=True)
    assert isinstance(weight.codes, PackedCodes) and kernel.name.endswith("+native+packed5")
    assert weight.nbytes == 64 * 64 + 64 * 4 * 4 + 64 * 4 * 4  # nibbles, high words, float32 scales
    assert torch.equal(weight.int8_codes(), codes)
    monkeypatch.setattr("tgi_vlm.layers.linear.grouped.PACK_CODES", False)  # the same layer, codes a byte each
    unpacked = GroupedInt8Linear(PlainWeights((linear_with(weight),)), grouped(codes.clone(), 32, False, seed=5),
                                 native=True)
    assert unpacked.weight.codes.dtype == torch.int8 and unpacked.name.endswith("+native")
    for rows in (1, 7, 40):  # native product, native product, sliced (de-quantized, then torch's product)
        x = torch.randn(rows, 128)
        assert torch.equal(kernel(x), unpacked(x)), rows


@needs_packed
def test_packed_siblings_fuse_without_unpacking_and_unlike_ones_fuse_as_int8():
    require("grouped_packed_linear")
    a, b, wide = (grouped(random_codes(32, 64, -16, 16, seed=s), 32, False, seed=s) for s in (6, 7, 8))
    wide.codes = random_codes(32, 64, -100, 100, seed=9)
    modules = []
    for w in (a, b, wide):
        module = linear_with(w)
        module.__class__ = type("M", (torch.nn.Linear,), {})
        module.linear_kernel = GroupedInt8Linear(PlainWeights((module,)), w, native=True)
        modules.append(module)
    fused = modules[0].linear_kernel.fused_over(PlainWeights(tuple(modules[:2])))
    assert isinstance(fused.weight.codes, PackedCodes) and fused.weight.codes.zero == 16
    assert torch.equal(fused.weight.int8_codes(), torch.cat([a.int8_codes(), b.int8_codes()]))
    mixed = modules[0].linear_kernel.fused_over(PlainWeights(tuple(modules)))
    assert mixed.weight.codes.dtype == torch.int8 and not mixed.name.endswith("packed5")
    assert torch.equal(mixed.weight.codes, torch.cat([a.int8_codes(), b.int8_codes(), wide.codes]))
