"""Period close (docs/invoicing.md; correctness F01-F03): which periods a node marks open, when
it closes them, and what an export says of a period (``final``, ``open_nodes``), in process
on memory storage and with the node's own loop."""

from __future__ import annotations

import asyncio
import calendar
import time
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meter.cli.export import final_line
from meter.core.keys import Key, period_start
from meter.errors import InvalidArgument
from meter.ops.export import rpc_page
from meter.persist import closing
from meter.persist.closing import (
    PeriodCloser,
    PeriodMethods,
    close_state,
    period_closes_at,
    periods_to_open,
    recent_periods,
)
from storage.base import MAX_OWNER_NOTE_BYTES
from storage.memory import MemoryStorage
from storage.periods import bounds
from tests.support.services import SlowLoads

NOV = "2026-11"
NOV_END = calendar.timegm((2026, 12, 1, 0, 0, 0))


@settings(max_examples=300, deadline=None)
@given(
    st.datetimes(min_value=datetime(2001, 1, 1), max_value=datetime(2098, 12, 31)),
    st.floats(0, 40 * 86400),
    st.floats(0, 1),
)
def test_the_periods_a_node_opens_hold_every_call_it_may_count(
    at: datetime, grace: float, back: float
) -> None:
    """The period of every call a node may count at ``now`` (``at`` anywhere from now back
    to where the grace still lets a call count) that closes within ``CLOSING_SOON_S`` is
    among those it marks open at ``now`` whatever it holds; each of those is a real period
    name that may still count, and there are a few of them whatever the grace."""
    now = at.replace(tzinfo=UTC).timestamp()
    opened = periods_to_open(["month", "day"], [None], grace, now)
    when = now - back * (grace + 62 * 86400)  # (past the grace too: then it is refused)
    for kind in ("month", "day"):
        assert period_start(kind, now) in opened
        called = period_start(kind, when)
        closes = period_closes_at(called, grace)
        if now < closes <= now + closing.CLOSING_SOON_S:  # (the grace lets it count: L06)
            assert called in opened, (kind, called, opened)
        # (one closing later is marked once held: test_a_period_held_without_a_mark_...)
    assert len(opened) <= 2 * (2 + 2)  # (bounded, whatever the grace)
    for name in opened:
        assert period_start("day" if len(name) > 7 else "month", bounds(name)[0]) == name
        assert now < period_closes_at(name, grace)


def test_recent_periods_go_back_whole_periods() -> None:
    now = calendar.timegm((2026, 3, 1, 12, 0, 0))
    got = recent_periods(["month", "day"], [None], now)
    assert got[:3] == ["2026-02", "2026-01", "2025-12"]
    assert got[3:6] == ["2026-02-28", "2026-02-27", "2026-02-26"] and len(got) == 43


def test_a_period_closes_at_its_end_plus_the_grace() -> None:
    assert period_closes_at(NOV, 3600) == NOV_END + 3600
    day = "2026-11-30"
    assert period_closes_at(day, 0) == bounds(day)[1] == NOV_END


class Held:
    """What a closer is told this node holds unstored."""

    def __init__(self) -> None:
        self.keys: list[Key] = []

    def __call__(self) -> list[Key]:
        return list(self.keys)

    def periods(self) -> list[str]:
        return sorted({k[2] for k in self.keys})


async def test_a_node_closes_a_period_once_due_and_nothing_of_it_is_unstored() -> None:
    store = MemoryStorage()
    held = Held()
    closer = PeriodCloser("n1", store, lambda: ["month"], lambda: [None], 3600, held, "d1")
    at = NOV_END - 10  # (November, near its end: December read ahead too)
    await closer.start(at)
    assert closer.open == {NOV, "2026-12"}
    assert [(m.node, m.state) for m in await store.period_marks(NOV)] == [("n1", "open")]
    held.keys = [("acme", "api", NOV)]
    assert await closer.close_due(NOV_END + 3599) == []  # (not due yet)
    assert await closer.close_due(NOV_END + 3600) == []  # (due, but units not stored)
    state = await close_state(store, NOV, 3600, NOV_END + 3600)
    assert state["final"] is False and [n["node"] for n in state["open_nodes"]] == ["n1"]
    held.keys = [("acme", "api", "2026-12")]  # (stored; December's are not November's)
    assert await closer.close_due(NOV_END + 3601) == [NOV]
    assert closer.open == {"2026-12"} and closer.oldest_open() == "2026-12"
    state = await close_state(store, NOV, 3600, NOV_END + 3601)
    assert state["final"] is True and state["open_nodes"] == []


