"""Start a shard's ranks the way TGI's launcher does, and stop them the same way (SIGTERM, then wait).

Rank r runs `text-generation-server serve MODEL --uds-path BASE --logger-level L --json-output`
(plus `--sharded` when there is more than one rank) with RANK=r, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT in the environment (a free port unless the caller gives one: several sharded shards
may run on one machine, and the launcher's fixed 29500 would collide). Rank r binds `BASE-r` once
its model is loaded; the shard is ready when every rank has. Each rank's JSON log lines go to a
file; the tail is shown when a rank dies. A rank that dies, while starting or serving, takes the
others down with it (as the launcher does): a sharded model cannot run without every rank.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from loguru import logger

from tgi_vlm.sockets import remove_socket

LAUNCHER_ENV = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}
WATCH_INTERVAL_S = 0.2


def server_command() -> str:
    local = Path(sys.executable).parent / "text-generation-server"
    found = str(local) if local.exists() else shutil.which("text-generation-server")
    if not found:
        raise FileNotFoundError("text-generation-server is not installed (pip install -e .)")
    return found


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it) for MASTER_PORT."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ShardProcess:
    """`with ShardProcess(model, num_shard=2) as shard: await connect(shard.socket)`; SIGTERM to every rank on exit."""

    def __init__(self, model_id: str, *, uds_path: str | None = None, env: Mapping[str, str] | None = None,
                 extra_args: list[str] = (), logger_level: str = "INFO", startup_timeout_s: float = 300.0,
                 num_shard: int = 1):
        if num_shard < 1:
            raise ValueError(f"num_shard={num_shard}: at least one shard")
        self.directory = tempfile.mkdtemp(dir="/tmp", prefix="tv-")  # unix socket paths must stay short
        self.uds_path = uds_path or f"{self.directory}/s"
        self.num_shard = num_shard
        self.sockets = [f"{self.uds_path}-{rank}" for rank in range(num_shard)]
        self.socket = self.sockets[0]  # rank 0: ServiceDiscovery lists the others
        self.log_paths = [Path(self.directory) / f"shard-{rank}.log" for rank in range(num_shard)]
        self.model_id = model_id
        self.env = {**os.environ, **LAUNCHER_ENV, "WORLD_SIZE": str(num_shard), **(env or {})}
        if num_shard > 1 and "MASTER_PORT" not in (env or {}):
            self.env["MASTER_PORT"] = str(free_port())
        self.args = [server_command(), "serve", model_id, "--uds-path", self.uds_path, "--logger-level", logger_level,
                     "--json-output", *(["--sharded"] if num_shard > 1 else []), *extra_args]
        self.startup_timeout_s = startup_timeout_s
        self.processes: list[subprocess.Popen] = []
        self.failure: str | None = None  # why the ranks were stopped, when one died while serving
        self._stopping = threading.Event()

    def start(self) -> ShardProcess:
        for rank, log_path in enumerate(self.log_paths):
            remove_socket(self.sockets[rank])  # as the launcher: readiness is the socket appearing
            with open(log_path, "w") as log:
                self.processes.append(subprocess.Popen(self.args, env={**self.env, "RANK": str(rank)}, stdout=log,
                                                       stderr=subprocess.STDOUT))
        deadline = time.monotonic() + self.startup_timeout_s
        while not all(os.path.exists(path) for path in self.sockets):
            dead = self._dead_rank()
            if dead is not None:
                message = f"{self._describe_exit(dead)} before binding {self.sockets[dead]}; {self._tail_of(dead)}"
                self.stop()
                raise RuntimeError(message)
            if time.monotonic() > deadline:
                waiting = [path for path in self.sockets if not os.path.exists(path)]
                self.stop()
                raise TimeoutError(f"the shard did not bind {', '.join(waiting)} within {self.startup_timeout_s:.0f} s")
            time.sleep(0.05)
        threading.Thread(target=self._watch, name="tgi-vlm-shard-watch", daemon=True).start()
        return self

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM every rank, wait up to `grace_s`, then SIGKILL. Returns the first non-zero exit code in
        rank order (0 when every rank exited cleanly; None when nothing was started)."""
        self._stopping.set()
        codes = self._terminate(grace_s)
        shutil.rmtree(self.directory, ignore_errors=True)
        if not codes:
            return None
        return next((code for code in codes if code), 0)

    def log_tail(self, rank: int = 0, chars: int = 3000) -> str:
        try:
            return self.log_paths[rank].read_text()[-chars:]
        except OSError:
            return ""

    def _terminate(self, grace_s: float) -> list[int]:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            try:
                process.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return [process.returncode for process in self.processes]

    def _watch(self) -> None:
        """While serving: when a rank dies, stop the others and say why (with its log's tail)."""
        while not self._stopping.wait(WATCH_INTERVAL_S):
            dead = self._dead_rank()
            if dead is not None:
                self.failure = f"{self._describe_exit(dead)} while serving; {self._tail_of(dead)}"
                logger.error("{}\nstopping the other ranks", self.failure)
                self._terminate(grace_s=30.0)
                return

    def _dead_rank(self) -> int | None:
        return next((rank for rank, process in enumerate(self.processes) if process.poll() is not None), None)

    def _describe_exit(self, rank: int) -> str:
        who = f"shard rank {rank}" if self.num_shard > 1 else "the shard"
        return f"{who} exited with code {self.processes[rank].returncode}"

    def _tail_of(self, rank: int) -> str:
        return f"its log ({self.log_paths[rank].name}) ends with:\n{self.log_tail(rank)}"

    def __enter__(self) -> ShardProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

