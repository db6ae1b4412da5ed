"""The node's data dir: its id, its owner token, its gossip incarnation, and a lock so two
nodes never share it (ADR 0004)."""

from __future__ import annotations

import fcntl
import os
import secrets
import time
from pathlib import Path
from typing import IO

from meter.errors import ConfigError

#: Earlier owner tokens a data dir keeps (starts whose claim never succeeded).
MAX_EARLIER_TOKENS = 8


class DataDir:
    """The node's data dir: holds its id, its owner token, its gossip incarnation and a lock so
    two nodes never share it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_file: IO[str] | None = None

    def acquire(self) -> None:
        """Create the dir and take its lock; :class:`ConfigError` if another node holds it."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fh = (self.path / "lock").open("a+")
        except OSError as exc:
            raise ConfigError("data_dir", f"cannot use {self.path}: {exc.strerror}") from None
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            owner = fh.read().strip() or "?"
            fh.close()
            raise ConfigError(
                "data_dir", f"{self.path} is in use by another node (pid {owner})"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        self._lock_file = fh

    def release(self) -> None:
        """Drop the lock."""
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def owner_tokens(self) -> tuple[str, list[str]]:
        """A new owner token for this start, and the earlier ones of this data dir, which its
        claim accepts (ADR 0004): same data dir, same owner.

        The new token is kept (synced) with the earlier ones *before* it is claimed, so a crash
        between the claim and :meth:`owner_claimed` cannot lock the data dir out of its id. A
        fresh token per start also tells a copy of this data dir from a restart: the copy's
        claim takes the id over and the process it was copied from stops (it finds another
        owner) instead of both flushing under one id.
        """
        file = self.path / "owner"
        try:
            lines = file.read_text().splitlines()
        except FileNotFoundError:
            lines = []
        earlier = [t for t in (line.strip() for line in lines) if t][:MAX_EARLIER_TOKENS]
        new = secrets.token_hex(16)
        _write_synced(file, "\n".join([new, *earlier]) + "\n")
        return new, earlier

    def owner_claimed(self, token: str) -> None:
        """``token`` owns the id now: the earlier tokens are no longer needed."""
        _write_synced(self.path / "owner", token + "\n")

    def marks_id(self) -> str:
        """This data dir's own id, made once: the period marks it opens carry it, so a
        restart takes back its own marks and never another data dir's under the same node
        id (meter.persist.closing)."""
        file = self.path / "marks-id"
        try:
            text = file.read_text().strip()
        except FileNotFoundError:
            text = ""
        if not text:
            text = secrets.token_hex(8)
            _write_synced(file, text + "\n")
        return text

    def incarnation(self) -> int:
        """This start's gossip incarnation: ``max(now in ns, the last one + 1)``, kept here.

        Peers refuse messages of an incarnation older than one they saw (a replay), so it must
        grow across restarts even when this host's clock went back (set right after running
        ahead, a VM restored on another host): the wall clock alone would make the node stale
        to its peers for good. Written and synced before it is used.
        """
        file = self.path / "incarnation"
        try:
            last = int(file.read_text().strip() or "0")
        except FileNotFoundError:
            last = 0
        except ValueError:
            raise ConfigError("data_dir", f"{file} does not hold an integer") from None
        new = max(time.time_ns(), last + 1)
        _write_synced(file, f"{new}\n")
        return new

    def node_id(self, configured: str | None) -> str:
        """The configured id, else the one kept in the dir, else a new one (then kept)."""
        if configured:
            return configured
        file = self.path / "node_id"
        try:
            existing = file.read_text().strip()
        except FileNotFoundError:
            existing = ""
        if existing:
            return existing
        new = "n" + secrets.token_hex(6)
        tmp = file.with_suffix(".tmp")
        tmp.write_text(new + "\n")
        os.replace(tmp, file)
        return new


def _write_synced(file: Path, text: str) -> None:
    """Replace ``file`` with ``text`` atomically, synced to disk (file and directory)."""
    tmp = file.with_suffix(".tmp")
    with tmp.open("w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, file)
    fd = os.open(file.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
