"""Synthetic requests: images of varied sizes (generated test images), prompts of random words, output
lengths (`make_workload`, optionally all opening with one system prompt), and multi-turn conversations
that resend their growing history every turn (`make_conversations`). Deterministic for a seed: the same
bytes and lengths every run (benchmarks/peers replays them on other engines)."""

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
    system_tokens: int = 0  # > 0: every request opens with the same system prompt of about this many tokens
    adapters: tuple[str, ...] = ()  # LoRA adapter ids: request i runs on ("", *adapters)[i % (n + 1)]

    def to_dict(self) -> dict:
        values = asdict(self)
        adapters = values.pop("adapters")
        return {**values, "adapters": list(adapters)} if adapters else values  # results files as before without LoRA


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
    system = [prompt_of(spec.system_tokens, random.Random(spec.seed + 1), tokenizer) + "\n"] if spec.system_tokens else []
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
        params = RequestParams([*system, *images, text], max_new_tokens=outputs, ignore_eos=spec.ignore_eos,  # greedy
                               adapter_id=("", *spec.adapters)[i % (len(spec.adapters) + 1)])
        items.append(WorkItem(params, target, sizes, clock))
    return items


def make_video_workload(spec: WorkloadSpec, tokenizer) -> list[WorkItem]:
    """One clip per request (Qwen2-VL / Qwen2.5-VL): 4, 6 or 8 noise frames at 1, 2 or 4 fps, each side uniform in
    [image_min, image_max], h264 in mp4; then a prompt as `make_workload`. Deterministic for a seed."""
    from tgi_vlm.media import VideoBytes
    from tgi_vlm.video import encode_clip, make_test_frames

    rng = random.Random(spec.seed)
    items, clock = [], 0.0
    for i in range(spec.num_requests):
        frames, fps = rng.choice((4, 6, 8)), rng.choice((1, 2, 4))
        width, height = (rng.randint(spec.image_min, spec.image_max) // 2 * 2 for _ in range(2))  # yuv420p: even
        clip = encode_clip(make_test_frames(frames, width, height, seed=spec.seed * 100_003 + i), fps,
                           codec="h264", container="mp4")
        target = rng.randint(spec.prompt_min, spec.prompt_max)
        text = prompt_of(target, rng, tokenizer)
        outputs = rng.randint(spec.output_min, spec.output_max)
        if spec.rate:
            clock += rng.expovariate(spec.rate)
        params = RequestParams([VideoBytes(clip), text], max_new_tokens=outputs, ignore_eos=spec.ignore_eos)
        items.append(WorkItem(params, target, [], clock))
    return items


def prompt_of(tokens: int, rng: random.Random, tokenizer) -> str:
    """Text of about `tokens` tokens of random words."""
    text = " ".join(rng.choice(WORDS) for _ in range(tokens))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
    return tokenizer.decode(ids)


@dataclass(frozen=True)
class ConversationSpec:
    """Chats: each opens with a shared system prompt and its own images, then asks `turns` questions;
    every turn resends the whole history (system, images, earlier questions and answers)."""

    conversations: int = 16
    turns: int = 4
    images_min: int = 1
    images_max: int = 2
    image_min: int = 64  # pixels per side
    image_max: int = 448
    system_tokens: int = 64
    question_min: int = 16  # text tokens
    question_max: int = 48
    output_min: int = 16
    output_max: int = 32
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Conversation:
    opening: list[str | bytes]  # system prompt, then the images
    questions: list[str]  # one per turn
    max_new_tokens: list[int]  # one per turn (EOS ignored)
    image_sizes: list[tuple[int, int]] = field(default_factory=list)

    def turn(self, history: list[str | bytes], t: int) -> RequestParams:
        """Turn t's request: `history` (opening + earlier turns with their answers) + question t."""
        return RequestParams([*history, self.questions[t]], max_new_tokens=self.max_new_tokens[t], ignore_eos=True)


def make_conversations(spec: ConversationSpec, tokenizer) -> list[Conversation]:
    """Deterministic for a seed."""
    from tgi_vlm.images import make_test_image, png_bytes

    rng = random.Random(spec.seed)
    system = prompt_of(spec.system_tokens, random.Random(spec.seed + 1), tokenizer) + "\n"
    conversations = []
    for c in range(spec.conversations):
        sizes = [(rng.randint(spec.image_min, spec.image_max), rng.randint(spec.image_min, spec.image_max))
                 for _ in range(rng.randint(spec.images_min, spec.images_max))]
        images = [png_bytes(make_test_image(w, h, seed=spec.seed * 100_003 + c * 17 + k)) for k, (w, h) in enumerate(sizes)]
        questions = [f"\nQ{t + 1}: " + prompt_of(rng.randint(spec.question_min, spec.question_max), rng, tokenizer) + "\nA: "
                     for t in range(spec.turns)]
        outputs = [rng.randint(spec.output_min, spec.output_max) for _ in range(spec.turns)]
        conversations.append(Conversation([system, *images], questions, outputs, sizes))
    return conversations
