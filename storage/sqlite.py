"""The embedded SQLite backend: the default when no DynamoDB table is configured.

One table, ``counters``, keyed ``(tenant, period, feature)`` so that every counter of a tenant
in a period is one primary-key range. Totals are stored as decimal TEXT because they may grow
past SQLite's 64-bit INTEGER; the per-node flush sequences are a JSON object in ``seqs``;
``expires_at`` (epoch seconds) is the later of the period's end and the last write, plus the
retention; :meth:`SQLiteStorage.purge_expired` deletes what is past it (the node runs it hourly).

``sqlite3`` blocks, so every statement runs on one dedicated worker thread that owns the
connection: calls from many asyncio tasks are queued and run one at a time, in order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from storage import periods
from storage.base import (
    DAYS_END,
    EMPTY,
    MARK_CLOSED,
    MARK_DRAINED,
    MARK_OPEN,
    MARK_STATES,
    Applied,
    BadCursor,
    BadItems,
    BudgetItem,
    Delta,
    ExportPage,
    ExportRow,
    GaugeReading,
    Key,
    LedgerRow,
    Owner,
    PeriodMark,
    Snapshot,
    Storage,
    StorageError,
    StoragePermanentError,
    StorageUnavailable,
    VersionMoved,
    check_children,
    check_day_of,
    check_export_limit,
    check_owner_note,
    check_period,
    check_period_mark,
    check_range,
    check_unique,
    check_value_of,
    check_values_key,
    check_values_limit,
    decode_cursor,
    encode_cursor,
    gauge_key,
    lease_end_ms,
    mark_units_from_text,
    mark_units_to_text,
    next_values_cursor,
    reading_wins,
    timeline_position,
    timeline_range,
    values_cursor,
)

T = TypeVar("T")

log = logging.getLogger("meter.storage.sqlite")

#: Bumped when the table layout changes; a file written by a newer layout is refused.
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS counters (
    tenant     TEXT    NOT NULL,
    period     TEXT    NOT NULL,
    feature    TEXT    NOT NULL,
    total      TEXT    NOT NULL,
    seqs       TEXT    NOT NULL,
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (tenant, period, feature)
) WITHOUT ROWID
"""

_UPSERT = (
    "INSERT INTO counters (tenant, period, feature, total, seqs, expires_at)"
    " VALUES (?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (tenant, period, feature) DO UPDATE SET"
    " total = excluded.total, seqs = excluded.seqs, expires_at = excluded.expires_at"
)

#: Keys per seeding query: 4 bound parameters each, under the 999 of SQLite before 3.32.
_LOAD_QUERY_KEYS = 240


@functools.lru_cache(maxsize=8)
def _load_query(n: int) -> str:
    """One query reading ``n`` keys: a join on a ``VALUES`` list of ``(index, tenant, period,
    feature)``, driven by the list (the primary key is probed once per key, where
    ``(a, b, c) IN (VALUES ...)`` scans the table). Rows name their key by its index."""
    values = ",".join(["(?,?,?,?)"] * n)
    return (
        f"WITH w(i, t, p, f) AS (VALUES {values})"
        " SELECT w.i, c.total, c.seqs"
        " FROM w CROSS JOIN counters AS c"
        " ON c.tenant = w.t AND c.period = w.p AND c.feature = w.f"
    )


@functools.lru_cache(maxsize=8)
def _load_days_query(n: int) -> str:
    """:func:`_load_query` on the ``days`` table: ``(index, tenant, day, feature)``."""
    values = ",".join(["(?,?,?,?)"] * n)
    return (
        f"WITH w(i, t, d, f) AS (VALUES {values})"
        " SELECT w.i, b.total, b.seqs"
        " FROM w CROSS JOIN days AS b"
        " ON b.tenant = w.t AND b.feature = w.f AND b.day = w.d"
    )


# For the retention purge (purge_expired), which deletes by expiry.
_EXPIRY_INDEX = "CREATE INDEX IF NOT EXISTS counters_expiry ON counters (expires_at)"
#: For ``children_page``: the counters of tenants below an account, by (period, feature,
#: tenant), so an account's users of one counter are one range. Partial: other tenants'
#: rows are not in it. Additive (files of this layout open in builds that ignore it).
_CHILDREN_WHERE = "instr(tenant, '/') > 0"
_CHILDREN_INDEX = (
    "CREATE INDEX IF NOT EXISTS counters_children ON counters (period, feature, tenant)"
    f" WHERE {_CHILDREN_WHERE}"
)
_CHILDREN_QUERY = (
    "SELECT tenant, total FROM counters"
    f" WHERE {_CHILDREN_WHERE} AND period = ? AND feature = ? AND tenant > ? AND tenant < ?"
    " AND instr(substr(tenant, ?), '/') = 0 ORDER BY tenant LIMIT ?"
)
#: Who owns each node id (ADR 0004): an additive table, so files of this layout still open in
#: builds that do not know it (they ignore it) and the schema version is unchanged.
_OWNERS = """
CREATE TABLE IF NOT EXISTS owners (
    node       TEXT    NOT NULL PRIMARY KEY,
    token      TEXT    NOT NULL,
    expires_ms INTEGER NOT NULL
) WITHOUT ROWID
"""

#: The note each owner's last renewal left (what the node says of its state): an additive table
#: beside ``owners``, written in the renewal's transaction.
_OWNER_NOTES = """
CREATE TABLE IF NOT EXISTS owner_notes (
    node TEXT NOT NULL PRIMARY KEY,
    note TEXT NOT NULL
) WITHOUT ROWID
"""

#: Limits (docs/quotas.md): opaque records and the version every change bumps in the same
#: transaction. Additive tables, like ``owners``: the schema version is unchanged.
_LIMITS = """
CREATE TABLE IF NOT EXISTS limits (
    scope   TEXT NOT NULL,
    name    TEXT NOT NULL,
    feature TEXT NOT NULL,
    body    TEXT NOT NULL,
    PRIMARY KEY (scope, name, feature)
) WITHOUT ROWID
"""
_LIMITS_VERSION = """
CREATE TABLE IF NOT EXISTS limits_version (
    id      INTEGER PRIMARY KEY CHECK (id = 1),
    version INTEGER NOT NULL
)
"""

#: Strict budgets (escrow, ADR 0009): one record per counter, replaced by version. Additive.
_BUDGETS = """
CREATE TABLE IF NOT EXISTS budgets (
    tenant     TEXT    NOT NULL,
    feature    TEXT    NOT NULL,
    period     TEXT    NOT NULL,
    version    INTEGER NOT NULL,
    body       TEXT    NOT NULL,
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (tenant, feature, period)
) WITHOUT ROWID
"""

#: Units admitted straight onto a budget record since its body was written (ADR 0014), one
#: row per admitting process. A swap of the body deletes them (the writer folded them in).
#: Additive.
_BUDGET_ADMITS = """
CREATE TABLE IF NOT EXISTS budget_admits (
    tenant  TEXT    NOT NULL,
    feature TEXT    NOT NULL,
    period  TEXT    NOT NULL,
    name    TEXT    NOT NULL,
    units   INTEGER NOT NULL,
    op      TEXT    NOT NULL,
    PRIMARY KEY (tenant, feature, period, name)
) WITHOUT ROWID
"""

#: Threshold alerts claimed (docs/quotas.md): the first body stored under an id stays. Additive.
_ALERTS = """
CREATE TABLE IF NOT EXISTS alerts (
    id         TEXT PRIMARY KEY,
    body       TEXT NOT NULL,
    expires_at INTEGER NOT NULL
) WITHOUT ROWID
"""
#: Settings fixed when the cluster was created (ADR 0024): the first value stays. Additive.
_SETTINGS = """
CREATE TABLE IF NOT EXISTS cluster_settings (
    name  TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID
"""
#: Credits ledgers (docs/ledger.md): a balance record per tenant replaced by version, its
#: entries by sequence and its ref records. Additive tables: the schema version is unchanged.
_LEDGERS = (
    """
CREATE TABLE IF NOT EXISTS ledger_balances (
    tenant  TEXT    NOT NULL PRIMARY KEY,
    version INTEGER NOT NULL,
    body    TEXT    NOT NULL
) WITHOUT ROWID
""",
    """
CREATE TABLE IF NOT EXISTS ledger_entries (
    tenant TEXT    NOT NULL,
    seq    INTEGER NOT NULL,
    body   TEXT    NOT NULL,
    PRIMARY KEY (tenant, seq)
) WITHOUT ROWID
""",
    """
CREATE TABLE IF NOT EXISTS ledger_refs (
    tenant TEXT NOT NULL,
    ref    TEXT NOT NULL,
    body   TEXT NOT NULL,
    PRIMARY KEY (tenant, ref)
) WITHOUT ROWID
""",
)

