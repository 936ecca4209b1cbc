"""layers/cpu.py: the CPU rewrites compute what transformers' modules compute."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tgi_vlm.layers import cpu


def test_row_bucket_is_exact_for_decode_sizes_and_bounded_above():
    assert [cpu.row_bucket(n) for n in (1, 7, 32)] == [1, 7, 32]
    assert [cpu.row_bucket(n) for n in (33, 64, 65, 256, 257, 600, 1025, 2048)] == [64, 64, 96, 256, 288, 640, 1152, 2048]
    for n in range(1, 5000):
        b = cpu.row_bucket(n)
        assert n <= b and (b - n < 32 or b <= n * 1.125), n
    assert len({cpu.row_bucket(n) for n in range(1, 2049)}) == 32 + 7 + 8 + 8 + 8


def test_bucketed_linear_equals_plain_linear_rows(monkeypatch):
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 40).to(torch.bfloat16)
    model = torch.nn.Sequential(layer)
    assert cpu.bucket_linear_rows(model) == 1
    for rows in (1, 5, 33, 100, 300):
        x = torch.randn(1, rows, 48, dtype=torch.bfloat16)
        got = layer(x)
        assert got.shape == (1, rows, 40)
        torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=0, atol=0)


def test_bucketing_leaves_float32_alone():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    assert cpu.bucket_linear_rows(model) == 0
    assert "forward" not in vars(model[0])


def test_patch_conv_as_matmul_matches_the_convolution():
    torch.manual_seed(0)
    conv = torch.nn.Conv3d(3, 16, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=False).to(torch.bfloat16)
    x = torch.randn(10, 3, 2, 14, 14, dtype=torch.bfloat16)
    expected = conv(x)
    assert cpu.convs_as_linear(torch.nn.Sequential(conv)) == 1
    got = conv(x)
    assert got.shape == expected.shape == (10, 16, 1, 1, 1)
    # same products, another summation order: bf16 rounding apart
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert not torch.equal(got, torch.zeros_like(got))
    # an input larger than one kernel still convolves (and exactly as before)
    big = torch.randn(1, 3, 2, 28, 28, dtype=torch.bfloat16)
    torch.testing.assert_close(conv(big), conv._conv_forward(big, conv.weight, conv.bias), rtol=0, atol=0)


def test_patch_conv_multiplies_with_a_packed_weight():
    """The patch count changes with every image: the product goes through `PackedWeight` (padded rows, one oneDNN
    kernel per row bucket rather than per count); bf16 sums may round apart from the unpadded product by an ulp."""
    torch.manual_seed(0)
    conv = torch.nn.Conv3d(3, 32, kernel_size=(2, 14, 14), stride=(2, 14, 14)).to(torch.bfloat16)
    weight, bias = conv.weight.detach().reshape(32, -1).clone(), conv.bias.detach().clone()
    direct = cpu.PackedWeight(weight, decode_copy=False)
    assert cpu.convs_as_linear(torch.nn.Sequential(conv)) == 1
    for patches in (1, 7, 33, 100, 257, 1030):
        x = torch.randn(patches, 3, 2, 14, 14, dtype=torch.bfloat16)
        got = conv(x)
        torch.testing.assert_close(got, direct(x.reshape(patches, -1), bias).view(patches, 32, 1, 1, 1), rtol=0, atol=0)
        torch.testing.assert_close(got.float(), F.linear(x.reshape(patches, -1), weight, bias).view(patches, 32, 1, 1, 1).float(),
                                   rtol=1.6e-2, atol=1e-2)
    assert isinstance(vars(conv)["_packed_weight"], cpu.PackedWeight)
    assert conv.weight.shape == (32, 3, 2, 14, 14)  # kept for inputs larger than one kernel


def test_patch_conv_of_a_sharded_model_keeps_the_plain_matmul():
    """`speed_up_for_cpu(sharded=True)` packs nothing (tensor-parallel plans hook the modules): the patch
    product stays F.linear on the plain weight, exactly."""
    torch.manual_seed(0)
    conv = torch.nn.Conv3d(3, 16, kernel_size=(2, 14, 14), stride=(2, 14, 14)).to(torch.bfloat16)
    assert cpu.convs_as_linear(torch.nn.Sequential(conv), pack=False) == 1
    x = torch.randn(37, 3, 2, 14, 14, dtype=torch.bfloat16)
    expected = F.linear(x.reshape(37, -1), conv.weight.reshape(16, -1), conv.bias).view(37, 16, 1, 1, 1)
    torch.testing.assert_close(conv(x), expected, rtol=0, atol=0)
    assert "_packed_weight" not in vars(conv)


def test_convs_with_padding_or_overlap_are_not_touched():
    overlapping = torch.nn.Conv2d(3, 4, kernel_size=3, stride=1).to(torch.bfloat16)
    padded = torch.nn.Conv2d(3, 4, kernel_size=2, stride=2, padding=1).to(torch.bfloat16)
    fp32 = torch.nn.Conv2d(3, 4, kernel_size=2, stride=2)
    assert cpu.convs_as_linear(torch.nn.Sequential(overlapping, padded, fp32)) == 0


def test_allocator_tuning_is_accepted_by_glibc():
    assert cpu.tune_allocator() is True


def test_switch_off(monkeypatch):
    monkeypatch.setenv("TGI_VLM_CPU_SPEEDUPS", "0")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8).to(torch.bfloat16))
    cpu.speed_up_for_cpu(model)
    assert "forward" not in vars(model[0])
    monkeypatch.setenv("TGI_VLM_CPU_SPEEDUPS", "1")
    cpu.speed_up_for_cpu(model)
    assert "forward" in vars(model[0])


def test_packed_bf16_linear_equals_plain_linear_and_releases_the_plain_weight():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48).to(torch.bfloat16)
    plain = (layer.weight.detach().clone(), layer.bias.detach().clone())
    inputs = [torch.randn(1, rows, 64, dtype=torch.bfloat16) for rows in (1, 13, 40, 300)]
    expected = [F.linear(x, *plain) for x in inputs]
    model = torch.nn.Sequential(layer)
    cpu.bucket_linear_rows(model)
    assert cpu.pack_linear_weights(model) == 1
    for x, want in zip(inputs, expected):
        torch.testing.assert_close(layer(x), want, rtol=0, atol=0)
    assert layer.weight.numel() == 0 and layer.weight.dtype == torch.bfloat16  # one copy of the weight, packed


def _without_mkl(monkeypatch) -> None:
    """Float32 through oneDNN, as on a torch build without MKL (e.g. aarch64)."""
    monkeypatch.setattr(cpu, "mkl_packs_float32", lambda: False)


@pytest.mark.parametrize("mkl", [True, False], ids=["mkl", "onednn"])
def test_packed_float32_linear_matches_plain_linear_to_float_rounding(monkeypatch, mkl):
    """Packed kernels may sum in another order than `F.linear` (oneDNN always, MKL's packed GEMM for one row):
    within float32 rounding (the float32 parity suites hold whole models to transformers' tokens and 1e-4 logits
    with it)."""
    if not mkl:
        _without_mkl(monkeypatch)
    elif not cpu.mkl_packs_float32():
        pytest.fail("this torch build has no MKL packed GEMM: run the suite with the torch the project pins")
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    plain = (layer.weight.detach().clone(), layer.bias.detach().clone())
    inputs = [torch.randn(rows, 64) for rows in (1, 13, 40, 300)]
    expected = [F.linear(x, *plain) for x in inputs]
    model = torch.nn.Sequential(layer)
    assert cpu.pack_linear_weights(model) == 1
    for x, want in zip(inputs, expected):
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    assert layer.weight.numel() == 0 and layer.weight.dtype == torch.float32
    assert vars(layer)["_packed_weight"].mkl is mkl


# shapes of the bench model's products: q/k/v fused, o, gate/up fused, down, the vision tower's, the patch embedding
SERVED_SHAPES = [(768, 1280), (768, 768), (768, 5120), (2560, 768), (256, 768), (1024, 256), (1176, 256)]


def test_mkl_packed_float32_layout_does_not_depend_on_the_row_count_it_was_packed_for():
    """One packed copy serves every row count: from 2 rows up the product is bit-equal to that of a weight packed
    for exactly that count (`MKL_PACK_ROWS`; `mkl::_mkl_linear` only runs the packed kernel when told the count),
    and every count, one row included, is float32-accurate against a float64 product."""
    torch.manual_seed(0)
    for in_features, out_features in SERVED_SHAPES:
        weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
        packed = cpu.PackedWeight(weight, decode_copy=False)
        assert packed.mkl and packed.one_row is None
        for rows in (1, 2, 3, 13, 17, 32, 33, 100, 301, 1030):
            x = torch.randn(rows, in_features)
            got = packed(x, bias)
            want = F.linear(x.double(), weight.double(), bias.double())
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-5 * in_features ** 0.5)
            if rows >= 2:
                exact = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
                torch.testing.assert_close(got, torch.ops.mkl._mkl_linear(x, exact, weight, bias, rows), rtol=0, atol=0)


def test_a_packed_layout_that_disagrees_at_other_row_counts_keeps_the_shape_on_onednn(monkeypatch):
    """The per-shape check at packing can fail (here: a matrix packed from another weight), and a shape that fails it
    is multiplied through oneDNN instead, correctly."""
    torch.manual_seed(0)
    weight, other = torch.randn(40, 72), torch.randn(40, 72)
    monkeypatch.setattr(cpu, "_mkl_layout_checked", {})
    assert cpu._mkl_layout_agrees(weight, torch.ops.mkl._mkl_reorder_linear_weight(weight, 64)) is True
    monkeypatch.setattr(cpu, "_mkl_layout_checked", {})
    assert cpu._mkl_layout_agrees(weight, torch.ops.mkl._mkl_reorder_linear_weight(other, 64)) is False
    packed = cpu.PackedWeight(weight, decode_copy=True)  # the cached verdict for 40 x 72: disagrees
    assert not packed.mkl and packed.pads_rows and packed.skinny is None
    x = torch.randn(5, 72)
    torch.testing.assert_close(packed(x, None), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_mkl_packed_float32_takes_any_row_count_and_primes_nothing():
    """No kernel per row count: priming builds nothing for MKL's products, and empty inputs give empty outputs."""
    torch.manual_seed(0)
    weight = torch.randn(48, 64)
    packed = cpu.PackedWeight(weight, decode_copy=False)
    assert packed.mkl
    x = torch.randn(1, 40, 64)
    torch.testing.assert_close(packed(x, None), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert packed(torch.randn(0, 64), None).shape == (0, 48)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48))
    cpu.pack_linear_weights(model)
    model(torch.randn(5, 64))  # packs
    assert cpu.prime_packed_kernels(model, 300) == (0, 0)


