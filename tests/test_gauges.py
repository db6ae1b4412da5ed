"""Gauges in one process (docs/dimensions.md, "Gauges"): ``max`` and ``latest`` features,
their observations, limits, request ids, the log, the gauge flusher and a second node reading
what it stored. Real nodes: tests/test_gauges_cluster.py."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meter.config import CounterConfig
from meter.core.gauges import GaugeTable, Reading, wins
from meter.core.idempotency import RequestIds
from meter.core.keys import period_start
from meter.core.service import Service
from meter.core.table import CounterTable
from meter.errors import Conflict, InvalidArgument, LimitExceeded
from meter.node.wiring import build_service
from meter.persist.gauges import GaugeFlusher
from meter.persist.recovery import recover
from meter.quotas.alerts import Alerts
from meter.quotas.store import LimitStore
from meter.wal.log import WriteAheadLog
from storage.base import Delta
from storage.memory import MemoryStorage
from tests.support.nodes import BACKFILL_GRACE_S, short_tmpdir
from tests.support.services import logged_service
from tests.test_dimensions import call, error
from tests.test_wal_service import broken, disk_full, settle

MONTH = period_start("month")


def service(store: MemoryStorage | None = None, node: str = "n1", **config: Any) -> Service:
    config.setdefault("period_grace_s", BACKFILL_GRACE_S)
    return build_service(CounterTable(node), store or MemoryStorage(), CounterConfig(**config))


async def gauges(svc: Service) -> Service:
    await call(svc, "set_feature", "storage_gb", {"aggregation": "max"})
    await call(svc, "set_feature", "plan_seats", {"aggregation": "latest"})
    return svc


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["max", "latest"]),
    st.lists(
        st.tuples(st.integers(-5, 5), st.integers(0, 3), st.sampled_from(["a", "b"])),
        max_size=8,
    ),
    st.randoms(),
)
def test_readings_merge_to_one_reading_whatever_the_order(
    kind: str, readings: list[Reading], rnd: Any
) -> None:
    """The merge is a join: any order (and any repeats) of the same readings gives the same
    reading, the one that wins over every other."""
    a, b = GaugeTable("a"), GaugeTable("b")
    key = ("t", "g", MONTH)
    a.seed(key, kind, None)
    b.seed(key, kind, None)
    shuffled = readings * 2
    rnd.shuffle(shuffled)
    for r in readings:
        a.merge(key, r)
    for r in shuffled:
        b.merge(key, r)
    assert a.reading(key) == b.reading(key)
    best = a.reading(key)
    assert best is None or not any(wins(kind, r, best) for r in readings)


_ops = st.lists(
    st.tuples(
        st.sampled_from(["observe", "gossip", "lose", "flush", "checkpoint", "crash", "resync"]),
        st.integers(0, 2),  # the node
        st.integers(-3, 9),  # the value
        st.integers(0, 4),  # the instant
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["max", "latest"]), _ops)
def test_nodes_gossip_flush_crash_and_end_with_the_winner(
    kind: str, ops: list[tuple[str, int, int, int]]
) -> None:
    """Three nodes' gauge tables under any interleaving of observations (on the node's
    clock or not), gossip (delivered or lost), flushes, checkpoints of the log (it keeps only
    what the table says is unstored), crashes (memory lost, the log's readings restored) and
    resyncs: no node's view ever drops below one of its own observations, and once every
    node has flushed and re-read storage, storage and every view hold the reading that wins
    over every observation made."""
    store = MemoryStorage()
    key = ("t", "g", MONTH)
    nodes = [f"n{i}" for i in range(3)]
    tables = [GaugeTable(n) for n in nodes]
    observed: list[list[Reading]] = [[] for _ in nodes]  # (every observation, each node)
    logged: list[list[Reading]] = [[] for _ in nodes]  # (what each node's log holds)

    def flush(i: int) -> None:
        dirty = tables[i].dirty()
        for k, got in asyncio.run(store.put_gauges(dirty)).items():
            assert not isinstance(got, Exception)
            tables[i].stored(k, got)

    def resync(i: int) -> None:
        tables[i].seed(key, kind, asyncio.run(store.load_gauges([key]))[key])

    for i in range(3):
        resync(i)
    for op, i, value, at in ops:
        t = tables[i]
        if op == "observe":
            if not t.is_seeded(key):
                resync(i)
            reading = t.observe(key, kind, value, at, now=value % 2 == 0)[2]
            observed[i].append(reading)
            logged[i].append(reading)
        elif op in ("gossip", "lose"):
            items = t.take_readings()
            if op == "gossip":
                for j in range(3):
                    if j != i:
                        tables[j].merge_readings(items)
        elif op == "flush":
            flush(i)
        elif op == "checkpoint":
            logged[i] = [reading for _, _, reading in t.dirty()]
        elif op == "crash":
            tables[i] = GaugeTable(nodes[i])
            tables[i].restore((key, kind, r) for r in logged[i])
        else:
            resync(i)
        for j in range(3):
            held = tables[j].reading(key) if tables[j].is_seeded(key) else None
            if held is not None:
                assert not any(wins(kind, r, held) for r in observed[j]), (j, held)
    for i in range(3):
        flush(i)
    every = [r for rs in observed for r in rs]
    best = None
    for r in every:
        if wins(kind, r, best):
            best = r
    assert asyncio.run(store.load_gauges([key]))[key] == best
    for i in range(3):
        resync(i)
        assert tables[i].reading(key) == best
        assert tables[i].dirty() == []


def test_observations_on_the_node_clock_keep_their_order_within_a_millisecond() -> None:
    table = GaugeTable("n1")
    key = ("t", "seats", MONTH)
    table.seed(key, "latest", None)
    assert table.observe(key, "latest", 30, 1000, now=True)[2] == (30, 1000, "n1")
    assert table.observe(key, "latest", 4, 1000, now=True)[2] == (4, 1001, "n1")
    assert table.observe(key, "latest", 9, 999, now=True)[2] == (9, 1002, "n1")  # (clock back)
    assert table.value(key) == 9
    # A time the caller gives is taken as given: an older one does not win, and a later one
    # moves no observation made on the node's clock.
    assert table.observe(key, "latest", 5, 1001)[0] == 9
    assert table.observe(key, "latest", 6, 90_000)[2] == (6, 90_000, "n1")
    assert table.observe(key, "latest", 7, 1003, now=True)[2] == (7, 1003, "n1")
    assert table.value(key) == 6
    # At most a second ahead of the clock: of 2,000 calls in one millisecond, those past the
    # 1,000th take their own time.
    times = [table.observe(key, "latest", 1, 5000, now=True)[2][1] for _ in range(2000)]
    assert times[:1000] == list(range(5000, 6000)) and set(times[1000:]) == {5000}


def test_a_restart_keeps_the_clock_order_past_the_readings_it_restores() -> None:
    table = GaugeTable("n1")
    key = ("t", "seats", MONTH)
    table.restore([(key, "latest", (4, 5500, "n1"))])
    table.seed(key, "latest", None)
    assert table.observe(key, "latest", 9, 5000, now=True)[2] == (9, 5501, "n1")
    assert table.value(key) == 9


def test_an_unstored_observation_is_written_when_a_peers_reading_beats_it() -> None:
    """The peer may never store its own (durability off, its data lost): this node's
    observation is written, restated by checkpoints and kept from eviction until storage
    holds it (or one that wins over it)."""
    table = GaugeTable("n1")
    key = ("t", "g", MONTH)
    table.seed(key, "max", None)
    table.observe(key, "max", 5, 10)
    assert table.merge(key, (9, 11, "n2"))
    assert table.value(key) == 9
    assert table.dirty() == [(key, "max", (5, 10, "n1"))]
    for _ in range(3):
        table.evict_idle()
    assert table.is_seeded(key)
    table.stored(key, (5, 10, "n1"))
    assert table.dirty() == [] and table.value(key) == 9
    table.take_touched()
    for _ in range(2):
        table.evict_idle()
    assert not table.is_seeded(key)  # (stored, sent: evicted)


def test_without_gossip_nothing_is_kept_to_send_and_idle_gauges_are_evicted() -> None:
    table = GaugeTable("n1", gossip=False)
    key = ("t", "g", MONTH)
    table.seed(key, "max", None)
    table.observe(key, "max", 5, 10)
    table.stored(key, (5, 10, "n1"))
    assert table.take_touched() == []
    table.evict_idle()
    assert table.evict_idle() == 1


def test_an_undone_observation_leaves_the_gauge_to_be_read_again() -> None:
    """A peer's reading merged under an observation that is then taken back would be lost
    with it: the row is read again before its next use."""
    table = GaugeTable("n1")
    key = ("t", "g", MONTH)
    table.seed(key, "max", (3, 1, "n2"))
    after, before, observed, before_mine = table.observe(key, "max", 9, 5)
    assert (after, before, observed, before_mine) == (9, (3, 1, "n2"), (9, 5, "n1"), None)
    assert not table.merge(key, (7, 6, "n2"))  # (below 9: no move, and 7 is not kept)
    assert table.undo(key, before, observed, before_mine)
    assert table.dirty() == []
    assert table.value(key) is None and not table.is_seeded(key)
    table.seed(key, "max", (7, 6, "n2"))  # (storage holds the peer's by then)
    assert table.value(key) == 7


async def test_a_max_keeps_the_peak_and_a_latest_the_last_observation() -> None:
    svc = await gauges(service())
    assert await call(svc, "track", "acme", "storage_gb", 40) == 40
    assert await call(svc, "track", "acme", "storage_gb", 25) == 40  # (the peak stays)
    assert await call(svc, "track", "acme", "storage_gb", 70) == 70
    assert await call(svc, "usage", "acme", "storage_gb") == 70
    now = 1_800_000_000.0
    later = {"at": now + 10}
    assert await call(svc, "track", "acme", "plan_seats", 5, later) == 5
    # An observation made earlier (by its time) does not replace a later one.
    assert await call(svc, "track", "acme", "plan_seats", 9, {"at": now}) == 5
    assert await call(svc, "track", "acme", "plan_seats", 3, {"at": now + 20}) == 3
    assert await call(svc, "usage", "acme", "plan_seats", {"at": now}) == 3
    assert await call(svc, "usage", "acme", "never", {}) == 0
    got = await call(svc, "usage_all", "acme")
    assert got["storage_gb"] == 70


async def test_gauge_items_of_a_batch_are_observed_in_order() -> None:
    svc = await gauges(service())
    answers = await call(
        svc,
        "track_many",
        [
            ["acme", "storage_gb", 10],
            ["acme", "api", 3],
            ["acme", "storage_gb", 7],
            ["acme", "storage_gb", 12, {"id": "r1"}],
            ["acme", "storage_gb", 12, {"id": "r1"}],
        ],
    )
    assert answers == [10, 3, 10, 12, 12]
    assert await call(svc, "usage", "acme", "api") == 3
    assert await call(svc, "usage", "acme", "storage_gb") == 12


async def test_a_hard_limit_refuses_an_observation_above_it() -> None:
    svc = await gauges(service())
    await call(svc, "set_limit", "acme", "storage_gb", {"limit": 100, "alerts": [50]})
    assert await call(svc, "track", "acme", "storage_gb", 60) == 60
    exc = await error(svc, "track", "acme", "storage_gb", 101)
    assert isinstance(exc, LimitExceeded) and "above the hard limit 100" in exc.message
    assert (await call(svc, "check", "acme", "storage_gb", 101))["allowed"] is False
    assert (await call(svc, "check", "acme", "storage_gb", 100))["allowed"] is True
    assert await call(svc, "usage", "acme", "storage_gb") == 60
    answers = await call(
        svc, "track_many", [["acme", "storage_gb", 150], ["acme", "storage_gb", 90]]
    )
    assert answers[0]["code"] == "limit_exceeded" and answers[1] == 90, answers
    alerts = cast(Alerts, svc.gate.alerts)
    assert len(alerts.pending) == 1  # (50 % of 100 crossed once)
    await call(svc, "set_limit", "acme", "plan_seats", {"limit": 10, "price": 2})
    exc = await error(svc, "track", "acme", "plan_seats", 1)
    assert isinstance(exc, InvalidArgument) and "price" in exc.message


async def test_what_a_gauge_refuses() -> None:
    svc = await gauges(service())
    cases: list[tuple[str, list[Any], str]] = [
        ("reserve", ["acme", "storage_gb", 1], "gauge"),
        ("track", ["acme", "storage_gb", "x"], "must be an integer"),
        ("track", ["acme", "storage_gb", 1, {"dims": {"model": "a"}}], "declares no dimensions"),
        ("usage", ["acme", "storage_gb", {"group_by": ["model"]}], "no dimension"),
        ("history", ["acme", "storage_gb"], "kept per month"),
    ]
    for method, params, message in cases:
        exc = await error(svc, method, *params)
        assert exc.code == "invalid_argument" and message in exc.message, (method, exc)
    history = await call(svc, "history", "acme", "storage_gb", {"granularity": "month"})
    assert history[-1] == [MONTH, 0]
    exc = await error(svc, "set_feature", "storage_gb", {"aggregation": "sum"})
    assert isinstance(exc, Conflict)
    exc = await error(svc, "set_feature", "x", {"aggregation": "max", "dimensions": ["a"]})
    assert exc.code == "invalid_argument" and "not supported yet" in exc.message
    assert await call(svc, "usage", "acme", "storage_gb") == 0


async def test_a_retried_id_answers_as_the_first_observation() -> None:
    svc = await gauges(service())
    assert await call(svc, "track", "acme", "storage_gb", 5, {"id": "r1"}) == 5
    assert await call(svc, "track", "acme", "storage_gb", 9) == 9
    assert await call(svc, "track", "acme", "storage_gb", 5, {"id": "r1"}) == 5
    exc = await error(svc, "track", "acme", "storage_gb", 6, {"id": "r1"})
    assert isinstance(exc, Conflict)


async def test_a_gauge_is_never_counted_as_a_sum_nor_listed_as_one() -> None:
    """A price-only limit would let a plain track ride the batched path: not on a gauge.
    ``usage_all`` answers the gauge as ``usage`` does, and a counter of the same feature in
    storage (calls of a node that did not know yet) changes neither."""
    store = MemoryStorage()
    svc = await gauges(service(store))
    await call(svc, "set_limit", "acme", "storage_gb", {"limit": 10**6, "price": 1})
    key = ("acme", "storage_gb", MONTH)
    assert svc.gate.warm_check(key) is False
    assert svc.warm_tracks([[0, 1, "track", ["acme", "storage_gb", 5]]]) == []
    await call(svc, "clear_limit", "acme", "storage_gb")
    assert await call(svc, "track", "acme", "storage_gb", 40) == 40
    await store.apply("n9", [Delta(key, 1, 1000)])  # (a node that counted it as a sum)
    await GaugeFlusher(svc.gauging.table, store, interval=1.0).flush_once()
    other = await gauges(service(store, "n2"))
    for node in (svc, other):
        assert (await call(node, "usage_all", "acme"))["storage_gb"] == 40
        assert await call(node, "usage", "acme", "storage_gb") == 40
        assert not node.table.is_warm(key)
    rows = (await call(svc, "export", MONTH))["rows"]
    assert sorted(r for r in rows if r[1] == "storage_gb") == [
        ["acme", "storage_gb", MONTH, 40, {}, "gauge"],
        ["acme", "storage_gb", MONTH, 1000],
    ]


async def test_a_gauge_features_counter_is_not_pushed_as_its_value() -> None:
    """Calls counted on a feature before it was declared a gauge are its counter's, not the
    gauge's: live usage does not show them under the gauge's name."""
    svc = service()
    await limits_of(svc).refresh()
    assert await call(svc, "track", "acme", "level", 1000) == 1000
    await call(svc, "set_feature", "level", {"aggregation": "max"})
    assert await call(svc, "track", "acme", "level", 7) == 7
    assert ("level", MONTH) not in svc.watch_view("acme", None)
    assert (await call(svc, "usage_all", "acme"))["level"] == 7


async def test_history_reads_a_gauge_per_period_and_a_daily_gauges_months_as_the_gauge() -> None:
    store = MemoryStorage()
    svc = await gauges(service(store, feature_periods={"storage_gb": "day"}))
    now = time.time()
    today = period_start("day", now)
    yesterday = period_start("day", now - 86400)
    for day, values in ((yesterday, [70, 20]), (today, [30, 50])):
        for v in values:
            await store.put_gauges([(("acme", "storage_gb", day), "max", (v, 1, "n9"))])
            await store.put_gauges([(("acme", "plan_seats", day), "latest", (v, v, "n9"))])
    svc2 = await gauges(service(store, feature_periods={"storage_gb": "day", "plan_seats": "day"}))
    got = await call(svc2, "history", "acme", "storage_gb", {"from": yesterday, "to": today})
    assert got == [[yesterday, 70], [today, 50]]
    assert await call(svc2, "track", "acme", "storage_gb", 60) == 60
    got = await call(svc2, "history", "acme", "storage_gb", {"from": yesterday, "to": today})
    assert got[-1] == [today, 60]
    if yesterday[:7] == today[:7]:
        month = {"granularity": "month", "from": MONTH, "to": MONTH}
        assert await call(svc2, "history", "acme", "storage_gb", month) == [[MONTH, 70]]
        assert await call(svc2, "history", "acme", "plan_seats", month) == [[MONTH, 50]]
    del svc


async def test_a_cancelled_caller_does_not_fail_the_others_reading_the_same_gauge() -> None:
    class Slow(MemoryStorage):
        async def load_gauges(self, keys: Any) -> Any:
            await asyncio.sleep(0.05)
            return await super().load_gauges(keys)

    svc = await gauges(service(Slow()))
    first = asyncio.ensure_future(call(svc, "usage", "acme", "storage_gb"))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(call(svc, "track", "acme", "storage_gb", 7))
    await asyncio.sleep(0.01)
    first.cancel()
    assert await second == 7


async def test_concurrent_declarations_of_one_feature_leave_one_standing() -> None:
    """Both read no declaration before either writes: the one written last stands, the
    other is ``conflict``."""

    class Interleaved(MemoryStorage):
        async def write_limit(self, *args: Any, **kwargs: Any) -> int:
            await asyncio.sleep(0.01)  # (both calls have read the declarations by now)
            return await super().write_limit(*args, **kwargs)

    store = Interleaved()
    a, b = service(store, "n1"), service(store, "n2")
    got = await asyncio.gather(
        call(a, "set_feature", "level", {"aggregation": "max"}),
        call(b, "set_feature", "level", {"aggregation": "latest"}),
        return_exceptions=True,
    )
    assert sum(isinstance(g, Conflict) for g in got) == 1, got
    (ok,) = [g for g in got if isinstance(g, dict)]
    await limits_of(a).refresh()
    assert (await call(a, "get_feature", "level"))["aggregation"] == ok["aggregation"]


@pytest.fixture
def tmp() -> Iterator[Path]:
    d = short_tmpdir("gauge-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def limits_of(svc: Service) -> LimitStore:
    return cast(LimitStore, svc.limits)


async def test_the_log_brings_unstored_readings_back_and_the_flusher_stores_them(
    tmp: Path,
) -> None:
    store = MemoryStorage()

    async def start() -> tuple[Service, WriteAheadLog]:
        return await logged_service(tmp / "wal", store)

    svc, wal = await start()
    await gauges(svc)
    await call(svc, "track", "acme", "storage_gb", 40)
    await call(svc, "track", "acme", "storage_gb", 55, {"id": "r1"})
    await call(svc, "track", "acme", "plan_seats", 7)
    await wal.durable()
    await wal.close()  # (nothing stored: the log holds every observation)
    assert await store.load_gauges([("acme", "storage_gb", MONTH)]) == {
        ("acme", "storage_gb", MONTH): None
    }
    svc, wal = await start()
    assert await call(svc, "usage", "acme", "storage_gb") == 55
    assert await call(svc, "track", "acme", "storage_gb", 55, {"id": "r1"}) == 55
    flusher = GaugeFlusher(svc.gauging.table, store, interval=1.0)
    assert await flusher.flush_once()
    stored = await store.load_gauges([("acme", "storage_gb", MONTH), ("acme", "plan_seats", MONTH)])
    assert [r[0] if r else None for r in stored.values()] == [55, 7]
    assert svc.gauging.table.dirty() == []
    await wal.close()


async def test_another_node_reads_a_stored_gauge_and_merges_what_it_observes() -> None:
    store = MemoryStorage()
    a = await gauges(service(store, "n1"))
    b = service(store, "n2")
    await limits_of(b).refresh()
    await call(a, "track", "acme", "storage_gb", 80)
    await GaugeFlusher(a.gauging.table, store, interval=1.0).flush_once()
    assert await call(b, "usage", "acme", "storage_gb") == 80
    assert await call(b, "track", "acme", "storage_gb", 30) == 80
    assert await call(b, "track", "acme", "storage_gb", 90) == 90
    told: list[Any] = []
    await GaugeFlusher(b.gauging.table, store, interval=1.0, on_stored=told.extend).flush_once()
    assert [(item[1], item[4]) for item in told] == [("storage_gb", 90)]
    # a hears b's reading (gossip, or the stored one): the view moves to it.
    assert a.gauging.table.merge_readings(told) == 1
    assert a.gauging.table.merge_readings(told) == 0  # (heard twice: nothing more)
    assert await call(a, "usage", "acme", "storage_gb") == 90


async def test_a_failed_log_write_takes_an_observation_back(tmp: Path) -> None:
    """... and a flush round started before the commit fails does not write it."""
    wal = WriteAheadLog(tmp / "wal", node_id="n1", mode="fsync")
    store = MemoryStorage()
    svc = build_service(CounterTable("n1"), store, CounterConfig(), wal=wal,
                        ids=RequestIds(3600, 1000))  # fmt: skip
    await limits_of(svc).refresh()
    await recover(wal, svc)
    await gauges(svc)
    flusher = GaugeFlusher(svc.gauging.table, store, interval=1.0, wal=wal)
    assert await call(svc, "track", "acme", "storage_gb", 10) == 10
    await settle()
    with disk_full(wal):
        round_ = asyncio.ensure_future(flusher.flush_once())  # (it runs before the commit)
        assert await call(svc, "track", "acme", "storage_gb", 99, {"id": "g1"}) == 99
        await settle()  # the commit fails: the observation and its id are taken back
        assert broken(wal) is not None
    await round_
    stored = (await store.load_gauges([("acme", "storage_gb", MONTH)]))[
        ("acme", "storage_gb", MONTH)
    ]
    assert stored is None or stored[0] == 10, stored
    for _ in range(100):
        if broken(wal) is None:
            break
        await asyncio.sleep(0.05)
    assert await call(svc, "usage", "acme", "storage_gb") == 10
    assert await call(svc, "track", "acme", "storage_gb", 20, {"id": "g1"}) == 20  # (new)
    await wal.close()


async def test_concurrent_first_reads_of_one_gauge_share_one_read() -> None:
    class Counting(MemoryStorage):
        reads = 0

        async def load_gauges(self, keys: Any) -> Any:
            self.reads += 1
            await asyncio.sleep(0.01)
            return await super().load_gauges(keys)

    store = Counting()
    svc = await gauges(service(store))
    got = await asyncio.gather(*(call(svc, "track", "acme", "storage_gb", n) for n in range(5)))
    assert sorted(got)[-1] == 4 and store.reads == 1


def _node_config(tmp: Path, flush_ms: int) -> Any:
    from meter.config import FlushConfig, NodeConfig, ServerConfig

    return NodeConfig(data_dir=tmp / "data", node_id="n1",
                      server=ServerConfig(socket=tmp / "m.sock"),
                      flush=FlushConfig(interval_ms=flush_ms))  # fmt: skip


async def test_a_node_stores_its_gauges_in_its_own_loop(tmp: Path) -> None:
    """The node's own gauge flusher writes readings every interval (status counts them)."""
    from meter.client import AsyncClient
    from meter.node.lifecycle import Node

    store = MemoryStorage()
    key = ("acme", "storage_gb", MONTH)
    cfg = _node_config(tmp, 50)
    async with Node(cfg, storage=store):
        client = await AsyncClient.connect(cfg.server.socket)
        await client.set_feature("storage_gb", aggregation="max")
        assert await client.track("acme", "storage_gb", 12) == 12
        for _ in range(200):
            if (await store.load_gauges([key]))[key] is not None:
                break
            await asyncio.sleep(0.02)
        assert (await store.load_gauges([key]))[key] == (12, ANY_AT, "n1")
        gauges = (await client.status())["gauges"]
        assert gauges["written"] >= 1 and gauges["unstored"] == 0 and gauges["warm"] == 1
        await client.close()


async def test_a_clean_stop_drains_the_gauges_readings(tmp: Path) -> None:
    """No flush round comes before the stop: its drain writes the readings."""
    from meter.client import AsyncClient
    from meter.node.lifecycle import Node

    store = MemoryStorage()
    key = ("acme", "plan_seats", MONTH)
    cfg = _node_config(tmp, 3_600_000)
    async with Node(cfg, storage=store) as node:
        client = await AsyncClient.connect(cfg.server.socket)
        await client.set_feature("plan_seats", aggregation="latest")
        for value in (30, 4, 17, 2):  # (in one millisecond or not: in their order)
            assert await client.track("acme", "plan_seats", value) == value
        await client.close()
        assert (await store.load_gauges([key]))[key] is None
    assert node.drained
    stored = (await store.load_gauges([key]))[key]
    assert stored is not None and stored[0] == 2


class _AnyAt:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, int) and other > 0


ANY_AT: Any = _AnyAt()


def test_the_export_writers_mark_a_gauges_row() -> None:
    """From storage (the gauge's stored name) or from a node (``gauge``), a gauge's row says
    it is one; a gauge feature's counter row does not."""
    import io
    import json as json_

    from meter.ops.export import RowWriter
    from storage.base import ExportRow, gauge_key

    rows = [
        ExportRow("acme", gauge_key(("acme", "peak", MONTH))[1], MONTH, 9),
        ExportRow("acme", "peak", MONTH, 3),
        ExportRow("acme", "seats", MONTH, 4, gauge=True),
    ]
    out = io.StringIO()
    RowWriter(out, "csv").write(rows)
    assert out.getvalue().splitlines() == [
        "tenant,feature,period,total,dims,gauge",
        f"acme,peak,{MONTH},9,,true",
        f"acme,peak,{MONTH},3,,",
        f"acme,seats,{MONTH},4,,true",
    ]
    out = io.StringIO()
    RowWriter(out, "jsonl").write(rows)
    got = [(o["feature"], o["gauge"]) for o in map(json_.loads, out.getvalue().splitlines())]
    assert got == [("peak", True), ("peak", False), ("seats", True)]
