"""serve(): socket after load, owner-only socket, graceful SIGTERM; stale socket handling."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from tests.server.fake_model import FakeModel
from tests.server.rpc_harness import make_batch, run, running_shard
from tgi_vlm.config import ServerConfig
from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.pb import generate_pb2_grpc
from tgi_vlm.server.serve import start_server

REPO_ROOT = Path(__file__).parents[2]

# The factory records whether the socket already existed while the model was loading, and
# holds the first forward for a while so SIGTERM arrives while it is in flight.
SHARD_SCRIPT = """
import os, sys, threading
sys.path.insert(0, sys.argv[2])
from tests.server.fake_model import FakeModel
from tgi_vlm.config import ServerConfig
from tgi_vlm.server.serve import serve

def load(config):
    with open(sys.argv[3], "w") as f:
        f.write(str(os.path.exists(config.socket_path())))
    model = FakeModel()
    model.forward_may_finish.clear()
    threading.Timer(3.0, model.forward_may_finish.set).start()
    return model

serve(ServerConfig(model_id="fake", uds_path=sys.argv[1]), load)
"""


@pytest.fixture
def short_dir():
    directory = tempfile.mkdtemp(dir="/tmp", prefix="tv-")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def _wait_for(path: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_serve_binds_after_loading_and_finishes_the_in_flight_call_on_sigterm(short_dir):
    base, marker = f"{short_dir}/s", f"{short_dir}/loaded"
    process = subprocess.Popen([sys.executable, "-c", SHARD_SCRIPT, base, str(REPO_ROOT), marker],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(f"{base}-0", process)
        assert Path(marker).read_text() == "False"
        assert stat.S_IMODE(os.stat(f"{base}-0").st_mode) == 0o600
        with grpc.insecure_channel(f"unix://{base}-0") as channel:
            stub = generate_pb2_grpc.TextGenerationServiceStub(channel)
            stub.Health(pb.HealthRequest(), timeout=10)
            in_flight = stub.Prefill.future(pb.PrefillRequest(batch=make_batch(1, [1])), timeout=30)
            time.sleep(0.5)
            process.send_signal(signal.SIGTERM)
            assert in_flight.result().batch.id == 1
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    assert "Server started at unix://" in stderr
    assert not os.path.exists(f"{base}-0")


def test_a_stale_socket_file_is_replaced(short_dir):
    config = ServerConfig(model_id="fake", uds_path=f"{short_dir}/s")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(config.socket_path())
    stale.close()

    async def scenario():
        server, service = await start_server(config, FakeModel())
        try:
            async with grpc.aio.insecure_channel(config.socket_url()) as channel:
                await generate_pb2_grpc.TextGenerationServiceStub(channel).Health(pb.HealthRequest())
        finally:
            await server.stop(None)
            service.close()

    run(scenario)


def test_a_regular_file_at_the_socket_path_is_not_deleted(short_dir):
    config = ServerConfig(model_id="fake", uds_path=f"{short_dir}/s")
    Path(config.socket_path()).write_text("keep me")

    async def scenario():
        with pytest.raises(FileExistsError, match="not a socket"):
            await start_server(config, FakeModel())

    run(scenario)
    assert Path(config.socket_path()).read_text() == "keep me"


def test_the_harness_socket_is_owner_only():
    async def scenario():
        async with running_shard(FakeModel()) as shard:
            assert stat.S_IMODE(os.stat(shard.config.socket_path()).st_mode) == 0o600

    run(scenario)
