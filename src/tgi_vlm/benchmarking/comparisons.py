"""What a workload's served run is compared with, found by name (a workload names its comparison).

    reference       the target's run, then (--hf) the same requests through transformers' generate:
                    throughput ratio, latency percentiles, exact output matches (report.py)
    prefix-caching  the same workload twice on the target, its prefix cache off then on, each mode on a
                    fresh session (prefix_report.py); needs a target that can switch it (the driver)

Each returns an `Outcome`: tables and lines for the terminal, and the files it wrote.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from tgi_vlm.benchmarking import prefix_report, report
from tgi_vlm.benchmarking.load import Load, Requests
from tgi_vlm.benchmarking.options import BenchError, BenchOptions
from tgi_vlm.benchmarking.progress import progress_display
from tgi_vlm.benchmarking.references import transformers as reference
from tgi_vlm.benchmarking.results import ServingResult
from tgi_vlm.benchmarking.targets.base import Target

if TYPE_CHECKING:
    from tgi_vlm.benchmarking.workloads import Workload


@dataclass
class Outcome:
    tables: list = field(default_factory=list)  # rich renderables, printed first
    lines: list[str] = field(default_factory=list)  # then these
    written: list[Path] = field(default_factory=list)  # then "wrote PATH" for each


class Comparison(Protocol):
    def check(self, workload: Workload, target: Target) -> None:
        """BenchError when this comparison cannot run that workload on that target (before any work)."""

    def run(self, workload: Workload, load: Load, target: Target, options: BenchOptions) -> Outcome: ...


class AgainstReference:
    def check(self, workload: Workload, target: Target) -> None:
        pass

    def run(self, workload: Workload, load: Load, target: Target, options: BenchOptions) -> Outcome:
        if not isinstance(load, Requests):
            raise BenchError(f"--workload {workload.name}: the reference comparison runs independent requests")
        o = options.load
        name = options.name or (f"serving-{Path(options.model_id).name}-n{o.num_requests}"
                                f"-c{o.concurrency if not o.rate else f'r{o.rate}'}" + target.name_suffix)
        options.out_dir.mkdir(parents=True, exist_ok=True)
        profile_to = options.out_dir / f"{name}.pyspy.txt" if options.profile else None
        with progress_display() as progress:
            task = progress.add_task("tgi-vlm", total=len(load))
            serving = asyncio.run(target.run(load, profile_to=profile_to, progress=lambda: progress.advance(task)))
            found = None
            if options.hf:
                ref_task = progress.add_task("transformers", total=len(load))
                found = reference.run_reference(
                    options.model_id, load.items, options.hf_batch_size or o.concurrency,
                    progress=lambda n: progress.advance(ref_task, n),
                    dtype=reference.reference_dtype(options.model_id, serving.dtype, options.dtype))
        summary = report.summarize(load.spec, load.items, serving, found, options.model_id)
        summary["transport"] = target.transport
        summary["num_shard"] = target.num_shard
        return Outcome([report.result_table(summary)], report.summary_lines(summary),
                       report.write_results(summary, options.out_dir, name))


class PrefixCacheOffOn:
    def check(self, workload: Workload, target: Target) -> None:
        if not target.switches_prefix_cache:
            raise BenchError(f"--workload {workload.name} compares the router driver's prefix cache off and on: "
                             f"--target {target.name} cannot switch it (run it on the driver target)")

    def run(self, workload: Workload, load: Load, target: Target, options: BenchOptions) -> Outcome:
        name = options.name or f"prefix-{workload.name}-{Path(options.model_id).name}"
        machine = prefix_report.machine_info()
        with progress_display(live=False) as progress:
            task = progress.add_task(f"{workload.name}, prefix caching off then on", total=2 * len(load))
            results = asyncio.run(run_modes(target, load, progress=lambda: progress.advance(task)))
        summary = prefix_report.compare(workload.name, load.spec, results, options.model_id, machine)
        summary["machine_end"] = prefix_report.machine_info()
        return Outcome([], prefix_report.summary_lines(summary),
                       prefix_report.write(summary, options.out_dir, name))


async def run_modes(target: Target, load: Load, progress=None) -> dict[str, ServingResult]:
    """The load once per mode (prefix caching off, then on), each on a fresh session."""
    return {name: await target.run(load, prefix_caching=on, progress=progress) for name, on in prefix_report.MODES}


COMPARISONS: dict[str, Comparison] = {"reference": AgainstReference(), "prefix-caching": PrefixCacheOffOn()}