async def test_a_restarted_node_finds_its_open_marks_and_closes_them() -> None:
    store = MemoryStorage()
    first = PeriodCloser("n1", store, lambda: ["month"], lambda: [None], 60, Held(), "d1")
    await first.start(NOV_END - 5)
    # (killed; back two days later, its units stored by its flusher)
    again = PeriodCloser("n1", store, lambda: ["month"], lambda: [None], 60, Held(), "d1")
    await again.start(NOV_END + 2 * 86400)
    assert NOV in again.open and "2026-12" in again.open
    assert await again.close_due(NOV_END + 2 * 86400) == [NOV]
    other = PeriodCloser("n2", store, lambda: ["month"], lambda: [None], 60, Held(), "d2")
    await other.start(NOV_END + 2 * 86400)
    assert NOV not in other.open  # (n2 never counted there)


async def test_an_export_is_final_only_when_every_node_that_counted_closed() -> None:
    store = MemoryStorage()
    for node in ("n1", "n2", "n3"):
        await store.mark_period_open(NOV, node, NOV_END - 100)
    now = NOV_END + 7200
    await store.mark_period_closed(NOV, "n1", now, "n1")
    page = await rpc_page(store, NOV, None, 10, 3600)
    assert page["final"] is False
    assert [n["node"] for n in page["open_nodes"]] == ["n2", "n3"]
    assert all(n["lease_ends"] is None for n in page["open_nodes"])  # (no owner: not running)
    await store.mark_period_closed(NOV, "n2", now, "n2")
    methods = PeriodMethods(store, 3600)
    got = await methods.close_period([NOV, "n3"])
    assert got["state"] == "closed" and got["by"] == "operator"
    page = await rpc_page(store, NOV, None, 10, 3600)
    assert page["final"] is True and page["closed_by_operator"] == ["n3"]
    # A close by hand of a period that may still count is refused, changing nothing.
    with pytest.raises(InvalidArgument, match="may still count"):
        methods.close_period([period_start("month"), "n3"])
    with pytest.raises(InvalidArgument):
        methods.close_period(["2026-13", "n3"])
    # Not final before the grace has passed, even with every mark closed.
    current = period_start("month")
    assert (await close_state(store, current, 3600, time.time()))["final"] is False


async def test_the_nodes_loop_opens_and_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop (run) marks the periods open and closes one once due: the previous month
    with a grace ending a moment from now."""
    monkeypatch.setattr(closing, "EVERY_S", 0.05)
    now = time.time()
    month = period_start("month", now)
    start = bounds(month)[0]
    before = period_start("month", start - 1)
    grace = now - start + 0.5  # (the previous month closes half a second from now)
    store = MemoryStorage()
    closer = PeriodCloser("n1", store, lambda: ["month"], lambda: [None], grace, Held(), "d1")
    task = asyncio.ensure_future(closer.run())
    try:
        deadline = time.monotonic() + 10
        while not (closer.closed_total and before not in closer.open):
            assert time.monotonic() < deadline, closer.open
            await asyncio.sleep(0.02)
        marks = {m.node: m for m in await store.period_marks(before)}
        assert marks["n1"].state == "closed" and marks["n1"].at >= start + grace
        assert month in closer.open
    finally:
        task.cancel()


async def test_a_period_held_without_a_mark_is_marked_once_storage_answers() -> None:
    """Units counted in a period while storage could not take its mark (an outage across
    its start, past its grace): marked open at the next pass, and closed once stored."""
    store = MemoryStorage()
    held = Held()
    closer = PeriodCloser("n1", store, lambda: ["month"], lambda: [None], 60, held, "d1")
    now = NOV_END + 10 * 86400  # (December: November past its grace)
    held.keys = [("acme", "api", NOV), ("acme", "api", "")]  # (and a credit pool's key)
    await closer.start(now)
    assert NOV in closer.open
    state = await close_state(store, NOV, 60, now)
    assert state["final"] is False and [n["node"] for n in state["open_nodes"]] == ["n1"]
    held.keys = []
    assert await closer.close_due(now) == [NOV]
    assert (await close_state(store, NOV, 60, now))["final"] is True


async def test_a_drained_node_counts_as_closed_and_opens_again_when_back() -> None:
    store = MemoryStorage()
    held = Held()
    closer = PeriodCloser("n1", store, lambda: ["month"], lambda: [None], 60, held, "d1")
    await closer.start(NOV_END - 86400)
    await store.mark_period_open(NOV, "n2", NOV_END - 86400)
    await closer.drained(NOV_END - 3600)  # (SIGTERM, everything stored: gone for good?)
    assert closer.open == set()
    await store.mark_period_closed(NOV, "n2", NOV_END + 61, "n2")
    assert (await close_state(store, NOV, 60, NOV_END + 61))["final"] is True
    # Back before the period ended: it opens it again, and the export waits for it.
    back = PeriodCloser("n1", store, lambda: ["month"], lambda: [None], 60, held, "d1")
    await back.start(NOV_END - 1800)
    assert NOV in back.open
    state = await close_state(store, NOV, 60, NOV_END + 61)
    assert state["final"] is False and [n["node"] for n in state["open_nodes"]] == ["n1"]


async def test_an_operator_cannot_close_a_running_node() -> None:
    store = MemoryStorage()
    now = time.time()
    await store.mark_period_open(NOV, "n3", NOV_END - 100)
    await store.claim_owner("n3", "token", lease_s=30, now=now)
    with pytest.raises(InvalidArgument, match="is running"):
        await PeriodMethods(store, 60).close_period([NOV, "n3"])
    assert [m.state for m in await store.period_marks(NOV)] == ["open"]


def test_the_overdue_period_is_the_one_that_should_have_closed_first() -> None:
    closer = PeriodCloser(
        "n1", MemoryStorage(), lambda: ["month", "day"], lambda: [None], 60, Held(), "d1"
    )
    closer.open = {"2026-11", "2026-11-05", "2026-12"}
    assert closer.oldest_open() == "2026-11-05"
    assert closing.overdue_s(closer.oldest_open(), 60, NOV_END) == NOV_END - (
        calendar.timegm((2026, 11, 6, 0, 0, 0)) + 60
    )


async def test_a_unique_call_waiting_across_the_close_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call with ``at`` on a unique feature that waits for its counter's read while its
    period closes is refused (``period_closed``), counting nothing."""
    from meter.config import CounterConfig
    from meter.core.table import CounterTable
    from meter.errors import PeriodClosed
    from meter.node.wiring import build_service

    now = time.time()
    start = bounds(period_start("month", now))[0]
    grace = now - start + 0.3  # (last month closes 0.3 s from now)
    store = SlowLoads()
    svc = build_service(CounterTable("n1"), store, CounterConfig(period_grace_s=grace))
    got = svc.dispatch("set_feature", ["seats", {"aggregation": "unique"}])
    await got
    store.gate = asyncio.Event()
    call = svc.dispatch("track", ["acme", "seats", 1, {"value": "ann", "at": start - 10}])
    pending = asyncio.ensure_future(call)
    while time.time() < start + grace:
        await asyncio.sleep(0.02)
    store.gate.set()
    with pytest.raises(PeriodClosed):
        await pending
    assert store.items == {} or all(v.total == 0 for v in store.items.values())


