"""Decisions every rank of a sharded shard must take identically, made identical by one collective.

Every rank receives the same RPCs and runs the same deterministic code, so almost everything
agrees by construction (schedules, chunks, encoder cache, seeded sampling on identical gathered
logits). What can still differ is what depends on the process: a grammar compile that meets its
deadline on one rank only, memory on one device, a limit configured differently, a bug. A rank
that refused a request the others accepted would then run a different batch, and the ranks would
hang in the model's next collective. So intake ends with `agree`: the ranks exchange their
refusals, and each refuses the union, a request's message being that of the lowest rank that
refused it. A rank that failed outright (not a refusal) makes every rank fail.

Unsharded (`world_size == 1`) nothing is exchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from tgi_vlm.errors import InvalidRequest


class RankFailed(RuntimeError):
    """Another rank failed while this one did not (raised on the ranks that did not fail)."""

    def __init__(self, rank: int, what: str, reason: str):
        super().__init__(f"rank {rank} failed during {what}: {reason}")


@dataclass(frozen=True)
class Refusal:
    position: int  # the request's index in its batch (ids may repeat: warmup, duplicate-id refusals)
    error: InvalidRequest


class RankAgreement:
    def __init__(self, world_size: int = 1):
        self.world_size = world_size

    def agree(self, what: str, refusals: list[Refusal], failure: BaseException | None = None) -> list[InvalidRequest]:
        """The refusals of every rank, ordered by position; raises if any rank failed.

        Every rank must call this at the same point with the same `what`, failed or not.
        """
        if self.world_size > 1:
            refusals = self._union(what, refusals, failure)
        elif failure is not None:
            raise failure
        return [r.error for r in sorted(refusals, key=lambda r: r.position)]

    def minimum(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. KV blocks that fit on every device)."""
        if self.world_size == 1:
            return value
        values = self._gather(value)
        return min(values)

    def _union(self, what: str, refusals: list[Refusal], failure: BaseException | None) -> list[Refusal]:
        mine = ([(r.position, r.error.request_id, r.error.reason) for r in refusals],
                None if failure is None else f"{type(failure).__name__}: {failure}")
        everyone = self._gather(mine)
        if failure is not None:
            raise failure
        for rank, (_, reason) in enumerate(everyone):
            if reason is not None:
                raise RankFailed(rank, what, reason)
        merged: dict[int, Refusal] = {}
        for rank_refusals, _ in everyone:  # rank order: the lowest rank's message wins
            for position, request_id, reason in rank_refusals:
                merged.setdefault(position, Refusal(position, InvalidRequest(request_id, reason)))
        return list(merged.values())

    def _gather(self, value) -> list:
        import torch.distributed as dist

        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, value)
        return everyone
