"""layers/linear/kernels.py: every way of computing a linear layer gives what `F.linear` gives (bit for bit, or
within float32 rounding where a packed kernel sums in another order), and owns its storage."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tgi_vlm.layers import cpu
from tgi_vlm.layers.linear import kernels, plan
from tgi_vlm.layers.linear.kernels import (
    BucketedLinear,
    MklPackedLinear,
    OneDnnPackedGemvLinear,
    OneDnnPackedLinear,
    PlainWeights,
    TorchLinear,
)
from tgi_vlm.layers.linear.modules import KernelLinear, give_kernel, give_patch_kernel

needs_bf16_packing = pytest.mark.skipif(not kernels.can_pack_weights(torch.bfloat16),
                                        reason="oneDNN cannot prepack bf16 weights on this CPU (needs AVX512-BW/VL/DQ "
                                               "or AVX-NE-CONVERT)")
needs_mkl = pytest.mark.skipif(not kernels.mkl_packs_float32(), reason="this torch build has no MKL packed GEMM")


def planned(layer: torch.nn.Linear, kind) -> KernelLinear:
    return give_kernel(layer, kind(PlainWeights((layer,))))


def test_row_bucket_is_exact_for_decode_sizes_and_bounded_above():
    assert [kernels.row_bucket(n) for n in (1, 7, 32)] == [1, 7, 32]
    assert [kernels.row_bucket(n) for n in (33, 64, 65, 256, 257, 600, 1025, 2048)] == [
        64, 64, 96, 256, 288, 640, 1152, 2048]
    for n in range(1, 5000):
        b = kernels.row_bucket(n)
        assert n <= b and (b - n < 32 or b <= n * 1.125), n
    assert len({kernels.row_bucket(n) for n in range(1, 2049)}) == 32 + 7 + 8 + 8 + 8


def test_row_buckets_lists_every_padded_row_count_once():
    assert kernels.row_buckets(40) == list(range(1, 33)) + [64]
    buckets = kernels.row_buckets(2048)
    assert buckets == sorted({kernels.row_bucket(n) for n in range(1, 2049)})
    assert buckets[-1] == 2048


@pytest.mark.parametrize("kind", [TorchLinear, BucketedLinear])
def test_torch_kernels_equal_plain_linear_rows_bit_for_bit(kind):
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 40).to(torch.bfloat16)
    plain = (layer.weight.detach().clone(), layer.bias.detach().clone())
    planned(layer, kind)
    for rows in (1, 5, 33, 100, 300):
        x = torch.randn(1, rows, 48, dtype=torch.bfloat16)
        got = layer(x)
        assert got.shape == (1, rows, 40)
        torch.testing.assert_close(got, F.linear(x, *plain), rtol=0, atol=0)
    assert layer.weight.numel() == 48 * 40  # they read the parameters: nothing released


@needs_bf16_packing
def test_packed_bf16_linear_equals_plain_linear_and_releases_the_plain_weight():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48).to(torch.bfloat16)
    plain = (layer.weight.detach().clone(), layer.bias.detach().clone())
    inputs = [torch.randn(1, rows, 64, dtype=torch.bfloat16) for rows in (1, 13, 40, 300)]
    expected = [F.linear(x, *plain) for x in inputs]
    planned(layer, OneDnnPackedLinear)
    assert not layer.linear_kernel.ready  # packs on first use, on the thread that runs the model
    for x, want in zip(inputs, expected):
        torch.testing.assert_close(layer(x), want, rtol=0, atol=0)
    assert layer.linear_kernel.ready
    assert layer.weight.numel() == 0 and layer.weight.dtype == torch.bfloat16  # one copy of the weight, packed


@pytest.mark.parametrize("kind", [MklPackedLinear, OneDnnPackedLinear], ids=["mkl", "onednn"])
def test_packed_float32_linear_matches_plain_linear_to_float_rounding(kind):
    """Packed kernels may sum in another order than `F.linear` (oneDNN always, MKL's packed GEMM for one row):
    within float32 rounding (the float32 parity suites hold whole models to transformers' tokens and 1e-4 logits
    with it)."""
    if kind is MklPackedLinear and not kernels.mkl_packs_float32():
        pytest.fail("this torch build has no MKL packed GEMM: run the suite with the torch the project pins")
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    plain = (layer.weight.detach().clone(), layer.bias.detach().clone())
    planned(layer, kind)
    for rows in (1, 13, 40, 300):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), F.linear(x, *plain), rtol=1e-5, atol=1e-5)
    assert layer.weight.numel() == 0 and layer.weight.dtype == torch.float32


# shapes of the bench model's products: q/k/v fused, o, gate/up fused, down, the vision tower's, the patch embedding
SERVED_SHAPES = [(768, 1280), (768, 768), (768, 5120), (2560, 768), (256, 768), (1024, 256), (1176, 256)]


@needs_mkl
def test_mkl_packed_float32_layout_does_not_depend_on_the_row_count_it_was_packed_for():
    """One packed copy serves every row count: from 2 rows up the product is bit-equal to that of a weight packed
    for exactly that count (`MKL_PACK_ROWS`; `mkl::_mkl_linear` only runs the packed kernel when told the count),
    and every count, one row included, is float32-accurate against a float64 product."""
    torch.manual_seed(0)
    for in_features, out_features in SERVED_SHAPES:
        layer = torch.nn.Linear(in_features, out_features)
        weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
        assert kernels.mkl_layout_agrees(out_features, in_features)
        planned(layer, MklPackedLinear)
        for rows in (1, 2, 3, 13, 17, 32, 33, 100, 301, 1030):
            x = torch.randn(rows, in_features)
            got = layer(x)
            want = F.linear(x.double(), weight.double(), bias.double())
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-5 * in_features ** 0.5)
            if rows >= 2:
                exact = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
                torch.testing.assert_close(got, torch.ops.mkl._mkl_linear(x, exact, weight, bias, rows), rtol=0, atol=0)


@needs_mkl
def test_a_shape_whose_packed_layout_disagrees_is_planned_on_onednn(monkeypatch):
    """The per-shape check can fail (here: a matrix packed from another weight); the plan then gives that shape
    oneDNN's kernel, which multiplies correctly (on an Intel CPU, the only vendor MKL serves)."""
    monkeypatch.setattr(kernels, "cpu_vendor", lambda: "GenuineIntel")
    monkeypatch.setattr(plan, "cpu_vendor", lambda: "GenuineIntel")
    torch.manual_seed(0)
    weight, other = torch.randn(40, 72), torch.randn(40, 72)
    generator = torch.Generator().manual_seed(0)
    assert kernels._packed_multiplies_like(torch.ops.mkl._mkl_reorder_linear_weight(weight, 64), weight, generator)
    assert not kernels._packed_multiplies_like(torch.ops.mkl._mkl_reorder_linear_weight(other, 64), weight, generator)
    monkeypatch.setattr(kernels, "_mkl_layout_checked", {(40, 72): False})
    layer = torch.nn.Linear(72, 40, bias=False)
    plain = layer.weight.detach().clone()
    kernel = plan.choose_kernel(layer, plan.PlanOptions(cpu=True, decode_copy=True, skinny=True))
    assert type(kernel) is OneDnnPackedGemvLinear
    x = torch.randn(5, 72)
    torch.testing.assert_close(give_kernel(layer, kernel)(x), F.linear(x, plain), rtol=1e-5, atol=1e-5)


@needs_mkl
def test_mkl_packed_float32_takes_any_row_count_and_primes_nothing():
    """No kernel per row count: priming builds nothing for MKL's products, and empty inputs give empty outputs."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48, bias=False)
    weight = layer.weight.detach().clone()
    planned(layer, MklPackedLinear)
    x = torch.randn(1, 40, 64)
    torch.testing.assert_close(layer(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert layer(torch.randn(0, 64)).shape == (0, 48)
    assert plan.prime_packed_kernels(torch.nn.Sequential(layer), 300) == (0, 0)


def test_onednn_float32_keeps_its_plain_weight_for_one_row_products():
    """Without MKL (oneDNN for float32): one row (batch-1 decode) goes to the GEMV on the kept plain weight:
    exactly F.linear; more rows use the packed copy."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    plain = (layer.weight.detach().clone(), layer.bias.detach().clone())
    planned(layer, OneDnnPackedGemvLinear)
    one = torch.randn(1, 1, 64)
    torch.testing.assert_close(layer(one), F.linear(one, *plain), rtol=0, atol=0)
    many = torch.randn(1, 9, 64)
    torch.testing.assert_close(layer(many), F.linear(many, *plain), rtol=1e-5, atol=1e-5)
    assert layer.linear_kernel.one_row.numel() == 64 * 48  # kept by the kernel (two copies: plain and packed)


def test_decode_copies_are_allowed_for_float32_and_bfloat16_weights_small_against_memory(monkeypatch):
    assert cpu.decode_copies_fit(torch.nn.Linear(64, 48)) is True
    assert cpu.decode_copies_fit(torch.nn.Linear(64, 48).to(torch.bfloat16)) is True  # a tied bf16 head's copy
    assert cpu.decode_copies_fit(torch.nn.Linear(64, 48).to(torch.float16)) is False  # float16 is never packed
    # the limit is 1/16 of memory, counted in each dtype's bytes: 64 x 48 float32 = 12,288 B, bf16 = 6,144 B
    monkeypatch.setattr(cpu, "_usable_memory", lambda: 16 * 6144)
    assert cpu.decode_copies_fit(torch.nn.Linear(64, 48).to(torch.bfloat16)) is True
    assert cpu.decode_copies_fit(torch.nn.Linear(64, 48)) is False
    monkeypatch.setattr(cpu, "_usable_memory", lambda: 16 * 6144 - 1)
    assert cpu.decode_copies_fit(torch.nn.Linear(64, 48).to(torch.bfloat16)) is False


def test_patch_conv_as_matmul_matches_the_convolution():
    torch.manual_seed(0)
    conv = torch.nn.Conv3d(3, 16, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=False).to(torch.bfloat16)
    x = torch.randn(10, 3, 2, 14, 14, dtype=torch.bfloat16)
    expected = conv(x)
    give_patch_kernel(conv, TorchLinear(PlainWeights((conv,), as_matrix=True)))
    got = conv(x)
    assert got.shape == expected.shape == (10, 16, 1, 1, 1)
    # same products, another summation order: bf16 rounding apart
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert not torch.equal(got, torch.zeros_like(got))
    # an input larger than one kernel still convolves (and exactly as before)
    big = torch.randn(1, 3, 2, 28, 28, dtype=torch.bfloat16)
    torch.testing.assert_close(conv(big), conv._conv_forward(big, conv.weight, conv.bias), rtol=0, atol=0)


@needs_bf16_packing
def test_patch_conv_multiplies_with_a_packed_weight_and_keeps_its_own():
    """The patch count changes with every image: the product goes through oneDNN's packed kernel (padded rows, one
    oneDNN kernel per row bucket rather than per count); bf16 sums may round apart from the unpadded product."""
    torch.manual_seed(0)
    conv = torch.nn.Conv3d(3, 32, kernel_size=(2, 14, 14), stride=(2, 14, 14)).to(torch.bfloat16)
    weight, bias = conv.weight.detach().reshape(32, -1).clone(), conv.bias.detach().clone()
    give_patch_kernel(conv, OneDnnPackedLinear(PlainWeights((conv,), as_matrix=True)))
    for patches in (1, 7, 33, 100, 257, 1030):
        x = torch.randn(patches, 3, 2, 14, 14, dtype=torch.bfloat16)
        torch.testing.assert_close(conv(x).float(), F.linear(x.reshape(patches, -1), weight, bias).view(
            patches, 32, 1, 1, 1).float(), rtol=1.6e-2, atol=1e-2)
    assert conv.weight.shape == (32, 3, 2, 14, 14)  # kept for inputs larger than one kernel


def test_allocator_tuning_is_accepted_by_glibc():
    assert cpu.tune_allocator() is True


def test_kernel_cache_size_is_raised_unless_the_user_set_it(monkeypatch):
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "0")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")  # restored to its state before the test afterwards
    cpu.size_kernel_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(cpu.KERNEL_CACHE_CAPACITY)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "77")
    cpu.size_kernel_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "77"
