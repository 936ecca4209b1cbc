"""The lean decoder-layer forward (layers/cpu_decoder.py, on by default on CPU) and transformers' own
layer forward give the same logits, bit for bit, and the same tokens: prefill chunks next to decode
rows, requests joining and finishing at different steps, in float32 and bfloat16. The parity suites
compare the default (lean) path with transformers' generate; this pins it to the layer it replaces.

Bit for bit with torch's RMSNorm (`KernelSettings.native_norm` off, for every test but the last ones); the native
RMSNorm, on by default where it loads, sums its squares in double, so with it the logits agree to float32 rounding
and the tokens are equal (the last tests)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import load_engine
from tests.models.test_decode_mirror_parity import assert_identical_runs, run
from tests.unit.kernels_here import needs, op_calls, require
from tgi_vlm.config import KernelSettings
from tgi_vlm.layers.cpu_decoder import remove_lean_layers

TORCH_NORM = KernelSettings(native_norm=False)


def lean_engine(arch: str, kernels: KernelSettings = TORCH_NORM, **config):
    """An engine whose lean layers use `kernels` (torch's RMSNorm unless told otherwise)."""
    return load_engine(arch, kernels=kernels, **config)

# Every tiny architecture: those whose text layers are Llama-family get the lean forward.
COVERED = ("llama", "qwen2", "mistral", "qwen2_vl", "qwen2_5_vl", "llava_next", "idefics2", "idefics3", "smolvlm",
           "gemma3")
NOT_COVERED = ("gemma2", "paligemma", "llama4", "phi3")


def lean_layers(engine) -> int:
    return sum(1 for m in engine.language_model.modules() if "_tgi_vlm_lean_parts" in m.__dict__)


def arch_for_requests(arch: str) -> str:
    return arch if arch in ("llama", "mistral", "gemma2") else ("llama" if arch in ("qwen2", "phi3") else arch)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", COVERED)
def test_lean_layers_give_transformers_layers_logits_bit_for_bit(arch, dtype):
    lean = lean_engine(arch, dtype=dtype)
    layers = lean.language_model.config.num_hidden_layers
    assert lean_layers(lean) == layers
    plain_engine = load_engine(arch, dtype=dtype)
    assert remove_lean_layers(plain_engine.language_model) == layers and lean_layers(plain_engine) == 0
    requests = arch_for_requests(arch)
    lean_run, plain_run = run(lean, requests), run(plain_engine, requests)
    assert_identical_runs(lean_run, plain_run)
    assert sorted(lean_run.tokens) == [0, 1, 2, 10, 11]


@pytest.mark.parametrize("arch", NOT_COVERED)
def test_other_layers_keep_transformers_forward(arch):
    assert lean_layers(load_engine(arch)) == 0


@pytest.mark.parametrize("dtype,mkl", [("float32", True), ("float32", False), ("bfloat16", True)],
                         ids=["float32-mkl", "float32-onednn", "bfloat16"])
def test_long_prefills_stay_bit_for_bit(dtype, mkl, monkeypatch):
    """Prefills past 32 rows (oneDNN pads those rows: bf16, and float32 without MKL; MKL's float32 products take
    them as they are) beside decode rows: still transformers' values, bit for bit."""
    from tgi_vlm.layers.linear import kernels, plan
    from tgi_vlm.testing.harness import Runner, make_request

    # MKL's float32 products where torch has them (the plan's choice on Intel CPUs), else oneDNN's (AMD's choice)
    monkeypatch.setattr(plan, "mkl_serves_float32", lambda: mkl and kernels.mkl_packs_float32())
    words = "the cat sat on a mat and looked at the dog who ran away from it".split()
    runs = []
    for lean in (True, False):
        engine = lean_engine("qwen2", dtype=dtype)
        if not lean:
            remove_lean_layers(engine.language_model)
        runner = Runner(engine)
        runner.prefill([make_request(0, " ".join(words * 3), max_new_tokens=4)])
        runner.step()
        runner.prefill([make_request(1, " ".join(words * 5), max_new_tokens=3)], batch_id=2)
        runner.run()
        runs.append(runner)
    assert_identical_runs(*runs)


@needs("rms_norm")
@pytest.mark.parametrize("arch", ["qwen2", "qwen2_vl", "idefics2", "gemma3"])
def test_lean_layers_with_the_native_norm_give_transformers_tokens_and_logits_to_float32_rounding(arch):
    """float32: an ulp here and there in the norms' outputs moves logits by up to ~3e-5 over a run; they stay within
    the parity suites' 1e-4 of transformers' layers and the tokens are equal. The native norm must have run
    (counted); Gemma 3's layers take Gemma's norm (`gemma_rms_norm`, q/k norms in place on the fused product) and
    the native rotary + K/V store after it."""
    norm_op = "gemma_rms_norm" if arch == "gemma3" else "rms_norm"
    require(norm_op)
    lean = lean_engine(arch, KernelSettings(native_norm=True), dtype="float32")
    plain_engine = load_engine(arch, dtype="float32")
    remove_lean_layers(plain_engine.language_model)
    requests = arch_for_requests(arch)
    with op_calls() as calls:
        lean_run = run(lean, requests)
    plain_run = run(plain_engine, requests)
    assert calls[f"tgi_vlm::{norm_op}"], "the native norm did not run"
    if arch == "gemma3":  # 6 norms a layer: the input and pre-feedforward ones, q and k, and the two sandwich norms
        # that end the blocks, each with its residual add (gemma_rms_norm_add); one rotary + store a layer
        assert calls["tgi_vlm::gemma_rms_norm"] == 4 * calls["tgi_vlm::rotary_and_store"] > 0
        assert calls["tgi_vlm::gemma_rms_norm_add"] == 2 * calls["tgi_vlm::rotary_and_store"]
        assert calls["tgi_vlm::decode_attention"] > 0  # decode steps through the per-step plan's direct call
    assert dict(lean_run.tokens) == dict(plain_run.tokens)
    for rid, rows in plain_run.logits.items():
        assert len(lean_run.logits[rid]) == len(rows)
        for mine, theirs in zip(lean_run.logits[rid], rows):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-4)


