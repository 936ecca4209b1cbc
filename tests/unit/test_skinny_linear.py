"""layers/skinny_linear.py and `tgi_vlm::skinny_linear`: the native float32 loop for decode-sized linears computes
F.linear to float32 rounding, refuses inputs that do not fit its weight layout before any C runs, and the
`mkl-packed+native-skinny` kernel sends it exactly the products it is for."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.unit.kernels_here import needs, op_calls, require
from tgi_vlm.config import KernelSettings
from tgi_vlm.kernels.cpu import ops
from tgi_vlm.kernels.cpu.ops import blocked_weight
from tgi_vlm.layers import skinny_linear
from tgi_vlm.layers.linear.kernels import MklPackedLinear, MklSkinnyLinear, PlainWeights, mkl_packs_float32
from tgi_vlm.layers.skinny_linear import skinny_available, skinny_weight

needs_the_loop = needs("skinny_linear")


@pytest.fixture(scope="module")
def native():
    loaded = require("skinny_linear")
    assert ops.skinny_max_rows() >= skinny_linear.MAX_ROWS
    return loaded


def _rms_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want).pow(2).mean().sqrt().item()


# (in, out): the bench model's products, the lm-head's width, and odd sizes (columns past a block, a short K)
SHAPES = [(768, 1280), (2560, 768), (768, 3763), (64, 48), (33, 17), (300, 1)]


@needs_the_loop
@pytest.mark.parametrize("in_features,out_features", SHAPES)
def test_products_are_float32_accurate_for_every_decode_row_count(native, in_features, out_features):
    """Against a float64 product, with and without bias, for every row count the loop takes (row tiles of 14 split
    evenly, so 15 and 24 are two tiles): each output within the worst-case bound of float32 sums in chunks of 256
    ((256 + chunks + 2) ulps of the sum of |terms|), and the typical (RMS) error, over 256 outputs or more, within 3x MKL's own (F.linear)."""
    torch.manual_seed(in_features + out_features)
    weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    packed = skinny_weight(weight)
    assert packed is not None and packed.max_rows == skinny_linear.MAX_ROWS
    for rows in (1, 2, 7, 13, 14, 15, 24):
        x = torch.randn(rows, in_features)
        for b in (bias, None):
            want = F.linear(x.double(), weight.double(), None if b is None else b.double())
            got = packed(x, b)
            assert got.shape == (rows, out_features) and got.dtype == torch.float32
            magnitude = x.double().abs() @ weight.double().abs().T + (0 if b is None else b.double().abs())
            ulps = 256 + -(-in_features // 256) + 2
            assert ((got.double() - want).abs() <= ulps * 2.0 ** -24 * magnitude).all(), (rows, b is None)
            if rows * out_features >= 256:  # enough outputs for a typical error to mean something
                mkl = F.linear(x, weight, b)
                assert _rms_error(got, want) <= 3 * _rms_error(mkl, want) + 1e-9, (rows, b is None)


def test_the_blocked_layout_holds_16_columns_per_input_position_and_zero_padding():
    weight = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)
    blocked = blocked_weight(weight)
    assert blocked.shape == (4, 3, 16) and blocked.is_contiguous() and blocked.data_ptr() % 64 == 0
    assert torch.equal(blocked[0, 2], weight[:16, 2]) and torch.equal(blocked[2, 1, :8], weight[32:, 1])
    assert torch.equal(blocked[2, :, 8:], torch.zeros(3, 8)) and torch.equal(blocked[3], torch.zeros(3, 16))


@needs_the_loop
def test_batched_inputs_keep_their_leading_shape(native):
    torch.manual_seed(0)
    weight = torch.randn(96, 64)
    x = torch.randn(1, 9, 64)
    got = skinny_weight(weight)(x, None)
    assert got.shape == (1, 9, 96)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_inconsistent_inputs_are_refused_before_the_c_code():
    """The C code indexes raw memory: wrong shapes, dtypes or row counts stop in Python with a ValueError (these
    checks come before the library is looked up: they hold where it is not built)."""
    weight = torch.randn(48, 64)
    blocked = blocked_weight(weight)
    with pytest.raises(ValueError, match="inconsistent"):
        ops.skinny_linear(torch.randn(3, 63), blocked, 48, None)
    with pytest.raises(ValueError, match="inconsistent"):
        ops.skinny_linear(torch.randn(3, 64), blocked, 80, None)  # more outputs than the layout holds
    with pytest.raises(ValueError, match="inconsistent"):
        ops.skinny_linear(torch.randn(3, 64), blocked, 48, torch.randn(47))
    with pytest.raises(ValueError, match="inconsistent"):
        ops.skinny_linear(torch.randn(3, 64).to(torch.bfloat16), blocked, 48, None)
    with pytest.raises(ValueError, match="inconsistent"):
        ops.skinny_linear(torch.randn(0, 64), blocked, 48, None)
    with pytest.raises(ValueError, match="inconsistent"):
        ops.skinny_linear(torch.randn(3, 64), blocked[:, :, :8], 48, None)


@needs_the_loop
def test_more_rows_than_the_loop_takes_are_refused(native):
    blocked = blocked_weight(torch.randn(48, 64))
    with pytest.raises(ValueError, match="inconsistent"):
        ops.skinny_linear(torch.randn(ops.skinny_max_rows() + 1, 64), blocked, 48, None)


@needs_the_loop
def test_packed_float32_weights_use_the_loop_for_decode_rows_and_mkl_above(native):
    """With a decode copy: 1..MAX_ROWS rows through the native loop, more through MKL's packed GEMM; without one
    (a model too large for a second copy) everything through MKL."""
    assert mkl_packs_float32()
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 64), torch.randn(48)
    layers = [torch.nn.Linear(64, 48) for _ in range(2)]
    for layer in layers:
        layer.weight.data, layer.bias.data = weight.clone(), bias.clone()
    with_copy = MklSkinnyLinear(PlainWeights((layers[0],)))
    without = MklPackedLinear(PlainWeights((layers[1],)))
    calls = []
    for rows in (1, 13, skinny_linear.MAX_ROWS, skinny_linear.MAX_ROWS + 1, 300):
        x = torch.randn(rows, 64)
        for packed in (with_copy, without):
            with op_calls() as counted:
                torch.testing.assert_close(packed(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
            calls += [rows] * counted["tgi_vlm::skinny_linear"]
    assert with_copy.skinny is not None
    assert calls == [1, 13, skinny_linear.MAX_ROWS]


def test_switched_off_or_another_dtype_makes_no_copy():
    assert skinny_weight(torch.randn(8, 8).to(torch.bfloat16)) is None
    assert skinny_weight(torch.randn(8, 8), KernelSettings(skinny_linear=False)) is None
    assert not skinny_available(KernelSettings(skinny_linear=False))  # the plan then gives float32 layers MKL alone
