"""`--quantize eetq` (int8 weight-only, one scale per output channel, made at load): served greedy tokens and logits are
transformers' own on a model whose language-model weights are those int8 weights de-quantized (an exact reference for
the quantizer and the kernels, float32), the vision tower and projector untouched, and the CLI takes TGI's value and
refuses the others by name."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from tests.conftest import load_engine
from tests.models.reference import assert_matches, hf_greedy
from tests.models.vlm_reference import hf_inputs
from tgi_vlm.quantization.int8 import SOURCE, quantize_per_channel
from tgi_vlm.testing import make_test_image, png_bytes, tiny_model_path
from tgi_vlm.testing.harness import Runner, make_request

N = 8


def with_int8_weights(language_model: torch.nn.Module) -> int:
    """transformers' model with each language-model linear's weight replaced by its int8 weight de-quantized (the
    same rule as quantization/int8.attach_int8_weights: plain, unshared, width a multiple of 16)."""
    shared = {}
    for module in language_model.modules():
        for p in module.parameters(recurse=False):
            shared[id(p)] = shared.get(id(p), 0) + 1
    count = 0
    with torch.no_grad():
        for module in language_model.modules():
            if type(module) is torch.nn.Linear and shared[id(module.weight)] == 1 and module.in_features % 16 == 0:
                module.weight.copy_(quantize_per_channel(module.weight).dequantize())
                count += 1
    return count


def test_int8_per_channel_codes_and_scales_rebuild_each_weight_within_half_a_step():
    weight = torch.randn(48, 64)
    weight[3] = 0  # a zero row: scale 1, codes 0
    q = quantize_per_channel(weight)
    assert q.codes.dtype == torch.int8 and q.scales.shape == (48, 1) and q.group == 64 and q.offsets is None
    assert int(q.codes.abs().max()) == 127 and torch.equal(q.dequantize()[3], torch.zeros(64))
    assert bool(((q.dequantize() - weight).abs() <= q.scales / 2 + 1e-7).all())


def test_a_text_model_served_int8_gives_transformers_tokens_on_the_int8_weights():
    engine = load_engine("llama", quantize="eetq")
    kernels = engine.linear_plan.kernels
    assert {k for n, k in kernels.items() if n.startswith("model.layers.")} <= {
        f"int8-grouped({SOURCE}){s}" for s in ("", "+native")} | {f"fused(int8-grouped({SOURCE}){s})" for s in ("", "+native")}
    assert not kernels["lm_head"].startswith(("int8", "fused(int8"))  # the head stays in the model's dtype
    path = tiny_model_path("llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert with_int8_weights(model.model) == sum(n.startswith("model.layers.") for n in kernels)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = ["hello world", "the quick brown fox"]
    runner = Runner(engine)
    runner.prefill([make_request(i, p, max_new_tokens=N) for i, p in enumerate(prompts)])
    runner.run()
    for i, prompt in enumerate(prompts):
        assert_matches(runner, i, hf_greedy(model, dict(tokenizer(prompt, return_tensors="pt")), N), atol=1e-4)


def test_a_vlm_served_int8_keeps_its_vision_tower_and_gives_transformers_tokens_on_the_int8_weights():
    engine = load_engine("qwen2_vl", quantize="eetq")
    kernels = engine.linear_plan.kernels
    vision = {n: k for n, k in kernels.items() if ".visual." in f".{n}" or n.startswith("model.visual")}
    text = {n: k for n, k in kernels.items() if "language_model" in n}
    assert vision and not any("int8" in k for k in vision.values())
    assert text and all("int8-grouped" in k for k in text.values())
    chunks = (png_bytes(make_test_image(56, 42, seed=1)), "Describe the picture.")
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_path("qwen2_vl"), dtype=torch.float32).eval()
    assert with_int8_weights(model.model.language_model) == len(text)
    runner = Runner(engine)
    runner.prefill([make_request(0, *chunks, max_new_tokens=N)])
    runner.run()
    assert_matches(runner, 0, hf_greedy(model, hf_inputs("qwen2_vl", chunks), N), atol=1e-4)


@pytest.mark.parametrize("value,message", [
    ("marlin", r"--quantize marlin: Marlin-format checkpoints are not supported .*\(supported: eetq: int8 weight-only"),
    ("exl2", "--quantize exl2: EXL2 checkpoints are not supported"),
    ("int3", "--quantize int3: not one of TGI's --quantize values"),
])
def test_the_shard_takes_eetq_and_the_packed_methods_and_refuses_other_quantize_values_by_name(value, message):
    import re

    from tgi_vlm.cli import unsupported_features
    from tgi_vlm.config import ServerConfig

    config = ServerConfig.from_env("m", env={})
    for taken in ("eetq", "awq", "gptq", "compressed-tensors"):
        assert unsupported_features(config, taken, None, None) == []
    problems = unsupported_features(config, value, None, None)
    assert len(problems) == 1 and re.search(message, problems[0]), problems


def test_quantized_weights_of_every_kind_are_refused_on_more_than_one_shard_before_loading(tmp_path):
    """GGUF files, packed checkpoints and --quantize eetq are served on one shard (their weights are not split
    across ranks): each refused at start with what it is, before a process group or a load is needed."""
    from tgi_vlm.config import EngineConfig
    from tgi_vlm.models import get_model
    from tgi_vlm.testing.quantized_checkpoints import write_quantized_copy
    from tgi_vlm.testing.tiny_gguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    gptq = write_quantized_copy(tiny_model_path("llama"), tmp_path / "gptq", "gptq", group=32)
    cases = [(str(gguf), None, "tiny.gguf: a GGUF file"), (str(gptq), None, "a gptq checkpoint"),
             (str(tiny_model_path("llama")), "eetq", "--quantize eetq")]
    for path, quantize, what in cases:
        config = EngineConfig(device="cpu", dtype="float32", rank=0, world_size=2, quantize=quantize)
        with pytest.raises(ValueError, match=f"{what} is served on one shard"):
            get_model(path, config)
