"""torch_backend.causal_attention: reduced-precision spans padded to the kernel's 32-row blocks give the
real rows what unpadded causal attention gives them; float32 is the unpadded call itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tgi_vlm.layers.attention.torch_backend import causal_attention


def _reference(q, k, v, scale):
    """Causal grouped-query attention in float64, written out."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    length = q.shape[2]
    scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _span(length: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # q as the backend passes it: a strided view of the step's [T, Hq, D] rows
    q = torch.randn(length, 12, 64, generator=g).to(dtype).transpose(0, 1)[None]
    k = torch.randn(1, 4, length, 64, generator=g).to(dtype)
    v = torch.randn(1, 4, length, 64, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("length", [1, 5, 31, 32, 33, 183, 250])
def test_padded_reduced_precision_span_matches_causal_attention(dtype, length):
    q, k, v = _span(length, dtype, seed=length)
    got = causal_attention(q, k, v, 0.125)
    assert got.shape == (1, 12, length, 64) and got.dtype == dtype
    unpadded = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
    reference = _reference(q, k, v, 0.125)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(got.double(), reference, rtol=0, atol=tolerance)
    # no worse than the unpadded kernel's own rounding
    assert (got.double() - reference).abs().max() <= (unpadded.double() - reference).abs().max() + tolerance / 2


@pytest.mark.parametrize("length", [5, 183])
def test_float32_span_is_the_unpadded_call(length):
    q, k, v = _span(length, torch.float32)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=None, enable_gqa=True)
    assert torch.equal(causal_attention(q, k, v, None), expected)


def test_long_reduced_precision_spans_are_the_unpadded_call():
    q, k, v = _span(1030, torch.bfloat16)  # padded would be 1056 rows, past the measured range
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
    assert torch.equal(causal_attention(q, k, v, 0.125), expected)
