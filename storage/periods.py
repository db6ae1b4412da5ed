"""Period names: what a counter's period is, read from its name alone. Pure: no I/O.

A period is named by its calendar and its start, so anything that holds a key (the flusher
dating a day bucket, storage setting a TTL, the closer judging a period over) knows its bounds
without asking whose it is (docs/periods.md):

- ``2026-11``: a UTC calendar month; ``2026-11-30``: a UTC day (the default calendar);
- ``2026-11@15:America/New_York``: a billing-cycle month that starts at local midnight of the
  15th (of the month's last day where it is shorter) in that IANA zone and ends where the next
  one starts; ``2026-11@15T09:30:America/New_York``: the same anchored at 09:30 local time;
- ``2026-11-30@America/New_York``: a local day of that zone.

Only canonical names are valid: one period, one name (an anchor of 1 at midnight in ``UTC``
is the UTC calendar, named without ``@``; midnight is named without ``T00:00``). Kept in
``storage`` because storage validates names and sets TTLs by them, and storage must not
depend on ``meter``.
"""

from __future__ import annotations

import calendar
import functools
import math
import re
from datetime import UTC, date, datetime, timedelta
from typing import Literal, NamedTuple
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

PeriodKind = Literal["month", "day"]

#: A zone name: what an IANA key may hold (``America/Argentina/Buenos_Aires``, ``Etc/GMT+5``).
ZONE_RE = re.compile(r"[A-Za-z][A-Za-z0-9_+\-]*(?:/[A-Za-z0-9_+\-]+){0,3}")
MAX_ZONE_CHARS = 64
_NAME_RE = re.compile(
    r"([0-9]{4})-([0-9]{2})(?:-([0-9]{2}))?"
    r"(?:@(?:([1-9][0-9]?)(?:T([0-9]{2}):([0-9]{2}))?:)?([^@:]{1,64}))?"
)
#: Minutes in a day: an anchor's time of day is ``0 <= minute < MINUTES_A_DAY``.
MINUTES_A_DAY = 1440


class Cycle(NamedTuple):
    """A billing cycle: periods start at local time ``minute`` (minutes after midnight) of
    ``day`` (1..31; the month's last day where it is shorter) in the IANA zone ``zone``.
    ``None`` stands for the UTC calendar."""

    day: int
    zone: str
    minute: int = 0


class Period(NamedTuple):
    """A period name, parsed: its kind, calendar (``None``: UTC) and start date."""

    kind: PeriodKind
    cycle: Cycle | None
    year: int
    month: int
    #: The day of a ``day`` period (a month's is its start, :func:`month_start_day`).
    day: int
    # (A zone's day period has the cycle of day 1 in its zone: only the zone counts.)


#: Names of UTC itself: a cycle in one of them is in ``UTC`` (one calendar, one name).
UTC_NAMES = frozenset(
    {"UTC", "Etc/UTC", "UCT", "Etc/UCT", "Universal", "Etc/Universal", "Zulu", "Etc/Zulu",
     "GMT", "Etc/GMT", "GMT0", "Etc/GMT0", "GMT+0", "Etc/GMT+0", "GMT-0", "Etc/GMT-0",
     "Greenwich", "Etc/Greenwich"}
)  # fmt: skip


@functools.lru_cache(maxsize=1)
def known_zones() -> frozenset[str]:
    """The IANA zones this machine knows, without the names that are not zones everywhere
    (``localtime`` is each machine's own setting; ``posixrules``, ``Factory``, and the
    ``posix/`` and ``right/`` copies)."""
    return frozenset(
        z
        for z in available_timezones()
        if z not in ("localtime", "posixrules", "Factory")
        and not z.startswith(("posix/", "right/"))
    )


