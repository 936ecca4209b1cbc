"""Two ranks of `serve --sharded` in a real gloo process group, each forward meeting the other rank in
an all-reduce (as tensor-parallel layers do), with a fake engine: how a rank ends when its peer goes.

- a peer leaving while this rank waits for it in a collective: gloo fails the collective, the call
  gets INTERNAL, this rank sees the peer's socket removed and stops too; both exit 0;
- a model thread that never comes back (a collective NCCL would wait in until its own timeout):
  SIGTERM ends the rank after the grace periods with exit code 1, and its peer follows (exit 0);
- a peer killed outright: its socket stays but refuses connections; this rank stops with exit code 1.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest

from tests.server.rpc_harness import make_batch
from tgi_vlm.pb import generate_pb2 as pb
from tgi_vlm.pb import generate_pb2_grpc
from tgi_vlm.router.shard import free_port

REPO_ROOT = Path(__file__).parents[2]
EXIT_BOUND_S = 60  # far above what any of these needs; only a hang reaches it

# argv: repo root, uds base, mode ("collective" | "stuck"), marker file written when a forward starts.
RANK_SCRIPT = """
import sys, threading
sys.path[:0] = [sys.argv[1] + "/src", sys.argv[1]]  # this checkout's tgi_vlm and tests
import torch, torch.distributed as dist, typer
from tests.server.fake_model import FakeModel
from tgi_vlm import cli
from tgi_vlm.config import EngineConfig, ServerConfig

class CollectiveModel(FakeModel):
    def generate_token(self, batch):
        open(sys.argv[4], "w").close()
        if sys.argv[3] == "stuck":
            threading.Event().wait()  # never returns, as a collective whose peer is gone under NCCL
        dist.all_reduce(torch.ones(1))
        return super().generate_token(batch)

cli.load_model = lambda config: CollectiveModel()
try:
    cli.run_server(ServerConfig.from_env("fake", uds_path=sys.argv[2], sharded=True, engine=EngineConfig()))
except typer.Exit as exc:
    sys.exit(exc.exit_code)
"""


class Pair:
    def __init__(self, mode: str):
        self.directory = tempfile.mkdtemp(dir="/tmp", prefix="tv-")
        self.base = f"{self.directory}/s"
        self.logs = [Path(self.directory) / f"rank{rank}.log" for rank in range(2)]
        self.markers = [Path(self.directory) / f"forward{rank}" for rank in range(2)]
        launcher_env = {"WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": str(free_port()),
                        "TGI_VLM_SHUTDOWN_GRACE_S": "1", "TGI_VLM_DIST_TIMEOUT_S": "60"}
        self.processes = []
        for rank in range(2):
            with open(self.logs[rank], "w") as log:
                self.processes.append(subprocess.Popen(
                    [sys.executable, "-c", RANK_SCRIPT, str(REPO_ROOT), self.base, mode, str(self.markers[rank])],
                    env={**os.environ, **launcher_env, "RANK": str(rank)}, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 120
        # Ready when each rank has seen the other up: a peer watch notices a leaving rank only once it
        # saw it up (server/peers.py), so a rank stopped before that would leave its peer running.
        while not all(f"peer rank {1 - rank} is up" in self.logs[rank].read_text() for rank in range(2)):
            assert all(p.poll() is None for p in self.processes), self.log_text()
            assert time.monotonic() < deadline, f"the ranks did not see each other up:\n{self.log_text()}"
            time.sleep(0.05)

    def stub(self, rank: int) -> generate_pb2_grpc.TextGenerationServiceStub:
        return generate_pb2_grpc.TextGenerationServiceStub(grpc.insecure_channel(f"unix://{self.base}-{rank}"))

    def prefill_in_background(self, rank: int) -> dict:
        """A Prefill sent to `rank` alone (its peer never joins the forward's collective)."""
        result: dict = {}
        stub = self.stub(rank)

        def call():
            try:
                result["response"] = stub.Prefill(pb.PrefillRequest(batch=make_batch(1, [1, 2])), timeout=EXIT_BOUND_S)
            except grpc.RpcError as exc:
                result["error"] = exc

        result["thread"] = threading.Thread(target=call)
        result["thread"].start()
        deadline = time.monotonic() + 30
        while not self.markers[rank].exists():  # the forward has started
            assert time.monotonic() < deadline, self.log_text()
            time.sleep(0.02)
        return result

    def exit_codes(self) -> list[int]:
        try:
            return [process.wait(EXIT_BOUND_S) for process in self.processes]
        except subprocess.TimeoutExpired:
            raise AssertionError(f"a rank is still running after {EXIT_BOUND_S} s:\n{self.log_text()}") from None

    def log_text(self, rank: int | None = None) -> str:
        ranks = range(2) if rank is None else [rank]
        return "\n".join(f"--- rank {r}:\n{self.logs[r].read_text()[-3000:]}" for r in ranks)

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


@pytest.fixture
def pair(request):
    pairs: list[Pair] = []

    def start(mode: str) -> Pair:
        pairs.append(Pair(mode))
        return pairs[-1]

    yield start
    for started in pairs:
        started.close()


def test_a_peer_leaving_fails_the_collective_waiting_for_it_and_both_ranks_exit_cleanly(pair):
    ranks = pair("collective")
    call = ranks.prefill_in_background(0)
    ranks.processes[1].send_signal(signal.SIGTERM)
    assert ranks.exit_codes() == [0, 0], ranks.log_text()
    call["thread"].join(EXIT_BOUND_S)
    assert call["error"].code() == grpc.StatusCode.INTERNAL, call["error"]
    assert "Connection closed by peer" in call["error"].details()
    assert "rank 1 shut down" in ranks.log_text(0)
    for rank in range(2):
        assert f"rank {rank} left the process group" in ranks.log_text(rank)
        assert not os.path.exists(f"{ranks.base}-{rank}")


def test_a_model_thread_that_never_returns_does_not_hold_the_rank_after_sigterm(pair):
    ranks = pair("stuck")
    call = ranks.prefill_in_background(0)
    ranks.processes[0].send_signal(signal.SIGTERM)
    assert ranks.exit_codes() == [1, 0], ranks.log_text()
    assert "the model thread is still busy" in ranks.log_text(0)
    assert "rank 0 shut down" in ranks.log_text(1)
    call["thread"].join(EXIT_BOUND_S)
    assert "error" in call and not os.path.exists(f"{ranks.base}-0")


def test_a_peer_killed_outright_stops_the_other_rank_with_exit_code_1(pair):
    ranks = pair("collective")
    ranks.processes[1].kill()
    assert ranks.exit_codes() == [1, -signal.SIGKILL], ranks.log_text()
    assert f"rank 0 stopped: rank 1 died ({ranks.base}-1 refuses connections)" in ranks.log_text(0)
