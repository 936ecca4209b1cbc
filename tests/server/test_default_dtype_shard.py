"""`serve` without --dtype, as TGI's launcher starts it when the user gives none: the shard runs this CPU's
default (bfloat16 where the CPU has native bf16, as this project's machines do; else float32), says why in its
log, and reports it in Info."""

from __future__ import annotations

import json

import grpc

from tests.conftest import load_engine
from tests.server.test_real_shard import CHECKOUT_PYTHONPATH, Blocks, Session, routed
from tgi_vlm.dtypes import cpu_has_native_bf16
from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.pb import generate_pb2_grpc
from tgi_vlm.router import ShardProcess
from tgi_vlm.testing import tiny_model_path
from tgi_vlm.testing.harness import Runner, make_batch, make_request

PROMPTS = {1: "the cat sat on the mat", 2: "a picture of a red house near the sea, far left"}
ENV = {"TGI_VLM_CPU_KV_CACHE_GB": "0.05", "TGI_VLM_DEVICE": "cpu", "PYTHONPATH": CHECKOUT_PYTHONPATH}


def test_serve_without_dtype_runs_reports_and_logs_the_cpus_default():
    has_bf16 = cpu_has_native_bf16()
    expected = "bfloat16" if has_bf16 else "float32"
    with ShardProcess(str(tiny_model_path("llama")), env=ENV) as shard:  # no --dtype
        with grpc.insecure_channel(f"unix://{shard.socket}") as channel:
            stub = generate_pb2_grpc.TextGenerationServiceStub(channel)
            info = stub.Info(pb.InfoRequest(), timeout=30)
            # Served in that dtype: the shard's model thread (where layers/cpu.py packs bf16 weights on
            # first use) gives the tokens the same engine gives in this process.
            session, blocks = Session(stub), Blocks()
            session.prefill(make_batch(1, [routed(blocks, rid, text, 8) for rid, text in PROMPTS.items()]))
            session.run()
        log = [json.loads(line) for line in shard.log_paths[0].read_text().splitlines() if line.startswith("{")]
    runner = Runner(load_engine("llama", dtype=expected))
    runner.prefill([make_request(rid, text, max_new_tokens=8) for rid, text in PROMPTS.items()])
    runner.run()
    assert session.tokens == dict(runner.tokens) and all(len(t) == 8 for t in session.tokens.values())
    assert (info.dtype, info.device_type) == (expected, "cpu")
    reason = "CPU has native bf16" if has_bf16 else "CPU has no native bf16"
    messages = [record["record"]["message"] for record in log]
    assert f"dtype {expected} ({reason} (AMX / AVX512-BF16); float32 checkpoint)" in messages, messages