def zone(name: str) -> ZoneInfo:
    """The IANA zone ``name``; :class:`ValueError` if it is not one."""
    if not isinstance(name, str) or len(name) > MAX_ZONE_CHARS or not ZONE_RE.fullmatch(name):
        raise ValueError(f"time zone {str(name)[:64]!r} is not an IANA zone name")
    if name not in known_zones() and name != "UTC":
        raise ValueError(f"time zone {name[:64]!r} is not a known IANA zone")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ValueError(f"time zone {name[:64]!r} is not a known IANA zone") from None


def cycle(day: int, zone_name: str, minute: int = 0) -> Cycle | None:
    """The cycle anchored on ``day`` at ``minute`` (minutes after local midnight) in
    ``zone_name`` (checked; a name of UTC is ``UTC``), ``None`` for the UTC calendar (day 1
    at midnight in UTC); :class:`ValueError` for a bad one."""
    if isinstance(day, bool) or not isinstance(day, int) or not 1 <= day <= 31:
        raise ValueError(f"anchor day must be an integer in 1..31, got {day!r}")
    if isinstance(minute, bool) or not isinstance(minute, int) or not 0 <= minute < MINUTES_A_DAY:
        raise ValueError(f"anchor time must be a minute of the day in 0..1439, got {minute!r}")
    zone(zone_name)
    if zone_name in UTC_NAMES:
        zone_name = "UTC"
    if day == 1 and zone_name == "UTC" and minute == 0:
        return None
    return Cycle(day, zone_name, minute)


def clock(minute: int) -> str:
    """``minute`` (after midnight) as ``HH:MM``."""
    return f"{minute // 60:02d}:{minute % 60:02d}"


def minute_of(text: object) -> int:
    """The minute after midnight that ``HH:MM`` (``00:00``..``23:59``) names;
    :class:`ValueError` for anything else."""
    if isinstance(text, str) and re.fullmatch(r"[0-9]{2}:[0-9]{2}", text):
        hours, minutes = int(text[:2]), int(text[3:])
        if hours < 24 and minutes < 60:
            return hours * 60 + minutes
    shown = text[:16] if isinstance(text, str) else type(text).__name__
    raise ValueError(f"anchor time must be HH:MM (00:00..23:59), got {shown!r}")


def month_start_day(year: int, month: int, anchor: int) -> int:
    """The day a cycle anchored on ``anchor`` starts in ``year``-``month``."""
    return min(anchor, calendar.monthrange(year, month)[1])


def _next_month(year: int, month: int) -> tuple[int, int]:
    return (year + 1, 1) if month == 12 else (year, month + 1)


def _prev_month(year: int, month: int) -> tuple[int, int]:
    return (year - 1, 12) if month == 1 else (year, month - 1)


def _midnight(z: ZoneInfo, day: date) -> float:
    """The first instant of local ``day`` in ``z``: where midnight does not exist (a clock
    jumping over it), the jump; where it is there twice, the first."""
    return datetime(day.year, day.month, day.day, tzinfo=z).timestamp()


def _cycle_start(c: Cycle, year: int, month: int) -> float:
    """The first instant of ``c``'s period of ``year``-``month``: its anchor's local time on
    its start day; a time the clock skips that day is read with the offset before the change
    (02:30 on a night the clock jumps from 02:00 to 03:00 is 03:30), a time it shows twice is
    the first."""
    day = date(year, month, month_start_day(year, month, c.day))
    hour, minute = divmod(c.minute, 60)  # (midnight: what _midnight reads)
    return datetime(day.year, day.month, day.day, hour, minute, tzinfo=zone(c.zone)).timestamp()


