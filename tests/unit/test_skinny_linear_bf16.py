"""`tgi_vlm::skinny_linear_bf16` and the `onednn-packed+native-skinny` kernel: the bf16 loop (AVX512-BF16 pair
products) computes a bf16 linear as oneDNN does, to its one rounding, refuses inputs that do not fit its layout before
any C runs, and the kernel sends it exactly the row counts it is for (1..BF16_MAX_ROWS), oneDNN the rest."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from tests.unit.kernels_here import needs, op_calls, require
from tgi_vlm.kernels.cpu import ops
from tgi_vlm.layers import skinny_linear
from tgi_vlm.layers.linear import plan
from tgi_vlm.layers.linear.kernels import OneDnnPackedSkinnyLinear, PlainWeights, can_pack_weights
from tgi_vlm.layers.linear.modules import give_kernel

needs_the_loop = needs("skinny_linear_bf16")


@pytest.fixture(scope="module")
def native():
    loaded = require("skinny_linear_bf16")
    if ops.skinny_bf16_max_rows() < 1:
        pytest.skip("this CPU has AVX-512 without its BF16 extension: the bf16 loop is not built")
    return loaded


# (in, out): Gemma 3 270M's products (q/k/v fused, o, gate/up fused, down), odd sizes (an odd K, columns past a block)
SHAPES = [(640, 1536), (1024, 640), (640, 4096), (2048, 640), (33, 17), (7, 100), (64, 1)]


def bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Half a bf16 ulp of the exact result (its one rounding) plus float32 sums' worst case over K terms."""
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    magnitude = x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs())
    spacing = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    return exact, spacing / 2 + (x.shape[1] + 4) * 2.0 ** -24 * magnitude


@needs_the_loop
@pytest.mark.parametrize("amx", [True, False], ids=["amx-where-it-takes", "vdpbf16ps-loop"])
@pytest.mark.parametrize("in_features,out_features", SHAPES)
def test_products_round_once_to_bf16_within_float32_sums_for_every_row_count_it_takes(native, in_features,
                                                                                       out_features, amx):
    """Against float64: every output within half a bf16 ulp plus the float32 sums' bound, with and without bias, at
    every row count up to the C loop's limit (row tiles of 14), on AMX tiles (where the CPU has them: tiles of 16
    rows, two at a time, a partial last one; the width a multiple of 32) and on the VDPBF16PS loop; oneDNN's bf16
    product is within the same bound, and at least 9 in 10 outputs are its very value (the rest differ where the
    sums' order moves a rounding)."""
    torch.manual_seed(in_features * 7 + out_features)
    weight = torch.randn(out_features, in_features).bfloat16()
    bias = torch.randn(out_features).bfloat16()
    blocked = ops.blocked_weight_bf16(weight)
    limit = max(ops.skinny_bf16_max_rows(), ops.amx_max_rows() if amx and in_features % 32 == 0 else 0)
    for rows in (1, 2, 4, 5, 14, 15, 16, 17, 32, 33, 48, 100, 300):
        if rows > limit:
            continue
        x = torch.randn(rows, in_features).bfloat16()
        for b in (bias, None):
            got = ops.skinny_linear_bf16(x, blocked, out_features, b, amx)
            assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
            exact, most = bound(x, weight, b)
            assert ((got.double() - exact).abs() <= most).all(), (rows, b is None)
            onednn = F.linear(x, weight, b)  # within the same bound of the exact sum, and mostly the same bf16 value
            assert ((got.double() - onednn.double()).abs() <= 2 * most).all(), (rows, b is None)
            assert (got == onednn).double().mean() >= 0.9, (rows, b is None)


@needs_the_loop
def test_the_blocked_layout_zeroes_the_padding_and_keeps_every_weight(native):
    weight = torch.arange(1, 17 * 7 + 1, dtype=torch.float32).view(17, 7).bfloat16()
    blocked = ops.blocked_weight_bf16(weight)
    assert blocked.shape == (2, 4, 32) and blocked.data_ptr() % 64 == 0
    # column c of block 0, input pair p: [p, 2c] = w[c, 2p], [p, 2c + 1] = w[c, 2p + 1] (0 past the 7th input)
    assert blocked[0, 1, 2 * 3] == weight[3, 2] and blocked[0, 1, 2 * 3 + 1] == weight[3, 3]
    assert blocked[1, 0, 0] == weight[16, 0] and (blocked[1, :, 2:] == 0).all()  # columns 17..31 are zero
    assert (blocked[0, 3, 1::2] == 0).all()  # the odd input past 7
    assert blocked.float().sum() == weight.float().sum()


