"""Storage faults that must stay local: an undecodable item parks its key only, a failed batch
read leaves no request running, an item that goes back under a warm row is re-seeded, expired
counters are purged by the node's own loop, and a seeding failure never delays writes."""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aioboto3
import pytest

from meter.core.table import CounterTable
from meter.persist.flusher import Flusher
from storage.base import BadItems, Delta, Key, Snapshot, StorageUnavailable
from storage.dynamodb import DynamoDBStorage, _ttl
from storage.memory import MemoryStorage
from storage.sqlite import SQLiteStorage
from tests.support.dynamodb_local import free_port
from tests.support.nodes import BACKFILL, NodeProcess, short_tmpdir, wait_for

A: Key = ("acme", "a", "2026-11")
B: Key = ("acme", "b", "2026-11")
C: Key = ("acme", "c", "2026-11")


@pytest.fixture
def tmp() -> Iterator[Path]:
    d = short_tmpdir("sh-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def test_sqlite_an_undecodable_row_parks_its_key_and_the_others_are_seeded(
    tmp: Path,
) -> None:
    store = SQLiteStorage(tmp / "c.sqlite3")
    await store.open()
    try:
        await store.apply("n0", [Delta(A, 1, 5), Delta(B, 1, 7)])
        with sqlite3.connect(tmp / "c.sqlite3") as conn:
            conn.execute("UPDATE counters SET seqs = 'not json' WHERE feature = 'b'")
        with pytest.raises(BadItems) as info:
            await store.load([A, B, C])
        assert set(info.value.bad) == {B} and info.value.good == {
            A: Snapshot(5, {"n0": 1}),
            C: Snapshot(0, {}),
        }
        table = CounterTable("n1", gossip=False)
        for key in (A, B, C):
            table.incr(key, 1)  # cold: unseeded rows
        flusher = Flusher(table, store)
        await flusher.flush_once()
        assert B in flusher.stats.poisoned and "cannot seed" in flusher.stats.poisoned[B]
        assert table.value(A) == 6 and table.value(C) == 1  # seeded and flushed
        assert (await store.load([A]))[A].total == 6
        assert table.pending(B) == 1  # kept, not lost
        assert flusher._failures_in_row == 0
    finally:
        await store.close()


@pytest.mark.dynamodb
async def test_dynamodb_an_undecodable_item_fails_alone(
    dynamodb_local: str, dynamodb_table: str
) -> None:
    store = DynamoDBStorage(dynamodb_table, endpoint_url=dynamodb_local)
    await store.open()
    try:
        await store.apply("n0", [Delta(A, 1, 5)])
        session = aioboto3.Session(
            aws_access_key_id="x", aws_secret_access_key="x", region_name="us-east-1"
        )
        async with session.client("dynamodb", endpoint_url=dynamodb_local) as raw:
            await raw.put_item(
                TableName=dynamodb_table,
                Item={"pk": {"S": "acme"}, "sk": {"S": "2026-11#b"}, "t": {"S": "x"}},
            )
        with pytest.raises(BadItems) as info:
            await store.load([A, B, C])
        assert set(info.value.bad) == {B}
        assert info.value.good == {A: Snapshot(5, {"n0": 1}), C: Snapshot(0, {})}
    finally:
        await store.close()


async def test_dynamodb_a_failed_batch_read_leaves_no_request_running() -> None:
    store = DynamoDBStorage(
        "t", endpoint_url=f"http://127.0.0.1:{free_port()}", connect_timeout=0.2, read_timeout=0.2
    )
    await store.open()
    try:
        keys: list[Key] = [("acme", f"f{i}", "2026-11") for i in range(350)]  # four requests
        with pytest.raises(StorageUnavailable):
            await store.load(keys)
        left = [
            t for t in asyncio.all_tasks() if not t.done() and "_batch_get" in repr(t.get_coro())
        ]
        assert left == []
    finally:
        await store.close()


async def test_a_stored_item_that_went_back_is_reseeded_not_retried_for_ever() -> None:
    store = MemoryStorage()
    a, b = CounterTable("a", gossip=False), CounterTable("b", gossip=False)
    fa, fb = Flusher(a, store), Flusher(b, store)
    for table, flusher in ((a, fa), (b, fb), (a, fa)):
        table.incr(A, 10)
        await flusher.flush_once()
    a.rebase(A, (await store.load([A]))[A])  # a knows b's sequence
    del store.items[A]  # TTL expiry (or a restored table): the item is gone
    a.incr(A, 3)
    await fa.flush_once()
    await fa.flush_once()
    cols = a.columns(A)
    assert cols is not None and cols["inflight"] == 0 and cols["pending_flush"] == 0
    assert a.value(A) == (await store.load([A]))[A].total == 3
    assert fa.stats.reseeded == 1
    assert not a.dirty_keys()


def test_ttl_and_expiry_start_from_now_for_an_old_period() -> None:
    now = time.time()
    assert _ttl("2020-01", 30) >= now + 30 * 86400 - 1
    store = SQLiteStorage(":memory:", retention_days=30)
    assert store._expires_at("2020-01-05") >= now + 30 * 86400 - 1


