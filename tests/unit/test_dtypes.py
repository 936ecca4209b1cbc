"""The default dtype rule (tgi_vlm.dtypes), branch by branch, with the CPU's capability injected."""

from __future__ import annotations

import types

import pytest
import torch

from tgi_vlm import dtypes
from tgi_vlm.dtypes import checkpoint_dtype, cpu_has_native_bf16, cpuinfo_has_native_bf16, resolve_dtype


@pytest.mark.parametrize("requested", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize(("device", "has_bf16"), [("cpu", True), ("cpu", False), ("cuda", False), ("cuda:1", True)])
def test_a_requested_dtype_wins_on_every_device(requested, device, has_bf16):
    choice = resolve_dtype(requested, device, "bfloat16", has_bf16, "qwen2_vl")
    assert (choice.name, choice.reason) == (requested, "--dtype")


def test_an_unknown_requested_dtype_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"dtype 'float64' is not supported; choose one of float32, bfloat16, float16"):
        resolve_dtype("float64", "cpu", None, True)


@pytest.mark.parametrize("stored", ["float32", "bfloat16", "float16", None])
def test_a_cpu_with_native_bf16_runs_any_checkpoint_in_bfloat16(stored):
    choice = resolve_dtype(None, "cpu", stored, True, "llama")
    assert choice.name == "bfloat16"
    assert choice.reason.startswith("CPU has native bf16 (AMX / AVX512-BF16); ")
    assert choice.reason.endswith(f"{stored} checkpoint" if stored else "checkpoint of unstated dtype")


@pytest.mark.parametrize("stored", ["float32", "bfloat16", "float16", None])
def test_a_cpu_without_native_bf16_runs_any_checkpoint_in_float32(stored):
    choice = resolve_dtype(None, "cpu", stored, False, "llama")
    assert choice.name == "float32" and choice.reason.startswith("CPU has no native bf16")


@pytest.mark.parametrize(("model_type", "expected"), [
    ("qwen2_vl", "bfloat16"), ("qwen2_5_vl", "bfloat16"), ("idefics3", "bfloat16"), ("smolvlm", "bfloat16"),
    ("paligemma", "bfloat16"), ("gemma3", "bfloat16"), ("gemma3_text", "bfloat16"), ("gemma2", "bfloat16"),
    ("llama4", "bfloat16"),
    ("llava_next", "float16"), ("idefics2", "float16"), ("llama", "float16"), ("mistral", "float16"),
    ("qwen2", "float16"), ("phi3", "float16"), ("gpt2", "float16"),
])
def test_on_a_gpu_the_default_is_tgis_per_architecture_whatever_the_checkpoint(model_type, expected):
    for stored in ("float32", "bfloat16", "float16"):
        choice = resolve_dtype(None, "cuda", stored, cpu_has_bf16=True, model_type=model_type)
        assert (choice.name, choice.reason) == (expected, f"TGI's default for model type {model_type} on a GPU")


def test_the_checkpoint_dtype_is_the_configs_else_its_text_configs():
    text = types.SimpleNamespace(dtype=torch.bfloat16)
    assert checkpoint_dtype(types.SimpleNamespace(dtype=torch.float16, text_config=text)) == "float16"
    assert checkpoint_dtype(types.SimpleNamespace(dtype=None, text_config=text)) == "bfloat16"
    assert checkpoint_dtype(types.SimpleNamespace(dtype="float32")) == "float32"  # a name, as some configs keep it
    assert checkpoint_dtype(types.SimpleNamespace(dtype=None, text_config=None)) is None
    assert checkpoint_dtype(types.SimpleNamespace()) is None


CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu vme sse sse2 avx2 avx512f avx512bw {extra}
bugs\t\t: spectre_v1

processor\t: 1
flags\t\t: fpu vme sse sse2 avx2 avx512f avx512bw {extra}
"""


@pytest.mark.parametrize(("extra", "expected"), [
    ("amx_tile amx_bf16 amx_int8 avx512_bf16", True), ("avx512_bf16", True), ("amx_bf16", True),
    ("avx512_fp16 amx_tile", False), ("", False),
])
def test_cpuinfo_flags_name_native_bf16(extra, expected):
    assert cpuinfo_has_native_bf16(CPUINFO.format(extra=extra)) is expected


def test_cpuinfo_without_a_flags_line_means_no_native_bf16():
    assert cpuinfo_has_native_bf16("processor : 0\nmodel name : some ARM core\n") is False
    assert cpuinfo_has_native_bf16("") is False


@pytest.mark.parametrize(("capabilities", "expected"), [
    ({"amx_bf16": True, "avx512_bf16": True}, True), ({"amx_bf16": False, "avx512_bf16": True}, True),
    ({"amx_bf16": True}, True), ({"avx512_bf16": False, "avx512_f": True, "avx2": True}, False), ({}, False),
])
def test_torchs_capability_query_decides_when_torch_has_it(monkeypatch, capabilities, expected):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities, raising=False)
    monkeypatch.setattr(dtypes, "_read_cpuinfo", lambda: pytest.fail("/proc/cpuinfo read although torch answered"))
    assert cpu_has_native_bf16() is expected


@pytest.mark.parametrize(("extra", "expected"), [("amx_bf16", True), ("avx2", False)])
def test_proc_cpuinfo_decides_on_a_torch_without_the_query(monkeypatch, extra, expected):
    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
    monkeypatch.setattr(dtypes, "_read_cpuinfo", lambda: CPUINFO.format(extra=extra))
    assert cpu_has_native_bf16() is expected