@pytest.mark.parametrize("make,problem", [
    (lambda: (torch.randn(2, 64).bfloat16(), ops.blocked_weight_bf16(torch.randn(20, 64).bfloat16()), 33, None),
     "inconsistent inputs"),
    (lambda: (torch.randn(2, 64), ops.blocked_weight_bf16(torch.randn(20, 64).bfloat16()), 20, None),
     "inconsistent inputs (x (2, 64) torch.float32"),
    (lambda: (torch.randn(2, 62).bfloat16(), ops.blocked_weight_bf16(torch.randn(20, 64).bfloat16()), 20, None),
     "inconsistent inputs"),
    (lambda: (torch.randn(64, 2).bfloat16().T, ops.blocked_weight_bf16(torch.randn(20, 64).bfloat16()), 20, None),
     "inconsistent inputs"),
    (lambda: (torch.randn(2, 64).bfloat16(), ops.blocked_weight_bf16(torch.randn(20, 64).bfloat16()), 20,
              torch.randn(20)), "inconsistent inputs"),
    (lambda: (torch.randn(0, 64).bfloat16(), ops.blocked_weight_bf16(torch.randn(20, 64).bfloat16()), 20, None),
     "inconsistent inputs"),
])
def test_the_op_refuses_inputs_that_do_not_fit_its_layout_before_any_c_runs(make, problem):
    x, blocked, out_features, bias = make()
    with pytest.raises(ValueError, match=re.escape(problem)):
        ops.skinny_linear_bf16(x, blocked, out_features, bias)


@needs_the_loop
def test_more_rows_than_the_c_code_takes_are_refused(native):
    """Past the loop's rows without AMX (or a width AMX does not take), past AMX's with it."""
    blocked = ops.blocked_weight_bf16(torch.randn(20, 64).bfloat16())
    rows = ops.skinny_bf16_max_rows() + 1
    with pytest.raises(ValueError, match=re.escape(f"({rows} rows, at most {rows - 1})")):
        ops.skinny_linear_bf16(torch.randn(rows, 64).bfloat16(), blocked, 20, None, False)
    rows = max(ops.skinny_bf16_max_rows(), ops.amx_max_rows()) + 1
    with pytest.raises(ValueError, match=re.escape(f"({rows} rows, at most {rows - 1})")):
        ops.skinny_linear_bf16(torch.randn(rows, 64).bfloat16(), blocked, 20, None)


@needs_the_loop
@pytest.mark.parametrize("in_features", [96, 90])
def test_the_kernel_sends_the_native_product_up_to_its_row_limit_and_onednn_past_it(native, in_features):
    """1..max_rows rows go to the native product, one more to oneDNN's packed product (counted); max_rows is AMX's
    256 where the CPU has tiles and the width is a multiple of 32 (96), else the loop's 4 (90 wide); every result
    within one rounding of the exact product (float32 sums apart)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(in_features, 80).bfloat16()
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    give_kernel(layer, OneDnnPackedSkinnyLinear(PlainWeights((layer,))))
    layer(torch.zeros(1, in_features).bfloat16())  # packs
    limit = layer.linear_kernel.skinny.max_rows
    amx = ops.amx_max_rows() >= skinny_linear.AMX_MAX_ROWS and in_features % 32 == 0
    assert limit == (skinny_linear.AMX_MAX_ROWS if amx else skinny_linear.BF16_MAX_ROWS)
    for rows, native_calls in ((1, 1), (min(5, limit), 1), (limit, 1), (limit + 1, 0), (limit + 40, 0)):
        x = torch.randn(1, rows, in_features).bfloat16()
        with op_calls() as calls:
            got = layer(x)
        assert calls["tgi_vlm::skinny_linear_bf16"] == native_calls, rows
        exact, most = bound(x[0], weight, bias)
        assert got.shape == (1, rows, 80) and ((got[0].double() - exact).abs() <= most).all(), rows


@needs_the_loop
def test_the_plan_gives_bf16_layers_and_a_tied_head_the_loop_only_with_room_for_the_copy(native):
    if not can_pack_weights(torch.bfloat16):
        pytest.skip("oneDNN cannot prepack bf16 here")
    embed = torch.nn.Embedding(40, 16).bfloat16()
    head = torch.nn.Linear(16, 40, bias=False).bfloat16()
    head.weight = embed.weight
    model = torch.nn.ModuleDict({"embed": embed, "head": head, "mlp": torch.nn.Linear(16, 16).bfloat16()})
    got = plan.plan_linears(model, plan.PlanOptions(cpu=True, decode_copy=True, skinny_bf16=True)).kernels
    assert got == {"head": "onednn-packed+native-skinny+plain-kept", "mlp": "onednn-packed+native-skinny"}
    for options in (plan.PlanOptions(cpu=True, decode_copy=False, skinny_bf16=True),
                    plan.PlanOptions(cpu=True, decode_copy=True, skinny_bf16=False)):
        layer = torch.nn.Linear(16, 16).bfloat16()
        assert plan.choose_kernel(layer, options).name == "onednn-packed"
