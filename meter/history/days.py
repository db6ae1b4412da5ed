"""History: a counter's units per UTC day or month over a range (docs/history.md).

Every month counter is also kept per UTC day in storage (its *day buckets*), written by the
flush that writes the counter, under the same ``(node, seq)``: the flusher picks the day here
(:func:`flush_day`) and storage applies it exactly once per bucket. The ``history`` method
(:mod:`meter.history.methods`) reads the stored buckets of a range in one storage read and
adds what usage knows that storage does not have yet to the current period's bucket, so the
current day's (or month's) bucket agrees with ``usage``. Pure: dates and ranges, no I/O.
"""

from __future__ import annotations

import calendar
import math
import re
import time
from datetime import UTC, date, datetime, timedelta
from typing import Literal

from meter.core.keys import period_start
from meter.core.params import opts as check_opts
from meter.errors import InvalidArgument
from storage.periods import day_of, is_period, parse

Granularity = Literal["day", "month"]

#: The longest range one call may ask for, per granularity (a bound on the answer's size and
#: on the storage read: 400 days is about one DynamoDB Query page).
MAX_DAYS = 400
MAX_MONTHS = 120
#: The range asked for when ``from`` is left out, ending at ``to``.
DEFAULT_DAYS = 30
DEFAULT_MONTHS = 12

_OPTS = frozenset({"from", "to", "granularity", "where"})
#: ASCII digits only: ``strptime`` alone takes ``"2026-11- 3"`` for a day.
_DAY_RE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
_MONTH_RE = re.compile(r"[0-9]{4}-[0-9]{2}")


def flush_day(period: str, now: float) -> str | None:
    """The day bucket a flush at ``now`` (epoch seconds) writes a month key's delta to: the
    UTC day (a billing cycle's: its zone's day) of ``now`` clamped into the month ``period``
    (units counted into November and flushed on December 1 go to November 30, so a month's
    days sum to the month). ``None``
    for a day key: it is its own day bucket."""
    return clamp_day(period, utc_day(now), now)


def utc_day(now: float) -> str:
    """The UTC day (``YYYY-MM-DD``) of the instant ``now`` (its whole second, as period
    names are judged)."""
    moment = datetime.fromtimestamp(math.floor(now), tz=UTC)
    return f"{moment.year:04d}-{moment.month:02d}-{moment.day:02d}"


def clamp_day(period: str, today: str, now: float) -> str | None:
    """:func:`flush_day` for the UTC day ``today`` of ``now`` (the flusher dates a whole
    round at once). A billing cycle's month dates by its zone's days (storage.periods)."""
    if len(period) != 7:
        if "@" not in period or not is_period(period) or parse(period).kind != "month":
            return None
        return day_of(period, now)
    if today.startswith(period):
        return today
    if today < period:  # a key of a later month (counted with ``at``): its first day
        return f"{period}-01"
    return last_day(period)


def utc_span(granularity: Granularity, first: str, last: str) -> tuple[float, float]:
    """The first instant of the UTC day or month ``first`` and the first after ``last``."""
    start = date.fromisoformat(first if granularity == "day" else f"{first}-01")
    stop = date.fromisoformat(last if granularity == "day" else last_day(last))
    return (
        float(calendar.timegm(start.timetuple())),
        float(calendar.timegm(stop.timetuple())) + 86400,
    )


def days_between(first: str, last: str) -> list[str]:
    """Every ``YYYY-MM-DD`` from ``first`` to ``last``, inclusive."""
    a, b = date.fromisoformat(first), date.fromisoformat(last)
    return [(a + timedelta(days=i)).isoformat() for i in range((b - a).days + 1)]


def months_between(first: str, last: str) -> list[str]:
    """Every ``YYYY-MM`` from ``first`` to ``last``, inclusive."""
    n = _month_index(last) - _month_index(first)
    start = _month_index(first)
    return [_month_name(start + i) for i in range(n + 1)]


def last_day(month: str) -> str:
    """The last ``YYYY-MM-DD`` of ``month``."""
    return f"{month}-{calendar.monthrange(int(month[:4]), int(month[5:7]))[1]:02d}"


def _month_index(month: str) -> int:
    return int(month[:4]) * 12 + int(month[5:7]) - 1


def _month_name(index: int) -> str:
    return f"{index // 12:04d}-{index % 12 + 1:02d}"


