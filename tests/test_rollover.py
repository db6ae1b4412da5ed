"""Period roll-over: the next period's keys are read ahead before a period ends (ADR 0005), so
the first calls of a new period find their keys seeded, and nothing is lost or doubled across
the boundary. Real node processes whose clocks are moved to just before a month ends."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from bench.clockshift import next_month_start, shift_to
from meter.core.keys import Key, period_start
from meter.core.periods import kinds_in_use, next_keys
from meter.core.service import Service
from meter.core.table import CounterTable
from meter.node.wiring import build_service
from storage.base import Snapshot
from storage.dynamodb import DynamoDBStorage
from storage.memory import MemoryStorage
from storage.periods import bounds, name
from storage.sqlite import SQLiteStorage
from tests.support.cluster_harness import Conn, Fleet, wait_until
from tests.support.nodes import NodeProcess, short_tmpdir, wait_for


def ts(year: int, month: int, day: int, hour: int = 0, minute: int = 0, sec: int = 0) -> float:
    return datetime(year, month, day, hour, minute, sec, tzinfo=UTC).timestamp()


# -- the pure part --------------------------------------------------------------------------


def _end(kind: Any, at: float) -> float:
    return bounds(name(None, kind, at))[1]


def test_period_end_is_the_next_period_start() -> None:
    assert _end("month", ts(2026, 11, 30, 23, 59, 59)) == ts(2026, 12, 1)
    assert _end("month", ts(2026, 12, 1)) == ts(2027, 1, 1)
    assert _end("month", ts(2026, 12, 31, 23, 59, 59)) == ts(2027, 1, 1)
    assert _end("month", ts(2028, 2, 10)) == ts(2028, 3, 1)
    assert _end("day", ts(2026, 11, 30, 12)) == ts(2026, 12, 1)
    assert _end("day", ts(2026, 12, 31)) == ts(2027, 1, 1)
    assert _end("day", ts(2027, 1, 1, 0, 0, 1)) == ts(2027, 1, 2)
    for kind in ("month", "day"):
        now = ts(2026, 11, 30, 23, 59, 59)
        end = _end(kind, now)
        assert period_start(kind, end) != period_start(kind, end - 0.001)


def test_next_keys_maps_current_keys_of_one_kind_only() -> None:
    periods: dict[str, Any] = {"api": "day"}
    keys: list[Key] = [
        ("acme", "seats", "2026-11"),  # month, current: read ahead
        ("acme", "api", "2026-11-30"),  # day, current: only for "day"
        ("acme", "seats", "2026-10"),  # an old period (named with ``at``): skipped
        ("acme", "api", "2026-11-29"),  # an old day: skipped
        ("acme", "seats", "2026-11-30"),  # a month feature under a day period: skipped
    ]
    assert next_keys(keys, "month", "2026-11", "2026-12", periods) == [("acme", "seats", "2026-12")]
    assert next_keys(keys, "day", "2026-11-30", "2026-12-01", periods) == [
        ("acme", "api", "2026-12-01")
    ]
    assert kinds_in_use({}) == ["month"] and kinds_in_use(periods) == ["month", "day"]


async def test_read_ahead_seeds_the_next_periods_keys_in_batches() -> None:
    class Counting(MemoryStorage):
        loads = 0

        async def load(self, keys: Any) -> dict[Key, Snapshot]:
            self.loads += 1
            return await super().load(keys)

    store = Counting()
    table = CounterTable("n1")
    svc = build_service(table, store)
    now = time.time()
    month = period_start("month", now)
    upcoming = period_start("month", _end("month", now))
    for i in range(250):
        table.seed((f"t{i}", "api", month), Snapshot(0))
    before = store.loads
    assert svc.read_ahead("month", now, table.keys()) == 250
    assert svc.read_ahead("month", now, table.keys()) == 0, "queued keys are not queued twice"
    await asyncio.wait_for(_idle(svc), 5)
    assert all(table.is_seeded((f"t{i}", "api", upcoming)) for i in range(250))
    assert store.loads - before == 3, "250 keys in batches of 100"
    assert svc.seeder.stats.prefetched == 250 and svc.seeder.stats.on_demand == 0


async def _idle(svc: Service) -> None:
    while svc.seeder.busy():
        await asyncio.sleep(0.001)


# -- real processes -------------------------------------------------------------------------

#: Seconds between starting the nodes and the month's end on their clocks, and how long before
#: it the read-ahead runs. Wide: node start and the first tracks must come before the read-ahead.
TO_BOUNDARY = 14.0
LEAD = 7.0


def _items(n: int, qty: int = 1) -> list[list[Any]]:
    return [[f"t{i % 50}", f"f{i // 50}", qty] for i in range(n)]


def _wait_node_clock(shift: float, instant: float, nodes: list[NodeProcess]) -> None:
    wait_until(lambda: time.time() + shift >= instant, 60, "the nodes' clocks pass", nodes)


def test_a_new_month_finds_its_keys_read_ahead_sqlite(workdir: Path) -> None:
    boundary = next_month_start()
    shift = shift_to(boundary, TO_BOUNDARY)
    node = NodeProcess(workdir, "n0", METER_ROLLOVER_READ_AHEAD_S=str(LEAD))
    node.clock_shift = shift
    node.start()
    try:
        keys = 300
        conn = Conn(node.socket)
        assert conn.ok("track_many", _items(keys)) == [1] * keys
        assert time.time() + shift < boundary.timestamp() - LEAD, "started too late to test"
        wait_for(
            lambda: node.call("status")["seeding"]["prefetched"] >= keys,
            TO_BOUNDARY + 10,
            "the next month's keys read ahead",
        )
        seeding = node.call("status")["seeding"]
        assert seeding["prefetched"] == keys
        on_demand = seeding["on_demand"]
        _wait_node_clock(shift, boundary.timestamp(), [node])
        # The first calls of the new month: counted from 0, no read.
        assert conn.ok("track_many", _items(keys, 2)) == [2] * keys
        assert conn.ok("usage", "t0", "f0") == 2
        assert node.call("status")["seeding"]["on_demand"] == on_demand
        conn.close()
        assert node.stop() == 0, node.log()
    finally:
        if node.proc is not None and node.proc.poll() is None:
            node.kill()

    b = boundary.timestamp()

    async def stored() -> tuple[int, int]:
        store = SQLiteStorage(node.data_dir / "counters.sqlite3")
        await store.open()
        try:
            old = await store.list_period("t0", period_start("month", b - 1))
            new = await store.list_period("t0", period_start("month", b))
            return old["f0"].total, new["f0"].total
        finally:
            await store.close()

    assert asyncio.run(stored()) == (1, 2)


@pytest.mark.slow
@pytest.mark.dynamodb
@pytest.mark.redis
def test_a_month_rolls_over_under_load_on_two_nodes(
    fleet: Fleet, dynamodb_local: str, dynamodb_table: str
) -> None:
    """Two nodes on DynamoDB Local and Redis, clients tracking through the month's end: no
    call of the new month waits for a read, every acknowledged unit is stored once (in one
    period or the other), and both nodes' views of the new month equal the store."""
    boundary = next_month_start()
    shift = shift_to(boundary, TO_BOUNDARY + 16)  # a cluster takes longer to start
    nodes = fleet(2, clock_shift=shift, METER_ROLLOVER_READ_AHEAD_S=str(LEAD))
    try:
        acked: Counter[tuple[str, str]] = Counter()
        lock = threading.Lock()
        stop = threading.Event()
        errors: list[str] = []

        def client(node: NodeProcess, seed: int) -> None:
            conn = Conn(node.socket)
            try:
                n = 0
                while not stop.is_set():
                    if n == 0:  # the first call touches every key: all are active
                        items = [(f"t{i % 20}", f"f{i // 20}", 1) for i in range(400)]
                    else:
                        items = [
                            (f"t{(seed + n + i) % 20}", f"f{(n + i) // 20 % 20}", 1)
                            for i in range(50)
                        ]
                    n += 7
                    try:
                        err, result = conn.call("track_many", [list(x) for x in items])
                    except OSError as exc:  # a node gone: the test fails on its own terms
                        errors.append(repr(exc))
                        return
                    if err is not None:
                        errors.append(str(err))
                        continue
                    with lock:
                        for (t, f, q), r in zip(items, result, strict=True):
                            if not isinstance(r, dict):
                                acked[(t, f)] += q
            finally:
                conn.close()

        threads = [
            threading.Thread(target=client, args=(p, s), daemon=True)
            for p in nodes
            for s in (0, 11)
        ]
        for t in threads:
            t.start()
        wait_until(lambda: sum(acked.values()) >= 4 * 400, 30, "every client's first call", nodes)
        late = time.time() + shift - (boundary.timestamp() - LEAD / 4)
        assert late < 0, f"the nodes and first calls took {late:.1f} s too long to test this"
        _wait_node_clock(shift, boundary.timestamp() - 1.0, nodes)
        before = [p.call("status")["seeding"] for p in nodes]
        assert [s["on_demand"] for s in before] == [400, 400], before
        _wait_node_clock(shift, boundary.timestamp() + 3.0, nodes)
        stop.set()
        for t in threads:
            t.join(30)
        assert not errors, errors[:5]
        after = [p.call("status")["seeding"] for p in nodes]
        # Every key of the new month was read ahead (the reads may land after the boundary on
        # a slow machine: a call then waits for its key's read ahead), none on demand.
        assert [s["on_demand"] for s in after] == [400, 400], after
        assert [s["prefetched"] for s in after] == [400, 400], after
        old_period = period_start("month", boundary.timestamp() - 1)
        new_period = period_start("month", boundary.timestamp())
        wait_until(
            lambda: all(
                not st["flush"]["backlog_keys"] and not st["keys"]["dirty"]
                for st in (p.call("status") for p in nodes)
            ),
            30,
            "both nodes flushed",
            nodes,
        )
        stored_old, stored_new = asyncio.run(
            _stored(dynamodb_local, dynamodb_table, acked, old_period, new_period)
        )
        assert sum(stored_new.values()) > 0, "the load ran into the new month"
        for tf, units in acked.items():
            assert stored_old.get(tf, 0) + stored_new.get(tf, 0) == units, tf

        def views_exact() -> bool:
            return all(
                Conn(p.socket).ok("usage", t, f) == stored_new.get((t, f), 0)
                for p in nodes
                for (t, f) in list(acked)[:40]
            )

        wait_until(views_exact, 10, "both nodes' views of the new month equal the store", nodes)
        for p in nodes:
            assert p.stop() == 0, p.log()
    finally:
        for p in nodes:
            if p.proc is not None and p.proc.poll() is None:
                p.kill()


