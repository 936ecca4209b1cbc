"""`tgi-vlm bench`: the named workload on the named target, through its comparison."""

from __future__ import annotations

from tgi_vlm.benchmarking.comparisons import COMPARISONS, Outcome
from tgi_vlm.benchmarking.options import BenchOptions
from tgi_vlm.benchmarking.targets import target_for
from tgi_vlm.benchmarking.workloads import workload_named


def run_bench(options: BenchOptions) -> Outcome:
    """Names and flags are checked before anything loads (BenchError); then the model's tokenizer builds the
    workload (the router's TokenCounter: the processor's own tokenizer), and the comparison runs it."""
    from tgi_vlm.router.tokens import TokenCounter

    workload = workload_named(options.workload)
    comparison = COMPARISONS[workload.comparison]
    target = target_for(options)
    comparison.check(workload, target)
    load = workload.build(options.load, TokenCounter(options.model_id).tokenizer)
    return comparison.run(workload, load, target, options)
