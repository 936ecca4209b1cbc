"""A live `tgi-vlm launch` process for e2e tests, and a local HTTP server that serves test images.

`Launch` runs this checkout's CLI (`python -m tgi_vlm.cli launch ... --port 0`) and reads the URL
from its banner; `metrics()` parses /metrics into {sample: value}. `ImageServer` serves on
127.0.0.1 only: /ok.png, /big (over a limit), /slow (answers after a delay), anything else 404.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

SRC = Path(__file__).resolve().parents[2] / "src"
SHARD_ENV = {"TGI_VLM_CPU_KV_CACHE_GB": "0.05", "TGI_VLM_DEVICE": "cpu", "ATTENTION": "paged", "PREFIX_CACHING": "0"}
_SERVING = re.compile(r"tgi-vlm: serving .* on (http://\S+) ")


class Launch:
    def __init__(self, model: str, *args: str, startup_timeout_s: float = 180.0):
        env = {**os.environ, **SHARD_ENV, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.process = subprocess.Popen([sys.executable, "-m", "tgi_vlm.cli", "launch", model, "--port", "0", *args],
                                        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []
        self._url = threading.Event()
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()
        if not self._url.wait(startup_timeout_s):
            self.stop()
            raise RuntimeError("tgi-vlm launch did not start:\n" + "".join(self.output[-40:]))

    def _read(self) -> None:
        for line in self.process.stdout:
            self.output.append(line)
            match = _SERVING.search(line)
            if match:
                self.url = match.group(1)
                self._url.set()
        self._url.set()  # exited: let the waiter see it

    def shard_pid(self) -> int:
        """The shard process this launch started (its only child)."""
        tasks = Path(f"/proc/{self.process.pid}/task").iterdir()  # started from a worker thread: any task's child
        children = [c for task in tasks for c in (task / "children").read_text().split()]
        assert len(children) == 1, children
        return int(children[0])

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")}

    def wait_for_metric(self, name: str, value: float, timeout_s: float = 20.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout_s
        while True:
            metrics = self.metrics()
            if metrics.get(name) == value or time.monotonic() > deadline:
                return metrics
            time.sleep(0.1)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


class ImageServer:
    """Serves `png` at /ok.png, `big_bytes` bytes at /big, `png` after `slow_s` at /slow; else 404."""

    def __init__(self, png: bytes, big_bytes: int, slow_s: float):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                outer.requests.append(self.path)
                if self.path == "/slow":
                    time.sleep(slow_s)
                body = {"/ok.png": png, "/slow": png, "/big": b"\0" * big_bytes}.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the fetcher gave up first

            def log_message(self, *args) -> None:
                pass

        self.requests: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
