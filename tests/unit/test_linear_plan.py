"""layers/linear/plan.py: every linear layer of every architecture gets exactly one kernel, the plan logged at start
is what runs, the rules pick what their table says, and a layer's extra term runs in every path."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import load_engine
from tgi_vlm.layers.linear import KernelLinear, LinearPlan, PlanOptions, fused_group, plan, plan_linears
from tgi_vlm.layers.linear import kernels as kernels_module
from tgi_vlm.layers.linear.fused import FusedProjections
from tgi_vlm.layers.linear.kernels import BucketedLinear, MklPackedLinear, OneDnnPackedLinear, TorchLinear
from tgi_vlm.layers.linear.modules import give_kernel
from tgi_vlm.testing import make_test_image, png_bytes
from tgi_vlm.testing.builder import ARCHS, TEXT_ARCHS
from tgi_vlm.testing.harness import Runner, make_request

IMG = png_bytes(make_test_image(40, 28, seed=3))


def _requests(arch: str):
    chunks = ("the cat sat on a mat",) if arch in TEXT_ARCHS else ("Look ", IMG, " the cat sat on a mat")
    return [make_request(0, *chunks, max_new_tokens=3)]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_linear_has_one_kernel_and_the_plan_is_what_runs(arch, monkeypatch):
    """Each `nn.Linear` is a `KernelLinear`; the engine's plan (what was logged) names each one; serving a request
    (an image for VLMs) calls every layer through exactly the kernel the plan names, fused groups included."""
    engine = load_engine(arch)
    model = engine.model
    linears = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    # Subclasses keep their own forward: nn.MultiheadAttention's out_proj (its owner reads the weight), Llama4's
    # router (top-k on its product).
    owned = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and
             type(m).__name__ in ("NonDynamicallyQuantizableLinear", "Llama4Router")}
    assert set(engine.linear_plan.not_planned) == owned
    linears -= owned
    assert linears and all(isinstance(model.get_submodule(n), KernelLinear) for n in linears)
    assert set(engine.linear_plan.kernels) == linears
    assert engine.linear_plan == LinearPlan.read(model)
    ran: dict[str, set[str]] = collections.defaultdict(set)
    names = {id(m): n for n, m in model.named_modules()}
    forward, product = KernelLinear.forward, FusedProjections.product

    def recording_forward(self, x):
        ran[names[id(self)]].add(self.linear_kernel.name)
        return forward(self, x)

    def recording_product(self, x):
        for member in self.members:
            ran[names[id(member)]].add(f"fused({self.kernel.name})")
        return product(self, x)

    monkeypatch.setattr(KernelLinear, "forward", recording_forward)
    monkeypatch.setattr(FusedProjections, "product", recording_product)
    Runner(engine).prefill(_requests(arch))
    unused = {n for n in linears if not ran[n]}
    assert not unused, sorted(unused)[:5]
    for name, seen in ran.items():
        assert seen == {engine.linear_plan.kernels[name]}, name


def test_a_cpu_plan_follows_its_rules():
    torch.manual_seed(0)
    embed = torch.nn.Embedding(10, 8).to(torch.bfloat16)
    head = torch.nn.Linear(8, 10, bias=False).to(torch.bfloat16)
    head.weight = embed.weight  # tied, as many lm-heads are
    model = torch.nn.ModuleDict({
        "embed": embed, "head": head,
        "fp16": torch.nn.Linear(8, 8).to(torch.float16),  # no fast oneDNN float16 path on most CPUs
        "bf16": torch.nn.Linear(8, 8).to(torch.bfloat16),
        "fp32": torch.nn.Linear(8, 8)})
    got = plan_linears(model, PlanOptions(cpu=True)).kernels
    bf16 = "onednn-packed" if kernels_module.can_pack_weights(torch.bfloat16) else "torch-bucketed"
    fp32 = "mkl-packed" if kernels_module.mkl_serves_float32() else "onednn-packed"
    # without room for a second copy (decode_copy false) the tied head is not packed
    assert got == {"head": "torch-bucketed", "fp16": "torch-bucketed", "bf16": bf16, "fp32": fp32}


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
def test_float32_goes_to_mkl_only_on_intel_and_amd_takes_onednn_for_every_row_count(vendor, monkeypatch):
    """MKL's packed GEMM on Intel CPUs (with the native loop or not); on AMD, where MKL runs generic code, oneDNN's
    packed product, with no plain one-row copy (oneDNN is faster there at one row too); the products agree."""
    monkeypatch.setattr(kernels_module, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(plan, "cpu_vendor", lambda: vendor)
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    kernel = plan.choose_kernel(layer, PlanOptions(cpu=True, decode_copy=True))
    if vendor == "AuthenticAMD":
        assert type(kernel) is OneDnnPackedLinear
    elif kernels_module.mkl_packs_float32():
        assert type(kernel) is MklPackedLinear
    else:
        assert kernel.name == "onednn-packed+gemv"
    kernel_layer = give_kernel(layer, kernel)
    for rows in (1, 4, 33):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(kernel_layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert layer.weight.numel() == (0 if vendor == "AuthenticAMD" or kernels_module.mkl_packs_float32() else 64 * 48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tied_lm_head_is_packed_where_a_second_copy_fits_and_the_embedding_keeps_its_weight(dtype):
    """A weight shared by the embedding and the lm-head gets its dtype's packed kernel with the plain weight kept
    (`...+plain-kept`) when `decode_copy` allows a second copy: the embedding still reads every row, the head's
    product equals F.linear on the same weight, and no product is fused with it."""
    if not kernels_module.can_pack_weights(dtype):
        assert dtype == torch.bfloat16  # an AVX2-only CPU: bf16 cannot be packed, the rule under test is float32's
        dtype = torch.float32
    torch.manual_seed(0)
    embed = torch.nn.Embedding(40, 16).to(dtype)
    head = torch.nn.Linear(16, 40, bias=False).to(dtype)
    head.weight = embed.weight
    plain = embed.weight.detach().clone()
    model = torch.nn.ModuleDict({"embed": embed, "head": head})
    got = plan_linears(model, PlanOptions(cpu=True, decode_copy=True)).kernels
    packed = {torch.bfloat16: "onednn-packed",
              torch.float32: "mkl-packed" if kernels_module.mkl_serves_float32() else "onednn-packed"}[dtype]
    assert got == {"head": f"{packed}+plain-kept"}
    for rows in (1, 5, 16):
        x = torch.randn(rows, 16).to(dtype)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(head(x), F.linear(x, plain), **tol)
    assert head.linear_kernel.ready and embed.weight.shape == (40, 16)
    ids = torch.tensor([0, 39, 7])
    torch.testing.assert_close(embed(ids), plain[ids], rtol=0, atol=0)


@pytest.mark.parametrize("options", [PlanOptions(cpu=False), PlanOptions(cpu=True, sharded=True)],
                         ids=["not-cpu", "sharded"])
def test_off_cpu_and_on_tensor_parallel_ranks_every_layer_is_plain_torch(options):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).to(torch.bfloat16))
    weight = model[0].weight.detach().clone()
    assert set(plan_linears(model, options).kernels.values()) == {"torch"}
    x = torch.randn(3, 8)
    torch.testing.assert_close(model[0](x), F.linear(x, weight, model[0].bias), rtol=0, atol=0)
    assert model[0].weight.numel() == 64  # nothing packed, nothing released


def test_a_weight_that_is_not_a_plain_tensor_is_neither_packed_nor_fused():
    """A quantized or otherwise subclassed weight may report a dtype it is not stored in: its own F.linear runs."""

    class Tagged(torch.Tensor):
        pass

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(8, 8) for _ in range(3))

    attn = Attention()
    attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.detach().as_subclass(Tagged))
    got = plan_linears(attn, PlanOptions(cpu=True), language_model=attn)
    assert got.kernels["k_proj"] == "torch" and not got.groups
    assert fused_group(attn, ("q_proj", "k_proj", "v_proj")) is None


class Delta:
    """An extra term x @ delta.T (what a LoRA delta adds), counting its calls."""

    def __init__(self, delta: torch.Tensor):
        self.delta, self.calls = delta, 0

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> None:
        self.calls += 1
        out += x @ self.delta.T


@pytest.mark.parametrize("kind", [TorchLinear, BucketedLinear, MklPackedLinear, OneDnnPackedLinear])
def test_an_extra_term_runs_in_every_kernel(kind):
    from tgi_vlm.layers.linear.kernels import PlainWeights
    from tgi_vlm.layers.linear.modules import give_kernel

    if kind is MklPackedLinear and not kernels_module.mkl_packs_float32():
        pytest.skip("this torch build has no MKL packed GEMM")
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 12)
    merged = (layer.weight.detach().clone(), layer.bias.detach().clone())
    delta = torch.randn(12, 16) * 0.1
    give_kernel(layer, kind(PlainWeights((layer,)))).extra = Delta(delta)
    x = torch.randn(5, 16)
    torch.testing.assert_close(layer(x), F.linear(x, merged[0] + delta, merged[1]), rtol=1e-5, atol=1e-5)
    assert layer.extra.calls == 1


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_vl"])
def test_extra_terms_run_inside_fused_and_lean_layers(arch):
    """Deltas on q_proj, v_proj, o_proj, up_proj and down_proj of every lean, fused layer give, token for token and
    logit for logit, the model whose weights hold W + D (served without the deltas)."""
    from tgi_vlm.layers.cpu_decoder import _PARTS_ATTR

    with_extras, merged = load_engine(arch), load_engine(arch)
    layers = [m for m in with_extras.language_model.modules() if _PARTS_ATTR in vars(m)]
    assert layers, "no lean layer to test"
    generator = torch.Generator().manual_seed(0)
    extras = []
    for layer, twin in zip(layers, (m for m in merged.language_model.modules() if _PARTS_ATTR in vars(m))):
        for path in ("self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj"):
            module, twin_module = layer.get_submodule(path), twin.get_submodule(path)
            delta = torch.randn(module.out_features, module.in_features, generator=generator) * 0.05
            module.extra = Delta(delta)
            extras.append(module.extra)
            _add_to_weight(twin_module, delta)
    runs = []
    for engine in (with_extras, merged):
        runner = Runner(engine)
        runner.prefill(_requests(arch))
        runner.run()
        runs.append(runner)
    assert all(e.calls > 0 for e in extras)
    assert dict(runs[0].tokens) == dict(runs[1].tokens)
    for rid, rows in runs[1].logits.items():
        for mine, theirs in zip(runs[0].logits[rid], rows):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-4)


def _add_to_weight(module: KernelLinear, delta: torch.Tensor) -> None:
    """Fold `delta` into the layer's weights before its kernel packs them (packing is lazy: nothing ran yet)."""
    kernel = module.linear_kernel
    assert not kernel.ready, "the kernel packed already"
    with torch.no_grad():
        module.weight += delta


