"""Billing-cycle periods (docs/periods.md, ADR 0021): period names read alone, a tenant's
schedule of anchor changes, and the node's keys by them (correctness Y01-Y04)."""

from __future__ import annotations

import calendar
import itertools
import math
import time
from datetime import UTC, date, datetime
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meter.core.cycles import (
    NOTICE_S,
    calendar_at,
    changed,
    check_cycle_opts,
    decode,
    encode,
    month_days,
    period_name,
    periods_between,
)
from meter.core.keycache import KeyCache
from meter.errors import InvalidArgument, PeriodClosed
from meter.persist.closing import periods_to_open
from meter.quotas.methods import LimitMethods
from meter.quotas.store import LimitStore
from storage import periods as P
from storage.base import StoragePermanentError, check_day_of, check_period
from storage.memory import MemoryStorage

NY = "America/New_York"
ZONES = sorted(P.known_zones())


def ts(*parts: int) -> float:
    return float(calendar.timegm((*parts, 0, 0, 0, 0, 0, 0)[:6]))


# -- the period function: total, contiguous, non-overlapping (P01) ----------------------------


@st.composite
def _instants(draw: st.DrawFn, zone: str, day: int, minute: int) -> float:
    """Any instant, or one a few hours from the anchor's local time on its day (where a
    clock change next to a period's start matters)."""
    if draw(st.booleans()):
        return draw(st.floats(ts(1971, 1, 1), ts(2100, 1, 1), allow_nan=False))
    year, month = draw(st.integers(1971, 2099)), draw(st.integers(1, 12))
    local = datetime(year, month, P.month_start_day(year, month, day), tzinfo=ZoneInfo(zone))
    return local.timestamp() + minute * 60 + draw(st.floats(-4 * 3600, 4 * 3600))


@settings(max_examples=400, deadline=None)
@given(
    day=st.integers(1, 31),
    zone=st.sampled_from(ZONES),
    minute=st.one_of(st.just(0), st.integers(0, P.MINUTES_A_DAY - 1)),
    kind=st.sampled_from(["month", "day"]),
    data=st.data(),
)
def test_every_instant_is_in_exactly_one_period_and_periods_follow_in_order(
    day: int, zone: str, minute: int, kind: P.PeriodKind, data: st.DataObject
) -> None:
    """For any anchor (day and time of day), zone and instant: the period named for the
    instant holds it, the next period starts exactly where it ends and the one before ends
    exactly where it starts (no gap, no overlap), its name parses back to itself, and an
    instant one period later is named after it."""
    at = data.draw(_instants(zone, day, minute))
    c = P.cycle(day, zone, minute)
    name = P.name(c, kind, at)
    start, end = P.bounds(name)
    assert start <= at < end
    after, before = P.following(name), P.preceding(name)
    assert P.bounds(after)[0] == end and P.bounds(before)[1] == start
    assert P.preceding(after) == name and P.following(before) == name
    assert P.name(c, kind, end) == after and P.name(c, kind, start) == name
    if P.bounds(before)[0] < start - 0.001:  # (a day a zone skipped is an empty period)
        assert P.name(c, kind, start - 0.001) == before
    assert P.parse(name).kind == kind
    if kind == "month":
        first, last = P.days(name)
        bucket = P.day_of(name, at)
        assert first <= date.fromisoformat(P.bucket_date(bucket)) <= last
        assert P.bucket_of(bucket, name) and not P.bucket_of(bucket, after)
        assert not P.bucket_of(bucket, before)
        zone_of = ZoneInfo("UTC" if c is None else c.zone)
        local = datetime.fromtimestamp(math.floor(at), zone_of).date()
        assert P.bucket_date(bucket) == local.isoformat()  # (its own date: no clamping)
        check_day_of(bucket, name)
        assert P.bounds(name)[1] - P.bounds(name)[0] <= 32 * 86400


