"""The write-ahead log's errors (interpreted, not compiled with :mod:`meter.wal.log`: a
compiled subclass of :class:`~meter.errors.MeterError` would lose its ``code``)."""

from __future__ import annotations

from pathlib import Path

from meter.errors import MeterError


class WalError(Exception):
    """The log cannot be written now (disk full, I/O error); nothing new can be accepted."""


class LogCorrupt(MeterError):
    """A segment is damaged before its tail; the node refuses to start on it."""

    code = "internal"

    def __init__(self, path: Path, offset: int, reason: str) -> None:
        super().__init__(
            f"write-ahead log {path} is damaged at byte {offset} ({reason}); records after it "
            f"cannot be trusted. To start anyway, keeping the records before it: "
            f"truncate -s {offset} {path}   (see docs/durability.md, 'Recovery')"
        )
        self.path = path
        self.offset = offset


class LogIdMismatch(MeterError):
    """The log was written by another node id: replaying it under this one would re-send its
    in-flight deltas under sequences storage has never seen from this id."""

    code = "invalid_argument"

    def __init__(self, directory: Path, logged: str, configured: str) -> None:
        super().__init__(
            f"the write-ahead log in {directory} belongs to node id {logged!r}, but this node "
            f"is {configured!r}. Start it with METER_NODE_ID={logged} to deliver what the log "
            f"holds (then change the id after a clean drain), or move the log aside "
            f"(see docs/durability.md, 'Recovery')"
        )
