"""ShardProcess as TGI's launcher: N ranks with RANK/WORLD_SIZE/MASTER_*; ready when every rank's socket is
bound; a rank that dies takes the others down, and its log's tail says why. Stand-in ranks (a few lines
of Python binding a unix socket) replace the model server."""

from __future__ import annotations

import signal
import socket
import sys
import time

import pytest

from tgi_vlm.router.shard import LAUNCHER_ENV, ShardProcess

# argv: uds base. RANK from the environment; FAKE_<rank> says what that rank does:
# "serve" binds {base}-{rank} and waits; "fail:<code>:<message>" prints the message and exits before binding;
# "die:<code>:<message>" binds, then exits after a moment.
FAKE_RANK = """
import os, socket, sys, time
rank = os.environ["RANK"]
what = os.environ["FAKE_" + rank].split(":")
if what[0] == "fail":
    print(what[2], flush=True)
    sys.exit(int(what[1]))
server = socket.socket(socket.AF_UNIX)
server.bind(sys.argv[1] + "-" + rank)
server.listen()
if what[0] == "die":
    time.sleep(0.5)
    print(what[2], flush=True)
    sys.exit(int(what[1]))
time.sleep(600)
"""


def fake_shard(num_shard: int, **ranks: str) -> ShardProcess:
    env = {f"FAKE_{rank.removeprefix('rank')}": what for rank, what in ranks.items()}
    shard = ShardProcess("model", num_shard=num_shard, env=env, startup_timeout_s=60)
    shard.args = [sys.executable, "-c", FAKE_RANK, shard.uds_path]
    return shard


def test_ranks_get_the_launchers_flags_and_environment_with_a_free_master_port():
    sharded = ShardProcess("/models/m", num_shard=2, extra_args=["--dtype", "float32"])
    assert sharded.args[1:] == ["serve", "/models/m", "--uds-path", sharded.uds_path, "--logger-level", "INFO",
                                "--json-output", "--sharded", "--dtype", "float32"]
    assert (sharded.env["WORLD_SIZE"], sharded.env["MASTER_ADDR"]) == ("2", "localhost")
    port = int(sharded.env["MASTER_PORT"])
    with socket.socket() as probe:  # nothing listens there: the first rank can host the rendezvous
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    assert sharded.sockets == [f"{sharded.uds_path}-0", f"{sharded.uds_path}-1"] and sharded.socket.endswith("-0")
    single = ShardProcess("/models/m")
    assert "--sharded" not in single.args and single.env["WORLD_SIZE"] == "1"
    assert single.env["MASTER_PORT"] == LAUNCHER_ENV["MASTER_PORT"]
    given = ShardProcess("/models/m", num_shard=2, env={"MASTER_PORT": "31001"})
    assert given.env["MASTER_PORT"] == "31001"
    with pytest.raises(ValueError, match="num_shard=0"):
        ShardProcess("/models/m", num_shard=0)


def test_ready_once_every_rank_is_bound_and_stopped_together():
    shard = fake_shard(3, rank0="serve", rank1="serve", rank2="serve").start()
    try:
        assert all(process.poll() is None for process in shard.processes)
    finally:
        code = shard.stop()
    assert code == -signal.SIGTERM  # the stand-ins do not handle SIGTERM
    assert [process.returncode for process in shard.processes] == [-signal.SIGTERM] * 3


def test_a_rank_that_dies_while_starting_stops_the_others_and_its_log_tail_is_the_error():
    shard = fake_shard(2, rank0="serve", rank1="fail:3:weights are missing")
    with pytest.raises(RuntimeError) as caught:
        shard.start()
    message = str(caught.value)
    assert message.startswith(f"shard rank 1 exited with code 3 before binding {shard.uds_path}-1")
    assert "shard-1.log" in message and "weights are missing" in message
    assert shard.processes[0].returncode == -signal.SIGTERM


def test_a_rank_that_dies_while_serving_stops_the_others_and_says_why():
    shard = fake_shard(2, rank0="serve", rank1="die:4:lost the device").start()
    try:
        deadline = time.monotonic() + 30
        while shard.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert shard.failure is not None and shard.failure.startswith("shard rank 1 exited with code 4 while serving")
        assert "lost the device" in shard.failure
        assert shard.processes[0].wait(30) == -signal.SIGTERM
    finally:
        shard.stop()
