"""api/health.py: /health asks Health while generation is fine, the liveness Prefill after a failure (TGI)."""

from __future__ import annotations

import asyncio

from tgi_vlm.api.health import BackendHealth


class Client:
    def __init__(self, health_ok: bool = True, liveness_ok: bool = True):
        self.calls: list[str] = []
        self.health_ok, self.liveness_ok = health_ok, liveness_ok

    async def health(self):
        self.calls.append("health")
        if not self.health_ok:
            raise ConnectionError("shard gone")

    async def liveness(self):
        self.calls.append("liveness")
        if not self.liveness_ok:
            raise RuntimeError("prefill failed")


def check(health: BackendHealth, client: Client) -> bool:
    return asyncio.run(health.check(client))


def test_healthy_generation_asks_the_health_rpc_only():
    health, client = BackendHealth(), Client()
    assert check(health, client) and check(health, client)
    assert client.calls == ["health", "health"]


def test_after_a_failed_generation_the_next_check_runs_the_model_then_returns_to_health():
    health, client = BackendHealth(), Client()
    health.generation_failed()
    assert check(health, client)
    assert check(health, client)
    assert client.calls == ["liveness", "health"]


def test_a_failing_liveness_prefill_is_unhealthy_and_keeps_running_the_model():
    health, client = BackendHealth(), Client(liveness_ok=False)
    health.generation_failed()
    assert not check(health, client) and not check(health, client)
    assert client.calls == ["liveness", "liveness"]
    client.liveness_ok = True
    assert check(health, client) and client.calls[-1] == "liveness"


def test_a_failing_health_rpc_switches_to_liveness_next_time():
    health, client = BackendHealth(), Client(health_ok=False)
    assert not check(health, client)
    assert check(health, client)
    assert client.calls == ["health", "liveness"]


def test_a_check_that_hangs_is_unhealthy_after_the_timeout():
    class Hanging(Client):
        async def health(self):
            await asyncio.sleep(60)

    assert not check(BackendHealth(timeout_s=0.05), Hanging())
