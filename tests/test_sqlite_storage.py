"""SQLite-specific behaviour: persistence, WAL, the on-disk layout, error mapping, concurrency.

The behaviour every backend shares is in ``test_storage_contract.py``.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import storage.sqlite as sqlite_mod
from storage.base import (
    Applied,
    Delta,
    Key,
    Snapshot,
    StorageError,
    StoragePermanentError,
    StorageUnavailable,
)
from storage.sqlite import SQLiteStorage

K: Key = ("acme", "api_calls", "2026-11")


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "meter.db"


@pytest.fixture
async def store(db_path: Path) -> AsyncIterator[SQLiteStorage]:
    s = SQLiteStorage(db_path, retention_days=30)
    await s.open()
    try:
        yield s
    finally:
        await s.close()


def _raw(path: Path) -> sqlite3.Connection:
    """A second, plain connection to the same file, as an operator's shell would have."""
    return sqlite3.connect(str(path), isolation_level=None)


# -- persistence and layout ---------------------------------------------------------------------


async def test_reopen_same_object_and_new_object(db_path: Path) -> None:
    s = SQLiteStorage(db_path)
    await s.open()
    await s.apply("n1", [Delta(K, 1, 2**70)])
    await s.close()
    await s.open()  # the same object can be opened again
    try:
        assert (await s.load([K]))[K] == Snapshot(2**70, {"n1": 1})
    finally:
        await s.close()
    t = SQLiteStorage(str(db_path))  # str paths work too
    await t.open()
    try:
        assert (await t.list_period("acme", "2026-11")) == {"api_calls": Snapshot(2**70, {"n1": 1})}
    finally:
        await t.close()


