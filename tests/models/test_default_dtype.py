"""What runs when no dtype is asked for: get_model resolves tgi_vlm.dtypes' rule against the checkpoint, with the
CPU's bf16 capability injected both ways (so this runs on any CPU). The weights, the KV cache, Info's dtype
and the startup log line all say the same."""

from __future__ import annotations

import pytest
import torch
from loguru import logger
from transformers import AutoModelForCausalLM, AutoTokenizer

import tgi_vlm.models
from tgi_vlm.config import EngineConfig
from tgi_vlm.models import get_model
from tgi_vlm.testing import tiny_model_path


@pytest.fixture
def log_lines():
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(message.record["message"]), level="INFO")
    yield lines
    logger.remove(sink)


def load_default(path, monkeypatch, has_bf16: bool):
    monkeypatch.setattr(tgi_vlm.models, "cpu_has_native_bf16", lambda: has_bf16)
    return get_model(str(path), EngineConfig(device="cpu", cpu_kv_cache_bytes=1 << 20))  # no dtype


def dtypes_in(engine) -> set[torch.dtype]:
    return {p.dtype for p in engine.model.parameters()}


@pytest.mark.parametrize(("arch", "has_bf16", "expected"), [
    ("llama", True, torch.bfloat16), ("llama", False, torch.float32),
    ("qwen2_vl", True, torch.bfloat16), ("qwen2_vl", False, torch.float32),
])
def test_a_float32_checkpoint_runs_in_bf16_exactly_when_the_cpu_has_native_bf16(monkeypatch, log_lines, arch,
                                                                                 has_bf16, expected):
    engine = load_default(tiny_model_path(arch), monkeypatch, has_bf16)
    name = str(expected).removeprefix("torch.")
    assert dtypes_in(engine) == {expected}
    assert engine.kv_spec.dtype == expected
    assert engine.info().dtype == name
    reason = "CPU has native bf16" if has_bf16 else "CPU has no native bf16"
    assert f"dtype {name} ({reason} (AMX / AVX512-BF16); float32 checkpoint)" in log_lines


@pytest.fixture(scope="module")
def float16_llama(tmp_path_factory):
    """The tiny llama stored in float16 (its config says so)."""
    source = tiny_model_path("llama")
    out = tmp_path_factory.mktemp("llama-fp16")
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.float16).save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


@pytest.mark.parametrize(("has_bf16", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_a_float16_checkpoint_on_a_cpu_runs_in_bf16_or_float32_never_float16(monkeypatch, log_lines, float16_llama,
                                                                              has_bf16, expected):
    engine = load_default(float16_llama, monkeypatch, has_bf16)
    assert dtypes_in(engine) == {expected}
    assert any(line.startswith("dtype ") and line.endswith("; float16 checkpoint)") for line in log_lines), log_lines


def test_an_explicit_dtype_is_kept_whatever_the_cpu(monkeypatch, log_lines):
    monkeypatch.setattr(tgi_vlm.models, "cpu_has_native_bf16", lambda: True)
    engine = get_model(str(tiny_model_path("llama")), EngineConfig(device="cpu", dtype="float32",
                                                                    cpu_kv_cache_bytes=1 << 20))
    assert dtypes_in(engine) == {torch.float32} and engine.info().dtype == "float32"
    assert "dtype float32 (--dtype)" in log_lines