def test_a_short_month_starts_on_its_last_day_and_the_next_on_the_anchor() -> None:
    """Anchored on the 31st (UTC): February's period starts on the 28th (29th in a leap
    year), March's on the 31st; anchored on the 30th, a leap February starts on the 29th."""
    c = P.cycle(31, "UTC")
    feb = P.name(c, "month", ts(2027, 3, 1))
    assert feb == "2027-02@31:UTC"
    assert P.bounds(feb) == (ts(2027, 2, 28), ts(2027, 3, 31))
    assert P.name(c, "month", ts(2027, 3, 30, 23)) == feb
    assert P.name(c, "month", ts(2028, 2, 29, 12)) == "2028-02@31:UTC"
    assert P.bounds("2028-02@30:UTC") == (ts(2028, 2, 29), ts(2028, 3, 30))
    assert P.days(feb) == (date(2027, 2, 28), date(2027, 3, 30))


def test_an_anchor_off_midnight_names_its_periods_and_starts_at_its_local_time() -> None:
    """Anchored on the 15th at 09:30 in New York: the period starts at 09:30 local (14:30
    UTC in winter, 13:30 in summer), its name carries the time, its start date is in two
    periods, each with its own bucket of it; a time the clock skips is read with the offset
    before the change, a time it shows twice is the first."""
    c = P.cycle(15, NY, 9 * 60 + 30)
    assert c == P.Cycle(15, NY, 570)
    nov = P.name(c, "month", ts(2026, 12, 15, 14, 29))  # (09:29 EST on December 15)
    assert nov == "2026-11@15T09:30:America/New_York"
    assert P.bounds(nov) == (ts(2026, 11, 15, 14, 30), ts(2026, 12, 15, 14, 30))
    assert P.name(c, "month", ts(2026, 12, 15, 14, 30)) == "2026-12@15T09:30:America/New_York"
    assert P.bounds("2027-03@15T09:30:America/New_York")[0] == ts(2027, 3, 15, 13, 30)  # EDT
    assert P.days(nov) == (date(2026, 11, 15), date(2026, 12, 15))
    last = P.day_of(nov, ts(2026, 12, 15, 14, 29))
    first = P.day_of(P.following(nov), ts(2026, 12, 15, 14, 30))
    assert last == "2026-12-15@2026-11@15T09:30:America/New_York"
    assert first == "2026-12-15@2026-12@15T09:30:America/New_York"
    assert P.bucket_of(last, nov) and not P.bucket_of(last, P.following(nov))
    assert P.bucket_of(first, P.following(nov)) and not P.bucket_of(first, nov)
    assert not P.bucket_of("2026-12-15@15T09:30:America/New_York", nov)
    # New York's clocks: 02:00 -> 03:00 on March 14, 2027; 02:00 -> 01:00 on November 7.
    assert P.bounds("2027-03@14T02:30:America/New_York")[0] == ts(2027, 3, 14, 7, 30)
    assert P.bounds("2027-11@7T01:30:America/New_York")[0] == ts(2027, 11, 7, 5, 30)
    # Day periods stay the zone's midnight-to-midnight days; UTC at midnight on the 1st is
    # the UTC calendar, any other time there is a cycle.
    assert P.name(c, "day", ts(2026, 12, 15, 14, 29)) == "2026-12-15@America/New_York"
    assert P.cycle(1, "UTC", 0) is None
    assert P.name(P.cycle(1, "Etc/UTC", 60), "month", ts(2027, 1, 1, 0, 30)) == (
        "2026-12@1T01:00:UTC"
    )


