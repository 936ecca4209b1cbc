"""layers/cpu_decoder.py's pieces equal transformers' own, bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRMSNorm

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
