"""CounterTable.incr_seeded: the batch form of incr that track_many uses."""

from __future__ import annotations

import pytest

from meter.core.keys import QTY_MAX
from meter.core.table import CounterTable, PartlyRefused
from meter.errors import InvalidArgument
from storage.base import EMPTY, Snapshot


def test_incr_seeded_counts_warm_keys_like_incr() -> None:
    a, b = CounterTable("n1"), CounterTable("n1")
    warm = ("t", "f", "2026-11")
    based = ("t", "g", "2026-11")
    for t in (a, b):
        t.seed(warm, EMPTY)
        t.seed(based, Snapshot(40, {"n2": 3}))
    got = a.incr_seeded([(warm, 2), (based, 1), (warm, -1)])
    want = [b.incr(warm, 2), b.incr(based, 1), b.incr(warm, -1)]
    assert got == want == [2, 41, 1]
    for key in (warm, based):
        assert a.columns(key) == b.columns(key)
    assert sorted(a.dirty_keys()) == sorted(b.dirty_keys())
    assert sorted(a.touched_keys()) == sorted(b.touched_keys())
    assert a.incr_seeded([]) == []


def test_incr_seeded_counts_nothing_if_any_key_is_cold_or_unseeded() -> None:
    t = CounterTable("n1")
    warm = ("t", "f", "2026-11")
    cold = ("t", "h", "2026-11")
    unseeded = ("t", "u", "2026-11")
    t.seed(warm, EMPTY)
    assert t.incr(unseeded, 1) is None
    before = t.columns(warm)
    assert t.incr_seeded([(warm, 2), (cold, 5)]) is None
    assert t.incr_seeded([(warm, 2), (unseeded, 5)]) is None
    assert t.columns(warm) == before, "nothing of the batch was counted"
    assert not t.is_warm(cold)
    assert t.pending(unseeded) == 1


def test_try_incr_counts_seeded_keys_only() -> None:
    t, ref = CounterTable("n1"), CounterTable("n1")
    warm = ("t", "f", "2026-11")
    cold = ("t", "c", "2026-11")
    unseeded = ("t", "u", "2026-11")
    for table in (t, ref):
        table.seed(warm, Snapshot(10, {}))
        table.incr(unseeded, 1)
    assert t.try_incr(warm, 3) == ref.incr(warm, 3) == 13
    assert t.columns(warm) == ref.columns(warm)
    assert t.try_incr(cold, 3) is None and not t.is_warm(cold)
    assert t.try_incr(unseeded, 3) is None and t.pending(unseeded) == 1


def test_incr_seeded_refuses_only_the_items_past_64_bits() -> None:
    t, ref = CounterTable("n1"), CounterTable("n1")
    top = ("t", "f", "2026-11")
    other = ("t", "g", "2026-11")
    for table in (t, ref):
        table.seed(top, Snapshot(QTY_MAX - 1, {}))
        table.seed(other, EMPTY)
    with pytest.raises(PartlyRefused) as info:
        t.incr_seeded([(top, 1), (top, 1), (other, 2), (top, -5), (top, 5), (other, 1)])
    answers = info.value.answers
    assert answers[0] == QTY_MAX and answers[2] == 2 and answers[3] == QTY_MAX - 5
    assert answers[4] == QTY_MAX and answers[5] == 3
    assert isinstance(answers[1], InvalidArgument) and "64-bit" in answers[1].message
    for qty in (1, -5, 5):
        ref.incr(top, qty)
    ref.incr(other, 3)
    assert t.columns(top) == ref.columns(top) and t.columns(other) == ref.columns(other)
    with pytest.raises(InvalidArgument):
        t.try_incr(top, 1)
    assert t.incr_prefix([(other, 1), (top, 1), (other, 1)]) == [4], "the run stops there"
    assert t.value(top) == QTY_MAX and t.value(other) == 4


def test_pending_units_sums_pending_over_the_keys() -> None:
    t = CounterTable("n1")
    a, b, cold = ("t", "a", "2026-11"), ("t", "b", "2026-11"), ("t", "c", "2026-11")
    t.seed(a, EMPTY)
    t.seed(b, EMPTY)
    t.incr(a, 3)
    t.incr(b, 4)
    assert t.take_flush(a) == (1, 3)  # in flight still counts
    t.incr(a, 2)
    keys = [a, b, cold, a]
    assert t.pending_units(keys) == sum(t.pending(k) for k in keys) == 14
    assert t.pending_units([]) == 0


def test_unflushed_lists_each_key_with_units_once() -> None:
    """A cold key counted before it is seeded is both dirty and unseeded: the backlog holds it
    (and its units) once; excluded keys (parked) are left out."""
    t = CounterTable("n1")
    a, b, parked = ("t", "a", "2026-11"), ("t", "b", "2026-11"), ("t", "p", "2026-11")
    cold, restored = ("t", "c", "2026-11"), ("t", "r", "2026-11")
    for key in (a, b, parked):
        t.seed(key, EMPTY)
    t.incr(a, 3)
    t.incr(parked, 9)
    assert t.take_flush(a) == (1, 3)  # in flight still counts
    t.incr(a, 2)
    t.incr(cold, 4, check=False)  # counted before its stored total is known
    t.restore(restored, 7, 6, 0)  # replayed from the log: in flight, unseeded
    held = dict(t.unflushed({parked}))
    assert held == {a: 5, cold: 4, restored: 6}  # (each key's units: in flight and pending)
    assert sum(held.values()) == sum(t.pending(k) for k in (a, cold, restored))
    assert dict(t.unflushed(())) == {**held, parked: 9}  # b: nothing
