"""A tenant's billing cycle over time: which calendar its periods follow at any instant. Pure.

A tenant's *schedule* is the list of its anchor changes, each ``(from, cycle)``: from the
instant ``from`` on, its periods follow ``cycle`` (:class:`storage.periods.Cycle`; ``None``:
UTC calendar months and days). Before the first change, the UTC calendar. A change set with
``assign_plan`` takes effect at the end of the period in force (by default) or now, never
sooner than :data:`NOTICE_S` from when it is made, so every node has read it before it
counts by it (docs/periods.md, ADR 0021).

Where a change cuts a period short (or starts one late), the period keeps its name: its name
says a later end (or an earlier start) than the tenant's stretch of it, so the name-derived
end a node closes it by is never too early.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping, Sequence
from typing import Literal

from storage.periods import Cycle, PeriodKind, bounds, clock, cycle, minute_of, name

#: A change takes effect this long after it is made, at the soonest: peers read the limits'
#: records on a change frame at once and every half second anyway (docs/quotas.md).
NOTICE_S = 60.0
#: How long a change is kept once another has replaced it: past the longest
#: ``period_grace_s`` (ten years) no call counts in its periods; a read with ``at`` that far
#: back is answered by UTC calendar periods.
KEPT_S = 11 * 365 * 86400.0
#: The most changes a schedule holds (within :data:`KEPT_S`); one more is refused.
MAX_CHANGES = 64

Schedule = tuple[tuple[float, Cycle | None], ...]
Effective = Literal["next_period", "now"]


def calendar_at(schedule: Schedule, at: float) -> Cycle | None:
    """The calendar ``schedule`` follows at the instant ``at``."""
    if not schedule:
        return None
    i = bisect.bisect_right(schedule, at, key=lambda entry: entry[0])
    return None if i == 0 else schedule[i - 1][1]


def period_name(schedule: Schedule, kind: PeriodKind, at: float) -> str:
    """The name of the tenant's period of ``kind`` holding ``at`` (:class:`ValueError` past
    year 9999 in its zone)."""
    return name(calendar_at(schedule, at), kind, at)


def next_change(schedule: Schedule, now: float) -> float:
    """When ``schedule`` next changes calendar after ``now`` (``inf``: never)."""
    for start, _ in schedule:
        if start > now:
            return start
    return math.inf


def stretches(
    schedule: Schedule, kind: PeriodKind, start: float, end: float
) -> list[tuple[str, float, float]]:
    """The tenant's periods of ``kind`` over ``[start, end)``, in order, each as ``(name,
    from, to)``: the stretch of it the tenant spends there (cut by a change of calendar, and
    by ``start`` and ``end``)."""
    out: list[tuple[str, float, float]] = []
    at = start
    while at < end:
        period = period_name(schedule, kind, at)
        stop = min(bounds(period)[1], next_change(schedule, at), end)
        if out and out[-1][0] == period:  # (a change to the calendar in force: one stretch)
            out[-1] = (period, out[-1][1], stop)
        else:
            out.append((period, at, stop))
        at = stop
    return out


def month_days(
    schedule: Schedule, periods: Sequence[str], start: float, end: float
) -> list[tuple[str, float, float]]:
    """The tenant's day stretches (:func:`stretches`) over the whole stretches of its month
    ``periods`` (those holding an instant of ``[start, end)``), from the start of the day
    holding the first one's start: a day counts in the month period holding its first
    instant, so a day an anchor's time of day (or a change of cycle in its zone) splits is
    the earlier period's, whatever the range asked."""
    wide = stretches(schedule, "month", start - 32 * 86400, end + 32 * 86400)
    cut = [(a, b) for p, a, b in wide if p in periods]
    first, last = min(a for a, _ in cut), max(b for _, b in cut)
    return stretches(schedule, "day", bounds(period_name(schedule, "day", first))[0], last)


def periods_between(schedule: Schedule, kind: PeriodKind, start: float, end: float) -> list[str]:
    """The names of the tenant's periods of ``kind`` that hold an instant in ``[start, end)``,
    in order (a period cut by a change of calendar is listed once)."""
    return list(dict.fromkeys(name for name, _, _ in stretches(schedule, kind, start, end)))


