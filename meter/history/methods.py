"""The ``history`` method (docs/history.md): stored day or month buckets of a range, with
what ``usage`` knows that storage does not have yet added to the current period's bucket."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Any, cast

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
)
from storage.base import GAUGE_MARK, DayBuckets, StorageError


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
        if period in (period_start("day", now), period_start("month", now)):
            return await self._usage(tenant, feature, now)
        if not self.table.is_seeded(key):
            return None
        return self.table.value(key)

    async def _usage(self, tenant: str, feature: str, now: float) -> int:
        """What ``usage`` answers for the counter of the current period (``feature``: a
        validated feature, or a dimension counter's name)."""
        keys = self.keys
        key = (tenant, feature, keys.period(period_start(keys.kind_of(feature), now)))
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