#: Every tenant's ledger entries in time order (docs/ledger.md, "Timeline"): one row per entry
#: at its time, so a page of the timeline is one range of the primary key. Additive; a file
#: of an earlier layout gets it filled from its entries when it is added.
_LEDGER_TIMELINE = """
CREATE TABLE IF NOT EXISTS ledger_timeline (
    at_ms  INTEGER NOT NULL,
    tenant TEXT    NOT NULL,
    seq    INTEGER NOT NULL,
    PRIMARY KEY (at_ms, tenant, seq)
) WITHOUT ROWID
"""
_LEDGER_TIMELINE_FILL = (
    "INSERT OR IGNORE INTO ledger_timeline (at_ms, tenant, seq)"
    " SELECT CAST(round(json_extract(body, '$.t') * 1000) AS INTEGER), tenant, seq"
    " FROM ledger_entries WHERE json_valid(body)"
)

#: Day buckets of month counters (docs/history.md): the units a counter's flushes added on each
#: UTC day, exactly once per (node, seq) like the counter itself. Keyed so that one tenant and
#: feature's range of days is one primary-key range. Additive, like ``budgets``; purged with
#: the retention (``expires_at`` is its month counter's).
_DAYS = """
CREATE TABLE IF NOT EXISTS days (
    tenant     TEXT    NOT NULL,
    feature    TEXT    NOT NULL,
    day        TEXT    NOT NULL,
    total      TEXT    NOT NULL,
    seqs       TEXT    NOT NULL,
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (tenant, feature, day)
) WITHOUT ROWID
"""
_DAYS_EXPIRY_INDEX = "CREATE INDEX IF NOT EXISTS days_expiry ON days (expires_at)"
_DAYS_UPSERT = (
    "INSERT INTO days (tenant, feature, day, total, seqs, expires_at) VALUES (?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (tenant, feature, day) DO UPDATE SET"
    " total = excluded.total, seqs = excluded.seqs, expires_at = excluded.expires_at"
)

#: Values of unique features (docs/storage.md, "Unique values"): one row per (key, value),
#: holding the claimant that stored it first. Keyed so that one key's values are one range of
#: the primary key in value order (BINARY collation: UTF-8 bytes, i.e. code points). Additive,
#: like ``days``; purged with the retention (``expires_at`` as its counter's).
_VALUES = """
CREATE TABLE IF NOT EXISTS unique_values (
    tenant     TEXT    NOT NULL,
    feature    TEXT    NOT NULL,
    period     TEXT    NOT NULL,
    value      TEXT    NOT NULL,
    claimant   TEXT    NOT NULL,
    expires_at INTEGER NOT NULL,
    voided     INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, feature, period, value)
) WITHOUT ROWID
"""
_VALUES_EXPIRY_INDEX = (
    "CREATE INDEX IF NOT EXISTS unique_values_expiry ON unique_values (expires_at)"
)

#: Period marks (docs/storage.md, "Period marks"): each node's open, closed or drained mark of
#: a counting period, one row per (period, node), so a period's marks are one range of the
#: primary key in node order. Additive, like ``unique_values``; a period's marks are purged with
#: the retention once its last counter is gone (never before the period's end plus it).
_PERIOD_MARKS = """
CREATE TABLE IF NOT EXISTS period_marks (
    period TEXT    NOT NULL,
    node   TEXT    NOT NULL,
    state  TEXT    NOT NULL,
    at     REAL    NOT NULL,
    by     TEXT    NOT NULL,
    units  TEXT,
    PRIMARY KEY (period, node)
) WITHOUT ROWID
"""
#: An open: written where no mark is, over a drained one (the node opening again); an open or
#: closed mark already there stays.
_MARK_OPENING = (
    "INSERT INTO period_marks (period, node, state, at, by) VALUES (?, ?, ?, ?, ?)"
    " ON CONFLICT (period, node) DO UPDATE SET state = excluded.state, at = excluded.at,"
    " by = excluded.by, units = NULL WHERE period_marks.state = 'drained'"
)
#: A close: written where no mark is, over an open or drained one; a close already there stays.
_MARK_CLOSE = (
    "INSERT INTO period_marks (period, node, state, at, by, units) VALUES (?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (period, node) DO UPDATE SET state = excluded.state, at = excluded.at,"
    " by = excluded.by, units = excluded.units WHERE period_marks.state <> 'closed'"
)
#: A drain: over an open mark only; nothing written where no mark is, or a closed or drained one.
_MARK_DRAIN = (
    "UPDATE period_marks SET state = ?, at = ?, by = ?, units = ?"
    " WHERE period = ? AND node = ? AND state = 'open'"
)


#: How long a statement waits for another connection's lock before giving up (busy).
BUSY_TIMEOUT_S = 5.0


