"""``CounterTable.seed_many`` (the seeder's batch path) seeds exactly as ``seed`` does, key by
key, whatever the rows' states and the snapshots: a faster way, not another meaning."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from meter.core.keys import Key
from meter.core.table import CounterTable
from storage.base import Snapshot

NODE = "n1"
KEYS: list[Key] = [(f"t{i}", "api", "2026-11") for i in range(6)]

snapshots = st.builds(
    Snapshot,
    st.integers(-(10**6), 10**6),
    st.dictionaries(st.sampled_from([NODE, "n2", "n3"]), st.integers(1, 50), max_size=3),
)
# What happens to a key before the batch lands: nothing (cold), counted while unseeded,
# seeded already, or seeded, counted and flushed (in flight).
histories = st.sampled_from(["cold", "unseeded", "seeded", "inflight"])


def _prepare(table: CounterTable, key: Key, history: str, snap: Snapshot, qty: int) -> None:
    if history == "unseeded":
        table.incr(key, qty)
    elif history == "seeded":
        table.seed(key, snap)
        table.incr(key, qty)
    elif history == "inflight":
        table.seed(key, snap)
        table.incr(key, qty)
        table.take_flush(key)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(histories, snapshots, snapshots, st.integers(-5, 5)), min_size=6, max_size=6
    ),
    st.booleans(),
)
def test_seed_many_is_seed_key_by_key(
    cases: list[tuple[str, Snapshot, Snapshot, int]], evicted: bool
) -> None:
    one, many = CounterTable(NODE), CounterTable(NODE)
    for table in (one, many):
        for key, (history, before, _, qty) in zip(KEYS, cases, strict=True):
            _prepare(table, key, history, before, qty)
    read_at = one.epoch
    assert many.epoch == read_at
    if evicted:  # an eviction pass or a claim came after the read was issued: both refuse
        one.refuse_earlier_reads()
        many.refuse_earlier_reads()
    expected_seeded = 0
    expected_refused = []
    for key, (_, _, landed, _) in zip(KEYS, cases, strict=True):
        if one.seed(key, landed, read_at):
            expected_seeded += 1
        elif not one.is_seeded(key):
            expected_refused.append(key)
    seeded, refused = many.seed_many(
        [(k, landed) for k, (_, _, landed, _) in zip(KEYS, cases, strict=True)], read_at
    )
    assert (seeded, refused) == (expected_seeded, expected_refused)
    for key in KEYS:
        assert many.columns(key) == one.columns(key), key
        assert many.is_seeded(key) == one.is_seeded(key)
    assert many.dirty_keys() == one.dirty_keys()
    assert sorted(many.unseeded_keys()) == sorted(one.unseeded_keys())
    assert many.all_for("t0", "2026-11") == one.all_for("t0", "2026-11")
