"""Whether this node may change state now, and the write-ahead log its changes go to.

A change is refused (before anything is counted) while another process owns this node's id
(:attr:`Fence.reason`, set by the node as its claim moves) or while the log cannot be
written. Pure: no I/O.
"""

from __future__ import annotations

from meter.errors import Unavailable
from meter.wal.log import WriteAheadLog


class Fence:
    """The one place the request path asks before it changes state."""

    def __init__(self, wal: WriteAheadLog | None) -> None:
        #: The write-ahead log every state change is appended to (``None``: durability off).
        self.wal = wal
        #: Why state changes are refused now (another process owns this node's id), or None.
        self.reason: str | None = None

    def close(self, reason: str | None) -> None:
        """Refuse state changes for ``reason`` from now on (``None``: take them again)."""
        self.reason = reason

    def check(self) -> None:
        """Raise :class:`Unavailable` if a state change cannot be made or logged now."""
        wal = self.wal
        if wal is not None and wal.broken is not None:
            raise log_down(wal)
        if self.reason is not None:
            raise Unavailable(self.reason)


def log_down(wal: WriteAheadLog) -> Unavailable:
    """The error of a call refused because ``wal`` cannot be written."""
    return Unavailable(f"write-ahead log cannot be written, nothing counted: {wal.broken}")
