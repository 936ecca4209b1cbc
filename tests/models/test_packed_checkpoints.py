"""AWQ, GPTQ and compressed-tensors checkpoints of the tiny models served with their packed layers kept quantized,
against transformers' float model holding the same de-quantized weights, read by code that is not the shard's:

- compressed-tensors W4A16 (asymmetric, groups of 16) of the tiny Qwen2-VL, written by the compressed-tensors package
  itself (its qparams and its compressor, as llm-compressor saves one), and the reference read by transformers with
  compressed-tensors (`CompressedTensorsConfig(dequantize=True)`): greedy tokens equal over 16 tokens of an image
  prompt, every step's logits within 1e-4 (float32), every language-model linear on an `int8-grouped` kernel (q/k/v and
  gate/up fused), the vision tower's parameters bit for bit the float checkpoint's;
- GPTQ of the tiny Qwen2-VL (4-bit, asymmetric, groups of 32, activation order with its g_idx; classic format) and
  AWQ GEMM of the tiny llama (groups of 32), written by tgi_vlm.testing.quantized_checkpoints; their reference weights
  computed from the safetensors by the definition formulas of tests/unit/test_packed_formats.py (AutoAWQ's own
  de-quantization agrees with them there);
- groups of 8 inputs (the native kernel takes multiples of 16): served by the torch fallback (kernels without
  `+native`), the same tokens;
- refused at start: `--quantize` naming another method than the checkpoint's, or a packed method on a float
  checkpoint, or eetq on a packed one; a config declaring 4-bit codes over 8-bit tensors (file and tensor named); a
  packed layer the config's ignore list names.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from tests.models.reference import assert_matches, hf_greedy
from tests.models.vlm_reference import hf_inputs
from tests.unit.test_packed_formats import awq_by_definition, gptq_by_definition
from tgi_vlm.config import EngineConfig
from tgi_vlm.layers.linear.grouped import grouped_native_available, packed_native_available
from tgi_vlm.models import get_model
from tgi_vlm.quantization.packed_checkpoint import model_names
from tgi_vlm.quantization.packed_config import PackedCheckpointError
from tgi_vlm.testing import make_test_image, png_bytes, tiny_model_path
from tgi_vlm.testing.harness import Runner, make_request
from tgi_vlm.testing.quantized_checkpoints import write_quantized_copy

N = 16
IMAGE_PROMPT = (png_bytes(make_test_image(56, 42, seed=1)), "Describe the picture.")
TEXT_PROMPTS = ["hello world", "the quick brown fox jumps"]
NATIVE = "+native" if grouped_native_available() else ""
# 4-bit codes with a zero point are held as q - z (-15..15): packed in 5 bits where the packed ops load.
PACKED_ASYM = "+packed5" if NATIVE and packed_native_available() else ""


def engine_for(path, **overrides):
    config = EngineConfig(**{"device": "cpu", "dtype": "float32", "cpu_kv_cache_bytes": 32 << 20, **overrides})
    return get_model(str(path), config)


def compressed_tensors_copy(arch: str, dst, *, symmetric: bool, group: int):
    """The tiny model quantized and saved by compressed-tensors itself (float32 scales: its model's dtype)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    src = tiny_model_path(arch)
    model = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head", "re:.*visual.*"], quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, config)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        groups = module.weight.detach().view(module.weight.shape[0], -1, group)
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        with torch.no_grad():
            module.weight_scale.copy_(scale)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero)
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    for path in src.iterdir():  # tokenizer, processor, chat template
        if not (dst / path.name).exists():
            shutil.copy(path, dst / path.name)
    return dst


def float_model_with(arch: str, weights: dict[str, torch.Tensor]):
    """transformers' float32 model of the tiny `arch` with `weights` (checkpoint name -> tensor) put in."""
    auto = AutoModelForCausalLM if arch == "llama" else AutoModelForImageTextToText
    model = auto.from_pretrained(tiny_model_path(arch), dtype=torch.float32).eval()
    names = model_names(model, list(weights))
    with torch.no_grad():
        for key, value in weights.items():
            model.get_parameter(names[key]).copy_(value)
    return model


