"""The ``history`` method (docs/history.md): stored day or month buckets of a range, with
what ``usage`` knows that storage does not have yet added to the current period's bucket."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Any, cast

from meter.core.cycles import Schedule, month_days, period_name, periods_between, stretches
from meter.core.dims import is_dimension, where_name
from meter.core.gauging import Gauging
from meter.core.groups import Groups
from meter.core.keycache import KeyCache
from meter.core.keys import check_feature, check_tenant
from meter.core.params import args as check_args
from meter.core.ports import Handler
from meter.core.seeder import Seeder
from meter.core.table import CounterTable
from meter.errors import InvalidArgument, Unavailable
from meter.history.days import (
    Granularity,
    days_between,
    flush_day,
    last_day,
    months_between,
    parse_range,
    utc_span,
)
from storage.base import GAUGE_MARK, DayBuckets, StorageError
from storage.periods import bucket_date, bucket_of, days


class HistoryMethods:
    """The handler, over one node's table, key cache, seeder and storage."""

    def __init__(
        self,
        table: CounterTable,
        keys: KeyCache,
        seeder: Seeder,
        storage: DayBuckets,
        groups: Groups,
        gauging: Gauging,
    ) -> None:
        self.table = table
        self.keys = keys
        self.seeder = seeder
        self.storage = storage
        #: Reads of a dimension counter (``where``): one no call made reads 0.
        self.groups = groups
        #: Gauges: each period is its stored reading (no day buckets are kept of a month).
        self.gauging = gauging

    def handlers(self) -> dict[str, Handler]:
        return {"history": self.history}

    def history(self, params: list[Any]) -> Awaitable[list[list[Any]]]:
        tenant, feature, opts = check_args("history", params, 2, 3)
        tenant = check_tenant(tenant)
        feature = check_feature(feature)
        now = time.time()
        schedule = self.keys.schedule(tenant)
        today = None if schedule is None else period_name(schedule, "day", now)[:10]
        granularity, first, last = parse_range(opts, now, today)
        gauge = self.gauging.kind(feature)
        if gauge is not None:
            if granularity == "day" and self.keys.kind_of(feature) == "month":
                raise InvalidArgument(
                    f"history: {feature!r} is a gauge (max or latest) kept per month: read it "
                    'with granularity "month", not per day'
                )
            return self._gauge_history(tenant, feature, gauge, granularity, first, last, now)
        where = opts.get("where") if isinstance(opts, dict) else None
        if where is not None:  # one dimension value's counter (docs/dimensions.md)
            feature = where_name(feature, self.keys.spec(feature), where)
        if schedule is not None:
            return self._cycle_history(tenant, feature, schedule, granularity, first, last, now)
        return self._history(tenant, feature, granularity, first, last, now)

    async def _history(
        self, tenant: str, feature: str, granularity: Granularity, first: str, last: str, now: float
    ) -> list[list[Any]]:
        kind = self.keys.kind_of(feature)
        if granularity == "day":
            buckets = days_between(first, last)
            months = months_between(first[:7], last[:7])
        else:
            buckets = months_between(first, last)
            months = buckets
        # Whole months are read: what a month's stored days do not hold of its live value
        # goes to the day its next flush will write (today in the current month).
        low, high = months[0] + "-01", last_day(months[-1])
        storage = self.storage
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

    async def _cycle_history(
        self,
        tenant: str,
        feature: str,
        schedule: Schedule,
        granularity: Granularity,
        first: str,
        last: str,
        now: float,
    ) -> list[list[Any]]:
        """:meth:`_history` of a tenant with a billing cycle (docs/periods.md): day rows are
        its zone's dates; month rows are its periods (by name) that hold an instant of the
        UTC months ``first``..``last``. Only the tenant's own stretch of each period counts
        (a change of calendar cuts one short)."""
        start, end = utc_span(granularity, first, last)
        if granularity == "month":
            periods = periods_between(schedule, "month", start, end)
        if self.keys.kind_of(feature) == "month":
            if granularity == "month":
                return [[p, await self._period_total(tenant, feature, p, now)] for p in periods]
            # Every period whose dates meet the range, cut short by a change or not (a
            # period is at most 32 days: its stretch lies within that of the range).
            near = periods_between(schedule, "month", start - 33 * 86400, end + 33 * 86400)
            dates = {p: days(p) for p in near}
            meet = [
                p
                for p in near
                if dates[p][0].isoformat() <= last and dates[p][1].isoformat() >= first
            ]
            low = min([first, *(dates[p][0].isoformat() for p in meet)])
            high = max([last, *(dates[p][1].isoformat() for p in meet)])
            try:
                buckets = await self.storage.day_buckets(tenant, feature, low, high)
            except StorageError as exc:
                raise Unavailable(f"storage is unreachable: {exc}") from None
            # What this node holds of a period that storage does not have yet goes to the
            # day its next flush writes, so the period's days sum to usage (as _history).
            for period in meet:
                live = await self._live(tenant, feature, period, now)
                day = flush_day(period, now)
                if live is None or day is None:
                    continue
                own = [b for b in buckets if bucket_of(b, period)]
                buckets[day] = live - sum(buckets[b] for b in own if b != day)
            stored: dict[str, int] = {}  # (a date of a change of calendar: two buckets)
            for bucket, units in buckets.items():
                stored[bucket_date(bucket)] = stored.get(bucket_date(bucket), 0) + units
            return [[d, stored.get(d, 0)] for d in days_between(first, last)]
        # A day feature: each of the tenant's days is a period, named in its zone; a date of
        # a change of zone is two such days.
        if granularity == "month":  # (the whole stretches of those periods: a month's days)
            spans = month_days(schedule, periods, start, end)
        else:  # (any zone's days of those dates)
            spans = stretches(schedule, "day", start - 86400, end + 86400)
        values = await self._day_values(tenant, feature, [d[0] for d in spans], now)
        if granularity == "day":
            by_date: dict[str, int] = {}
            for period in values:
                by_date[period[:10]] = by_date.get(period[:10], 0) + values[period]
            return [[d, by_date.get(d, 0)] for d in days_between(first, last)]
        by_period = dict.fromkeys(periods, 0)
        for period, month in {(p, period_name(schedule, "month", at)) for p, at, _ in spans}:
            if month in by_period:
                by_period[month] += values[period]
        return [[p, units] for p, units in by_period.items()]

    async def _period_total(self, tenant: str, feature: str, period: str, now: float) -> int:
        """A period's total: this node's where it holds it, else storage's."""
        live = await self._live(tenant, feature, period, now)
        return live if live is not None else await self._stored_total(tenant, feature, period)

    async def _stored_total(self, tenant: str, feature: str, period: str) -> int:
        try:
            stored = await self.storage.counters_between(tenant, feature, period, period)
        except StorageError as exc:
            raise Unavailable(f"storage is unreachable: {exc}") from None
        return stored.get(period, 0)

    async def _day_values(
        self, tenant: str, feature: str, periods: list[str], now: float
    ) -> dict[str, int]:
        """Each of ``periods`` (days, of one zone or more) read: this node's value where it
        holds it, else storage's; one storage read per zone."""
        by_zone: dict[str, list[str]] = {}
        for period in dict.fromkeys(periods):
            by_zone.setdefault(period[10:], []).append(period)
        out: dict[str, int] = {}
        for group in by_zone.values():
            group.sort()
            try:
                stored = await self.storage.counters_between(tenant, feature, group[0], group[-1])
            except StorageError as exc:
                raise Unavailable(f"storage is unreachable: {exc}") from None
            for period in group:
                live = await self._live(tenant, feature, period, now)
                out[period] = live if live is not None else stored.get(period, 0)
        return out

    async def _gauge_history(
        self,
        tenant: str,
        feature: str,
        gauge: str,
        granularity: Granularity,
        first: str,
        last: str,
        now: float,
    ) -> list[list[Any]]:
        """A gauge's periods: each its stored reading, with this node's for the periods it
        holds; a day gauge's months (and, for a tenant with a billing cycle, a date holding
        two zones' days) are their days combined as the gauge is (``max``: the largest,
        ``latest``: the last day observed). A period never observed reads 0."""
        rows = self._gauge_rows(tenant, feature, granularity, first, last)
        names = list(dict.fromkeys(p for _, periods in rows for p in periods))
        readings = await self._gauge_readings(tenant, feature, gauge, names, now)
        out: list[list[Any]] = []
        for label, periods in rows:
            value: int | None = None
            for period in periods:  # (in order: a later day's value replaces for latest)
                if period in readings:
                    v = readings[period]
                    value = v if value is None or gauge == "latest" else max(value, v)
            out.append([label, 0 if value is None else value])
        return out

    def _gauge_rows(
        self, tenant: str, feature: str, granularity: Granularity, first: str, last: str
    ) -> list[tuple[str, list[str]]]:
        """Each row of a gauge's history and the periods it combines, in order."""
        daily = self.keys.kind_of(feature) == "day"
        schedule = self.keys.schedule(tenant)
        if schedule is None:  # (UTC calendar periods: a row is a month or a day)
            if not daily or granularity == "day":
                shown = months_between if granularity == "month" else days_between
                return [(b, [b]) for b in shown(first, last)]
            return [(m, days_between(f"{m}-01", last_day(m))) for m in months_between(first, last)]
        start, end = utc_span(granularity, first, last)
        if not daily:
            return [(p, [p]) for p in periods_between(schedule, "month", start, end)]
        if granularity == "day":
            spans = stretches(schedule, "day", start - 86400, end + 86400)
            return [(d, [p for p, _, _ in spans if p[:10] == d]) for d in days_between(first, last)]
        periods = periods_between(schedule, "month", start, end)
        spans = month_days(schedule, periods, start, end)
        return [
            (m, [p for p, at, _ in spans if period_name(schedule, "month", at) == m])
            for m in periods
        ]

    async def _gauge_readings(
        self, tenant: str, feature: str, gauge: str, periods: list[str], now: float
    ) -> dict[str, int]:
        """The reading of each of ``periods`` observed: storage's, or this node's view where
        it holds the period (storage's merged with its own); one storage read per calendar."""
        groups: dict[tuple[int, str], list[str]] = {}
        for period in periods:
            cut = 10 if len(period) >= 10 and period[7] == "-" else 7  # (a day, or a month)
            groups.setdefault((cut, period[cut:]), []).append(period)
        stored: dict[str, int] = {}
        for group in groups.values():
            try:
                got = await self.storage.counters_between(
                    tenant, feature + GAUGE_MARK, min(group), max(group)
                )
            except StorageError as exc:
                raise Unavailable(f"storage is unreachable: {exc}") from None
            stored.update((p, v) for p, v in got.items() if p in group)
        current = self.keys.period_of(tenant, self.keys.kind_of(feature), now)
        table = self.gauging.table
        for period in periods:
            key = (tenant, feature, period)
            if period == current or (key, gauge) in table.unseeded_in(tenant, period):
                await self.gauging.load([(key, gauge)])  # (held unread: the log's readings)
            reading = table.reading(key)
            if reading is not None:  # (this node's view: storage's merged with its own)
                stored[period] = reading[0]
        return stored

    async def _live(self, tenant: str, feature: str, period: str, now: float) -> int | None:
        """What ``usage`` says of the counter of ``period``: for the current period (read from
        storage if cold), or for any other one this node holds (``None`` if it does not: then
        it has no units of it that storage lacks)."""
        key = (tenant, feature, period)
        if period == self.keys.period_of(tenant, self.keys.kind_of(feature), now):
            return await self._usage(tenant, feature, now)
        if not self.table.is_seeded(key):
            return None
        return self.table.value(key)

    async def _usage(self, tenant: str, feature: str, now: float) -> int:
        """What ``usage`` answers for the counter of the current period (``feature``: a
        validated feature, or a dimension counter's name)."""
        keys = self.keys
        key = (tenant, feature, keys.period(keys.period_of(tenant, keys.kind_of(feature), now)))
        if is_dimension(feature):
            got = self.groups.value(key)
            return cast(int, await got if isinstance(got, Awaitable) else got)
        value = self.table.value(key)
        if value is not None:
            return value
        if not self.table.is_seeded(key) and not await self.seeder.seed(key):
            raise Unavailable("storage is unreachable and this counter's total is not known")
        value = self.table.value(key)
        if value is None:  # evicted between seeding and reading: practically never
            raise Unavailable("counter was evicted while being read; retry")
        return value
