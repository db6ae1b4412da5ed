"""The units a node counted in a period, as its close mark says (docs/invoicing.md;
correctness F04): taken for storage once each, kept by the write-ahead log across crashes and
checkpoints, dimension counters left out; what the closer writes in the mark."""

from __future__ import annotations

import asyncio
import calendar
import shutil
from pathlib import Path
from typing import Any, cast

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from meter.cli.export import final_line
from meter.config import CounterConfig
from meter.core import journal
from meter.core.counts import PeriodUnits
from meter.core.dims import is_dimension
from meter.core.idempotency import RequestIds
from meter.core.keys import period_start
from meter.core.service import Service
from meter.core.table import CounterTable
from meter.node.wiring import build_service
from meter.persist.closing import PeriodCloser, close_state
from meter.persist.flusher import Flusher
from meter.persist.recovery import recover
from meter.quotas.store import LimitStore
from meter.wal import log as wal_log
from meter.wal import records as R
from meter.wal import replay as wal_replay
from meter.wal.log import WriteAheadLog
from storage.memory import MemoryStorage
from tests.support.nodes import short_tmpdir
from tests.test_dimensions import call
from tests.test_voids import log_back
from tests.test_wal_service import disk_full, settle

MONTH = period_start("month")
CONFIG = CounterConfig(tenant_hierarchy=True)
TENANTS = ["acme", "acme/bob", "beta"]

OP = st.one_of(
    st.tuples(st.just("track"), st.sampled_from(TENANTS), st.integers(-3, 9)),
    st.tuples(st.just("dims"), st.sampled_from(TENANTS), st.integers(1, 9)),
    st.tuples(st.just("flush")),
    st.tuples(st.just("fail")),  # the next write fails before it lands
    st.tuples(st.just("lose")),  # the next write lands, its answer is lost
    st.tuples(st.just("full")),  # a flush whose log record a full disk loses
    st.tuples(st.just("crash")),  # kill -9: the log's records replayed
    st.tuples(st.just("restart")),  # a clean stop: a checkpoint replayed
)


async def _start(d: Path, store: MemoryStorage) -> tuple[Service, WriteAheadLog, Flusher]:
    # Small segments: checkpoints run while calls and flushes go on.
    wal = WriteAheadLog(d, node_id="n1", mode="fsync", segment_bytes=2048)
    svc = build_service(CounterTable("n1"), store, CONFIG, wal=wal, ids=RequestIds(3600, 10_000))
    await cast(LimitStore, svc.limits).refresh()
    await recover(wal, svc)
    flusher = Flusher(svc.table, store, wal=wal, period_units=svc.journal.units)
    return svc, wal, flusher


def _stored(store: MemoryStorage) -> dict[str, dict[str, int]]:
    """What storage holds by period and feature, dimension counters left out (one node wrote
    it all)."""
    out: dict[str, dict[str, int]] = {}
    for (_, f, p), snap in store.items.items():
        if not is_dimension(f):
            out.setdefault(p, {})[f] = out.get(p, {}).get(f, 0) + snap.total
    return _nonzero(out)