def test_float32_keeps_its_plain_weight_for_one_row_products_when_asked(monkeypatch):
    """Without MKL (oneDNN for float32): one row (batch-1 decode) goes to the GEMV on the kept plain weight:
    exactly F.linear; more rows use the packed copy."""
    _without_mkl(monkeypatch)
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    plain = (layer.weight.detach().clone(), layer.bias.detach().clone())
    assert cpu.pack_linear_weights(torch.nn.Sequential(layer), decode_copy=True) == 1
    one = torch.randn(1, 1, 64)
    torch.testing.assert_close(layer(one), F.linear(one, *plain), rtol=0, atol=0)
    many = torch.randn(1, 9, 64)
    torch.testing.assert_close(layer(many), F.linear(many, *plain), rtol=1e-5, atol=1e-5)
    assert layer.weight.numel() == 64 * 48  # kept (two copies: plain and packed)


def test_one_row_copies_are_kept_only_for_float32_weights_small_against_memory():
    assert cpu.decode_copies_fit(torch.nn.Linear(64, 48)) is True
    assert cpu.decode_copies_fit(torch.nn.Linear(64, 48).to(torch.bfloat16)) is False


def test_shared_and_float16_weights_are_not_packed():
    embed = torch.nn.Embedding(10, 8).to(torch.bfloat16)
    head = torch.nn.Linear(8, 10, bias=False).to(torch.bfloat16)
    head.weight = embed.weight  # tied, as many lm-heads are
    fp16 = torch.nn.Linear(8, 8).to(torch.float16)  # no fast oneDNN float16 path on most CPUs
    assert cpu.pack_linear_weights(torch.nn.ModuleDict({"embed": embed, "head": head, "fp16": fp16})) == 0


