"""The ``history`` method (docs/history.md): stored day or month buckets of a range, with
what ``usage`` knows that storage does not have yet added to the current period's bucket."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from datetime import UTC, datetime
from typing import Any, cast

from meter.core.cycles import Schedule, calendar_at, periods_between
from meter.core.dims import is_dimension, where_name
from meter.core.gauging import Gauging
from meter.core.groups import Groups
from meter.core.keycache import KeyCache
from meter.core.keys import check_feature, check_tenant, period_start
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
from storage.periods import days


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
        granularity, first, last = parse_range(opts, now)
        gauge = self.gauging.kind(feature)
        if gauge is not None and self.keys.schedule(tenant) is not None:
            raise InvalidArgument(
                f"history: {feature!r} is a gauge and {tenant!r} has a billing cycle: read its "
                "periods with usage and at (gauge history follows UTC calendar periods only)"
            )
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
        schedule = self.keys.schedule(tenant)
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
        UTC months ``first``..``last``."""
        start, end = utc_span(granularity, first, last)
        if self.keys.kind_of(feature) == "month":
            if granularity == "month":
                periods = periods_between(schedule, "month", start, end)
                return [[p, await self._period_total(tenant, feature, p, now)] for p in periods]
            periods = periods_between(schedule, "month", start - 86400, end + 86400)
            low = min(days(p)[0] for p in periods).isoformat()
            high = max(days(p)[1] for p in periods).isoformat()
            try:
                stored = await self.storage.day_buckets(tenant, feature, low, high)
            except StorageError as exc:
                raise Unavailable(f"storage is unreachable: {exc}") from None
            for period in periods:
                live = await self._live(tenant, feature, period, now)
                if live is None:
                    continue
                day = flush_day(period, now)
                assert day is not None
                a, b = (d.isoformat() for d in days(period))
                stored[day] = live - sum(v for d, v in stored.items() if a <= d <= b and d != day)
            return [[d, stored.get(d, 0)] for d in days_between(first, last)]
        # A day feature: each date is a period of its own, named in the tenant's zone.
        if granularity == "month":
            periods = periods_between(schedule, "month", start, end)
            low = min(days(p)[0] for p in periods).isoformat()
            high = max(days(p)[1] for p in periods).isoformat()
        else:
            periods, low, high = [], first, last
        by_date = await self._days(tenant, feature, schedule, low, high, now)
        if granularity == "day":
            return [[d, by_date.get(d, 0)] for d in days_between(first, last)]
        rows: list[list[Any]] = []
        for period in periods:
            a, b = (d.isoformat() for d in days(period))
            rows.append([period, sum(v for d, v in by_date.items() if a <= d <= b)])
        return rows

    async def _period_total(self, tenant: str, feature: str, period: str, now: float) -> int:
        """A month period's total: this node's where it holds it, else storage's."""
        live = await self._live(tenant, feature, period, now)
        if live is not None:
            return live
        try:
            stored = await self.storage.counters_between(tenant, feature, period, period)
        except StorageError as exc:
            raise Unavailable(f"storage is unreachable: {exc}") from None
        return stored.get(period, 0)

    async def _days(
        self, tenant: str, feature: str, schedule: Schedule, low: str, high: str, now: float
    ) -> dict[str, int]:
        """A day feature's totals of the dates ``low``..``high``, by date: each date's period
        is the tenant's day of that date in the zone its calendar has at the date's noon
        (UTC); one storage read per zone."""
        names: dict[str, str] = {}  # period name -> date
        for day in days_between(low, high):
            noon = datetime.fromisoformat(day).replace(hour=12, tzinfo=UTC).timestamp()
            c = calendar_at(schedule, noon)
            names[day if c is None or c.zone == "UTC" else f"{day}@{c.zone}"] = day
        by_zone: dict[str, list[str]] = {}
        for period in names:
            by_zone.setdefault(period[10:], []).append(period)
        out: dict[str, int] = {}
        for group in by_zone.values():
            try:
                stored = await self.storage.counters_between(tenant, feature, group[0], group[-1])
            except StorageError as exc:
                raise Unavailable(f"storage is unreachable: {exc}") from None
            for period in group:
                live = await self._live(tenant, feature, period, now)
                out[names[period]] = live if live is not None else stored.get(period, 0)
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
        holds; a day gauge's months are their days combined as the gauge is (``max``: the
        largest, ``latest``: the last day observed). A period never observed reads 0."""
        daily = self.keys.kind_of(feature) == "day"
        if daily:
            months = months_between(first[:7], last[:7]) if granularity == "month" else []
            low, high = (months[0] + "-01", last_day(months[-1])) if months else (first, last)
        else:
            low, high = first, last
        try:
            stored = await self.storage.counters_between(tenant, feature + GAUGE_MARK, low, high)
        except StorageError as exc:
            raise Unavailable(f"storage is unreachable: {exc}") from None
        periods = days_between(low, high) if daily else months_between(low, high)
        current = period_start("day" if daily else "month", now)
        table = self.gauging.table
        for period in periods:
            key = (tenant, feature, period)
            if period == current or (key, gauge) in table.unseeded_in(tenant, period):
                await self.gauging.load([(key, gauge)])  # (held unread: the log's readings)
            reading = table.reading(key)
            if reading is not None:  # (this node's view: storage's merged with its own)
                stored[period] = reading[0]
        if not (daily and granularity == "month"):
            return [[b, stored.get(b, 0)] for b in periods]
        by_month: dict[str, int] = {}
        for day in periods:  # (in order: a later day's value replaces for latest)
            if day in stored:
                value, month = stored[day], day[:7]
                held = by_month.get(month)
                by_month[month] = value if held is None or gauge == "latest" else max(held, value)
        return [[m, by_month.get(m, 0)] for m in months]

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