def test_a_day_split_by_an_anchor_time_is_the_earlier_periods_whatever_the_range() -> None:
    """A day feature's month rows: a day counts in the month period holding its midnight,
    so the start date of a period anchored at 09:30 is the period before's, whether the
    range asked starts there or a month earlier."""
    schedule = ((ts(2020, 1, 1), P.cycle(15, NY, 570)),)
    nov = f"2026-11@15T09:30:{NY}"

    def days_of(month: str, first_utc: tuple[int, int], last_utc: tuple[int, int]) -> list[str]:
        start, end = ts(*first_utc, 1), ts(*last_utc, 28)
        periods = periods_between(schedule, "month", start, end)
        spans = month_days(schedule, periods, start, end)
        return [p[:10] for p, at, _ in spans if period_name(schedule, "month", at) == month]

    narrow = days_of(nov, (2026, 12), (2026, 12))
    wide = days_of(nov, (2026, 11), (2026, 12))
    assert narrow == wide
    assert (narrow[0], narrow[-1], len(narrow)) == ("2026-11-16", "2026-12-15", 30)


def test_a_day_a_change_of_cycle_splits_in_its_zone_is_one_periods_whatever_the_range() -> None:
    """A change of cycle in the same zone at 09:30 on December 15 (the anchor time's period
    ends there): December 15 is one day counter, in the period holding its midnight, whether
    the range asked starts at the new cycle's first month or a month before."""
    before, after = P.cycle(15, NY, 570), P.cycle(1, NY)
    change = P.bounds(f"2026-11@15T09:30:{NY}")[1]
    schedule = ((ts(2020, 1, 1), before), (change, after))

    def rows(first_utc: tuple[int, int], last_utc: tuple[int, int]) -> dict[str, list[str]]:
        start, end = ts(*first_utc, 1), ts(*last_utc, 28)
        periods = periods_between(schedule, "month", start, end)
        out: dict[str, list[str]] = {p: [] for p in periods}
        for day, at, _ in month_days(schedule, periods, start, end):
            month = period_name(schedule, "month", at)
            if month in out:
                out[month].append(day[:10])
        return out

    narrow, wide = rows((2027, 1), (2027, 1)), rows((2026, 12), (2027, 1))
    dec = f"2026-12@1:{NY}"
    assert narrow[dec] == wide[dec] and narrow[dec][0] == "2026-12-16"
    assert wide[f"2026-11@15T09:30:{NY}"][-1] == "2026-12-15"


