"""The planned kernel of a quantized layer (`GroupedInt8Linear`) and the quantized embedding: a layer given a
`quantized_weight` is planned to it (and owns it), its native rows and its sliced de-quantized rows compute the same
product as F.linear over the de-quantized weight, fused siblings are exactly their members' products side by side,
and the embedding returns the de-quantized rows (times a scaled embedding's scale) in the model's dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.unit.kernels_here import needs
from tgi_vlm.layers.linear import PlanOptions, plan_linears
from tgi_vlm.layers.linear.grouped import NATIVE_MAX_ROWS, GroupedInt8Linear
from tgi_vlm.layers.linear.kernels import PlainWeights
from tgi_vlm.layers.quantized_embedding import QuantizedEmbedding
from tgi_vlm.layers.weight_memory import weight_bytes
from tgi_vlm.quantization.grouped import GroupedInt8Weight


def grouped(out: int, in_features: int, *, group: int = 32, offsets: bool = False, seed: int = 0,
            source: str = "gguf Q8_0") -> GroupedInt8Weight:
    g = torch.Generator().manual_seed(seed)
    groups = in_features // group
    return GroupedInt8Weight(torch.randint(-128, 128, (out, in_features), dtype=torch.int8, generator=g),
                             torch.rand(out, groups, generator=g) * 0.02,
                             torch.rand(out, groups, generator=g) * 0.1 if offsets else None, group, source)


def quantized_layer(weight: GroupedInt8Weight, bias: bool = False, dtype=torch.float32) -> torch.nn.Linear:
    out, in_features = weight.shape
    layer = torch.nn.Linear(in_features, out, bias=bias, dtype=dtype)
    layer.weight = torch.nn.Parameter(torch.empty(out, in_features, dtype=dtype, device="meta"), requires_grad=False)
    layer.quantized_weight = weight
    return layer


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("native", [True, False], ids=["cpu-plan", "speed-ups-off"])
def test_a_layer_with_a_quantized_weight_is_planned_to_it_and_owns_it(native):
    weight = grouped(48, 64, offsets=True)
    model = torch.nn.Sequential(quantized_layer(weight, bias=True))
    plan = plan_linears(model, PlanOptions(cpu=native, grouped_int8=native))
    kernel = model[0].linear_kernel
    assert isinstance(kernel, GroupedInt8Linear) and kernel.weight is weight
    assert not hasattr(model[0], "quantized_weight")  # the kernel owns it now
    assert plan.kernels == {"0": "int8-grouped(gguf Q8_0)" + ("+native" if native else "")}
    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert close(model(x), F.linear(x, weight.dequantize(), model[0].bias))


@needs("grouped_int8_linear")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_rows_and_sliced_rows_compute_the_same_product(dtype, monkeypatch):
    import tgi_vlm.layers.linear.grouped as module

    weight = grouped(100, 96, offsets=True, seed=3)
    layer = quantized_layer(weight, dtype=dtype)
    kernel = GroupedInt8Linear(PlainWeights((layer,)), weight, native=True)
    monkeypatch.setattr(module, "DENSE_SLICE_VALUES", 96 * 16)  # slices of 16 outputs: the slicing itself is tested
    for rows in (1, NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 1, 70):
        x = torch.randn(2, rows, 96).to(dtype)
        want = F.linear(x.float(), weight.dequantize())
        got = kernel(x)
        assert got.shape == (2, rows, 100) and got.dtype == dtype
        tolerance = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
        assert torch.allclose(got.float(), want, rtol=tolerance, atol=tolerance * float(want.abs().max())), rows


def test_fused_siblings_are_their_members_products_side_by_side():
    q, k, v = grouped(64, 64, seed=1), grouped(32, 64, seed=2, source="gguf Q5_0"), grouped(32, 64, seed=3)
    attention = torch.nn.Module()
    attention.q_proj, attention.k_proj, attention.v_proj = (quantized_layer(w) for w in (q, k, v))
    model = torch.nn.Sequential(attention)
    plan = plan_linears(model, PlanOptions(cpu=True), language_model=model)
    assert plan.groups == {"0.q_proj+k_proj+v_proj": "int8-grouped(gguf Q5_0+gguf Q8_0)"}
    x = torch.randn(5, 64)
    outputs = [attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)]
    for got, w in zip(outputs, (q, k, v)):
        assert torch.equal(got, GroupedInt8Linear(PlainWeights((quantized_layer(w),)), w, native=False)(x))


def test_siblings_whose_groups_differ_are_not_fused():
    attention = torch.nn.Module()
    attention.q_proj = quantized_layer(grouped(32, 64))
    attention.k_proj = quantized_layer(grouped(32, 64, group=16))
    attention.v_proj = quantized_layer(grouped(32, 64))
    plan = plan_linears(torch.nn.Sequential(attention), PlanOptions(cpu=True), language_model=attention)
    assert plan.groups == {}


class ScaledEmbedding(torch.nn.Embedding):  # transformers' scaled word embedding, as Gemma's is
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.embed_scale = torch.tensor(8.0)

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_quantized_embedding_gives_what_the_module_it_replaces_gives_on_the_same_values(dtype):
    table = grouped(50, 32, offsets=True, seed=5)
    original = ScaledEmbedding(50, 32, padding_idx=0, dtype=dtype)
    original.weight.data = table.dequantize().to(dtype)
    embedding = QuantizedEmbedding.replacing(original, table)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    assert torch.equal(embedding(ids), original(ids))
    assert embedding(ids).dtype == dtype and embedding.num_embeddings == 50 and embedding.padding_idx == 0
    with pytest.raises(IndexError):
        embedding(torch.tensor([50]))


def test_the_weights_bytes_count_a_shared_quantized_table_once_and_placeholders_not_at_all():
    table = grouped(50, 32)
    model = torch.nn.Module()
    model.embed = QuantizedEmbedding(table, torch.float32)
    model.head = quantized_layer(table)
    plan_linears(model, PlanOptions(cpu=True))
    assert weight_bytes(model) == 50 * 32 + 50 * 1 * 4  # codes, one float32 scale per row of 32


def test_a_quantized_layers_placeholder_does_not_count_as_weights_a_second_copy_would_double():
    from tgi_vlm.layers.cpu import decode_copies_fit

    huge = torch.nn.Linear(1 << 14, 1 << 20, bias=False, device="meta")  # a 64 GiB float32 weight, were it real
    small = torch.nn.Linear(64, 64)
    assert decode_copies_fit(torch.nn.Sequential(small, huge)) == decode_copies_fit(torch.nn.Sequential(small))


def test_de_quantizing_to_a_dtype_it_does_not_write_is_refused_saying_so():
    from tgi_vlm.kernels.cpu import ops

    weight = grouped(16, 64)
    with pytest.raises(ValueError, match="dtype must be float32 or bfloat16, got torch.float16"):
        ops.grouped_int8_dequantize(weight.codes, weight.scales, None, 32, torch.float16)