class SQLiteStorage(Storage):
    """Counters in one SQLite file (WAL mode), written from one worker thread.

    ``path`` is created with its parent directories on :meth:`open`; ``retention_days`` is how
    long after the end of its period a counter's ``expires_at`` lies.
    """

    kind = "sqlite"
    #: One query per 240 keys (see :func:`_load_query`); two
    #: loads in flight keep the one database thread busy while the loop seeds the last one.
    load_chunk = _LOAD_QUERY_KEYS
    load_concurrency = 2

    def __init__(self, path: str | Path, *, retention_days: int = 400) -> None:
        if retention_days < 0:
            raise ValueError(f"retention_days must not be negative, got {retention_days}")
        self.path = Path(path)
        self.retention_days = retention_days
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        # Touched only on the worker thread.
        self._conn: sqlite3.Connection | None = None
        # Seeding reads run on a thread and connection of their own: on the writer's thread
        # they queued behind whole flush transactions (tens of thousands of keys), and a cold
        # key's caller waited seconds. WAL mode lets a reader see every commit made before its
        # read transaction began, without blocking the writer. None for ":memory:" (a second
        # connection would open another, empty database): reads then share the writer's.
        self._reader: concurrent.futures.ThreadPoolExecutor | None = None
        self._rconn: sqlite3.Connection | None = None  # touched only on the reader's thread

    # -- lifecycle ---------------------------------------------------------------------------

    async def open(self) -> None:
        """Create the file, its directories and the schema; switch the file to WAL mode.

        Raises :class:`StorageUnavailable` naming the path if the file cannot be opened or is
        not a usable database.
        """
        if self._executor is not None:
            return
        executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="meter-sqlite"
        )
        self._executor = executor
        try:
            await self._run(self._open_sync)
        except BaseException:
            self._executor = None
            executor.shutdown(wait=False)
            raise
        if str(self.path) != ":memory:":
            reader = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="meter-sqlite-read"
            )
            try:
                await asyncio.get_running_loop().run_in_executor(reader, self._open_reader_sync)
            except BaseException:
                reader.shutdown(wait=False)
                await self.close()
                raise
            self._reader = reader

    async def close(self) -> None:
        """Close the connection (after every queued call has run) and stop the worker."""
        reader, self._reader = self._reader, None
        if reader is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(reader, self._close_reader_sync)
            finally:
                reader.shutdown(wait=False)
        executor = self._executor
        if executor is None:
            return
        try:
            await self._run(self._close_sync)
        finally:
            self._executor = None
            # The close job was the last one queued, so the worker is idle or about to be.
            executor.shutdown(wait=False)

    async def init_schema(self) -> str:
        """Nothing to do for SQLite; :meth:`open` creates the schema."""
        return f"sqlite: schema is created automatically on open at {self.path} (nothing to do)"

    # -- operations --------------------------------------------------------------------------

    async def apply(self, node: str, deltas: Sequence[Delta]) -> dict[Key, Applied | StorageError]:
        """Apply one node's deltas in a single ``BEGIN IMMEDIATE`` transaction."""
        if not isinstance(node, str) or not node:
            raise StoragePermanentError(f"node id must be a non-empty string, got {node!r}")
        if not deltas:
            return {}
        batch = list(deltas)
        return await self._run(lambda: self._apply_sync(node, batch))

    async def apply_days(self, node: str, deltas: Sequence[Delta]) -> list[StorageError | None]:
        """The day buckets only, in one ``BEGIN IMMEDIATE`` transaction."""
        out: list[StorageError | None] = []
        good: list[Delta] = []
        for d in deltas:
            problem = _check_delta(d) if d.day is not None else f"{d.key!r}: no day"
            out.append(None if problem is None else StoragePermanentError(problem))
            if problem is None:
                good.append(d)
        if good:
            await self._run(lambda: self._apply_days_sync(node, good))
        return out

    def _apply_days_sync(self, node: str, deltas: list[Delta]) -> None:
        conn = self._connection()
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                self._apply_days(conn, node, deltas)
                conn.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise _map(exc, f"writing day buckets to {self.path}") from exc

    async def load(self, keys: Sequence[Key]) -> dict[Key, Snapshot]:
        """Read the current snapshot of each key from one consistent read transaction."""
        if not keys:
            return {}
        wanted = list(keys)
        reader = self._reader
        if reader is None:
            return await self._run(lambda: self._load_sync(wanted, self._connection))
        try:
            return await asyncio.get_running_loop().run_in_executor(
                reader, lambda: self._load_sync(wanted, self._read_connection)
            )
        except RuntimeError as exc:
            if "shutdown" in str(exc):
                raise StorageUnavailable(f"sqlite storage at {self.path} is closed") from exc
            raise

    async def list_period(self, tenant: str, period: str) -> dict[str, Snapshot]:
        """Every stored counter of ``tenant`` in ``period``: one primary-key range scan."""
        return await self._run(lambda: self._list_sync(tenant, period))

    async def list_between(
        self, tenant: str, period: str, first: str, last: str
    ) -> dict[str, Snapshot]:
        """One range of the ``counters`` primary key: ``(tenant, period, first..last)``."""
        return await self._run(lambda: self._list_sync(tenant, period, (first, last)))

    # -- gauges (docs/dimensions.md) ------------------------------------------------------------
    # A gauge is a ``counters`` row of its own (``gauge_key``): ``total`` its value, ``seqs``
    # ``{"@<node>": at_ms}`` (ints, as a counter's seqs are: listings and exports read it as
    # any row).

    async def put_gauges(
        self, items: Sequence[tuple[Key, str, GaugeReading]]
    ) -> dict[Key, GaugeReading | StorageError]:
        """One write transaction: each reading written if it wins over the row's."""
        return await self._run(lambda: self._put_gauges_sync(list(items)))

    async def load_gauges(self, keys: Sequence[Key]) -> dict[Key, GaugeReading | None]:
        """The rows' readings, on the writer's connection (a consistent read)."""
        return await self._run(lambda: self._load_gauges_sync(list(keys)))

    def _put_gauges_sync(
        self, items: list[tuple[Key, str, GaugeReading]]
    ) -> dict[Key, GaugeReading | StorageError]:
        conn = self._connection()
        out: dict[Key, GaugeReading | StorageError] = {}
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise _map(exc, f"starting a write transaction on {self.path}") from exc
        try:
            for key, kind, reading in items:
                tenant, feature, period = gauge_key(key)
                try:
                    check_period(period)
                    stored = self._gauge_row(conn, key)
                except StoragePermanentError as exc:
                    out[key] = exc
                    continue
                except ValueError as exc:  # (this key only: the others are written)
                    out[key] = StoragePermanentError(f"bad stored gauge in {self.path}: {exc}")
                    continue
                if reading_wins(kind, reading, stored):
                    value, at_ms, node = reading
                    seqs = json.dumps({"@" + node: at_ms}, separators=(",", ":"))
                    conn.execute(
                        _UPSERT,
                        (tenant, period, feature, str(value), seqs, self._expires_at(period)),
                    )
                    stored = reading
                assert stored is not None
                out[key] = stored
            conn.execute("COMMIT")
        except BaseException as exc:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise _map(exc, f"writing gauges to {self.path}") from exc
            raise
        return out

    def _load_gauges_sync(self, keys: list[Key]) -> dict[Key, GaugeReading | None]:
        conn = self._connection()
        try:
            return {key: self._gauge_row(conn, key) for key in keys}
        except sqlite3.Error as exc:
            raise _map(exc, f"reading gauges from {self.path}") from exc
        except ValueError as exc:
            raise StoragePermanentError(f"bad stored gauge in {self.path}: {exc}") from exc

    def _gauge_row(self, conn: sqlite3.Connection, key: Key) -> GaugeReading | None:
        tenant, feature, period = gauge_key(key)
        row = conn.execute(
            "SELECT total, seqs FROM counters WHERE tenant = ? AND period = ? AND feature = ?",
            (tenant, period, feature),
        ).fetchone()
        if row is None:
            return None
        snap = _snapshot(row[0], row[1])
        for name, at_ms in snap.seqs.items():
            if name.startswith("@"):
                return (snap.total, at_ms, name[1:])
        raise ValueError(f"the gauge row of {key} holds no reading's time")

    # -- history (docs/history.md) -------------------------------------------------------------

    async def day_buckets(self, tenant: str, feature: str, first: str, last: str) -> dict[str, int]:
        """One range of the ``days`` primary key, on the reader's connection."""
        first, last = check_range(first, last)
        sql = (
            "SELECT day, total FROM days WHERE tenant = ? AND feature = ?"
            " AND day BETWEEN ? AND ? ORDER BY day"
        )
        return await self._read_range(sql, (tenant, feature, first, last + DAYS_END), None)

    async def counters_between(
        self, tenant: str, feature: str, first: str, last: str
    ) -> dict[str, int]:
        """One range of the ``counters`` primary key (the tenant's periods ``first`` to
        ``last``), keeping ``feature``'s rows of that period shape."""
        first, last = check_range(first, last)
        sql = (
            "SELECT period, total FROM counters WHERE tenant = ? AND period BETWEEN ? AND ?"
            " AND feature = ? ORDER BY period"
        )
        return await self._read_range(sql, (tenant, first, last, feature), len(first))

    async def _read_range(
        self, sql: str, args: tuple[str, ...], shape: int | None
    ) -> dict[str, int]:
        def read(connection: Callable[[], sqlite3.Connection]) -> dict[str, int]:
            try:
                rows = connection().execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise _map(exc, f"reading history from {self.path}") from exc
            out: dict[str, int] = {}
            for period, total in rows:
                if shape is None or len(period) == shape:
                    out[period] = _total(total, args[0], "history", period)
            return out

        return await self._on_reader(read)

    async def export_page(self, period: str, cursor: str | None, limit: int) -> ExportPage:
        """Up to ``limit`` counters of ``period`` in (tenant, feature) order, read in one read
        transaction on the reader's connection (flushes are not held up)."""
        check_period(period)
        check_export_limit(limit)
        after = ("", "")
        if cursor is not None:
            state = decode_cursor(cursor)
            if not (
                isinstance(state, list)
                and len(state) == 4
                and state[:2] == ["q", period]
                and all(isinstance(x, str) for x in state[2:])
            ):
                raise BadCursor(f"cursor is not one handed out for period {period}")
            after = (state[2], state[3])
        reader = self._reader
        if reader is None:
            return await self._run(
                lambda: self._export_sync(self._connection, period, after, limit)
            )
        try:
            return await asyncio.get_running_loop().run_in_executor(
                reader, lambda: self._export_sync(self._read_connection, period, after, limit)
            )
        except RuntimeError as exc:
            if "shutdown" in str(exc):
                raise StorageUnavailable(f"sqlite storage at {self.path} is closed") from exc
            raise

    def _export_sync(
        self,
        connection: Callable[[], sqlite3.Connection],
        period: str,
        after: tuple[str, str],
        limit: int,
    ) -> ExportPage:
        """A skip scan over tenants: per tenant one range of the primary key (its counters
        of ``period`` are adjacent), then a seek to the next tenant. It reads the period's
        rows and one key per tenant, never the other periods' rows (a year of months and
        days would otherwise be read to export one month)."""
        conn = connection()
        rows: list[ExportRow] = []
        tenant, feature = after
        done = False
        try:
            if conn.in_transaction:  # left open by a read whose ROLLBACK failed
                conn.execute("ROLLBACK")
            conn.execute("BEGIN")
            try:
                while True:
                    got = conn.execute(
                        "SELECT feature, total FROM counters WHERE tenant = ? AND period = ?"
                        " AND feature > ? ORDER BY feature LIMIT ?",
                        (tenant, period, feature, limit - len(rows)),
                    ).fetchall()
                    for f, total in got:
                        rows.append(ExportRow(tenant, f, period, _total(total, tenant, f, period)))
                    if len(rows) >= limit:
                        break
                    nxt = conn.execute(
                        "SELECT tenant FROM counters WHERE tenant > ? ORDER BY tenant LIMIT 1",
                        (tenant,),
                    ).fetchone()
                    if nxt is None:
                        done = True
                        break
                    tenant, feature = str(nxt[0]), ""
            finally:
                if conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):  # (the next read rolls it back)
                        conn.execute("ROLLBACK")
        except sqlite3.Error as exc:
            raise _map(exc, f"exporting {period} from {self.path}") from exc
        if done:
            return ExportPage(rows, None, 1, 1)
        last = rows[-1]
        return ExportPage(rows, encode_cursor(["q", period, last.tenant, last.feature]), 1, 0)

    async def claim_owner(
        self, node: str, token: str, *, lease_s: float, now: float, accept: Sequence[str] = ()
    ) -> Owner:
        """Claim ``node`` for ``token`` in one ``BEGIN IMMEDIATE`` transaction."""
        ok = {token, *accept}

        def may(held: tuple[str, int] | None) -> bool:
            return held is None or held[0] in ok or held[1] <= now * 1000

        held = await self._run(lambda: self._set_owner_sync(node, token, now, lease_s, may))
        assert held is not None
        return held

    async def renew_owner(
        self, node: str, token: str, *, lease_s: float, now: float, note: str | None = None
    ) -> Owner | None:
        """Renew ``token``'s lease on ``node`` (and its note) in one ``BEGIN IMMEDIATE``
        transaction."""
        check_owner_note(note)

        def may(held: tuple[str, int] | None) -> bool:
            return held is not None and held[0] == token

        return await self._run(lambda: self._set_owner_sync(node, token, now, lease_s, may, note))

    async def owner(self, node: str) -> Owner | None:
        """The owner of ``node``, read from the committed state."""

        def read() -> Owner | None:
            try:
                return _read_owner(self._connection(), node)
            except sqlite3.Error as exc:
                raise _map(exc, f"reading the owner of {node!r} in {self.path}") from exc

        return await self._run(read)

    # -- limits ------------------------------------------------------------------------------

    async def limits_version(self) -> int:
        """The stored limits' version, from the committed state."""
        return await self._run(lambda: self._limits_version_sync(self._connection()))

    async def read_limits(self) -> tuple[int, list[tuple[str, str, str, str]]]:
        """Every limits record and their version, from one read transaction."""

        def read() -> tuple[int, list[tuple[str, str, str, str]]]:
            conn = self._connection()
            try:
                conn.execute("BEGIN")
                try:
                    version = self._limits_version_sync(conn)
                    rows = conn.execute("SELECT scope, name, feature, body FROM limits").fetchall()
                finally:
                    conn.execute("COMMIT")
            except sqlite3.Error as exc:
                raise _map(exc, f"reading limits from {self.path}") from exc
            return version, [(str(a), str(b), str(c), str(d)) for a, b, c, d in rows]

        return await self._run(read)

    async def write_limit(
        self, scope: str, name: str, feature: str, body: str | None, expect: int | None = None
    ) -> int:
        """Put or delete one record and bump the version in one ``BEGIN IMMEDIATE``."""

        def write(conn: sqlite3.Connection) -> int:
            if expect is not None and expect != (now := self._limits_version_sync(conn)):
                raise VersionMoved(f"limits are at version {now}, not {expect}")
            if body is None:
                conn.execute(
                    "DELETE FROM limits WHERE scope = ? AND name = ? AND feature = ?",
                    (scope, name, feature),
                )
            else:
                conn.execute(
                    "INSERT INTO limits (scope, name, feature, body) VALUES (?, ?, ?, ?)"
                    " ON CONFLICT (scope, name, feature)"
                    " DO UPDATE SET body = excluded.body",
                    (scope, name, feature, body),
                )
            version = self._limits_version_sync(conn) + 1
            conn.execute(
                "INSERT INTO limits_version (id, version) VALUES (1, ?)"
                " ON CONFLICT (id) DO UPDATE SET version = excluded.version",
                (version,),
            )
            return version

        return await self._run(lambda: self._immediate(write, f"writing a limit to {self.path}"))

    # -- alerts ------------------------------------------------------------------------------

    async def claim_alert(self, alert_id: str, body: str) -> bool:
        """``INSERT OR IGNORE`` then read back, in one ``BEGIN IMMEDIATE``."""

        def claim(conn: sqlite3.Connection) -> bool:
            # Purged with the counters: the retention past the end of the current month.
            expires = int(time.time()) + (self.retention_days + 32) * 86400
            conn.execute(
                "INSERT OR IGNORE INTO alerts (id, body, expires_at) VALUES (?, ?, ?)",
                (alert_id, body, expires),
            )
            row = conn.execute("SELECT body FROM alerts WHERE id = ?", (alert_id,)).fetchone()
            return row is not None and str(row[0]) == body

        return await self._run(lambda: self._immediate(claim, f"claiming an alert in {self.path}"))

    async def cluster_setting(self, name: str, value: str) -> str:
        """``INSERT OR IGNORE`` then read back, in one ``BEGIN IMMEDIATE``."""

        def put(conn: sqlite3.Connection) -> str:
            conn.execute(
                "INSERT OR IGNORE INTO cluster_settings (name, value) VALUES (?, ?)", (name, value)
            )
            row = conn.execute(
                "SELECT value FROM cluster_settings WHERE name = ?", (name,)
            ).fetchone()
            return str(row[0])

        return await self._run(
            lambda: self._immediate(put, f"storing the cluster setting {name} in {self.path}")
        )

    # -- unique values (docs/storage.md, "Unique values") ------------------------------------

    async def claim_value(self, key: Key, value: str, claimant: str) -> str:
        """``INSERT OR IGNORE`` then read the claimant back, in one ``BEGIN IMMEDIATE``."""
        check_unique(key, value, claimant)
        expires = self._expires_at(key[2])

        def claim(conn: sqlite3.Connection) -> str:
            conn.execute(
                "INSERT OR IGNORE INTO unique_values"
                " (tenant, feature, period, value, claimant, expires_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (*key, value, claimant, expires),
            )
            held = self._claimant_sync(conn, key, value)
            if held is None:
                raise StoragePermanentError(f"bad stored value of {key!r} in {self.path}")
            return held

        return await self._run(
            lambda: self._immediate(claim, f"claiming a unique value in {self.path}")
        )

    async def claimant_of(self, key: Key, value: str) -> str | None:
        """One ``SELECT`` of the row's claimant on the writer's connection: a claim commits on
        it, and one queued on its thread before this read (even if its caller stopped waiting)
        runs first, so a claim answered before is seen; so is another process's (each
        statement reads the latest commit)."""
        check_value_of(key, value)

        def read() -> str | None:
            try:
                return self._claimant_sync(self._connection(), key, value)
            except sqlite3.Error as exc:
                raise _map(exc, f"reading a unique value's claimant from {self.path}") from exc

        return await self._run(read)

    async def void_value(self, key: Key, value: str, claimant: str) -> str | None:
        """``UPDATE ... SET voided = 1`` where ``claimant`` holds it, then read the claimant
        back, in one ``BEGIN IMMEDIATE``."""
        check_unique(key, value, claimant)

        def mark(conn: sqlite3.Connection) -> str | None:
            conn.execute(
                "UPDATE unique_values SET voided = 1 WHERE tenant = ? AND feature = ?"
                " AND period = ? AND value = ? AND claimant = ?",
                (*key, value, claimant),
            )
            return self._claimant_sync(conn, key, value)

        return await self._run(
            lambda: self._immediate(mark, f"marking a unique value voided in {self.path}")
        )

    def _claimant_sync(self, conn: sqlite3.Connection, key: Key, value: str) -> str | None:
        """The claimant of ``value`` of ``key`` read on ``conn`` (``None``: no row)."""
        row = conn.execute(
            "SELECT claimant FROM unique_values"
            " WHERE tenant = ? AND feature = ? AND period = ? AND value = ?",
            (*key, value),
        ).fetchone()
        if row is None:
            return None
        if type(row[0]) is not str:
            raise StoragePermanentError(f"bad stored value of {key!r} in {self.path}")
        return row[0]

    async def values_page(
        self, key: Key, cursor: str | None, limit: int
    ) -> tuple[list[str], str | None]:
        """One range of the ``unique_values`` primary key, on the reader's connection (it sees
        every commit made before the read: a claim answered before is in it)."""
        check_values_key(key)
        check_values_limit(limit)
        after = values_cursor(cursor)

        def read(connection: Callable[[], sqlite3.Connection]) -> tuple[list[str], str | None]:
            try:
                # One more than asked for: whether a next page has any.
                rows = (
                    connection()
                    .execute(
                        "SELECT value FROM unique_values WHERE tenant = ? AND feature = ?"
                        " AND period = ? AND value > ? AND voided = 0 ORDER BY value LIMIT ?",
                        (*key, after, limit + 1),
                    )
                    .fetchall()
                )
            except sqlite3.Error as exc:
                raise _map(exc, f"reading unique values from {self.path}") from exc
            got = [v for (v,) in rows[:limit]]
            if any(type(v) is not str for v in got):
                raise StoragePermanentError(f"bad stored value of {key!r} in {self.path}")
            return got, next_values_cursor(got, len(rows) > limit)

        return await self._on_reader(read)

    # -- period marks (docs/storage.md, "Period marks") --------------------------------------

    async def mark_period_open(
        self, period: str, node: str, at: float, by: str | None = None
    ) -> PeriodMark:
        """An upsert that replaces a drained row only, then the mark read back, in one
        ``BEGIN IMMEDIATE``."""
        mark = check_period_mark(period, node, at, by or node, MARK_OPEN)

        def write(conn: sqlite3.Connection) -> PeriodMark:
            conn.execute(_MARK_OPENING, (period, node, mark.state, mark.at, mark.by))
            return self._mark_sync(conn, period, node)

        return await self._run(
            lambda: self._immediate(write, f"marking {period} open in {self.path}")
        )

    async def mark_period_closed(
        self, period: str, node: str, at: float, by: str, units: dict[str, int] | None = None
    ) -> PeriodMark:
        """An upsert that leaves a closed row as it is, then the mark read back, in one
        ``BEGIN IMMEDIATE``."""
        mark = check_period_mark(period, node, at, by, MARK_CLOSED, units)
        text = mark_units_to_text(mark.units)

        def write(conn: sqlite3.Connection) -> PeriodMark:
            conn.execute(_MARK_CLOSE, (period, node, mark.state, mark.at, mark.by, text))
            return self._mark_sync(conn, period, node)

        return await self._run(
            lambda: self._immediate(write, f"marking {period} closed in {self.path}")
        )

    async def mark_period_drained(
        self, period: str, node: str, at: float, units: dict[str, int] | None = None
    ) -> PeriodMark | None:
        """An ``UPDATE`` of an open row only, then the mark read back (``None``: no row), in
        one ``BEGIN IMMEDIATE``."""
        mark = check_period_mark(period, node, at, node, MARK_DRAINED, units)
        text = mark_units_to_text(mark.units)

        def write(conn: sqlite3.Connection) -> PeriodMark | None:
            conn.execute(_MARK_DRAIN, (mark.state, mark.at, mark.by, text, period, node))
            return self._mark_or_none(conn, period, node)

        return await self._run(
            lambda: self._immediate(write, f"marking {period} drained in {self.path}")
        )

    async def period_marks(self, period: str) -> list[PeriodMark]:
        """One range of the ``period_marks`` primary key, on the writer's connection (a mark
        written before the call is seen)."""
        check_period(period)

        def read() -> list[PeriodMark]:
            try:
                rows = (
                    self._connection()
                    .execute(
                        "SELECT node, state, at, by, units FROM period_marks WHERE period = ?"
                        " ORDER BY node",
                        (period,),
                    )
                    .fetchall()
                )
            except sqlite3.Error as exc:
                raise _map(exc, f"reading the marks of {period} from {self.path}") from exc
            return [_mark(row, self.path) for row in rows]

        return await self._run(read)

    def _mark_sync(self, conn: sqlite3.Connection, period: str, node: str) -> PeriodMark:
        mark = self._mark_or_none(conn, period, node)
        if mark is None:
            raise StoragePermanentError(f"the mark of {node!r} in {period} was not stored")
        return mark

    def _mark_or_none(self, conn: sqlite3.Connection, period: str, node: str) -> PeriodMark | None:
        row = conn.execute(
            "SELECT node, state, at, by, units FROM period_marks WHERE period = ? AND node = ?",
            (period, node),
        ).fetchone()
        return None if row is None else _mark(row, self.path)

    # -- strict budgets (ADR 0009) -----------------------------------------------------------

    async def budget_read(self, key: Key) -> BudgetItem:
        """The record, from the committed state (the writer's connection, so a read after a
        write sees it)."""

        def read() -> BudgetItem:
            try:
                return _budget_item(self._connection(), key)
            except sqlite3.Error as exc:
                raise _map(exc, f"reading a budget from {self.path}") from exc

        return await self._run(read)

    async def budget_swap(self, key: Key, version: int, body: str) -> bool:
        """One transaction: compare the version, write the next (and drop the units admitted
        onto the old body: the writer folded them in). A record with no period (a credit
        pool) never expires."""
        expires = self._expires_at(key[2]) if key[2] else 2**62

        def swap(conn: sqlite3.Connection) -> bool:
            row = conn.execute(
                "SELECT version FROM budgets WHERE tenant = ? AND feature = ? AND period = ?",
                key,
            ).fetchone()
            done = (0 if row is None else int(row[0])) == version
            if done:
                conn.execute(
                    "INSERT INTO budgets"
                    " (tenant, feature, period, version, body, expires_at)"
                    " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, feature, period)"
                    " DO UPDATE SET version = excluded.version, body = excluded.body,"
                    " expires_at = excluded.expires_at",
                    (*key, version + 1, body, expires),
                )
                conn.execute(
                    "DELETE FROM budget_admits WHERE tenant = ? AND feature = ? AND period = ?",
                    key,
                )
            return done

        return await self._run(lambda: self._immediate(swap, f"writing a budget to {self.path}"))

    async def budget_admit(
        self, key: Key, body: str, name: str, units: int, most: int, op: str
    ) -> BudgetItem | None:
        """One transaction: check the conditions, add the units (making the record if there
        is none), move the version on."""
        expires = self._expires_at(key[2]) if key[2] else 2**62

        def admit(conn: sqlite3.Connection) -> BudgetItem | None:
            item = _budget_item(conn, key)
            mine = next((a for a in item.admitted if a[0] == name), None)
            if (
                (item.body is not None and item.body != body)
                or units <= 0
                or item.admitted_total + units > most
                or (mine is not None and mine[2] == op)
            ):
                return None
            conn.execute(
                "INSERT INTO budget_admits (tenant, feature, period, name, units, op)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, feature, period, name)"
                " DO UPDATE SET units = units + excluded.units, op = excluded.op",
                (*key, name, units, op),
            )
            conn.execute(
                "INSERT INTO budgets (tenant, feature, period, version, body, expires_at)"
                " VALUES (?, ?, ?, 1, ?, ?) ON CONFLICT (tenant, feature, period)"
                " DO UPDATE SET version = version + 1",
                (*key, body, expires),
            )
            return _budget_item(conn, key)

        return await self._run(
            lambda: self._immediate(admit, f"admitting onto a budget in {self.path}")
        )

    # -- credits ledgers (docs/ledger.md) ----------------------------------------------------

    async def ledger_read(self, tenant: str) -> tuple[int, str | None]:
        """The balance record and its version, from the committed state."""

        def read() -> tuple[int, str | None]:
            try:
                row = (
                    self._connection()
                    .execute(
                        "SELECT version, body FROM ledger_balances WHERE tenant = ?", (tenant,)
                    )
                    .fetchone()
                )
            except sqlite3.Error as exc:
                raise _map(exc, f"reading a ledger from {self.path}") from exc
            return (0, None) if row is None else (int(row[0]), str(row[1]))

        return await self._run(read)

    async def ledger_write(
        self,
        tenant: str,
        version: int,
        body: str,
        entries: Sequence[LedgerRow],
        refs: Sequence[tuple[str, str]] = (),
    ) -> bool:
        """One ``BEGIN IMMEDIATE``: compare the version and the refs, write everything."""

        def write(conn: sqlite3.Connection) -> bool:
            row = conn.execute(
                "SELECT version FROM ledger_balances WHERE tenant = ?", (tenant,)
            ).fetchone()
            done = (0 if row is None else int(row[0])) == version
            for ref, _ in refs if done else ():
                hit = conn.execute(
                    "SELECT 1 FROM ledger_refs WHERE tenant = ? AND ref = ?", (tenant, ref)
                ).fetchone()
                done = done and hit is None
            for seq, _, _ in entries if done else ():
                hit = conn.execute(
                    "SELECT 1 FROM ledger_entries WHERE tenant = ? AND seq = ?",
                    (tenant, seq),
                ).fetchone()
                done = done and hit is None
            if done:
                conn.execute(
                    "INSERT INTO ledger_balances (tenant, version, body) VALUES (?, ?, ?)"
                    " ON CONFLICT (tenant) DO UPDATE SET"
                    " version = excluded.version, body = excluded.body",
                    (tenant, version + 1, body),
                )
                conn.executemany(
                    "INSERT INTO ledger_entries (tenant, seq, body) VALUES (?, ?, ?)",
                    [(tenant, seq, b) for seq, b, _ in entries],
                )
                conn.executemany(
                    "INSERT INTO ledger_timeline (at_ms, tenant, seq) VALUES (?, ?, ?)",
                    [(at_ms, tenant, seq) for seq, _, at_ms in entries],
                )
                conn.executemany(
                    "INSERT INTO ledger_refs (tenant, ref, body) VALUES (?, ?, ?)",
                    [(tenant, ref, b) for ref, b in refs],
                )
            return done

        return await self._run(lambda: self._immediate(write, f"writing a ledger to {self.path}"))

    async def ledger_ref(self, tenant: str, ref: str) -> str | None:
        def read() -> str | None:
            try:
                row = (
                    self._connection()
                    .execute(
                        "SELECT body FROM ledger_refs WHERE tenant = ? AND ref = ?", (tenant, ref)
                    )
                    .fetchone()
                )
            except sqlite3.Error as exc:
                raise _map(exc, f"reading a ledger ref from {self.path}") from exc
            return None if row is None else str(row[0])

        return await self._run(read)

    async def ledger_entries(self, tenant: str, after: int, limit: int) -> list[tuple[int, str]]:
        def read() -> list[tuple[int, str]]:
            try:
                rows = (
                    self._connection()
                    .execute(
                        "SELECT seq, body FROM ledger_entries WHERE tenant = ? AND seq > ?"
                        " ORDER BY seq LIMIT ?",
                        (tenant, after, limit),
                    )
                    .fetchall()
                )
            except sqlite3.Error as exc:
                raise _map(exc, f"reading ledger entries from {self.path}") from exc
            return [(int(a), str(b)) for a, b in rows]

        return await self._run(read)

    @staticmethod
    def _add_timeline(conn: sqlite3.Connection) -> None:
        """Add ``ledger_timeline`` to a file without it, filled from its entries, in one
        transaction (a failure or a crash in between leaves neither: tried again at the
        next open). An entry whose body is not JSON is left out of it."""
        if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'ledger_timeline'").fetchone():
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(_LEDGER_TIMELINE)
            conn.execute(_LEDGER_TIMELINE_FILL)
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise

    @staticmethod
    def _add_column(conn: sqlite3.Connection, table: str, column: str, declared: str) -> None:
        """Add ``column`` to ``table`` of a file an older build made (its rows get the
        column's default); judged again under the write lock, as another process may add it
        first."""

        def has_it() -> bool:
            columns = conn.execute(f"PRAGMA table_info({table})").fetchall()
            return any(c[1] == column for c in columns)

        if has_it():
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            if not has_it():
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declared}")
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise

    async def ledger_timeline(
        self, start_ms: int, end_ms: int, after: str | None, limit: int
    ) -> tuple[list[tuple[str, int, str]], str | None]:
        """One range of the ``ledger_timeline`` primary key, each row's body from its entry."""
        start, _ = timeline_range(start_ms, end_ms, after)
        at, tenant, seq = start.split("#")  # (tenants hold no #)
        lo = (int(at), tenant, int(seq))

        def read() -> tuple[list[tuple[str, int, str]], str | None]:
            try:
                rows = (
                    self._connection()
                    .execute(
                        "SELECT t.at_ms, t.tenant, t.seq, e.body FROM ledger_timeline t"
                        " JOIN ledger_entries e ON e.tenant = t.tenant AND e.seq = t.seq"
                        " WHERE (t.at_ms, t.tenant, t.seq) >= (?, ?, ?) AND t.at_ms < ?"
                        " ORDER BY t.at_ms, t.tenant, t.seq LIMIT ?",
                        (*lo, end_ms, limit + 1),
                    )
                    .fetchall()
                )
            except sqlite3.Error as exc:
                raise _map(exc, f"reading the ledger timeline from {self.path}") from exc
            page = [(str(t), int(s), str(b)) for _, t, s, b in rows[:limit]]
            if len(rows) <= limit:
                return page, None
            at, t, s, _ = rows[limit - 1]
            return page, timeline_position(int(at), str(t), int(s))

        return await self._run(read)

    @staticmethod
    def _limits_version_sync(conn: sqlite3.Connection) -> int:
        try:
            row = conn.execute("SELECT version FROM limits_version WHERE id = 1").fetchone()
        except sqlite3.Error as exc:
            raise _map(exc, "reading the limits version") from exc
        return 0 if row is None else int(row[0])

    # -- plumbing ----------------------------------------------------------------------------

    def _immediate(self, body: Callable[[sqlite3.Connection], T], doing: str) -> T:
        """``body`` in one ``BEGIN IMMEDIATE`` transaction of the writer's connection (on the
        worker thread): committed, or rolled back on any exception; a SQLite error is mapped
        to a :class:`StorageError` saying what it was ``doing``."""
        conn = self._connection()
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                out = body(conn)
                conn.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise _map(exc, doing) from exc
        return out

    async def _on_reader(self, read: Callable[[Callable[[], sqlite3.Connection]], T]) -> T:
        """``read(connection)`` on the reader's thread and connection (the writer's for
        ``:memory:``, which has no reader)."""
        reader = self._reader
        if reader is None:
            return await self._run(lambda: read(self._connection))
        try:
            return await asyncio.get_running_loop().run_in_executor(
                reader, lambda: read(self._read_connection)
            )
        except RuntimeError as exc:
            if "shutdown" in str(exc):
                raise StorageUnavailable(f"sqlite storage at {self.path} is closed") from exc
            raise

    async def _run(self, fn: Callable[[], T]) -> T:
        executor = self._executor
        if executor is None:
            raise StorageUnavailable(f"sqlite storage at {self.path} is not open")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(executor, fn)
        except RuntimeError as exc:
            # The executor was shut down under us (close raced with this call).
            if "shutdown" in str(exc):
                raise StorageUnavailable(f"sqlite storage at {self.path} is closed") from exc
            raise

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StorageUnavailable(f"sqlite storage at {self.path} is not open")
        return self._conn

    def _open_sync(self) -> None:
        memory = str(self.path) == ":memory:"
        try:
            if not memory:
                self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageUnavailable(
                f"cannot create the directory for sqlite database {self.path}: {exc}"
            ) from exc
        conn: sqlite3.Connection | None = None
        try:
            # isolation_level=None: we issue BEGIN/COMMIT ourselves. check_same_thread stays on
            # as a guard: the connection is created here, on the worker, and only used here.
            conn = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_S, isolation_level=None)
            mode = str(conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]).lower()
            if mode != "wal" and not memory:
                raise StorageUnavailable(
                    f"sqlite database {self.path} refused WAL mode (journal_mode={mode})"
                )
            # FULL: a flush acknowledged to the node survives a power loss, not only a crash:
            # the node drops its copy of the delta on that acknowledgement.
            conn.execute("PRAGMA synchronous=FULL")
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            if version > SCHEMA_VERSION:
                raise StorageUnavailable(
                    f"sqlite database {self.path} has schema version {version}; "
                    f"this build knows up to {SCHEMA_VERSION}"
                )
            conn.execute(_SCHEMA)
            conn.execute(_EXPIRY_INDEX)
            conn.execute(_CHILDREN_INDEX)
            conn.execute(_OWNERS)
            conn.execute(_OWNER_NOTES)
            conn.execute(_LIMITS)
            conn.execute(_LIMITS_VERSION)
            conn.execute(_BUDGETS)
            conn.execute(_BUDGET_ADMITS)
            conn.execute(_ALERTS)
            conn.execute(_SETTINGS)
            for statement in _LEDGERS:
                conn.execute(statement)
            self._add_timeline(conn)
            conn.execute(_DAYS)
            conn.execute(_DAYS_EXPIRY_INDEX)
            conn.execute(_VALUES)
            self._add_column(conn, "unique_values", "voided", "INTEGER NOT NULL DEFAULT 0")
            conn.execute(_VALUES_EXPIRY_INDEX)
            conn.execute(_PERIOD_MARKS)
            self._add_column(conn, "period_marks", "units", "TEXT")
            if version < SCHEMA_VERSION:
                conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except sqlite3.Error as exc:
            if conn is not None:
                conn.close()
            raise StorageUnavailable(
                f"cannot open sqlite database {self.path}: {_describe(exc)}"
            ) from exc
        except BaseException:
            if conn is not None:
                conn.close()
            raise
        self._conn = conn

    def _open_reader_sync(self) -> None:
        try:
            conn = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_S, isolation_level=None)
            conn.execute("PRAGMA query_only=ON")
        except sqlite3.Error as exc:
            raise _map(exc, f"opening {self.path} for reading") from exc
        self._rconn = conn

    def _close_reader_sync(self) -> None:
        conn, self._rconn = self._rconn, None
        if conn is not None:
            with contextlib.suppress(sqlite3.Error):
                conn.close()

    def _close_sync(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except sqlite3.Error as exc:
                raise _map(exc, f"closing {self.path}") from exc

    def _apply_sync(self, node: str, deltas: list[Delta]) -> dict[Key, Applied | StorageError]:
        conn = self._connection()
        out: dict[Key, Applied | StorageError] = {}
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise _map(exc, f"starting a write transaction on {self.path}") from exc
        try:
            good: list[Delta] = []
            for d in deltas:
                problem = _check_delta(d)
                if problem is not None:
                    out[d.key] = StoragePermanentError(problem)
                else:
                    good.append(d)
            checked = list(good)
            done = self._apply_many(conn, node, good)
            if done is not None:
                out.update(done)
                good = []
            for d in good:
                # A savepoint per key: a key that hits a permanent error is rolled back alone
                # and the rest of the batch still commits.
                conn.execute("SAVEPOINT k")
                try:
                    out[d.key] = self._apply_one(conn, node, d)
                except (sqlite3.IntegrityError, sqlite3.ProgrammingError, ValueError) as exc:
                    conn.execute("ROLLBACK TO k")
                    out[d.key] = (
                        _map(exc, f"applying {d.key}")
                        if isinstance(exc, sqlite3.Error)
                        else StoragePermanentError(f"bad stored item for {d.key}: {exc}")
                    )
                conn.execute("RELEASE k")
            # Day buckets in the same transaction: a counter and its day bucket land together.
            self._apply_days(
                conn, node, [d for d in checked if d.day and isinstance(out[d.key], Applied)]
            )
            conn.execute("COMMIT")
        except BaseException as exc:
            # The whole batch is abandoned: nothing of it is committed.
            try:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            if isinstance(exc, sqlite3.Error):
                raise _map(exc, f"applying a batch to {self.path}") from exc
            raise
        return out

    def _apply_many(
        self, conn: sqlite3.Connection, node: str, deltas: list[Delta]
    ) -> dict[Key, Applied | StorageError] | None:
        """:meth:`_apply_one` of every delta, as a few reads and one ``executemany``: the
        outcome is the same (one write transaction holds the lock: nothing changes between
        the read and the write), at a fraction of the statements (a flush competes with the
        seeding reads for the interpreter). ``None``, with nothing written, when the batch
        names a key twice or a write fails: the caller then takes the keys one at a time."""
        keys = [d.key for d in deltas]
        if not deltas or len(set(keys)) != len(keys):
            return None
        stored: dict[Key, tuple[object, object]] = {}
        for start in range(0, len(deltas), _LOAD_QUERY_KEYS):
            chunk = keys[start : start + _LOAD_QUERY_KEYS]
            args: list[object] = []
            for i, (t, f, p) in enumerate(chunk):
                args += (i, t, p, f)
            for i, total, seqs in conn.execute(_load_query(len(chunk)), args):
                stored[chunk[i]] = (total, seqs)
        out: dict[Key, Applied | StorageError] = {}
        rows: list[tuple[str, str, str, str, str, int]] = []
        for d in deltas:
            row = stored.get(d.key)
            try:
                current = EMPTY if row is None else _snapshot(row[0], row[1])
            except ValueError as exc:
                out[d.key] = StoragePermanentError(f"bad stored item for {d.key}: {exc}")
                continue
            out[d.key], new = self._next_row(current, node, d)
            if new is not None:
                rows.append(new)
        conn.execute("SAVEPOINT m")
        try:
            conn.executemany(_UPSERT, rows)
        except (sqlite3.IntegrityError, sqlite3.ProgrammingError, ValueError):
            conn.execute("ROLLBACK TO m")
            conn.execute("RELEASE m")
            return None
        conn.execute("RELEASE m")
        return out

    def _apply_days(self, conn: sqlite3.Connection, node: str, deltas: list[Delta]) -> None:
        """Add each delta to its day bucket unless its ``(node, seq)`` is in it already."""
        stored: dict[tuple[str, str, str], tuple[object, object]] = {}
        buckets = list({(d.key[0], d.key[1], d.day or "") for d in deltas})
        for start in range(0, len(buckets), _LOAD_QUERY_KEYS):
            chunk = buckets[start : start + _LOAD_QUERY_KEYS]
            args: list[object] = []
            for i, (t, f, day) in enumerate(chunk):
                args += (i, t, day, f)
            for i, total, seqs in conn.execute(_load_days_query(len(chunk)), args):
                stored[chunk[i]] = (total, seqs)
        rows: list[tuple[str, str, str, str, str, int]] = []
        for d in deltas:
            tenant, feature, period = d.key
            assert d.day is not None
            row = stored.get((tenant, feature, d.day))
            try:
                current = EMPTY if row is None else _snapshot(row[0], row[1])
            except ValueError as exc:
                # A damaged bucket must not stop counting: it is rewritten from this delta on.
                log.error("bad day bucket %s/%s@%s rewritten: %s", tenant, feature, d.day, exc)
                current = EMPTY
            if current.seq_of(node) >= d.seq:
                continue
            seqs = dict(current.seqs)
            seqs[node] = d.seq
            seqs_json = json.dumps(seqs, sort_keys=True, separators=(",", ":"))
            total = str(current.total + d.delta)
            rows.append((tenant, feature, d.day, total, seqs_json, self._expires_at(period)))
            stored[(tenant, feature, d.day)] = (total, seqs_json)  # a key named twice
        if rows:
            conn.executemany(_DAYS_UPSERT, rows)

    def _apply_one(self, conn: sqlite3.Connection, node: str, d: Delta) -> Applied:
        tenant, feature, period = d.key
        row = conn.execute(
            "SELECT total, seqs FROM counters WHERE tenant = ? AND period = ? AND feature = ?",
            (tenant, period, feature),
        ).fetchone()
        current = EMPTY if row is None else _snapshot(row[0], row[1])
        applied, new = self._next_row(current, node, d)
        if new is not None:
            conn.execute(_UPSERT, new)
        return applied

    def _next_row(
        self, current: Snapshot, node: str, d: Delta
    ) -> tuple[Applied, tuple[str, str, str, str, str, int] | None]:
        """The answer for ``d`` on top of the stored ``current``, and the row to write
        (``None``: a duplicate, nothing to write)."""
        if current.seq_of(node) >= d.seq:
            return Applied(current, duplicate=True), None
        seqs = dict(current.seqs)
        seqs[node] = d.seq
        snap = Snapshot(current.total + d.delta, seqs)
        tenant, feature, period = d.key
        seqs_json = json.dumps(seqs, sort_keys=True, separators=(",", ":"))
        new = (tenant, period, feature, str(snap.total), seqs_json, self._expires_at(period))
        return Applied(snap), new

    def _set_owner_sync(
        self,
        node: str,
        token: str,
        now: float,
        lease_s: float,
        may: Callable[[tuple[str, int] | None], bool],
        note: str | None = None,
    ) -> Owner | None:
        """Set ``node``'s owner to ``token`` (lease to ``now + lease_s``, and its ``note`` if
        given) if ``may(held)``, in one write transaction; return the owner after it."""
        conn = self._connection()
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                row = conn.execute(
                    "SELECT token, expires_ms FROM owners WHERE node = ?", (node,)
                ).fetchone()
                held = None if row is None else (str(row[0]), int(row[1]))
                if may(held):
                    held = (token, lease_end_ms(now, lease_s))
                    conn.execute(
                        "INSERT INTO owners (node, token, expires_ms) VALUES (?, ?, ?)"
                        " ON CONFLICT (node) DO UPDATE SET"
                        " token = excluded.token, expires_ms = excluded.expires_ms",
                        (node, *held),
                    )
                    if note is not None:
                        conn.execute(
                            "INSERT INTO owner_notes (node, note) VALUES (?, ?)"
                            " ON CONFLICT (node) DO UPDATE SET note = excluded.note",
                            (node, note),
                        )
                owner = _read_owner(conn, node)
                conn.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise _map(exc, f"claiming node id {node!r} in {self.path}") from exc
        return owner

    def _expires_at(self, period: str) -> int:
        # From the later of the period's end and now: a late write to an old period must not
        # be purged at once (its units would vanish under a warm row).
        return max(_period_end(period), int(time.time())) + self.retention_days * 86400

    async def purge_expired(self, now: float | None = None) -> int:
        """Delete counters whose ``expires_at`` has passed, a bounded batch at a time (and
        day buckets and unique values likewise)."""
        cutoff = int(time.time() if now is None else now)
        total = 0
        while True:
            n = await self._run(lambda: self._purge_sync(cutoff, 10_000))
            total += n
            if n < 10_000:
                return total

    def _purge_sync(self, cutoff: int, limit: int) -> int:
        conn = self._connection()
        try:
            with conn:
                cur = conn.execute(
                    "DELETE FROM counters WHERE (tenant, period, feature) IN ("
                    " SELECT tenant, period, feature FROM counters WHERE expires_at < ? LIMIT ?)",
                    (cutoff, limit),
                )
                n = cur.rowcount
                # Day buckets expire with their month counters.
                days = conn.execute(
                    "DELETE FROM days WHERE (tenant, feature, day) IN ("
                    " SELECT tenant, feature, day FROM days WHERE expires_at < ? LIMIT ?)",
                    (cutoff, limit),
                )
                # Unique values too (they may far outnumber the counters: a batch each).
                values = conn.execute(
                    "DELETE FROM unique_values WHERE (tenant, feature, period, value) IN ("
                    " SELECT tenant, feature, period, value FROM unique_values"
                    " WHERE expires_at < ? LIMIT ?)",
                    (cutoff, limit),
                )
                if n < limit:  # (the last batch) budgets and claimed alerts past their retention
                    conn.execute("DELETE FROM budgets WHERE expires_at < ?", (cutoff,))
                    conn.execute(
                        "DELETE FROM budget_admits WHERE (tenant, feature, period) NOT IN"
                        " (SELECT tenant, feature, period FROM budgets)"
                    )
                    conn.execute("DELETE FROM alerts WHERE expires_at < ?", (cutoff,))
                    self._purge_marks(conn, cutoff)
                return max(n, days.rowcount, values.rowcount)
        except sqlite3.Error as exc:
            raise _map(exc, f"purging expired counters in {self.path}") from exc

    def _purge_marks(self, conn: sqlite3.Connection, cutoff: int) -> None:
        """Delete the marks of each period past its end plus the retention that has no
        counter left (a mark is kept as long as its period's counters are)."""
        periods = [p for (p,) in conn.execute("SELECT DISTINCT period FROM period_marks")]
        for period in periods:
            try:
                over = _period_end(str(period)) + self.retention_days * 86400 < cutoff
            except ValueError:  # (a row this module did not write: left alone)
                continue
            if not over:
                continue
            left = conn.execute("SELECT 1 FROM counters WHERE period = ? LIMIT 1", (period,))
            if left.fetchone() is None:
                conn.execute("DELETE FROM period_marks WHERE period = ?", (period,))

    def _read_connection(self) -> sqlite3.Connection:
        if self._rconn is None:
            raise StorageUnavailable(f"sqlite storage at {self.path} is not open")
        return self._rconn

    def _load_sync(
        self, keys: list[Key], connection: Callable[[], sqlite3.Connection]
    ) -> dict[Key, Snapshot]:
        conn = connection()
        out: dict[Key, Snapshot] = {}
        bad: dict[Key, str] = {}
        try:
            if conn.in_transaction:  # left open by a read whose ROLLBACK failed
                conn.execute("ROLLBACK")
            # One read transaction: every key is read from the same committed state.
            conn.execute("BEGIN")
            try:
                for start in range(0, len(keys), _LOAD_QUERY_KEYS):
                    chunk = keys[start : start + _LOAD_QUERY_KEYS]
                    args: list[object] = []
                    for i, (t, f, p) in enumerate(chunk):
                        args += (i, t, p, f)
                    for key in chunk:
                        out[key] = EMPTY
                    for i, total, seqs in conn.execute(_load_query(len(chunk)), args):
                        key = chunk[i]
                        try:
                            out[key] = _snapshot(total, seqs)
                        except ValueError as exc:  # this item only: the others are still read
                            del out[key]
                            bad[key] = f"bad stored item in {self.path}: {exc}"
            except BaseException:
                # The read's own error is the one reported: an error that ended the
                # transaction (out of memory, I/O) would make a COMMIT fail in its place.
                if conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):  # (the next read rolls it back)
                        conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            raise _map(exc, f"reading from {self.path}") from exc
        if bad:
            raise BadItems(out, bad)
        return out

    async def children_page(
        self, parent: str, feature: str, period: str, after: str | None, limit: int
    ) -> tuple[list[tuple[str, int]], bool]:
        """One range of the ``counters_children`` index, on the reader's connection; deeper
        levels in the range are passed over by the query."""
        check_children(parent, feature, period, after, limit)
        # ('0' follows '/': every tenant below parent sorts before parent + '0'.)
        args = (period, feature, after or parent + "/", parent + "0", len(parent) + 2, limit + 1)

        def read(connection: Callable[[], sqlite3.Connection]) -> list[tuple[str, int]]:
            try:
                rows = connection().execute(_CHILDREN_QUERY, args).fetchall()
                return [(tenant, int(total)) for tenant, total in rows]
            except sqlite3.Error as exc:
                raise _map(exc, f"listing the children of {parent[:80]} in {self.path}") from exc
            except ValueError as exc:
                raise StoragePermanentError(f"bad stored item in {self.path}: {exc}") from exc

        rows = await self._on_reader(read)
        return rows[:limit], len(rows) > limit

    def _list_sync(
        self, tenant: str, period: str, between: tuple[str, str] | None = None
    ) -> dict[str, Snapshot]:
        conn = self._connection()
        sql = "SELECT feature, total, seqs FROM counters WHERE tenant = ? AND period = ?"
        args: tuple[str, ...] = (tenant, period)
        if between is not None:
            sql += " AND feature BETWEEN ? AND ?"
            args += between
        try:
            rows = conn.execute(sql, args).fetchall()
            return {feature: _snapshot(total, seqs) for feature, total, seqs in rows}
        except sqlite3.Error as exc:
            raise _map(exc, f"listing {tenant}/{period} in {self.path}") from exc
        except ValueError as exc:
            raise StoragePermanentError(f"bad stored item in {self.path}: {exc}") from exc


