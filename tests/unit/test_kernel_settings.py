"""KernelSettings (config.py): read from the environment in one place, carried by EngineConfig; each native kernel
follows its own switch (the norm off while decode attention is on, and the reverse), counted per op in the
profiler over a real engine's prefill and two decode steps."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tests.conftest import load_engine
from tests.unit.kernels_here import kernels, op_calls
from tgi_vlm.config import EngineConfig, KernelSettings, default_kernel_cache
from tgi_vlm.testing.harness import Runner, make_request


def test_every_kernel_is_on_by_default_and_built_under_the_home_cache():
    settings = KernelSettings.from_env({})
    assert settings == KernelSettings(True, True, True, True, True, default_kernel_cache(), None)
    assert default_kernel_cache() == Path.home() / ".cache" / "tgi-vlm" / "kernels"


def test_each_variable_sets_its_own_field():
    env = {"TGI_VLM_NATIVE_ATTENTION": "0", "TGI_VLM_NATIVE_NORM": "0", "TGI_VLM_NATIVE_ROTARY": "false",
           "TGI_VLM_SKINNY_LINEAR": "no", "TGI_VLM_CPU_SPEEDUPS": "0", "TGI_VLM_KERNEL_CACHE": "/k", "CC": "ccache gcc"}
    assert KernelSettings.from_env(env) == KernelSettings(False, False, False, False, False, Path("/k"), "ccache gcc")
    for name, field in (("TGI_VLM_NATIVE_ATTENTION", "native_attention"), ("TGI_VLM_NATIVE_NORM", "native_norm"),
                        ("TGI_VLM_NATIVE_ROTARY", "native_rotary"), ("TGI_VLM_SKINNY_LINEAR", "skinny_linear"),
                        ("TGI_VLM_CPU_SPEEDUPS", "cpu_speedups")):
        assert KernelSettings.from_env({name: "0"}) == replace(KernelSettings(), **{field: False}), name


def test_the_engine_config_carries_them_and_decode_attention_is_for_cpu_only():
    assert EngineConfig.from_env({"TGI_VLM_NATIVE_NORM": "0"}, device="cpu").kernels.native_norm is False
    assert EngineConfig.from_env({}, device="cpu").native_attention_on
    assert not EngineConfig.from_env({}, device="cuda").native_attention_on
    assert not EngineConfig.from_env({"TGI_VLM_NATIVE_ATTENTION": "1"}, device="cuda").native_attention_on
    assert not EngineConfig.from_env({"TGI_VLM_NATIVE_ATTENTION": "0"}, device="cpu").native_attention_on


def _calls_over_three_steps(settings: KernelSettings) -> tuple[dict, int]:
    engine = load_engine("qwen2", kernels=settings)
    runner = Runner(engine)
    with op_calls() as calls:
        runner.prefill([make_request(0, "the cat sat on the mat", max_new_tokens=3)])
        runner.run()
    return dict(calls), engine.language_model.config.num_hidden_layers


@pytest.mark.parametrize("switched_off", ["none", "native_norm", "native_attention", "native_rotary"])
def test_each_kernel_follows_its_own_setting(switched_off):
    """A prefill and two decode steps: per layer two norms a step, one rotary + store a step, one decode attention
    a decode step; a kernel switched off is not called, the others are (where they load here)."""
    settings = KernelSettings() if switched_off == "none" else replace(KernelSettings(), **{switched_off: False})
    calls, layers = _calls_over_three_steps(settings)
    here = kernels()
    expected = {
        "tgi_vlm::rms_norm": 6 * layers if settings.native_norm and here.available("rms_norm") else 0,
        "tgi_vlm::rotary_and_store": 3 * layers if settings.native_rotary and here.available("rotary_and_store") else 0,
        "tgi_vlm::decode_attention": (2 * layers if settings.native_attention and here.available("decode_attention")
                                      else 0),
    }
    assert {op: calls.get(op, 0) for op in expected} == expected
