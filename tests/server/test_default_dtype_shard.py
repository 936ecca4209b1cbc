"""`serve` without --dtype, as TGI's launcher starts it when the user gives none: the shard runs this CPU's
default (bfloat16 where the CPU has native bf16, as this project's machines do; else float32), says why in its
log, and reports it in Info."""

from __future__ import annotations

import json

import grpc

from tests.server.test_real_shard import CHECKOUT_PYTHONPATH
from tgi_vlm.dtypes import cpu_has_native_bf16
from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.pb import generate_pb2_grpc
from tgi_vlm.router import ShardProcess
from tgi_vlm.testing import tiny_model_path

ENV = {"TGI_VLM_CPU_KV_CACHE_GB": "0.05", "TGI_VLM_DEVICE": "cpu", "PYTHONPATH": CHECKOUT_PYTHONPATH}


def test_serve_without_dtype_runs_reports_and_logs_the_cpus_default():
    has_bf16 = cpu_has_native_bf16()
    expected = "bfloat16" if has_bf16 else "float32"
    with ShardProcess(str(tiny_model_path("llama")), env=ENV) as shard:  # no --dtype
        with grpc.insecure_channel(f"unix://{shard.socket}") as channel:
            info = generate_pb2_grpc.TextGenerationServiceStub(channel).Info(pb.InfoRequest(), timeout=30)
        log = [json.loads(line) for line in shard.log_paths[0].read_text().splitlines() if line.startswith("{")]
    assert (info.dtype, info.device_type) == (expected, "cpu")
    reason = "CPU has native bf16" if has_bf16 else "CPU has no native bf16"
    messages = [record["record"]["message"] for record in log]
    assert f"dtype {expected} ({reason} (AMX / AVX512-BF16); float32 checkpoint)" in messages, messages