def changed(
    schedule: Schedule, new: Cycle | None, now: float, effective: Effective = "next_period"
) -> Schedule:
    """``schedule`` with ``new`` taking effect at the end of the period in force at
    ``now + NOTICE_S`` (``next_period``) or at ``now + NOTICE_S`` (``now``): nothing before
    ``now + NOTICE_S`` changes. A change due after that is replaced; a change to the
    calendar in force then is none. :class:`ValueError` past :data:`MAX_CHANGES` changes
    within :data:`KEPT_S`, or where the period in force has no end before year 10000."""
    # A change due within the notice is fixed: a node may be counting by it already.
    base = tuple(entry for entry in schedule if entry[0] <= now + NOTICE_S)
    soonest = float(math.ceil(now + NOTICE_S))
    if base and base[-1][0] >= soonest:
        soonest = base[-1][0] + 1  # (changes are one second apart at least)
    if calendar_at(base, soonest) == new:
        return base
    start = soonest if effective == "now" else bounds(period_name(base, "month", soonest))[1]
    out = (*base, (start, new))
    # Changes whose calendar stopped long before anything may count late (the longest
    # grace) are dropped: no call can name an instant they govern any more.
    while len(out) > 1 and out[1][0] < now - KEPT_S:
        out = out[1:]
    if len(out) > MAX_CHANGES:
        raise ValueError(
            f"a tenant's billing cycle changes at most {MAX_CHANGES} times in 11 years"
        )
    return out


def encode(schedule: Schedule) -> str:
    """The stored body of ``schedule`` (JSON: ``[[from, day, zone], ...]``, with a fourth
    element, the anchor's minute of the day, where it is off midnight)."""
    rows: list[list[object]] = []
    for start, c in schedule:
        day, zone_name, minute = c if c is not None else (1, "UTC", 0)
        rows.append([start, day, zone_name, minute] if minute else [start, day, zone_name])
    return json.dumps(rows, separators=(",", ":"))


def decode(body: str) -> Schedule:
    """The schedule stored as ``body``; :class:`ValueError` if it is not one."""
    rows = json.loads(body)
    if not isinstance(rows, list):
        raise ValueError("a schedule is a list of [from, day, zone]")
    out: list[tuple[float, Cycle | None]] = []
    for row in rows:
        if not (isinstance(row, list) and len(row) in (3, 4) and isinstance(row[0], int | float)):
            raise ValueError(f"schedule entry {str(row)[:64]} is not [from, day, zone(, minute)]")
        if out and row[0] <= out[-1][0]:
            raise ValueError("schedule entries are not in order")
        out.append((float(row[0]), cycle(row[1], row[2], row[3] if len(row) == 4 else 0)))
    return tuple(out)


def of_kind(calendars: Sequence[Cycle | None], kind: PeriodKind) -> list[Cycle | None]:
    """``calendars`` as far as periods of ``kind`` tell them apart: a day is its zone's,
    whatever the anchor (the UTC calendar first)."""
    if kind == "month":
        return list(calendars)
    zones = sorted({c.zone for c in calendars if c is not None and c.zone != "UTC"})
    return [None, *(Cycle(1, z) for z in zones)]


def describe(c: Cycle | None) -> dict[str, object]:
    """``c`` as the protocol shows it."""
    if c is None:
        return {"anchor_day": 1, "anchor_time": "00:00", "tz": "UTC"}
    return {"anchor_day": c.day, "anchor_time": clock(c.minute), "tz": c.zone}


def check_cycle_opts(opts: Mapping[str, object]) -> tuple[Cycle | None, Effective] | None:
    """The cycle and when it takes effect that ``assign_plan``'s options ask for (``None``:
    they ask for no change); :class:`ValueError` for bad ones."""
    if "anchor_day" not in opts and "tz" not in opts and "anchor_time" not in opts:
        if "effective" in opts:
            raise ValueError("effective is given without anchor_day, anchor_time or tz")
        return None
    day = opts.get("anchor_day", 1)
    minute = minute_of(opts.get("anchor_time", "00:00"))
    zone_name = opts.get("tz", "UTC")
    if not isinstance(zone_name, str):
        raise ValueError(f"tz must be an IANA zone name (a string), got {type(zone_name).__name__}")
    effective = opts.get("effective", "next_period")
    if effective not in ("next_period", "now"):
        raise ValueError(f'effective must be "next_period" or "now", got {str(effective)[:32]!r}')
    return cycle(day, zone_name, minute), ("now" if effective == "now" else "next_period")  # type: ignore[arg-type]


def entries(schedule: Schedule) -> Sequence[dict[str, object]]:
    """``schedule`` as the protocol shows it: each change's ``from`` and cycle."""
    return [{"from": start, **describe(c)} for start, c in schedule]
