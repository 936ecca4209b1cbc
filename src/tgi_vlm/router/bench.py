"""`tgi-vlm bench`: one workload through a shard (via the router) and through transformers' generate.

Serving: continuous batching behind our router; closed loop (`concurrency` in flight) or open loop
(Poisson `rate`). Reference: the same requests, in-process, as static batches of `hf_batch_size`
(left-padded, greedy, EOS ignored via min_new_tokens, each request's output cut to its own length).
Reported as ratios, with TTFT / inter-token latency percentiles and how many outputs match exactly.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tgi_vlm.router.router import RouterConfig, StepRecord
from tgi_vlm.router.session import router_session
from tgi_vlm.router.workload import WorkItem, WorkloadSpec


@dataclass
class RequestResult:
    tokens: list[int]
    submitted: float
    token_times: list[float]
    error: str | None = None
    turn: int = 0  # conversation turn (0 for single requests)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.submitted if self.token_times else None

    @property
    def itl_s(self) -> list[float]:
        return list(np.diff(self.token_times)) if len(self.token_times) > 1 else []


@dataclass
class ServingResult:
    wall_s: float
    requests: list[RequestResult]
    steps: list[StepRecord]
    calls: dict[str, int]
    profile: dict[str, float] = field(default_factory=dict)  # function → share of shard samples
    prefix: dict = field(default_factory=dict)  # the router's PrefixStats after the run
    cpu_s: dict = field(default_factory=dict)  # CPU seconds used during the run: "shard", "router"
    dtype: str | None = None  # what the shard runs in (its Info); None over HTTP (TGI's /info does not say)


@dataclass
class ReferenceResult:
    wall_s: float
    outputs: list[list[int]]
    batch_latencies_s: list[float]
    dtype: str = "float32"


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    return {f"p{q}": float(np.percentile(values, q)) for q in (50, 90, 99)}


# ----- serving -------------------------------------------------------------------------------

async def run_serving(model_id: str, items: list[WorkItem], spec: WorkloadSpec, *, uds_path: str | None = None,
                      shard_env: dict | None = None, shard_args: Sequence[str] = (), config: RouterConfig | None = None,
                      profile_to: Path | None = None, progress=None) -> ServingResult:
    async with router_session(model_id, uds_path=uds_path, shard_env=shard_env, shard_args=shard_args,
                              config=config) as session:
        router = session.router
        await warm_up(router, items[0].image_sizes)
        spy = _start_profiler(session.shard, profile_to)
        results: list[RequestResult | None] = [None] * len(items)
        cpu = CpuClock(session.shard)
        start = time.perf_counter()
        limit = asyncio.Semaphore(spec.concurrency or len(items))

        async def one(i: int, item: WorkItem) -> None:
            if spec.rate:
                await asyncio.sleep(max(0.0, start + item.arrival_s - time.perf_counter()))
            async with limit:
                submitted = time.perf_counter()
                tokens, final = await (await router.submit(item.params)).final()
            results[i] = RequestResult([t.token_id for t in tokens], submitted, [t.time for t in tokens], final.error)
            if progress is not None:
                progress()

        await asyncio.gather(*[one(i, item) for i, item in enumerate(items)])
        wall = time.perf_counter() - start
        used = cpu.used()
        profile = _stop_profiler(spy, profile_to)
        return ServingResult(wall, results, list(router.steps), dict(router.calls), profile,
                             router.prefix_stats.to_dict(), used, router.shard.info.dtype)


class CpuClock:
    """CPU seconds (user + system) used since creation by the shard processes we started (every rank)
    and by this process (router, token counter): on a shared machine, steadier than wall time."""

    def __init__(self, shard) -> None:
        self.pids = [process.pid for process in shard.processes] if shard is not None else []
        self.start = self._now()

    def _now(self) -> dict[str, float]:
        times = {"router": time.process_time()}
        try:
            if self.pids:
                times["shard"] = sum(_cpu_seconds(pid) for pid in self.pids)
        except (OSError, IndexError, ValueError):
            pass
        return times

    def used(self) -> dict[str, float]:
        now = self._now()
        return {k: now[k] - self.start[k] for k in now if k in self.start}


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def warm_up(router, image_sizes: list[tuple[int, int]]) -> None:
    """One short request with images of the workload's first sizes but content of its own (so that
    it leaves nothing in the prefix cache a measured request could use); then the counters restart."""
    from tgi_vlm.images import make_test_image, png_bytes
    from tgi_vlm.router.requests import RequestParams

    images = [png_bytes(make_test_image(w, h, seed=999_983 + k)) for k, (w, h) in enumerate(image_sizes)]
    await (await router.submit(RequestParams([*images, "warm up"], max_new_tokens=2, ignore_eos=True))).final()
    router.steps.clear()
    router.calls.clear()
    router.prefix_stats.reset_counters()


def _start_profiler(shard, out: Path | None) -> subprocess.Popen | None:
    """py-spy sampling the shard process (rank 0's; raw collapsed stacks), when asked for and installed."""
    if out is None or shard is None:
        return None
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(exe).exists():
        print("py-spy is not installed; no profile (pip install py-spy)", file=sys.stderr)
        return None
    return subprocess.Popen([exe, "record", "--pid", str(shard.processes[0].pid), "--format", "raw", "--rate", "50",
                             "--nonblocking", "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop_profiler(spy: subprocess.Popen | None, out: Path | None) -> dict[str, float]:
    if spy is None:
        return {}
    spy.send_signal(signal.SIGINT)
    try:
        spy.wait(30)
    except subprocess.TimeoutExpired:
        spy.kill()
        return {}
    return summarize_profile(out) if out.exists() else {}


# Frames that name where a shard spends its time, outermost first wins the sample.
PROFILE_BUCKETS = [
    ("vision tower", ("get_image_features", "encode (")),
    ("processor / tokenize", ("tokenize_request", "image_inputs", "process (")),
    ("language model forward", ("language_model", "forward (tgi_vlm/models/flash_causal_lm.py")),
    ("attention (paged torch)", ("torch_paged_attention",)),
    ("sampling / logits", ("sample (", "choose_tokens", "compute_logits")),
    ("detokenize / stopping", ("_emit", "detokenizer", "stopping")),
    ("step bookkeeping", ("build_step", "schedule", "to_pb", "concatenate", "filter")),
    ("grpc / idle", ("grpc", "asyncio", "select", "epoll", "wait (threading")),
]


def summarize_profile(path: Path) -> dict[str, float]:
    """Share of py-spy samples per bucket: a sample goes to the innermost bucket frame found on its stack."""
    counts: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        total += int(n)
        counts[_bucket(stack.split(";"))] += int(n)
    return {k: v / total for k, v in counts.most_common()} if total else {}


def _bucket(frames: list[str]) -> str:
    for frame in reversed(frames):  # innermost first
        for name, needles in PROFILE_BUCKETS:
            if any(n in frame for n in needles):
                return name
    return "other"


# ----- transformers reference ----------------------------------------------------------------

def run_reference(model_id: str, items: list[WorkItem], batch_size: int, progress=None,
                  dtype: str = "float32") -> ReferenceResult:
    """`dtype`: the serving run's, so both sides do the same arithmetic."""
    import io

    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from tgi_vlm.models.architectures import prompt_for
    from tgi_vlm.models.architectures.llama4 import enable_transformers_generate

    enable_transformers_generate()  # the reference runs transformers' own generate
    model = AutoModelForImageTextToText.from_pretrained(model_id, dtype=getattr(torch, dtype)).eval()
    processor = AutoProcessor.from_pretrained(model_id)
    processor.tokenizer.padding_side = "left"
    prompt = prompt_for(model.config.model_type)(processor, model.config)

    def inputs_for(batch: list[WorkItem]) -> dict:
        texts = [prompt.build_prompt([c if isinstance(c, str) else None for c in it.params.chunks]) for it in batch]
        images = [Image.open(io.BytesIO(c)).convert("RGB") for it in batch for c in it.params.chunks if isinstance(c, bytes)]
        kwargs = {"images": images} if images else {}
        inputs = dict(processor(text=texts, return_tensors="pt", padding=True, **kwargs))
        inputs.pop("labels", None)
        return inputs

    def generate(inputs: dict, n: int):
        with torch.inference_mode():
            # like ignore_eos_token: EOS neither stops generation nor is masked (min_new_tokens would mask it)
            return model.generate(**inputs, max_new_tokens=n, eos_token_id=None, do_sample=False)

    generate(inputs_for(items[:1]), 2)  # warm
    outputs: list[list[int]] = []
    latencies = []
    start = time.perf_counter()
    for b in range(0, len(items), batch_size):
        batch = items[b : b + batch_size]
        t0 = time.perf_counter()
        inputs = inputs_for(batch)
        n = max(it.params.max_new_tokens for it in batch)
        sequences = generate(inputs, n)[:, inputs["input_ids"].shape[1] :]
        latencies.append(time.perf_counter() - t0)
        outputs += [row[: it.params.max_new_tokens].tolist() for row, it in zip(sequences, batch)]
        if progress is not None:
            progress(len(batch))
    return ReferenceResult(time.perf_counter() - start, outputs, latencies, dtype)


def reference_dtype(model_id: str, serving_dtype: str | None, requested: str | None) -> str:
    """The reference runs on this CPU in the dtype the shard ran in; over HTTP, where the shard's dtype is not
    reported, in `requested` (bench --dtype) or what a shard here would pick by default (tgi_vlm.dtypes)."""
    if serving_dtype:
        return serving_dtype
    from transformers import AutoConfig

    from tgi_vlm.dtypes import checkpoint_dtype, cpu_has_native_bf16, resolve_dtype

    config = AutoConfig.from_pretrained(model_id)
    return resolve_dtype(requested, "cpu", checkpoint_dtype(config), cpu_has_native_bf16(), config.model_type).name


# ----- report --------------------------------------------------------------------------------

def summarize(spec: WorkloadSpec, items: list[WorkItem], serving: ServingResult,
              reference: ReferenceResult | None, model_id: str) -> dict:
    ok = [r for r in serving.requests if r.error is None]
    out_tokens = sum(len(r.tokens) for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [x for r in ok for x in r.itl_s]
    report = {
        "model": Path(model_id).name,  # no local paths in results
        "dtype": serving.dtype,  # None over HTTP: TGI's /info does not report it
        "workload": spec.to_dict(),
        "prompt_tokens_mean": float(np.mean([it.prompt_tokens for it in items])),
        "output_tokens": sum(it.params.max_new_tokens for it in items),
        "serving": {
            "wall_s": serving.wall_s,
            "failed": len(serving.requests) - len(ok),
            "req_per_s": len(ok) / serving.wall_s,
            "out_tok_per_s": out_tokens / serving.wall_s,
            "ttft_s": percentiles(ttft),
            "itl_s": percentiles(itl),
            "calls": serving.calls,
            "time_split": time_split(serving),
            "cpu_s": serving.cpu_s,  # shard and router (this process: token counting included)
            "profile": serving.profile,
        },
    }
    if reference is not None:
        ref_tokens = sum(len(o) for o in reference.outputs)
        matches = sum(r.tokens == o for r, o in zip(serving.requests, reference.outputs))
        report["transformers"] = {
            "wall_s": reference.wall_s,
            "dtype": reference.dtype,
            "req_per_s": len(items) / reference.wall_s,
            "out_tok_per_s": ref_tokens / reference.wall_s,
            "batch_latency_s": percentiles(reference.batch_latencies_s),
        }
        report["throughput_ratio"] = report["serving"]["out_tok_per_s"] / report["transformers"]["out_tok_per_s"]
        report["exact_matches"] = matches
        report["first_mismatch_at"] = [first_difference(r.tokens, o) for r, o in zip(serving.requests, reference.outputs)]
    return report


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def time_split(serving: ServingResult) -> dict[str, float]:
    """Where the serving wall time went, in seconds (shard figures are what it reports per RPC).
    Empty when the run had no step records (over HTTP)."""
    steps = serving.steps
    if not steps:
        return {}
    forward = sum(s.forward_ns for s in steps) / 1e9
    sample = sum(s.decode_ns for s in steps) / 1e9
    server = sum(s.total_ns for s in steps) / 1e9
    rpc = sum(s.wall_s for s in steps)
    return {
        "shard forward (incl. vision, embeds)": forward,
        "shard sampling + detokenize": sample,
        "shard other (from_pb/tokenize, concat, to_pb)": server - forward - sample,
        "gRPC + (de)serialization": rpc - server,
        "router, between RPCs": serving.wall_s - rpc,
        "prefill RPCs": sum(s.wall_s for s in steps if s.kind != "decode"),
        "decode RPCs": sum(s.wall_s for s in steps if s.kind == "decode"),
        "steps": len(steps),
        "mean decode batch": float(np.mean([s.size for s in steps if s.kind == "decode"] or [0])),
    }


def write_results(report: dict, out_dir: Path, name: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    json_path.write_text(json.dumps(report, indent=2))
    written = [json_path]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install 'tgi-vlm[bench]')", file=sys.stderr)
        return written
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    systems = {"tgi-vlm (router + shard)": report["serving"]}
    if "transformers" in report:
        systems["transformers generate"] = report["transformers"]
    ax1.bar(list(systems), [s["out_tok_per_s"] for s in systems.values()], color=["tab:blue", "tab:gray"][: len(systems)])
    ax1.set_ylabel("output tokens / s")
    ax1.set_title("throughput")
    qs = ["p50", "p90", "p99"]
    x = np.arange(len(qs))
    for offset, key, label in ((-0.2, "ttft_s", "TTFT"), (0.2, "itl_s", "inter-token")):
        values = [(report["serving"][key][q] or 0) * 1000 for q in qs]
        ax2.bar(x + offset, values, width=0.4, label=label)
    ax2.set_xticks(x, qs)
    ax2.set_ylabel("ms")
    ax2.set_title("tgi-vlm latency")
    ax2.legend()
    fig.suptitle(f"{Path(report['model']).name}: {report['workload']['num_requests']} requests")
    fig.tight_layout()
    png = out_dir / f"{name}.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return written + [png]


def result_table(report: dict):
    from rich.table import Table

    table = Table(title=f"{Path(report['model']).name} — {report['workload']['num_requests']} requests")
    for col in ("system", "req/s", "out tok/s", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms", "wall s"):
        table.add_column(col, justify="right" if col != "system" else "left")
    s = report["serving"]
    table.add_row(f"tgi-vlm ({report.get('transport', 'router driver')})", f"{s['req_per_s']:.2f}", f"{s['out_tok_per_s']:.1f}", _ms(s["ttft_s"]), _ms(s["itl_s"]),
                  f"{s['wall_s']:.1f}")
    if "transformers" in report:
        t = report["transformers"]
        table.add_row("transformers (static)", f"{t['req_per_s']:.2f}", f"{t['out_tok_per_s']:.1f}", "—", "—",
                      f"{t['wall_s']:.1f}")
    return table


def _ms(p: dict) -> str:
    return "/".join("—" if v is None else f"{v * 1000:.0f}" for v in p.values())


def summary_lines(report: dict) -> list[str]:
    lines = [f"dtype: tgi-vlm {report.get('dtype') or 'not reported (HTTP)'}"
             + (f", transformers {report['transformers']['dtype']}" if "transformers" in report else "")]
    if "throughput_ratio" in report:
        n = report["workload"]["num_requests"]
        lines.append(f"throughput ratio (tgi-vlm / transformers): {report['throughput_ratio']:.2f}x; "
                     f"exact output matches: {report['exact_matches']}/{n}")
    split = report["serving"]["time_split"]
    if split:
        lines.append("serving time split: " + ", ".join(
            f"{k} {v:.1f}" + ("" if k in ("steps", "mean decode batch") else " s") for k, v in split.items()))
    if report["serving"]["profile"]:
        lines.append("shard profile (py-spy samples): " + ", ".join(
            f"{k} {v:.0%}" for k, v in report["serving"]["profile"].items()))
    return lines
