"""`tgi_vlm::grouped_int8_linear`: x times a weight held as int8 codes with a float32 scale (and offset) per group of
inputs equals F.linear over the de-quantized weight within float32 sums' bound (bf16: plus its one rounding), at every
row count (row tiles of 8, output blocks of 16 taken 4 / 2 at a time, their tails) and group size, and refuses inputs
it cannot take before any C runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.unit.kernels_here import needs, require
from tgi_vlm.kernels.cpu import ops
from tgi_vlm.quantization.grouped import GroupedInt8Weight

needs_the_op = needs("grouped_int8_linear")


def grouped_weight(out: int, in_features: int, group: int, offsets: bool, seed: int) -> GroupedInt8Weight:
    g = torch.Generator().manual_seed(seed)
    groups = in_features // group
    return GroupedInt8Weight(
        codes=torch.randint(-128, 128, (out, in_features), dtype=torch.int8, generator=g),
        scales=torch.rand(out, groups, generator=g) * 0.02,
        offsets=torch.rand(out, groups, generator=g) * 0.1 if offsets else None, group=group, source="test")


def within_bound(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    exact = F.linear(x.double(), weight.double())
    magnitude = x.double().abs() @ weight.double().abs().T
    bound = (x.shape[1] + 8) * 2.0 ** -24 * magnitude * 2  # float32 products and sums, the offsets' term
    if y.dtype == torch.bfloat16:  # the output rounded to bf16 once; on AMX tiles (4..32 rows) each weight too
        bound = bound + magnitude * 2.0 ** -8
    return bool(((y.double() - exact).abs() <= bound + 1e-30).all())


@needs_the_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out,in_features,group,offsets", [
    (640, 1024, 32, True), (2048, 640, 32, False), (640, 2048, 16, False), (17, 64, 64, False), (1, 32, 16, True),
    (33, 96, 32, True), (100, 640, 640, False)])
def test_products_equal_f_linear_over_the_dequantized_weight_at_every_row_count(out, in_features, group, offsets,
                                                                                   dtype):
    require("grouped_int8_linear")
    weight = grouped_weight(out, in_features, group, offsets, seed=out + in_features)
    dense = weight.dequantize()
    for rows in (1, 2, 3, 4, 5, 8, 9, 11, 12, 16, 17, 32, 33):  # FMA loop; AMX tiles (bf16, 12..32); FMA
        x = torch.randn(rows, in_features).to(dtype)
        y = ops.grouped_int8_linear(x, weight.codes, weight.scales, weight.offsets, group)
        assert y.dtype == dtype and y.shape == (rows, out)
        assert within_bound(y, x.float(), dense), (rows, out, in_features, group)


@needs_the_op
def test_a_nan_input_gives_nan_outputs_in_bf16_not_infinities():
    require("grouped_int8_linear")
    weight = grouped_weight(16, 32, 32, False, seed=1)
    x = torch.randn(2, 32).bfloat16()
    x[1, 3] = float("nan")
    y = ops.grouped_int8_linear(x, weight.codes, weight.scales, None, 32)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all()


@pytest.mark.parametrize("change,message", [
    (dict(group=8), "a group that is a multiple of 16"),
    (dict(group=48), "a group that is a multiple of 16 dividing in"),
    (dict(x=torch.randn(2, 64).half()), "contiguous float32/bfloat16 x"),
    (dict(x=torch.randn(64, 2).T), "contiguous float32/bfloat16 x"),
    (dict(x=torch.randn(2, 32)), "codes .* do not|inconsistent inputs"),
    (dict(codes=torch.zeros(4, 64, dtype=torch.uint8)), "int8 codes"),
    (dict(scales=torch.zeros(4, 3)), r"scales must be contiguous float32 \(4, 2\)"),
    (dict(scales=torch.zeros(4, 2, dtype=torch.float64)), "scales must be contiguous float32"),
    (dict(offsets=torch.zeros(2, 4).T), "offsets must be contiguous float32"),
])
def test_inputs_it_cannot_take_are_refused_before_any_c_runs(change, message):
    inputs = dict(x=torch.randn(2, 64), codes=torch.zeros(4, 64, dtype=torch.int8), scales=torch.ones(4, 2),
                  offsets=None, group=32)
    inputs.update(change)
    with pytest.raises(ValueError, match=message):
        ops.grouped_int8_linear(**inputs)