def name(c: Cycle | None, kind: PeriodKind, at: float) -> str:
    """The name of the period of ``kind`` in calendar ``c`` that holds the instant ``at``
    (epoch seconds). :class:`ValueError` where the period has no end before year 10000."""
    if c is None or (kind == "day" and c.zone == "UTC"):
        # (whole seconds: a time is rounded to microseconds, which would move an instant a
        # hair before midnight into the next day; every period starts on a whole second)
        moment = datetime.fromtimestamp(math.floor(at), tz=UTC)
        if kind == "month":
            return f"{moment.year:04d}-{moment.month:02d}"
        return f"{moment.year:04d}-{moment.month:02d}-{moment.day:02d}"
    z = zone(c.zone)
    try:
        local = datetime.fromtimestamp(at, tz=z).date()
        if kind == "day":
            # The local date, moved by one where a clock going back over midnight shows a
            # date whose day has started (or not) already.
            if at < _midnight(z, local):
                local -= timedelta(days=1)
            elif at >= _midnight(z, local + timedelta(days=1)):
                local += timedelta(days=1)
            _midnight(z, local + timedelta(days=1))  # (its end exists)
            return f"{local.isoformat()}@{c.zone}"
        year, month = local.year, local.month
        if at < _cycle_start(c, year, month):
            year, month = _prev_month(year, month)
        elif at >= _cycle_start(c, *_next_month(year, month)):
            year, month = _next_month(year, month)
        _cycle_start(c, *_next_month(year, month))  # (its end exists)
    except (OverflowError, ValueError):
        raise ValueError(f"instant {at!r} has no period in {c.zone} before year 10000") from None
    return f"{year:04d}-{month:02d}@{_anchor(c)}:{c.zone}"


def _anchor(c: Cycle) -> str:
    """A month name's anchor: ``15``, or ``15T09:30`` off midnight."""
    return f"{c.day}T{clock(c.minute)}" if c.minute else str(c.day)


@functools.lru_cache(maxsize=4096)
def parse(period: str) -> Period:
    """The parts of the period name ``period``; :class:`ValueError` if it is not a canonical
    name of a period with an end before year 10000 (cached: every key a flush writes asks)."""
    match = _NAME_RE.fullmatch(period) if isinstance(period, str) else None
    if match is None:
        raise ValueError(_bad(period))
    y, m, d, anchor, hh, mm, zone_name = match.groups()
    year, month = int(y), int(m)
    try:
        date(year, month, int(d) if d else 1)
    except ValueError:
        raise ValueError(_bad(period)) from None
    if zone_name is None:
        kind: PeriodKind = "day" if d else "month"
        return Period(kind, None, year, month, int(d) if d else 1)
    if (d is not None and anchor is not None) or (d is None and anchor is None):
        raise ValueError(_bad(period))
    try:
        minute = minute_of(f"{hh}:{mm}") if hh is not None else 0
        c = cycle(int(anchor) if anchor else 1, zone_name, minute)
    except ValueError as exc:
        raise ValueError(f"period {period[:80]!r}: {exc}") from None
    if hh is not None and minute == 0:
        raise ValueError(f"period {period[:80]!r}: name a midnight anchor without T00:00")
    if c is None or (d is not None and zone_name in UTC_NAMES):
        raise ValueError(f"period {period[:80]!r} is a UTC calendar period: name it without @")
    if c.zone != zone_name:
        raise ValueError(f"period {period[:80]!r}: name UTC as UTC (...@{_anchor(c)}:UTC)")
    if d is not None:
        out = Period("day", Cycle(1, zone_name), year, month, int(d))
    else:
        out = Period("month", c, year, month, month_start_day(year, month, c.day))
    try:
        bounds_of(out)
    except (OverflowError, ValueError):
        raise ValueError(f"period {period[:80]!r} ends after year 9999") from None
    return out


def _bad(period: object) -> str:
    shown = period[:80] if isinstance(period, str) else type(period).__name__
    return (
        f"period {shown!r} is not a period name (YYYY-MM, YYYY-MM-DD, YYYY-MM@D:Zone, "
        "YYYY-MM@DTHH:MM:Zone or YYYY-MM-DD@Zone)"
    )


def is_period(period: object) -> bool:
    """Whether ``period`` is a valid period name."""
    try:
        parse(period)
    except (ValueError, TypeError):
        return False
    return True


