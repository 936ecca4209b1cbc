"""SIGTERM while a forward runs: the in-flight call finishes, then the shard exits 0 and removes its socket."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from tests.conftest import FLOAT32_SHARD_ARGS
from tests.server.test_real_shard import CHECKOUT_PYTHONPATH, LAUNCHER_ENV, _wait_for_socket
from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.pb import generate_pb2_grpc
from tgi_vlm.testing import tiny_model_path
from tgi_vlm.testing.harness import make_batch, make_request


def test_sigterm_during_a_forward_lets_it_finish_then_exits_cleanly():
    directory = tempfile.mkdtemp(dir="/tmp", prefix="tv-")
    base, stdout_path = f"{directory}/s", Path(directory) / "stdout"
    script = Path(sys.executable).parent / "text-generation-server"
    with open(stdout_path, "w") as stdout:
        process = subprocess.Popen(
            [str(script), "serve", str(tiny_model_path("llama")), "--uds-path", base, "--json-output", *FLOAT32_SHARD_ARGS],
            # A grace well above the forward's length, so a busy CI machine cannot cut the forward short.
            env={**os.environ, **LAUNCHER_ENV, "TGI_VLM_CPU_KV_CACHE_GB": "0.2", "TGI_VLM_SHUTDOWN_GRACE_S": "120",
                 "PYTHONPATH": CHECKOUT_PYTHONPATH},
            stdout=stdout, stderr=subprocess.DEVNULL,
        )
    try:
        _wait_for_socket(f"{base}-0", process, stdout_path)
        stub = generate_pb2_grpc.TextGenerationServiceStub(grpc.insecure_channel(f"unix://{base}-0"))
        long_text = "word " * 1500
        batch = make_batch(1, [make_request(i, long_text, max_new_tokens=2) for i in range(48)])
        result: dict = {}

        def call():
            try:
                result["response"] = stub.Prefill(pb.PrefillRequest(batch=batch), timeout=120)
            except grpc.RpcError as exc:
                result["error"] = exc
            result["done_at"] = time.monotonic()

        thread = threading.Thread(target=call)
        thread.start()
        time.sleep(0.3)  # the requests are decoded and the forward is running (it takes seconds)
        signalled_at = time.monotonic()
        process.send_signal(signal.SIGTERM)
        thread.join(120)
        assert "error" not in result, f"in-flight Prefill failed: {result.get('error')}"
        assert result["done_at"] > signalled_at, "the forward ended before SIGTERM: the test proved nothing"
        assert len(result["response"].generations) == 48
        assert process.wait(60) == 0
        assert not os.path.exists(f"{base}-0")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
