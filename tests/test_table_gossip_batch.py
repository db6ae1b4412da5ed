"""CounterTable.take_gossip_all and apply_remote_many: the batch forms the gossip layer uses
equal the per-key take_gossip / apply_remote they replace, whatever came before."""

from __future__ import annotations

from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from meter.core.table import CounterTable
from storage.base import Snapshot

KEYS = [("t", f, "2026-11") for f in ("a", "b", "c", "d")]
PEERS = ["n1", "n2", "n3"]  # n1 is the table's own id: its deltas must be skipped

keys = st.sampled_from(KEYS)
ops = st.one_of(
    st.tuples(st.just("incr"), keys, st.integers(-5, 20)),
    st.tuples(st.just("seed"), keys, st.integers(0, 50), st.integers(0, 3)),
    st.tuples(st.just("flush"), keys, st.booleans()),
    st.tuples(st.just("take"), st.integers(0, 3)),
    st.tuples(
        st.just("remote"),
        st.sampled_from(PEERS),
        st.lists(st.tuples(keys, st.integers(1, 4), st.integers(-3, 9)), max_size=6),
    ),
    st.tuples(st.just("rebase"), keys, st.integers(0, 99), st.integers(0, 4)),
    st.tuples(st.just("evict")),
)


def _per_key_take(t: CounterTable) -> list[tuple[str, str, str, int, int]]:
    out = []
    for key in t.touched_keys():
        for seq, delta in t.take_gossip(key):
            if delta:
                out.append((key[0], key[1], key[2], seq, delta))
    return out


def _row(t: CounterTable, key: Any) -> Any:
    """Every column and flag of a row, and its extension's contents (None: no extension)."""
    row = t._rows[key]
    ext = row.ext
    return (
        row.base, row.flags, row.own_seq, row.inflight, row.pending_flush,
        row.pending_gossip, row.extra,
        None if ext is None else (
            ext.reserved, ext.leases, ext.remote_total, ext.peer_seqs,
            None if ext.remote is None else {p: dict(s) for p, s in ext.remote.items()},
            None if ext.sealed is None else list(ext.sealed),
        ),
    )  # fmt: skip


def _state(t: CounterTable) -> Any:
    rows = sorted((k, _row(t, k)) for k in t.keys())  # noqa: SIM118 (a method, not a dict)
    return rows, sorted(t.touched_keys()), sorted(t.dirty_keys())


K0, K1 = KEYS[0], KEYS[1]


@settings(max_examples=300, deadline=None)
@given(st.lists(ops, max_size=40))
# A take then -n (nothing to write, yet peers were told +n: the sequence is still written,
# C07); a take between an unacknowledged flush and its retry; remote deltas then a re-base
# holding some; two keys un-touched and seeded again in another order.
@example([("seed", K0, 0, 0), ("incr", K0, 5), ("take", 0), ("incr", K0, -5), ("flush", K0, True)])
@example(
    [("seed", K0, 0, 0), ("incr", K0, 3), ("flush", K0, False), ("take", 0), ("flush", K0, True)]
)
@example([("seed", K0, 0, 1), ("remote", "n2", [(K0, 2, 4), (K0, 1, 9)]), ("rebase", K0, 20, 2)])
@example(
    [
        ("incr", K0, 2),
        ("take", 0),
        ("incr", K1, 1),
        ("seed", K0, 0, 0),
        ("seed", K1, 0, 0),
        ("take", 0),
    ]
)
def test_batch_gossip_equals_per_key(steps: list[tuple[Any, ...]]) -> None:
    a, b = CounterTable("n1"), CounterTable("n1")  # a: batch forms; b: per key
    for step in steps:
        kind = step[0]
        if kind == "incr":
            assert a.incr(step[1], step[2]) == b.incr(step[1], step[2])
        elif kind == "seed":
            snap = Snapshot(step[2], {"n2": step[3]} if step[3] else {})
            assert a.seed(step[1], snap) == b.seed(step[1], snap)
        elif kind == "flush":
            ta, tb = a.take_flush(step[1]), b.take_flush(step[1])
            assert ta == tb
            if ta is not None and step[2]:  # acknowledged: the store now holds it
                seq, delta = ta
                based = a.based_on(step[1])
                assert based is not None
                seqs = {**based.seqs, "n1": seq}
                snap = Snapshot(based.total + delta, seqs)
                assert a.rebase(step[1], snap) == b.rebase(step[1], snap)
        elif kind == "take":
            # Items of different keys may come in another order: the per-key take leaves a key
            # it un-touched in the list (compacted away later), where a key seeded again
            # keeps its old place; take_gossip_all empties the list. A key's own items keep
            # their order.
            assert sorted(a.take_gossip_all()) == sorted(_per_key_take(b))
        elif kind == "remote":
            peer, items = step[1], step[2]
            flat = [(*k, seq, d) for k, seq, d in items]
            want = sum(b.apply_remote(k, peer, seq, d) for k, seq, d in items)
            assert a.apply_remote_many(peer, flat) == want
        elif kind == "rebase":
            snap = Snapshot(step[2], {"n2": step[3]})
            assert a.rebase(step[1], snap, "gossip") == b.rebase(step[1], snap, "gossip")
        elif kind == "evict":
            assert a.evict_idle() == b.evict_idle()
        assert _state(a) == _state(b)
    assert sorted(a.take_gossip_all()) == sorted(_per_key_take(b))
    assert _state(a) == _state(b)


def test_take_gossip_all_leaves_nothing_touched() -> None:
    t = CounterTable("n1")
    t.seed(KEYS[0], Snapshot(0, {}))
    t.incr(KEYS[0], 3)
    t.incr(KEYS[1], 2)  # cold: unseeded, its flush sequence unknown, not gossiped yet
    assert t.take_gossip_all() == [("t", "a", "2026-11", 1, 3)]
    assert t.touched_keys() == []
    assert t.take_gossip_all() == []
    t.seed(KEYS[1], Snapshot(10, {}))  # seeding marks it touched again
    assert t.take_gossip_all() == [("t", "b", "2026-11", 1, 2)]


def test_apply_remote_many_skips_own_id_and_cold_keys() -> None:
    t = CounterTable("n1")
    t.seed(KEYS[0], Snapshot(5, {"n2": 2}))
    items = [("t", "a", "2026-11", 2, 7), ("t", "a", "2026-11", 3, 4), ("t", "z", "2026-11", 1, 9)]
    assert t.apply_remote_many("n1", items) == 0
    assert t.apply_remote_many("n2", items) == 1  # seq 2 is in the base; z is cold
    assert t.value(KEYS[0]) == 9
