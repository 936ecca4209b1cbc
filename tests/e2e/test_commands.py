"""README's `tiny-model` and `generate` commands (what `make run` runs): a tiny model is written, then
`generate` starts a shard for it as TGI's launcher does and streams one text+image request."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tgi_vlm import cli

pytestmark = pytest.mark.usefixtures("restore_logging")  # tests/conftest.py


def test_tiny_model_then_generate_demo_streams_a_text_and_image_request(tmp_path, monkeypatch):
    monkeypatch.setenv("TGI_VLM_DEVICE", "cpu")
    monkeypatch.setenv("TGI_VLM_CPU_KV_CACHE_GB", "0.05")  # the shard inherits the environment
    model = tmp_path / "tiny-qwen2_vl"
    runner = CliRunner()
    result = runner.invoke(cli.app, ["tiny-model", "--arch", "qwen2_vl", str(model)])
    assert result.exit_code == 0, result.output
    assert {"config.json", "model.safetensors", "processor_config.json"} <= {p.name for p in model.iterdir()}

    result = runner.invoke(cli.app, ["generate", str(model), "--demo", "--max-new-tokens", "4", "--ignore-eos",
                                     "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "tokens: 4 (length)" in lines and any(line.startswith("TTFT: ") for line in lines), result.output
    # --dtype reached the shard it started: its Info says so.
    assert any(line.startswith("shard startup: ") and line.endswith(" s (float32 on cpu)") for line in lines), lines
