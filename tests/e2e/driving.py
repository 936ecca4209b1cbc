"""Driving a shard process through the router driver in e2e tests."""

from __future__ import annotations

import asyncio

from tgi_vlm.router import FinalEvent, Router, RouterConfig, ShardClient

CONFIG = RouterConfig(max_input_tokens=200, max_total_tokens=300, max_batch_prefill_tokens=256)


def drive_router(socket: str, count_tokens, scenario, *, client=lambda c: c, router=Router, timeout: float = 60.0,
                 config: RouterConfig = CONFIG):
    """Run `scenario(router, client)` with a fresh router over `socket`; its allocator must be full after."""

    async def main():
        wrapped = client(ShardClient(socket))
        driver = router(wrapped, count_tokens, config)
        await driver.start()
        loop = asyncio.create_task(driver.run())
        try:
            result = await asyncio.wait_for(scenario(driver, wrapped), timeout)
            assert driver.allocator.is_full, f"{driver.allocator.num_free}/{driver.allocator.capacity} blocks free"
            return result
        finally:
            driver.stop()
            await loop
            await wrapped.close()

    return asyncio.run(main())


async def tokens_of(stream) -> tuple[list[int], FinalEvent]:
    tokens, final = await stream.final()
    return [t.token_id for t in tokens], final