async def _stored(
    endpoint: str,
    table: str,
    acked: Counter[tuple[str, str]],
    old: str,
    new: str,
) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]]:
    store = DynamoDBStorage(table, endpoint_url=endpoint)
    await store.open()
    try:
        wanted = [(t, f, p) for (t, f) in acked for p in (old, new)]
        snaps = await store.load(wanted)
        out_old = {(t, f): s.total for (t, f, p), s in snaps.items() if p == old}
        out_new = {(t, f): s.total for (t, f, p), s in snaps.items() if p == new}
        return out_old, out_new
    finally:
        await store.close()


@contextlib.contextmanager
def short_tmpdir_path() -> Iterator[Path]:
    path = short_tmpdir("ra-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _node_config(tmp: Path, lead: float) -> Any:
    from meter.config import CounterConfig, FlushConfig, NodeConfig, ServerConfig

    return NodeConfig(
        data_dir=tmp / "data",
        server=ServerConfig(socket=tmp / "n.sock"),
        flush=FlushConfig(interval_ms=3_600_000),
        counters=CounterConfig(rollover_read_ahead_s=lead),
    )


async def _until(cond: Any, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting until {what}")
        await asyncio.sleep(0.01)


async def test_a_read_ahead_lead_under_a_second_is_not_slept_through() -> None:
    """L02: the loop waits until the next pass's moment (at most a second), so a lead shorter
    than a second still reads ahead before the period ends. The wall clock is simulated:
    each step is made at the instant the previous one said to look again."""
    from meter.node.lifecycle import Node

    lead = 0.8
    with short_tmpdir_path() as tmp:
        async with Node(_node_config(tmp, lead), storage=MemoryStorage()) as node:
            assert node.service is not None and node.table is not None
            assert node.read_ahead is not None
            node.table.seed(("acme", "api", period_start("month")), Snapshot(0, {}))
            seeder = node.service.seeder
            end = _end("month", time.time())
            now = end - lead - 0.1  # the loop looks a tenth of a second before the first pass
            done: dict[tuple[str, float], int] = {}
            steps = 0
            while now < end:
                now += await node.read_ahead.step(now, lead, done)
                steps += 1
                assert steps < 1000
            assert done.get(("month", end), 0) >= 1, f"no pass before the period end: {done}"
            await _until(lambda: seeder.stats.prefetched >= 1, "the next month's key is read")


async def test_an_error_in_a_read_ahead_pass_does_not_end_the_loop() -> None:
    """A bug in one read-ahead pass is logged and the loop goes on (it used to end the loop
    silently, and Node.stop() raised it before draining)."""
    from meter.node.lifecycle import Node

    with short_tmpdir_path() as tmp:
        async with Node(_node_config(tmp, 60.0), storage=MemoryStorage()) as node:
            calls = 0

            async def failing_then_waiting(
                now: float, lead: float, done: dict[tuple[str, float], int]
            ) -> float:
                nonlocal calls
                calls += 1
                if calls == 1:
                    raise RuntimeError("a bug in a read-ahead pass")
                return 3600.0

            assert node.read_ahead is not None
            node.read_ahead.step = failing_then_waiting  # type: ignore[method-assign]
            task = asyncio.create_task(node.read_ahead.run())
            try:
                await _until(lambda: calls >= 2, "the loop looks again after the error")
                assert not task.done()
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