async def test_a_node_id_reused_by_another_data_dir_never_closes_its_marks() -> None:
    """A process on a fresh data dir under a killed node's id does not take its open marks
    (it does not hold their units): they stay open for an operator to close."""
    store = MemoryStorage()
    first = PeriodCloser("n1", store, lambda: ["month"], lambda: [None], 60, Held(), "d1")
    await first.start(NOV_END - 100)  # (then killed, holding units of November)
    other = PeriodCloser("n1", store, lambda: ["month"], lambda: [None], 60, Held(), "d9")
    await other.start(NOV_END + 86400)
    assert NOV in other.foreign and NOV not in other.open
    assert await other.close_due(NOV_END + 86400) == []
    state = await close_state(store, NOV, 60, NOV_END + 86400)
    assert state["final"] is False and [n["node"] for n in state["open_nodes"]] == ["n1"]


async def test_a_drain_leaves_open_a_period_it_still_holds_a_reservation_of() -> None:
    store = MemoryStorage()
    held = Held()
    closer = PeriodCloser("n1", store, lambda: ["month"], lambda: [None], 60, held, "d1")
    await closer.start(NOV_END - 3600)
    held.keys = [("acme", "api", NOV)]  # (an open reservation of November)
    await closer.drained(NOV_END - 1800)
    assert closer.open == {NOV}
    assert {m.state for m in await store.period_marks(NOV)} == {"open"}


def test_a_nodes_note_says_its_backlog_of_each_period_it_holds() -> None:
    """The note a renewal leaves: keys and units per period held not stored; a period the note
    does not list is zeros when it lists every one, unknown (None) when it left some out or is
    not a note; every note fits the owner record."""
    held: list[tuple[Key, int]] = [
        (("a", "api", NOV), 5), (("b", "api", NOV), 7), (("a", "api", "2026-11-30"), 2),
    ]  # fmt: skip
    note = closing.backlog_note(held, 1000.25)
    assert closing.noted_backlog(note, NOV) == (1000.25, {"keys": 2, "units": 12})
    assert closing.noted_backlog(note, "2026-11-30") == (1000.25, {"keys": 1, "units": 2})
    assert closing.noted_backlog(note, "2026-10") == (1000.25, {"keys": 0, "units": 0})
    for bad in ("", "not json", "[1]", '{"at": true}'):
        assert closing.noted_backlog(bad, NOV) == (None, None), bad
    # Many periods, long names: the ones that close first, within the record's bound.
    zone = "America/Argentina/ComodRivadavia"
    many = [((f"t{d}", "api", f"2026-11-{d:02d}@{zone}"), 10**15) for d in range(1, 31)]
    many += [((f"t{d}", "api", f"2026-10-{d:02d}@{zone}"), 10**15) for d in range(1, 32)]
    note = closing.backlog_note(many, 5.0)
    assert len(note.encode()) <= MAX_OWNER_NOTE_BYTES
    assert closing.noted_backlog(note, f"2026-10-01@{zone}")[1] == {"keys": 1, "units": 10**15}
    assert closing.noted_backlog(note, f"2026-11-30@{zone}") == (5.0, None)  # (left out)


