"""How a workload's requests are sent to a target: the same loops whichever target serves them.

`Requests`: independent requests, closed loop (`spec.concurrency` in flight) or open loop (Poisson arrivals
at `spec.rate`, each at its own offset). `Chats`: conversations run concurrently, turns one after another
within a conversation, each turn resending the history with the answer the target gave. Results come back
in workload order (conversation by conversation, turn by turn).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tgi_vlm.benchmarking.results import RequestResult
from tgi_vlm.router.requests import RequestParams

if TYPE_CHECKING:
    from tgi_vlm.benchmarking.synthetic import Conversation, ConversationSpec, WorkItem, WorkloadSpec

# A target's way of serving one request: stamps `submitted` itself, returns when the request has ended.
Submit = Callable[[RequestParams], Awaitable[RequestResult]]
Progress = Callable[[], None] | None


class Load(Protocol):
    """What every target runs: a workload's requests and the loop that sends them."""

    spec: WorkloadSpec | ConversationSpec

    def __len__(self) -> int:
        """Requests sent (every turn of every conversation)."""

    @property
    def first_image_sizes(self) -> list[tuple[int, int]]:
        """(width, height) of the first request's images: the warm-up request sends images of these sizes."""

    @property
    def first_request(self) -> RequestParams:
        """The first request as sent."""

    async def drive(self, submit: Submit, start: float, progress: Progress = None) -> list[RequestResult]:
        """Every request through `submit`; `start` is time zero of the open loop's arrivals."""


@dataclass
class Requests:
    spec: WorkloadSpec
    items: list[WorkItem]

    def __len__(self) -> int:
        return len(self.items)

    @property
    def first_image_sizes(self) -> list[tuple[int, int]]:
        return self.items[0].image_sizes

    @property
    def first_request(self) -> RequestParams:
        return self.items[0].params

    async def drive(self, submit: Submit, start: float, progress: Progress = None) -> list[RequestResult]:
        results: list[RequestResult | None] = [None] * len(self.items)
        limit = asyncio.Semaphore(self.spec.concurrency or len(self.items))

        async def one(i: int, item: WorkItem) -> None:
            if self.spec.rate:
                await asyncio.sleep(max(0.0, start + item.arrival_s - time.perf_counter()))
            async with limit:
                results[i] = await submit(item.params)
            if progress is not None:
                progress()

        await asyncio.gather(*[one(i, item) for i, item in enumerate(self.items)])
        return results


@dataclass
class Chats:
    spec: ConversationSpec
    conversations: list[Conversation]

    def __len__(self) -> int:
        return len(self.conversations) * self.turns

    @property
    def turns(self) -> int:
        return len(self.conversations[0].questions)

    @property
    def first_image_sizes(self) -> list[tuple[int, int]]:
        return self.conversations[0].image_sizes

    @property
    def first_request(self) -> RequestParams:
        first = self.conversations[0]
        return first.turn(list(first.opening), 0)

    async def drive(self, submit: Submit, start: float, progress: Progress = None) -> list[RequestResult]:
        turns = self.turns
        results: list[RequestResult | None] = [None] * len(self)

        async def talk(c: int, conversation: Conversation) -> None:
            history = list(conversation.opening)
            for t in range(turns):
                result = await submit(conversation.turn(history, t))
                result.turn = t
                results[c * turns + t] = result
                history += [conversation.questions[t], result.text]
                if progress is not None:
                    progress()

        await asyncio.gather(*[talk(c, conversation) for c, conversation in enumerate(self.conversations)])
        return results
