"""What `tgi-vlm bench` was asked to do, as typed values (the CLI parses its flags into these)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tgi_vlm.router.router import RouterConfig


class BenchError(ValueError):
    """A benchmark that cannot run as asked: an unknown name, or flags the chosen target cannot honour."""


@dataclass(frozen=True)
class WorkloadOptions:
    """The workload flags; each workload reads the ones it uses (synthetic.WorkloadSpec / ConversationSpec)."""

    num_requests: int = 64
    images_per_request: int = 1
    image_min: int = 64  # pixels per side
    image_max: int = 448
    prompt_min: int = 16  # text tokens
    prompt_max: int = 128
    output_min: int = 16
    output_max: int = 64
    concurrency: int | None = 16  # closed loop: this many in flight
    rate: float | None = None  # open loop: Poisson arrivals per second (overrides concurrency)
    seed: int = 0
    ignore_eos: bool = True
    system_tokens: int = 0  # a shared system prompt of about this many tokens (0: none; a workload may default it)
    conversations: int = 16  # multiturn
    turns: int = 4
    adapters: tuple[str, ...] = ()  # LoRA adapter ids: request i runs on ("", *adapters)[i % (n + 1)]


@dataclass(frozen=True)
class BenchOptions:
    model_id: str
    workload: str = "synthetic"  # a name in workloads.WORKLOADS
    target: str | None = None  # a name in targets.TARGETS; None: "http" when `url` is given, else "driver"
    load: WorkloadOptions = field(default_factory=WorkloadOptions)
    router: RouterConfig = field(default_factory=RouterConfig)  # the driver target's router (limits, prefix cache, ranks)
    uds_path: str | None = None  # driver: a running shard's socket, or where to start one
    shard_args: tuple[str, ...] = ()  # driver: extra `serve` flags for the shard it starts (--dtype)
    url: str | None = None  # http: the server's base URL
    api_key: str | None = None  # http: bearer token
    dtype: str | None = None  # --dtype: the shard's; over HTTP what that server runs (for the reference)
    hf: bool = True  # also run transformers' generate (the reference comparison)
    hf_batch_size: int | None = None  # its static batch size (None: the workload's concurrency)
    profile: bool = False  # py-spy the shard (driver)
    out_dir: Path = Path("benchmarks/results")
    name: str | None = None  # results file stem (None: each comparison's default)

    @property
    def target_name(self) -> str:
        return self.target or ("http" if self.url else "driver")
