"""The CLI as TGI's launcher calls it: accepted flags, refused features, download-weights checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tgi_vlm import cli

runner = CliRunner()
CLEAN_ENV = {"WORLD_SIZE": None, "RANK": None, "MASTER_ADDR": None, "MASTER_PORT": None, "LORA_ADAPTERS": None,
             "TGI_VLM_DEVICE": "cpu", "ATTENTION": None}
RANK_1_OF_2 = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29511"}


pytestmark = pytest.mark.usefixtures("restore_logging")  # tests/conftest.py


@pytest.fixture
def served(monkeypatch) -> list:
    """Configs that reached the server, which is never started."""
    configs: list = []
    monkeypatch.setattr(cli, "run_server", configs.append)
    return configs


def invoke(*args: str, env: dict | None = None):
    return runner.invoke(cli.app, list(args), env={**CLEAN_ENV, **(env or {})})


def model_dir(tmp_path: Path, *files: str) -> Path:
    for name in files:
        (tmp_path / name).write_text("{}")
    return tmp_path


def test_serve_accepts_every_flag_the_launcher_passes(served):
    result = invoke(
        "serve", "/models/m", "--uds-path", "/tmp/tgs", "--logger-level", "WARN", "--json-output",
        "--trust-remote-code", "--dtype", "bfloat16", "--revision", "abc", "--otlp-endpoint", "http://otel:4317",
        "--otlp-service-name", "svc", "--max-input-tokens", "100", "--speculate", "0",
    )
    assert result.exit_code == 0, result.output
    (config,) = served
    assert (config.model_id, config.uds_path, config.json_output, config.max_input_tokens) == (
        "/models/m", "/tmp/tgs", True, 100)
    assert (config.otlp_endpoint, config.otlp_service_name) == ("http://otel:4317", "svc")
    assert (config.engine.dtype, config.engine.revision, config.engine.trust_remote_code) == ("bfloat16", "abc", True)


@pytest.mark.parametrize(("args", "env"), [(["--lora-adapters", "math=/a/m, code@v2"], {}),
                                           ([], {"LORA_ADAPTERS": "math=/a/m,code@v2"})])
def test_serve_takes_the_launchers_lora_adapters_flag_or_env_and_parses_them(served, args, env):
    from tgi_vlm.lora import AdapterSpec

    result = invoke("serve", "/models/m", *args, env=env)
    assert result.exit_code == 0, result.output
    (config,) = served
    assert config.engine.lora_adapters == (AdapterSpec("math", "/a/m"), AdapterSpec("code", None, "v2"))


@pytest.fixture
def loaded(monkeypatch) -> list:
    """(model_id, keyword arguments) of each get_model call made by `serve`: the server loop is replaced by
    a single call of its model factory, get_model by a recorder."""
    import tgi_vlm.models
    import tgi_vlm.server.serve

    calls: list = []
    monkeypatch.setattr(tgi_vlm.models, "get_model", lambda model_id, config, **kwargs: calls.append((model_id, kwargs)))
    monkeypatch.setattr(tgi_vlm.server.serve, "serve", lambda config, factory: factory(config))
    return calls


@pytest.mark.parametrize(("flags", "trusted"), [([], False), (["--trust-remote-code"], True)])
def test_serve_lets_the_loader_run_remote_code_only_with_the_flag(loaded, flags, trusted):
    result = invoke("serve", "/models/m", *flags)
    assert result.exit_code == 0, result.output
    ((model_id, kwargs),) = loaded
    assert model_id == "/models/m" and kwargs["trust_remote_code"] is trusted


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--quantize", "marlin"], {}, "--quantize marlin: Marlin-format checkpoints are not supported (a GPTQ/AWQ "
                                       "checkpoint: --quantize gptq|awq or no flag) (supported: eetq"),
        (["--quantize", "nf5"], {}, "--quantize nf5: not one of TGI's --quantize values"),
        (["--speculate", "-1"], {}, "--speculate -1 must be >= 0"),
        (["--kv-cache-dtype", "fp8_e4m3fn"], {}, "--kv-cache-dtype fp8_e4m3fn is not supported"),
        (["--lora-adapters", "a=x=y"], {}, "--lora-adapters: 'a=x=y' is not id, id=path"),
        ([], {"LORA_ADAPTERS": "c/d,c/d"}, "--lora-adapters: adapter id(s) 'c/d' given more than once"),
        (["--lora-adapters", "a/b", "--sharded"], RANK_1_OF_2, "--lora-adapters with WORLD_SIZE=2: LoRA adapters are "
                                                               "served on one shard only"),
    ],
)
def test_serve_refuses_unsupported_features_with_exit_code_1(served, args, env, message):
    result = invoke("serve", "/models/m", *args, env=env)
    assert result.exit_code == 1
    assert message in result.output
    assert served == []


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        # TGI's serve asserts each of the launcher's four variables under --sharded.
        (["--sharded"], {}, "--sharded needs RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment"),
        (["--sharded"], {**RANK_1_OF_2, "MASTER_PORT": None}, "--sharded needs MASTER_PORT in the environment"),
        # TGI would bind every rank to {uds}-0.
        ([], RANK_1_OF_2, "WORLD_SIZE=2 without --sharded: pass --sharded"),
        (["--sharded"], {**RANK_1_OF_2, "RANK": "2"}, "RANK=2 is outside WORLD_SIZE=2"),
    ],
)
def test_serve_refuses_inconsistent_sharding_with_exit_code_1(served, args, env, message):
    result = invoke("serve", "/models/m", *args, env=env)
    assert result.exit_code == 1
    assert message in result.output
    assert served == []


def test_serve_sharded_takes_rank_and_world_from_the_launchers_environment(served):
    result = invoke("serve", "/models/m", "--uds-path", "/tmp/tgs", "--sharded", env=RANK_1_OF_2)
    assert result.exit_code == 0, result.output
    (config,) = served
    assert (config.sharded, config.rank, config.world_size, config.master_addr, config.master_port) == (
        True, 1, 2, "localhost", 29511)
    assert (config.engine.rank, config.engine.world_size) == (1, 2)
    assert config.socket_url() == "unix:///tmp/tgs-1"


def test_serve_sharded_with_a_world_of_one_is_a_single_shard_as_in_tgi(served):
    result = invoke("serve", "/models/m", "--uds-path", "/tmp/tgs", "--sharded",
                    env={**RANK_1_OF_2, "RANK": "0", "WORLD_SIZE": "1"})
    assert result.exit_code == 0, result.output
    (config,) = served
    assert (config.rank, config.world_size, config.engine.world_size, config.socket_url()) == (
        0, 1, 1, "unix:///tmp/tgs-0")


@pytest.mark.parametrize(("flags", "depth"), [([], 0), (["--speculate", "0"], 0), (["--speculate", "3"], 3)])
def test_serve_passes_the_launchers_speculate_to_the_engine(served, flags, depth):
    result = invoke("serve", "/models/m", *flags)
    assert result.exit_code == 0, result.output
    (config,) = served
    assert config.engine.speculate == depth


def test_serve_errors_are_json_records_with_json_output(served):
    result = invoke("serve", "/models/m", "--json-output", "--quantize", "exl2")
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record["record"]["level"]["name"] == "ERROR"
    assert "--quantize exl2" in record["text"]


def test_serve_refuses_an_unknown_dtype(served):
    result = invoke("serve", "/models/m", "--dtype", "float64")
    assert result.exit_code == 2 and "Invalid value for '--dtype'" in result.output and served == []


def test_serve_refuses_an_unknown_logger_level(served):
    result = invoke("serve", "/models/m", "--logger-level", "LOUD")
    assert result.exit_code == 1 and "LOUD" in result.output


# The rule is a `..` path component, anywhere (README: "model ids with a `..` path component").
@pytest.mark.parametrize("model_id", ["../etc", "org/../x", "/models/../../etc", "..", "../", "a/..", "./..", "~/../x"])
def test_model_ids_with_parent_directory_components_are_refused(model_id, served):
    for command in ("download-weights", "serve"):
        result = invoke(command, model_id)
        assert result.exit_code == 1 and "contains '..'" in result.output
    assert served == []


# Dots that are not a whole component are names, not a way out of a directory.
@pytest.mark.parametrize("model_id", ["a..b", "org/model..v2", "/models/v1..2/m", "org/...", "..a/b", "org/b.."])
def test_model_ids_with_dots_inside_a_component_are_served(model_id, served, tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda **kwargs: str(model_dir(tmp_path, "config.json", "model.safetensors")))
    result = invoke("serve", model_id)
    assert result.exit_code == 0, result.output
    assert [config.model_id for config in served] == [model_id]
    result = invoke("download-weights", model_id)
    assert "contains '..'" not in result.output and (result.exit_code == 0 or "does not exist" in result.output)


def test_download_weights_accepts_a_local_directory_with_config_and_safetensors(tmp_path):
    path = model_dir(tmp_path, "config.json", "model.safetensors")
    result = invoke("download-weights", str(path), "--extension", ".safetensors", "--json-output")
    assert result.exit_code == 0, result.output


def test_download_weights_refuses_a_directory_with_only_pickle_weights(tmp_path):
    path = model_dir(tmp_path, "config.json", "pytorch_model.bin")
    result = invoke("download-weights", str(path))
    assert result.exit_code == 1
    assert "no *.safetensors" in result.output and "pickle .bin weights are not loaded" in result.output


def test_download_weights_refuses_a_directory_without_config(tmp_path):
    result = invoke("download-weights", str(model_dir(tmp_path, "model.safetensors")))
    assert result.exit_code == 1 and "no config.json" in result.output


def test_download_weights_refuses_a_missing_local_directory(tmp_path):
    result = invoke("download-weights", str(tmp_path / "absent"))
    assert result.exit_code == 1 and "does not exist" in result.output


def test_download_weights_refuses_lora_merging_and_other_extensions(tmp_path):
    path = str(model_dir(tmp_path, "config.json", "model.safetensors"))
    assert invoke("download-weights", path, "--merge-lora").exit_code == 1
    assert invoke("download-weights", path, "--extension", ".bin").exit_code == 1


def test_download_weights_fetches_config_tokenizer_and_safetensors_only_from_the_hub(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_snapshot(**kwargs):
        calls.append(kwargs)
        return str(model_dir(tmp_path, "config.json", "model.safetensors"))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    result = invoke("download-weights", "org/model", "--revision", "v1")
    assert result.exit_code == 0, result.output
    (call,) = calls
    assert (call["repo_id"], call["revision"]) == ("org/model", "v1")
    assert "*.safetensors" in call["allow_patterns"] and "*.json" in call["allow_patterns"]
    assert not any(p.endswith((".bin", ".py")) for p in call["allow_patterns"])


def test_download_weights_offline_is_a_clear_error(monkeypatch):
    import huggingface_hub

    def offline(**kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    result = invoke("download-weights", "org/model")
    assert result.exit_code == 1
    assert "could not download 'org/model'" in result.output and "network is unreachable" in result.output


def test_serve_takes_tgis_quantize_eetq_into_the_engine_config(served):
    result = invoke("serve", "/models/m", "--quantize", "eetq")
    assert result.exit_code == 0, result.output
    assert [c.engine.quantize for c in served] == ["eetq"]
    invoke("serve", "/models/m")
    assert served[-1].engine.quantize is None


@pytest.mark.parametrize("command", [["generate", "/models/m", "--prompt", "hi"], ["launch", "/models/m"],
                                     ["bench", "/models/m", "--no-hf"]])
def test_generate_launch_and_bench_check_lora_adapters_before_starting_anything(command):
    result = invoke(*command, "--lora-adapters", "a=x=y")
    assert result.exit_code == 1
    assert "--lora-adapters: 'a=x=y' is not id, id=path" in result.output


def test_bench_refuses_the_transformers_reference_with_lora_adapters():
    result = invoke("bench", "/models/m", "--lora-adapters", "a=/x")
    assert result.exit_code == 1
    assert "the transformers reference runs the base model only; pass --no-hf" in result.output
