"""Batches kept between RPCs, by id.

Ownership: a batch in the cache belongs to the cache. `pop` hands it to the caller (who must
either put a batch back with `add` or release it); `drop`/`clear` and replacement by `add`
release it here, so KV blocks and encoder entries are never leaked by the cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from loguru import logger

from tgi_vlm.errors import BatchNotFound, InvalidArgument


class CacheableBatch(Protocol):
    """The part of the engine's batch contract the server relies on (see models/types.py)."""

    batch_id: int

    @property
    def request_ids(self) -> Sequence[int]: ...

    def __len__(self) -> int: ...

    def to_pb(self) -> Any: ...

    def filter(self, request_ids: list[int]) -> Any: ...

    def release(self) -> None: ...


class BatchCache:
    def __init__(self) -> None:
        self._batches: dict[int, CacheableBatch] = {}

    def __len__(self) -> int:
        return len(self._batches)

    def __contains__(self, batch_id: int) -> bool:
        return batch_id in self._batches

    def ids(self) -> list[int]:
        return list(self._batches)

    def add(self, batch: CacheableBatch) -> None:
        old = self._batches.get(batch.batch_id)
        if old is not None and old is not batch:
            logger.warning("batch {} replaced in the cache; releasing the previous one", batch.batch_id)
            release_quietly(old)
        self._batches[batch.batch_id] = batch

    def get(self, batch_id: int) -> CacheableBatch:
        try:
            return self._batches[batch_id]
        except KeyError:
            raise BatchNotFound(batch_id) from None

    def pop(self, batch_id: int) -> CacheableBatch:
        batch = self.get(batch_id)
        del self._batches[batch_id]
        return batch

    def pop_all(self, batch_ids: Iterable[int]) -> list[CacheableBatch]:
        """Pop several batches, or none: the cache is unchanged when any id is unknown or repeated."""
        ids = list(batch_ids)
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise InvalidArgument(f"batch id(s) {repeated} listed more than once")
        for batch_id in ids:
            self.get(batch_id)
        return [self.pop(batch_id) for batch_id in ids]

    def drop(self, batch_id: int) -> bool:
        """Release one batch; False when the id is unknown (not an error, as in TGI's ClearCache)."""
        batch = self._batches.pop(batch_id, None)
        if batch is None:
            return False
        release_quietly(batch)
        return True

    def clear(self) -> list[CacheableBatch]:
        """Release every batch and return them (for logging and tests)."""
        batches = list(self._batches.values())
        self._batches.clear()
        for batch in batches:
            release_quietly(batch)
        return batches


def release_quietly(batch: CacheableBatch) -> None:
    """Release a batch that is being dropped; a failing release is logged, never raised, so one
    broken batch cannot keep the others (or the rest of an error path) from being freed."""
    try:
        batch.release()
    except Exception:
        logger.exception("releasing batch {} failed", getattr(batch, "batch_id", "?"))