def _parse(field: str, value: object, granularity: Granularity) -> str:
    """A ``from``/``to`` option: ``YYYY-MM-DD`` for days, ``YYYY-MM`` for months."""
    shape = "YYYY-MM-DD" if granularity == "day" else "YYYY-MM"
    pattern = _DAY_RE if granularity == "day" else _MONTH_RE
    if not isinstance(value, str) or pattern.fullmatch(value) is None:
        raise InvalidArgument(
            f"history: {field} must be a UTC {granularity} {shape} for {granularity} "
            f"granularity, got {str(value)[:32]!r}"
        )
    try:
        datetime.strptime(value, "%Y-%m-%d" if granularity == "day" else "%Y-%m")
    except ValueError:
        raise InvalidArgument(
            f"history: {field} {value!r} is not a real {granularity} ({shape})"
        ) from None
    return value


def parse_range(opts: object, now: float, today: str | None = None) -> tuple[Granularity, str, str]:
    """The granularity and the first and last bucket of a ``history`` call's options;
    ``today``: the tenant's date now, if not the UTC one (a billing cycle's zone)."""
    opts = check_opts("history", opts, _OPTS)
    granularity = opts.get("granularity", "day")
    if granularity not in ("day", "month"):
        raise InvalidArgument(
            f'history: granularity must be "day" or "month", got {str(granularity)[:32]!r}'
        )
    g: Granularity = "day" if granularity == "day" else "month"
    current = today if g == "day" and today is not None else period_start(g, now)
    last = current if opts.get("to") is None else _parse("to", opts["to"], g)
    if opts.get("from") is not None:
        first = _parse("from", opts["from"], g)
    elif g == "day":
        try:
            first = (date.fromisoformat(last) - timedelta(days=DEFAULT_DAYS - 1)).isoformat()
        except OverflowError:
            first = "0001-01-01"
    else:
        first = _month_name(max(_month_index(last) - (DEFAULT_MONTHS - 1), 12))
    if first > last:
        raise InvalidArgument(f"history: from {first} is after to {last}")
    if g == "day":
        n = (date.fromisoformat(last) - date.fromisoformat(first)).days + 1
        cap = MAX_DAYS
    else:
        n = _month_index(last) - _month_index(first) + 1
        cap = MAX_MONTHS
    if n > cap:
        raise InvalidArgument(
            f"history: from {first} to {last} is {n} {g}s; at most {cap} per call"
        )
    return g, first, last


#: Eighths of a block, for the bar chart of ``meter history``.
_BLOCKS = " ▏▎▍▌▋▊▉█"
#: Widest bar, in characters.
BAR_WIDTH = 40


def history_args(days: int | None, months: int | None, now: float | None = None) -> tuple[str, str]:
    """``meter history --days N | --months N`` as the ``from`` and granularity to ask for
    (the node checks the range)."""
    today = datetime.fromtimestamp(time.time() if now is None else now, tz=UTC).date()
    if months is not None:
        if months < 1:
            raise InvalidArgument(f"--months must be at least 1, got {months}")
        return _month_name(max(_month_index(today.isoformat()[:7]) - months + 1, 12)), "month"
    n = DEFAULT_DAYS if days is None else days
    if n < 1:
        raise InvalidArgument(f"--days must be at least 1, got {n}")
    try:
        return (today - timedelta(days=n - 1)).isoformat(), "day"
    except OverflowError:
        return "0001-01-01", "day"


def render(points: list[tuple[str, int]]) -> str:
    """The buckets as lines ``PERIOD  VALUE  BAR`` for a terminal: bars of unicode blocks in
    eighths, the largest value :data:`BAR_WIDTH` wide (negative values get none)."""
    if not points:
        return "(no buckets)"
    top = max(max(v for _, v in points), 0)
    width = max(len(str(v)) for _, v in points)
    lines = []
    for period, value in points:
        eighths = 0 if top <= 0 or value <= 0 else max(1, value * BAR_WIDTH * 8 // top)
        bar = _BLOCKS[8] * (eighths // 8) + (_BLOCKS[eighths % 8] if eighths % 8 else "")
        lines.append(f"{period}  {value:>{width}}  {bar}".rstrip())
    total = sum(v for _, v in points)
    lines.append(f"{'total':<{len(points[0][0])}}  {total:>{width}}")
    return "\n".join(lines)
