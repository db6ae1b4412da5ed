"""Unique values a ``void`` took back, until storage marks them voided (ADR 0022).

A void of a call that counted a unique value counts -1 wherever the call's claims won, at
once, like any void (meter.core.voids). The value's item in storage keeps its claimant, so the
value stays claimed in its period (tracked again, it counts 0 on every node, as any value
claimed before), and is marked voided so that the values an invoice reads leave it out. The
mark is written here, after the void's log record is on disk (a void whose log write fails
is undone before its mark can be written), again after a restart (the log's ``VOID`` records
and a checkpoint's ``VALUE_VOIDS`` hold the marks not known written), until storage answers.
Writing a mark twice changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from meter.core.keys import Key
from meter.wal.errors import WalError
from meter.wal.log import WriteAheadLog
from storage.base import StorageError, StoragePermanentError, UniqueValues

log = logging.getLogger("meter.service")

#: A value to mark voided: ``(key, value)`` -> the claimant that won it.
Unmarked = dict[tuple[Key, str], str]


class ValueVoids:
    """The voided values whose storage mark is not known written, and their writing."""

    def __init__(self, storage: UniqueValues, wal: WriteAheadLog | None) -> None:
        self.storage = storage
        self.wal = wal
        self.unmarked: Unmarked = {}
        #: Marks written since start, and those storage refused (the value not held by the
        #: claimant: its item expired, or storage cannot keep it).
        self.marked = 0
        self.refused = 0
        #: One writer at a time (the node's loop, a drain).
        self._writing = asyncio.Lock()

    def voided(self, key: Key, value: str, claimant: str) -> None:
        """``value`` of ``key``, won by ``claimant``, was voided: mark it in storage."""
        self.unmarked[(key, value)] = claimant

    def unvoided(self, key: Key, value: str) -> None:
        """The void of ``value`` was undone (its log write failed): no mark."""
        self.unmarked.pop((key, value), None)

    def restore(self, unmarked: Unmarked) -> None:
        """Marks the log holds not known written (a restart)."""
        self.unmarked.update(unmarked)

    def keys(self) -> Iterable[Key]:
        """The keys of the values not marked yet (a period holding one is not closed)."""
        return (key for key, _ in self.unmarked)

    def restated(self) -> list[list[object]]:
        """``VALUE_VOIDS`` items of every mark not written yet (a checkpoint's)."""
        return [[*key, value, c] for (key, value), c in self.unmarked.items()]

    async def mark(self) -> int:
        """Write every mark whose void the log holds on disk; how many are left (storage did
        not answer, or the log cannot be written: tried again by the caller's loop)."""
        async with self._writing:
            return await self._mark()

    async def _mark(self) -> int:
        todo = list(self.unmarked.items())
        if not todo:
            return 0
        if self.wal is not None:
            try:
                await self.wal.durable()  # (the voids before it: on disk, or undone)
            except WalError:
                return len(self.unmarked)
        for (key, value), claimant in todo:
            if self.unmarked.get((key, value)) != claimant:
                continue  # undone meanwhile
            why: str | None = None
            try:
                held = await self.storage.void_value(key, value, claimant)
            except StoragePermanentError as exc:
                why = f"storage cannot mark it: {exc}"
            except StorageError:
                break  # tried again on the next pass
            else:
                if held != claimant:
                    why = f"it is held by {held}, not by {claimant} that counted it"
            if self.unmarked.get((key, value)) == claimant:
                del self.unmarked[(key, value)]
            if why is None:
                self.marked += 1
            else:
                self.refused += 1
                log.error("unique values: a voided value of %s/%s is not marked: %s", *key[:2], why)
        return len(self.unmarked)
