"""GET /metrics: Prometheus text under TGI's metric names (router/src/server.rs, docs/reference/metrics.md).

Histograms and gauges render exactly as TGI's (`tgi_request_duration_bucket{le=...}`, ...). TGI's
counters are exposed without the `_total` suffix (`tgi_request_count 3`), which prometheus_client's
Counter always adds, so they are kept here and rendered as untyped samples of the same names.
Queue size and KV blocks are read from the router driver at scrape time; batch figures come from
its step listener (one call per Prefill/Decode). Names starting `tgi_vlm_` are ours, not TGI's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from tgi_vlm.router.router import Router, StepRecord

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

COUNTERS = {
    "tgi_request_count": "Total number of requests",
    "tgi_request_success": "Number of successful requests",
    "tgi_request_failure": "Number of failed requests, by error type (err)",
    "tgi_batch_inference_count": "Inference calls per method (prefill or decode)",
    "tgi_batch_inference_success": "Number of successful inference calls per method (prefill or decode)",
    "tgi_vlm_request_cancelled": "Requests whose client disconnected before the end (their KV blocks are freed)",
}

DURATION_BUCKETS = [0.0001 * 1.5**k for k in range(1, 36)]  # TGI's geometric buckets


class CounterSet(Collector):
    """Counters with TGI's bare names, rendered untyped (`tgi_request_count 3`, no `_total`)."""

    def __init__(self, descriptions: dict[str, str]):
        self.descriptions = descriptions
        self.values: dict[str, dict[tuple[tuple[str, str], ...], float]] = defaultdict(dict)

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[name][key] = self.values[name].get(key, 0.0) + amount

    def value(self, name: str, **labels: str) -> float:
        return self.values[name].get(tuple(sorted(labels.items())), 0.0)

    def collect(self) -> Iterator[Metric]:
        for name, doc in self.descriptions.items():
            metric = Metric(name, doc, "unknown")
            for key, value in (self.values.get(name) or {(): 0.0}).items():
                metric.add_sample(name, dict(key), value)
            yield metric


class RouterGauges(Collector):
    """Figures read from the router driver when Prometheus scrapes."""

    def __init__(self, router: Router):
        self.router = router

    def collect(self) -> Iterator[Metric]:
        router = self.router
        yield _gauge("tgi_queue_size", "Current queue size", len(router.queue) if router.queue else 0)
        allocator = router.allocator
        if allocator is not None:
            yield _gauge("tgi_batch_total_tokens", "Maximum amount of tokens in total.",
                         allocator.capacity * allocator.block_size)
            yield _gauge("tgi_vlm_kv_blocks_total", "KV cache blocks the router allocates from", allocator.capacity)
            yield _gauge("tgi_vlm_kv_blocks_free", "KV cache blocks not held by any request", allocator.num_free)
            yield _gauge("tgi_vlm_kv_block_size", "Tokens per KV cache block", allocator.block_size)
        if router.config.prefix_caching:
            stats = router.prefix_stats
            for name, doc in PREFIX_FIGURES.items():
                yield _gauge(f"tgi_vlm_prefix_cache_{name}", doc, getattr(stats, name))


# The router driver's prefix-cache counters (router/prefix_cache.PrefixStats), as running totals.
PREFIX_FIGURES = {
    "requests": "Prefills the shard accepted",
    "prompt_tokens": "Their prompt tokens",
    "cached_tokens": "Prompt tokens taken from the prefix cache instead of computed",
    "hits": "Prefills that took a cached prefix",
}


def _gauge(name: str, doc: str, value: float) -> Metric:
    metric = Metric(name, doc, "gauge")
    metric.add_sample(name, {}, value)
    return metric


class Metrics:
    def __init__(self, router: Router, max_input_tokens: int, max_total_tokens: int):
        disable_created_metrics()  # TGI has no `_created` series
        self.registry = CollectorRegistry()
        self.counters = CounterSet(COUNTERS)
        self.registry.register(self.counters)
        self.registry.register(RouterGauges(router))

        def histogram(name: str, doc: str, buckets: list[float], labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        def lengths(limit: int) -> list[float]:
            return [limit / 100 * (x + 1) for x in range(100)]

        self.request_duration = histogram("tgi_request_duration", "Request duration", DURATION_BUCKETS)
        self.validation_duration = histogram("tgi_request_validation_duration", "Request validation duration",
                                             DURATION_BUCKETS)
        self.inference_duration = histogram("tgi_request_inference_duration", "Request inference duration",
                                            DURATION_BUCKETS)
        self.time_per_token = histogram("tgi_request_mean_time_per_token_duration",
                                        "Mean time per token per request", DURATION_BUCKETS)
        self.generated_tokens = histogram("tgi_request_generated_tokens", "Generated tokens per request",
                                          lengths(max_total_tokens))
        self.input_length = histogram("tgi_request_input_length", "Input token length per request",
                                      lengths(max_input_tokens))
        self.max_new_tokens = histogram("tgi_request_max_new_tokens", "Maximum new tokens per request",
                                        lengths(max_total_tokens))
        self.batch_forward = histogram("tgi_batch_forward_duration",
                                       "Batch forward duration per method (prefill or decode)", DURATION_BUCKETS,
                                       ("method",))
        self.batch_decode = histogram("tgi_batch_decode_duration",
                                      "Time spent decoding a batch per method (prefill or decode)", DURATION_BUCKETS,
                                      ("method",))
        self.batch_inference = histogram("tgi_batch_inference_duration", "Batch inference duration",
                                         DURATION_BUCKETS, ("method",))
        self.batch_size = Gauge("tgi_batch_current_size", "Current batch size", registry=self.registry)
        router.step_listeners.append(self.on_step)

    def on_step(self, step: StepRecord) -> None:
        method = "decode" if step.kind == "decode" else "prefill"
        self.counters.inc("tgi_batch_inference_count", method=method)
        self.counters.inc("tgi_batch_inference_success", method=method)
        self.batch_forward.labels(method).observe(step.forward_ns / 1e9)
        self.batch_decode.labels(method).observe(step.decode_ns / 1e9)
        self.batch_inference.labels(method).observe(step.wall_s)
        self.batch_size.set(step.size)

    def request_done(self, *, total_s: float, validation_s: float, inference_s: float, generated_tokens: int,
                     input_length: int, max_new_tokens: int) -> None:
        self.counters.inc("tgi_request_success")
        self.request_duration.observe(total_s)
        self.validation_duration.observe(validation_s)
        self.inference_duration.observe(inference_s)
        self.time_per_token.observe(inference_s / max(generated_tokens, 1))
        self.generated_tokens.observe(generated_tokens)
        self.input_length.observe(input_length)
        self.max_new_tokens.observe(max_new_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
