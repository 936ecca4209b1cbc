"""Write `tgi-vlm bench`'s requests to a workload directory (workload_file.py) for a peer engine to replay.

    python benchmarks/peers/export_workload.py MODEL OUT_DIR [-n 64] [--seed 0]

Runs with the project's interpreter. The requests are `tgi_vlm.benchmarking.synthetic.make_workload`'s for the same
spec as `tgi-vlm bench`'s defaults (WorkloadSpec's defaults: 1 image of 64-448 px per side, 16-128 text
tokens, 16-64 new tokens, seed 0; `--images-per-request 0` for a text model, whose prompt is the text); the warm-up request is the one `tgi_vlm.benchmarking.targets.driver.warm_up` sends. Each
prompt is laid out by the model's own prompt adapter (for Qwen2-VL: `<|vision_start|><|image_pad|>
<|vision_end|>` per image, then the text; no chat template), and its token ids are computed by the router's
TokenCounter, which runs the shard's intake code: the ids the shard prefills.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload_file import Workload, write_workload  # noqa: E402

WARMUP_TEXT = "warm up"  # tgi_vlm.benchmarking.targets.driver.warm_up's request: its own images, this text, 2 new tokens
WARMUP_TOKENS = 2
WARMUP_IMAGE_SEED = 999_983


def export_workload(model: str, out_dir: Path, *, num_requests: int = 64, concurrency: int = 16,
                    seed: int = 0, images_per_request: int = 1) -> Workload:
    from transformers import AutoConfig

    from tgi_vlm.benchmarking.synthetic import WorkloadSpec, make_workload
    from tgi_vlm.images import make_test_image, png_bytes
    from tgi_vlm.media import MediaKind
    from tgi_vlm.router.tokens import TokenCounter

    counter = TokenCounter(model)
    if counter.prompt is None and images_per_request:
        raise SystemExit(f"{model} is not a vision-language model: pass --images-per-request 0")
    spec = replace(WorkloadSpec(), num_requests=num_requests, concurrency=concurrency, seed=seed,
                   images_per_request=images_per_request)
    items = make_workload(spec, counter.tokenizer)

    def layout(chunks: list[str | bytes]) -> tuple[str, list[bytes]]:
        if counter.prompt is None:  # a text model: the text as it is (the tokenizer adds what it adds)
            return "".join(chunks), []
        prompt = counter.prompt.build_prompt([c if isinstance(c, str) else MediaKind.IMAGE for c in chunks])
        return prompt, [c for c in chunks if isinstance(c, bytes)]

    warm_images = [png_bytes(make_test_image(w, h, seed=WARMUP_IMAGE_SEED + k))
                   for k, (w, h) in enumerate(items[0].image_sizes)]
    warm_prompt, _ = layout([*warm_images, WARMUP_TEXT])
    requests = []
    for i, item in enumerate(items):
        prompt, images = layout(item.params.chunks)
        requests.append((prompt, images, item.params.max_new_tokens, counter.input_ids(item.params.to_pb(i))))
    from tgi_vlm.quantization.gguf_file import pretrained_source

    source, gguf_args = pretrained_source(model)  # a GGUF file: its directory and gguf_file=
    model_type = AutoConfig.from_pretrained(source, **gguf_args).model_type
    return write_workload(out_dir, model=Path(model).name, model_type=model_type, spec=spec.to_dict(),
                          warmup=(warm_prompt, warm_images, WARMUP_TOKENS), requests=requests)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", help="model directory (or hub id) tgi-vlm bench runs")
    p.add_argument("out_dir", type=Path)
    p.add_argument("-n", "--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16, help="recorded in the spec; the runner uses it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--images-per-request", type=int, default=1, help="0 for a text model")
    a = p.parse_args(argv)
    w = export_workload(a.model, a.out_dir, num_requests=a.num_requests, concurrency=a.concurrency, seed=a.seed,
                        images_per_request=a.images_per_request)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in w.requests)
    print(f"wrote {a.out_dir}: {len(w.requests)} requests, {prompt_tokens} prompt tokens, "
          f"{sum(r.max_new_tokens for r in w.requests)} new tokens, digest {w.digest}")


if __name__ == "__main__":
    main()