async def test_an_export_names_each_open_nodes_last_known_backlog() -> None:
    store = MemoryStorage()
    await store.mark_period_open(NOV, "n1", NOV_END - 100)
    await store.mark_period_open(NOV, "n2", NOV_END - 100)
    await store.claim_owner("n1", "t1", lease_s=30, now=NOV_END)
    note = closing.backlog_note([(("a", "api", NOV), 9)], NOV_END + 5)
    await store.renew_owner("n1", "t1", lease_s=30, now=NOV_END + 5, note=note)
    state = await close_state(store, NOV, 0.0, NOV_END + 10)
    assert state["open_nodes"] == [
        {"node": "n1", "opened_at": NOV_END - 100, "lease_ends": NOV_END + 35,
         "seen_at": NOV_END + 5, "backlog": {"keys": 1, "units": 9}},
        {"node": "n2", "opened_at": NOV_END - 100, "lease_ends": None, "seen_at": None,
         "backlog": None},
    ]  # fmt: skip
    line = final_line(NOV, state)
    assert (
        "n1 (open since 2026-11-30T23:58:20Z, running, 9 units in 1 keys not stored as of "
        "2026-12-01T00:00:05Z); n2 (open since 2026-11-30T23:58:20Z, not running)" in line
    ), line


class MarksFail(MemoryStorage):
    """Memory storage that does not answer marks of voided values while ``failing``."""

    failing = False
    tries = 0

    async def void_value(self, key: Key, value: str, claimant: str) -> str | None:
        self.tries += 1
        if self.failing:
            from storage.base import StorageUnavailable

            raise StorageUnavailable("injected: the mark is not written")
        return await super().void_value(key, value, claimant)


async def test_a_voided_value_not_marked_keeps_its_period_open() -> None:
    """A node holding a voided unique value whose mark storage did not take does not close the
    value's period (its units stored); once its own loop writes the mark, it does, and the
    export's values leave the value out (correctness V05)."""
    import tempfile
    from pathlib import Path

    from meter.client import AsyncClient
    from meter.config import CounterConfig, FlushConfig, NodeConfig, ServerConfig
    from meter.node.lifecycle import Node

    store = MarksFail()
    with tempfile.TemporaryDirectory() as d:
        cfg = NodeConfig(
            data_dir=Path(d) / "data",
            node_id="n1",
            server=ServerConfig(socket=Path(d) / "m.sock"),
            flush=FlushConfig(interval_ms=3_600_000),  # rounds are driven by the test
            counters=CounterConfig(period_grace_s=60),
        )
        async with Node(cfg, storage=store) as node:
            assert node.flusher is not None and node.closer is not None
            client = await AsyncClient.connect(cfg.server.socket)
            try:
                await client.call("set_feature", "seats", {"aggregation": "unique"})
                for value in ("ann", "bea"):
                    await client.track("acme", "seats", 1, value=value, id=f"u-{value}")
                store.failing = True
                assert await client.call("void", "u-ann") == {"voided": 1, "value": 1}
                assert await node.flusher.flush_once()
                key = ("acme", "seats", period_start("month"))
                assert store.items[key].total == 1
                month = key[2]
                due = bounds(month)[1] + 60
                deadline = time.monotonic() + 10
                while store.tries < 2:  # (the loop tried twice: the mark waits)
                    assert time.monotonic() < deadline, "the node's loop never tried the mark"
                    await asyncio.sleep(0.05)
                assert (await client.status())["uniques"]["voided_unmarked"] == 1
                assert await node.closer.close_due(due) == []
                store.failing = False
                deadline = time.monotonic() + 10
                while (await client.status())["uniques"]["voided_unmarked"]:
                    assert time.monotonic() < deadline, "the node's loop never wrote the mark"
                    await asyncio.sleep(0.05)
                assert await node.closer.close_due(due) == [month]
                assert await store.values_page(key, None, 10) == (["bea"], None)
            finally:
                await client.close()