def _nonzero(by_period: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    kept = {p: {f: n for f, n in held.items() if n} for p, held in by_period.items()}
    return {p: held for p, held in kept.items() if held}


def _said(units: PeriodUnits) -> dict[str, dict[str, int]]:
    return _nonzero(units.by_period)


async def on_disk(wal: WriteAheadLog) -> None:
    """Wait until every record appended is on disk. (A record of its own: after a write that
    failed, ``durable`` alone waits for the next commit's sync.)"""
    wal.append([R.NOOP])
    await wal.durable()


async def _calls_flushes_and_crashes(ops: list[tuple[Any, ...]]) -> None:
    d = short_tmpdir("units-")
    store = MemoryStorage()
    # Checkpoints of a record a key, over many passes: a crash may cut one short.
    saved = journal.CHECKPOINT_ITEMS, wal_log.PROBE_INTERVAL_S
    journal.CHECKPOINT_ITEMS, wal_log.PROBE_INTERVAL_S = 1, 0.01
    try:
        svc, wal, flusher = await _start(d, store)
        await call(svc, "set_feature", "tokens", {"dimensions": ["model"]})
        for op in ops:
            if op[0] == "track":
                await call(svc, "track", op[1], "api", op[2])
            elif op[0] == "dims":
                await call(svc, "track", op[1], "tokens", op[2], {"dims": {"model": "a"}})
            elif op[0] == "flush":
                await flusher.flush_once()
            elif op[0] == "fail":
                store.fail_next = 1
            elif op[0] == "lose":
                store.lose_next_ack = 1
            elif op[0] == "full":
                with disk_full(wal):
                    await flusher.flush_once()
                await log_back(wal)
            else:
                await on_disk(wal)
                await wal.close(final_checkpoint=op[0] == "restart")
                svc, wal, flusher = await _start(d, store)
            await settle()  # (a checkpoint's steps run between calls)
        store.fail_next = store.lose_next_ack = 0
        for _ in range(20):
            await flusher.flush_once()
            if not svc.table.unstored_keys():
                break
        assert not svc.table.unstored_keys()
        assert _said(svc.journal.units) == _stored(store)
        await on_disk(wal)
        await wal.close(final_checkpoint=False)  # and once more from the records alone
        svc, wal, flusher = await _start(d, store)
        assert _said(svc.journal.units) == _stored(store)
        await wal.close()
    finally:
        journal.CHECKPOINT_ITEMS, wal_log.PROBE_INTERVAL_S = saved
        shutil.rmtree(d)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(OP, min_size=3, max_size=30))
@example(
    [
        ("track", "acme/bob", 5),
        ("lose",),
        ("flush",),  # landed, not heard: taken again under its sequence, not counted again
        ("crash",),
        ("flush",),
        ("dims", "beta", 4),
        ("fail",),
        ("flush",),
        ("restart",),
        ("track", "acme", -2),
        ("flush",),
        ("crash",),
    ]
)
@example(  # a take whose record a full disk lost, then a checkpoint cut short: its retry counts
    [
        ("track", "acme/bob", 5),
        ("dims", "beta", 3),
        ("full",),
        ("track", "acme", 2),
        ("track", "beta", 4),
        ("track", "acme/bob", 1),
        ("crash",),
        ("flush",),
        ("crash",),
    ]
)
def test_the_units_taken_are_what_storage_holds_whatever_fails_and_restarts(
    ops: list[tuple[Any, ...]],
) -> None:
    """Tracks (levels of a hierarchy, negative ones, dimension counters), flushes whose writes
    fail or land unheard, crashes (the log's records replayed) and clean restarts (a
    checkpoint), with checkpoints written while it all runs: once every unit is stored, the
    units the node says it took by period and feature are what storage holds, dimension
    counters left out; a restart after that says the same."""
    asyncio.run(_calls_flushes_and_crashes(ops))


def test_the_log_tells_dimension_counters_as_the_dimensions_module_does() -> None:
    for name in ["api", "tokens\x1fmodel=a", "tokens\x1emodel=a,region=x", "a-b.c:d", "é"]:
        assert wal_replay.is_dimension(name) == is_dimension(name), name


async def test_the_close_carries_the_units_and_forgets_them() -> None:
    """A node's close of a period writes its units there (an export shows them by node) and
    forgets them; a restart that finds its close forgets them too; without a log a node
    says none."""
    store = MemoryStorage()
    units = PeriodUnits()
    units.add("2026-11", "api", 7)
    units.add("2026-11", "tokens", 30)
    units.add("2026-12", "api", 1)
    end = float(calendar.timegm((2026, 12, 1, 0, 0, 0)))
    closer = PeriodCloser("n1", store, lambda: ["month"], lambda: [None], 60, list, "d1", units)
    await closer.start(end - 10)
    assert await closer.close_due(end + 60) == ["2026-11"]
    (mark,) = await store.period_marks("2026-11")
    assert mark.units == {"api": 7, "tokens": 30}
    assert "2026-11" not in units.by_period and units.of("2026-12") == {"api": 1}
    state = await close_state(store, "2026-11", 60, end + 60)
    assert state["closed_nodes"] == [
        {"node": "n1", "state": "closed", "at": mark.at, "by": "n1", "units": mark.units}
    ]
    # Restarted with units restored from a checkpoint written before the close.
    again = PeriodUnits()
    again.restore({"2026-11": {"api": 7}, "2026-12": {"api": 1}})
    restarted = PeriodCloser("n1", store, lambda: ["month"], lambda: [None], 60, list, "d1", again)
    await restarted.start(end + 120)
    assert list(again.by_period) == ["2026-12"]
    # Drained: the units so far, kept while the period may count (the node may open it
    # again and close it with all of them), forgotten once it may not.
    await restarted.drained(end + 130)
    (dec,) = await store.period_marks("2026-12")
    assert dec.state == "drained" and dec.units == {"api": 1}
    jan = float(calendar.timegm((2027, 1, 1, 0, 0, 0)))
    assert await restarted.close_due(jan + 59) == [] and again.of("2026-12") == {"api": 1}
    assert await restarted.close_due(jan + 60) == [] and "2026-12" not in again.by_period
    # A restart whose storage does not answer yet forgets nothing (its marks are not read).
    late = PeriodUnits()
    late.restore({"2026-11": {"api": 7}})
    blind = PeriodCloser("n9", store, lambda: ["month"], lambda: [None], 60, list, "d9", late)
    assert await blind.close_due(jan + 600) == [] and late.of("2026-11") == {"api": 7}
    # No log: nothing said.
    bare = PeriodUnits(kept=False)
    bare.add("2027-01", "api", 3)
    assert bare.of("2027-01") is None


