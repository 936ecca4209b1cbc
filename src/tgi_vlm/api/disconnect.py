"""Non-streaming routes: a client that goes away before the answer cancels its request (as in TGI,
where dropping the connection drops the request). Streams need none of this: their generator is
closed when a write fails or the server sees the disconnect."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientGone(Exception):
    pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`await work`, cancelled (→ ClientGone) if the client disconnects first. The body must already be read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task  # its cleanup (the router cancel) runs now
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the client is gone; nobody gets an answer
        pass
    raise ClientGone


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