def _check_delta(d: Delta) -> str | None:
    """Why ``d`` can never be applied, or ``None`` if it is well-formed."""
    key = d.key
    if not (isinstance(key, tuple) and len(key) == 3 and all(isinstance(p, str) for p in key)):
        return f"key must be (tenant, feature, period) strings, got {key!r}"
    if not key[0] or not key[1]:
        return f"tenant and feature must not be empty: {key!r}"
    if isinstance(d.seq, bool) or not isinstance(d.seq, int) or d.seq < 1:
        return f"seq must be a positive integer, got {d.seq!r} for {key!r}"
    if isinstance(d.delta, bool) or not isinstance(d.delta, int):
        return f"delta must be an integer, got {d.delta!r} for {key!r}"
    try:
        _period_end(key[2])
    except ValueError as exc:
        return f"{key!r}: {exc}"
    if d.day is not None:
        try:
            check_day_of(d.day, key[2])
        except StoragePermanentError as exc:
            return f"{key!r}: {exc}"
    return None


def _period_end(period: str) -> int:
    """The first instant after ``period`` (:mod:`storage.periods`), epoch seconds (cached
    there: every key a flush writes asks); :class:`ValueError` for a bad period."""
    return int(periods.bounds(period)[1])


def _total(total: object, tenant: str, feature: str, period: str) -> int:
    """A stored total as an exact int; a row this module did not write fails its export."""
    try:
        if type(total) is not str:
            raise ValueError(f"a {type(total).__name__}, not decimal text")
        return int(total)
    except ValueError as exc:
        raise StoragePermanentError(
            f"bad stored total for ({tenant[:80]!r}, {feature[:80]!r}, {period}): {exc}"
        ) from None


