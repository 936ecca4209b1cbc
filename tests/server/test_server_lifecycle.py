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
sys.path[:0] = [sys.argv[2] + "/src", sys.argv[2]]  # this checkout's tgi_vlm and tests
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


def test_the_socket_is_owner_only_from_the_moment_it_is_bound_even_under_umask_0(short_dir, monkeypatch):
    """No window in which another user could connect: the socket is 0600 when bound, before any chmod,
    however permissive the process umask (0 here: a socket bound without care would be 0777). The
    process umask is restored afterwards."""
    config = ServerConfig(model_id="fake", uds_path=f"{short_dir}/s")
    path = config.socket_path()
    before_chmod: list[int] = []
    real_chmod = os.chmod

    def chmod(target, mode, *args, **kwargs):
        if os.fspath(target) == path:
            before_chmod.append(stat.S_IMODE(os.stat(path).st_mode))
        return real_chmod(target, mode, *args, **kwargs)

    monkeypatch.setattr(os, "chmod", chmod)
    previous = os.umask(0)
    try:
        async def scenario():
            server, service = await start_server(config, FakeModel())
            try:
                umask_after = os.umask(0)
                final = stat.S_IMODE(os.stat(path).st_mode)
                assert stat.S_ISSOCK(os.stat(path).st_mode)
                assert (before_chmod or [final])[0] == 0o600, "the socket was group/world accessible when bound"
                assert final == 0o600
                assert umask_after == 0, "start_server left its umask on the process"
            finally:
                await server.stop(None)
                service.close()

        run(scenario)
    finally:
        os.umask(previous)
