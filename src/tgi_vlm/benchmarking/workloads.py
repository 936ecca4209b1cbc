"""Named workloads: what `tgi-vlm bench --workload NAME` sends, and what its run is compared with.

    synthetic      independent image+text requests (synthetic.make_workload), closed or open loop;
                   compared with transformers' generate
    multiturn      conversations resending their history every turn (synthetic.make_conversations);
                   the driver's prefix cache off vs on
    shared-prefix  independent requests that all open with one system prompt (default 256 tokens);
                   the driver's prefix cache off vs on
    video          one short clip + text per request (Qwen2-VL / Qwen2.5-VL); compared with transformers' generate

A new workload is one `register(Workload(...))`: its name, a line saying what it is, the comparison it
runs (a key of comparisons.COMPARISONS) and `build`: the bench's workload options and the model's
tokenizer → a `Load` (`load.Requests` or `load.Chats`) that any target runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tgi_vlm.benchmarking.load import Chats, Load, Requests
from tgi_vlm.benchmarking.options import BenchError, WorkloadOptions
from tgi_vlm.benchmarking.synthetic import (
    ConversationSpec,
    WorkloadSpec,
    make_conversations,
    make_video_workload,
    make_workload,
)


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    comparison: str  # a key of comparisons.COMPARISONS
    build: Callable[[WorkloadOptions, Any], Load]  # (options, the model's tokenizer) → its requests


WORKLOADS: dict[str, Workload] = {}


def register(workload: Workload) -> Workload:
    WORKLOADS[workload.name] = workload
    return workload


def workload_named(name: str) -> Workload:
    if name not in WORKLOADS:
        raise BenchError(f"unknown --workload {name!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def serving_spec(o: WorkloadOptions, system_tokens: int) -> WorkloadSpec:
    return WorkloadSpec(o.num_requests, o.images_per_request, o.image_min, o.image_max, o.prompt_min, o.prompt_max,
                        o.output_min, o.output_max, o.concurrency, o.rate, o.seed, ignore_eos=o.ignore_eos,
                        system_tokens=system_tokens, adapters=o.adapters)


def _serving(o: WorkloadOptions, tokenizer) -> Requests:
    spec = serving_spec(o, o.system_tokens)
    return Requests(spec, make_workload(spec, tokenizer))


def _shared_prefix(o: WorkloadOptions, tokenizer) -> Requests:
    spec = serving_spec(o, o.system_tokens or 256)
    return Requests(spec, make_workload(spec, tokenizer))


def _video(o: WorkloadOptions, tokenizer) -> Requests:
    spec = serving_spec(o, 0)
    return Requests(spec, make_video_workload(spec, tokenizer))


def _multiturn(o: WorkloadOptions, tokenizer) -> Chats:
    spec = ConversationSpec(conversations=o.conversations, turns=o.turns, seed=o.seed)
    return Chats(spec, make_conversations(spec, tokenizer))


register(Workload("synthetic", "image+text requests of varied sizes and lengths, vs transformers", "reference",
                  _serving))
register(Workload("multiturn", "conversations resending their history, the prefix cache off vs on",
                  "prefix-caching", _multiturn))
register(Workload("shared-prefix", "requests opening with one system prompt, the prefix cache off vs on",
                  "prefix-caching", _shared_prefix))
register(Workload("video", "one clip (4-8 frames at 1-4 fps) + text per request, vs transformers", "reference",
                  _video))
