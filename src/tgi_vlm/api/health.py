"""TGI's /health: which check runs depends on how the last generations went (router/src/infer/mod.rs).

While generation is healthy, /health asks the shards' Health RPC (can they allocate). Once a request's
stream ended in an error, the next /health runs the model itself instead: the one-token liveness
Prefill (id 2^64-1, block 0, slot 0), sent to every rank. Whichever check ran sets the flag for
the next call, so one passing liveness Prefill brings back the cheap check.
"""

from __future__ import annotations

import asyncio
from typing import Protocol


class HealthClient(Protocol):
    async def health(self) -> object: ...

    async def liveness(self) -> object: ...


class BackendHealth:
    def __init__(self, timeout_s: float = 10.0):
        self.healthy = True  # TGI's start_health for the v3 backend
        self.timeout_s = timeout_s

    def generation_failed(self) -> None:
        """A request's stream ended in an error (TGI stores false on any error of the stream)."""
        self.healthy = False

    async def check(self, client: HealthClient) -> bool:
        call = client.health() if self.healthy else client.liveness()
        try:
            await asyncio.wait_for(call, self.timeout_s)
            ok = True
        except Exception:  # noqa: BLE001 - any failure to reach or run the shard is "unhealthy"
            ok = False
        self.healthy = ok
        return ok
