"""What a benchmark run measures: per request, per serving run, per reference run (shared by every target)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tgi_vlm.router.router import StepRecord


@dataclass
class RequestResult:
    tokens: list[int]
    submitted: float  # time.perf_counter() when the target was handed the request
    token_times: list[float]  # when each token reached this process
    error: str | None = None
    turn: int = 0  # conversation turn (0 for single requests)
    text: str = ""  # the generated text (a conversation resends it with its next turn)

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
    steps: list[StepRecord]  # the router driver's Prefill/Decode records; empty over HTTP
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