def test_utc_periods_and_days_are_judged_on_the_whole_second() -> None:
    """An instant a hair before midnight is the day (and month) before, by the key cache's
    UTC periods, by period names and by the day a flush dates a bucket."""
    from meter.core.keys import period_start
    from meter.history.days import utc_day

    at = ts(2025, 12, 1) - 2e-7
    assert period_start("month", at) == P.name(None, "month", at) == "2025-11"
    assert period_start("day", at) == P.name(None, "day", at) == utc_day(at) == "2025-11-30"


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("2026-11@15T00:00:America/New_York", "without T00:00"),
        ("2026-11@15T24:00:America/New_York", "HH:MM"),
        ("2026-11@15T09:60:America/New_York", "HH:MM"),
        ("2026-11@15T9:30:America/New_York", "not a period name"),
        ("2026-11@T09:30:America/New_York", "not a period name"),
        ("2026-11-15@T09:30:America/New_York", "not a period name"),
        ("2026-11-15@15T09:30:America/New_York", "not a period name"),
    ],
)
def test_names_of_anchors_off_midnight_are_canonical(name: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        P.parse(name)
    assert not P.is_period(name)


def test_a_period_across_a_dst_change_starts_and_ends_at_local_midnight() -> None:
    """Anchored on the 15th in New York: the period from February 15 (EST, UTC-5) to March
    15 (EDT, UTC-4) is 28 days less an hour; its local days are 24 hours except March 14's
    23; November 1's (back to EST) is 25."""
    c = P.cycle(15, NY)
    name = P.name(c, "month", ts(2027, 3, 1))
    assert name == "2027-02@15:America/New_York"
    assert P.bounds(name) == (ts(2027, 2, 15, 5), ts(2027, 3, 15, 4))
    assert P.bounds(name)[1] - P.bounds(name)[0] == 28 * 86400 - 3600
    assert P.name(c, "month", ts(2027, 3, 15, 3, 59)) == name  # (still the 14th in New York)
    assert P.name(c, "month", ts(2027, 3, 15, 4)) == "2027-03@15:America/New_York"
    short = P.name(c, "day", ts(2027, 3, 14, 12))
    assert short == "2027-03-14@America/New_York"
    assert P.bounds(short)[1] - P.bounds(short)[0] == 23 * 3600
    long = P.name(c, "day", ts(2026, 11, 1, 12))
    assert P.bounds(long)[1] - P.bounds(long)[0] == 25 * 3600
    assert P.day_of(name, ts(2027, 3, 1, 3)) == "2027-02-28@15:America/New_York"  # (10 pm)


def test_only_canonical_names_are_periods() -> None:
    """Every name a period can have is accepted by storage; the UTC calendar spelled with
    ``@``, an anchor with a leading zero, an unknown zone, a day with an anchor, a month
    without one, and a period ending after 9999 are refused with a clear error."""
    for good in ("2026-11", "2026-11-30", "2026-11@15:America/New_York", "2026-11-30@Asia/Tokyo"):
        assert check_period(good) == good
    for bad, why in [
        ("2026-11@1:UTC", "UTC calendar"),
        ("2026-11-30@UTC", "UTC calendar"),
        ("2026-11@05:America/New_York", "not a period name"),
        ("2026-11@15:Mars/Olympus", "not a known IANA zone"),
        ("2026-11@15:../../etc/passwd", "not an IANA zone name"),
        ("2026-11@15:Etc/UTC", "name UTC as UTC"),
        ("2026-11-30@GMT", "UTC calendar"),
        ("2026-11-30@2:Asia/Tokyo", "not a period name"),
        ("2026-11@Asia/Tokyo", "not a period name"),
        ("2026-11@32:Asia/Tokyo", "1..31"),
        ("9999-12@15:Asia/Tokyo", "after year 9999"),
        ("2026-02-30@Asia/Tokyo", "not a period name"),
    ]:
        with pytest.raises(StoragePermanentError, match=why):
            check_period(bad)


def test_a_day_bucket_must_lie_in_its_periods_local_dates() -> None:
    """A billing cycle's month has buckets of its own, named by its calendar, for its local
    dates only; a UTC month's are plain dates."""
    check_day_of("2026-12-14@15:America/New_York", "2026-11@15:America/New_York")
    check_day_of("2026-11-15@15:America/New_York", "2026-11@15:America/New_York")
    check_day_of("2026-11-30", "2026-11")
    for bad in (
        "2026-11-14@15:America/New_York",
        "2026-12-15@15:America/New_York",
        "2026-12-14",
        "2026-12-14@15:Asia/Tokyo",
        "2026-W48-1@15:America/New_York",
        "2026-11-15@America/New_York",
    ):
        with pytest.raises(StoragePermanentError, match="is not a day of"):
            check_day_of(bad, "2026-11@15:America/New_York")
    for bad in ("2026-11-30@15:America/New_York", "2026-11-20@", "2026-11-20@@"):
        with pytest.raises(StoragePermanentError, match="is not a day of"):
            check_day_of(bad, "2026-11")


# -- a tenant's schedule (P02) --------------------------------------------------------------


def test_a_change_takes_effect_at_the_end_of_the_period_in_force() -> None:
    """From the UTC calendar to the 15th in New York on December 7: December stays a UTC
    month; from January 1 the tenant's period is the New York one holding it (named
    ``2026-12@15``, its stretch January 1 to 15); then whole cycles. A second change before
    the first takes effect replaces it; a change to the calendar in force is none."""
    now = ts(2026, 12, 7, 10)
    c = P.cycle(15, NY)
    schedule = changed((), c, now)
    assert schedule == ((ts(2027, 1, 1), c),)
    assert period_name(schedule, "month", ts(2026, 12, 31, 23)) == "2026-12"
    assert period_name(schedule, "month", ts(2027, 1, 1)) == "2026-12@15:America/New_York"
    assert period_name(schedule, "month", ts(2027, 1, 20)) == "2027-01@15:America/New_York"
    assert periods_between(schedule, "month", ts(2026, 12, 10), ts(2027, 2, 1)) == [
        "2026-12",
        "2026-12@15:America/New_York",
        "2027-01@15:America/New_York",
    ]
    other = P.cycle(20, "Europe/Paris")
    assert changed(schedule, other, now) == ((ts(2027, 1, 1), other),)
    assert changed(schedule, None, now) == ()
    assert changed(schedule, c, now) == schedule  # (the same change again: the same)
    assert decode(encode(schedule)) == schedule
    later = ts(2027, 2, 1)
    assert changed(schedule, c, later) == schedule  # (in force: nothing to do)


def test_a_change_effective_now_waits_the_notice_only() -> None:
    now = ts(2026, 12, 7, 10)
    c = P.cycle(7, "UTC")
    schedule = changed((), c, now, "now")
    assert schedule == ((now + NOTICE_S, c),)
    assert period_name(schedule, "month", now) == "2026-12"
    assert period_name(schedule, "month", now + NOTICE_S) == "2026-12@7:UTC"
    assert calendar_at(schedule, now + NOTICE_S - 1) is None


@settings(max_examples=200, deadline=None)
@given(
    changes=st.lists(
        st.tuples(
            st.floats(0, 400 * 86400),
            st.one_of(st.none(), st.tuples(st.integers(1, 31), st.sampled_from(ZONES[:80]))),
            st.sampled_from(["next_period", "now"]),
        ),
        max_size=5,
    ),
    probe=st.floats(0, 500 * 86400),
)
def test_any_schedule_names_every_instant_once_and_in_order(
    changes: list[tuple[float, tuple[int, str] | None, str]], probe: float
) -> None:
    """Whatever anchor changes are made (any calendar, any time, either effect): the
    tenant's periods over a stretch hold every instant once, in order, and each instant's
    period is the one listed for it."""
    base = ts(2026, 1, 1)
    schedule: tuple[tuple[float, P.Cycle | None], ...] = ()
    clock = base
    for offset, spec, effective in sorted(changes, key=lambda change: change[0]):
        clock = max(clock, base + offset)
        c = None if spec is None else P.cycle(*spec)
        before = schedule
        schedule = changed(schedule, c, clock, "now" if effective == "now" else "next_period")
        # Nothing before the notice's end changes: a node may be counting by it already.
        for t in (base, clock - 86400, clock, clock + NOTICE_S / 2, clock + NOTICE_S - 0.001):
            assert calendar_at(schedule, t) == calendar_at(before, t)
    names = periods_between(schedule, "month", base, base + 500 * 86400)
    assert all(a != b for a, b in itertools.pairwise(names))
    at = base + probe
    name = period_name(schedule, "month", at)
    assert name in names
    start, end = P.bounds(name)
    assert start <= at < end  # (a period cut short by a change keeps its name's bounds)


def test_a_change_within_the_notice_is_fixed_and_changes_are_bounded() -> None:
    """A change due within the minute is kept whatever is asked next (a node may count by it
    already): the next one follows it; the 65th change kept is refused; an instant past year
    9999 in the tenant's zone is refused, one in 1969 is named."""
    now = ts(2026, 12, 7, 10)
    due = changed((), P.cycle(7, "UTC"), now, "now")
    assert changed(due, None, now + 30) == (due[0], (ts(2027, 1, 7), None))  # (then its end)
    again = changed(due, P.cycle(9, NY), now + 30, "now")
    assert again == (due[0], (now + 30 + NOTICE_S, P.cycle(9, NY)))
    schedule: tuple[tuple[float, P.Cycle | None], ...] = ()
    for i in range(64):
        schedule = changed(schedule, P.cycle(1 + i % 2, NY), now + i * 120, "now")
    with pytest.raises(ValueError, match="at most 64 times"):
        changed(schedule, P.cycle(20, NY), now + 64 * 120, "now")
    assert P.name(P.cycle(15, NY), "month", -86400.0) == "1969-12@15:America/New_York"
    with pytest.raises(ValueError, match="before year 10000"):
        P.name(P.cycle(15, "Pacific/Kiritimati"), "month", 253402300799.0)


def test_bad_cycle_options_are_refused_with_clear_errors() -> None:
    assert check_cycle_opts({}) is None
    assert check_cycle_opts({"anchor_day": 15, "tz": NY}) == (P.Cycle(15, NY), "next_period")
    assert check_cycle_opts({"anchor_day": 1, "tz": "UTC", "effective": "now"}) == (None, "now")
    assert check_cycle_opts({"anchor_time": "09:30"}) == (P.Cycle(1, "UTC", 570), "next_period")
    assert check_cycle_opts({"anchor_day": 1, "anchor_time": "00:00"}) == (None, "next_period")
    bad: list[tuple[dict[str, object], str]] = [
        ({"anchor_day": 0}, "1..31"),
        ({"anchor_day": 32}, "1..31"),
        ({"anchor_day": True}, "1..31"),
        ({"anchor_day": "15"}, "1..31"),
        ({"tz": "Nowhere/City"}, "not a known IANA zone"),
        ({"tz": "localtime"}, "not a known IANA zone"),
        ({"tz": "posix/America/New_York"}, "not a known IANA zone"),
        ({"tz": 5}, "IANA zone name"),
        ({"tz": NY, "effective": "later"}, "effective must be"),
        ({"effective": "now"}, "without anchor_day, anchor_time or tz"),
        ({"anchor_time": "24:00"}, "HH:MM"),
        ({"anchor_time": "9:30"}, "HH:MM"),
        ({"anchor_time": 570}, "HH:MM"),
        ({"anchor_time": "09:30:00"}, "HH:MM"),
    ]
    for opts, why in bad:
        with pytest.raises(ValueError, match=why):
            check_cycle_opts(opts)
    bodies = ["{}", "[[1, 15]]", '[[2, 15, "UTC"], [1, 15, "UTC"]]', '[["x", 1, "UTC"]]']
    bodies += ['[[1, 15, "UTC", 1440]]', '[[1, 15, "UTC", 1, 2]]']
    for body in bodies:
        with pytest.raises(ValueError):
            decode(body)
    # A stored schedule keeps a time of day; one at midnight is stored as before it had one.
    schedule = ((1.0, P.cycle(15, NY, 570)), (2.0, P.cycle(15, NY)))
    assert encode(schedule) == '[[1.0,15,"America/New_York",570],[2.0,15,"America/New_York"]]'
    assert decode(encode(schedule)) == schedule


# -- the node's keys (P03) ------------------------------------------------------------------


def test_keys_of_an_anchored_tenant_follow_its_schedule_and_others_stay_utc() -> None:
    keys = KeyCache({"api_daily": "day"}, False, 3600.0)
    schedule = ((ts(2020, 1, 1), P.cycle(15, NY)),)
    keys.new_cycles({"acme": schedule})
    at = ts(2027, 3, 1, 3)  # (February 28, 10 pm in New York)
    assert keys.key_for("acme", "api", at) == ("acme", "api", "2027-02@15:America/New_York")
    assert keys.key_for("acme", "api_daily", at) == (
        "acme",
        "api_daily",
        "2027-02-28@America/New_York",
    )
    assert keys.key_for("other", "api", at) == ("other", "api", "2027-03")
    now_key = keys.key_for("acme", "api")
    assert now_key[2] == P.name(P.cycle(15, NY), "month", keys.day_start)
    # The cached stretch ends at New York's next midnight at the latest.
    ny_day_end = P.bounds(P.name(P.cycle(15, NY), "day", keys.day_start))[1]
    assert keys.day_end <= ny_day_end
    # The grace is judged by the period's own end (March 15, 04:00 UTC).
    feb = ("acme", "api", "2027-02@15:America/New_York")
    keys.check_open(feb, at, ts(2027, 3, 15, 4, 59, 59))
    with pytest.raises(PeriodClosed):
        keys.check_open(feb, at, ts(2027, 3, 15, 5))


def test_with_the_hierarchy_every_level_follows_the_accounts_cycle() -> None:
    """``acme/alice`` counts by ``acme``'s cycle, so its call's levels share one period."""
    keys = KeyCache({}, True, 3600.0)
    keys.new_cycles({"acme": ((0.0, P.cycle(15, NY)),)})
    key = keys.key_for("acme/alice", "api", ts(2027, 3, 1))
    assert key == ("acme/alice", "api", "2027-02@15:America/New_York")
    assert {level[2] for level in keys.levels(key)} == {"2027-02@15:America/New_York"}
    assert keys.key_for("other/bob", "api", ts(2027, 3, 1))[2] == "2027-03"


def test_a_calendar_out_of_use_for_longer_than_the_grace_is_no_longer_marked() -> None:
    keys = KeyCache({}, False, 3600.0)
    old, new = P.cycle(15, NY), P.cycle(20, "Asia/Tokyo")
    long_ago = 1_000_000_000.0
    keys.new_cycles({"acme": ((long_ago, old), (long_ago + 86400 * 60, new))})
    assert keys.calendars() == [None, new]
    recent = time.time() - 86400
    keys.new_cycles({"acme": ((long_ago, old), (recent, new))})
    assert keys.calendars() == [None, old, new]


async def test_with_the_hierarchy_a_cycle_is_set_on_the_account_only() -> None:
    """A cycle on ``acme/alice`` is refused (changing nothing); on ``acme`` it is stored, and
    assigning it again changes nothing more."""
    store = LimitStore(MemoryStorage(), lambda book: None)
    methods = LimitMethods(store, hierarchy=True)
    await store.refresh()
    with pytest.raises(InvalidArgument, match="set it on 'acme'"):
        await methods.assign_plan(["acme/alice", None, {"anchor_day": 15, "tz": NY}])
    assert store.book.cycles == {} and store.book.version == 0
    answer = await methods.assign_plan(["acme", None, {"anchor_day": 15, "tz": NY}])
    assert [(c["anchor_day"], c["tz"]) for c in answer["cycle"]] == [(15, NY)]
    version = store.book.version
    again = await methods.assign_plan(["acme", None, {"anchor_day": 15, "tz": NY}])
    assert again["cycle"] == answer["cycle"]
    assert store.book.version == version + 1  # (the assignment's write only)
    assert store.book.cycles["acme"][0][1] == P.Cycle(15, NY)


def test_a_new_schedule_starts_the_key_cache_over() -> None:
    keys = KeyCache({}, False, 3600.0)
    assert keys.key_for("acme", "api")[2] == P.name(None, "month", keys.day_start)
    keys.new_cycles({"acme": ((0.0, P.cycle(15, "Asia/Tokyo")),)})
    assert keys.key_for("acme", "api")[2].endswith("@15:Asia/Tokyo")


def test_an_instant_without_a_period_in_the_tenants_zone_is_refused() -> None:
    keys = KeyCache({}, False, 3600.0)
    keys.new_cycles({"acme": ((0.0, P.cycle(15, "Pacific/Kiritimati")),)})
    with pytest.raises(InvalidArgument, match="before year 10000"):
        keys.key_for("acme", "api", 253402300799.0)


def test_the_closer_marks_each_calendars_current_periods() -> None:
    now = ts(2026, 12, 7, 10)
    got = periods_to_open(["month"], [None, P.cycle(15, NY)], 3600.0, now)
    assert got == ["2026-12", "2026-11@15:America/New_York"]


def test_zone_days_are_named_by_the_local_date() -> None:
    moment = ts(2026, 12, 7, 3)  # (December 6, 10 pm in New York)
    assert P.name(P.cycle(1, NY), "day", moment) == "2026-12-06@America/New_York"
    assert datetime.fromtimestamp(moment, tz=UTC).date() == date(2026, 12, 7)