def _snapshot(total: object, seqs: object) -> Snapshot:
    """Decode a stored row; raises ``ValueError`` if it is not what this module writes."""
    if type(total) is not str or type(seqs) is not str:
        raise ValueError(f"unexpected column types {type(total).__name__}/{type(seqs).__name__}")
    decoded = _decode_json(seqs)
    if type(decoded) is not dict:
        raise ValueError(f"seqs column is not an object of node -> int: {seqs[:100]!r}")
    for n, s in decoded.items():
        # ``type(s) is int`` refuses booleans too. A loop, not all(): seeding decodes every
        # row it reads, and this is most of its cost.
        if type(n) is not str or type(s) is not int:
            raise ValueError(f"seqs column is not an object of node -> int: {seqs[:100]!r}")
    return Snapshot(int(total), decoded)


#: json.loads without its per-call argument handling (this module only reads its own rows).
_decode_json = json.JSONDecoder().decode


def _describe(exc: sqlite3.Error) -> str:
    name = getattr(exc, "sqlite_errorname", None)
    return f"{exc} ({name})" if name else str(exc)


def _map(exc: sqlite3.Error, doing: str) -> StorageError:
    """Map a ``sqlite3`` exception to the storage hierarchy.

    Integrity and programming errors are bugs in the request: retrying cannot help. Everything
    else (busy, locked, disk I/O, a corrupt or vanished file) may pass, or be fixed by an
    operator, so the caller keeps its deltas and retries.
    """
    message = f"sqlite error while {doing}: {_describe(exc)}"
    if isinstance(
        exc,
        sqlite3.IntegrityError
        | sqlite3.ProgrammingError
        | sqlite3.InterfaceError
        | sqlite3.DataError
        | sqlite3.NotSupportedError,
    ):
        return StoragePermanentError(message)
    return StorageUnavailable(message)


