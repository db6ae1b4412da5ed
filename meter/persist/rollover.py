"""Period roll-over: before each period ends, read the next period's keys of the warm keys of
the ending one (ADR 0005), so the first calls of the new period find them seeded.

Every period is a new key, so at 00:00 UTC on the 1st every active counter of a node is cold at
once. The keys to read are chosen by :mod:`meter.core.periods` (pure); the reads are ordinary
fresh reads of cold keys (C06) queued behind any request (:class:`meter.core.seeder.Seeder`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from meter.config import CounterConfig
from meter.core.cycles import of_kind
from meter.core.keys import PeriodKind
from meter.core.periods import kinds_in_use
from meter.core.service import Service
from storage.periods import Cycle, bounds, name

log = logging.getLogger("meter.node")

#: Warm keys mapped to the next period per event-loop pass when reading ahead.
READ_AHEAD_SLICE = 5000
#: Read-ahead passes per period end (at 1, 3/4, 1/2 and 1/4 of the lead before it).
READ_AHEAD_PASSES = 4


class ReadAhead:
    """The read-ahead loop of one node's service."""

    def __init__(self, service: Service, config: CounterConfig) -> None:
        self.service = service
        self.config = config

    async def run(self) -> None:
        """Four passes per period end, ``lead``, 3/4, 1/2 and 1/4 of it before, each for the
        keys first used since the one before (keys queued or seeded already are skipped).
        An error in one pass is logged and the loop goes on."""
        c = self.config
        # A row read ahead must outlive the wait for the boundary: eviction keeps an idle row
        # at least evict_after_s.
        lead = min(c.rollover_read_ahead_s, c.evict_after_s)
        if lead <= 0:
            return
        done: dict[tuple[str, float], int] = {}  # (kind and calendar, period end) -> passes
        while True:
            try:
                wait = await self.step(time.time(), lead, done)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not end the read-ahead for good (nor the drain)
                log.exception("rollover read-ahead failed unexpectedly (retried)")
                wait = 1.0
            await asyncio.sleep(wait)

    async def step(self, now: float, lead: float, done: dict[tuple[str, float], int]) -> float:
        """Make the read-ahead passes whose moment has come at ``now``; return how long to
        wait before the next look: until the next pass's moment, at most a second (the wall
        clock may jump, NTP), so a lead shorter than a second is not slept through."""
        wait = 1.0
        for kind in kinds_in_use(self.config.feature_periods):
            for calendar in of_kind(self.service.keys.calendars(), kind):
                try:
                    current = name(calendar, kind, now)
                except ValueError:  # (no period after it: nothing to read ahead)
                    continue
                end = bounds(current)[1]
                tag = kind if calendar is None else f"{kind} {current.partition('@')[2]}"
                passes = done.get((tag, end), 0)
                if passes < READ_AHEAD_PASSES and now >= end - lead * (1 - passes / 4):
                    for k in [k for k in done if k[0] == tag and k[1] < end]:
                        del done[k]
                    # Passes whose moment has come already are one.
                    while passes < READ_AHEAD_PASSES and now >= end - lead * (1 - passes / 4):
                        passes += 1
                    done[(tag, end)] = passes
                    queued = await self.read_ahead(kind, now, calendar)
                    log.info(
                        "%s ends in %.0f s: reading %d keys of the next one ahead",
                        current,
                        end - now,
                        queued,
                    )
                if passes < READ_AHEAD_PASSES:
                    wait = min(wait, end - lead * (1 - passes / 4) - now)
        return max(wait, 0.001)

    async def read_ahead(self, kind: PeriodKind, now: float, calendar: Cycle | None = None) -> int:
        """Queue the next period's keys of every warm key of ``calendar``'s current period of
        ``kind``, a slice per loop pass (a million keys mapped in one go would hold the loop
        for a good part of a second)."""
        keys = list(self.service.table.keys())
        queued = 0
        for start in range(0, len(keys), READ_AHEAD_SLICE):
            chunk = keys[start : start + READ_AHEAD_SLICE]
            queued += self.service.read_ahead(kind, now, chunk, calendar)
            await asyncio.sleep(0)
        return queued
