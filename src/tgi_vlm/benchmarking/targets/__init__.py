"""Targets: what serves a benchmark's requests, found by name (`tgi-vlm bench --target NAME`).

    base.py    Target (configured from the bench options) and Session (one started target: warm up,
               submit, measure); `Target.run(load)` → ServingResult, the same for every target
    driver.py  "driver": the router driver (router/) against a shard started as TGI's launcher does,
               or one already listening on --uds-path
    http.py    "http": TGI's HTTP API of a running `tgi-vlm launch` (or TGI) at --url

A new target is one module here with a `@register`ed `Target` subclass (its `name`, `from_options`,
`session`), added to `_load_all`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tgi_vlm.benchmarking.options import BenchError

if TYPE_CHECKING:
    from tgi_vlm.benchmarking.options import BenchOptions
    from tgi_vlm.benchmarking.targets.base import Target

TARGETS: dict[str, type[Target]] = {}


def register(cls: type[Target]) -> type[Target]:
    TARGETS[cls.name] = cls
    return cls


def target_names() -> list[str]:
    _load_all()
    return list(TARGETS)


def target_for(options: BenchOptions) -> Target:
    """The target the options name, configured from them; BenchError when unknown or misconfigured."""
    _load_all()
    name = options.target_name
    if name not in TARGETS:
        raise BenchError(f"unknown --target {name!r}; known: {', '.join(TARGETS)}")
    return TARGETS[name].from_options(options)


def _load_all() -> None:
    # Importing the modules runs their @register decorators.
    from tgi_vlm.benchmarking.targets import driver, http  # noqa: F401