def _read_owner(conn: sqlite3.Connection, node: str) -> Owner | None:
    row = conn.execute(
        "SELECT o.token, o.expires_ms, n.note FROM owners o"
        " LEFT JOIN owner_notes n ON n.node = o.node WHERE o.node = ?",
        (node,),
    ).fetchone()
    return None if row is None else Owner(str(row[0]), int(row[1]) / 1000, str(row[2] or ""))


def _mark(row: Sequence[object], path: Path) -> PeriodMark:
    """A stored ``period_marks`` row (node, state, at, by, units) as a mark."""
    node, state, at, by, units = row
    if (
        type(node) is not str
        or state not in MARK_STATES
        or type(at) is not float
        or type(by) is not str
    ):
        raise StoragePermanentError(f"bad stored period mark {str(node)[:64]!r} in {path}")
    assert isinstance(state, str)
    return PeriodMark(node, state, at, by, mark_units_from_text(units))


def _budget_item(conn: sqlite3.Connection, key: Key) -> BudgetItem:
    """A budget record and the units admitted onto it, read on ``conn`` in one statement (one
    snapshot: another process's write cannot fall between the body and its tallies)."""
    rows = conn.execute(
        "SELECT b.version, b.body, a.name, a.units, a.op FROM budgets b"
        " LEFT JOIN budget_admits a"
        " ON a.tenant = b.tenant AND a.feature = b.feature AND a.period = b.period"
        " WHERE b.tenant = ? AND b.feature = ? AND b.period = ? ORDER BY a.name",
        key,
    ).fetchall()
    if not rows:
        return BudgetItem(0, None)
    admitted = tuple((str(n), int(u), str(op)) for _, _, n, u, op in rows if n is not None)
    return BudgetItem(int(rows[0][0]), str(rows[0][1]), admitted)
