"""The grace window (``period_grace_s``): a ``track`` or ``reserve`` with ``at`` in an ended
period counts there until the period's end plus the grace, and is refused with
``period_closed`` after, counting nothing; reads reach any period; a counted call's retry
answers as it did (docs/protocol.md, "Methods"; correctness L06)."""

from __future__ import annotations

import asyncio
import calendar
import inspect
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from meter.config import CounterConfig
from meter.core.keycache import KeyCache
from meter.core.table import CounterTable
from meter.errors import PeriodClosed, from_wire
from meter.node.wiring import build_service
from tests.support.nodes import BACKFILL, NodeProcess, raw_call
from tests.support.stores import SlowStorage


def _month_start(now: float) -> int:
    """The first instant of the UTC month holding ``now``."""
    moment = datetime.fromtimestamp(now, tz=UTC)
    return calendar.timegm((moment.year, moment.month, 1, 0, 0, 0))


def test_a_period_closes_for_calls_exactly_at_its_end_plus_the_grace() -> None:
    """The boundary, on the node's own check: open one second before the period's end plus
    the grace, closed at it, for a month and for a day in the middle of it; an instant at
    the top of the range (December 9999) is open."""
    keys = KeyCache({"api_daily": "day"}, False, 600.0)
    at = calendar.timegm((2026, 11, 14, 12, 0, 0))
    month_end = calendar.timegm((2026, 12, 1, 0, 0, 0))
    day_end = calendar.timegm((2026, 11, 15, 0, 0, 0))
    month = keys.key_for("acme", "api", at)
    assert month == ("acme", "api", "2026-11")
    keys.check_open(month, at, month_end + 599.0)  # (open)
    with pytest.raises(PeriodClosed, match="period 2026-11 of 'api' closed"):
        keys.check_open(month, at, month_end + 600.0)
    day = keys.key_for("acme", "api_daily", at)
    assert day == ("acme", "api_daily", "2026-11-14")
    keys.check_open(day, at, day_end + 599.0)
    with pytest.raises(PeriodClosed, match="period 2026-11-14"):
        keys.check_open(day, at, day_end + 600.0)
    last = 253402300799.0  # (the largest ``at``: its month ends in the year 10000)
    keys.check_open(keys.key_for("acme", "api", last), last, time.time())


def test_calls_into_a_closed_period_are_refused_and_count_nothing(workdir: Path) -> None:
    """``period_grace_s = 0``: a call with ``at`` in last month is ``period_closed`` (track and
    reserve), counts nothing there and leaves the connection usable; one in this month counts;
    reads of last month still answer."""
    now = time.time()
    last_month = _month_start(now) - 1
    with NodeProcess(workdir, METER_PERIOD_GRACE_S="0") as node:
        error, _ = raw_call(node.socket, "track", "acme", "api", 5, {"at": last_month})
        assert isinstance(from_wire(error), PeriodClosed), error
        error, _ = raw_call(node.socket, "reserve", "acme", "api", 5, {"at": last_month})
        assert isinstance(from_wire(error), PeriodClosed), error
        error, _ = raw_call(node.socket, "check", "acme", "api", 5, {"at": last_month})
        assert isinstance(from_wire(error), PeriodClosed), error  # (as the track would be)
        assert node.call("check", "acme", "api", 5, {"at": now})["allowed"] is True
        assert node.call("usage_all", "acme", {"at": last_month}) == {}  # (no trace)
        assert node.call("usage", "acme", "api", {"at": last_month}) == 0
        assert node.call("track", "acme", "api", 2, {"at": now}) == 2
        assert node.call("usage", "acme", "api") == 2


def test_the_default_grace_refuses_a_call_weeks_late(workdir: Path) -> None:
    """Without the setting (an hour): a call 40 days late is refused (its month ended at
    least 9 days ago), one in the current period counts."""
    now = time.time()
    with NodeProcess(workdir) as node:
        error, _ = raw_call(node.socket, "track", "acme", "api", 1, {"at": now - 40 * 86400})
        assert isinstance(from_wire(error), PeriodClosed), error
        assert node.call("track", "acme", "api", 1) == 1


def test_a_counted_call_retried_after_its_period_closed_answers_as_it_did(workdir: Path) -> None:
    """A track and a reserve made under ids while last month was open, retried under the
    same ids after a restart with no grace, answer as they did and count nothing more; a new
    call there is refused."""
    last_month = _month_start(time.time()) - 1
    first = NodeProcess(workdir, **BACKFILL)
    with first as node:
        assert node.call("track", "acme", "api", 3, {"at": last_month, "id": "late-1"}) == 3
        held = node.call("reserve", "acme", "api", 2, {"at": last_month, "id": "late-2"})
        before = node.call("usage", "acme", "api", {"at": last_month})  # (3, and 2 reserved)
    again = NodeProcess(workdir, METER_PERIOD_GRACE_S="0")
    with again as node:
        assert node.call("track", "acme", "api", 3, {"at": last_month, "id": "late-1"}) == 3
        assert node.call("reserve", "acme", "api", 2, {"at": last_month, "id": "late-2"}) == held
        error, _ = raw_call(node.socket, "track", "acme", "api", 3, {"at": last_month, "id": "x"})
        assert isinstance(from_wire(error), PeriodClosed), error
        assert node.call("usage", "acme", "api", {"at": last_month}) == before


@pytest.mark.parametrize(
    ("method", "limited"), [("track", False), ("track", True), ("reserve", False)]
)
async def test_a_call_whose_period_closes_while_its_key_loads_is_refused(
    method: str, limited: bool
) -> None:
    """A call waiting for its key to load when its period closes is refused after the wait,
    like its retry that arrived after the close: both say ``period_closed`` and nothing is
    counted (a retry must never be told "not counted" about a call that then counts); under
    a limit too (the checked path). In process, on the node's request path."""
    now = time.time()
    last_month = _month_start(now) - 1
    closes_in = 1.0
    grace = now - _month_start(now) + closes_in  # (last month closes for calls in a second)
    store = SlowStorage()
    svc = build_service(CounterTable("n1"), store, CounterConfig(period_grace_s=grace))
    if limited:
        done = svc.dispatch("set_limit", ["acme", "api", {"limit": 1_000}])
        if inspect.isawaitable(done):
            await done
    store.release.clear()
    args = ["acme", "api", 4, {"at": last_month, "id": "late"}]
    first = svc.dispatch(method, args)
    assert inspect.isawaitable(first)
    waiting = asyncio.ensure_future(first)
    await asyncio.wait_for(store.reading.wait(), 5)
    deadline = time.monotonic() + 10
    early = []  # (retries sent while the period was open: they wait on the same load)
    while True:  # (until the period has closed: a retry is refused at once)
        try:
            retry = svc.dispatch(method, args)
        except PeriodClosed:
            break
        assert inspect.isawaitable(retry)
        early.append(asyncio.ensure_future(retry))
        assert time.monotonic() < deadline, "the period did not close"
        await asyncio.sleep(0.05)
    store.release.set()
    for call in [waiting, *early]:
        with pytest.raises(PeriodClosed):
            await call
    got = svc.dispatch("usage", ["acme", "api", {"at": last_month}])
    assert (await got if inspect.isawaitable(got) else got) == 0