def by_definition(path, method: str, group: int) -> dict[str, torch.Tensor]:
    """Every packed layer's W from the safetensors, by the formats' definition formulas (not the shard's reader)."""
    tensors = load_file(path / "model.safetensors")
    weights = {}
    for key in tensors:
        if key.endswith(".qweight"):
            prefix = key.removesuffix(".qweight")
            layer = {s: tensors[f"{prefix}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx")
                     if f"{prefix}.{s}" in tensors}
            w = gptq_by_definition(layer, 4, True) if method == "gptq" else awq_by_definition(layer, group)
            weights[f"{prefix}.weight"] = torch.from_numpy(w)
    return weights


def serve_image_prompt(engine):
    runner = Runner(engine)
    runner.prefill([make_request(0, *IMAGE_PROMPT, max_new_tokens=N)])
    runner.run()
    return runner


def serve_text_prompts(engine):
    runner = Runner(engine)
    runner.prefill([make_request(i, p, max_new_tokens=N) for i, p in enumerate(TEXT_PROMPTS)])
    runner.run()
    return runner


def language_kernels(engine) -> set[str]:
    return {k for n, k in engine.linear_plan.kernels.items() if "language_model" in n or n.startswith("model.layers")}


@pytest.fixture(scope="module")
def ct_qwen(tmp_path_factory):
    return compressed_tensors_copy("qwen2_vl", tmp_path_factory.mktemp("ct") / "qwen", symmetric=False, group=16)


