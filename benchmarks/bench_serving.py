"""Serving benchmark: `tgi-vlm bench` (router + shard vs transformers generate), as a script.

    python benchmarks/bench_serving.py MODEL_DIR [tgi-vlm bench options]
    python benchmarks/bench_serving.py --bench-model   # the ~100M Qwen2-VL-shaped config, the issue's workload

--bench-model runs in float32, as results/serving-qwen2_vl-bench-n64-c16.json was measured (add --dtype bfloat16
after it for the default on a CPU with native bf16; a later --dtype wins).
"""

from __future__ import annotations

import sys

from tgi_vlm.cli import app


def main(argv: list[str]) -> None:
    if argv[:1] == ["--bench-model"]:
        from tgi_vlm.testing import tiny_model_path

        argv = [str(tiny_model_path("qwen2_vl", size="bench")), "--num-requests", "64", "--concurrency", "16",
                "--image-min", "64", "--image-max", "448", "--prompt-min", "16", "--prompt-max", "128",
                "--output-min", "16", "--output-max", "64", "--profile", "--dtype", "float32", *argv[1:]]
    app(["bench", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
