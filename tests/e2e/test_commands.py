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


def test_generate_with_a_video_file_streams_transformers_tokens(tmp_path, monkeypatch):
    from tests.models.video_reference import reference_model, video_reference
    from tgi_vlm.media import VideoBytes
    from tgi_vlm.testing import tiny_model_path
    from tgi_vlm.video import encode_clip, make_test_frames

    monkeypatch.setenv("TGI_VLM_DEVICE", "cpu")
    monkeypatch.setenv("TGI_VLM_CPU_KV_CACHE_GB", "0.05")
    clip = encode_clip(make_test_frames(4, 56, 42, seed=3), 2.0, codec="h264", container="mp4")
    (tmp_path / "clip.mp4").write_bytes(clip)
    model = str(tiny_model_path("qwen2_vl"))
    result = CliRunner().invoke(cli.app, ["generate", model, "--video", str(tmp_path / "clip.mp4"), "--prompt",
                                          "What happens?", "--max-new-tokens", "4", "--ignore-eos", "--dtype",
                                          "float32", "--no-prefix-caching"])
    assert result.exit_code == 0, result.output
    want = video_reference("qwen2_vl", (VideoBytes(clip), "What happens?"), 4).ids
    tokenizer = reference_model("qwen2_vl")[1].tokenizer
    lines = result.output.splitlines()
    streamed = lines[lines.index("tokens: 4 (length)") - 1]
    # the stream holds back a trailing incomplete UTF-8 sequence (shown as U+FFFD by a plain decode)
    assert streamed == tokenizer.decode(want).rstrip("\ufffd"), (streamed, tokenizer.decode(want))