def test_row_buckets_lists_every_padded_row_count_once():
    assert cpu.row_buckets(40) == list(range(1, 33)) + [64]
    buckets = cpu.row_buckets(2048)
    assert buckets == sorted({cpu.row_bucket(n) for n in range(1, 2049)})
    assert buckets[-1] == 2048


def _two_layer_model() -> torch.nn.Module:
    from tgi_vlm.layers.cpu_fused import fuse_sibling_projections

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(32, 16).to(torch.bfloat16) for _ in range(3))
            self.o_proj = torch.nn.Linear(16, 32, bias=False).to(torch.bfloat16)

    model = torch.nn.Sequential(Attention(), Attention())
    cpu.pack_linear_weights(model)
    fuse_sibling_projections(model)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    for attention in model:  # packing is lazy: first use
        attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
        attention.o_proj(torch.randn(3, 16, dtype=torch.bfloat16))
    return model


def test_packed_products_lists_each_product_shape_once():
    """Two layers of the same shapes: one fused q/k/v product (with bias) and one o_proj product (without)."""
    products = cpu.packed_products(_two_layer_model())
    assert sorted((w.in_features, w.out_features, b is not None, cap) for w, b, cap in products) == [
        (16, 32, False, None), (32, 48, True, None)]


def test_priming_runs_every_shape_at_every_bucket_and_stops_at_its_budget(monkeypatch):
    model = _two_layer_model()
    seen = []
    original = cpu.PackedWeight.__call__
    monkeypatch.setattr(cpu.PackedWeight, "__call__", lambda self, x, bias: seen.append((self.out_features, x.shape[0])) or original(self, x, bias))
    assert cpu.prime_packed_kernels(model, 40) == (2 * 33, 64)
    assert sorted(seen) == sorted((out, rows) for out in (32, 48) for rows in cpu.row_buckets(40))
    seen.clear()
    clock = iter(range(100))  # one second per reading: the start, then one before each bucket
    assert cpu.prime_packed_kernels(model, 2048, budget_s=2.5, clock=lambda: next(clock)) == (4, 2)
    assert sorted(seen) == [(32, 1), (32, 2), (48, 1), (48, 2)]


def test_priming_stops_a_capped_module_at_its_rows(monkeypatch):
    """The lm-head meets at most a logprob chunk of rows: its product is not run at larger buckets."""
    model = _two_layer_model()
    seen = []
    original = cpu.PackedWeight.__call__
    monkeypatch.setattr(cpu.PackedWeight, "__call__", lambda self, x, bias: seen.append((self.out_features, x.shape[0])) or original(self, x, bias))
    count, largest = cpu.prime_packed_kernels(model, 100, row_caps={model[0].o_proj: 5, model[1].o_proj: 5})
    assert largest == 128 and count == len(cpu.row_buckets(100)) + 5
    assert sorted(rows for out, rows in seen if out == 32) == [1, 2, 3, 4, 5]


def test_priming_with_nothing_packed_runs_nothing():
    assert cpu.prime_packed_kernels(torch.nn.Sequential(torch.nn.Linear(4, 4)), 2048) == (0, 0)


def test_kernel_cache_size_is_raised_unless_the_user_set_it(monkeypatch):
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "0")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")  # restored to its state before the test afterwards
    cpu.size_kernel_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(cpu.KERNEL_CACHE_CAPACITY)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "77")
    cpu.size_kernel_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "77"
