"""`tgi_vlm::gemma_rms_norm` (kernels/cpu/csrc/rms_norm.c): transformers' Gemma RMSNorm per head, in place on a fused
q/k/v product or into a new tensor, against the module it replaces; and what it refuses at its own entry."""

from __future__ import annotations

import re

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

from tests.unit.kernels_here import needs, require
from tgi_vlm.kernels.cpu import ops
from tgi_vlm.layers.cpu_decoder import gemma_norm

HQ, HKV, D = 4, 1, 64


def module(width: int, dtype: torch.dtype, seed: int = 0) -> Gemma3RMSNorm:
    norm = Gemma3RMSNorm(width, eps=1e-6)
    norm.weight.data = torch.randn(width, generator=torch.Generator().manual_seed(seed)) * 0.5
    return norm.to(dtype)


def ulps_apart(got: torch.Tensor, want: torch.Tensor) -> int:
    """The largest distance in units in the last place of `want`'s dtype."""
    spacing = torch.finfo(want.dtype).eps * want.float().abs().clamp_min(torch.finfo(want.dtype).tiny)
    return int(((got.float() - want.float()).abs() / spacing).ceil().max())


@needs("gemma_rms_norm")
@pytest.mark.parametrize("dtype,most_ulps", [(torch.float32, 4), (torch.bfloat16, 1)])
def test_query_heads_normalized_in_place_equal_the_module_within_its_roundings_and_leave_the_rest(dtype, most_ulps):
    """The query heads of a fused [1, T, (Hq + 2 Hkv) D] product are normalized in place; the key and value columns
    are not touched. float32 within 4 ulps of the module (the sum of squares in double), bf16 within one."""
    require("gemma_rms_norm")
    norm = module(D, dtype)
    qkv = (torch.randn(1, 7, (HQ + 2 * HKV) * D, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    before = qkv.clone()
    query = qkv[0, :, : HQ * D].view(7, HQ, D)
    want = norm(query.clone())
    ops.gemma_rms_norm(query, norm.weight, norm.eps, query)
    assert ulps_apart(query, want) <= most_ulps
    assert torch.equal(qkv[..., HQ * D :], before[..., HQ * D :])
    assert not torch.equal(qkv[..., : HQ * D], before[..., : HQ * D])


@needs("gemma_rms_norm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_norm_of_hidden_rows_runs_the_op_and_agrees_with_the_module_and_without_it_is_the_module(dtype):
    require("gemma_rms_norm")
    norm = module(640, dtype, seed=2)
    x = (torch.randn(1, 5, 640, generator=torch.Generator().manual_seed(3)) * 10).to(dtype)
    want = norm(x)
    assert torch.equal(gemma_norm(norm, x, native=False), want)  # the module's own forward, bit for bit
    got = gemma_norm(norm, x, native=True)
    assert got.shape == x.shape and got.data_ptr() != x.data_ptr()
    assert ulps_apart(got, want) <= (4 if dtype == torch.float32 else 1)
    assert ulps_apart(got, want) < 64  # and not equal by accident of a do-nothing op: x itself is far from it
    assert ulps_apart(x, want) > 64


@pytest.mark.parametrize("make,problem", [
    (lambda: (torch.randn(3, 4, 16).transpose(0, 1), torch.ones(16)), "heads of H contiguous and adjacent"),
    (lambda: (torch.randn(3, 4, 16)[:, :, :8], torch.ones(8)), "heads of H contiguous and adjacent"),
    (lambda: (torch.randn(3, 64), torch.ones(64)), "must be CPU float32 or bfloat16 [T, G, H]"),
    (lambda: (torch.randn(3, 4, 16).half(), torch.ones(16).half()), "must be CPU float32 or bfloat16"),
    (lambda: (torch.randn(3, 4, 16), torch.ones(15)), "must match x"),
    (lambda: (torch.randn(3, 4, 16), torch.ones(16, dtype=torch.bfloat16)), "must match x"),
])
def test_the_op_refuses_what_its_c_loop_cannot_address(make, problem):
    x, weight = make()
    with pytest.raises(ValueError, match=re.escape(problem)):
        ops.gemma_rms_norm(x, weight, 1e-6, x)
    assert not ops.can_gemma_norm(x, weight)


def test_an_output_overlapping_the_input_other_than_exactly_is_refused():
    buffer = torch.randn(4 * 2 * 16 + 16)
    x = buffer[:128].view(4, 2, 16)
    shifted = buffer[16:].view(4, 2, 16)
    with pytest.raises(ValueError, match="out overlaps x without being x"):
        ops.gemma_rms_norm(x, torch.ones(16), 1e-6, shifted)
    with pytest.raises(ValueError, match=re.escape("out (4, 2, 8)")):
        ops.gemma_rms_norm(x, torch.ones(16), 1e-6, torch.empty(4, 2, 8))


@needs("gemma_rms_norm_add")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_place", [False, True])
def test_norm_add_is_the_residual_plus_the_modules_norm_rounded_as_transformers_rounds_it(dtype, in_place):
    """`residual + norm(x)` as the layer computes it (the norm rounded to the dtype, then the sum): equal to torch's
    add of the native norm (the same roundings), and within one ulp of the module's own norm plus the residual."""
    require("gemma_rms_norm_add")
    norm = module(640, dtype, seed=4)
    x = (torch.randn(3, 640, generator=torch.Generator().manual_seed(5)) * 7).to(dtype)
    residual = (torch.randn(3, 640, generator=torch.Generator().manual_seed(6)) * 2).to(dtype)
    normed = torch.empty_like(x)
    ops.gemma_rms_norm(x.view(3, 1, 640), norm.weight, norm.eps, normed.view(3, 1, 640))
    same_roundings = residual + normed
    transformers_sum = residual + norm(x)
    out = residual.clone() if in_place else torch.empty_like(x)
    ops.gemma_rms_norm_add(x, norm.weight, norm.eps, out if in_place else residual, out)
    assert torch.equal(out, same_roundings)
    assert ulps_apart(out, transformers_sum) <= (4 if dtype == torch.float32 else 1)
    assert not torch.equal(out, residual)


@pytest.mark.parametrize("make,problem", [
    (lambda: (torch.randn(3, 16).t(), torch.ones(3), torch.randn(16, 3), torch.empty(16, 3)), "must be contiguous"),
    (lambda: (torch.randn(3, 16), torch.ones(16), torch.randn(3, 8), torch.empty(3, 16)), "residual (3, 8)"),
    (lambda: (torch.randn(3, 16), torch.ones(16), torch.randn(3, 16), torch.empty(3, 16).bfloat16()), "out (3, 16)"),
    (lambda: (torch.randn(3, 16), torch.ones(8), torch.randn(3, 16), torch.empty(3, 16)), "weight (8,)"),
])
def test_norm_add_refuses_what_its_c_loop_cannot_address(make, problem):
    x, weight, residual, out = make()
    with pytest.raises(ValueError, match=re.escape(problem)):
        ops.gemma_rms_norm_add(x, weight, 1e-6, residual, out)


def test_norm_add_refuses_an_output_over_its_input():
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="out overlaps x"):
        ops.gemma_rms_norm_add(x, torch.ones(16), 1e-6, torch.randn(3, 16), x)
