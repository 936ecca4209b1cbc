"""Synthetic serving workloads: requests with images of varied sizes, prompt and output lengths."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

from tgi_vlm.router.requests import RequestParams

WORDS = ("the a picture shows red blue green sky sea tree house cat dog road car light dark small large old new "
         "city river mountain person walking under over near far left right top bottom bright color shape").split()


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 64
    images_per_request: int = 1
    image_min: int = 64  # pixels per side, uniform in [min, max] for width and height
    image_max: int = 448
    prompt_min: int = 16  # text tokens
    prompt_max: int = 128
    output_min: int = 16
    output_max: int = 64
    concurrency: int | None = 16  # closed loop: this many in flight
    rate: float | None = None  # open loop: Poisson arrivals per second (overrides concurrency)
    seed: int = 0
    ignore_eos: bool = True  # every request runs its full length (off: greedy outputs may stop at EOS)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class WorkItem:
    params: RequestParams
    prompt_tokens: int
    image_sizes: list[tuple[int, int]] = field(default_factory=list)
    arrival_s: float = 0.0  # offset from the start (open loop only)


def make_workload(spec: WorkloadSpec, tokenizer) -> list[WorkItem]:
    """Deterministic for a seed: the same images, prompts and lengths every run."""
    from tgi_vlm.images import make_test_image, png_bytes

    rng = random.Random(spec.seed)
    items, clock = [], 0.0
    for i in range(spec.num_requests):
        sizes = [(rng.randint(spec.image_min, spec.image_max), rng.randint(spec.image_min, spec.image_max))
                 for _ in range(spec.images_per_request)]
        images = [png_bytes(make_test_image(w, h, seed=spec.seed * 100_003 + i * 17 + k)) for k, (w, h) in enumerate(sizes)]
        target = rng.randint(spec.prompt_min, spec.prompt_max)
        text = prompt_of(target, rng, tokenizer)
        outputs = rng.randint(spec.output_min, spec.output_max)
        if spec.rate:
            clock += rng.expovariate(spec.rate)
        params = RequestParams([*images, text], max_new_tokens=outputs, ignore_eos=spec.ignore_eos)  # greedy
        items.append(WorkItem(params, target, sizes, clock))
    return items


def prompt_of(tokens: int, rng: random.Random, tokenizer) -> str:
    """Text of about `tokens` tokens of random words."""
    text = " ".join(rng.choice(WORDS) for _ in range(tokens))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
    return tokenizer.decode(ids)