async def test_sqlite_purge_deletes_only_expired_counters(tmp: Path) -> None:
    store = SQLiteStorage(tmp / "c.sqlite3", retention_days=1)
    await store.open()
    try:
        await store.apply("n1", [Delta(A, 1, 5), Delta(B, 1, 7)])
        assert await store.purge_expired() == 0
        with sqlite3.connect(tmp / "c.sqlite3") as conn:
            conn.execute("UPDATE counters SET expires_at = 1 WHERE feature = 'a'")
        assert await store.purge_expired() == 1
        assert await store.load([A, B]) == {A: Snapshot(0, {}), B: Snapshot(7, {"n1": 1})}
    finally:
        await store.close()


def test_the_node_purges_expired_counters_on_its_own(tmp: Path) -> None:
    with NodeProcess(tmp, METER_RETENTION_PURGE_INTERVAL_S="0.2", **BACKFILL) as node:
        node.call("track", "acme", "old", 1, {"at": 1577836800})  # 2020-01
        node.call("track", "acme", "new", 1)
        db = node.data_dir / "counters.sqlite3"
        deadline = time.monotonic() + 10
        while True:  # flushed
            with sqlite3.connect(db) as conn:
                n = conn.execute("SELECT count(*) FROM counters").fetchone()[0]
            if n == 2:
                break
            assert time.monotonic() < deadline, "never flushed"
            time.sleep(0.05)
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE counters SET expires_at = 1 WHERE feature = 'old'")
        deadline = time.monotonic() + 10
        while True:
            with sqlite3.connect(db) as conn:
                left = [r[0] for r in conn.execute("SELECT feature FROM counters")]
            if left == ["new"]:
                break
            assert time.monotonic() < deadline, f"not purged: {left}"
            time.sleep(0.05)
        # The node logs the purge once its delete has committed, which the test can see first.
        wait_for(lambda: "retention purge:" in node.log(), 10, "the purge is logged")
        assert "retention purge: deleted 1 expired counters" in node.log()


class _SeedsFail(MemoryStorage):
    async def load(self, keys: Any) -> Any:
        raise StorageUnavailable("reads down")


async def test_a_failed_seeding_read_does_not_back_off_the_writes() -> None:
    store = _SeedsFail()
    table = CounterTable("n1", gossip=False)
    table.seed(A, Snapshot(0, {}))
    table.incr(A, 2)
    table.incr(B, 1)  # cold: its seeding read fails
    flusher = Flusher(table, store, interval=0.5)
    assert await flusher.flush_once() is False
    assert store.items[A].total == 2  # A was written
    assert flusher._failures_in_row == 0 and flusher._next_delay() == 0.5
    assert flusher.stats.last_result == "error" and "reads down" in (flusher.stats.last_error or "")


class _Buggy(MemoryStorage):
    async def load(self, keys: Any) -> Any:
        raise RuntimeError("a bug in a backend")


async def test_a_backend_bug_never_escapes_a_drain() -> None:
    table = CounterTable("n1", gossip=False)
    table.incr(A, 1)  # unseeded: the drain must read it, and the read blows up
    flusher = Flusher(table, _Buggy())
    assert await flusher.drain(0.3) is False


class _Overtaken(MemoryStorage):
    """After a's write lands, b writes too and a re-bases on b's newer snapshot (as an
    announcement that overtakes a's own answer would): a's answer is then older."""

    def __init__(self, a: CounterTable, b: CounterTable) -> None:
        super().__init__()
        self.a, self.b = a, b
        self.armed = False

    async def apply(self, node: str, deltas: Any) -> Any:
        out = await super().apply(node, deltas)
        if self.armed and node == "a":
            self.armed = False
            self.b.incr(A, 4)
            await Flusher(self.b, self).flush_once()
            self.a.rebase(A, self.items[A], "gossip")
        return out


async def test_an_answer_overtaken_by_a_newer_snapshot_is_not_taken_for_storage_going_back() -> (
    None
):
    a, b = CounterTable("a", gossip=False), CounterTable("b", gossip=False)
    store = _Overtaken(a, b)
    fa, fb = Flusher(a, store), Flusher(b, store)
    for table, flusher in ((a, fa), (b, fb), (a, fa)):
        table.incr(A, 10)
        await flusher.flush_once()
    a.rebase(A, store.items[A])
    a.incr(A, 1)
    store.armed = True
    before = a.value(A)
    await fa.flush_once()
    assert fa.stats.reseeded == 0
    value = a.value(A)
    assert value is not None and before is not None and value >= before  # never dips
    assert value == store.items[A].total == 35
    cols = a.columns(A)
    assert cols is not None and cols["inflight"] == 0


@pytest.mark.parametrize(
    ("pool", "concurrency", "expected"),
    [(64, 64, 72), (4, 16, 24), (100, 16, 108), (2, 3, 6)],
)
async def test_dynamodb_reads_keep_connections_writes_cannot_take(
    pool: int, concurrency: int, expected: int
) -> None:
    """The client's pool holds the writes' connections (``concurrency`` may exceed the
    configured pool) plus ``load_concurrency`` more, so seeding reads always find one free.
    (Opening a client connects to nothing: no server is needed.)"""
    store = DynamoDBStorage(
        "counters",
        endpoint_url=f"http://127.0.0.1:{free_port()}",
        max_pool_connections=pool,
        concurrency=concurrency,
    )
    assert store.pool_connections == expected
    assert expected == max(pool, concurrency) + store.load_concurrency
    await store.open()
    try:
        assert store._client.meta.config.max_pool_connections == expected
    finally:
        await store.close()
