"""tgi-vlm against vLLM's CPU build, side by side, on exactly the requests `tgi-vlm bench` makes.

    python benchmarks/peers/compare.py                       # everything: 10-15 minutes on 2 quiet cores
    python benchmarks/peers/compare.py -n 16 --dtypes float32 --prefix-caching default --name peers-vllm-cpu.dev

Runs with the project's interpreter, one run at a time (each gets the whole machine, which must otherwise
be idle):
1. builds the bench model if needed (`tgi-vlm tiny-model --arch qwen2_vl --size bench`);
2. writes the workload once (export_workload.py: `tgi-vlm bench`'s requests, images and prompt ids, digest);
3. tgi-vlm: for each dtype (default = none given, float32, bfloat16) starts a shard as the launcher does
   (`text-generation-server serve MODEL [--dtype D]`), reads its dtype from the Info RPC, and runs
   `tgi-vlm bench MODEL --uds-path SOCKET --no-hf` against it (bench's defaults otherwise: 16 in flight,
   prefill budget 2048, max total tokens 2048, the router's prefix cache on); reads bench's own JSON;
4. vLLM: for each dtype (auto = vLLM's default, float32, bfloat16) runs vllm_runner.py with vLLM's
   interpreter on the workload file;
5. writes one table, markdown and JSON, under benchmarks/results/ (`--name`, default peers-vllm-cpu).

Prefix caching: both systems default to on (tgi-vlm bench's router prefix cache; vLLM's
enable_prefix_caching). The workload's requests share no prefix (each opens with its own image), so "on"
costs bookkeeping and gains nothing here; `--prefix-caching both` (the default) runs every row at each
system's default (on) and with it off on both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from export_workload import export_workload  # noqa: E402
from workload_file import Workload  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
RUN_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Run:
    system: str  # tgi-vlm | vllm | llamacpp
    dtype: str  # as requested: default/auto or a dtype name (llamacpp: the GGUF's key, e.g. bfloat16, q4_k_m)
    prefix_caching: bool
    compile: bool = False  # vLLM only: torch.compile instead of enforce_eager
    round: int = 0  # --rounds: the whole list again, alternating which system goes first

    @property
    def name(self) -> str:
        return (f"{self.system}-{self.dtype}-prefix-{'on' if self.prefix_caching else 'off'}"
                + ("-eager" if self.system == "vllm" and not self.compile else "") + (f"-r{self.round}" if self.round else ""))

    @property
    def is_default_dtype(self) -> bool:
        return self.dtype in ("default", "auto")


@dataclass(frozen=True)
class Context:
    model: str
    workload: Workload
    runs_dir: Path  # each run's own results and log
    vllm_python: Path
    llamacpp_server: Path | None = None
    llamacpp_gguf: dict[str, tuple[str, list[str]]] = field(default_factory=dict)  # key -> (GGUF file, its flags)
    llamacpp_flags: tuple[str, ...] = ()


def plan(a: argparse.Namespace) -> list[Run]:
    """Each round: for every prefix mode and dtype, tgi-vlm's run next to vLLM's (vLLM first in odd
    rounds), so slow drift of a shared machine hits both systems of a pair alike."""
    modes = {"default": [True], "off": [False], "both": [True, False]}[a.prefix_caching]
    tgi_dtypes = list(dict.fromkeys("default" if d == "auto" else d for d in a.dtypes))
    vllm_dtypes = list(dict.fromkeys("auto" if d == "default" else d for d in a.dtypes))
    runs = []
    for round_ in range(a.rounds):
        for prefix in modes:
            for tgi_dtype, vllm_dtype in zip(tgi_dtypes, vllm_dtypes):
                pair = []
                if "tgi-vlm" in a.systems:
                    pair.append(Run("tgi-vlm", tgi_dtype, prefix, round=round_))
                if "vllm" in a.systems:
                    pair += [Run("vllm", vllm_dtype, prefix, compiled, round=round_)
                             for compiled in [True] + ([False] if a.vllm_eager else [])]
                runs += pair[::-1] if round_ % 2 else pair
        if "llamacpp" in a.systems:  # once a round: its prompt cache is off in every run (no shared prefixes)
            runs += [Run("llamacpp", key, False, round=round_) for key in llamacpp_files(a)]
    return runs


def llamacpp_files(a: argparse.Namespace) -> dict[str, tuple[str, list[str]]]:
    """--llamacpp-gguf KEY=FILE[,FLAGS], in the order given (KEY: the dtype it is compared at, or a quantization name;
    FLAGS: extra llama-server flags for this file alone, e.g. `q4_k_m=FILE,-nr`)."""
    files = {}
    for item in a.llamacpp_gguf:
        key, _, rest = item.partition("=")
        path, _, flags = rest.partition(",")
        if not path:
            raise SystemExit(f"--llamacpp-gguf takes KEY=FILE (e.g. bfloat16=/tmp/gguf/gemma-bf16.gguf), got {item!r}")
        files[key] = (path, flags.split())
    return files


# ----- tgi-vlm ---------------------------------------------------------------------------------

def run_tgi_vlm(run: Run, ctx: Context) -> dict:
    """A shard with the run's dtype, then `tgi-vlm bench` against it; bench's own report, read back."""
    from tgi_vlm.router import ShardProcess

    spec = ctx.workload.spec
    shard_args = [] if run.is_default_dtype else ["--dtype", run.dtype]
    log = ctx.runs_dir / f"{run.name}.log"
    with ShardProcess(ctx.model, extra_args=shard_args, logger_level="WARNING") as shard:
        dtype = asyncio.run(shard_dtype(shard.socket))
        command = [sys.executable, "-m", "tgi_vlm.cli", "bench", ctx.model, "--uds-path", shard.socket, "--no-hf",
                   "--num-requests", str(spec["num_requests"]), "--concurrency", str(spec["concurrency"]),
                   "--seed", str(spec["seed"]), "--images-per-request", str(spec["images_per_request"]),
                   "--out-dir", str(ctx.runs_dir), "--name", run.name,
                   *([] if run.prefix_caching else ["--no-prefix-caching"])]
        run_logged(command, log)
    report = json.loads((ctx.runs_dir / f"{run.name}.json").read_text())
    s = report["serving"]
    produced = round(s["out_tok_per_s"] * s["wall_s"])
    checks = {"same_spec_as_workload": report["workload"] == spec,
              "exact_output_tokens": produced == sum(r.max_new_tokens for r in ctx.workload.requests)
              and s["failed"] == 0}
    return {"dtype": dtype, "serving": serving_fields(s), "checks": checks}


async def shard_dtype(socket: str) -> str:
    from tgi_vlm.router import ShardClient

    client = ShardClient(socket)
    try:
        return (await client.info()).dtype
    finally:
        await client.close()


# ----- vLLM ------------------------------------------------------------------------------------

def run_vllm(run: Run, ctx: Context) -> dict:
    out = ctx.runs_dir / f"{run.name}.json"
    command = [str(ctx.vllm_python), str(HERE / "vllm_runner.py"), str(ctx.workload.directory), ctx.model,
               "--dtype", run.dtype, "--json", str(out),
               *([] if run.prefix_caching else ["--no-prefix-caching"]), *(["--compile"] if run.compile else [])]
    run_logged(command, ctx.runs_dir / f"{run.name}.log")
    report = json.loads(out.read_text())
    s = report["serving"]
    checks = {"same_workload_digest": report["workload_digest"] == ctx.workload.digest,
              "exact_output_tokens": not s["wrong_output_lengths"],
              "prompt_ids_identical": s["prompt_check"]["identical"]}
    return {"dtype": report["config"]["dtype"], "serving": serving_fields(s), "checks": checks,
            "prompt_check": s["prompt_check"], "config": report["config"], "versions": report["versions"]}


# ----- llama.cpp --------------------------------------------------------------------------------

def run_llamacpp(run: Run, ctx: Context) -> dict:
    out = ctx.runs_dir / f"{run.name}.json"
    command = [sys.executable, str(HERE / "llamacpp_runner.py"), str(ctx.workload.directory),
               "--server", str(ctx.llamacpp_server), "--gguf", ctx.llamacpp_gguf[run.dtype][0], "--json", str(out),
               "--", *ctx.llamacpp_flags, *ctx.llamacpp_gguf[run.dtype][1]]
    run_logged(command, ctx.runs_dir / f"{run.name}.log")
    report = json.loads(out.read_text())
    s = report["serving"]
    checks = {"same_workload_digest": report["workload_digest"] == ctx.workload.digest,
              "exact_output_tokens": not s["wrong_output_lengths"] and s["failed"] == 0,
              "prompt_token_counts_equal": not s["prompt_tokens_differ"]}
    return {"dtype": run.dtype, "serving": serving_fields(s), "checks": checks, "config": report["config"]}


def run_logged(command: list[str], log: Path) -> None:
    with open(log, "w") as f:
        done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"{Path(command[1]).name} {' '.join(command[2:4])}... exited {done.returncode}; "
                           f"{log} ends with:\n{tail}")


def serving_fields(s: dict) -> dict:
    return {k: s[k] for k in ("out_tok_per_s", "req_per_s", "ttft_s", "itl_s", "wall_s", "failed")}


# ----- the comparison --------------------------------------------------------------------------

def execute(run: Run, ctx: Context) -> dict:
    row = {"run": asdict(run), "name": run.name, "load_avg_1m_start": os.getloadavg()[0]}
    started = time.perf_counter()
    try:
        row |= {"tgi-vlm": run_tgi_vlm, "vllm": run_vllm, "llamacpp": run_llamacpp}[run.system](run, ctx)
        row["error"] = None
    except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as exc:
        row["error"] = str(exc)
    row["elapsed_s"] = time.perf_counter() - started  # startup included
    row["load_avg_1m_end"] = os.getloadavg()[0]
    return row


def ratios(rows: list[dict]) -> list[dict]:
    """tgi-vlm / vLLM for each prefix mode: at each one's default dtype, and at each dtype both ran.
    Throughput > 1 and latency < 1 mean tgi-vlm is ahead."""
    # against vLLM at its own defaults (compiled); its eager rows are in the table, not in the ratios
    ok = [r for r in rows if r["error"] is None and (r["run"]["system"] != "vllm" or r["run"]["compile"])]
    out = []
    for prefix in dict.fromkeys(r["run"]["prefix_caching"] for r in ok):
        tgi = [r for r in ok if r["run"]["system"] == "tgi-vlm" and r["run"]["prefix_caching"] == prefix]
        peer = [r for r in ok if r["run"]["system"] == "vllm" and r["run"]["prefix_caching"] == prefix]
        pairs = [("defaults", a, b) for a in tgi for b in peer
                 if a["run"]["dtype"] == "default" and b["run"]["dtype"] == "auto"]
        pairs += [(f"both {a['dtype']}", a, b) for a in tgi for b in peer
                  if a["dtype"] == b["dtype"] and not a["run"]["dtype"] == "default" and b["run"]["dtype"] != "auto"]
        for label, a, b in pairs:
            if a["run"].get("round", 0) != b["run"].get("round", 0):
                continue  # each round's runs are compared with their own round's
            out.append(ratio_entry(label, a, b))
    return out


def ratio_entry(label: str, a: dict, b: dict) -> dict:
    """tgi-vlm's row `a` over the peer's row `b` (the key "vllm" names the peer's run, whichever system it is)."""
    sa, sb = a["serving"], b["serving"]
    return {"compared": label, "prefix_caching": a["run"]["prefix_caching"], "round": a["run"].get("round", 0),
            "tgi_vlm": a["name"], "vllm": b["name"],
            "out_tok_per_s": sa["out_tok_per_s"] / sb["out_tok_per_s"],
            "req_per_s": sa["req_per_s"] / sb["req_per_s"],
            "ttft_p50": _ratio(sa["ttft_s"]["p50"], sb["ttft_s"]["p50"]),
            "itl_p50": _ratio(sa["itl_s"]["p50"], sb["itl_s"]["p50"])}


def llamacpp_ratios(rows: list[dict], same_file: frozenset[str] = frozenset()) -> list[dict]:
    """tgi-vlm / llama.cpp: at equal precision (tgi-vlm's dtype, its default's included, equal to the GGUF's key),
    tgi-vlm serving the very GGUF file llama.cpp runs (`same_file`: those keys; tgi-vlm's default row), and tgi-vlm's
    default against each other quantized file (marked as such: not equal precision). Prefix cache: tgi-vlm's off rows
    where there are, else its default (the workload shares no prefix; llama.cpp's cache is off)."""
    ok = [r for r in rows if r["error"] is None]
    peers = [r for r in ok if r["run"]["system"] == "llamacpp"]
    tgi = [r for r in ok if r["run"]["system"] == "tgi-vlm"]
    if any(not r["run"]["prefix_caching"] for r in tgi):
        tgi = [r for r in tgi if not r["run"]["prefix_caching"]]
    out = []
    for b in peers:
        key = b["run"]["dtype"]
        for a in tgi:
            if a["run"].get("round", 0) != b["run"].get("round", 0):
                continue
            if key in same_file:
                if a["run"]["dtype"] != "default":
                    continue
                label = f"llama.cpp {key}, the same GGUF file (tgi-vlm: its quantized weights, {a['dtype']} activations)"
            elif a["dtype"] == key:
                label = f"llama.cpp {key}, equal precision" + (" (tgi-vlm default)" if a["run"]["dtype"] == "default"
                                                               else "")
            elif a["run"]["dtype"] == "default" and key not in ("float32", "bfloat16", "float16"):
                label = f"llama.cpp {key} vs tgi-vlm default ({a['dtype']}): not equal precision"
            else:
                continue
            out.append(ratio_entry(label, a, b))
    return out


def summary(ratios_: list[dict]) -> list[dict]:
    """Across rounds: each comparison's median throughput ratio, its range and every round's value."""
    groups: dict[tuple, list[float]] = {}
    for q in ratios_:
        groups.setdefault((q["compared"], q["prefix_caching"]), []).append(q["out_tok_per_s"])
    return [{"compared": c, "prefix_caching": p, "rounds": len(v), "median": statistics.median(v),
             "min": min(v), "max": max(v), "values": v} for (c, p), v in groups.items()]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def machine_facts(vllm_python: Path | None) -> dict:
    import importlib.metadata as metadata

    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    facts = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": cpu,
             "cores": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)), "python": platform.python_version(),
             "torch": torch.__version__, "transformers": metadata.version("transformers"),
             "tgi_vlm_commit": git_commit(), "load_avg_1m": os.getloadavg()[0]}
    if vllm_python is not None and vllm_python.exists():
        probe = ("import importlib.metadata as m, json; "
                 "print(json.dumps({k: m.version(k) for k in ('vllm-cpu', 'torch', 'transformers')}))")
        done = subprocess.run([str(vllm_python), "-c", probe], capture_output=True, text=True)
        if done.returncode == 0:
            facts["vllm_venv"] = json.loads(done.stdout)
    return facts