async def test_open_creates_parent_directories(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "c" / "meter.db"
    s = SQLiteStorage(path)
    await s.open()
    await s.close()
    assert path.is_file()


async def test_wal_mode_is_on(store: SQLiteStorage, db_path: Path) -> None:
    await store.apply("n1", [Delta(K, 1, 1)])
    conn = _raw(db_path)
    try:
        # WAL is a property of the file, so a fresh connection sees it too.
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()
    assert db_path.with_name(db_path.name + "-wal").exists()


async def test_stored_layout(store: SQLiteStorage, db_path: Path) -> None:
    # Periods that end after today: a write to a period already over expires from now (the
    # test would depend on the day it runs).
    month: Key = ("acme", "api_calls", "2099-11")
    day: Key = ("acme", "api_calls", "2099-12-31")
    await store.apply("n1", [Delta(month, 3, 10**30), Delta(day, 1, 5)])
    await store.apply("n2", [Delta(month, 1, 1)])
    conn = _raw(db_path)
    try:
        rows = conn.execute(
            "SELECT tenant, period, feature, typeof(total), total, seqs, expires_at"
            " FROM counters ORDER BY period"
        ).fetchall()
        pk = [r[5] for r in conn.execute("PRAGMA table_info(counters)") if r[5]]
    finally:
        conn.close()
    month_end = datetime(2099, 12, 1, tzinfo=UTC).timestamp() + 30 * 86400
    day_end = datetime(2100, 1, 1, tzinfo=UTC).timestamp() + 30 * 86400
    assert rows == [
        (
            "acme",
            "2099-11",
            "api_calls",
            "text",
            str(10**30 + 1),
            '{"n1":3,"n2":1}',
            int(month_end),
        ),
        ("acme", "2099-12-31", "api_calls", "text", "5", '{"n1":1}', int(day_end)),
    ]
    assert pk == [1, 2, 3]  # PRIMARY KEY (tenant, period, feature), in that order


async def test_december_period_expires_next_year(db_path: Path) -> None:
    s = SQLiteStorage(db_path, retention_days=0)
    await s.open()
    try:
        await s.apply("n1", [Delta(("t", "f", "2026-12"), 1, 1)])
    finally:
        await s.close()
    conn = _raw(db_path)
    try:
        (expires,) = conn.execute("SELECT expires_at FROM counters").fetchone()
    finally:
        conn.close()
    assert expires == int(datetime(2027, 1, 1, tzinfo=UTC).timestamp())


async def test_init_schema_reports_nothing_to_do(store: SQLiteStorage) -> None:
    report = await store.init_schema()
    assert report.startswith("sqlite:") and "automatic" in report and "\n" not in report


# -- error mapping ------------------------------------------------------------------------------


async def test_open_a_directory_is_unavailable_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "is_a_dir"
    path.mkdir()
    s = SQLiteStorage(path)
    with pytest.raises(StorageUnavailable, match=re.escape(str(path))):
        await s.open()
    # A failed open leaves the object closed.
    with pytest.raises(StorageUnavailable, match="not open"):
        await s.load([K])


async def test_open_a_corrupt_file_is_unavailable_naming_the_path(db_path: Path) -> None:
    db_path.write_bytes(b"this is not a sqlite database, just some bytes\n" * 200)
    s = SQLiteStorage(db_path)
    with pytest.raises(StorageUnavailable, match=re.escape(str(db_path))):
        await s.open()


async def test_open_under_a_file_is_unavailable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    s = SQLiteStorage(blocker / "meter.db")
    with pytest.raises(StorageUnavailable, match=re.escape(str(blocker))):
        await s.open()


async def test_newer_schema_version_is_refused(db_path: Path) -> None:
    conn = _raw(db_path)
    conn.execute(f"PRAGMA user_version={sqlite_mod.SCHEMA_VERSION + 1}")
    conn.close()
    s = SQLiteStorage(db_path)
    with pytest.raises(StorageUnavailable, match="schema version"):
        await s.open()


async def test_calls_before_open_and_after_close_are_unavailable(db_path: Path) -> None:
    s = SQLiteStorage(db_path)
    with pytest.raises(StorageUnavailable):
        await s.apply("n1", [Delta(K, 1, 1)])
    await s.open()
    await s.close()
    await s.close()  # idempotent
    with pytest.raises(StorageUnavailable):
        await s.list_period("acme", "2026-11")


async def test_locked_database_is_unavailable_and_nothing_lands(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_mod, "BUSY_TIMEOUT_S", 0.05)
    s = SQLiteStorage(db_path)
    await s.open()
    try:
        await s.apply("n1", [Delta(K, 1, 1)])
        other = _raw(db_path)
        other.execute("BEGIN IMMEDIATE")  # another writer holds the write lock
        try:
            with pytest.raises(StorageUnavailable, match=r"locked|busy"):
                await s.apply("n1", [Delta(K, 2, 10)])
        finally:
            other.execute("ROLLBACK")
            other.close()
        # The caller retries the same delta once the lock is gone; it lands once.
        out = await s.apply("n1", [Delta(K, 2, 10)])
        assert out[K] == Applied(Snapshot(11, {"n1": 2}))
    finally:
        await s.close()


async def _full(path: Path) -> SQLiteStorage:
    """A store with one row whose file may not grow any more: SQLite's own limit
    (``max_page_count``, set on the store's connection) makes it answer "database or disk is
    full" when a write needs a new page, as on a full disk. Updating a row in place and the
    first inserts still fit in the pages the file has."""
    store = SQLiteStorage(path)
    await store.open()
    await store.apply("n1", [Delta(FIRST, 1, 1)])

    def limit() -> int:
        conn = store._connection()
        pages = int(conn.execute("PRAGMA page_count").fetchone()[0])
        return int(conn.execute(f"PRAGMA max_page_count = {pages}").fetchone()[0]) - pages

    assert await store._run(limit) == 0
    return store


FIRST: Key = ("acme", "first", "2026-11")
# A batch of many keys: the first updates FIRST in place, the next insert new rows.
BATCH = [Delta(FIRST, 2, 10)] + [
    Delta(("acme", f"f{i:04d}", "2026-11"), 1, i + 1) for i in range(400)
]


async def test_a_batch_that_fails_part_way_lands_nothing_and_its_retry_lands_once(
    tmp_path: Path,
) -> None:
    # Under that limit the batch's first keys are written: a short batch lands.
    probe = await _full(tmp_path / "probe.db")
    try:
        out = await probe.apply("n1", BATCH[:6])
        assert all(isinstance(r, Applied) and not r.duplicate for r in out.values()), out
    finally:
        await probe.close()
    # The whole batch fails part-way, once it needs a page: nothing of it lands, not even the
    # keys written before the failure.
    path = tmp_path / "meter.db"
    store = await _full(path)
    try:
        with pytest.raises(StorageUnavailable, match="full"):
            await store.apply("n1", BATCH)
        other = _raw(path)
        try:
            assert other.execute("SELECT feature, total, seqs FROM counters").fetchall() == [
                ("first", "1", '{"n1":1}')
            ]
        finally:
            other.close()
        assert (await store.load([FIRST]))[FIRST] == Snapshot(1, {"n1": 1})
        # Space again: the same batch, retried, lands once.
        await store._run(
            lambda: store._connection().execute("PRAGMA max_page_count = 1073741823").fetchone()
        )
        out = await store.apply("n1", BATCH)
        assert out[FIRST] == Applied(Snapshot(11, {"n1": 2}))
        for i, d in enumerate(BATCH[1:]):
            assert out[d.key] == Applied(Snapshot(i + 1, {"n1": 1}))
        again = await store.apply("n1", BATCH)
        assert all(isinstance(r, Applied) and r.duplicate for r in again.values())
        listed = await store.list_period("acme", "2026-11")
        assert len(listed) == 401
        assert sum(snap.total for snap in listed.values()) == 11 + sum(range(1, 401))
    finally:
        await store.close()


async def test_bad_delta_fails_alone(store: SQLiteStorage) -> None:
    good: Key = ("acme", "ok", "2026-11")
    bad_period: Key = ("acme", "bad", "2026-13")
    not_a_period: Key = ("acme", "bad2", "november")
    out = await store.apply(
        "n1",
        [Delta(good, 1, 1), Delta(bad_period, 1, 1), Delta(not_a_period, 1, 1)],
    )
    assert out[good] == Applied(Snapshot(1, {"n1": 1}))
    assert isinstance(out[bad_period], StoragePermanentError)
    assert "2026-13" in str(out[bad_period])
    assert isinstance(out[not_a_period], StoragePermanentError)
    assert await store.list_period("acme", "2026-13") == {}


async def test_bad_seq_is_permanent(store: SQLiteStorage) -> None:
    out = await store.apply("n1", [Delta(K, 0, 1)])
    assert isinstance(out[K], StoragePermanentError)
    with pytest.raises(StoragePermanentError):
        await store.apply("", [Delta(K, 1, 1)])


async def test_corrupt_row_fails_that_key_only(store: SQLiteStorage, db_path: Path) -> None:
    other: Key = ("acme", "fine", "2026-11")
    await store.apply("n1", [Delta(K, 1, 1)])
    conn = _raw(db_path)
    conn.execute("UPDATE counters SET seqs = 'not json' WHERE feature = 'api_calls'")
    conn.close()
    out = await store.apply("n1", [Delta(K, 2, 1), Delta(other, 1, 7)])
    assert isinstance(out[K], StoragePermanentError)
    assert out[other] == Applied(Snapshot(7, {"n1": 1}))
    with pytest.raises(StoragePermanentError):
        await store.load([K])


def test_exception_mapping() -> None:
    assert isinstance(
        sqlite_mod._map(sqlite3.OperationalError("database is locked"), "x"), StorageUnavailable
    )
    assert isinstance(
        sqlite_mod._map(sqlite3.DatabaseError("disk I/O error"), "x"), StorageUnavailable
    )
    for exc in (
        sqlite3.IntegrityError("UNIQUE"),
        sqlite3.ProgrammingError("bad"),
        sqlite3.DataError("x"),
    ):
        mapped = sqlite_mod._map(exc, "doing it")
        assert isinstance(mapped, StoragePermanentError)
        assert not mapped.retryable and "doing it" in str(mapped)


# -- concurrency --------------------------------------------------------------------------------


async def test_many_concurrent_applies(store: SQLiteStorage) -> None:
    nodes = [f"n{i}" for i in range(5)]
    keys: list[Key] = [("acme", f"f{i}", "2026-11") for i in range(4)]

    async def node_writes(node: str) -> None:
        # Each node flushes its keys with increasing sequences, like a flusher would.
        for seq in range(1, 21):
            await store.apply(node, [Delta(k, seq, seq) for k in keys])

    await asyncio.gather(*(node_writes(n) for n in nodes))
    per_node = sum(range(1, 21))
    snaps = await store.load(keys)
    for k in keys:
        assert snaps[k] == Snapshot(per_node * len(nodes), dict.fromkeys(nodes, 20))


async def test_concurrent_retries_of_one_delta_count_once(store: SQLiteStorage) -> None:
    results = await asyncio.gather(*(store.apply("n1", [Delta(K, 1, 5)]) for _ in range(50)))
    outcomes = [r[K] for r in results]
    assert all(isinstance(o, Applied) for o in outcomes)
    assert sum(1 for o in outcomes if isinstance(o, Applied) and not o.duplicate) == 1
    assert (await store.load([K]))[K].total == 5


async def test_two_instances_on_one_file(db_path: Path) -> None:
    # Two nodes on one host sharing the file: WAL plus the busy timeout serialize them.
    a, b = SQLiteStorage(db_path), SQLiteStorage(db_path)
    await a.open()
    await b.open()
    try:

        async def writes(s: SQLiteStorage, node: str) -> None:
            for seq in range(1, 31):
                await s.apply(node, [Delta(K, seq, 1)])

        await asyncio.gather(writes(a, "na"), writes(b, "nb"))
        assert (await a.load([K]))[K] == Snapshot(60, {"na": 30, "nb": 30})
    finally:
        await a.close()
        await b.close()


async def test_close_waits_for_queued_calls(db_path: Path) -> None:
    s = SQLiteStorage(db_path)
    await s.open()
    tasks = [asyncio.create_task(s.apply("n1", [Delta(K, i, 1)])) for i in range(1, 21)]
    await asyncio.sleep(0)  # let every task queue its call
    await s.close()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, dict) for r in results), results
    t = SQLiteStorage(db_path)
    await t.open()
    try:
        assert (await t.load([K]))[K] == Snapshot(20, {"n1": 20})
    finally:
        await t.close()


