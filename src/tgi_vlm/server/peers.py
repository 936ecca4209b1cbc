"""Watching the other ranks of a sharded shard: a rank alone cannot serve, so when a peer leaves, it stops too.

Every rank of `serve --sharded` binds its own unix socket (`{uds}-{rank}`) on the same machine. A
peer is alive while its socket accepts connections. A rank that shuts down removes its socket
first (`serve.py`), so a missing socket means the peer left in order; a socket that is still there
but refuses connections means its process died (a crash, SIGKILL). A peer counts only once it has
been seen up: before that it may still be loading, and a refusing file may be a stale one from an
earlier run that the peer has not replaced yet.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from loguru import logger

PROBE_TIMEOUT_S = 1.0


class SocketState(Enum):
    UP = "up"  # accepts connections (or is too busy to answer at once: alive)
    ABSENT = "absent"
    REFUSED = "refused"
    UNKNOWN = "unknown"  # any other error: no decision


def probe(path: str, timeout_s: float = PROBE_TIMEOUT_S) -> SocketState:
    """Connect to a unix socket and hang up (the gRPC server sees a connection that closes unused)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except FileNotFoundError:
            return SocketState.ABSENT
        except ConnectionRefusedError:
            return SocketState.REFUSED
        except (TimeoutError, BlockingIOError):
            return SocketState.UP  # a full backlog: the process is alive
        except OSError:
            return SocketState.UNKNOWN
    return SocketState.UP


@dataclass(frozen=True)
class PeerGone:
    rank: int
    path: str
    in_order: bool  # True: it removed its socket (it shut down); False: its socket refuses connections (it died)

    def __str__(self) -> str:
        if self.in_order:
            return f"rank {self.rank} shut down ({self.path} was removed)"
        return f"rank {self.rank} died ({self.path} refuses connections)"


class PeerWatch:
    """The other ranks' sockets; `poll()` names the first peer that was up and is not any more."""

    def __init__(self, sockets: Mapping[int, str]):
        self.sockets = dict(sockets)
        self.seen_up: set[int] = set()

    def poll(self) -> PeerGone | None:
        for rank, path in self.sockets.items():
            state = probe(path)
            if state is SocketState.UP:
                if rank not in self.seen_up:
                    logger.info("peer rank {} is up ({})", rank, path)  # from now on its leaving is noticed
                self.seen_up.add(rank)
            elif rank in self.seen_up and state in (SocketState.ABSENT, SocketState.REFUSED):
                return PeerGone(rank, path, in_order=state is SocketState.ABSENT)
        return None

    async def until_one_leaves(self, interval_s: float = 0.5) -> PeerGone:
        while True:
            gone = await asyncio.to_thread(self.poll)
            if gone is not None:
                return gone
            await asyncio.sleep(interval_s)
