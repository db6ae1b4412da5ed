"""History (docs/history.md): day buckets written by the flush, exactly once, and the
``history`` method of a real node."""

from __future__ import annotations

import asyncio
import calendar
import json
import sqlite3
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pytest

from meter.cli.main import main
from meter.client import AsyncClient
from meter.config import CounterConfig, FlushConfig, NodeConfig, ServerConfig
from meter.core.table import CounterTable
from meter.errors import InvalidArgument
from meter.history.days import MAX_DAYS, MAX_MONTHS, flush_day, history_args, parse_range, render
from meter.node.lifecycle import Node
from meter.persist.flusher import Flusher
from meter.quotas.limits import cycle_record
from storage.base import Applied, Delta, Snapshot, StorageError
from storage.dynamodb import DynamoDBStorage
from storage.memory import MemoryStorage
from storage.periods import Cycle
from storage.sqlite import SQLiteStorage
from tests.support.nodes import BACKFILL_GRACE_S

K = ("acme", "api", "2026-11")


def _at(text: str) -> float:
    """Epoch seconds of a UTC ``YYYY-MM-DDTHH:MM:SS``."""
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


# -- the day a flush writes to -------------------------------------------------------------


def test_flush_day_is_the_utc_day_clamped_into_the_month() -> None:
    assert flush_day("2026-11", _at("2026-11-30T23:59:59")) == "2026-11-30"
    assert flush_day("2026-11", _at("2026-11-01T00:00:00")) == "2026-11-01"
    # Counted into November, flushed on December 1 (or much later): November 30.
    assert flush_day("2026-11", _at("2026-12-01T00:00:01")) == "2026-11-30"
    assert flush_day("2024-02", _at("2025-06-01T00:00:00")) == "2024-02-29"
    # A later month's key (counted with ``at``): its first day.
    assert flush_day("2027-01", _at("2026-11-30T12:00:00")) == "2027-01-01"
    # A day key is its own bucket.
    assert flush_day("2026-11-30", _at("2026-11-30T12:00:00")) is None


def _flusher(store: MemoryStorage, now: str) -> tuple[CounterTable, Flusher]:
    table = CounterTable("n1")
    table.seed(K, Snapshot(0, {}))
    table.seed(("acme", "daily", "2026-11-30"), Snapshot(0, {}))
    flusher = Flusher(table, store)
    flusher.clock = lambda: _at(now)
    return table, flusher


async def test_a_flush_writes_the_month_and_the_day_bucket() -> None:
    store = MemoryStorage()
    table, flusher = _flusher(store, "2026-11-30T10:00:00")
    table.incr(K, 3)
    table.incr(("acme", "daily", "2026-11-30"), 4)
    assert await flusher.flush_once()
    assert store.items[K] == Snapshot(3, {"n1": 1})
    assert store.days == {("acme", "api", "2026-11-30"): Snapshot(3, {"n1": 1})}
    assert store.writes == 3, "a month key costs two writes, a day key one"


async def test_units_counted_before_midnight_and_flushed_after_stay_in_their_month() -> None:
    store = MemoryStorage()
    table, flusher = _flusher(store, "2026-11-30T23:59:59")
    table.incr(K, 5)
    flusher.clock = lambda: _at("2026-12-01T00:00:00.5")
    assert await flusher.flush_once()
    assert store.days == {("acme", "api", "2026-11-30"): Snapshot(5, {"n1": 1})}


