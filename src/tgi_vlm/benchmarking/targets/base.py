"""What every target does: start (a session), warm up, serve requests one `submit` at a time, measure.

`Target.run` is the one measured run: warm-up outside the clock, then the load's own loop
(`load.Requests` / `load.Chats`) through the session's `submit`, timed from the first request to the
last answer; the session adds what only it can see (step records, CPU time, a profile, the dtype).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from tgi_vlm.benchmarking.load import Load, Progress
from tgi_vlm.benchmarking.results import RequestResult, ServingResult
from tgi_vlm.router.requests import RequestParams

if TYPE_CHECKING:
    from tgi_vlm.benchmarking.options import BenchOptions


class Session(ABC):
    """A started target, for one run."""

    @abstractmethod
    async def warm_up(self, load: Load) -> None:
        """One untimed request before the run (what it sends is the target's: see each target)."""

    @abstractmethod
    async def submit(self, params: RequestParams) -> RequestResult:
        """Serve one request; `submitted` is stamped when it is handed over, token times as tokens arrive."""

    def begin(self) -> None:  # noqa: B027 - optional: only targets that measure more than the requests need it
        """The measured run starts now (start CPU clocks, profilers)."""

    @abstractmethod
    def end(self, wall_s: float, results: list[RequestResult]) -> ServingResult:
        """The measured run has ended: its result, with what this target measured besides."""


class Target(ABC):
    name: ClassVar[str]  # its --target name
    switches_prefix_cache: ClassVar[bool] = False  # session(prefix_caching=...) is honoured (the prefix comparison)

    @classmethod
    @abstractmethod
    def from_options(cls, options: BenchOptions) -> Target:
        """Configured from the bench options; BenchError when they ask for what this target cannot do."""

    @property
    @abstractmethod
    def transport(self) -> str:
        """How requests reach it, for the report ("router driver", "HTTP <url>")."""

    @property
    def num_shard(self) -> int | None:
        """Shard ranks it started, for the report; None when it does not know (a server elsewhere)."""
        return None

    @property
    def name_suffix(self) -> str:
        """Appended to the default results name, so runs on different targets do not overwrite each other."""
        return f"-{self.name}"

    @abstractmethod
    def session(self, *, prefix_caching: bool | None = None,
                profile_to: Path | None = None) -> AbstractAsyncContextManager[Session]:
        """Start it (and stop it on exit). `prefix_caching`: None keeps the configured mode; `profile_to`:
        where a target that can profile its server writes the samples."""

    async def run(self, load: Load, *, prefix_caching: bool | None = None, profile_to: Path | None = None,
                  progress: Progress = None) -> ServingResult:
        async with self.session(prefix_caching=prefix_caching, profile_to=profile_to) as session:
            await session.warm_up(load)
            session.begin()
            start = time.perf_counter()
            results = await load.drive(session.submit, start, progress)
            return session.end(time.perf_counter() - start, results)
