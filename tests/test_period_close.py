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

from meter.core.keys import Key, period_start
from meter.core.periods import period_end, period_instant
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
from storage.memory import MemoryStorage

NOV = "2026-11"
NOV_END = calendar.timegm((2026, 12, 1, 0, 0, 0))


@settings(max_examples=200, deadline=None)
@given(
    st.datetimes(min_value=datetime(2001, 1, 1), max_value=datetime(2098, 12, 31)),
    st.floats(0, 40 * 86400),
)
def test_the_periods_a_node_opens_hold_every_call_it_may_count(at: datetime, grace: float) -> None:
    """Every period a call at ``now`` (with ``at`` anywhere the grace still lets count)
    lands in is among those a node marks open at ``now``; each is a real period name."""
    now = at.replace(tzinfo=UTC).timestamp()
    opened = periods_to_open(["month", "day"], grace, now)
    for kind in ("month", "day"):
        assert period_start(kind, now) in opened
        # The period before, if the grace still lets a call count there.
        before = period_start(kind, period_instant(period_start(kind, now)) - 1)
        if now < period_closes_at(before, grace):
            assert before in opened
    for name in opened:
        assert period_start("day" if len(name) > 7 else "month", period_instant(name)) == name


def test_recent_periods_go_back_whole_periods() -> None:
    now = calendar.timegm((2026, 3, 1, 12, 0, 0))
    got = recent_periods(["month", "day"], now)
    assert got[:3] == ["2026-02", "2026-01", "2025-12"]
    assert got[3:6] == ["2026-02-28", "2026-02-27", "2026-02-26"] and len(got) == 43


def test_a_period_closes_at_its_end_plus_the_grace() -> None:
    assert period_closes_at(NOV, 3600) == NOV_END + 3600
    day = "2026-11-30"
    assert period_closes_at(day, 0) == period_end("day", period_instant(day)) == NOV_END


class Held:
    """What a closer is told this node holds unstored."""

    def __init__(self) -> None:
        self.keys: list[Key] = []

    def __call__(self) -> list[Key]:
        return list(self.keys)


async def test_a_node_closes_a_period_once_due_and_nothing_of_it_is_unstored() -> None:
    store = MemoryStorage()
    held = Held()
    closer = PeriodCloser("n1", store, lambda: ["month"], 3600, held)
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
    first = PeriodCloser("n1", store, lambda: ["month"], 60, Held())
    await first.start(NOV_END - 5)
    # (killed; back two days later, its units stored by its flusher)
    again = PeriodCloser("n1", store, lambda: ["month"], 60, Held())
    await again.start(NOV_END + 2 * 86400)
    assert NOV in again.open and "2026-12" in again.open
    assert await again.close_due(NOV_END + 2 * 86400) == [NOV]
    other = PeriodCloser("n2", store, lambda: ["month"], 60, Held())
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
    start = period_instant(month)
    before = period_start("month", start - 1)
    grace = now - start + 0.5  # (the previous month closes half a second from now)
    store = MemoryStorage()
    closer = PeriodCloser("n1", store, lambda: ["month"], grace, Held())
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
