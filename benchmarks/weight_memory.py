"""Bytes the served weights hold, per format, for README's memory table: the Gemma 3 270M GGUF file served as it is,
its de-quantized directory in bf16 and float32, and bf16 with `--quantize eetq`. Each case in a fresh process: load
as a shard does, serve two short requests (the packed decode copies are made on first use), then
`layers/weight_memory.weight_bytes` and the process RSS (after gc and malloc_trim).

    .venv/bin/python benchmarks/weight_memory.py          # needs '.[real-models]'; writes results/weight_memory.{json,md}
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"

CASE = r"""
import ctypes, gc, json, sys, psutil
from tgi_vlm.config import EngineConfig
from tgi_vlm.layers.weight_memory import weight_bytes
from tgi_vlm.models import get_model
from tgi_vlm.testing.harness import Runner, make_request
path, dtype, quantize = sys.argv[1], sys.argv[2], sys.argv[3] or None
engine = get_model(path, EngineConfig(device="cpu", dtype=dtype, cpu_kv_cache_bytes=64 << 20, quantize=quantize))
at_load = weight_bytes(engine.model)
runner = Runner(engine)
runner.prefill([make_request(0, "The capital of France is", max_new_tokens=4), make_request(1, "Hello " * 40, max_new_tokens=4)])
runner.run()
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
print(json.dumps(dict(at_load=at_load, served=weight_bytes(engine.model), rss=psutil.Process().memory_info().rss)))
"""


def main() -> None:
    from tgi_vlm.testing.machine import machine
    from tgi_vlm.testing.real_models import gemma3_270m_dir, gemma3_270m_gguf

    gguf, directory = gemma3_270m_gguf(), gemma3_270m_dir()
    cases = [("the GGUF file", gguf, "bfloat16", ""), ("de-quantized directory, bf16", directory, "bfloat16", ""),
             ("de-quantized directory, bf16, --quantize eetq", directory, "bfloat16", "eetq"),
             ("de-quantized directory, float32", directory, "float32", "")]
    rows = []
    for name, path, dtype, quantize in cases:
        done = subprocess.run([sys.executable, "-c", CASE, str(path), dtype, quantize], capture_output=True,
                              text=True, check=True)
        rows.append(dict(case=name, dtype=dtype, **json.loads(done.stdout.strip().splitlines()[-1])))
        print(rows[-1], flush=True)
    file_bytes = gguf.stat().st_size
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "weight_memory.json").write_text(json.dumps(dict(machine=machine(), file_bytes=file_bytes,
                                                                rows=rows), indent=1) + "\n")
    lines = [f"# Weights held by the shard, Gemma 3 270M (the GGUF file: {file_bytes / 1e6:.1f} MB)", "",
             f"- machine: {machine()}", "",
             "| served as | dtype | weights at load MB | weights serving MB | x file | process RSS GB |",
             "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['case']} | {r['dtype']} | {r['at_load'] / 1e6:.1f} | {r['served'] / 1e6:.1f} | "
              f"{r['served'] / file_bytes:.2f} | {r['rss'] / 1e9:.2f} |" for r in rows]
    (RESULTS / "weight_memory.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
