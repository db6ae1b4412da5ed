"""Keeps a node's :class:`~meter.quotas.limits.LimitBook` current with storage, and makes changes.

A change made through this node is written to storage (one record and a version bump, in one
atomic write), read back at once, and announced on the gossip bus (a ``limits`` frame with the
new version); a peer that hears it, or that may have missed one (a gap, a reconnect), reads the
version and, if it moved, every record. Every node also reads the version every ``poll_s``,
bus or no bus (docs/quotas.md, "Propagation").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meter.errors import ConfigError, InvalidArgument, Unavailable
from meter.quotas.limits import LimitBook, plan_record, plans_from_toml
from storage.base import LimitRecords, StorageError, VersionMoved

log = logging.getLogger("meter.limits")

#: At most one warning per this many seconds while reads keep failing.
WARN_EVERY_S = 60.0


class LimitStore:
    """The limits a node enforces, and the loop that keeps them current (the storage half
    of :mod:`meter.quotas.limits`: the only part of it that awaits storage).

    ``on_book(book)`` is called with every new book read; ``publish(version)`` tells peers
    of a change made through this node (the gossip layer's ``limits_changed``), if clustered.
    """

    def __init__(
        self,
        storage: LimitRecords,
        on_book: Callable[[LimitBook], None],
        *,
        poll_s: float = 0.5,
        publish: Callable[[int], None] | None = None,
    ) -> None:
        self.storage = storage
        self.on_book = on_book
        self.poll_s = poll_s
        self.book = LimitBook()
        self.publish = publish
        self.reads = 0
        self.loaded_at: float | None = None
        self.last_error: str | None = None
        self._warned_at = 0.0
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()

    async def refresh(self) -> bool:
        """Read the version and, if it moved, every record; return whether the book changed.
        Raises :class:`StorageError`."""
        async with self._lock:
            version = await self.storage.limits_version()
            self.reads += 1
            if version == self.book.version and self.loaded_at is not None:
                self.loaded_at = time.time()
                self.last_error = None  # storage answers again, nothing changed meanwhile
                return False
            version, records = await self.storage.read_limits()
            self.reads += 1
            if version < self.book.version:  # an older read overtook a newer one: keep ours
                self.last_error = None
                return False
            book = LimitBook.from_records(version, records)
            for where, why in book.bad:
                log.warning("limits: stored record %r skipped: %s", where, why)
            self.book = book
            self.loaded_at = time.time()
            self.last_error = None
            self.on_book(book)
            return True

    def invalidate(self, version: int) -> None:
        """A peer changed the limits to ``version`` (``-1``: a frame may have been missed):
        read them again now unless this node already holds that version."""
        if version < 0 or version > self.book.version:
            self._wake.set()

    async def run(self) -> None:
        """Re-read when told to (a ``limits`` frame, a gossip gap), and read the version
        every ``poll_s`` meanwhile, forever, whatever the bus: a change made through a node
        whose bus is down reaches no peer by frame, and a read that failed is retried."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)
            self._wake.clear()
            try:
                await self.refresh()
            except StorageError as exc:
                self._failed(exc)
            except Exception:  # a bug must not end the loop: limits would silently freeze
                log.exception("limits: refresh failed")

    def _failed(self, exc: StorageError) -> None:
        self.last_error = str(exc)
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning("limits: cannot read them from storage (keeping version %d): %s",
                        self.book.version, exc)  # fmt: skip

    async def change(
        self, record: tuple[str, str, str, str | None], expect: int | None = None
    ) -> int:
        """Write one record (``body`` ``None``: delete it), take it into this node's book at
        once, and tell peers; return the new version. ``expect``: only on that version
        (:class:`~storage.base.VersionMoved` if another write moved it)."""
        try:
            if expect is None:
                version = await self.storage.write_limit(*record)
            else:
                version = await self.storage.write_limit(*record, expect=expect)
        except VersionMoved:
            raise
        except StorageError as exc:
            raise Unavailable(f"limits could not be stored, nothing changed: {exc}") from None
        try:
            await self.refresh()
        except StorageError as exc:  # stored: the loop reads it when storage answers again
            self._failed(exc)
            self._wake.set()
        if self.publish is not None:
            self.publish(version)
        return version

    async def apply_plans_file(self, path: Path) -> int:
        """Write every plan of the TOML file ``path`` that storage does not hold as it is;
        return how many were written. :class:`ConfigError` for a file that cannot be read or
        holds a bad plan (nothing written); :class:`StorageError` if storage cannot be read."""
        try:
            with path.open("rb") as fh:
                data = tomllib.load(fh)
            plans = plans_from_toml(data, str(path))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError("plans_file", f"cannot read {path}: {exc}") from None
        except InvalidArgument as exc:
            raise ConfigError("plans_file", exc.message) from None
        await self.refresh()
        written = 0
        for name, features in plans.items():
            if self.book.plans.get(name) != features:  # unchanged plans bump no version
                await self.change(plan_record(name, features))
                written += 1
        return written

    def status(self) -> dict[str, Any]:
        """For ``status``."""
        book = self.book
        return {
            "version": book.version,
            "plans": len(book.plans),
            "assigned_tenants": len(book.assigned),
            "overrides": len(book.overrides),
            "limited_pairs": book.by_pair.count,
            "bad_records": len(book.bad),
            "reads": self.reads,
            "loaded_at": self.loaded_at,
            "last_error": self.last_error,
        }