def bounds_of(p: Period) -> tuple[float, float]:
    """The first instant of the period ``p`` and the first after it (epoch seconds)."""
    if p.cycle is None:
        if p.kind == "day":
            start = float(calendar.timegm((p.year, p.month, p.day, 0, 0, 0)))
            return start, start + 86400
        # (start + length: after 9999-12 there is no next month to name)
        start = float(calendar.timegm((p.year, p.month, 1, 0, 0, 0)))
        return start, start + calendar.monthrange(p.year, p.month)[1] * 86400
    if p.kind == "day":
        z = zone(p.cycle.zone)
        day = date(p.year, p.month, p.day)
        return _midnight(z, day), _midnight(z, day + timedelta(days=1))
    return _cycle_start(p.cycle, p.year, p.month), _cycle_start(
        p.cycle, *_next_month(p.year, p.month)
    )


@functools.lru_cache(maxsize=4096)
def bounds(period: str) -> tuple[float, float]:
    """The first instant of the period named ``period`` and the first after it."""
    return bounds_of(parse(period))


def following(period: str) -> str:
    """The name of the period after ``period`` in its calendar; :class:`ValueError` past 9999."""
    p = parse(period)
    return name(p.cycle, p.kind, bounds(period)[1])


def preceding(period: str) -> str:
    """The name of the period before ``period`` in its calendar."""
    p = parse(period)
    return name(p.cycle, p.kind, bounds(period)[0] - 1)


def days(period: str) -> tuple[date, date]:
    """The first and last local dates of the month period ``period`` (its day buckets'):
    an anchor off midnight shares its start date with the period before (each has a bucket
    of that date, :func:`day_of`)."""
    p = parse(period)
    if p.kind != "month":
        raise ValueError(f"period {period[:80]!r} is not a month period")
    first = date(p.year, p.month, p.day)
    y, m = _next_month(p.year, p.month)
    if y > 9999:
        return first, date(9999, 12, 31)
    anchor = 1 if p.cycle is None else p.cycle.day
    following_start = date(y, m, month_start_day(y, m, anchor))
    if p.cycle is not None and p.cycle.minute:
        return first, following_start
    return first, following_start - timedelta(days=1)


def day_of(period: str, at: float) -> str:
    """The day bucket of a delta of the month period ``period`` sent at ``at``: the date of
    ``at`` in the period's calendar, kept inside the period's dates (a key of a later or
    earlier period, counted with ``at``, gets its first or last); ``YYYY-MM-DD`` for a UTC
    month, ``YYYY-MM-DD@D:Zone`` for a billing cycle's (its own bucket: a date of a change
    of calendar is in two periods, and a bucket keeps one sequence per node), and
    ``YYYY-MM-DD@<period>`` for a cycle anchored off midnight (its start date is in two of
    its periods)."""
    first, last = days(period)
    p = parse(period)
    tz = UTC if p.cycle is None else zone(p.cycle.zone)
    try:
        today = datetime.fromtimestamp(math.floor(at), tz=tz).date()
    except (OverflowError, ValueError):
        today = last
    day = min(max(today, first), last).isoformat()
    if p.cycle is None:
        return day
    return f"{day}@{period}" if p.cycle.minute else f"{day}@{period[8:]}"


def bucket_date(bucket: str) -> str:
    """The date (``YYYY-MM-DD``) of a day bucket's name (:func:`day_of`)."""
    return bucket[:10]


def bucket_of(bucket: str, period: str) -> bool:
    """Whether ``bucket`` (a day bucket's name) is one of the month period ``period``'s:
    one of its dates, under its calendar's name (none for a UTC month; the period's own
    for a cycle anchored off midnight, :func:`day_of`)."""
    date, at, calendar = bucket.partition("@")
    suffix = period.partition("@")[2]
    try:
        p = parse(period)
        if p.cycle is not None and p.cycle.minute:
            suffix = period
        if (at == "@") != bool(suffix) or calendar != suffix or len(date) != 10:
            return False
        first, last = days(period)
        return first <= datetime.strptime(date, "%Y-%m-%d").date() <= last
    except ValueError:
        return False
