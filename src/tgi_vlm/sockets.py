"""Unix-socket files of the shard: what both the server (its own socket) and the router's
`ShardProcess` (the sockets of the ranks it starts) remove."""

from __future__ import annotations

import os
import stat


def remove_socket(path: str) -> None:
    """Remove `path` if it is a socket; anything else there (or nothing) is left alone."""
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
