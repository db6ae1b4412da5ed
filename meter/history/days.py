"""History: a counter's units per UTC day or month over a range (docs/history.md).

Every month counter is also kept per UTC day in storage (its *day buckets*), written by the
flush that writes the counter, under the same ``(node, seq)``: the flusher picks the day here
(:func:`flush_day`) and storage applies it exactly once per bucket. The ``history`` method
(:class:`HistoryMethod`) reads the stored buckets of a range in one storage read and adds
what usage knows that storage does not have yet to the current period's bucket, so the
current day's (or month's) bucket agrees with ``usage``.
"""

from __future__ import annotations

import calendar
import re
import time
from collections.abc import Awaitable, Mapping
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

from meter.core.keys import check_feature, check_tenant, period_start
from meter.errors import InvalidArgument, Unavailable
from storage.base import StorageError

if TYPE_CHECKING:
    from meter.core.service import Service

Granularity = Literal["day", "month"]

#: The longest range one call may ask for, per granularity (a bound on the answer's size and
#: on the storage read: 400 days is about one DynamoDB Query page).
MAX_DAYS = 400
MAX_MONTHS = 120
#: The range asked for when ``from`` is left out, ending at ``to``.
DEFAULT_DAYS = 30
DEFAULT_MONTHS = 12

_OPTS = frozenset({"from", "to", "granularity"})
#: ASCII digits only: ``strptime`` alone takes ``"2026-11- 3"`` for a day.
_DAY_RE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
_MONTH_RE = re.compile(r"[0-9]{4}-[0-9]{2}")


def flush_day(period: str, now: float) -> str | None:
    """The day bucket a flush at ``now`` (epoch seconds) writes a month key's delta to: the
    UTC day of ``now`` clamped into the month ``period`` (units counted into November and
    flushed on December 1 go to November 30, so a month's days sum to the month). ``None``
    for a day key: it is its own day bucket."""
    return clamp_day(period, utc_day(now))


def utc_day(now: float) -> str:
    """The UTC day (``YYYY-MM-DD``) of the instant ``now``."""
    moment = datetime.fromtimestamp(now, tz=UTC)
    return f"{moment.year:04d}-{moment.month:02d}-{moment.day:02d}"


def clamp_day(period: str, today: str) -> str | None:
    """:func:`flush_day` for the day ``today`` (the flusher dates a whole round at once)."""
    if len(period) != 7:
        return None
    if today.startswith(period):
        return today
    if today < period:  # a key of a later month (counted with ``at``): its first day
        return f"{period}-01"
    return last_day(period)


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


def parse_range(opts: object, now: float) -> tuple[Granularity, str, str]:
    """The granularity and the first and last bucket of a ``history`` call's options."""
    if opts is None:
        opts = {}
    if not isinstance(opts, Mapping):
        raise InvalidArgument(f"history: opts must be a map, got {type(opts).__name__}")
    for name in opts:
        if name not in _OPTS:
            names = ", ".join(sorted(_OPTS))
            raise InvalidArgument(f"history: unknown option {str(name)[:32]!r} (allowed: {names})")
    granularity = opts.get("granularity", "day")
    if granularity not in ("day", "month"):
        raise InvalidArgument(
            f'history: granularity must be "day" or "month", got {str(granularity)[:32]!r}'
        )
    g: Granularity = "day" if granularity == "day" else "month"
    current = period_start(g, now)
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


class HistoryMethod:
    """The ``history`` method of one node's :class:`~meter.core.service.Service`."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def handlers(self) -> dict[str, Any]:
        return {"history": self.history}

    def history(self, params: list[Any]) -> Awaitable[list[list[Any]]]:
        n = len(params)
        if not 2 <= n <= 3:
            raise InvalidArgument(f"history takes 2 to 3 params, got {n}")
        tenant = check_tenant(params[0])
        feature = check_feature(params[1])
        now = time.time()
        granularity, first, last = parse_range(params[2] if n == 3 else None, now)
        return self._history(tenant, feature, granularity, first, last, now)

    async def _history(
        self, tenant: str, feature: str, granularity: Granularity, first: str, last: str, now: float
    ) -> list[list[Any]]:
        kind = self.service.config.feature_periods.get(feature, "month")
        if granularity == "day":
            buckets = days_between(first, last)
            months = months_between(first[:7], last[:7])
        else:
            buckets = months_between(first, last)
            months = buckets
        # Whole months are read: what a month's stored days do not hold of its live value
        # goes to the day its next flush will write (today in the current month).
        low, high = months[0] + "-01", last_day(months[-1])
        storage = self.service.storage
        try:
            if kind == "month" and granularity == "month":
                stored = await storage.counters_between(tenant, feature, first, last)
            elif kind == "month":
                stored = await storage.day_buckets(tenant, feature, low, high)
            else:
                stored = await storage.counters_between(tenant, feature, low, high)
        except StorageError as exc:
            raise Unavailable(f"storage is unreachable: {exc}") from None
        if kind == "month":
            for month in months:
                live = await self._live(tenant, feature, month, now)
                if live is None:
                    continue
                if granularity == "month":
                    stored[month] = live
                    continue
                day = flush_day(month, now)
                assert day is not None
                before = sum(v for d, v in stored.items() if d.startswith(month) and d != day)
                stored[day] = live - before
        else:
            for day in days_between(low, high):
                live = await self._live(tenant, feature, day, now)
                if live is not None:
                    stored[day] = live
            if granularity == "month":
                sums: dict[str, int] = {}
                for day, units in stored.items():
                    sums[day[:7]] = sums.get(day[:7], 0) + units
                stored = sums
        return [[b, stored.get(b, 0)] for b in buckets]

    async def _live(self, tenant: str, feature: str, period: str, now: float) -> int | None:
        """What ``usage`` says of the counter of ``period``: for the current period (read from
        storage if cold), or for any other one this node holds (``None`` if it does not: then
        it has no units of it that storage lacks)."""
        service = self.service
        key = (tenant, feature, period)
        if period in (period_start("day", now), period_start("month", now)):
            return await self._usage(tenant, feature, now)
        if not service.table.is_seeded(key):
            return None
        return service.table.value(key)

    async def _usage(self, tenant: str, feature: str, now: float) -> int:
        """What ``usage`` answers for the counter of the current period."""
        service = self.service
        key = service.key_for(tenant, feature, now)
        value = service.table.value(key)
        if value is not None:
            return value
        if not await service.seed(key):
            raise Unavailable("storage is unreachable and this counter's total is not known")
        value = service.table.value(key)
        if value is None:  # evicted between seeding and reading: practically never
            raise Unavailable("counter was evicted while being read; retry")
        return value