async def test_meter_export_says_what_the_nodes_counted_in_a_final_period() -> None:
    store = MemoryStorage()
    end = float(calendar.timegm((2026, 12, 1, 0, 0, 0)))
    await store.mark_period_closed("2026-11", "n1", end, "n1", {"api": 7, "tokens": 30})
    await store.mark_period_drained("2026-11", "n2", end)  # (no mark: nothing written)
    await store.mark_period_open("2026-11", "n2", end - 5)
    await store.mark_period_drained("2026-11", "n2", end, {"api": 2})
    await store.mark_period_closed("2026-11", "n3", end, "operator")
    state = await close_state(store, "2026-11", 0.0, end + 1)
    line = final_line("2026-11", state)
    assert line.endswith(
        "closed it; closed by an operator for n3; units the nodes counted: api=9, tokens=30 "
        "(not said by n3)"
    ), line


def test_replay_counts_each_take_once_whatever_restates_it() -> None:
    """A take counts once: its retry under the same sequence adds nothing, whether the take's
    own record or a checkpoint's ``UNITS`` (which holds it) came first; a ``STATE`` restating
    the key in flight does not stand for the take (a full disk may have lost its record, and
    a checkpoint cut short before its ``UNITS`` leaves only the retry's)."""
    key = ["acme", "api", MONTH]

    def replayed(*records: list[Any]) -> dict[str, dict[str, int]]:
        r = wal_replay.Replay()
        r.apply_all(records)
        return r.units

    flush = [R.FLUSH, [[*key, 5, 10]]]
    assert replayed(flush, flush) == {MONTH: {"api": 10}}
    units = [R.UNITS, [[MONTH, "api", 10]], [[*key, 5]]]
    assert replayed(flush, units, flush) == {MONTH: {"api": 10}}
    assert replayed(units, flush, [R.FLUSH, [[*key, 6, 3]]]) == {MONTH: {"api": 13}}
    state = [R.STATE, [[*key, 5, 10, 0]]]
    assert replayed(state, flush) == {MONTH: {"api": 10}}  # (its own record lost)
    dims = [R.FLUSH, [["acme", "api\x1fmodel=a", MONTH, 1, 10]]]
    assert replayed(dims) == {}


async def test_units_of_a_period_open_in_storage_are_kept_for_its_close() -> None:
    """A period whose open mark reached storage though the node never heard it (the answer
    lost), its units stored: past its grace the closer finds the mark, closes the period and
    the close carries the units, rather than forgetting them."""
    store = MemoryStorage()
    units = PeriodUnits()
    units.add("2026-11", "api", 7)
    end = float(calendar.timegm((2026, 12, 1, 0, 0, 0)))
    closer = PeriodCloser("n1", store, lambda: ["month"], lambda: [None], 60, list, "d1", units)
    await closer.start(end + 10 * 86400)  # (November past its grace: not opened now)
    assert "2026-11" not in closer.open
    await store.mark_period_open("2026-11", "n1", end - 5, "d1")  # (written; answer lost)
    assert await closer.close_due(end + 10 * 86400) == ["2026-11"]  # (found open: closed)
    (mark,) = await store.period_marks("2026-11")
    assert mark.state == "closed" and mark.units == {"api": 7}