async def test_a_read_that_fails_with_its_transaction_open_does_not_break_the_next_reads(
    store: SQLiteStorage,
) -> None:
    """A seeding read that fails part-way is rolled back, not committed; and a read whose
    end of transaction failed too (its connection left inside the read transaction) does not
    make every later read fail with "cannot start a transaction within a transaction"."""
    key = ("acme", "api", "2026-11")
    await store.apply("n1", [Delta(key, 1, 5)])
    assert store._reader is not None
    reader = store._reader
    calls = 0
    armed = True

    def progress() -> int:
        # SQLite calls this every VM step: let BEGIN (3 steps) through, then interrupt every
        # statement (the read, and what ends its transaction) until disarmed.
        nonlocal calls
        calls += 1
        return 1 if armed and calls > 3 else 0

    loop = asyncio.get_running_loop()
    conn = store._read_connection
    await loop.run_in_executor(reader, lambda: conn().set_progress_handler(progress, 1))
    try:
        with pytest.raises(StorageError, match="interrupted"):
            await store.load([key])
        assert await loop.run_in_executor(reader, lambda: conn().in_transaction)
        armed = False
        assert (await store.load([key]))[key] == Snapshot(5, {"n1": 1})
        assert not await loop.run_in_executor(reader, lambda: conn().in_transaction)
    finally:
        await loop.run_in_executor(reader, lambda: conn().set_progress_handler(None, 1))


