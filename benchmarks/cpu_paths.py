"""What one CPU fast path buys in a serving-shaped step, paired: two engines of the bench Qwen2-VL model,
one with the path and one without, stepped in turn in one process (so drift on a shared host hits both).

Paths (each alone, everything else at its default):
- `lean-layers`: layers/cpu_decoder.py's lean decoder-layer forward vs transformers' layer forward.
- `causal-padding`: torch_backend.causal_attention (reduced-precision causal spans padded to 32 rows)
  vs the unpadded SDPA call.
- `native-attention`: decode attention through the C kernel (`tgi_vlm::decode_attention`, the CPU attention
  backend) vs the decode mirror and SDPA.
- `native-rotary`: the lean layer's rotary and K/V store in one C pass (`tgi_vlm::rotary_and_store`, bit-exact) vs
  torch's operations.
- `native-norm`: the lean layer's RMSNorm in one C call (`tgi_vlm::rms_norm`, within a few ulps) vs torch's
  ~6 operations.
- `skinny-linear` (float32 only): decode-sized float32 linears through the native loop (`tgi_vlm::skinny_linear`,
  layers/skinny_linear.py, a second copy of each weight) vs MKL's packed kernel.

The four native paths are chosen per side through `EngineConfig.kernels` (KernelSettings, the rest as the
environment sets it); each side's first decode step is profiled to check that its kernel ran, or did not.
- `mkl-float32` (float32 only): float32 linears through MKL's packed GEMM (`MklPackedLinear`, rows as they are)
  vs oneDNN's packed kernel with padded rows (what a torch build without MKL runs).

Steps measured: decode of 13 sequences (prompts ~200-300 tokens, growing), then prefill steps where
two new text prompts of 60-140 words join those 13 decoding rows (the shape of a serving step when
requests arrive). Medians after warm-up; each side's tokens are compared (they must be equal for
`lean-layers`, which is bit-exact).

    PYTHONPATH=src .venv/bin/python benchmarks/cpu_paths.py [--dtype bfloat16|float32] [--path lean-layers]

Writes benchmarks/results/cpu_paths-{dtype}.{json,md} (all paths) or cpu_paths-{path}-{dtype}.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

import tgi_vlm.layers.attention.torch_backend as torch_backend
import tgi_vlm.layers.linear.plan as linear_plan
from tgi_vlm.config import EngineConfig, KernelSettings
from tgi_vlm.kernels import cpu as cpu_kernels
from tgi_vlm.layers.cpu_decoder import remove_lean_layers
from tgi_vlm.layers.linear.kernels import mkl_packs_float32
from tgi_vlm.models import get_model
from tgi_vlm.testing import tiny_model_path
from tgi_vlm.testing.harness import make_batch, make_request

RESULTS = Path(__file__).parent / "results"
DECODE_ROWS = 13
WORDS = ("red", "blue sky", "a cat", "the house")


def _unpadded_causal(q, k, v, scaling):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)


PADDED_CAUSAL = torch_backend.causal_attention
MKL_SERVES_FLOAT32 = linear_plan.mkl_serves_float32
# path -> (its KernelSettings field, the op that runs with it)
KERNEL_PATHS = {"native-attention": ("native_attention", "decode_attention"),
                "native-rotary": ("native_rotary", "rotary_and_store"), "native-norm": ("native_norm", "rms_norm"),
                "skinny-linear": ("skinny_linear", "skinny_linear")}


class Side:
    """One engine and its running batch; `enter()` switches the process-wide choices this side makes."""

    def __init__(self, name: str, path: str, with_path: bool, model: str, dtype: str):
        self.name, self.path, self.with_path = name, path, with_path
        kernels = KernelSettings.from_env()
        if path in KERNEL_PATHS:
            kernels = replace(kernels, **{KERNEL_PATHS[path][0]: with_path})
        if path == "mkl-float32":  # the linear plan reads it at load; with the path: MKL wherever torch has it
            linear_plan.mkl_serves_float32 = mkl_packs_float32 if with_path else (lambda: False)
        self.engine = get_model(model, EngineConfig(device="cpu", cpu_kv_cache_bytes=1 << 30, dtype=dtype,
                                                    kernels=kernels))
        linear_plan.mkl_serves_float32 = MKL_SERVES_FLOAT32
        self.engine.prefill_budget = 2048
        if path == "lean-layers" and not with_path:
            removed = remove_lean_layers(self.engine.language_model)
            assert removed == self.engine.language_model.config.num_hidden_layers, "nothing to compare against"
        self.enter()
        reqs = [make_request(i, " ".join(["hello world"] * (100 + 7 * i)), max_new_tokens=500) for i in range(DECODE_ROWS)]
        _, self.batch, _ = self.engine.generate_token(self.engine.batch_from_pb(make_batch(1, reqs)))
        self.decode_ms: list[float] = []
        self.prefill_ms: list[float] = []
        self.tokens: list[list[int]] = []
        self._check_kernel()

    def _check_kernel(self) -> None:
        """One decode step (not timed) under the profiler: a native path's side with it must have run its op, the
        side without it must not have."""
        if self.path not in KERNEL_PATHS:
            return
        op = KERNEL_PATHS[self.path][1]
        with torch.autograd.profiler.profile(use_kineto=False) as profile:
            generations, self.batch, _ = self.engine.generate_token(self.batch)
        self.tokens.append([g.tokens.ids[0] for g in generations])
        ran = sum(1 for e in profile.function_events if e.name == f"tgi_vlm::{op}")
        if bool(ran) != self.with_path:
            reason = cpu_kernels.loaded().reason(op) if cpu_kernels.loaded() else None
            raise SystemExit(f"{self.path}: the side {self.name} ran tgi_vlm::{op} {ran} times"
                             + (f" (not available here: {reason})" if reason else ""))

    def enter(self) -> None:
        if self.path == "causal-padding":
            torch_backend.causal_attention = PADDED_CAUSAL if self.with_path else _unpadded_causal

    def step(self, into: list[float]) -> None:
        self.enter()
        start = time.perf_counter()
        generations, self.batch, _ = self.engine.generate_token(self.batch)
        into.append((time.perf_counter() - start) * 1e3)
        self.tokens.append([g.tokens.ids[0] for g in generations])

    def prefill(self, batch_id: int, texts: list[str]) -> None:
        new = [make_request(10_000 + batch_id * 2 + j, text, max_new_tokens=500) for j, text in enumerate(texts)]
        self.batch = self.engine.concatenate([self.batch, self.engine.batch_from_pb(make_batch(batch_id, new))])
        self.step(self.prefill_ms)
        self.batch = self.batch.filter(list(range(DECODE_ROWS)))


def measure(path: str, dtype: str, decode_steps: int, prefill_steps: int) -> dict:
    model = str(tiny_model_path("qwen2_vl", size="bench"))
    sides = [Side("without", path, False, model, dtype), Side("with", path, True, model, dtype)]
    for i in range(decode_steps):
        for side in sides if i % 2 == 0 else sides[::-1]:
            side.step(side.decode_ms)
    rng = random.Random(0)
    for i in range(prefill_steps):
        texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 140))) for _ in range(2)]
        for side in sides if i % 2 == 0 else sides[::-1]:
            side.prefill(100 + i, texts)
    torch_backend.causal_attention = PADDED_CAUSAL
    skip_decode, skip_prefill = decode_steps // 5, prefill_steps // 5
    out = {"path": path, "dtype": dtype, "threads": torch.get_num_threads(), "decode_rows": DECODE_ROWS,
           "tokens_equal": sides[0].tokens == sides[1].tokens,
           "when": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    for side in sides:
        out[side.name] = {"decode_ms": statistics.median(side.decode_ms[skip_decode:]),
                          "prefill_step_ms": statistics.median(side.prefill_ms[skip_prefill:])}
    out["decode_ratio"] = out["with"]["decode_ms"] / out["without"]["decode_ms"]
    out["prefill_ratio"] = out["with"]["prefill_step_ms"] / out["without"]["prefill_step_ms"]
    return out


def markdown(results: list[dict]) -> str:
    lines = ["| path | dtype | decode step without → with (ms) | ratio | prefill step without → with (ms) | ratio | tokens equal |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in results:
        lines.append(f"| {r['path']} | {r['dtype']} | {r['without']['decode_ms']:.2f} → {r['with']['decode_ms']:.2f} | "
                     f"{r['decode_ratio']:.3f} | {r['without']['prefill_step_ms']:.2f} → {r['with']['prefill_step_ms']:.2f} | "
                     f"{r['prefill_ratio']:.3f} | {r['tokens_equal']} |")
    when = results[0]["when"] if results else ""
    return (f"# CPU fast paths, paired ({when})\n\n`benchmarks/cpu_paths.py`: bench Qwen2-VL, {DECODE_ROWS} decoding "
            "sequences; prefill steps add two new 60-140-word prompts to them. Two engines stepped in turn in one "
            "process; medians.\n\n" + "\n".join(lines) + "\n\n`tokens equal`: every greedy token of both sides. "
            "lean-layers and native-rotary are bit-exact, so they must be; causal-padding, native-attention, "
            "native-norm, mkl-float32 and skinny-linear sum in another order "
            "(about one bf16 ulp), "
            "so a random-weight model's near-tied tokens may part (bf16 parity with transformers is "
            "tests/models/test_bf16_parity.py).\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--path", action="append", choices=("lean-layers", "causal-padding", "native-attention", "native-rotary",
                                                       "native-norm", "mkl-float32", "skinny-linear"))
    parser.add_argument("--decode-steps", type=int, default=60)
    parser.add_argument("--prefill-steps", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    paths = args.path or ["lean-layers", "causal-padding", "native-attention", "native-rotary", "native-norm"]
    if {"mkl-float32", "skinny-linear"} & set(paths) and args.dtype != "float32":
        parser.error("--path mkl-float32 / skinny-linear compare float32 kernels: add --dtype float32")
    results = [measure(p, args.dtype, args.decode_steps, args.prefill_steps) for p in paths]
    RESULTS.mkdir(exist_ok=True)
    name = "cpu_paths" if args.path is None else "cpu_paths-" + "-".join(paths)  # one path's run keeps the others'
    (RESULTS / f"{name}-{args.dtype}.json").write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / f"{name}-{args.dtype}.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
