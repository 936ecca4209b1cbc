"""What chat tools cost: a tool-call request against a plain one, and the tools grammar's compile time.

1. Compile (in process, the tiny Qwen2-VL's vocabulary): the tools grammar of a `required` and an
   `auto` request, as the front end checks it (llguidance's validation, cached by grammar text) and as
   the shard compiles it (`GrammarCompiler`: a fresh compile, then the cached one). Cold runs rename
   the functions each time so nothing is cached.
2. Over HTTP (`tgi-vlm launch` on the tiny Qwen2-VL, float32, CPU): streamed chat requests, rounds
   alternating between modes so load from other processes hits all alike, median per mode of the
   time to the first chunk and of the whole request, and the whole request per completion token:
   - plain: the question alone;
   - plain, the tools' prompt: the prompt a tool request gets (tools and instruction appended), no grammar;
   - tools, required: the same tools, the reply held to the call grammar (cached after the first);
   - tools, required, new grammar: a function renamed every request, so the grammar compiles cold.
   One torch thread in the shard (a shared machine). The tiny model's steps are milliseconds, so the
   figures show the front end's and the grammar's own cost rather than a real model's.

    PYTHONPATH=src python benchmarks/chat_tools.py [--rounds 8]

Writes benchmarks/results/chat_tools.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from tgi_vlm.api import grammar as api_grammar
from tgi_vlm.api.schemas import ChatRequest
from tgi_vlm.api.tools import plan_tools, template_tools
from tgi_vlm.config import GrammarLimits
from tgi_vlm.generation import GrammarCompiler, GrammarType
from tgi_vlm.testing import tiny_model_path
from tgi_vlm.testing.machine import machine
from tgi_vlm.testing.schemas import ADD, WEATHER

RESULTS = Path(__file__).parent / "results"
USER = [{"role": "user", "content": "What is the weather in Paris for three days?"}]
MAX_TOKENS = 96  # room for a whole call


def tools(suffix: str = "") -> list[dict]:
    return [{"type": "function", "function": {"name": f"get_weather{suffix}", "parameters": WEATHER}},
            {"type": "function", "function": {"name": f"add{suffix}", "parameters": ADD}}]


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


# ----- 1. compile ------------------------------------------------------------------------------------

def compile_times(reps: int) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path("qwen2_vl"))
    compiler = GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, GrammarLimits())
    out = {}
    for choice in ("required", "auto"):
        rows = {"api_check_cold_ms": [], "api_check_cached_ms": [], "shard_compile_cold_ms": [],
                "shard_compile_cached_ms": []}
        for rep in range(reps):
            body = ChatRequest.model_validate({"messages": USER, "tools": tools(f"_{rep}_{time.time_ns()}"),
                                               "tool_choice": choice})
            api_grammar._problem.cache_clear()
            start = time.perf_counter()
            plan = plan_tools(body)  # schema checks included: llguidance validation, cold
            rows["api_check_cold_ms"].append(ms(time.perf_counter() - start))
            start = time.perf_counter()
            plan_tools(body)
            rows["api_check_cached_ms"].append(ms(time.perf_counter() - start))
            text = json.dumps(plan.schema)
            for key in ("shard_compile_cold_ms", "shard_compile_cached_ms"):
                start = time.perf_counter()
                compiler.state_for(GrammarType.JSON, text)
                rows[key].append(ms(time.perf_counter() - start))
        out[choice] = {k: statistics.median(v) for k, v in rows.items()} | {"schema_bytes": len(text)}
    api_grammar._problem.cache_clear()
    return out


# ----- 2. over HTTP ----------------------------------------------------------------------------------

class Server:
    """`tgi-vlm launch` on the tiny Qwen2-VL (its own process, its own shard)."""

    def __init__(self):
        env = {**os.environ, "TGI_VLM_CPU_KV_CACHE_GB": "0.1", "TGI_VLM_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tgi_vlm.cli", "launch", str(tiny_model_path("qwen2_vl")), "--port", "0",
             "--max-input-tokens", "1500", "--max-total-tokens", "2048", "--max-batch-prefill-tokens", "2048",
             "--dtype", "float32"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.url, ready = "", threading.Event()

        def read() -> None:
            for line in self.process.stdout:
                found = re.search(r"tgi-vlm: serving .* on (http://\S+) ", line)
                if found:
                    self.url = found.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(300) or not self.url:
            self.stop()
            raise RuntimeError("tgi-vlm launch did not start")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)


def timed(url: str, body: dict) -> dict:
    start, first, usage = time.perf_counter(), None, None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True,
                                                                   "stream_options": {"include_usage": True}},
                      timeout=300) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {response.read().decode()[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"error event: {event}")
            if first is None and event.get("choices"):
                first = time.perf_counter()
            usage = event.get("usage") or usage
    end = time.perf_counter()
    tokens = usage["completion_tokens"]
    return {"first_chunk_ms": ms(first - start), "total_ms": ms(end - start), "completion_tokens": tokens,
            "prompt_tokens": usage["prompt_tokens"], "ms_per_token": ms((end - start) / max(tokens, 1))}


def with_tools_text(messages: list[dict]) -> list[dict]:
    """The prompt a `required` request gets (tools appended to the last message), sent as plain text."""
    plan = plan_tools(ChatRequest.model_validate({"messages": messages, "tools": tools(), "tool_choice": "required"}))
    appended = f"\n---\n{json.dumps(template_tools(plan.tools))}\n{plan.prompt(None)}"
    return [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + appended}]


def modes(round_index: int) -> dict[str, dict]:
    base = {"model": "tgi", "messages": USER, "max_tokens": MAX_TOKENS, "seed": round_index}
    return {
        "plain": base,
        "plain, the tools' prompt": {**base, "messages": with_tools_text(USER)},
        "tools, required": {**base, "tools": tools(), "tool_choice": "required"},
        "tools, required, new grammar": {**base, "tools": tools(f"_{round_index}"), "tool_choice": "required"},
    }


def http_figures(rounds: int) -> dict:
    server = Server()
    try:
        for body in modes(rounds).values():
            timed(server.url, body)  # warm-up: first requests of each shape
        rows: dict[str, list[dict]] = {name: [] for name in modes(0)}
        for r in range(rounds):
            for name, body in modes(r).items():
                rows[name].append(timed(server.url, body))
    finally:
        server.stop()
    return {name: {key: statistics.median(row[key] for row in runs) for key in runs[0]} for name, runs in rows.items()}


def markdown(report: dict) -> str:
    lines = ["# Chat tools: overhead", "", f"{report['date']}, {report['machine']['cpu']}, "
             f"{report['machine']['cores']} cores, load {report['machine']['load_avg_1m']:.1f}; tiny Qwen2-VL, float32",
             "", "## Tools grammar compile (median ms)", "",
             "| tool_choice | schema bytes | API check cold | API check cached | shard compile cold | shard compile cached |",
             "|---|---:|---:|---:|---:|---:|"]
    for choice, row in report["compile"].items():
        lines.append(f"| {choice} | {row['schema_bytes']} | {row['api_check_cold_ms']:.2f} | "
                     f"{row['api_check_cached_ms']:.3f} | {row['shard_compile_cold_ms']:.2f} | "
                     f"{row['shard_compile_cached_ms']:.3f} |")
    lines += ["", f"## Streamed chat requests over HTTP (median of {report['rounds']} rounds)", "",
              "| mode | prompt tokens | completion tokens | first chunk ms | total ms | total ms per completion token |",
              "|---|---:|---:|---:|---:|---:|"]
    for name, row in report["http"].items():
        lines.append(f"| {name} | {row['prompt_tokens']:.0f} | {row['completion_tokens']:.0f} | "
                     f"{row['first_chunk_ms']:.1f} | {row['total_ms']:.1f} | {row['ms_per_token']:.2f} |")
    lines += ["", "First chunk: a call's first chunk waits until its name is generated (about 15 tokens); the "
              "prompts repeat across rounds, so the prefix cache computes only their last block."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--compile-reps", type=int, default=5)
    args = parser.parse_args()
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "rounds": args.rounds, "compile": compile_times(args.compile_reps), "http": http_figures(args.rounds)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "chat_tools.json").write_text(json.dumps(report, indent=1) + "\n")
    (RESULTS / "chat_tools.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
