"""The gauge flusher: every interval, the readings of this node's observations that storage
may not hold are written (:meth:`storage.base.GaugeRecords.put_gauges`: each kept only if it
wins), and the readings storage answers are merged back and told to peers.

Readings merge (:mod:`meter.core.gauges`), so nothing here needs sequences: a write whose
answer was lost is written again, a retry after a crash too (the log replays observations),
and storage ends with the same reading. A reading is dirty until storage is known to hold it
or one that wins over it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meter.core.gauges import GaugeTable, Reading
from meter.core.keys import Key
from meter.wal.log import WalError, WriteAheadLog
from storage.base import GaugeRecords, StorageError

log = logging.getLogger("meter.gauges")

#: Readings written per storage call.
BATCH = 500

#: What the flusher tells of readings storage holds: ``(tenant, feature, period, kind,
#: value, at_ms, node)`` each (gossip's readings).
OnStored = Callable[[Sequence[tuple[str, str, str, str, int, int, str]]], None]


@dataclass
class GaugeFlushStats:
    """For ``status``."""

    rounds: int = 0
    written: int = 0
    failed_rounds: int = 0
    last_error: str | None = None
    last_at: float | None = None


class GaugeFlusher:
    """Writes ``table``'s dirty readings to ``storage`` every ``interval`` seconds."""

    def __init__(
        self,
        table: GaugeTable,
        storage: GaugeRecords,
        *,
        interval: float,
        max_backoff: float = 30.0,
        on_stored: OnStored | None = None,
        wal: WriteAheadLog | None = None,
    ) -> None:
        self.table = table
        #: The node's log: a round takes the readings at a commit boundary, so an observation
        #: whose log write fails (and is taken back) is never written.
        self.wal = wal
        self.storage = storage
        self.interval = interval
        self.max_backoff = max_backoff
        self.on_stored = on_stored
        self.stats = GaugeFlushStats()
        self._failures = 0
        self._lock = asyncio.Lock()

    async def flush_once(self) -> bool:
        """One round: every dirty reading written. True if nothing failed."""
        async with self._lock:
            self.stats.rounds += 1
            try:
                dirty = await self._take_committed()
            except WalError as exc:  # (kept: written once the log is)
                self._failed(StorageError(f"the log is not written: {exc}"))
                self.stats.failed_rounds += 1
                return False
            ok = True
            for start in range(0, len(dirty), BATCH):
                part = dirty[start : start + BATCH]
                try:
                    got = await self.storage.put_gauges(part)
                except StorageError as exc:
                    self._failed(exc)
                    ok = False
                    continue
                stored: list[tuple[str, str, str, str, int, int, str]] = []
                for key, kind, _ in part:
                    outcome = got.get(key)
                    if isinstance(outcome, StorageError) or outcome is None:
                        self._failed(outcome or StorageError(f"no answer for {key}"))
                        ok = False
                        continue
                    self.table.stored(key, outcome)
                    stored.append((key[0], key[1], key[2], kind, *outcome))
                self.stats.written += len(stored)
                if stored and self.on_stored is not None:
                    self.on_stored(stored)
            if ok:
                self._failures = 0
                self.stats.last_error = None
            else:
                self.stats.failed_rounds += 1
            self.stats.last_at = time.time()
            return ok

    async def _take_committed(self) -> list[tuple[Key, str, Reading]]:
        """The dirty readings at the log's next commit boundary, once durable."""
        wal = self.wal
        if wal is None:
            return self.table.dirty()
        fut: asyncio.Future[list[tuple[Key, str, Reading]]] = (
            asyncio.get_running_loop().create_future()
        )

        def take() -> None:
            if not fut.done():  # (a round cancelled meanwhile: nothing waits for it)
                fut.set_result(self.table.dirty())

        wal.at_commit(take)
        dirty = await fut
        if dirty:
            await wal.durable()
        return dirty

    def _failed(self, exc: StorageError) -> None:
        self.stats.last_error = str(exc)
        log.warning("gauges: a write failed (kept, written again): %s", exc)

    async def run(self) -> None:
        """Flush every interval (backing off while storage fails), forever."""
        while True:
            delay = self.interval
            if self._failures:
                cap = min(self.max_backoff, self.interval * 2 ** min(self._failures, 20))
                delay = random.uniform(self.interval, max(self.interval, cap))
            await asyncio.sleep(delay)
            try:
                if not await self.flush_once():
                    self._failures += 1
            except Exception:  # a bug must not end the loop: readings would never be stored
                self._failures += 1
                log.exception("gauges: a flush round failed")

    async def drain(self, timeout: float) -> bool:
        """Write until nothing is dirty or ``timeout`` seconds passed; whether all was."""
        deadline = time.monotonic() + timeout
        while self.table.dirty():
            if time.monotonic() >= deadline:
                return False
            if await self.flush_once():
                continue
            await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        return True