# -- the batched write --------------------------------------------------------------------------

# Periods that end after today, so both runs compute the same expiry (a period already over
# expires from the second of its write).
_keys = st.sampled_from([("t", f, p) for f in ("a", "b", "c") for p in ("2099-11", "2099-11-30")])
_batch = st.lists(
    st.builds(
        Delta,
        _keys,
        st.integers(min_value=1, max_value=4),
        st.integers(min_value=-(2**70), max_value=2**70),
    ),
    max_size=6,
)


def _outcome(v: object) -> object:
    return ("error", type(v).__name__, str(v)) if isinstance(v, StorageError) else v


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["n1", "n2"]), _batch), max_size=6), st.booleans())
def test_the_batched_write_equals_the_one_key_at_a_time_write(
    tmp_path_factory: pytest.TempPathFactory, batches: list[Any], corrupt: bool
) -> None:
    """``_apply_many`` (a few reads and one executemany) answers and stores exactly what the
    per-key path does, for any batches: duplicates within the store, keys named twice in one
    batch (which fall back to the per-key path), totals past 64 bits, and a corrupt row."""
    base = tmp_path_factory.mktemp("batched")

    async def run(batched: bool) -> tuple[list[object], list[tuple[object, ...]]]:
        store = SQLiteStorage(base / f"{batched}.db", retention_days=30)
        if not batched:
            store._apply_many = lambda *a: None  # type: ignore[method-assign]
        await store.open()
        answers: list[object] = []
        try:
            for i, (node, deltas) in enumerate(batches):
                if corrupt and i == 1:
                    conn = _raw(base / f"{batched}.db")
                    conn.execute("UPDATE counters SET seqs = 'not json' WHERE feature = 'a'")
                    conn.close()
                out = await store.apply(node, deltas)
                answers.append(sorted((k, repr(_outcome(v))) for k, v in out.items()))
        finally:
            await store.close()
        conn = _raw(base / f"{batched}.db")
        rows = conn.execute("SELECT * FROM counters ORDER BY tenant, period, feature").fetchall()
        conn.close()
        return answers, rows

    assert asyncio.run(run(True)) == asyncio.run(run(False))


async def test_a_batch_naming_a_key_twice_is_written_one_key_at_a_time(
    store: SQLiteStorage,
) -> None:
    out = await store.apply("n1", [Delta(K, 1, 5), Delta(K, 2, 3)])
    assert out[K] == Applied(Snapshot(8, {"n1": 2}))  # the later delta's answer, both written
    assert (await store.load([K]))[K] == Snapshot(8, {"n1": 2})