def test_packed_products_lists_each_product_shape_once():
    """Two layers of the same shapes: one fused q/k/v product (with bias) and one o_proj product (without)."""
    products = plan.packed_products(_two_layer_model())
    assert sorted((k.in_features, k.out_features, k.source.has_bias, cap) for k, cap in products) == [
        (16, 32, False, None), (32, 48, True, None)]


def test_priming_runs_every_shape_at_every_bucket_and_stops_at_its_budget(monkeypatch):
    model = _two_layer_model()
    seen = _record_products(monkeypatch)
    assert plan.prime_packed_kernels(model, 40) == (2 * 33, 64)
    assert sorted(seen) == sorted((out, rows) for out in (32, 48) for rows in kernels_module.row_buckets(40))
    seen.clear()
    clock = iter(range(100))  # one second per reading: the start, then one before each bucket
    assert plan.prime_packed_kernels(model, 2048, budget_s=2.5, clock=lambda: next(clock)) == (4, 2)
    assert sorted(seen) == [(32, 1), (32, 2), (48, 1), (48, 2)]


def test_priming_stops_a_capped_module_at_its_rows(monkeypatch):
    """The lm-head meets at most a logprob chunk of rows: its product is not run at larger buckets."""
    model = _two_layer_model()
    seen = _record_products(monkeypatch)
    count, largest = plan.prime_packed_kernels(model, 100, row_caps={model[0].o_proj: 5, model[1].o_proj: 5})
    assert largest == 128 and count == len(kernels_module.row_buckets(100)) + 5
    assert sorted(rows for out, rows in seen if out == 32) == [1, 2, 3, 4, 5]