def test_a_compressed_tensors_vlm_written_by_the_library_gives_its_de_quantized_models_tokens(ct_qwen):
    from transformers import CompressedTensorsConfig

    config = json.loads((ct_qwen / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized" and "lm_head" in config["ignore"]
    engine = engine_for(ct_qwen)
    label = "int8-grouped(compressed-tensors 4-bit g16 asym)" + NATIVE + PACKED_ASYM
    assert language_kernels(engine) == {label, f"fused({label})"}
    assert len(engine.linear_plan.groups) == 4 and set(engine.linear_plan.groups.values()) == {label}
    vision = {n: k for n, k in engine.linear_plan.kernels.items() if "visual" in n or n == "lm_head"}
    assert vision and not any("int8" in k for k in vision.values())
    # as loaded (a packed kernel may release its plain weight once it has served)
    float_model = AutoModelForImageTextToText.from_pretrained(tiny_model_path("qwen2_vl"), dtype=torch.float32)
    served_visual = dict(engine.model.model.visual.named_parameters())
    float_visual = dict(float_model.model.visual.named_parameters())
    assert served_visual.keys() == float_visual.keys()
    assert all(torch.equal(served_visual[n], float_visual[n]) for n in float_visual)
    reference = AutoModelForImageTextToText.from_pretrained(
        ct_qwen, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    runner = serve_image_prompt(engine)
    ref = hf_greedy(reference, hf_inputs("qwen2_vl", IMAGE_PROMPT), N)
    assert len(set(ref.ids)) > 3, ref.ids
    assert_matches(runner, 0, ref, atol=1e-4)


def test_a_gptq_vlm_in_activation_order_gives_its_de_quantized_models_tokens(tmp_path):
    path = write_quantized_copy(tiny_model_path("qwen2_vl"), tmp_path / "gptq", "gptq", group=32, symmetric=False,
                                act_order=True)
    engine = engine_for(path, quantize="gptq")
    label = "int8-grouped(gptq 4-bit g32 asym act-order)" + NATIVE + PACKED_ASYM
    assert language_kernels(engine) == {label, f"fused({label})"}
    runner = serve_image_prompt(engine)
    reference = float_model_with("qwen2_vl", by_definition(path, "gptq", 32))
    assert_matches(runner, 0, hf_greedy(reference, hf_inputs("qwen2_vl", IMAGE_PROMPT), N), atol=1e-4)


def test_an_awq_text_model_gives_its_de_quantized_models_tokens(tmp_path):
    path = write_quantized_copy(tiny_model_path("llama"), tmp_path / "awq", "awq", group=32, symmetric=False)
    engine = engine_for(path, quantize="awq")
    label = "int8-grouped(awq 4-bit g32 asym)" + NATIVE + PACKED_ASYM
    assert language_kernels(engine) == {label, f"fused({label})"}
    assert not engine.linear_plan.kernels["lm_head"].startswith(("int8", "fused(int8"))
    runner = serve_text_prompts(engine)
    reference = float_model_with("llama", by_definition(path, "awq", 32))
    tokenizer = AutoTokenizer.from_pretrained(path)
    for i, prompt in enumerate(TEXT_PROMPTS):
        assert_matches(runner, i, hf_greedy(reference, dict(tokenizer(prompt, return_tensors="pt")), N), atol=1e-4)


def test_groups_of_8_inputs_are_served_by_the_torch_fallback_with_the_same_tokens(tmp_path):
    from transformers import CompressedTensorsConfig

    path = write_quantized_copy(tiny_model_path("llama"), tmp_path / "g8", "compressed-tensors", group=8,
                                scale_dtype=torch.float32)
    engine = engine_for(path)
    label = "int8-grouped(compressed-tensors 4-bit g8)"
    assert language_kernels(engine) == {label, f"fused({label})"}  # no +native: the native op takes multiples of 16
    runner = serve_text_prompts(engine)
    reference = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    for i, prompt in enumerate(TEXT_PROMPTS):
        assert_matches(runner, i, hf_greedy(reference, dict(tokenizer(prompt, return_tensors="pt")), N), atol=1e-4)


@pytest.fixture(scope="module")
def awq_llama(tmp_path_factory):
    return write_quantized_copy(tiny_model_path("llama"), tmp_path_factory.mktemp("awq") / "llama", "awq", group=32,
                                symmetric=False)


@pytest.mark.parametrize("model,quantize,message", [
    ("awq", "gptq", r"--quantize gptq: .*llama is a awq checkpoint \(llama/config.json quantization_config\); pass "
                    r"--quantize awq or leave the flag out"),
    ("awq", "eetq", r"--quantize eetq: .*llama is a awq checkpoint"),
    ("float", "awq", r"--quantize awq: .*llama-tiny is not a awq checkpoint \(its config.json has no "
                     r"quantization_config\)"),
])
def test_a_quantize_flag_that_does_not_match_the_checkpoint_is_refused_at_start(awq_llama, model, quantize, message):
    path = awq_llama if model == "awq" else tiny_model_path("llama")
    with pytest.raises(PackedCheckpointError, match=message):
        engine_for(path, quantize=quantize)


def edited_copy(src, dst, edit):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_a_config_declaring_4_bit_codes_over_8_bit_tensors_is_refused_naming_file_and_tensor(tmp_path):
    eight = write_quantized_copy(tiny_model_path("llama"), tmp_path / "g8bit", "gptq", bits=8, group=32)
    wrong = edited_copy(eight, tmp_path / "declared4", lambda q: q.update(bits=4))
    message = ("model.safetensors: tensor model.layers.0.mlp.down_proj.qweight is [32, 64], not [16, 64] as 4-bit "
               "codes of a 64 x 128 layer take: the quantization config does not match the weights")
    with pytest.raises(PackedCheckpointError, match=f"^{re.escape(message)}$"):
        engine_for(wrong)


def test_a_packed_layer_the_ignore_list_names_is_refused_naming_it(tmp_path):
    src = write_quantized_copy(tiny_model_path("llama"), tmp_path / "ct", "compressed-tensors", group=32)
    wrong = edited_copy(src, tmp_path / "ignored", lambda q: q["ignore"].append("re:.*mlp\\.down_proj"))
    with pytest.raises(PackedCheckpointError, match=r"model\.safetensors: tensor model\.layers\.0\.mlp\.down_proj\."
                                                    r"weight_packed: packed, but .* keeps model\.layers\.0\.mlp\."
                                                    r"down_proj unquantized"):
        engine_for(wrong)
