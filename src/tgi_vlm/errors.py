"""Errors the server maps to gRPC status codes.

InvalidRequest/InvalidBatch -> INVALID_ARGUMENT (the client sent something we refuse; the
shard keeps serving), BatchNotFound -> NOT_FOUND, Unsupported -> INVALID_ARGUMENT with
"not supported". Anything else escaping a handler is our bug -> INTERNAL.
"""

from __future__ import annotations


class TgiVlmError(Exception):
    """Base class of errors raised on purpose."""


class InvalidRequest(TgiVlmError):
    """One request of a batch is unacceptable. The message names the request and the problem."""

    def __init__(self, request_id: int, reason: str):
        self.request_id = request_id
        self.reason = reason
        super().__init__(f"request {request_id}: {reason}")


class InvalidBatch(TgiVlmError):
    """Several requests of one batch are unacceptable; each is listed with its reason."""

    def __init__(self, errors: list[InvalidRequest], what: str = "batch"):
        self.errors = errors
        detail = "; ".join(str(e) for e in errors)
        super().__init__(f"{what} rejected ({len(errors)} invalid request(s)): {detail}")

    @property
    def request_ids(self) -> list[int]:
        return [e.request_id for e in self.errors]


class InvalidArgument(TgiVlmError):
    """A call-level argument is wrong (not tied to one request)."""


class BatchNotFound(TgiVlmError):
    def __init__(self, batch_id: int):
        self.batch_id = batch_id
        super().__init__(f"batch {batch_id} not found in the cache")


class ForwardFailed(TgiVlmError):
    """A forward raised (e.g. out of memory); the batches of that call were freed."""