def test_priming_skips_the_row_counts_a_native_bf16_product_takes(monkeypatch):
    """`onednn-packed+native-skinny`: the counts its native product takes build nothing, so warmup's budget goes to
    oneDNN's buckets past them only."""
    from tests.unit.kernels_here import kernels
    from tgi_vlm.kernels.cpu import ops
    from tgi_vlm.layers.linear.kernels import OneDnnPackedSkinnyLinear, PlainWeights, can_pack_weights
    from tgi_vlm.layers.linear.modules import give_kernel

    if not (kernels().available("skinny_linear_bf16") and ops.skinny_bf16_max_rows() and can_pack_weights(torch.bfloat16)):
        pytest.skip("no native bf16 product here (AVX512-BF16) or oneDNN cannot pack bf16")
    layer = torch.nn.Linear(64, 48).bfloat16()
    give_kernel(layer, OneDnnPackedSkinnyLinear(PlainWeights((layer,))))
    layer(torch.zeros(1, 64).bfloat16())  # packs
    limit = layer.linear_kernel.skinny.max_rows
    seen = _record_products(monkeypatch)
    count, largest = plan.prime_packed_kernels(torch.nn.Sequential(layer), limit + 100)
    past = [rows for rows in kernels_module.row_buckets(limit + 100) if rows > limit]
    assert sorted(rows for _, rows in seen) == past and count == len(past) > 0


def test_priming_with_nothing_packed_runs_nothing():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    plan_linears(model, PlanOptions(cpu=False))
    assert plan.prime_packed_kernels(model, 2048) == (0, 0)


def _record_products(monkeypatch) -> list[tuple[int, int]]:
    seen = []
    original = OneDnnPackedLinear._product
    monkeypatch.setattr(OneDnnPackedLinear, "_product",
                        lambda self, x: seen.append((self.out_features, x.shape[0])) or original(self, x))
    return seen


def _two_layer_model() -> torch.nn.Module:
    """Two attention blocks on oneDNN's packed float32 kernel (it builds per row count), fused, used once."""
    from tgi_vlm.layers.linear.kernels import PlainWeights
    from tgi_vlm.layers.linear.modules import give_kernel

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(32, 16) for _ in range(3))
            self.o_proj = torch.nn.Linear(16, 32, bias=False)

    model = torch.nn.Sequential(Attention(), Attention())
    for module in list(model.modules()):
        if type(module) is torch.nn.Linear:
            give_kernel(module, OneDnnPackedLinear(PlainWeights((module,))))
    assert plan.fuse_siblings(model) == 2
    x = torch.randn(3, 32)
    for attention in model:  # packing is lazy: first use
        attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
        attention.o_proj(torch.randn(3, 16))
    return model
