"""Period close: this node's marks of the counting periods it counts in, and its close of each
once the period has ended plus the grace and every unit it counted there is stored
(docs/invoicing.md; ADR 0020).

A node marks a period *open* in storage before it can count there: at start, the current
period of each kind in use and the one before it while it is still within the grace (a call
with ``at`` may count there), and each next period shortly before it begins. An export of a
period is ``final`` only when every node that marked it open has closed it: a node killed
with units of the period not stored stays open until it restarts from its data dir, stores
them and closes; an operator closes a node that will never come back by hand.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

from meter.core.counts import PeriodUnits
from meter.core.cycles import of_kind
from meter.core.keys import Key, PeriodKind, check_period
from meter.core.params import args as check_args
from meter.core.ports import Handler
from meter.errors import InvalidArgument, Unavailable
from storage.base import (
    MARK_CLOSED,
    MARK_OPEN,
    MAX_OWNER_NOTE_BYTES,
    Owners,
    PeriodMarks,
    StorageError,
    StoragePermanentError,
)
from storage.periods import Cycle, bounds, following, is_period, name, preceding

log = logging.getLogger(__name__)

#: How often the node looks for periods to open and to close (a close lands within this of
#: its period's end plus the grace, or of its last unit stored, whichever comes later).
EVERY_S = 1.0
#: A next period is marked open this long before it begins.
AHEAD_S = 120.0
#: Every how many passes the node looks for periods it holds units of but has not marked
#: (a scan of its unstored keys: about 10 ms at 100,000 keys).
HELD_EVERY = 10
#: An earlier period the grace still reaches is marked open whatever the node holds once it
#: closes within this (by then the scan above has had many passes to mark a held one).
CLOSING_SOON_S = 600.0
#: Who a close by hand is written by (``meter period close``).
OPERATOR = "operator"
#: At start, how many periods of each kind before the current one are checked for this
#: node's open marks (a node down longer is closed by hand: ``meter period close``).
LOOK_BACK = {"month": 3, "day": 40}


def periods_to_open(
    kinds: Iterable[PeriodKind],
    calendars: Sequence[Cycle | None],
    grace_s: float,
    now: float,
) -> list[str]:
    """The periods a node marks open whether it holds anything of them or not: of each
    kind in each calendar in use (the UTC one and every billing cycle), the current one, the
    next one when it begins within :data:`AHEAD_S`, and every earlier one its grace still
    reaches that closes within :data:`CLOSING_SOON_S` (the current first). An earlier period
    that closes later (a long grace) is marked once the node holds units of it
    (:meth:`PeriodCloser.open_due`'s scan), well before it closes."""
    out: list[str] = []
    for kind in kinds:
        for calendar in of_kind(calendars, kind):
            try:
                current = name(calendar, kind, now)
            except ValueError:  # (past year 9999 in its zone: nothing counts there)
                continue
            out.append(current)
            start, end = bounds(current)
            if end - now <= AHEAD_S:
                out.append(following(current))
            before = current
            while now < start + grace_s:  # (the period before ``start`` ends there)
                before = preceding(before)
                if start + grace_s - now <= CLOSING_SOON_S:
                    out.append(before)
                start = bounds(before)[0]
    return out


def recent_periods(
    kinds: Iterable[PeriodKind], calendars: Sequence[Cycle | None], now: float
) -> list[str]:
    """The periods before the current one of each kind in each calendar that a restart
    checks for its own open marks (:data:`LOOK_BACK`)."""
    out: list[str] = []
    for kind in kinds:
        for calendar in of_kind(calendars, kind):
            try:
                period = name(calendar, kind, now)
            except ValueError:
                continue
            for _ in range(LOOK_BACK[kind]):
                period = preceding(period)
                out.append(period)
    return out


#: Periods a node's backlog note lists at most (those that close first).
NOTE_PERIODS = 32


def backlog_note(held: Iterable[tuple[Key, int]], now: float) -> str:
    """The note a node's owner renewals leave for exports to read (:func:`close_state`):
    ``{"at": now, "backlog": {period: [keys, units], ...}, "more": bool}``, the keys and units
    it holds not stored of each period (the :data:`NOTE_PERIODS` that close first; ``more``:
    others were left out)."""
    per: dict[str, list[int]] = {}
    for key, units in held:
        entry = per.get(key[2])
        if entry is None:
            entry = per[key[2]] = [0, 0]
        entry[0] += 1
        entry[1] += units
    listed = sorted((p for p in per if is_period(p)), key=lambda p: bounds(p)[1])
    while True:  # (within the owner record's note: fewer periods if long names pass it)
        shown = listed[:NOTE_PERIODS]
        note = json.dumps(
            {"at": round(now, 3), "backlog": {p: per[p] for p in shown},
             "more": len(shown) < len(per)},
            separators=(",", ":"),
        )  # fmt: skip
        if len(note) <= MAX_OWNER_NOTE_BYTES or not listed:
            return note
        listed = listed[: len(shown) // 2]


def noted_backlog(note: str, period: str) -> tuple[float | None, dict[str, int] | None]:
    """What a node's note (:func:`backlog_note`) says of ``period``: when it was written, and
    the keys and units it held not stored (zeros if none; None if the note does not say, or
    is not one)."""
    try:
        raw = json.loads(note) if note else None
    except ValueError:
        raw = None
    if not isinstance(raw, dict):
        return None, None
    at = raw.get("at")
    seen = float(at) if isinstance(at, int | float) and not isinstance(at, bool) else None
    backlog = raw.get("backlog")
    if not isinstance(backlog, dict):
        return seen, None
    entry = backlog.get(period)
    if isinstance(entry, list) and len(entry) == 2 and all(type(n) is int for n in entry):
        return seen, {"keys": entry[0], "units": entry[1]}
    return seen, (None if raw.get("more") is not False else {"keys": 0, "units": 0})


def period_closes_at(period: str, grace_s: float) -> float:
    """When calls may count in ``period`` no more: its end plus the grace."""
    return bounds(period)[1] + grace_s


class MarksAndOwners(PeriodMarks, Owners, Protocol):
    """What an export's close state reads: the period's marks and who owns each node id."""


class PeriodCloser:
    """This node's open periods: marked in storage, closed when due (see the module doc)."""

    def __init__(
        self,
        node: str,
        storage: PeriodMarks,
        kinds: Callable[[], list[PeriodKind]],
        calendars: Callable[[], list[Cycle | None]],
        grace_s: float,
        unstored: Callable[[], Iterable[Key]],
        data_dir_id: str,
        units: PeriodUnits | None = None,
    ) -> None:
        self.node = node
        #: The units this node took for storage by period: its close marks carry them.
        self.units = units if units is not None else PeriodUnits(kept=False)
        #: This node's data dir (its own id): the marks it opens carry it, so a restart
        #: takes back its own marks and never those another data dir opened under the same
        #: node id (whose units it does not hold).
        self.data_dir_id = data_dir_id
        self.storage = storage
        self.kinds = kinds
        #: The calendars periods follow: the UTC one and every billing cycle in use.
        self.calendars = calendars
        self.grace_s = grace_s
        #: The keys holding units (or holds, or claims) of this node that storage may not
        #: hold yet: a period with one of them is not closed, and one not marked open
        #: (counted while storage was unreachable, or replayed from the log) is marked.
        self.unstored = unstored
        #: Periods this node marked open (or found open at start) and has not closed.
        self.open: set[str] = set()
        #: Periods open under this node id by another data dir: never closed here (an
        #: operator closes them once that data dir is gone for good).
        self.foreign: set[str] = set()
        #: Closes written since the start.
        self.closed_total = 0
        # Periods found closed by an operator while this node held units of them (said once).
        self._closed_held: set[str] = set()
        self._passes = 0
        self._started = False

    async def start(self, now: float | None = None) -> None:
        """Find this node's open marks of recent periods (a restart's), and mark the periods
        it may count in now and those it holds units of. Storage unreachable: logged, tried
        again by :meth:`run`."""
        now = time.time() if now is None else now
        try:
            for period in recent_periods(self.kinds(), self.calendars(), now):
                if period in self.open:
                    continue
                for mark in await self.storage.period_marks(period):
                    if mark.node == self.node and mark.state == MARK_OPEN:
                        self._opened(period, mark.by)
                    elif mark.node == self.node and mark.state == MARK_CLOSED:
                        self.units.drop(period)  # (closed before a restart: in its mark)
            self._started = True
        except StorageError as exc:
            log.warning("period marks not read (will try again): %s", exc)
        await self.open_due(now)

    async def open_due(self, now: float) -> None:
        """Mark open every period this node may count in now (:func:`periods_to_open`) and,
        every :data:`HELD_EVERY` passes (and at start), every one it holds something
        unstored of."""
        wanted = [
            p
            for p in periods_to_open(self.kinds(), self.calendars(), self.grace_s, now)
            if p not in self.open
        ]
        held: set[str] | None = None
        if self._passes % HELD_EVERY == 0:
            held = self._held()  # (a scan of the table: not each pass)
            wanted += sorted(
                p for p in held
                if p not in self.open and p not in self._closed_held and is_period(p)
            )  # fmt: skip
        self._passes += 1
        for period in dict.fromkeys(wanted):
            try:
                mark = await self.storage.mark_period_open(period, self.node, now, self.data_dir_id)
            except StorageError as exc:
                log.warning("period %s not marked open (will try again): %s", period, exc)
                continue
            if mark.state == MARK_OPEN:
                self._opened(period, mark.by)
            elif mark.by == OPERATOR and period in (held if held is not None else self._held()):
                # Closed by hand while this node held units of it: they are stored (the
                # flusher writes them), so the period's export changes. Said loudly.
                log.error(
                    "period %s was closed by an operator for this node, which holds units of "
                    "it not stored yet: storing them changes the period's export",
                    period,
                )
                self._closed_held.add(period)

    def _held(self) -> set[str]:
        """The periods this node holds something of that storage may not hold yet."""
        return {key[2] for key in self.unstored()}

    def _opened(self, period: str, by: str) -> None:
        """``period`` is open under this node id, opened by ``by``."""
        if by == self.data_dir_id:
            self.open.add(period)
        elif period not in self.foreign:
            self.foreign.add(period)
            log.error(
                "period %s is open for node id %s from another data dir (%s): this process "
                "will not close it; once that data dir is gone for good, close it by hand "
                "(meter period close %s --node %s)",
                period, self.node, by, period, self.node,
            )  # fmt: skip

    async def close_due(self, now: float) -> list[str]:
        """Close every open period past its end plus the grace that holds nothing of this
        node's unstored; the periods closed."""
        await self._forget_units(now)
        due = [p for p in sorted(self.open) if now >= period_closes_at(p, self.grace_s)]
        if not due:
            return []
        held = self._held()
        done: list[str] = []
        for period in due:
            if period in held:
                continue
            try:
                mark = await self.storage.mark_period_closed(
                    period, self.node, time.time(), self.node, self.units.of(period)
                )
            except StorageError as exc:
                log.warning("period %s not closed (will try again): %s", period, exc)
                continue
            if mark.by == OPERATOR:
                log.error("period %s had been closed for this node by an operator", period)
            self.open.discard(period)
            self.units.drop(period)
            self.closed_total += 1
            done.append(period)
            log.info("period %s closed: every unit this node counted there is stored", period)
        return done

    async def _forget_units(self, now: float) -> None:
        """Forget the units of periods that may no longer count, that this node holds nothing
        of and whose mark storage holds is not this data dir's open one (drained, closed by
        an operator, closed before a restart): no close of its will carry them. An open one
        (its open's answer lost) is this node's to close. Not before :meth:`start` has read
        this node's marks."""
        if not self._started:
            return
        over = [
            p
            for p in self.units.by_period
            if p not in self.open and now >= period_closes_at(p, self.grace_s)
        ]
        if not over:
            return
        held = self._held()
        for period in over:
            if period in held:
                continue
            try:
                marks = await self.storage.period_marks(period)
            except StorageError:
                return  # (tried again on the next pass)
            mine = [m for m in marks if m.node == self.node and m.state == MARK_OPEN]
            if mine:
                self._opened(period, mine[0].by)
            if period not in self.open:
                self.units.drop(period)

    async def drained(self, now: float) -> None:
        """After a clean drain (nothing unstored): close the periods due, and mark the others
        drained (counted as closed by an export; this node opens them again if it comes
        back while they may still count)."""
        await self.close_due(now)
        held = self._held()  # (open leases, claims: kept open)
        for period in sorted(self.open - held):
            try:
                await self.storage.mark_period_drained(
                    period, self.node, now, self.units.of(period)
                )
            except StorageError as exc:
                log.warning("period %s not marked drained: %s", period, exc)
                continue
            self.open.discard(period)

    def oldest_open(self) -> str | None:
        """The open period that should have closed the longest ago (or, with none overdue,
        the one that closes first)."""
        return min(self.open, key=lambda p: period_closes_at(p, self.grace_s), default=None)

    async def run(self) -> None:
        """The node's loop: open and close periods every :data:`EVERY_S` seconds."""
        while True:
            await asyncio.sleep(EVERY_S)
            now = time.time()
            try:
                if not self._started:
                    await self.start(now)
                else:
                    await self.open_due(now)
                await self.close_due(now)
            except Exception:  # (a bug must not end the loop: periods would never close)
                log.exception("period close: a pass failed (tried again)")


def overdue_s(period: str | None, grace_s: float, now: float) -> float:
    """How long ago ``period`` (a node's oldest open one) should have closed: 0 if it may
    still count, or if there is none."""
    if period is None:
        return 0.0
    return max(0.0, now - period_closes_at(period, grace_s))


async def close_state(
    storage: MarksAndOwners, period: str, grace_s: float, now: float
) -> dict[str, Any]:
    """What an export of ``period`` says of its close, as of ``now``: ``final`` (the period
    has ended plus the grace and every node that marked it open has closed it, or drained),
    ``open_nodes`` (each with when it marked the period open, when its ownership lease of its
    id ends: past, it is not running; and its last known state, from the note of its last
    renewal: ``seen_at`` and ``backlog``, the keys and units of the period it held not
    stored), ``closed_nodes`` (each closed or drained mark: ``node``, ``state``, ``at``,
    ``by``, and ``units``, what the node counted there by feature, ``None`` if it did not
    say), ``closed_by_operator`` (nodes closed by hand), ``nodes`` (how many marked it),
    ``closes_at`` and ``read_at`` (``now``)."""
    marks = await storage.period_marks(period)
    closes_at = period_closes_at(period, grace_s)
    open_nodes: list[dict[str, Any]] = []
    for mark in marks:
        if mark.state == MARK_OPEN:
            owner = await storage.owner(mark.node)
            seen, backlog = noted_backlog("" if owner is None else owner.note, period)
            open_nodes.append({"node": mark.node, "opened_at": mark.at,
                               "lease_ends": None if owner is None else owner.expires,
                               "seen_at": seen, "backlog": backlog})  # fmt: skip
    by_hand = [m.node for m in marks if m.state == MARK_CLOSED and m.by == OPERATOR]
    closed_nodes = [
        {"node": m.node, "state": m.state, "at": m.at, "by": m.by, "units": m.units}
        for m in marks
        if m.state != MARK_OPEN
    ]
    return {
        "final": now >= closes_at and not open_nodes,
        "open_nodes": open_nodes,
        "closed_nodes": closed_nodes,
        "closed_by_operator": by_hand,
        "nodes": len(marks),
        "closes_at": closes_at,
        "read_at": now,
    }


class PeriodMethods:
    """The ``close_period`` method: an operator closes a period for a node that will never
    come back (its unstored units, if any, are lost to the period: the export records who
    closed it)."""

    def __init__(self, storage: MarksAndOwners, grace_s: float) -> None:
        self.storage = storage
        self.grace_s = grace_s

    def handlers(self) -> dict[str, Handler]:
        """The methods by name, for the node's dispatch table."""
        return {"close_period": self.close_period}

    def close_period(self, params: list[Any]) -> Awaitable[dict[str, Any]]:
        """``close_period(period, node)``: ``{period, node, state, by, at}`` as stored (a
        close already there is kept)."""
        period, node = check_args("close_period", params, 2, 2)
        period = check_period(period)
        if not isinstance(node, str) or not node:
            raise InvalidArgument("close_period: node must be a node id (a string)")
        now = time.time()
        closes_at = period_closes_at(period, self.grace_s)
        if now < closes_at:
            raise InvalidArgument(
                f"close_period: period {period} may still count until {closes_at:.0f} (its end "
                "plus period_grace_s); nothing changed"
            )
        return self._close(period, node, now)

    async def _close(self, period: str, node: str, now: float) -> dict[str, Any]:
        try:
            owner = await self.storage.owner(node)
            if owner is not None and owner.expires > now:
                raise InvalidArgument(
                    f"close_period: node {node!r} is running (its id is owned until "
                    f"{owner.expires:.0f}): it closes the period itself once it has stored "
                    "everything; nothing changed"
                )
            mark = await self.storage.mark_period_closed(period, node, now, OPERATOR)
        except StoragePermanentError as exc:
            raise InvalidArgument(f"close_period: {exc}") from None
        except StorageError as exc:
            raise Unavailable(f"close_period: storage: {exc}") from None
        return {"period": period, "node": mark.node, "state": mark.state, "by": mark.by,
                "at": mark.at}  # fmt: skip
