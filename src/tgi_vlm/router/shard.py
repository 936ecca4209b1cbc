"""Start a shard the way TGI's launcher does, and stop it the same way (SIGTERM, then wait).

`text-generation-server serve MODEL --uds-path BASE --json-output` with RANK/WORLD_SIZE/MASTER_*
in the environment; the shard binds `BASE-0` once the model is loaded, which is how readiness is
detected. Its JSON log lines go to a file; the tail is shown when it dies early.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

LAUNCHER_ENV = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}


def server_command() -> str:
    local = Path(sys.executable).parent / "text-generation-server"
    found = str(local) if local.exists() else shutil.which("text-generation-server")
    if not found:
        raise FileNotFoundError("text-generation-server is not installed (pip install -e .)")
    return found


class ShardProcess:
    """`with ShardProcess(model) as shard: ShardClient(shard.socket)`; SIGTERM on exit."""

    def __init__(self, model_id: str, *, uds_path: str | None = None, env: Mapping[str, str] | None = None,
                 extra_args: list[str] = (), logger_level: str = "INFO", startup_timeout_s: float = 300.0):
        self.directory = tempfile.mkdtemp(dir="/tmp", prefix="tv-")  # unix socket paths must stay short
        self.uds_path = uds_path or f"{self.directory}/s"
        self.socket = f"{self.uds_path}-0"
        self.log_path = Path(self.directory) / "shard.log"
        self.model_id = model_id
        self.env = {**os.environ, **LAUNCHER_ENV, **(env or {})}
        self.args = [server_command(), "serve", model_id, "--uds-path", self.uds_path,
                     "--logger-level", logger_level, "--json-output", *extra_args]
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None

    def start(self) -> ShardProcess:
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout_s
        while not os.path.exists(self.socket):
            if self.process.poll() is not None:
                message = (f"the shard exited with code {self.process.returncode} before binding "
                           f"{self.socket}; its log ends with:\n{self.log_tail()}")
                self.stop()
                raise RuntimeError(message)
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the shard did not bind {self.socket} within {self.startup_timeout_s:.0f} s")
            time.sleep(0.05)
        return self

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM, wait up to `grace_s`, then SIGKILL. Returns the exit code."""
        code = None
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(grace_s)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            code = self.process.returncode
        shutil.rmtree(self.directory, ignore_errors=True)
        return code

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text()[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> ShardProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
