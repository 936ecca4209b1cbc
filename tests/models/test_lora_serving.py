"""LoRA serving around the parity suite (tiny llama): an unknown adapter refuses only its own request while the
running batch goes on; quantized (int8-grouped) layers add the delta too; with no adapter loaded no layer carries
an extra term (the base model's path is unchanged)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import load_engine
from tests.models.lora_reference import RECIPES, make_adapter, merged_model
from tests.models.reference import assert_matches, hf_greedy
from tgi_vlm.errors import InvalidBatch
from tgi_vlm.layers.linear.modules import KernelLinear
from tgi_vlm.layers.step_context import StepContext, using
from tgi_vlm.lora import AdapterSpec
from tgi_vlm.testing.harness import Runner, make_batch, make_request

PROMPT = "the quick brown fox jumps over the lazy dog and then"


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serving")
    return {name: make_adapter("llama", root / name, RECIPES[name]) for name in ("lora-all", "lora-rs")}


def specs(dirs) -> tuple[AdapterSpec, ...]:
    return tuple(AdapterSpec(name, str(path)) for name, path in dirs.items())


@pytest.fixture(scope="module")
def engine(adapter_dirs):
    return load_engine("llama", lora_adapters=specs(adapter_dirs))


def test_an_unknown_adapter_refuses_its_request_only_and_the_running_batch_goes_on(engine, adapter_dirs):
    runner = Runner(engine)
    request = make_request(1, PROMPT, max_new_tokens=6)
    request.adapter_id = "lora-all"
    runner.prefill([request])
    unknown, good = make_request(2, "hello", max_new_tokens=6), make_request(3, PROMPT, max_new_tokens=6)
    unknown.adapter_id, good.adapter_id = "lora-missing", "lora-rs"
    with pytest.raises(InvalidBatch) as refused:
        engine.batch_from_pb(make_batch(2, [unknown, good]))
    assert refused.value.request_ids == [2]
    assert ("request 2: adapter_id 'lora-missing' is not a loaded LoRA adapter (loaded: 'lora-all', 'lora-rs'; "
            "leave adapter_id empty for the base model)") in str(refused.value)
    runner.step()  # the running batch decodes on; the router resends the good request alone (router.py)
    runner.prefill([good], batch_id=3)
    runner.run()
    ids = engine.tokenize_request(good).ids
    inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    for rid, adapter in ((1, "lora-all"), (3, "lora-rs")):
        assert_matches(runner, rid, hf_greedy(merged_model("llama", adapter_dirs[adapter]), inputs, 6))
    assert engine.kv_blocks_in_use == 0


def test_int8_grouped_layers_add_each_rows_adapter_delta(adapter_dirs):
    engine = load_engine("llama", quantize="eetq", lora_adapters=specs(adapter_dirs))
    o_proj = engine.language_model.layers[1].self_attn.o_proj
    assert o_proj.linear_kernel.name.startswith("int8-grouped") and o_proj.extra.adapters == (1, 2)
    x = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(0))
    context = StepContext(request_ids=(7, 8, 9), row_starts=(0, 2, 5, 6), adapters=(2, 0, 1), device=torch.device("cpu"))
    with torch.inference_mode(), using(context):
        got = o_proj(x)[0]
    expected = o_proj.linear_kernel(x)[0].clone()
    for rows, adapter in ((slice(0, 2), 2), (slice(5, 6), 1)):
        a, b = o_proj.extra.pair(adapter)
        expected[rows] += x[0, rows] @ a.T @ b.T
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(got, o_proj.linear_kernel(x)[0], atol=1e-3)  # the delta is there


def test_without_adapters_no_layer_carries_an_extra_term():
    engine = load_engine("llama")
    layers = [m for m in engine.model.modules() if isinstance(m, KernelLinear)]
    assert layers and all(m.extra is None for m in layers)
    assert len(engine.adapter_table) == 0 and engine.info().lora_adapters == []
