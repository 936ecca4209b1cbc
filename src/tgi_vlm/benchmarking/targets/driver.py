"""The "driver" target: the router driver (router/) against a shard, as `generate` and `launch` run it.

The session starts the shard as TGI's launcher does (`RouterConfig.num_shard` ranks; `shard_args` such as
--dtype) or connects to one already on `uds_path`, and a router over it (`router.session.router_session`).
Besides the requests it reports the router's step records and RPC counts, its prefix-cache figures, the
CPU time of the shard processes and of this process (router and token counting), a py-spy profile of the
shard when asked, and the shard's dtype (its Info).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from tgi_vlm.benchmarking.load import Load
from tgi_vlm.benchmarking.options import BenchOptions
from tgi_vlm.benchmarking.profile import start_profiler, stop_profiler
from tgi_vlm.benchmarking.results import RequestResult, ServingResult
from tgi_vlm.benchmarking.targets import register
from tgi_vlm.benchmarking.targets.base import Session, Target
from tgi_vlm.router.requests import RequestParams
from tgi_vlm.router.router import Router, RouterConfig
from tgi_vlm.router.session import Session as RouterSession
from tgi_vlm.router.session import router_session

# The warm-up's images are its own (benchmarks/peers/export_workload.py writes the same ones for peers).
WARM_UP_IMAGE_SEED = 999_983


@register
@dataclass
class DriverTarget(Target):
    name = "driver"
    switches_prefix_cache = True

    model_id: str
    config: RouterConfig = field(default_factory=RouterConfig)
    uds_path: str | None = None
    shard_args: Sequence[str] = ()
    shard_env: Mapping[str, str] | None = None  # the shard's environment on top of ours (benchmarks/revision_ab.py)

    @classmethod
    def from_options(cls, options: BenchOptions) -> DriverTarget:
        return cls(options.model_id, options.router, options.uds_path, options.shard_args)

    @property
    def transport(self) -> str:
        return "router driver"

    @property
    def num_shard(self) -> int:
        return self.config.num_shard

    @property
    def name_suffix(self) -> str:
        return ""  # the default target: results keep their historical names

    @asynccontextmanager
    async def session(self, *, prefix_caching: bool | None = None,
                      profile_to: Path | None = None) -> AsyncIterator[DriverSession]:
        config = self.config if prefix_caching is None else replace(self.config, prefix_caching=prefix_caching)
        async with router_session(self.model_id, uds_path=self.uds_path, shard_env=self.shard_env,
                                  shard_args=self.shard_args, config=config) as session:
            yield DriverSession(session, profile_to)


class DriverSession(Session):
    def __init__(self, session: RouterSession, profile_to: Path | None) -> None:
        self.router = session.router
        self.shard = session.shard  # None when we connected to a running shard
        self.profile_to = profile_to
        self.spy = None
        self.cpu: CpuClock | None = None

    async def warm_up(self, load: Load) -> None:
        await warm_up(self.router, load.first_image_sizes)

    async def submit(self, params: RequestParams) -> RequestResult:
        submitted = time.perf_counter()
        tokens, final = await (await self.router.submit(params)).final()
        return RequestResult([t.token_id for t in tokens], submitted, [t.time for t in tokens], final.error,
                             text=final.text)

    def begin(self) -> None:
        self.spy = start_profiler(self.shard, self.profile_to)
        self.cpu = CpuClock(self.shard)

    def end(self, wall_s: float, results: list[RequestResult]) -> ServingResult:
        used = self.cpu.used()
        profile = stop_profiler(self.spy, self.profile_to)
        router = self.router
        return ServingResult(wall_s, results, list(router.steps), dict(router.calls), profile,
                             router.prefix_stats.to_dict(), used, router.shard.info.dtype)


async def warm_up(router: Router, image_sizes: list[tuple[int, int]]) -> None:
    """One short request with images of the workload's first sizes but content of its own (so that
    it leaves nothing in the prefix cache a measured request could use); then the counters restart."""
    from tgi_vlm.images import make_test_image, png_bytes

    images = [png_bytes(make_test_image(w, h, seed=WARM_UP_IMAGE_SEED + k)) for k, (w, h) in enumerate(image_sizes)]
    await (await router.submit(RequestParams([*images, "warm up"], max_new_tokens=2, ignore_eos=True))).final()
    router.steps.clear()
    router.calls.clear()
    router.prefix_stats.reset_counters()


class CpuClock:
    """CPU seconds (user + system) used since creation by the shard processes we started (every rank)
    and by this process (router, token counter): on a shared machine, steadier than wall time."""

    def __init__(self, shard) -> None:
        self.pids = [process.pid for process in shard.processes] if shard is not None else []
        self.start = self._now()

    def _now(self) -> dict[str, float]:
        times = {"router": time.process_time()}
        try:
            if self.pids:
                times["shard"] = sum(_cpu_seconds(pid) for pid in self.pids)
        except (OSError, IndexError, ValueError):
            pass
        return times

    def used(self) -> dict[str, float]:
        now = self._now()
        return {k: now[k] - self.start[k] for k in now if k in self.start}


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