async def test_a_failure_between_the_two_writes_neither_doubles_nor_drops() -> None:
    """The counter's write lands, the day bucket's fails (separate writes on DynamoDB): the
    key stays in flight and its retry - sent on the next day - is a duplicate on the counter
    and lands on the first try's day, once."""
    store = MemoryStorage()
    table, flusher = _flusher(store, "2026-11-29T23:59:59")
    table.incr(K, 5)
    store.day_fail_next = 1
    assert not await flusher.flush_once()
    assert store.items[K].total == 5 and store.days == {}
    assert table.pending(K) == 5, "still in flight"
    flusher.clock = lambda: _at("2026-11-30T00:00:05")
    table.incr(K, 2)  # counted meanwhile: the next sequence, today's bucket
    assert await flusher.flush_once()
    assert store.days == {("acme", "api", "2026-11-29"): Snapshot(5, {"n1": 1})}
    assert await flusher.flush_once()
    assert store.items[K] == Snapshot(7, {"n1": 2})
    assert store.days[("acme", "api", "2026-11-30")] == Snapshot(2, {"n1": 2})
    assert sum(s.total for s in store.days.values()) == store.items[K].total


async def test_a_delta_stored_without_our_answer_still_reaches_its_day() -> None:
    """The counter's write lands, the bucket's fails, and before the retry a peer's snapshot
    (or a read) holding the delta ends it in flight: the flusher writes the bucket alone,
    once, on the first try's day."""
    store = MemoryStorage()
    table, flusher = _flusher(store, "2026-11-29T23:59:59")
    table.incr(K, 5)
    store.day_fail_next = 1
    assert not await flusher.flush_once()
    assert table.rebase(K, store.items[K], "gossip")  # a peer's announcement of the item
    assert table.pending(K) == 0, "no longer in flight"
    flusher.clock = lambda: _at("2026-11-30T00:00:05")
    store.fail_next = 1  # the repair's first try fails too
    assert not await flusher.flush_once()
    assert await flusher.flush_once()
    assert store.days == {("acme", "api", "2026-11-29"): Snapshot(5, {"n1": 1})}
    assert store.items[K] == Snapshot(5, {"n1": 1})
    assert await flusher.flush_once()  # nothing more to write
    assert store.days == {("acme", "api", "2026-11-29"): Snapshot(5, {"n1": 1})}


async def test_a_drain_waits_for_day_bucket_repairs() -> None:
    store = MemoryStorage()
    table, flusher = _flusher(store, "2026-11-29T12:00:00")
    table.incr(K, 5)
    store.day_fail_next = 1
    assert not await flusher.flush_once()
    assert table.rebase(K, store.items[K], "gossip")
    store.fail_next = 1
    assert await flusher.drain(10)
    assert store.days == {("acme", "api", "2026-11-29"): Snapshot(5, {"n1": 1})}


async def test_a_lost_answer_after_both_writes_counts_the_day_once() -> None:
    store = MemoryStorage()
    table, flusher = _flusher(store, "2026-11-29T23:59:59")
    table.incr(K, 5)
    store.lose_next_ack = 1
    assert not await flusher.flush_once()
    flusher.clock = lambda: _at("2026-11-30T00:00:05")
    assert await flusher.flush_once()
    assert store.items[K] == Snapshot(5, {"n1": 1})
    assert store.days == {("acme", "api", "2026-11-29"): Snapshot(5, {"n1": 1})}
    assert flusher.stats.duplicates == 1


async def test_sqlite_writes_the_counter_and_its_bucket_in_one_transaction(
    tmp_path: Path,
) -> None:
    store = SQLiteStorage(tmp_path / "m.db", retention_days=1)
    await store.open()
    try:
        table = CounterTable("n1")
        table.seed(K, Snapshot(0, {}))
        flusher = Flusher(table, store)
        flusher.clock = lambda: _at("2026-11-30T10:00:00")
        table.incr(K, 3)
        assert await flusher.flush_once()
        assert await store.day_buckets("acme", "api", "2026-11-01", "2026-11-30") == {
            "2026-11-30": 3
        }
        # Purged with the retention, like the counter.
        assert await store.purge_expired(time.time() + 3 * 86400) == 1
        assert await store.day_buckets("acme", "api", "2026-11-01", "2026-11-30") == {}
        assert (await store.load([K]))[K].total == 0
    finally:
        await store.close()