def git_commit() -> str | None:
    done = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return done.stdout.strip() or None


def markdown(report: dict) -> str:
    m = report["machine"]
    w = report["workload"]
    lines = [f"# tgi-vlm vs its peers (CPU) on `tgi-vlm bench`'s requests — {m['date']}", "",
             f"{m['cpu']}, {m['cores']} cores; 1-min load average {m['load_avg_1m']:.1f} at the start, "
             f"{report['machine_end']['load_avg_1m']:.1f} at the end. tgi-vlm {m['tgi_vlm_commit']} "
             f"(torch {m['torch']}, transformers {m['transformers']}); "
             + (f"vLLM CPU {m['vllm_venv']['vllm-cpu']} (torch {m['vllm_venv']['torch']}, transformers "
                f"{m['vllm_venv']['transformers']})." if "vllm_venv" in m else "vLLM not run."),
             "",
             f"Workload {w['digest']}: {w['requests']} requests of model `{w['model']}`, {w['spec']['concurrency']} in "
             f"flight (closed loop), {w['prompt_tokens']} prompt tokens (images included), {w['output_tokens']} "
             f"new tokens (greedy, EOS ignored), spec {json.dumps(w['spec'])}.",
             "Every run: one warm-up request first; TTFT from submission (before tokenizing and image processing) "
             "to the first token; ITL = gaps between a request's tokens; prefill budget 2048 tokens, max length "
             "2048, 1 GB KV cache, all cores. vLLM: its defaults (compiled: CompilationMode.DYNAMO_TRACE_ONCE, inductor) "
             "unless marked eager (enforce_eager), chunked prefill. llama.cpp (text workloads): llama-server with one "
             "slot per request in flight, the shard's prompt token ids, prompt cache off (llamacpp_runner.py).", ""]
    # Only the load before the first run tells of other work: by the end, it counts these runs' own.
    if m["load_avg_1m"] > (m["cores"] or 1) / 2:
        lines += [f"**The machine was not idle** (load average above half its {m['cores']} cores before the "
                  "first run): these figures are not results.", ""]
    lines += ["| system | dtype | prefix cache | out tok/s | req/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | "
              "wall s | checks |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in report["rows"]:
        run = r["run"]
        system = run["system"] + (" (eager)" if run["system"] == "vllm" and not run["compile"] else "") + (f" (round {run['round'] + 1})"
                                                                               if report.get("rounds", 1) > 1 else "")
        dtype = (f"{run['dtype']} ({r['dtype']})" if run["dtype"] in ("default", "auto") and r.get("dtype")
                 else run["dtype"])
        prefix = "on" if run["prefix_caching"] else "off"
        if r["error"]:
            lines.append(f"| {system} | {dtype} | {prefix} | failed: {r['error'].splitlines()[0]} | | | | | |")
            continue
        s = r["serving"]
        checks = ", ".join(k for k, v in r["checks"].items() if not v)
        lines.append(f"| {system} | {dtype} | {prefix} | {s['out_tok_per_s']:.1f} | {s['req_per_s']:.2f} | "
                     f"{_ms(s['ttft_s'])} | {_ms(s['itl_s'])} | {s['wall_s']:.1f} | "
                     f"{'FAILED: ' + checks if checks else 'ok'} |")
    if report["ratios"]:
        lines += ["", "tgi-vlm / peer (throughput > 1 and latency < 1: tgi-vlm ahead; the peer is vLLM at its defaults "
                  "unless the row names llama.cpp):", "",
                  "| compared | prefix cache | round | out tok/s | req/s | TTFT p50 | ITL p50 |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for q in report["ratios"]:
            lines.append(f"| {q['compared']} | {'on' if q['prefix_caching'] else 'off'} | {q['round'] + 1} | "
                         f"{q['out_tok_per_s']:.2f} | {q['req_per_s']:.2f} | {_x(q['ttft_p50'])} | {_x(q['itl_p50'])} |")
    if report.get("rounds", 1) > 1 and report["ratios"]:
        lines += ["", f"Across the {report['rounds']} rounds (each a tgi-vlm run next to its peers' runs), out tok/s ratio:", "",
                  "| compared | prefix cache | median | min – max | rounds |", "|---|---|---:|---:|---|"]
        for q in summary(report["ratios"]):
            lines.append(f"| {q['compared']} | {'on' if q['prefix_caching'] else 'off'} | {q['median']:.2f} | "
                         f"{q['min']:.2f} – {q['max']:.2f} | {', '.join(f'{v:.2f}' for v in q['values'])} |")
    prompt = next((r["prompt_check"] for r in report["rows"] if r.get("prompt_check")), None)
    if prompt is not None:
        lines += ["", "Prompt token ids, vLLM vs tgi-vlm's shard: " + (
            f"identical in every request ({prompt['vllm_prompt_tokens']} tokens)." if prompt["identical"] else
            f"{prompt['requests_differing']} requests differ ({prompt['tgi_vlm_prompt_tokens']} tokens in tgi-vlm, "
            f"{prompt['vllm_prompt_tokens']} in vLLM); first: {json.dumps(prompt['first_difference'])}.")]
    lines += ["", "checks: tgi-vlm — bench ran the workload's spec, every request produced exactly max_new_tokens; "
              "vLLM — the runner verified the workload digest, exact max_new_tokens per request, prompt ids equal "
              "to tgi-vlm's. Each run's own report and log: `runs_dir` of the JSON, under compare.py's --work-dir.", ""]
    return "\n".join(lines)


def _ms(p: dict) -> str:
    return "/".join("—" if v is None else f"{v * 1000:.0f}" for v in p.values())


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


# ----- entry point -----------------------------------------------------------------------------

def default_work_dir() -> Path:
    return Path(tempfile.gettempdir()) / "tgi-vlm-peers"


def default_vllm_python() -> Path:
    venv = os.environ.get("VLLM_CPU_VENV") or str(Path(tempfile.gettempdir()) / "vllmcpu")
    return Path(venv) / "bin" / "python"


def same_gguf_keys(ctx: Context) -> frozenset[str]:
    """The --llamacpp-gguf keys whose file is the GGUF file tgi-vlm serves (--model real-gemma-gguf or a .gguf)."""
    served = Path(ctx.model)
    if served.suffix != ".gguf":
        return frozenset()
    return frozenset(k for k, (f, _) in ctx.llamacpp_gguf.items() if Path(f).resolve() == served.resolve())


def ensure_model(model: str | None, work_dir: Path) -> str:
    if model == "real-gemma-gguf":  # the same file, served as it is (its quantized tensors kept quantized)
        from tgi_vlm.testing.real_models import gemma3_270m_gguf

        return str(gemma3_270m_gguf())
    if model == "real-gemma":  # Gemma 3 270M, de-quantized once from the package index's GGUF (real-models extra)
        from tgi_vlm.testing.real_models import gemma3_270m_dir

        return str(gemma3_270m_dir())
    if model:
        return model
    path = work_dir / "bench-qwen2_vl"
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, "-m", "tgi_vlm.cli", "tiny-model", "--arch", "qwen2_vl", "--size", "bench",
                        str(path)], check=True)
    return str(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model directory (default: the bench Qwen2-VL, built under --work-dir); real-gemma: "
                                   "Gemma 3 270M from the package index, de-quantized (with --images-per-request 0); "
                                   "real-gemma-gguf: its Q4_K_M GGUF file itself")
    p.add_argument("--work-dir", type=Path, default=default_work_dir(),
                   help="model, workload and each run's files (default: %(default)s)")
    p.add_argument("-n", "--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", nargs="+", choices=("tgi-vlm", "vllm", "llamacpp"), default=["tgi-vlm", "vllm"])
    p.add_argument("--llamacpp-server", type=Path,
                   default=Path(tempfile.gettempdir()) / "llamacpp-build" / "bin" / "llama-server",
                   help="llama.cpp's llama-server (../shared/peers/llamacpp/setup_llamacpp.sh builds it)")
    p.add_argument("--llamacpp-gguf", action="append", default=[], metavar="KEY=FILE",
                   help="a GGUF file for llama.cpp and what it is compared at: bfloat16=..., float32=... (equal "
                        "precision), or a quantization name (q4_k_m=...), with its own server flags after a comma "
                        "(q4_k_m=FILE,-nr); repeat for several. Text workloads only")
    p.add_argument("--llamacpp-flags", default="", help="extra llama-server flags, e.g. '-nr' (no AMX repacking, "
                                                         "which crashes on quantized files on AMX CPUs)")
    p.add_argument("--dtypes", nargs="+", choices=("default", "auto", "float32", "bfloat16"),
                   default=["default", "float32", "bfloat16"],
                   help="default (= auto): each system's own (tgi-vlm: no --dtype; vLLM: auto)")
    p.add_argument("--prefix-caching", choices=("default", "off", "both"), default="both",
                   help="default: each system's default (on for both); off: off on both; both: every row twice")
    p.add_argument("--vllm-eager", action="store_true",
                   help="also run vLLM with enforce_eager (its default, compiled, always runs)")
    p.add_argument("--images-per-request", type=int, default=1, help="0 for a text model (e.g. real-gemma)")
    p.add_argument("--vllm-python", type=Path, default=default_vllm_python(),
                   help="vLLM's interpreter (setup_vllm_cpu.sh; default: $VLLM_CPU_VENV/bin/python, else %(default)s)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the whole list this many times (pairs interleaved, alternating which system goes "
                        "first) and report each comparison's median ratio: a shared machine drifts by ±10%%")
    p.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--name", default="peers-vllm-cpu", help="results: OUT_DIR/NAME.md and NAME.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    runs = plan(a)
    if any(r.system == "vllm" for r in runs) and not a.vllm_python.exists():
        raise SystemExit(f"{a.vllm_python} does not exist: run benchmarks/peers/setup_vllm_cpu.sh "
                         "(or pass --vllm-python / set VLLM_CPU_VENV)")
    a.work_dir.mkdir(parents=True, exist_ok=True)
    machine = machine_facts(a.vllm_python)
    model = ensure_model(a.model, a.work_dir)
    workload = export_workload(model, a.work_dir / f"workload-{Path(model).name}-n{a.num_requests}-c{a.concurrency}"
                                              f"-s{a.seed}-i{a.images_per_request}",
                               num_requests=a.num_requests, concurrency=a.concurrency, seed=a.seed,
                               images_per_request=a.images_per_request)
    runs_dir = a.work_dir / "runs" / a.name
    runs_dir.mkdir(parents=True, exist_ok=True)
    ctx = Context(model, workload, runs_dir, a.vllm_python, a.llamacpp_server, llamacpp_files(a),
                  tuple(a.llamacpp_flags.split()))
    print(f"workload {workload.digest}: {len(workload.requests)} requests; {len(runs)} runs, one at a time",
          flush=True)
    rows = []
    for run in runs:
        rows.append(row := execute(run, ctx))
        s = row.get("serving")
        print(f"{run.name}: " + (f"failed: {row['error']}" if row["error"] else
                                 f"{row['dtype']} {s['out_tok_per_s']:.1f} out tok/s, {s['req_per_s']:.2f} req/s "
                                 f"(run {row['elapsed_s']:.0f} s with startup)"), flush=True)
    report = {"machine": machine, "machine_end": {"load_avg_1m": os.getloadavg()[0]},
              "workload": {"digest": workload.digest, "model": workload.model, "spec": workload.spec,
                           "requests": len(workload.requests),
                           "prompt_tokens": sum(len(r.prompt_token_ids) for r in workload.requests),
                           "output_tokens": sum(r.max_new_tokens for r in workload.requests)},
              "runs_dir": str(runs_dir.relative_to(a.work_dir)), "rows": rows,
              "ratios": ratios(rows) + llamacpp_ratios(rows, same_gguf_keys(ctx)),
              "rounds": a.rounds}
    report["summary"] = summary(report["ratios"])
    a.out_dir.mkdir(parents=True, exist_ok=True)
    (a.out_dir / f"{a.name}.json").write_text(json.dumps(report, indent=1))
    (a.out_dir / f"{a.name}.md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {a.out_dir / a.name}.md and .json")


if __name__ == "__main__":
    main()
