"""`generate`, `launch` and `bench` take `--dtype` like `serve` and hand it to the shard they start (only when
given, as TGI's launcher does); `bench`'s transformers reference runs in the shard's dtype. The commands stop
at the recorders that stand in for the shard side. (test_commands.py and test_launch.py check that the flag
reaches a real shard: its Info's dtype.)"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tgi_vlm import cli
from tgi_vlm.benchmarking.references import transformers as reference
from tgi_vlm.benchmarking.references.transformers import reference_dtype
from tgi_vlm.benchmarking.results import ReferenceResult, RequestResult, ServingResult
from tgi_vlm.benchmarking.targets.driver import DriverTarget
from tgi_vlm.testing import tiny_model_path

runner = CliRunner()


pytestmark = pytest.mark.usefixtures("restore_logging")  # tests/conftest.py


class Recorded(Exception):
    """Raised by a recorder: the command goes no further (it reports a failure, which is not under test)."""


@pytest.mark.parametrize(("flags", "shard_args"), [([], []), (["--dtype", "bfloat16"], ["--dtype", "bfloat16"])])
def test_generate_passes_dtype_to_the_shard(monkeypatch, flags, shard_args):
    import tgi_vlm.router.generate

    calls = []

    async def record(model_id, params, **kwargs):
        calls.append(kwargs["shard_args"])
        raise RuntimeError("recorded")

    monkeypatch.setattr(tgi_vlm.router.generate, "generate", record)
    result = runner.invoke(cli.app, ["generate", "/models/m", "--prompt", "hi", *flags])
    assert calls == [shard_args], result.output


@pytest.mark.parametrize(("flags", "shard_args"), [([], ["--max-input-tokens", "2047"]),
                                                   (["--dtype", "float32"], ["--max-input-tokens", "2047", "--dtype", "float32"])])
def test_launch_passes_dtype_to_the_shard(monkeypatch, flags, shard_args):
    import tgi_vlm.api.launch

    configs = []

    async def record(config):
        configs.append(config)

    monkeypatch.setattr(tgi_vlm.api.launch, "launch", record)
    result = runner.invoke(cli.app, ["launch", "/models/m", *flags])
    assert result.exit_code == 0, result.output
    assert [c.shard_args for c in configs] == [shard_args]


BENCH = ["--num-requests", "2", "--concurrency", "1", "--image-min", "28", "--image-max", "28", "--prompt-max", "16",
         "--output-min", "1", "--output-max", "2"]


def serving_result(dtype: str | None) -> ServingResult:
    return ServingResult(1.0, [RequestResult([1], 0.0, [0.5]), RequestResult([2], 0.0, [0.5])], [], {}, dtype=dtype)


@pytest.mark.parametrize(("flags", "shard_args"), [([], ()), (["--dtype", "float32"], ("--dtype", "float32"))])
def test_bench_passes_dtype_to_the_shard_and_runs_the_reference_in_the_shards_dtype(monkeypatch, tmp_path, flags,
                                                                                    shard_args):
    served, referenced = [], []

    async def run(target, load, **kwargs):
        served.append(target.shard_args)
        return serving_result("bfloat16" if not flags else "float32")

    def run_reference(model_id, items, batch_size, progress=None, dtype="float32"):
        referenced.append(dtype)
        return ReferenceResult(1.0, [[1], [2]], [1.0], dtype)

    monkeypatch.setattr(DriverTarget, "run", run)
    monkeypatch.setattr(reference, "run_reference", run_reference)
    model = str(tiny_model_path("qwen2_vl"))
    result = runner.invoke(cli.app, ["bench", model, *BENCH, *flags, "--out-dir", str(tmp_path), "--name", "r"])
    assert result.exit_code == 0, result.output
    expected = "float32" if flags else "bfloat16"  # what the (recorded) shard reported
    assert (served, referenced) == ([shard_args], [expected])
    assert f"dtype: tgi-vlm {expected}, transformers {expected}" in result.output.splitlines()


def test_bench_prefix_workloads_pass_dtype_to_both_shards(monkeypatch, tmp_path):
    calls = []

    async def run(target, load, *, prefix_caching=None, **kwargs):
        calls.append((prefix_caching, target.shard_args))
        if len(calls) == 2:
            raise Recorded
        return serving_result("bfloat16")

    monkeypatch.setattr(DriverTarget, "run", run)
    result = runner.invoke(cli.app, ["bench", str(tiny_model_path("qwen2_vl")), "--workload", "shared-prefix",
                                     "--dtype", "bfloat16", *BENCH, "--out-dir", str(tmp_path)])
    assert isinstance(result.exception, Recorded)
    assert calls == [(False, ("--dtype", "bfloat16")), (True, ("--dtype", "bfloat16"))]


def test_the_reference_dtype_is_the_shards_else_the_flag_else_this_cpus_default(monkeypatch):
    import tgi_vlm.dtypes

    model = str(tiny_model_path("qwen2_vl"))  # a float32 checkpoint
    assert reference_dtype(model, "bfloat16", "float32") == "bfloat16"  # the shard said (its Info)
    assert reference_dtype(model, None, "float16") == "float16"  # over HTTP: what bench --dtype says it runs
    for has_bf16, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(tgi_vlm.dtypes, "cpu_has_native_bf16", lambda has=has_bf16: has)
        assert reference_dtype(model, None, None) == expected
