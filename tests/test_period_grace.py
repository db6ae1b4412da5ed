"""The grace window (``period_grace_s``): a ``track`` or ``reserve`` with ``at`` in an ended
period counts there until the period's end plus the grace, and is refused with
``period_closed`` after, counting nothing; reads reach any period; a counted call's retry
answers as it did (docs/protocol.md, "Methods"; correctness L06)."""

from __future__ import annotations

import calendar
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from meter.core.keycache import KeyCache
from meter.errors import PeriodClosed, from_wire
from tests.support.nodes import BACKFILL, NodeProcess, raw_call


def _month_start(now: float) -> int:
    """The first instant of the UTC month holding ``now``."""
    moment = datetime.fromtimestamp(now, tz=UTC)
    return calendar.timegm((moment.year, moment.month, 1, 0, 0, 0))


def test_a_period_closes_for_calls_exactly_at_its_end_plus_the_grace() -> None:
    """The boundary, on the node's own check: open one second before the period's end plus
    the grace, closed at it; a day period closes a day after its start, plus the grace."""
    keys = KeyCache({"api_daily": "day"}, False, 600.0)
    at = calendar.timegm((2026, 11, 30, 23, 59, 59))
    end = calendar.timegm((2026, 12, 1, 0, 0, 0))
    month = keys.key_for("acme", "api", at)
    assert month == ("acme", "api", "2026-11")
    keys.check_open(month, at, end + 599.0)  # (open)
    with pytest.raises(PeriodClosed, match="period 2026-11 of 'api' closed"):
        keys.check_open(month, at, end + 600.0)
    day = keys.key_for("acme", "api_daily", at)
    keys.check_open(day, at, end + 599.0)
    with pytest.raises(PeriodClosed):
        keys.check_open(day, at, end + 600.0)
    # The current period is always open, whatever the grace.
    now = time.time()
    KeyCache({}, False, 0.0).check_open(month, now, now)


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
    """A call counted under an id while last month was open, retried under the same id after
    a restart with no grace, answers as it did and counts nothing more; a new call there is
    refused."""
    last_month = _month_start(time.time()) - 1
    first = NodeProcess(workdir, **BACKFILL)
    with first as node:
        assert node.call("track", "acme", "api", 3, {"at": last_month, "id": "late-1"}) == 3
    again = NodeProcess(workdir, METER_PERIOD_GRACE_S="0")
    with again as node:
        assert node.call("track", "acme", "api", 3, {"at": last_month, "id": "late-1"}) == 3
        error, _ = raw_call(node.socket, "track", "acme", "api", 3, {"at": last_month, "id": "x"})
        assert isinstance(from_wire(error), PeriodClosed), error
        assert node.call("usage", "acme", "api", {"at": last_month}) == 3
