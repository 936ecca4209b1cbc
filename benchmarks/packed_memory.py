"""Bytes the served weights hold for the bench Qwen2-VL (100.8M parameters) as a bf16 directory, as its compressed-tensors
W4A16 copy (`tgi-vlm quantized-copy`, group 128, symmetric) and with `--quantize eetq`; bf16 activations. Each case
in a fresh process: load as a shard does, serve one short request, then `layers/weight_memory.weight_bytes` of the
model and of its language model.

    .venv/bin/python benchmarks/packed_memory.py       # writes results/packed_memory.{json,md}
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results"

CASE = r"""
import json, sys
from tgi_vlm.config import EngineConfig
from tgi_vlm.layers.weight_memory import weight_bytes
from tgi_vlm.models import get_model
from tgi_vlm.testing.harness import Runner, make_request
path, quantize = sys.argv[1], sys.argv[2] or None
engine = get_model(path, EngineConfig(device="cpu", dtype="bfloat16", cpu_kv_cache_bytes=64 << 20, quantize=quantize))
runner = Runner(engine)
runner.prefill([make_request(0, "hello world", max_new_tokens=4)])
runner.run()
print(json.dumps(dict(served=weight_bytes(engine.model), language_model=weight_bytes(engine.find_language_model()),
                      plan=engine.linear_plan.summary())))
"""


def main() -> None:
    from tgi_vlm.testing import build_tiny_model
    from tgi_vlm.testing.quantized_checkpoints import write_quantized_copy

    with tempfile.TemporaryDirectory() as tmp:
        float_dir = build_tiny_model("qwen2_vl", Path(tmp) / "bench", size="bench")
        packed_dir = write_quantized_copy(float_dir, Path(tmp) / "ct", "compressed-tensors", group=128)
        cases = {"bf16 directory": (float_dir, ""), "compressed-tensors W4A16 g128": (packed_dir, ""),
                 "bf16 directory, --quantize eetq": (float_dir, "eetq")}
        results = {}
        for name, (path, quantize) in cases.items():
            out = subprocess.run([sys.executable, "-c", CASE, str(path), quantize], capture_output=True, text=True,
                                 check=True).stdout.strip().splitlines()[-1]
            results[name] = json.loads(out)
    lines = ["# Weights held, bench Qwen2-VL, bf16 activations", "",
             "| served as | weights held MB | of which the language model MB | plan |", "|---|---:|---:|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['served'] / 1e6:.1f} | {r['language_model'] / 1e6:.1f} | {r['plan']} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "packed_memory.json").write_text(json.dumps(results, indent=1))
    (RESULTS / "packed_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
