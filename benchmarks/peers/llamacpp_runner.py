r"""llama.cpp's `llama-server` on `tgi-vlm bench`'s requests (text workloads), measured the way `tgi-vlm bench` measures.

    python benchmarks/peers/llamacpp_runner.py WORKLOAD_DIR --server BIN --gguf MODEL.gguf --json OUT.json [-- FLAGS]

Standard library only (as vllm_runner.py, it never imports tgi_vlm). The server is built from the llama-cpp-python
source package on the index (the shared peers recipe: `setup_llamacpp.sh`); the GGUF file is the model in one of
llama.cpp's formats (the package index's Q4_K_M of Gemma 3 270M as it is, or a bf16 / f32 conversion of the same
weights).

Equal work with tgi-vlm's bench: the server gets `-np C` slots (C = the workload's concurrency) of 2048 tokens each
(`-c 2048 C`: tgi-vlm's --max-total-tokens), a prefill batch of 2048 (`-b 2048`: tgi-vlm's prefill budget), no prompt
cache between requests (`--cache-ram 0`, `cache_prompt: false`; the workload's requests share no prefix), its own
default threads; anything else after `--`. Each request sends the prompt as the token ids tgi-vlm's shard computed
(`prompt_token_ids`), so both run the same tokens; the runner checks that the server evaluated exactly that many
(`tokens_evaluated`) and produced exactly `max_new_tokens` (greedy: temperature 0, top_k 1; `ignore_eos`).

Timing as `tgi-vlm bench`'s driver target: one untimed warm-up request (the first request's prompt, 2 new tokens);
then a closed loop of C requests in flight (threads, one HTTP connection each), the next submitted as one finishes.
A request's tokens are stamped when their server-sent event arrives (an event carrying k tokens stamps k); TTFT =
first token - submission; ITL = gaps between a request's consecutive tokens, pooled; p50/p90/p99 as
numpy.percentile (linear); out tok/s and req/s over the loop's wall time. Image workloads are not run here
(llama.cpp's multimodal path needs a projector GGUF per model): the runner refuses them.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from token_times import TokenTimes, percentiles  # noqa: E402
from workload_file import PeerRequest, read_workload  # noqa: E402

CTX_PER_SLOT = 2048  # tgi-vlm bench's --max-total-tokens
BATCH = 2048  # tgi-vlm bench's --max-batch-prefill-tokens
START_TIMEOUT_S = 300


@dataclass
class Timing(TokenTimes):
    evaluated: int | None = None  # prompt tokens the server says it evaluated
    error: str | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(binary: str, gguf: str, slots: int, extra: list[str], log) -> tuple[subprocess.Popen, int]:
    port = free_port()
    command = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
               "-c", str(CTX_PER_SLOT * slots), "-b", str(BATCH), "--cache-ram", "0", *extra]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited {process.returncode} while starting")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return process, port
        except OSError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"llama-server did not answer /health within {START_TIMEOUT_S} s")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def send(port: int, request: PeerRequest, max_new_tokens: int, timing: Timing) -> None:
    """One streamed /completion request; fills `timing` (token stamps, evaluated prompt tokens, or the error)."""
    body = {"prompt": request.prompt_token_ids, "n_predict": max_new_tokens, "ignore_eos": True, "temperature": 0,
            "top_k": 1, "seed": 0, "cache_prompt": False, "stream": True, "return_tokens": True}
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            timing.error = f"HTTP {response.status}: {response.read()[:200]!r}"
            return
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            now = time.perf_counter()
            timing.token_times += [now] * len(event.get("tokens") or [])
            if event.get("stop"):
                timing.evaluated = event.get("tokens_evaluated")
                break
        conn.close()
    except (OSError, ValueError, http.client.HTTPException) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"


def closed_loop(port: int, requests: list[PeerRequest], concurrency: int) -> tuple[list[Timing], float]:
    timings: list[Timing | None] = [None] * len(requests)
    next_index = 0
    lock = threading.Lock()

    def worker() -> None:
        nonlocal next_index
        while True:
            with lock:
                if next_index >= len(requests):
                    return
                i = next_index
                next_index += 1
            timings[i] = Timing(time.perf_counter())
            send(port, requests[i], requests[i].max_new_tokens, timings[i])

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return timings, time.perf_counter() - start


def serving_report(requests: list[PeerRequest], timings: list[Timing], wall: float) -> dict:
    ok = [t for t in timings if t.error is None]
    tokens = sum(len(t.token_times) for t in ok)
    wrong = [i for i, (r, t) in enumerate(zip(requests, timings))
             if t.error is None and len(t.token_times) != r.max_new_tokens]
    prompt_mismatch = [i for i, (r, t) in enumerate(zip(requests, timings))
                       if t.error is None and t.evaluated != len(r.prompt_token_ids)]
    return {"requests": len(requests), "failed": len(requests) - len(ok),
            "errors": [t.error for t in timings if t.error][:5], "output_tokens": tokens, "wall_s": wall,
            "out_tok_per_s": tokens / wall, "req_per_s": len(ok) / wall,
            "ttft_s": percentiles([t.ttft_s for t in ok if t.ttft_s is not None]),
            "itl_s": percentiles([x for t in ok for x in t.itl_s]),
            "wrong_output_lengths": wrong, "prompt_tokens_differ": prompt_mismatch}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("workload", type=Path)
    p.add_argument("--server", required=True, help="the llama-server binary")
    p.add_argument("--gguf", required=True, help="the model file")
    p.add_argument("--json", type=Path, required=True)
    a = p.parse_args(argv)
    workload = read_workload(a.workload)
    if any(r.images for r in workload.requests):
        raise SystemExit("llamacpp_runner.py runs text workloads only (--images-per-request 0)")
    if any(not r.prompt_token_ids for r in workload.requests):
        raise SystemExit("the workload has no prompt token ids: write it with export_workload.py")
    concurrency = workload.spec["concurrency"]
    log_path = a.json.with_suffix(".server.log")
    with open(log_path, "w") as log:
        process, port = start_server(a.server, a.gguf, concurrency, extra, log)
        try:
            first = workload.requests[0]
            send(port, first, 2, warm := Timing(time.perf_counter()))
            if warm.error:
                raise RuntimeError(f"the warm-up request failed: {warm.error}")
            timings, wall = closed_loop(port, workload.requests, concurrency)
        finally:
            stop_server(process)
    report = {"workload_digest": workload.digest, "serving": serving_report(workload.requests, timings, wall),
              "config": {"gguf": Path(a.gguf).name, "slots": concurrency, "ctx_per_slot": CTX_PER_SLOT,
                         "batch": BATCH, "extra_flags": extra},
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                          "load_avg_1m": os.getloadavg()[0]}}
    a.json.write_text(json.dumps(report, indent=1))
    s = report["serving"]
    print(f"llama.cpp {Path(a.gguf).name}: {s['out_tok_per_s']:.1f} out tok/s, {s['req_per_s']:.2f} req/s, "
          f"ITL p50 {s['itl_s']['p50']}, failed {s['failed']}, wrong lengths {len(s['wrong_output_lengths'])}, "
          f"prompt token counts differing {len(s['prompt_tokens_differ'])}")


if __name__ == "__main__":
    main()