# -- the range of a call -------------------------------------------------------------------


NOW = _at("2026-11-30T12:00:00")


def test_defaults_are_the_last_30_days_and_12_months() -> None:
    assert parse_range(None, NOW) == ("day", "2026-11-01", "2026-11-30")
    assert parse_range({"granularity": "month"}, NOW) == ("month", "2025-12", "2026-11")
    assert parse_range({"to": "2026-03-01"}, NOW) == ("day", "2026-01-31", "2026-03-01")
    assert parse_range({"from": "2026-11-29"}, NOW) == ("day", "2026-11-29", "2026-11-30")
    assert parse_range({"to": "0001-01", "granularity": "month"}, NOW)[1] == "0001-01"


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        ("x", "opts must be a map"),
        ({"since": "2026-11-01"}, "unknown option 'since'"),
        ({"granularity": "week"}, "granularity must be"),
        ({"from": "2026-11"}, "from must be a UTC day YYYY-MM-DD"),
        ({"to": 20261130}, "to must be a UTC day"),
        ({"from": "2026-02-30"}, "from '2026-02-30' is not a real day"),
        ({"from": "2026-11- 3"}, "from must be a UTC day"),
        ({"to": "2026-\u0661\u0661-03"}, "to must be a UTC day"),
        ({"from": "0000-01-01"}, "not a real day"),
        ({"from": "2026-11", "granularity": "month", "to": "2026-13"}, "to '2026-13'"),
        ({"from": "2026-11-30", "to": "2026-11-01"}, "from 2026-11-30 is after to 2026-11-01"),
        ({"from": "2025-01-01"}, f"is 699 days; at most {MAX_DAYS}"),
        ({"from": "2010-01", "granularity": "month"}, f"at most {MAX_MONTHS}"),
        ({"from": "2026-11-01", "granularity": "month"}, "from must be a UTC month YYYY-MM"),
    ],
)
def test_bad_ranges_are_refused(opts: object, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        parse_range(opts, NOW)


def test_the_caps_are_inclusive() -> None:
    first = (date(2026, 11, 30) - timedelta(days=MAX_DAYS - 1)).isoformat()
    assert parse_range({"from": first}, NOW)[1:] == (first, "2026-11-30")


# -- a real node (SQLite) ------------------------------------------------------------------


@pytest.fixture
def tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:  # short path: Unix socket paths are limited
        yield Path(d)


def _config(tmp: Path) -> NodeConfig:
    return NodeConfig(
        data_dir=tmp / "data",
        node_id="n1",
        server=ServerConfig(socket=tmp / "m.sock"),
        flush=FlushConfig(interval_ms=3_600_000),  # rounds are driven by the test
        counters=CounterConfig(feature_periods={"daily": "day"}, period_grace_s=BACKFILL_GRACE_S),
    )


def _previous_month(now: float) -> tuple[str, float]:
    """The month before ``now``'s and an instant in it."""
    today = datetime.fromtimestamp(now, tz=UTC).date()
    last = today.replace(day=1) - timedelta(days=1)
    return f"{last.year:04d}-{last.month:02d}", _at(f"{last.isoformat()}T12:00:00")


async def test_history_of_a_real_node_agrees_with_usage(tmp: Path) -> None:
    cfg = _config(tmp)
    async with Node(cfg) as node:
        assert node.flusher is not None
        client = await AsyncClient.connect(cfg.server.socket)
        try:
            now = time.time()
            today = datetime.fromtimestamp(now, tz=UTC).date().isoformat()
            month = today[:7]
            prev, in_prev = _previous_month(now)
            await client.track("acme", "api", 4)
            # Nothing stored yet: the units are pending, and show in today's bucket.
            days = await client.history("acme", "api")
            assert len(days) == 30 and days[-1] == (today, 4)
            assert sum(v for _, v in days) == 4
            assert await client.history("acme", "api", granularity="month") == [
                *((m, 0) for m in _months_before(month, 11)),
                (month, 4),
            ]
            assert await node.flusher.flush_once()
            await client.track("acme", "api", 3)  # pending after a flush
            await client.track("acme", "api", 10, at=in_prev)  # last month's counter
            days = await client.history("acme", "api", first=f"{prev}-01", last=today)
            assert days[-1] == (today, 7) == (today, await client.usage("acme", "api"))
            assert sum(v for _, v in days) == 17
            assert await node.flusher.flush_once()
            # Flushed in this month: last month's units go to its last day.
            days = await client.history("acme", "api", first=f"{prev}-01", last=today)
            assert dict(days)[f"{prev}-{_days_in(prev):02d}"] == 10
            assert days[-1] == (today, 7)
            months = await client.history(
                "acme", "api", first=prev, last=month, granularity="month"
            )
            assert months == [(prev, 10), (month, 7)]
            # A feature with a day period: its day counters are the buckets.
            await client.track("acme", "daily", 2)
            await client.track("acme", "daily", 5, at=in_prev)
            assert node.flusher is not None and await node.flusher.flush_once()
            await client.track("acme", "daily", 1)
            days = await client.history("acme", "daily", first=f"{prev}-01", last=today)
            assert days[-1] == (today, 3) == (today, await client.usage("acme", "daily"))
            assert sum(v for _, v in days) == 8
            months = await client.history(
                "acme", "daily", first=prev, last=month, granularity="month"
            )
            assert months == [(prev, 5), (month, 3)]
            # A range in the past is read from storage only; future days are zeros.
            assert await client.history("acme", "api", first=f"{prev}-01", last=f"{prev}-02") == [
                (f"{prev}-01", 0),
                (f"{prev}-02", 0),
            ]
        finally:
            await client.close()


async def test_history_survives_a_restart(tmp: Path) -> None:
    """Day buckets are stored: a new process reads them back."""
    cfg = _config(tmp)
    today = datetime.now(tz=UTC).date().isoformat()
    async with Node(cfg) as node:
        client = await AsyncClient.connect(cfg.server.socket)
        await client.track("acme", "api", 6)
        await client.close()
        assert node.flusher is not None and await node.flusher.flush_once()
    async with Node(cfg):
        client = await AsyncClient.connect(cfg.server.socket)
        try:
            days = await client.history("acme", "api", first=today, last=today)
            # (A restart just after midnight UTC would date the units yesterday.)
            assert days == [(today, 6)] or today != datetime.now(tz=UTC).date().isoformat()
        finally:
            await client.close()


async def test_bad_calls_are_invalid_arguments(tmp: Path) -> None:
    cfg = _config(tmp)
    async with Node(cfg):
        client = await AsyncClient.connect(cfg.server.socket)
        try:
            with pytest.raises(InvalidArgument, match="tenant"):
                await client.history("", "api")
            with pytest.raises(InvalidArgument, match="feature"):
                await client.history("acme", "a b")
            with pytest.raises(InvalidArgument, match="granularity"):
                await client.history("acme", "api", granularity="year")
            with pytest.raises(InvalidArgument, match="from"):
                await client.history("acme", "api", first="yesterday")
            with pytest.raises(InvalidArgument, match="at most 400"):
                await client.history("acme", "api", first="2000-01-01", last="2026-01-01")
            # The calendar's ends are ranges like any other.
            assert len(await client.history("acme", "api", last="9999-12-31")) == 30
            assert len(await client.history("acme", "api", last="0001-01-05")) == 5
            months = await client.history("acme", "api", last="0001-03", granularity="month")
            assert months == [("0001-01", 0), ("0001-02", 0), ("0001-03", 0)]
            months = await client.history("acme", "api", last="9999-12", granularity="month")
            assert len(months) == 12
        finally:
            await client.close()


def _months_before(month: str, n: int) -> list[str]:
    index = int(month[:4]) * 12 + int(month[5:7]) - 1
    return [f"{i // 12:04d}-{i % 12 + 1:02d}" for i in range(index - n, index)]


def _days_in(month: str) -> int:
    return calendar.monthrange(int(month[:4]), int(month[5:7]))[1]


# -- the CLI -------------------------------------------------------------------------------


def test_render_draws_bars_in_eighths() -> None:
    text = render([("2026-11-28", 0), ("2026-11-29", 1), ("2026-11-30", 80), ("x" * 10, -3)])
    lines = text.split("\n")
    assert lines[0] == "2026-11-28   0"
    assert lines[1] == "2026-11-29   1  ▌"  # 1/80 of 40 columns: 4 eighths
    assert lines[2] == "2026-11-30  80  " + "█" * 40
    assert lines[3] == "xxxxxxxxxx  -3"
    assert lines[4] == "total       78"
    assert render([]) == "(no buckets)"


def test_history_args() -> None:
    assert history_args(None, None, NOW) == ("2026-11-01", "day")
    assert history_args(1, None, NOW) == ("2026-11-30", "day")
    assert history_args(None, 12, NOW) == ("2025-12", "month")
    for days, months in [(0, None), (None, 0), (-1, None)]:
        with pytest.raises(InvalidArgument, match="must be at least 1"):
            history_args(days, months, NOW)


async def test_the_cli_prints_a_chart_of_a_real_node(
    tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _config(tmp)
    sock = str(cfg.server.socket)

    async def meter(*args: str) -> int:
        return await asyncio.to_thread(main, ["history", "--socket", sock, *args])

    today = datetime.now(tz=UTC).date().isoformat()
    async with Node(cfg):
        client = await AsyncClient.connect(cfg.server.socket)
        await client.track("acme", "api", 9)
        await client.close()
        assert await meter("acme", "api", "--days", "3") == 0
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 4 and lines[2] == f"{today}  9  " + "█" * 40
        assert lines[3] == "total       9"
        assert await meter("acme", "api", "--months", "2", "--json") == 0
        answer = json.loads(capsys.readouterr().out)
        assert answer["granularity"] == "month" and answer["history"][-1] == [today[:7], 9]
        assert len(answer["history"]) == 2
        assert await meter("acme", "api", "--days", "0") == 1
        assert "--days must be at least 1" in capsys.readouterr().err
        assert await meter("acme", "api", "--days", "401") == 1
        assert "at most 400" in capsys.readouterr().err
        with pytest.raises(SystemExit):  # argparse: one or the other
            await meter("acme", "api", "--days", "3", "--months", "2")


# -- DynamoDB Local: the cost, and a failure between the two writes -------------------------


@pytest.mark.dynamodb
async def test_dynamodb_cost_per_flushed_key(dynamodb_storage: DynamoDBStorage) -> None:
    """A month key's flush writes two items (the counter, its day bucket: in one
    transaction, the default), a day key's one; reading a range of days is one Query."""
    store = dynamodb_storage
    table = CounterTable("n1")
    months = [("acme", f"f{i}", "2026-11") for i in range(50)]
    days = [("acme", f"d{i}", "2026-11-30") for i in range(50)]
    for key in months + days:
        table.seed(key, Snapshot(0, {}))
    flusher = Flusher(table, store)
    flusher.clock = lambda: _at("2026-11-30T10:00:00")
    for key in months:
        table.incr(key, 2)
    before = store.write_stats().items
    assert await flusher.flush_once()
    assert store.write_stats().items - before == 2 * len(months)
    for key in days:
        table.incr(key, 2)
    before = store.write_stats().items
    assert await flusher.flush_once()
    assert store.write_stats().items - before == len(days)
    assert store.calls["update_item"] == 0  # every item in transactions
    before = store.calls["query"]
    assert await store.day_buckets("acme", "f7", "2025-11-01", "2026-11-30") == {"2026-11-30": 2}
    assert store.calls["query"] - before == 1
    # Item sizes as DynamoDB bills them: a bucket is as small as its counter (one write unit).
    sizes = []
    for sk in ("2026-11#f7", "#d#f7#2026-11-30"):
        resp = await store._client.get_item(
            TableName=store.table, Key={"pk": {"S": "acme"}, "sk": {"S": sk}}
        )
        sizes.append(_item_bytes(resp["Item"]))
    print(f"\nitem bytes: counter {sizes[0]}, day bucket {sizes[1]}")
    assert sizes[1] - sizes[0] == len("#d#") + len("-30")
    assert max(sizes) < 100


@pytest.mark.dynamodb
async def test_dynamodb_a_failed_day_write_is_completed_by_the_retry(
    dynamodb_storage: DynamoDBStorage,
) -> None:
    """The counter's write lands and the day bucket's is refused (here: a bucket item of the
    wrong type): the key's outcome is the error; the same delta sent again is a duplicate on
    the counter and lands on the bucket once the item is writable."""
    store = dynamodb_storage
    key = ("acme", "api", "2026-11")
    bucket = {"pk": {"S": "acme"}, "sk": {"S": "#d#api#2026-11-29"}}
    client = store._client
    await client.put_item(TableName=store.table, Item={**bucket, "t": {"S": "not a number"}})
    delta = Delta(key, 1, 5, "2026-11-29")
    out = await store.apply("n1", [delta])
    assert isinstance(out[key], StorageError)
    assert (await store.load([key]))[key] == Snapshot(5, {"n1": 1})
    await client.delete_item(TableName=store.table, Key=bucket)
    for _ in range(2):
        out = await store.apply("n1", [delta])
        result = out[key]
        assert isinstance(result, Applied) and result.duplicate
    assert (await store.load([key]))[key] == Snapshot(5, {"n1": 1})
    assert await store.day_buckets("acme", "api", "2026-11-01", "2026-11-30") == {"2026-11-29": 5}


def _item_bytes(item: dict[str, dict[str, str]]) -> int:
    """An item's size by DynamoDB's rules: each attribute's name plus its value (a string's
    UTF-8 bytes; a number's significant digits / 2, rounded up, plus 1)."""
    size = 0
    for name, value in item.items():
        size += len(name.encode())
        if "S" in value:
            size += len(value["S"].encode())
        else:
            digits = value["N"].lstrip("-").lstrip("0") or "0"
            size += (len(digits.rstrip("0") or "0") + 1) // 2 + 1
    return size


async def test_a_cycle_tenants_days_sum_to_usage_with_a_bucket_write_missing(tmp: Path) -> None:
    """A tenant with a billing cycle (docs/periods.md): its current day's row takes what the
    node holds beyond the period's stored buckets, so its days sum to ``usage`` also while a
    bucket's write is missing (a repair still waiting), as a UTC tenant's do."""
    cfg = _config(tmp)
    async with Node(cfg) as node:
        assert node.flusher is not None and node.parts is not None
        tokyo = ((0.0, Cycle(15, "Asia/Tokyo")),)
        await node.parts.limits.change(cycle_record("acme", tokyo))
        client = await AsyncClient.connect(cfg.server.socket)
        try:
            for tenant in ("acme", "utc"):
                await client.track(tenant, "api", 4)
            assert await node.flusher.flush_once()
            with sqlite3.connect(tmp / "data" / "counters.sqlite3") as db:  # (the lost write)
                assert db.execute("DELETE FROM days").rowcount == 2
            for tenant in ("acme", "utc"):
                await client.track(tenant, "api", 3)
                days = await client.history(tenant, "api")
                assert sum(v for _, v in days) == await client.usage(tenant, "api") == 7
            (period,) = [
                p for p, v in await client.history("acme", "api", granularity="month") if v
            ]
            assert period.endswith("@15:Asia/Tokyo")
        finally:
            await client.close()
