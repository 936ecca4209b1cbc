"""What both peer runners record per request and how they summarize it, as `tgi-vlm bench` does
(tgi_vlm.benchmarking.results): standard library only, so vLLM's virtualenv and any Python can import it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenTimes:
    """One request: when it was submitted and when each of its tokens arrived (perf_counter seconds)."""

    submitted: float
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.submitted if self.token_times else None

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 with numpy.percentile's default (linear) interpolation."""
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)
    out = {}
    for q in (50, 90, 99):
        rank = (len(ordered) - 1) * q / 100
        low = int(rank)
        high = min(low + 1, len(ordered) - 1)
        out[f"p{q}"] = ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
    return out
