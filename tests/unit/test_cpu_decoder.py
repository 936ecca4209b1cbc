"""layers/cpu_decoder.py's pieces equal transformers' own: bit for bit, the native RMSNorm to the last place."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRMSNorm

from tests.unit.kernels_here import needs, op_calls, require
from tgi_vlm.kernels.cpu import ops
from tgi_vlm.layers.cpu_decoder import _rotate, rms_norm


@pytest.mark.parametrize("norm_type", [LlamaRMSNorm, Qwen2VLRMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_transformers_rms_norm(norm_type, dtype):
    g = torch.Generator().manual_seed(0)
    for hidden, rows, scale in ((64, 1, 1.0), (768, 13, 30.0), (1000, 7, 0.01), (3584, 301, 3.0)):
        norm = norm_type(hidden, eps=1e-5).to(dtype)
        norm.weight.data = torch.randn(hidden, generator=g).to(dtype)
        x = (torch.randn(1, rows, hidden, generator=g) * scale).to(dtype)
        assert torch.equal(rms_norm(norm, x), norm(x))


@needs("rms_norm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_rms_norm_is_transformers_rms_norm_to_the_last_place(dtype):
    """kernels/cpu/csrc/rms_norm.c: the same steps as transformers' RMSNorm except the sum of squares (double there): float32
    outputs within 4 float32 ulps of torch's (an ulp in the variance, then the rounded steps after it) and, as
    torch's, within 4 ulps of a float64 norm; bfloat16 within 4 bf16 ulps (equal in practice); rows with a stride (a slice) are taken as they are, a transposed input is left to torch."""
    require("rms_norm")
    g = torch.Generator().manual_seed(0)
    ulp = 2.0 ** -23 if dtype == torch.float32 else 2.0 ** -7
    for hidden, rows, scale in ((64, 1, 1.0), (768, 13, 30.0), (1000, 7, 0.01), (3584, 301, 3.0), (13, 2, 1.0)):
        norm = Qwen2VLRMSNorm(hidden, eps=1e-5).to(dtype)
        norm.weight.data = torch.randn(hidden, generator=g).to(dtype)
        x = (torch.randn(1, rows, hidden, generator=g) * scale).to(dtype)
        with op_calls() as calls:
            got = rms_norm(norm, x, native=True)
        want = norm(x)
        assert calls == {"tgi_vlm::rms_norm": 1}
        assert got.shape == want.shape and got.dtype == dtype
        assert ((got.double() - want.double()).abs() <= 4 * ulp * want.double().abs() + 1e-30).all(), hidden
        x64 = x.double()
        exact = norm.weight.double() * x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
        if dtype == torch.float32:  # as accurate as torch's: each output within 4 ulps of the float64 norm
            assert ((got.double() - exact).abs() <= 4 * ulp * exact.abs() + 1e-30).all()
            assert ((want.double() - exact).abs() <= 4 * ulp * exact.abs() + 1e-30).all()
    norm = Qwen2VLRMSNorm(64, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(64, generator=g).to(dtype)
    sliced = torch.randn(1, 4, 128, generator=g).to(dtype)[..., :64]  # rows 128 apart
    assert ops.can_norm(sliced, norm.weight)
    want, got = norm(sliced), rms_norm(norm, sliced, native=True)
    assert ((got.double() - want.double()).abs() <= 4 * ulp * want.double().abs() + 1e-30).all()
    transposed = torch.randn(1, 64, 4, generator=g).to(dtype).transpose(1, 2)  # elements of a row 4 apart
    assert not ops.can_norm(transposed, norm.weight)
    assert torch.equal(rms_norm(norm, transposed, native=True), norm(transposed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joint_rotary_is_transformers_rotary_per_head(dtype):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 9, 6, 32, generator=g).to(dtype)  # [bsz, T, heads, D]
    k = torch.randn(1, 9, 2, 32, generator=g).to(dtype)
    cos, sin = torch.randn(1, 9, 32, generator=g).to(dtype), torch.randn(1, 9, 32, generator=g).to(dtype)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    joint = _rotate(torch.cat([q, k], dim=2), cos.unsqueeze(2), sin.unsqueeze(2))
    assert torch.equal(joint[:, :, :6].transpose(1, 2), want_q)
    assert torch.equal(joint[:, :, 6:].transpose(1, 2), want_k)