@needs("gemma_rms_norm_add")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["gemma3", "qwen2_vl", "llama", "idefics2"])
def test_the_per_step_plan_is_the_ops_path_bit_for_bit(arch, dtype, monkeypatch):
    """The lean layers on the per-step plan (layers/native_step.py: the same C calls, checked once a step; Gemma 3's
    sandwich norms fused with their residual adds) against the same kernels called op by op with their checks:
    equal logits, bit for bit, over prefills beside decode rows and decode-only steps (through decode_attention)."""
    from tgi_vlm.layers import native_step

    require("gemma_rms_norm_add")
    planned_layers, direct_decodes = [], []
    attend, gemma3, llama = native_step._decode_attention, native_step.gemma3_layer, native_step.llama_layer
    monkeypatch.setattr(native_step, "_decode_attention", lambda *args: direct_decodes.append(1) or attend(*args))
    monkeypatch.setattr(native_step, "gemma3_layer", lambda *args: planned_layers.append(1) or gemma3(*args))
    monkeypatch.setattr(native_step, "llama_layer", lambda *args: planned_layers.append(1) or llama(*args))
    runs = []
    for planned in (True, False):
        monkeypatch.setattr(native_step, "ENABLED", planned)
        planned_layers.clear(), direct_decodes.clear()
        engine = lean_engine(arch, KernelSettings(native_norm=True), dtype=dtype)
        with op_calls() as calls:
            runs.append(run(engine, arch_for_requests(arch)))
        assert bool(planned_layers) == planned and bool(direct_decodes) == planned  # the plan ran, or only the ops
        if arch == "gemma3":
            assert bool(calls["tgi_vlm::gemma_rms_norm_add"]) == planned
    assert_identical_runs(*runs)


def test_gemma3_layers_with_soft_capped_attention_keep_transformers_forward():
    """The lean attention has no soft-capping: a Gemma 3 config that sets attn_logit_softcapping keeps transformers'
    layer (whose attention applies it)."""
    from tgi_vlm.layers.cpu_decoder import install_lean_layers

    engine = load_engine("gemma3")
    language_model = engine.language_model
    remove_lean_layers(language_model)
    for layer in language_model.modules():
        if hasattr(layer, "self_attn"):
            layer.self_attn.config.attn_logit_softcapping = 50.0
    assert install_lean_layers(language_model) == 0
