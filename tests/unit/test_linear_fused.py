"""layers/linear/fused.py: q/k/v and gate/up projections of one input computed as one product give each member
what its own layer gives, whatever the call order or input, its extra term included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tgi_vlm.layers.linear import fused_group, plan
from tgi_vlm.layers.linear.kernels import BucketedLinear, MklPackedLinear, PlainWeights, TorchLinear
from tgi_vlm.layers.linear.modules import give_kernel

KIND = {torch.float32: MklPackedLinear, torch.bfloat16: BucketedLinear}


def fuse_sibling_projections(model: torch.nn.Module, kinds=None) -> int:
    """Each linear of `model` on its dtype's kernel (`KIND`), then the plan's fusion."""
    kinds = kinds or KIND
    for module in list(model.modules()):
        if type(module) is torch.nn.Linear:
            give_kernel(module, kinds[module.weight.dtype](PlainWeights((module,))))
    return plan.fuse_siblings(model)


class Attention(torch.nn.Module):
    def __init__(self, dtype, bias=True):
        super().__init__()
        self.q_proj = torch.nn.Linear(32, 48, bias=bias).to(dtype)
        self.k_proj = torch.nn.Linear(32, 16, bias=bias).to(dtype)
        self.v_proj = torch.nn.Linear(32, 16, bias=bias).to(dtype)


class MLP(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.gate_proj = torch.nn.Linear(32, 64, bias=False).to(dtype)
        self.up_proj = torch.nn.Linear(32, 64, bias=False).to(dtype)


def plain(module):
    return {name: (m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone())
            for name, m in module.named_children()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_member_gets_its_own_layer_s_output_in_any_call_order(dtype):
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"attn": Attention(dtype), "mlp": MLP(dtype)})
    weights = {k: plain(v) for k, v in model.items()}
    assert fuse_sibling_projections(model) == 2
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for rows in (1, 13, 40):
        x = torch.randn(1, rows, 32, dtype=dtype)
        for order in (("q_proj", "k_proj", "v_proj"), ("v_proj", "q_proj", "k_proj")):
            for name in order:
                torch.testing.assert_close(getattr(model["attn"], name)(x), F.linear(x, *weights["attn"][name]), **tol)
        h = torch.randn(rows, 32, dtype=dtype)
        gate, up = model["mlp"].gate_proj(h), model["mlp"].up_proj(h)
        torch.testing.assert_close(gate, F.linear(h, *weights["mlp"]["gate_proj"]), **tol)
        torch.testing.assert_close(up, F.linear(h, *weights["mlp"]["up_proj"]), **tol)
        assert gate.shape == (rows, 64)
    assert model["attn"].q_proj.weight.numel() == 0  # one copy of the weights: the fused, packed one


def test_a_member_called_with_another_input_gets_that_input_s_output():
    torch.manual_seed(0)
    attn = Attention(torch.float32)
    weights = plain(attn)
    fuse_sibling_projections(attn)
    latents, context = torch.randn(3, 32), torch.randn(5, 32)
    q = attn.q_proj(latents)
    k = attn.k_proj(context)  # e.g. a perceiver: keys from another tensor
    v = attn.v_proj(context)
    torch.testing.assert_close(q, F.linear(latents, *weights["q_proj"]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, F.linear(context, *weights["k_proj"]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v, F.linear(context, *weights["v_proj"]), rtol=1e-5, atol=1e-5)


def test_groups_with_shared_weights_mixed_dtypes_or_missing_members_are_left_alone():
    shared = Attention(torch.float32)
    other = torch.nn.Linear(32, 16)
    other.weight = shared.k_proj.weight
    mixed = Attention(torch.float32)
    mixed.v_proj = mixed.v_proj.to(torch.bfloat16)
    half = MLP(torch.float32)
    del half.up_proj
    model = torch.nn.ModuleDict({"shared": shared, "other": other, "mixed": mixed, "partial": half})
    assert fuse_sibling_projections(model) == 0
    assert fused_group(shared, ("q_proj", "k_proj", "v_proj")) is None
    assert shared.q_proj.linear_kernel.name == "mkl-packed"


def test_a_projection_layer_shared_by_two_attention_modules_is_fused_once():
    first = Attention(torch.float32)
    second = Attention(torch.float32)
    second.q_proj = first.q_proj  # the same layer object in two groups
    assert fuse_sibling_projections(torch.nn.ModuleDict({"a": first, "b": second})) == 1
    x = torch.randn(2, 32)
    assert second.q_proj(x).shape == (2, 48)


def test_kernels_that_do_not_fuse_stay_apart():
    attn = Attention(torch.float32)
    assert fuse_sibling_projections(attn, {torch.float32: TorchLinear}) == 0
    assert fused_group(attn, ("q_proj", "k_proj", "v_proj")) is None


class Delta:
    """An extra term: x @ delta.T, as a LoRA delta would add."""

    def __init__(self, delta: torch.Tensor):
        self.delta = delta

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> None:
        out += x @ self.delta.T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_member_s_extra_term_lands_in_its_own_columns_of_the_fused_product(dtype):
    """With an extra term on k_proj only: k gets W x + D x, q and v their plain products, both through the members'
    own calls and through the group's product that the lean layer slices."""
    torch.manual_seed(0)
    attn = Attention(dtype)
    weights = plain(attn)
    assert fuse_sibling_projections(attn) == 1
    delta = torch.randn(16, 32, dtype=dtype) * 0.1
    attn.k_proj.extra = Delta(delta)
    x = torch.randn(7, 32, dtype=dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    want_k = F.linear(x, weights["k_proj"][0] + delta, weights["k_proj"][1])
    torch.testing.assert_close(attn.k_proj(x), want_k, **tol)
    torch.testing.assert_close(attn.q_proj(x), F.linear(x, *weights["q_proj"]), **tol)
    group = fused_group(attn, ("q_proj", "k_proj", "v_proj"))
    q, k, v = group.product(x).split(group.widths, dim=-1)
    torch.testing.assert_close(k, want_k, **tol)
    torch.testing.assert_close(v, F.linear(x, *weights["v_proj"]), **tol)
