"""Billing-cycle periods on real node processes (docs/periods.md; correctness Y03, Y04): a
tenant anchored on the 15th in America/New_York, its node's clock moved to just before its
period ends on the day after a DST change, across a month end; a UTC tenant beside it."""

from __future__ import annotations

import calendar
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.nodes import NodeProcess, short_tmpdir, wait_for

NY = "America/New_York"
FEB = f"2027-02@15:{NY}"
MAR = f"2027-03@15:{NY}"
#: Where FEB ends: March 15, 00:00 in New York, daylight time (UTC-4) since March 14.
FEB_END = calendar.timegm((2027, 3, 15, 4, 0, 0))
ENV = {"METER_FLUSH_INTERVAL_MS": "50", "METER_FEATURE_PERIODS": "api_daily=day"}


def ts(*parts: int) -> float:
    return float(calendar.timegm((*parts, 0, 0, 0, 0, 0)[:6]))


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = short_tmpdir("cycle-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def node_at(workdir: Path, instant: float, **env: str) -> NodeProcess:
    """A node whose clock reads ``instant`` now."""
    node = NodeProcess(workdir, **{**ENV, **env})
    node.clock_shift = instant - time.time()
    return node


def export(node: NodeProcess, period: str) -> tuple[dict[str, Any], dict[tuple[str, str], int]]:
    page = node.call("export", period)
    assert page["cursor"] is None
    return page, {(row[0], row[1]): int(row[3]) for row in page["rows"]}


def test_an_anchored_tenant_counts_by_its_own_periods_across_dst_and_a_month_end(
    workdir: Path,
) -> None:
    """Set on February 1 (effective a minute later), the anchor splits calls by New York's
    local midnight of the 15th: calls on February 28 and March 1 (a month end, local and UTC)
    share one period, a call at 23:59 on March 14 (daylight time, a day of 23 hours) is still
    in it and one at 00:00 on March 15 is not; the UTC tenant beside it splits at March 1
    UTC. Then the node's clock runs across FEB's end with calls without ``at``: every call
    answered before the end is in FEB, every call after in MAR; after the grace the node
    closes FEB and its export is final with exactly those units; usage, history and export
    agree."""
    with node_at(workdir, ts(2027, 2, 1)) as node:
        node.call("set_plan", "pro", {})
        assert node.clock_shift is not None
        sent = time.time() + node.clock_shift  # (the node's clock)
        node.call("assign_plan", "acme", "pro", {"anchor_day": 15, "tz": NY, "effective": "now"})
        answered = time.time() + node.clock_shift
        cycle = node.call("limits", "acme")["cycle"]
        assert [(c["anchor_day"], c["tz"]) for c in cycle] == [(15, NY)]
        assert sent + 60 <= cycle[0]["from"] <= answered + 61  # (a minute on, whole seconds)
        instants = [
            ts(2027, 2, 28, 23),  # February 28, 18:00 EST (UTC: February)
            ts(2027, 3, 1, 4, 30),  # February 28, 23:30 EST (UTC: March)
            ts(2027, 3, 1, 6),  # March 1, 01:00 EST
            ts(2027, 3, 14, 6, 30),  # March 14, 01:30 EST, before the change to EDT
            ts(2027, 3, 14, 7, 30),  # March 14, 03:30 EDT, after it
            FEB_END - 60,  # March 14, 23:59 EDT (UTC: March 15)
            FEB_END,  # March 15, 00:00 EDT
        ]
        for i, at in enumerate(instants):
            for tenant in ("acme", "plain"):
                node.call("track", tenant, "api", 10**i, {"at": at})
                node.call("track", tenant, "api_daily", 10**i, {"at": at})
        assert node.call("usage", "acme", "api", {"at": ts(2027, 3, 1)}) == 111111
        assert node.call("usage", "acme", "api", {"at": FEB_END}) == 1000000
        assert node.call("usage", "plain", "api", {"at": ts(2027, 2, 20)}) == 1
        assert node.call("usage", "plain", "api", {"at": ts(2027, 3, 20)}) == 1111110
        # The day of the change to daylight time is one local day of 23 hours.
        dst_day = {"at": instants[3]}
        assert node.call("usage", "acme", "api_daily", dst_day) == 1000 + 10000 + 100000
        assert node.call("usage", "plain", "api_daily", dst_day) == 1000 + 10000
        assert node.call("usage_all", "acme", dst_day) == {"api": 111111, "api_daily": 111000}
        wait_for(lambda: export(node, FEB)[1] == {("acme", "api"): 111111}, what="FEB stored")

        def march() -> bool:
            return export(node, "2027-03")[1].get(("plain", "api")) == 1111110

        wait_for(march, what="the UTC tenant's March stored")
        months = {"granularity": "month", "from": "2027-02", "to": "2027-03"}
        history = node.call("history", "acme", "api", months)
        # (the UTC month the anchor was set in, then New York's periods from a minute on)
        assert history == [
            ["2027-02", 0],
            [f"2027-01@15:{NY}", 0],
            [FEB, 111111],
            [MAR, 1000000],
        ]
        days = {"from": "2027-03-13", "to": "2027-03-15"}
        daily = node.call("history", "acme", "api_daily", days)
        assert daily == [["2027-03-13", 0], ["2027-03-14", 111000], ["2027-03-15", 1000000]]

    # The node's own clock across FEB's end, calls without ``at``. A call's period is
    # judged between its send and its answer: the node's clock read before the send and
    # after the answer brackets it.
    with node_at(workdir, FEB_END - 6, METER_PERIOD_GRACE_S="2") as node:
        shift = node.clock_shift
        assert shift is not None
        assert {FEB, MAR} <= set(node.call("status")["periods"]["open"])  # (marked first)
        before = after = calls = 0
        deadline = time.monotonic() + 30
        while after < 5 and time.monotonic() < deadline:
            sent = time.time() + shift
            value = node.call("track", "acme", "api", 1)
            answered = time.time() + shift
            calls += 1
            if answered < FEB_END:
                before += 1
                assert value == 111111 + before
            elif sent >= FEB_END:
                after += 1
            time.sleep(0.2)
        assert before >= 5 and after == 5
        feb_total = node.call("usage", "acme", "api", {"at": FEB_END - 1})
        mar_total = node.call("usage", "acme", "api", {"at": FEB_END})
        assert (feb_total - 111111) + (mar_total - 1000000) == calls
        assert feb_total - 111111 >= before and mar_total - 1000000 >= after

        def closed() -> bool:
            return FEB not in node.call("status")["periods"]["open"]

        wait_for(closed, timeout=20, what="FEB closed after its end plus the grace")
        page, rows = export(node, FEB)
        assert page["final"] is True and page["open_nodes"] == [] and page["nodes"] == 1
        assert rows == {("acme", "api"): feb_total}
        assert MAR in node.call("status")["periods"]["open"]


def test_history_across_a_change_of_calendar_counts_each_stretch_once(workdir: Path) -> None:
    """A tenant moved from the UTC calendar to New York's 15th a minute after February 1
    00:00 UTC: a day feature's units of January 31 (UTC) and of New York's January 31 (the
    first hours of February 1 UTC) are both that date's; each period's month row holds only
    the tenant's stretch of it; a month feature's day buckets and a gauge's months agree,
    from the node's memory before any flush and from storage after a drain and restart."""
    t0 = ts(2027, 2, 1)
    env = {"METER_FLUSH_INTERVAL_MS": "600000"}
    instants = [t0 - 3600, t0 + 30, t0 + 1800, t0 + 6 * 3600]  # (the change: t0 + 60)
    with node_at(workdir, t0, **env) as node:
        node.call("set_feature", "temp", {"aggregation": "max"})
        node.call("assign_plan", "acme", None, {"anchor_day": 15, "tz": NY, "effective": "now"})
        assert node.clock_shift is not None
        answered = time.time() + node.clock_shift  # (the node's clock once it answered)
        # A minute after the call, by the node's clock (a loaded machine starts it late).
        assert t0 + 60 <= node.call("limits", "acme")["cycle"][0]["from"] <= answered + 61
        for i, at in enumerate(instants):
            for feature in ("api", "api_daily"):
                node.call("track", "acme", feature, 10**i, {"at": at})
        for at, value in zip(instants[:3], (5, 0, 7), strict=True):
            node.call("track", "acme", "temp", value, {"at": at})
        unflushed = _histories(node)
    node = node_at(workdir, t0 + 120, **env)  # (drained: everything stored)
    with node:
        stored = _histories(node)
    assert unflushed == stored
    months, days, api_days, temp = stored
    assert days == [["2027-01-30", 0], ["2027-01-31", 101], ["2027-02-01", 1010], ["2027-02-02", 0]]
    assert months == [
        ["2027-01", 1],
        ["2027-02", 10],
        [f"2027-01@15:{NY}", 1100],
        [f"2027-02@15:{NY}", 0],
    ]
    # A month counter's day buckets: its units on the day each period's flush dated them (the
    # UTC January's on its last day, New York's first period's on its January 31).
    assert api_days == [["2027-01-31", 1101], ["2027-02-01", 10]]
    assert temp == [
        ["2027-01", 5],
        ["2027-02", 0],
        [f"2027-01@15:{NY}", 7],
        [f"2027-02@15:{NY}", 0],
    ]


def _histories(node: NodeProcess) -> tuple[Any, ...]:
    months = {"granularity": "month", "from": "2027-01", "to": "2027-02"}
    return (
        node.call("history", "acme", "api_daily", months),
        node.call("history", "acme", "api_daily", {"from": "2027-01-30", "to": "2027-02-02"}),
        node.call("history", "acme", "api", {"from": "2027-01-31", "to": "2027-02-01"}),
        node.call("history", "acme", "temp", months),
    )


def test_an_anchor_at_a_time_of_day_splits_its_start_date_between_two_periods(
    workdir: Path,
) -> None:
    """Anchored on the 15th at 09:30 in New York: calls without ``at`` while the node's clock
    crosses 09:30 on December 15 count in November's period before it and December's after;
    both periods keep a day bucket of December 15, and ``history`` of that date is every
    call, from memory and from storage after a restart; after the grace November's export
    is final with exactly its units."""
    nov, dec = f"2026-11@15T09:30:{NY}", f"2026-12@15T09:30:{NY}"
    end = ts(2026, 12, 15, 14, 30)  # (09:30 EST)
    with node_at(workdir, ts(2026, 12, 1)) as node:
        opts = {"anchor_day": 15, "anchor_time": "09:30", "tz": NY, "effective": "now"}
        node.call("assign_plan", "acme", None, opts)
        (change,) = node.call("limits", "acme")["cycle"]
        assert (change["anchor_day"], change["anchor_time"], change["tz"]) == (15, "09:30", NY)
    day = {"from": "2026-12-15", "to": "2026-12-15"}
    with node_at(workdir, end - 6, METER_PERIOD_GRACE_S="2") as node:
        shift = node.clock_shift
        assert shift is not None
        before = after = calls = 0
        deadline = time.monotonic() + 30
        while after < 5 and time.monotonic() < deadline:
            sent = time.time() + shift
            node.call("track", "acme", "api", 1)
            node.call("track", "acme", "api_daily", 1)
            answered = time.time() + shift
            calls += 1
            before += answered < end
            after += sent >= end
            time.sleep(0.2)
        assert before >= 5 and after == 5
        in_nov = node.call("usage", "acme", "api", {"at": end - 1})
        in_dec = node.call("usage", "acme", "api", {"at": end})
        assert in_nov + in_dec == calls and in_nov >= before and in_dec >= after
        months = {"granularity": "month", "from": "2026-12", "to": "2026-12"}
        assert node.call("history", "acme", "api", months) == [
            ["2026-12", 0], [nov, in_nov], [dec, in_dec]
        ]  # fmt: skip
        assert node.call("history", "acme", "api", day) == [["2026-12-15", calls]]
        # A day feature's December 15 is one counter: the month period holding its midnight.
        assert node.call("history", "acme", "api_daily", day) == [["2026-12-15", calls]]
        assert node.call("history", "acme", "api_daily", months) == [
            ["2026-12", 0], [nov, calls], [dec, 0]
        ]  # fmt: skip

        def closed() -> bool:
            return nov not in node.call("status")["periods"]["open"]

        wait_for(closed, timeout=20, what="November's period closed after its end plus grace")
        page, rows = export(node, nov)
        assert page["final"] is True and rows == {("acme", "api"): in_nov}
    with node_at(workdir, end + 60) as node:  # (drained: both buckets stored)
        assert node.call("history", "acme", "api", day) == [["2026-12-15", calls]]
        assert node.call("history", "acme", "api_daily", day) == [["2026-12-15", calls]]
        assert node.call("history", "acme", "api_daily", months) == [
            ["2026-12", 0], [nov, calls], [dec, 0]
        ]  # fmt: skip
        assert export(node, dec)[1] == {("acme", "api"): in_dec}
