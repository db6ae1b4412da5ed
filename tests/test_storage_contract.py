"""The storage contract: every backend must pass this one suite.

To add a backend, add its name to ``BACKENDS`` and a branch to ``_make``; backend-specific
fixtures (a server, a temp dir) are pulled in there with ``request.getfixturevalue``.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from storage.base import (
    EMPTY,
    MAX_EXPORT_PAGE,
    Applied,
    BadCursor,
    BudgetItem,
    Delta,
    ExportRow,
    Key,
    Owner,
    PeriodMark,
    Snapshot,
    Storage,
    StorageError,
    StoragePermanentError,
    VersionMoved,
    encode_cursor,
    gauge_key,
)
from storage.memory import MemoryStorage
from storage.sqlite import SQLiteStorage

if TYPE_CHECKING:
    from storage.dynamodb import DynamoDBStorage

BACKENDS = ["memory", "sqlite", "dynamodb"]
# DynamoDB Local needs Java: its variants carry the marker, so ``-m "not dynamodb"`` skips them.
# DynamoDB twice: flushing in transactions (the default, ``auto``) and one UpdateItem a key.
_PARAMS = [
    "memory",
    "sqlite",
    pytest.param("dynamodb", marks=pytest.mark.dynamodb),
    pytest.param("dynamodb-single", marks=pytest.mark.dynamodb),
]

K: Key = ("acme", "api_calls", "2026-11")


def _make(backend: str, request: pytest.FixtureRequest) -> Storage:
    if backend == "memory":
        return MemoryStorage()
    if backend == "sqlite":
        tmp_path: Path = request.getfixturevalue("tmp_path")
        return SQLiteStorage(tmp_path / "meter.db")
    if backend.startswith("dynamodb"):
        from storage.dynamodb import DynamoDBStorage
        from tests.support.fixtures_dynamodb import new_table_name

        # A fresh table per test in the session's DynamoDB Local; the fixture creates it.
        endpoint: str = request.getfixturevalue("dynamodb_local")
        mode = "single" if backend == "dynamodb-single" else "auto"
        return DynamoDBStorage(
            new_table_name(), endpoint_url=endpoint, flush_mode=mode, children=True
        )
    raise AssertionError(f"unknown backend {backend}")


@pytest.fixture(params=_PARAMS)
async def storage(request: pytest.FixtureRequest) -> AsyncIterator[Storage]:
    """An opened, empty backend of each kind."""
    store = _make(request.param, request)
    await store.open()
    await store.init_schema()
    try:
        yield store
    finally:
        await store.close()


async def _ok(store: Storage, node: str, key: Key, seq: int, delta: int) -> Applied:
    """Apply one delta and return its outcome, failing the test on a per-key error."""
    out = await store.apply(node, [Delta(key, seq, delta)])
    assert set(out) == {key}
    result = out[key]
    assert isinstance(result, Applied), result
    return result


async def test_kind_and_init_schema_report(storage: Storage) -> None:
    assert storage.kind in BACKENDS
    report = await storage.init_schema()  # idempotent: a second call is fine
    assert isinstance(report, str) and "\n" not in report and report


async def test_apply_new_key(storage: Storage) -> None:
    got = await _ok(storage, "n1", K, 1, 5)
    assert got == Applied(Snapshot(5, {"n1": 1}), duplicate=False)
    assert (await storage.load([K]))[K] == Snapshot(5, {"n1": 1})


async def test_totals_add_up(storage: Storage) -> None:
    for seq, delta in enumerate([3, 4, 10, 1], start=1):
        got = await _ok(storage, "n1", K, seq, delta)
        assert not got.duplicate
    assert got.snapshot == Snapshot(18, {"n1": 4})
    assert (await storage.load([K]))[K].total == 18


async def test_negative_deltas(storage: Storage) -> None:
    await _ok(storage, "n1", K, 1, 10)
    got = await _ok(storage, "n1", K, 2, -25)
    assert got.snapshot.total == -15
    assert (await storage.load([K]))[K].total == -15


@pytest.mark.parametrize("big", [2**63 - 1, 2**63, 2**64 + 7, 10**30, -(10**30)])
async def test_big_ints_keep_full_precision(storage: Storage, big: int) -> None:
    await _ok(storage, "n1", K, 1, big)
    got = await _ok(storage, "n1", K, 2, 1)
    assert got.snapshot.total == big + 1
    assert (await storage.load([K]))[K].total == big + 1
    assert (await storage.list_period("acme", "2026-11"))["api_calls"].total == big + 1


async def test_totals_past_int64_by_sums(storage: Storage) -> None:
    # Each delta fits in int64 but the total does not.
    for seq in range(1, 4):
        await _ok(storage, "n1", K, seq, 2**63 - 1)
    assert (await storage.load([K]))[K].total == 3 * (2**63 - 1)


async def test_duplicate_is_refused_with_current_snapshot(storage: Storage) -> None:
    await _ok(storage, "n1", K, 1, 5)
    await _ok(storage, "n2", K, 1, 7)
    again = await _ok(storage, "n1", K, 1, 5)
    assert again.duplicate
    # The current item, which holds the first attempt and the other node's write.
    assert again.snapshot == Snapshot(12, {"n1": 1, "n2": 1})
    assert (await storage.load([K]))[K].total == 12


async def test_older_seq_is_refused(storage: Storage) -> None:
    await _ok(storage, "n1", K, 5, 5)
    older = await _ok(storage, "n1", K, 3, 100)
    assert older.duplicate
    assert older.snapshot == Snapshot(5, {"n1": 5})


async def test_seq_gaps_are_accepted(storage: Storage) -> None:
    await _ok(storage, "n1", K, 1, 1)
    got = await _ok(storage, "n1", K, 10, 2)
    assert not got.duplicate
    assert got.snapshot == Snapshot(3, {"n1": 10})


async def test_nodes_have_independent_seqs(storage: Storage) -> None:
    await _ok(storage, "n1", K, 7, 1)
    got = await _ok(storage, "n2", K, 1, 2)  # lower than n1's, but n2's own first
    assert not got.duplicate
    assert got.snapshot == Snapshot(3, {"n1": 7, "n2": 1})
    dup = await _ok(storage, "n2", K, 1, 2)
    assert dup.duplicate and dup.snapshot.total == 3


async def test_seqs_are_per_key(storage: Storage) -> None:
    other: Key = ("acme", "storage_gb", "2026-11")
    await _ok(storage, "n1", K, 5, 1)
    got = await _ok(storage, "n1", other, 1, 1)
    assert not got.duplicate


async def test_load_missing_keys_gives_empty(storage: Storage) -> None:
    await _ok(storage, "n1", K, 1, 1)
    missing: Key = ("nobody", "api_calls", "2026-11")
    got = await storage.load([K, missing])
    assert got == {K: Snapshot(1, {"n1": 1}), missing: EMPTY}
    assert await storage.load([]) == {}


async def test_list_period_only_that_tenant_and_period(storage: Storage) -> None:
    writes: list[Key] = [
        ("acme", "api_calls", "2026-11"),
        ("acme", "storage", "2026-11"),
        ("acme", "api_calls", "2026-11-01"),  # a day bucket: same prefix, other period
        ("acme", "api_calls", "2026-12"),
        ("acme", "api_calls", "2026-10"),
        ("acme2", "api_calls", "2026-11"),  # a tenant whose name extends ours
        ("acm", "api_calls", "2026-11"),
        ("acme/user1", "api_calls", "2026-11"),  # a child tenant is its own tenant
        ("other", "api_calls", "2026-11"),
    ]
    for i, key in enumerate(writes, start=1):
        await _ok(storage, "n1", key, 1, i)
    assert await storage.list_period("acme", "2026-11") == {
        "api_calls": Snapshot(1, {"n1": 1}),
        "storage": Snapshot(2, {"n1": 1}),
    }
    assert await storage.list_period("acme", "2026-11-01") == {"api_calls": Snapshot(3, {"n1": 1})}
    assert await storage.list_period("acme2", "2026-11") == {"api_calls": Snapshot(6, {"n1": 1})}
    assert await storage.list_period("acme", "2027-01") == {}
    assert await storage.list_period("ghost", "2026-11") == {}


async def test_list_between_reads_one_range_of_features(storage: Storage) -> None:
    """A feature and the names that sort right after it (its dimension counters,
    docs/dimensions.md): one range read, with nothing of other features, periods or tenants,
    and names holding ``#``, ``=`` and non-ASCII kept whole."""
    f, last = "tok", "tok\x1f\U0010ffff"
    names = ["tok", "tok\x1emodel=a#b\x1fregion=é", "tok\x1fmodel=a#b", "tok\x1fregion=é"]
    outside = ["to", "tok-2", "tok2", "toka", "tok.x"]
    writes: list[Key] = [("acme", n, "2026-11") for n in [*names, *outside]]
    writes += [("acme", "tok\x1fmodel=a#b", "2026-12"), ("acme2", "tok", "2026-11")]
    for i, key in enumerate(writes, start=1):
        await _ok(storage, "n1", key, 1, i)
    got = await storage.list_between("acme", "2026-11", f, last)
    assert got == {n: Snapshot(i, {"n1": 1}) for i, n in enumerate(names, start=1)}
    assert await storage.list_between("acme", "2026-11", "tok\x1e", last) == {
        n: got[n] for n in names[1:]
    }
    assert await storage.list_between("acme", "2027-01", f, last) == {}
    assert await storage.list_between("ghost", "2026-11", f, last) == {}


async def test_a_feature_whose_name_goes_on_with_a_day_is_not_in_another_ones_days(
    storage: Storage,
) -> None:
    """Dimension values may hold ``#``: the day buckets of ``tok\x1fm=a#2026-11-05`` are not
    days of ``tok\x1fm=a`` (on DynamoDB both lie in one sort-key range)."""
    plain, longer = "tok\x1fm=a", "tok\x1fm=a#2026-11-05"
    out = await storage.apply(
        "n1",
        [
            Delta(("acme", plain, "2026-11"), 1, 2, "2026-11-03"),
            Delta(("acme", longer, "2026-11"), 1, 7, "2026-11-03"),
        ],
    )
    assert all(isinstance(o, Applied) for o in out.values()), out
    days = await storage.day_buckets("acme", plain, "2026-11-01", "2026-11-30")
    assert days == {"2026-11-03": 2}
    days = await storage.day_buckets("acme", longer, "2026-11-01", "2026-11-30")
    assert days == {"2026-11-03": 7}


async def test_gauges_keep_the_reading_that_wins_whatever_the_order(storage: Storage) -> None:
    """A ``max`` keeps the largest value, a ``latest`` the latest ``(at_ms, node)``; a write
    is answered with the reading stored after it; writing again changes nothing; the value
    lists and exports as the counter's total."""
    mx: Key = ("acme", "peak", "2026-11")
    lt: Key = ("acme", "last", "2026-11")
    assert await storage.load_gauges([mx, lt]) == {mx: None, lt: None}
    got = await storage.put_gauges([(mx, "max", (5, 10, "n1")), (lt, "latest", (5, 10, "n1"))])
    assert got == {mx: (5, 10, "n1"), lt: (5, 10, "n1")}
    got = await storage.put_gauges([(mx, "max", (3, 20, "n2")), (lt, "latest", (3, 20, "n2"))])
    assert got == {mx: (5, 10, "n1"), lt: (3, 20, "n2")}
    got = await storage.put_gauges([(mx, "max", (9, 5, "n2")), (lt, "latest", (8, 20, "n1"))])
    assert got == {mx: (9, 5, "n2"), lt: (3, 20, "n2")}  # (same time: the larger node id)
    got = await storage.put_gauges([(mx, "max", (9, 5, "n2")), (lt, "latest", (3, 20, "n2"))])
    assert got == {mx: (9, 5, "n2"), lt: (3, 20, "n2")}
    assert await storage.load_gauges([mx, lt]) == {mx: (9, 5, "n2"), lt: (3, 20, "n2")}
    # Listed and exported as a counter's total, under the gauge's own name.
    listed = await storage.list_period("acme", "2026-11")
    want = {gauge_key(mx)[1]: 9, gauge_key(lt)[1]: 3}
    assert {f: snap.total for f, snap in listed.items()} == want
    rows = [r async for page in storage.export("2026-11") for r in page.rows]
    assert {(r.feature, r.total) for r in rows} == set(want.items())
    got = await storage.put_gauges([(("acme", "x", "2026-13"), "max", (1, 1, "n1"))])
    assert isinstance(got[("acme", "x", "2026-13")], StoragePermanentError)
    # A gauge and its feature's counter (calls of a node that did not know it was a gauge)
    # are apart: neither changes the other, and a retried delta is still a duplicate.
    assert (await _ok(storage, "n1", mx, 1, 50)).snapshot.total == 50
    assert await storage.load_gauges([mx]) == {mx: (9, 5, "n2")}
    assert (await storage.load([mx]))[mx].total == 50
    await storage.put_gauges([(mx, "max", (70, 30, "n1"))])
    dup = await _ok(storage, "n1", mx, 1, 50)
    assert dup.duplicate and dup.snapshot.total == 50
    assert await storage.load_gauges([mx]) == {mx: (70, 30, "n1")}
    # A feature's range of dimension counters holds no gauge; a gauge's periods read by name.
    assert set(await storage.list_between("acme", "2026-11", "peak", "peak\x1f\U0010ffff")) == {
        "peak"
    }
    assert await storage.counters_between("acme", gauge_key(mx)[1], "2026-10", "2026-12") == {
        "2026-11": 70
    }
    # Ties: a max's equal value goes to the later (at_ms, node); a latest's equal time to
    # the larger node, then the larger value.
    assert await storage.put_gauges([(mx, "max", (70, 29, "n9"))]) == {mx: (70, 30, "n1")}
    assert await storage.put_gauges([(mx, "max", (70, 30, "n2"))]) == {mx: (70, 30, "n2")}
    assert await storage.put_gauges([(lt, "latest", (1, 20, "n2"))]) == {lt: (3, 20, "n2")}
    assert await storage.put_gauges([(lt, "latest", (-4, 21, "n1"))]) == {lt: (-4, 21, "n1")}


async def test_batch_with_many_keys(storage: Storage) -> None:
    keys: list[Key] = [("acme", f"f{i}", "2026-11") for i in range(300)]
    out = await storage.apply("n1", [Delta(k, 1, i) for i, k in enumerate(keys)])
    assert set(out) == set(keys)
    for i, k in enumerate(keys):
        assert out[k] == Applied(Snapshot(i, {"n1": 1}))
    # A second batch mixing duplicates and new sequences.
    mixed = [Delta(k, 1 if i % 2 else 2, 1) for i, k in enumerate(keys)]
    out = await storage.apply("n1", mixed)
    for i, k in enumerate(keys):
        result = out[k]
        assert isinstance(result, Applied)
        assert result.duplicate == bool(i % 2)
        assert result.snapshot.total == (i if i % 2 else i + 1)
    listed = await storage.list_period("acme", "2026-11")
    assert len(listed) == 300
    assert sum(s.total for s in listed.values()) == sum(range(300)) + 150


async def test_empty_batch(storage: Storage) -> None:
    assert await storage.apply("n1", []) == {}


@pytest.mark.parametrize(
    ("tenant", "feature"),
    [("a/b", "x:y"), (".", "."), ("a.b-c_d", "x:y:z"), ("a:b@c", "f.g-h_i"), ("a/b/c", "..")],
)
async def test_odd_names(storage: Storage, tenant: str, feature: str) -> None:
    key: Key = (tenant, feature, "2026-11")
    await _ok(storage, "node:1/a.b", key, 1, 4)
    assert (await storage.load([key]))[key] == Snapshot(4, {"node:1/a.b": 1})
    assert await storage.list_period(tenant, "2026-11") == {feature: Snapshot(4, {"node:1/a.b": 1})}


@pytest.mark.parametrize("period", ["9999-12", "9999-12-31", "1970-01", "1970-01-01"])
async def test_periods_at_the_ends_of_the_calendar(storage: Storage, period: str) -> None:
    """The protocol accepts instants from 1970 to 9999: their periods store like any other
    (the retention of a 9999-12 counter must not need a date in year 10000)."""
    key: Key = ("edge", "api", period)
    await _ok(storage, "n1", key, 1, 3)
    assert (await storage.load([key]))[key] == Snapshot(3, {"n1": 1})
    assert await storage.list_period("edge", period) == {"api": Snapshot(3, {"n1": 1})}


async def test_billing_cycle_periods_store_apart_with_their_zones_days(storage: Storage) -> None:
    """A billing cycle's month and a zone's day (docs/periods.md) store like any period, apart
    from the UTC ones that share their first characters; a day bucket of a cycle's month is
    any local date inside it (December 14 is in November 15's period) and no date outside;
    the export and the history reads of one period hold its counters only."""
    ny = "2026-11@15:America/New_York"
    keys: list[Key] = [
        ("acme", "api", ny),
        ("acme", "api", "2026-11"),
        ("acme", "api", "2026-11@15:Asia/Tokyo"),
        ("acme", "api", "2026-11-20@America/New_York"),
    ]
    out = await storage.apply(
        "n1",
        [
            Delta(k, 1, 10**i, f"2026-12-14@{ny[8:]}" if i == 0 else None)
            for i, k in enumerate(keys)
        ],
    )
    assert all(isinstance(o, Applied) for o in out.values()), out
    loaded = await storage.load(keys)
    assert [loaded[k].total for k in keys] == [1, 10, 100, 1000]
    assert await storage.list_period("acme", ny) == {"api": Snapshot(1, {"n1": 1})}
    assert await storage.counters_between("acme", "api", ny, ny) == {ny: 1}
    # (a date's buckets of two calendars, and a UTC day's beside them, are read together)
    more = [Delta(("acme", "api", "2026-12"), 1, 7, "2026-12-14")]
    assert isinstance((await storage.apply("n1", more))[("acme", "api", "2026-12")], Applied)
    assert await storage.day_buckets("acme", "api", "2026-11-01", "2026-12-14") == {
        "2026-12-14": 7,
        f"2026-12-14@{ny[8:]}": 1,
    }
    assert [(r.tenant, r.period, r.total) for r in await _export_all(storage, ny, 10)] == [
        ("acme", ny, 1)
    ]
    for day in ("2026-11-14@15:America/New_York", "2026-12-15@15:America/New_York", "2026-12-14"):
        bad = await storage.apply("n1", [Delta(keys[0], 2, 5, day)])
        assert isinstance(bad[keys[0]], StoragePermanentError), (day, bad)
    assert (await storage.load([keys[0]]))[keys[0]].total == 1
    for name in ("2026-11@1:UTC", "2026-11@15:Nowhere/City", "2026-11@15"):
        bad = await storage.apply("n1", [Delta(("acme", "api", name), 1, 1)])
        assert isinstance(bad[("acme", "api", name)], StoragePermanentError), (name, bad)


async def test_outcomes_are_applied_or_storage_errors(storage: Storage) -> None:
    out = await storage.apply("n1", [Delta(K, 1, 1)])
    assert all(isinstance(v, Applied | StorageError) for v in out.values())


# -- node id owners (ADR 0004) ---------------------------------------------------------------


async def test_a_free_node_id_is_claimed(storage: Storage) -> None:
    assert await storage.owner("n1") is None
    assert await storage.claim_owner("n1", "t1", lease_s=30, now=1000.0) == Owner("t1", 1030.0)
    assert await storage.owner("n1") == Owner("t1", 1030.0)
    assert await storage.owner("n2") is None
    odd = "node:1/a.b"
    assert await storage.claim_owner(odd, "t9", lease_s=0.25, now=5.5) == Owner("t9", 5.75)
    assert await storage.owner(odd) == Owner("t9", 5.75)
    # Owners are not counters.
    await _ok(storage, "n1", K, 1, 1)
    assert await storage.list_period("acme", "2026-11") == {"api_calls": Snapshot(1, {"n1": 1})}


async def test_a_claim_is_refused_while_another_lease_runs(storage: Storage) -> None:
    await storage.claim_owner("n1", "t1", lease_s=30, now=1000.0)
    # Another token gets the holder back, and changes nothing.
    assert await storage.claim_owner("n1", "t2", lease_s=30, now=1010.0) == Owner("t1", 1030.0)
    assert await storage.owner("n1") == Owner("t1", 1030.0)
    # The holder's own token, or an earlier token of the same data dir, claims again at once.
    assert await storage.claim_owner("n1", "t1", lease_s=30, now=1020.0) == Owner("t1", 1050.0)
    got = await storage.claim_owner("n1", "t3", lease_s=30, now=1021.0, accept=["t0", "t1"])
    assert got == Owner("t3", 1051.0)
    assert await storage.claim_owner("n1", "t1", lease_s=30, now=1022.0) == Owner("t3", 1051.0)
    # Once the lease has ended, anyone may claim; ids are independent.
    assert await storage.claim_owner("n1", "t4", lease_s=30, now=1051.0) == Owner("t4", 1081.0)
    assert await storage.claim_owner("n2", "t2", lease_s=30, now=1052.0) == Owner("t2", 1082.0)
    assert await storage.owner("n1") == Owner("t4", 1081.0)


async def test_only_the_holder_renews_its_lease(storage: Storage) -> None:
    await storage.claim_owner("n1", "t1", lease_s=30, now=1000.0)
    assert await storage.renew_owner("n1", "t1", lease_s=30, now=1020.0) == Owner("t1", 1050.0)
    # A lease that ended but was not taken is still the holder's.
    assert await storage.renew_owner("n1", "t1", lease_s=30, now=2000.0) == Owner("t1", 2030.0)
    assert await storage.claim_owner("n1", "t2", lease_s=30, now=2031.0) == Owner("t2", 2061.0)
    # Taken: the old holder's renewal changes nothing and answers the new holder.
    assert await storage.renew_owner("n1", "t1", lease_s=30, now=2032.0) == Owner("t2", 2061.0)
    # A release (lease 0) lets another token claim at once.
    assert await storage.renew_owner("n1", "t2", lease_s=0, now=2040.0) == Owner("t2", 2040.0)
    assert await storage.claim_owner("n1", "t5", lease_s=30, now=2040.0) == Owner("t5", 2070.0)
    assert await storage.renew_owner("ghost", "t1", lease_s=30, now=2041.0) is None
    assert await storage.owner("ghost") is None


async def test_a_renewal_leaves_its_note_on_the_owner_record(storage: Storage) -> None:
    """Set by the holder's renewal only, kept by a renewal without one and by a claim; too
    long is refused, changing nothing."""
    await storage.claim_owner("n1", "t1", lease_s=30, now=1000.0)
    assert (await storage.owner("n1")) == Owner("t1", 1030.0, "")
    note = '{"at": 1010.0, "backlog": {"2026-11": [3, 42]}} é'
    assert await storage.renew_owner("n1", "t1", lease_s=30, now=1010.0, note=note) == Owner(
        "t1", 1040.0, note
    )
    assert await storage.renew_owner("n1", "t1", lease_s=30, now=1011.0) == Owner(
        "t1", 1041.0, note
    )
    # Another token's renewal changes nothing, its note included.
    other = await storage.renew_owner("n1", "t9", lease_s=30, now=1012.0, note="x")
    assert other is not None and other.note == note
    with pytest.raises(StoragePermanentError):
        await storage.renew_owner("n1", "t1", lease_s=30, now=1013.0, note="x" * 4097)
    assert await storage.owner("n1") == Owner("t1", 1041.0, note)
    # A new holder's claim keeps the note until its own first renewal replaces it.
    assert await storage.claim_owner("n1", "t2", lease_s=30, now=1041.0) == Owner(
        "t2", 1071.0, note
    )
    big = "y" * 4096
    assert await storage.renew_owner("n1", "t2", lease_s=30, now=1042.0, note=big) == Owner(
        "t2", 1072.0, big
    )


async def test_limits_records_are_kept_and_every_change_bumps_the_version(
    storage: Storage,
) -> None:
    assert await storage.limits_version() == 0
    assert await storage.read_limits() == (0, [])
    assert await storage.write_limit("plan", "pro", "", '{"api":1}') == 1
    assert await storage.write_limit("assign", "acme/alice", "", "pro") == 2
    assert await storage.write_limit("limit", "acme", "api_calls", '{"x":2}') == 3
    # Replacing a record is a change too; deleting one a record does not hold as well.
    assert await storage.write_limit("plan", "pro", "", '{"api":5}') == 4
    assert await storage.write_limit("limit", "nobody", "f", None) == 5
    assert await storage.limits_version() == 5
    version, records = await storage.read_limits()
    assert version == 5
    assert sorted(records) == [
        ("assign", "acme/alice", "", "pro"),
        ("limit", "acme", "api_calls", '{"x":2}'),
        ("plan", "pro", "", '{"api":5}'),
    ]
    assert await storage.write_limit("limit", "acme", "api_calls", None) == 6
    version, records = await storage.read_limits()
    assert version == 6 and ("limit", "acme", "api_calls", '{"x":2}') not in records


async def test_concurrent_limit_changes_each_get_their_own_version(storage: Storage) -> None:
    import asyncio

    got = await asyncio.gather(
        *(storage.write_limit("limit", f"t{i}", "f", "{}") for i in range(6))
    )
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    version, records = await storage.read_limits()
    assert version == 6 and len(records) == 6


async def test_a_limits_write_on_a_version_moved_on_is_refused(storage: Storage) -> None:
    """``expect``: written only on that version (a declaration judged on it); else
    VersionMoved and nothing written."""
    v = await storage.write_limit("limit", "t", "f", "{}")
    with pytest.raises(VersionMoved):
        await storage.write_limit("feature", "g", "", '{"aggregation":"max"}', expect=v - 1)
    version, records = await storage.read_limits()
    assert version == v and [r[1] for r in records] == ["t"]
    assert await storage.write_limit("feature", "g", "", "{}", expect=v) == v + 1


async def test_an_alert_is_claimed_once_and_only_its_claimant_hears_yes(
    storage: Storage,
) -> None:
    a = '{"id":"x","node":"a"}'
    b = '{"id":"x","node":"b"}'
    assert await storage.claim_alert("x", a) is True
    assert await storage.claim_alert("x", b) is False  # another body: held
    assert await storage.claim_alert("x", a) is True  # a retry of the winner's own claim
    assert await storage.claim_alert("y", b) is True  # ids are independent
    assert await storage.claim_alert("x", b) is False


async def test_concurrent_alert_claims_have_one_winner(storage: Storage) -> None:
    import asyncio

    bodies = [f'{{"node":"n{i}"}}' for i in range(8)]
    won = await asyncio.gather(*(storage.claim_alert("same", b) for b in bodies))
    assert sum(won) == 1


async def test_a_cluster_setting_keeps_the_first_value_stored(storage: Storage) -> None:
    import asyncio

    assert await storage.cluster_setting("gossip_shards", "16") == "16"
    assert await storage.cluster_setting("gossip_shards", "4") == "16"  # kept for good
    assert await storage.cluster_setting("other", "4") == "4"  # names are independent
    won = await asyncio.gather(*(storage.cluster_setting("race", str(i)) for i in range(8)))
    assert len(set(won)) == 1 and won[0] in {str(i) for i in range(8)}


async def test_sqlite_reopen_after_close_keeps_data(tmp_path: Path) -> None:
    """Persistence is a property of the durable backends only (not ``memory``)."""
    path = tmp_path / "nested" / "dir" / "meter.db"
    first = SQLiteStorage(path)
    await first.open()
    await _ok(first, "n1", K, 1, 10**30)
    await _ok(first, "n2", K, 4, -1)
    await first.close()

    await first.open()
    await first.claim_owner("n1", "tok", lease_s=30, now=1000.0)
    await first.close()

    second = SQLiteStorage(path)
    await second.open()
    try:
        assert (await second.load([K]))[K] == Snapshot(10**30 - 1, {"n1": 1, "n2": 4})
        assert await second.owner("n1") == Owner("tok", 1030.0)
        assert (await _ok(second, "n1", K, 1, 10**30)).duplicate
    finally:
        await second.close()


# -- export (docs/operations.md, "Exporting usage for invoicing") ----------------------------


async def _export_all(store: Storage, period: str, limit: int) -> list[ExportRow]:
    """Every row of ``period``, page by page; checks each page's bound and progress."""
    rows: list[ExportRow] = []
    cursor: str | None = None
    for _ in range(10_000):
        page = await store.export_page(period, cursor, limit)
        assert len(page.rows) <= limit
        assert 0 <= page.parts_done <= page.parts
        rows += page.rows
        if page.cursor is None:
            assert page.parts_done == page.parts
            return rows
        assert isinstance(page.cursor, str)
        cursor = page.cursor
    raise AssertionError("the export never ended")


async def test_export_of_an_empty_period(storage: Storage) -> None:
    assert await _export_all(storage, "2026-11", 10) == []
    await _ok(storage, "n1", ("acme", "api", "2026-10"), 1, 5)
    assert await _export_all(storage, "2026-11", 10) == []
    assert await _export_all(storage, "2026-11-02", 10) == []


async def test_export_one_page_only_that_period(storage: Storage) -> None:
    writes: list[Key] = [
        ("acme", "api_calls", "2026-11"),
        ("acme", "storage", "2026-11"),
        ("acme", "api_calls", "2026-11-01"),  # a day bucket: same prefix, other period
        ("acme", "api_calls", "2026-12"),
        ("acme", "api_calls", "2026-10"),
        ("acme2", "api_calls", "2026-11"),
        ("acme/user1", "x:y", "2026-11"),
    ]
    for i, key in enumerate(writes, start=1):
        await _ok(storage, "n1", key, 1, i)
    await _ok(storage, "n2", writes[0], 1, 10**30)  # totals past 64 bits export exactly
    await storage.claim_owner("n1", "t1", lease_s=30, now=1000.0)  # owners are not counters
    page = await storage.export_page("2026-11", None, 100)
    assert sorted(page.rows, key=lambda r: (r.tenant, r.feature)) == [
        ExportRow("acme", "api_calls", "2026-11", 1 + 10**30),
        ExportRow("acme", "storage", "2026-11", 2),
        ExportRow("acme/user1", "x:y", "2026-11", 7),
        ExportRow("acme2", "api_calls", "2026-11", 6),
    ]
    assert page.cursor is None and page.parts_done == page.parts
    assert await _export_all(storage, "2026-11-01", 100) == [
        ExportRow("acme", "api_calls", "2026-11-01", 3)
    ]


async def test_export_pages_hold_every_counter_once(storage: Storage) -> None:
    keys: list[Key] = [(f"t{i % 13}", f"f{i}", "2026-11") for i in range(120)]
    others: list[Key] = [
        (f"t{i % 13}", f"f{i}", p) for i in range(40) for p in ("2026-10", "2026-11-03")
    ]
    out = await storage.apply("n1", [Delta(k, 1, i + 1) for i, k in enumerate(keys + others)])
    assert all(isinstance(v, Applied) for v in out.values())
    for limit in (1, 7, 120, 1000):
        rows = await _export_all(storage, "2026-11", limit)
        assert len(rows) == len(keys), limit
        assert {(r.tenant, r.feature): r.total for r in rows} == {
            (t, f): i + 1 for i, (t, f, _) in enumerate(keys)
        }
        assert {r.period for r in rows} == {"2026-11"}
    # An iterator over the pages gives the same.
    got = [r async for page in storage.export("2026-11", page_size=9) for r in page.rows]
    assert sorted(got, key=lambda r: r.feature) == sorted(rows, key=lambda r: r.feature)


async def test_export_refuses_bad_cursors_periods_and_limits(storage: Storage) -> None:
    for i in range(5):
        await _ok(storage, "n1", (f"t{i}", "api", "2026-11"), 1, 1)
    page = await storage.export_page("2026-11", None, 1)
    assert page.cursor is not None
    foreign = encode_cursor(["x", "2026-11", "a", "b"])
    deep = base64.urlsafe_b64encode(b"[" * 40_000).decode()
    for cursor in ["", "!!!", "bm9wZQ", page.cursor[:-3], foreign, deep, 42, "a" * 70_000]:
        with pytest.raises(BadCursor):
            await storage.export_page("2026-11", cursor, 1)  # type: ignore[arg-type]
    with pytest.raises(BadCursor):  # a cursor of another period
        await storage.export_page("2026-12", page.cursor, 1)
    arabic = "2026-\u0661\u0661"  # Arabic-Indic digits: not a period (ASCII digits only)
    bad = ["2026-13", "2026-11-31", "2026-1", "26-11", "2026-11#", "", "2026/11", arabic, None]
    for period in bad:
        with pytest.raises(StoragePermanentError, match="period"):
            await storage.export_page(period, None, 1)  # type: ignore[arg-type]
    for limit in [0, -1, MAX_EXPORT_PAGE + 1, True, 1.5, "10"]:
        with pytest.raises(StoragePermanentError, match="limit"):
            await storage.export_page("2026-11", None, limit)  # type: ignore[arg-type]
    # The good cursor still works after all that.
    assert len(await _export_all(storage, "2026-11", 2)) == 5


# -- strict budgets (ADR 0009) -----------------------------------------------------------------


async def test_budget_swap_compares_versions(storage: Storage) -> None:
    key = ("acme", "api", "2026-11")
    assert await storage.budget_read(key) == BudgetItem(0, None)
    assert not await storage.budget_swap(key, 1, "x")  # nothing is stored at version 1
    assert await storage.budget_swap(key, 0, '{"a":1}')
    assert await storage.budget_read(key) == BudgetItem(1, '{"a":1}')
    assert not await storage.budget_swap(key, 0, "late")  # a second creation loses
    assert await storage.budget_swap(key, 1, '{"a":2}')
    assert not await storage.budget_swap(key, 1, "stale")
    assert await storage.budget_read(key) == BudgetItem(2, '{"a":2}')
    # Budgets are per counter, and never show as counters.
    other = ("acme", "api", "2026-12")
    assert await storage.budget_read(other) == BudgetItem(0, None)
    assert await storage.list_period("acme", "2026-11") == {}
    assert (await storage.export_page("2026-11", None, 10)).rows == []


async def test_budget_admit_adds_within_most_on_the_body_it_was_decided_on(
    storage: Storage,
) -> None:
    """ADR 0014: units admitted onto a record add up per name within ``most``, only on the
    body they were decided on (the first makes the record), never twice under one op; each
    moves the version on, so a swap decided before it loses; a swap drops them (its writer
    folded them in); nothing is taken off by an add."""
    key = ("acme", "api", "2026-11")
    got = await storage.budget_admit(key, "body", "n1.r", 3, 10, "r.1")  # makes the record
    assert got == BudgetItem(1, "body", (("n1.r", 3, "r.1"),))
    assert await storage.budget_admit(key, "body", "n1.r", 3, 10, "r.1") is None  # that op again
    assert await storage.budget_admit(key, "other", "n2.s", 1, 10, "s.0") is None  # not its body
    got = await storage.budget_admit(key, "body", "n2.s", 5, 10, "s.1")  # made already: adds
    assert got == BudgetItem(2, "body", (("n1.r", 3, "r.1"), ("n2.s", 5, "s.1")))
    assert await storage.budget_admit(key, "body", "n1.r", 3, 10, "r.2") is None  # 11 > 10
    got = await storage.budget_admit(key, "body", "n1.r", 2, 10, "r.2")  # exactly 10
    assert got == BudgetItem(3, "body", (("n1.r", 5, "r.2"), ("n2.s", 5, "s.1")))
    assert await storage.budget_admit(key, "body", "n3.t", 1, 10, "t.1") is None  # none left
    assert await storage.budget_read(key) == got
    assert not await storage.budget_swap(key, 2, "stale")  # decided before the last admit
    assert await storage.budget_swap(key, 3, "folded")
    assert await storage.budget_read(key) == BudgetItem(4, "folded")
    assert await storage.budget_admit(key, "body", "n1.r", 1, 10, "r.4") is None  # old body
    got = await storage.budget_admit(key, "folded", "n1.r", 1, 1, "r.4")
    assert got == BudgetItem(5, "folded", (("n1.r", 1, "r.4"),))
    assert await storage.budget_admit(key, "folded", "n1.r", -1, 1, "r.5") is None  # adds only
    assert await storage.budget_admit(key, "folded", "n1.r", 0, 1, "r.5") is None
    # A record is never made by more than fits in nothing.
    fresh = ("acme", "api", "2026-10")
    assert await storage.budget_admit(fresh, "body", "n1.r", 5, 4, "r.9") is None
    assert await storage.budget_read(fresh) == BudgetItem(0, None)


async def test_ledger_write_compares_version_and_refs(storage: Storage) -> None:
    assert await storage.ledger_read("acme") == (0, None)
    assert await storage.ledger_ref("acme", "r1") is None
    assert await storage.ledger_entries("acme", 0, 10) == []
    assert not await storage.ledger_write("acme", 1, "x", [(1, "e1", 9)])  # nothing at version 1
    assert await storage.ledger_write("acme", 0, "b1", [(1, "e1", 9)], [("r1", "a1")])
    assert await storage.ledger_read("acme") == (1, "b1")
    assert await storage.ledger_ref("acme", "r1") == "a1"
    assert not await storage.ledger_write("acme", 0, "late", [(1, "x", 9)], [("r9", "x")])
    # The version matches but the ref was used: nothing of it is written.
    assert not await storage.ledger_write("acme", 1, "b2", [(2, "e2", 9)], [("r1", "other")])
    assert await storage.ledger_read("acme") == (1, "b1")
    assert await storage.ledger_ref("acme", "r1") == "a1"
    assert await storage.ledger_entries("acme", 0, 10) == [(1, "e1")]
    # Several entries in one write; refs are per tenant.
    two = [(2, "e2", 9), (3, "e3", 9)]
    assert await storage.ledger_write("acme", 1, "b2", two, [("r2", "a2")])
    assert await storage.ledger_write("beta", 0, "c1", [(1, "f1", 9)], [("r1", "other")])
    assert await storage.ledger_read("acme") == (2, "b2")
    assert await storage.ledger_ref("beta", "r1") == "other"
    assert await storage.ledger_entries("beta", 0, 10) == [(1, "f1")]


async def test_ledger_entries_are_paged_in_sequence_order(storage: Storage) -> None:
    for seq in range(1, 26):  # past 9 and 10: ordered as numbers, not strings
        assert await storage.ledger_write("acme", seq - 1, f"b{seq}", [(seq, f"e{seq}", 9)])
    assert await storage.ledger_entries("acme", 0, 3) == [(1, "e1"), (2, "e2"), (3, "e3")]
    assert await storage.ledger_entries("acme", 9, 2) == [(10, "e10"), (11, "e11")]
    assert [s for s, _ in await storage.ledger_entries("acme", 20, 100)] == [21, 22, 23, 24, 25]
    assert await storage.ledger_entries("acme", 25, 10) == []


async def test_the_ledger_timeline_pages_every_tenants_entries_in_time_order(
    storage: Storage,
) -> None:
    """Ordered by time, then tenant, then sequence; bounded by [start, end); paged with no
    entry lost or repeated whatever the page size, and no empty page after a cursor; an entry
    of a refused write is not in it; a bad cursor is refused."""
    written = []
    versions: dict[str, int] = {}
    for n in range(40):
        tenant = ["acme", "beta", "acme/bob", "z"][n % 4]
        at = 5_000 + (n // 3) * 7  # (several entries at one time, across tenants)
        seq = versions.get(tenant, 0) + 1
        body = f"{tenant}-{seq}"
        assert await storage.ledger_write(tenant, seq - 1, "b", [(seq, body, at)])
        versions[tenant] = seq
        written.append((at, tenant, seq, body))
    assert not await storage.ledger_write("acme", 0, "late", [(99, "never", 5_000)])
    want = [(t, s, b) for _, t, s, b in sorted(written)]
    for size in (1, 3, 7, 100):
        got: list[tuple[str, int, str]] = []
        cursor = None
        while True:
            page, cursor = await storage.ledger_timeline(0, 10**12, cursor, size)
            assert 0 < len(page) <= size  # (a cursor only while entries remain)
            got += page
            if cursor is None:
                break
        assert got == want, size
    inside = [(t, s, b) for at, t, s, b in sorted(written) if 5_007 <= at < 5_028]
    assert (await storage.ledger_timeline(5_007, 5_028, None, 100)) == (inside, None)
    assert await storage.ledger_timeline(5_028, 5_028, None, 10) == ([], None)
    for bad in ("x", "5000#acme#1", "0" * 15 + "#a#b#" + "0" * 20):
        with pytest.raises(BadCursor):
            await storage.ledger_timeline(0, 10**12, bad, 10)


async def test_an_accounts_children_are_one_range_in_tenant_order(storage: Storage) -> None:
    """Only direct children of the account, of that feature and period (not a day, another
    calendar's period, a deeper level, the account itself, a look-alike account), in tenant
    order, paged with none lost or repeated whatever the page size; bad arguments refused."""
    f, p = "calls", "2026-11"
    want = [(f"acme/u{n:02d}", n * 10 - 25) for n in range(12)]
    want.append(("acme/zz", 2**70))
    deltas = [Delta((t, f, p), 1, v) for t, v in want]
    others = [
        ("acme", f, p),
        ("acme/team/dave", f, p),
        ("acme-b/x", f, p),
        ("acmeb/x", f, p),
        ("acme/u01", "other", p),
        ("acme/u01", f, "2026-12"),
        ("acme/u01", f, "2026-11-03"),
        ("acme/u01", f, "2026-11@15:America/New_York"),
        ("ac/me", f, p),
    ]
    deltas += [Delta(k, 1, 7) for k in others]
    out = await storage.apply("n1", deltas)
    assert all(isinstance(r, Applied) for r in out.values())
    assert await storage.children_page("acme", f, p, None, 100) == (want, False)
    for size in (1, 4, 13):
        got: list[tuple[str, int]] = []
        after = None
        while True:
            page, more = await storage.children_page("acme", f, p, after, size)
            assert len(page) <= size and (page or not more)
            got += page
            if not more:
                break
            after = page[-1][0]
        assert got == want, size
    assert await storage.children_page("acme", f, p, "acme/u11", 5) == ([want[-1]], False)
    assert await storage.children_page("acme/team", f, p, None, 5) == (
        [("acme/team/dave", 7)],
        False,
    )
    assert await storage.children_page("acme", f, "2026-11-03", None, 5) == (
        [("acme/u01", 7)],
        False,
    )
    assert await storage.children_page("nobody", f, p, None, 5) == ([], False)
    for bad in (
        ("", f, p, None, 5),
        ("acme", "", p, None, 5),
        ("acme", f, "2026-13", None, 5),
        ("acme", f, p, "beta/x", 5),
        ("acme", f, p, "acme/team/dave", 5),
        ("acme", f, p, "acme/", 5),
        ("acme", f, p, None, 0),
        ("acme", f, p, None, 1001),
    ):
        with pytest.raises(StoragePermanentError):
            await storage.children_page(*bad)


async def test_a_ledger_writes_many_expiries_within_what_the_backend_takes(
    storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """12 grants expiring at once, then a grant and a debit: the ledger writes the expiries
    in writes no larger than the backend takes (DynamoDB Local: 4 entries, so several), and
    the timeline holds every entry once."""
    from meter.ledger import model as ledger
    from meter.ledger.store import LedgerStore

    now = [1000.0]
    book = LedgerStore(storage, clock=lambda: now[0])
    sizes: list[int] = []
    write = storage.ledger_write

    async def counted(*args: Any, **kwargs: Any) -> bool:
        sizes.append(len(args[3]))
        return await write(*args, **kwargs)

    monkeypatch.setattr(storage, "ledger_write", counted)
    for n in range(12):
        await book.apply("acme", ledger.credit(10, f"g{n}", expires_at=1100))
    now[0] = 1200.0
    await book.apply("acme", ledger.credit(5, "late"))
    got = await book.apply("acme", ledger.debit(5, "d"))
    assert got["balance_after"] == 0
    assert max(sizes) <= storage.ledger_max_entries, sizes
    # (more expiries than fit beside the grant's entry: written first, as many as fit alone)
    alone = min(20, storage.ledger_max_entries)
    with_op = max(1, min(20, (storage.ledger_max_entries - 1) // 2))
    assert len(sizes) == 12 + 2 + (0 if with_op >= 12 else -(-12 // alone)), sizes
    rows, cursor = await storage.ledger_timeline(0, 10**12, None, 1000)
    kinds = [json.loads(body)["k"] for _, _, body in rows]
    assert cursor is None and sorted(kinds) == sorted(["grant"] * 13 + ["expire"] * 12 + ["debit"])


async def test_ledger_items_never_show_as_counters(storage: Storage) -> None:
    await _ok(storage, "n1", K, 1, 5)
    await storage.budget_swap(K, 0, "budget")
    assert await storage.ledger_write(K[0], 0, "b", [(1, "e", 1000)], [("2026-11#api_calls", "x")])
    assert await storage.list_period(K[0], K[2]) == {"api_calls": Snapshot(5, {"n1": 1})}
    page = await storage.export_page(K[2], None, 100)
    rows = list(page.rows)
    cursor = page.cursor
    while cursor is not None:
        page = await storage.export_page(K[2], cursor, 100)
        rows += page.rows
        cursor = page.cursor
    assert rows == [ExportRow(K[0], "api_calls", K[2], 5)]
    assert (await storage.load([K]))[K] == Snapshot(5, {"n1": 1})


# -- history: day buckets (docs/history.md) ----------------------------------------------------


async def test_day_buckets_exactly_once_and_in_one_range(storage: Storage) -> None:
    """A delta with a day adds to its counter and to that day's bucket, each once per (node,
    seq): a retry (lost answer) adds to neither again; buckets are per tenant and feature and
    read as one range of days."""
    key: Key = ("acme", "api", "2026-11")
    for _ in range(2):  # the second time a retry: duplicates on both
        out = await storage.apply("n1", [Delta(key, 1, 5, "2026-11-03")])
        assert isinstance(out[key], Applied)
    await storage.apply("n1", [Delta(key, 2, 7, "2026-11-04")])
    await storage.apply("n2", [Delta(key, 1, 1, "2026-11-04")])  # another node's seq 1
    await storage.apply("n1", [Delta(("acme", "other", "2026-11"), 1, 100, "2026-11-04")])
    await storage.apply("n1", [Delta(("beta", "api", "2026-11"), 1, 100, "2026-11-04")])
    await storage.apply("n1", [Delta(("acme", "api", "2026-12"), 1, 9, "2026-12-01")])
    assert (await storage.load([key]))[key].total == 13
    assert await storage.day_buckets("acme", "api", "2026-11-01", "2026-12-31") == {
        "2026-11-03": 5,
        "2026-11-04": 8,
        "2026-12-01": 9,
    }
    assert await storage.day_buckets("acme", "api", "2026-11-04", "2026-11-30") == {"2026-11-04": 8}
    assert await storage.day_buckets("acme", "api", "2026-10-01", "2026-10-31") == {}
    # Day buckets never show as counters: not listed, exported, loaded or ranged.
    assert set(await storage.list_period("acme", "2026-11")) == {"api", "other"}
    assert sorted(r.feature for r in await _export_all(storage, "2026-11", 10)) == [
        "api",
        "api",
        "other",
    ]
    assert await storage.counters_between("acme", "api", "2026-11", "2026-12") == {
        "2026-11": 13,
        "2026-12": 9,
    }
    assert await storage.counters_between("acme", "api", "2026-11-01", "2026-11-30") == {}


async def test_a_delta_without_a_day_writes_no_bucket(storage: Storage) -> None:
    key: Key = ("acme", "api", "2026-11")
    await _ok(storage, "n1", key, 1, 5)
    assert await storage.day_buckets("acme", "api", "2026-11-01", "2026-11-30") == {}


async def test_counters_between_reads_one_shape(storage: Storage) -> None:
    """Month counters for a month range, day counters for a day range; other features and
    tenants and the periods outside are left out."""
    for key, units in [
        (("acme", "api", "2026-10"), 1),
        (("acme", "api", "2026-11"), 2),
        (("acme", "api", "2027-01"), 3),
        (("acme", "api", "2026-10-31"), 4),
        (("acme", "api", "2026-11-01"), 5),
        (("acme", "api", "2026-11-02"), 6),
        (("acme", "api2", "2026-11"), 7),
        (("acme", "ap", "2026-11-01"), 8),
        (("acme/x", "api", "2026-11"), 9),
    ]:
        await _ok(storage, "n1", key, 1, units)
    assert await storage.counters_between("acme", "api", "2026-10", "2026-12") == {
        "2026-10": 1,
        "2026-11": 2,
    }
    assert await storage.counters_between("acme", "api", "2026-10-15", "2026-11-01") == {
        "2026-10-31": 4,
        "2026-11-01": 5,
    }
    assert await storage.counters_between("acme", "api", "2026-11-02", "2026-11-02") == {
        "2026-11-02": 6
    }


async def test_a_bad_day_or_range_is_refused(storage: Storage) -> None:
    key: Key = ("acme", "api", "2026-11")
    for day in ["2026-12-01", "2026-11-31", "2026-11", "x"]:
        out = await storage.apply("n1", [Delta(key, 1, 5, day)])
        assert isinstance(out[key], StoragePermanentError), day
    assert (await storage.load([key]))[key] == EMPTY  # refused before any write
    for first, last in [("2026-11-02", "2026-11-01"), ("2026-11", "2026-11-01"), ("x", "y")]:
        with pytest.raises(StoragePermanentError):
            await storage.day_buckets("acme", "api", first, last)
        with pytest.raises(StoragePermanentError):
            await storage.counters_between("acme", "api", first, last)


async def test_apply_days_writes_buckets_alone_once(storage: Storage) -> None:
    """A delta whose counter holds it already gets its day bucket (a repair), once."""
    key: Key = ("acme", "api", "2026-11")
    await _ok(storage, "n1", key, 1, 5)  # the counter only
    good = Delta(key, 1, 5, "2026-11-29")
    for _ in range(2):
        assert await storage.apply_days("n1", [good]) == [None]
    bad = [Delta(key, 2, 1, "2026-12-01"), Delta(key, 2, 1, None)]
    outcomes = await storage.apply_days("n1", [*bad, Delta(key, 2, 3, "2026-11-30")])
    assert [type(o) for o in outcomes[:2]] == [StoragePermanentError] * 2 and outcomes[2] is None
    assert await storage.day_buckets("acme", "api", "2026-11-01", "2026-11-30") == {
        "2026-11-29": 5,
        "2026-11-30": 3,
    }
    assert (await storage.load([key]))[key].total == 5, "the counter is not touched"


# -- unique values (docs/storage.md, "Unique values") ------------------------------------------

U: Key = ("acme", "users", "2026-11")


async def _all_values(store: Storage, key: Key, limit: int) -> tuple[list[str], int]:
    """Every value of ``key``, page by page, and how many pages; checks each page's bound."""
    got: list[str] = []
    cursor: str | None = None
    for pages in range(1, 100_000):
        page, cursor = await store.values_page(key, cursor, limit)
        assert len(page) <= limit
        got += page
        if cursor is None:
            return got, pages
        assert isinstance(cursor, str) and page
    raise AssertionError("the values never ended")


async def test_a_value_is_claimed_once_and_its_first_claimant_stays(storage: Storage) -> None:
    assert await storage.claim_value(U, "user-17", "n1.a") == "n1.a"
    assert await storage.claim_value(U, "user-17", "n2.b") == "n1.a"  # the first stays
    assert await storage.claim_value(U, "user-17", "n1.a") == "n1.a"  # a retry: the same
    assert await storage.claim_value(U, "user-17", "n2.b") == "n1.a"
    assert await storage.claim_value(U, "user-18", "n2.b") == "n2.b"  # values are independent
    assert await storage.claim_value(U, "user-18", "n2.b") == "n2.b"
    assert await storage.values_page(U, None, 10) == (["user-17", "user-18"], None)


async def test_concurrent_claims_of_a_new_value_have_one_winner(storage: Storage) -> None:
    import asyncio

    claimants = [f"n{i}.{i:016x}" for i in range(10)]
    got = await asyncio.gather(*(storage.claim_value(U, "user-1", c) for c in claimants))
    assert len(set(got)) == 1 and got[0] in claimants, got
    again = await asyncio.gather(*(storage.claim_value(U, "user-1", c) for c in claimants))
    assert again == got
    assert await storage.values_page(U, None, 10) == (["user-1"], None)


async def test_values_are_paged_in_code_point_order_without_loss_or_repeat(
    storage: Storage,
) -> None:
    import asyncio

    # Code point order, not UTF-16's (which puts U+1F600 before U+FF61), nor a locale's.
    odd = ["Z", "a", "\xe9", "\uff61x", "\U0001f600x", "a\x1fb", "#u#", "2026-11#users", "é" * 128]
    values = [f"user-{i}" for i in range(2500 - len(odd))] + odd
    for start in range(0, len(values), 250):
        chunk = values[start : start + 250]
        await asyncio.gather(*(storage.claim_value(U, v, "n1.x") for v in chunk))
    want = sorted(values)
    assert want.index("\uff61x") < want.index("\U0001f600x")
    got, pages = await _all_values(storage, U, 7)
    assert got == want
    assert pages == -(-len(values) // 7)  # the last page says there is no more
    first, cursor = await storage.values_page(U, None, 1000)
    assert first == want[:1000] and cursor is not None
    second, _ = await storage.values_page(U, cursor, 1000)
    assert second == want[1000:2000]
    # A page that ends on the last value has no next cursor.
    last, cursor = await storage.values_page(U, encode_cursor(["u", want[-3]]), 2)
    assert (last, cursor) == (want[-2:], None)
    assert await storage.values_page(("acme", "users", "2026-10"), None, 5) == ([], None)


async def test_a_voided_value_stays_claimed_and_is_left_out_of_the_values(
    storage: Storage,
) -> None:
    import asyncio

    values = [f"user-{i:03}" for i in range(40)]
    await asyncio.gather(*(storage.claim_value(U, v, f"n1.{v}") for v in values))
    voided = set(values[3:30]) | {values[0], values[-1]}  # runs longer than a page, both ends
    # Only the claimant holding a value marks it; marking again changes nothing.
    assert await storage.void_value(U, "user-001", "n2.other") == "n1.user-001"
    assert await storage.void_value(U, "nobody", "n1.nobody") is None
    for v in sorted(voided):
        assert await storage.void_value(U, v, f"n1.{v}") == f"n1.{v}"
    assert await storage.void_value(U, values[0], f"n1.{values[0]}") == f"n1.{values[0]}"
    want = [v for v in values if v not in voided]
    for limit in (1, 2, 5, 1000):
        got: list[str] = []
        cursor: str | None = None
        for _ in range(200):
            page, cursor = await storage.values_page(U, cursor, limit)
            assert len(page) <= limit
            got += page
            if cursor is None:
                break
        assert got == want, limit
    # Still claimed: a later claim of a voided value is lost to its first claimant.
    assert await storage.claim_value(U, values[5], "n3.late") == f"n1.{values[5]}"
    assert await storage.claimant_of(U, values[5]) == f"n1.{values[5]}"
    # Another key's value of the same name is not voided with it.
    other: Key = ("acme", "users", "2026-12")
    assert await storage.claim_value(other, values[5], "n1.x") == "n1.x"
    assert await storage.values_page(other, None, 10) == ([values[5]], None)
    with pytest.raises(StoragePermanentError):
        await storage.void_value(("acme", "users", "2026-13"), "v", "c")
    with pytest.raises(StoragePermanentError):
        await storage.void_value(U, "", "c")


#: Keys beside ``("acme", "users", "2026-11")``: another period (and its shape), feature
#: or tenant whose name is a prefix or an extension of its.
NEAR_KEYS: list[Key] = [
    ("acme", "users", "2026-11-01"),
    ("acme", "users", "2026-12"),
    ("acme", "user", "2026-11"),
    ("acme", "users2", "2026-11"),
    ("acme/x", "users", "2026-11"),
    ("acm", "users", "2026-11"),
]


async def test_values_of_other_keys_are_not_mixed_in(storage: Storage) -> None:
    keys: list[Key] = [("acme", "users", "2026-11"), *NEAR_KEYS]
    for i, key in enumerate(keys):
        for v in ("v", f"k{i}"):
            assert await storage.claim_value(key, v, f"c{i}") == f"c{i}"
    for i, key in enumerate(keys):
        assert await _all_values(storage, key, 1) == (sorted(["v", f"k{i}"]), 2)
        assert await storage.claim_value(key, "v", "other") == f"c{i}"


async def test_value_items_never_show_as_counters(storage: Storage) -> None:
    month: Key = ("acme", "api_calls", "2026-11")
    await storage.apply("n1", [Delta(month, 1, 5, "2026-11-03")])
    before = (
        await storage.list_period("acme", "2026-11"),
        await storage.list_between("acme", "2026-11", "", "\U0010ffff"),
        await _export_all(storage, "2026-11", 3),
        await storage.counters_between("acme", "api_calls", "2026-01", "2026-12"),
        await storage.day_buckets("acme", "api_calls", "2026-11-01", "2026-11-30"),
    )
    for key in [month, U, ("acme", "api_calls", "2026-11-03"), ("acme", "x", "2026-11-03")]:
        for v in ("2026-11#api_calls", "api_calls", "#d#", "\U0010ffff", "a" * 256):
            await storage.claim_value(key, v, "n1.x")
    after = (
        await storage.list_period("acme", "2026-11"),
        await storage.list_between("acme", "2026-11", "", "\U0010ffff"),
        await _export_all(storage, "2026-11", 3),
        await storage.counters_between("acme", "api_calls", "2026-01", "2026-12"),
        await storage.day_buckets("acme", "api_calls", "2026-11-01", "2026-11-30"),
    )
    assert after == before
    assert before[0] == {"api_calls": Snapshot(5, {"n1": 1})}
    assert await storage.list_period("acme", "2026-11-03") == {}
    assert await _export_all(storage, "2026-11-03", 10) == []
    assert await storage.counters_between("acme", "api_calls", "2026-11-01", "2026-11-30") == {}
    assert await storage.load([month, U, ("acme", "users\x1f2026-11#api_calls", "2026-11")]) == {
        month: Snapshot(5, {"n1": 1}),
        U: EMPTY,
        ("acme", "users\x1f2026-11#api_calls", "2026-11"): EMPTY,
    }


async def test_bad_unique_inputs_are_refused_and_write_nothing(storage: Storage) -> None:
    refused: list[tuple[Key, object, object]] = [
        (("acme", "users", "2026-13"), "v", "c"),
        (("acme", "users", "2026-11-31"), "v", "c"),
        (("acme", "users", "x"), "v", "c"),
        (("", "users", "2026-11"), "v", "c"),
        (("acme", "", "2026-11"), "v", "c"),
        (("acme", "users\x1fm=a", "2026-11"), "v", "c"),  # its values would be in users'
        (U, "", "c"),
        (U, "a" * 257, "c"),
        (U, "é" * 129, "c"),  # 258 bytes
        (U, "\ud800", "c"),  # no UTF-8 for it
        (U, 17, "c"),
        (U, "v", ""),
        (U, "v", "c" * 257),
    ]
    for key, value, claimant in refused:
        with pytest.raises(StoragePermanentError):
            await storage.claim_value(key, value, claimant)  # type: ignore[arg-type]
    assert await storage.values_page(U, None, 10) == ([], None)
    assert await storage.values_page(("acme", "users", "2026-11-30"), None, 10) == ([], None)
    # The longest value is kept.
    assert await storage.claim_value(U, "é" * 128, "c" * 256) == "c" * 256
    for limit in (0, 1001, -1, True):
        with pytest.raises(StoragePermanentError):
            await storage.values_page(U, None, limit)
    for key in [("acme", "users", "2026-13"), ("acme", "users\x1fm=a", "2026-11"), ("", "u", "")]:
        with pytest.raises(StoragePermanentError):
            await storage.values_page(key, None, 10)
    bad = [
        "x",
        "",
        encode_cursor(["q", "2026-11", "acme", "users"]),
        encode_cursor(["u", ""]),
        encode_cursor(["u", 7]),
        encode_cursor(["u", "a" * 257]),
    ]
    for cursor in bad:
        with pytest.raises(BadCursor):
            await storage.values_page(U, cursor, 10)
    assert await storage.values_page(U, None, 10) == (["é" * 128], None)


async def test_claimant_of_a_value_is_its_first_claimant(storage: Storage) -> None:
    assert await storage.claimant_of(U, "user-17") is None  # nothing claimed yet
    assert await storage.claim_value(U, "user-17", "n1.a") == "n1.a"
    assert await storage.claim_value(U, "user-17", "n2.b") == "n1.a"
    assert await storage.claimant_of(U, "user-17") == "n1.a"  # the first claimant stays
    assert await storage.claimant_of(U, "user-17") == "n1.a"  # a read changes nothing
    # Neither another value of the key (one it begins with, one beginning with it) ...
    for v in ("user-1", "user-170", "User-17", "user-17 "):
        assert await storage.claimant_of(U, v) is None, v
    assert await storage.claim_value(U, "user-1", "n2.b") == "n2.b"
    assert await storage.claimant_of(U, "user-1") == "n2.b"
    assert await storage.claimant_of(U, "user-17") == "n1.a"
    # ... nor the same value in another key is mixed in.
    others = NEAR_KEYS
    for key in others:
        assert await storage.claimant_of(key, "user-17") is None, key
    for i, key in enumerate(others):
        assert await storage.claim_value(key, "user-17", f"c{i}") == f"c{i}"
    for i, key in enumerate(others):
        assert await storage.claimant_of(key, "user-17") == f"c{i}", key
    assert await storage.claimant_of(U, "user-17") == "n1.a"
    # Counters are not claims, nor claims counters.
    await _ok(storage, "n1", ("acme", "api_calls", "2026-11"), 1, 5)
    assert await storage.claimant_of(("acme", "api_calls", "2026-11"), "api_calls") is None
    assert await storage.claimant_of(U, "\U0010ffff") is None
    # The longest value is read as it is kept.
    assert await storage.claim_value(U, "é" * 128, "c" * 256) == "c" * 256
    assert await storage.claimant_of(U, "é" * 128) == "c" * 256


async def test_claimant_of_refuses_bad_inputs(storage: Storage) -> None:
    assert await storage.claim_value(U, "v", "c") == "c"
    refused: list[tuple[object, object]] = [
        (("acme", "users", "2026-13"), "v"),
        (("acme", "users", "2026-11-31"), "v"),
        (("acme", "users", "x"), "v"),
        (("", "users", "2026-11"), "v"),
        (("acme", "", "2026-11"), "v"),
        (("acme", "users\x1fm=a", "2026-11"), "v"),
        (("acme", "users"), "v"),
        (["acme", "users", "2026-11"], "v"),
        (("acme", 7, "2026-11"), "v"),
        (U, ""),
        (U, "a" * 257),
        (U, "é" * 129),  # 258 bytes
        (U, "\ud800"),  # no UTF-8 for it
        (U, 17),
        (U, None),
        (U, b"v"),
    ]
    for key, value in refused:
        with pytest.raises(StoragePermanentError):
            await storage.claimant_of(key, value)  # type: ignore[arg-type]
    assert await storage.claimant_of(U, "v") == "c"
    assert await storage.values_page(U, None, 10) == (["v"], None)


async def test_sqlite_purges_unique_values_with_the_counters(tmp_path: Path) -> None:
    import time

    store = SQLiteStorage(tmp_path / "m.db", retention_days=1)
    await store.open()
    try:
        old: Key = ("acme", "users", "2020-01")
        later: Key = ("acme", "users", "2999-01")
        await store.claim_value(old, "u1", "c")
        await store.claim_value(later, "u1", "c")
        await _ok(store, "n1", ("acme", "users", "2020-01"), 1, 1)
        assert await store.purge_expired(time.time() + 3600) == 0  # within the retention
        assert await store.values_page(old, None, 10) == (["u1"], None)
        # A write to a period long over expires the retention after now, as its counter does.
        assert await store.purge_expired(time.time() + 3 * 86400) == 1
        assert await store.values_page(old, None, 10) == ([], None)
        assert await store.values_page(later, None, 10) == (["u1"], None)
        assert await store.claim_value(old, "u1", "d") == "d"  # gone: the next claim stores it
    finally:
        await store.close()


async def _older_layout(path: Path, table: str) -> tuple[SQLiteStorage, int]:
    """A SQLite file holding one counter (``U``: 3), ``table`` dropped as a build before it
    left the file; the store (closed) and the file's schema version."""
    import sqlite3

    store = SQLiteStorage(path)
    await store.open()
    await _ok(store, "n1", U, 1, 3)
    await store.close()
    conn = sqlite3.connect(path)
    conn.execute(f"DROP TABLE {table}")
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    conn.close()
    return store, version


async def _older_table(
    path: Path, create: str, insert: str, rows: list[tuple[object, ...]]
) -> SQLiteStorage:
    """A SQLite file (:func:`_older_layout`) whose table ``create`` makes is as an older build
    made it, holding ``rows``; the store, closed."""
    import sqlite3

    table = create.split()[2]
    store, _ = await _older_layout(path, table)
    conn = sqlite3.connect(path)
    conn.execute(create)
    conn.executemany(insert, rows)
    conn.commit()
    conn.close()
    return store


async def test_sqlite_a_file_of_the_older_layout_gets_the_values_table(tmp_path: Path) -> None:
    store, _ = await _older_layout(tmp_path / "m.db", "unique_values")
    await store.open()
    try:
        assert await store.claim_value(U, "u1", "c") == "c"
        assert await store.values_page(U, None, 10) == (["u1"], None)
        assert (await store.load([U]))[U].total == 3
    finally:
        await store.close()


async def test_sqlite_a_values_table_without_the_voided_column_gets_it(tmp_path: Path) -> None:
    """A file whose ``unique_values`` an older build made (no ``voided``) keeps its values,
    none voided, and marks voids from then on."""
    path = tmp_path / "v.db"
    store = await _older_table(
        path,
        "CREATE TABLE unique_values (tenant TEXT NOT NULL, feature TEXT NOT NULL, period TEXT"
        " NOT NULL, value TEXT NOT NULL, claimant TEXT NOT NULL, expires_at INTEGER NOT NULL,"
        " PRIMARY KEY (tenant, feature, period, value)) WITHOUT ROWID",
        "INSERT INTO unique_values VALUES (?, ?, ?, ?, ?, ?)",
        [(*U, v, "c", 2**40) for v in ("u1", "u2")],
    )
    await store.open()
    try:
        assert await store.values_page(U, None, 10) == (["u1", "u2"], None)
        assert await store.void_value(U, "u1", "c") == "c"
        assert await store.values_page(U, None, 10) == (["u2"], None)
    finally:
        await store.close()
    again = SQLiteStorage(path)  # (opened again: the column is there, nothing changes)
    await again.open()
    try:
        assert await again.values_page(U, None, 10) == (["u2"], None)
    finally:
        await again.close()


async def test_sqlite_a_file_of_the_older_layout_gets_its_ledger_timeline_filled(
    tmp_path: Path,
) -> None:
    """The timeline table added to a file that holds entries is filled from them (each at
    its body's time, ``t`` seconds, as meter.ledger.model writes it); a body that is not JSON
    is left out, and does not keep the file from opening."""
    path = tmp_path / "l.db"
    store = SQLiteStorage(path)
    await store.open()
    bodies = ['{"s":1,"t":12.5,"k":"grant"}', '{"s":2,"t":3.25,"k":"debit"}']
    assert await store.ledger_write("acme", 0, "b", [(1, bodies[0], 12_500)])
    assert await store.ledger_write("acme", 1, "b", [(2, bodies[1], 3_250)])
    assert await store.ledger_write("beta", 0, "b", [(1, "not json", 5_000)])
    await store.close()
    store, _ = await _older_layout(path, "ledger_timeline")
    await store.open()
    try:
        page = await store.ledger_timeline(0, 10**12, None, 10)
        assert page == ([("acme", 2, bodies[1]), ("acme", 1, bodies[0])], None)
        assert await store.ledger_timeline(3_251, 12_500, None, 10) == ([], None)
    finally:
        await store.close()


async def test_sqlite_a_file_of_the_older_layout_gets_the_owner_notes_table(
    tmp_path: Path,
) -> None:
    store, _ = await _older_layout(tmp_path / "o.db", "owner_notes")
    await store.open()
    try:
        await store.claim_owner("n1", "t1", lease_s=30, now=1000.0)
        assert await store.owner("n1") == Owner("t1", 1030.0, "")
        got = await store.renew_owner("n1", "t1", lease_s=30, now=1001.0, note="x")
        assert got == Owner("t1", 1031.0, "x") == await store.owner("n1")
    finally:
        await store.close()


@pytest.mark.dynamodb
async def test_dynamodb_init_adds_the_children_index_to_a_table_without_it(
    dynamodb_local_home: Path,
) -> None:
    """A table a build before the index made gets it at ``storage init`` (not waited for),
    filled from the items written meanwhile, users' counters written without their index
    keys (an earlier build, the hierarchy off) given them; until then a read is
    ``unavailable`` saying what to do. (A DynamoDB Local of
    its own: one holding many tables takes minutes to fill a new index. Writes one key at a
    time: DynamoDB Local fails transactions writing the keys of an index added later.)"""
    from storage.base import StorageUnavailable
    from storage.dynamodb import CHILDREN_INDEX, TABLE_ATTRIBUTES, TABLE_KEYS, DynamoDBStorage
    from tests.support.dynamodb_local import TEST_JAVA_OPTIONS, DynamoDBLocal
    from tests.support.nodes import wait_for

    server = DynamoDBLocal(dynamodb_local_home, java_options=TEST_JAVA_OPTIONS)
    await asyncio.to_thread(server.start)
    loop = asyncio.get_running_loop()
    store = DynamoDBStorage(
        "meter_before", endpoint_url=server.endpoint, children=True, flush_mode="single"
    )
    plain = DynamoDBStorage("meter_before", endpoint_url=server.endpoint)
    await store.open()
    await plain.open()
    try:
        await store._call(
            "create_table",
            "test",
            TableName="meter_before",
            BillingMode="PAY_PER_REQUEST",
            KeySchema=TABLE_KEYS,
            AttributeDefinitions=TABLE_ATTRIBUTES,  # (as a build before the index made it)
        )
        for _ in range(100):  # (a fresh table is ACTIVE within a second)
            got = await store._call("describe_table", "test", TableName="meter_before")
            if got["Table"]["TableStatus"] == "ACTIVE":
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the table never became ACTIVE")
        await _ok(store, "n1", ("acme/bob", "f", "2026-11"), 1, 4)
        await _ok(plain, "n1", ("acme/eve", "f", "2026-11"), 1, 5)
        with pytest.raises(StorageUnavailable, match="meter storage init"):
            await store.children_page("acme", "f", "2026-11", None, 10)
        await _ok(plain, "n1", ("acme", "f", "2026-11"), 1, 9)  # (the account: not a user)
        report = await store.init_schema()
        assert f"index {CHILDREN_INDEX} added" in report, report
        assert "1 users' counters written to it" in report, report
        await asyncio.to_thread(
            wait_for,
            lambda: (
                "(ACTIVE)" in asyncio.run_coroutine_threadsafe(store.init_schema(), loop).result()
            ),
            60,
            "the index ACTIVE",
        )
        assert "0 users' counters written" in await store.init_schema()
        await _ok(store, "n1", ("acme/al", "f", "2026-11"), 1, 3)
        page = await store.children_page("acme", "f", "2026-11", None, 10)
        assert page == ([("acme/al", 3), ("acme/bob", 4), ("acme/eve", 5)], False)
        assert "index" not in await plain.init_schema()  # (no hierarchy: left alone)
    finally:
        await plain.close()
        await store.close()
        await asyncio.to_thread(server.stop)


@pytest.mark.dynamodb
async def test_dynamodb_value_item_layout_and_ttl(dynamodb_storage: DynamoDBStorage) -> None:
    """The value item's sort key, claimant and TTL: its counter's."""
    key: Key = ("acme", "users", "2099-11")
    await _ok(dynamodb_storage, "n1", key, 1, 1)
    assert await dynamodb_storage.claim_value(key, "user-17", "n1.a") == "n1.a"

    async def item(sk: str) -> dict[str, Any]:
        resp = await dynamodb_storage._call(
            "get_item",
            "test",
            TableName=dynamodb_storage.table,
            Key={"pk": {"S": "acme"}, "sk": {"S": sk}},
            ConsistentRead=True,
        )
        got: dict[str, Any] = resp["Item"]
        return got

    value = await item("#u#2099-11#users\x1fuser-17")
    counter = await item("2099-11#users")
    assert value == {
        "pk": {"S": "acme"},
        "sk": {"S": "#u#2099-11#users\x1fuser-17"},
        "c": {"S": "n1.a"},
        "ttl": counter["ttl"],
    }


async def test_dynamodb_a_refused_claim_is_answered_from_all_old(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DynamoDB returns the held item with a failed condition (DynamoDB Local does not, so
    the contract tests read it back): no read then."""
    from storage.dynamodb import DynamoDBStorage, _ConditionFailed

    store = DynamoDBStorage("t")
    calls: list[str] = []

    async def call(op: str, what: str, **params: Any) -> dict[str, Any]:
        calls.append(op)
        assert params["ReturnValuesOnConditionCheckFailure"] == "ALL_OLD"
        raise _ConditionFailed({**params["Item"], "c": {"S": "first"}})

    monkeypatch.setattr(store, "_call", call)
    assert await store.claim_value(U, "user-17", "second") == "first"
    assert calls == ["put_item"]
    with pytest.raises(StoragePermanentError):  # refused before any request
        await store.claim_value(("acme", "x" * 760, "2026-11"), "v", "c")
    assert calls == ["put_item"]


async def test_dynamodb_claimant_of_is_one_consistent_get_item(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One consistent GetItem of the value item; a refused claim that comes back without the
    held item (DynamoDB Local) is answered by that same read."""
    from storage.dynamodb import DynamoDBStorage, _ConditionFailed

    store = DynamoDBStorage("t")
    calls: list[tuple[str, dict[str, Any]]] = []
    held: dict[str, Any] | None = None

    async def call(op: str, what: str, **params: Any) -> dict[str, Any]:
        calls.append((op, params))
        if op == "put_item":
            raise _ConditionFailed(None)
        assert op == "get_item"
        return {} if held is None else {"Item": held}

    monkeypatch.setattr(store, "_call", call)
    assert await store.claimant_of(U, "user-17") is None
    item_key = {"pk": {"S": "acme"}, "sk": {"S": "#u#2026-11#users\x1fuser-17"}}
    get: dict[str, Any] = {"TableName": "t", "Key": item_key, "ConsistentRead": True}
    assert calls == [("get_item", get)]
    held = {**item_key, "c": {"S": "first"}}
    assert await store.claimant_of(U, "user-17") == "first"
    calls.clear()
    assert await store.claim_value(U, "user-17", "second") == "first"
    assert [op for op, _ in calls] == ["put_item", "get_item"] and calls[1][1] == get
    held = {**item_key}  # no claimant in it
    with pytest.raises(StoragePermanentError):
        await store.claimant_of(U, "user-17")
    calls.clear()
    with pytest.raises(StoragePermanentError):  # refused before any request
        await store.claimant_of(("acme", "x" * 760, "2026-11"), "v")
    assert calls == []


# -- period marks (docs/storage.md, "Period marks") ------------------------------------------

P = "2026-11"


def _open(node: str, at: float) -> PeriodMark:
    return PeriodMark(node, "open", at, node)


def _closed(node: str, at: float, by: str) -> PeriodMark:
    return PeriodMark(node, "closed", at, by)


def _drained(node: str, at: float) -> PeriodMark:
    return PeriodMark(node, "drained", at, node)


async def test_period_mark_open_twice_keeps_the_first(storage: Storage) -> None:
    assert await storage.period_marks(P) == []
    first = await storage.mark_period_open(P, "n1", 1000.25)
    assert first == _open("n1", 1000.25)
    assert await storage.mark_period_open(P, "n1", 2000.5) == first
    assert await storage.mark_period_open(P, "n1", 1000) == first
    assert await storage.period_marks(P) == [first]
    # An int time is kept as a float.
    assert await storage.mark_period_open(P, "n2", 7) == _open("n2", 7.0)
    assert await storage.period_marks(P) == [first, _open("n2", 7.0)]
    # Opened by someone other than the node id (its data dir): kept as given.
    assert await storage.mark_period_open(P, "n3", 8, "d1") == PeriodMark("n3", "open", 8.0, "d1")
    assert (await storage.period_marks(P))[2].by == "d1"


async def test_period_mark_close_after_open(storage: Storage) -> None:
    await storage.mark_period_open(P, "n1", 1000.0)
    closed = await storage.mark_period_closed(P, "n1", 2000.75, "n1")
    assert closed == _closed("n1", 2000.75, "n1")
    assert await storage.period_marks(P) == [closed]
    # A close where no mark was (an operator's, by hand) is written too.
    by_hand = await storage.mark_period_closed(P, "n2", 3000.0, "operator")
    assert by_hand == _closed("n2", 3000.0, "operator")
    assert await storage.period_marks(P) == [closed, by_hand]


async def test_period_mark_open_after_close_keeps_the_close(storage: Storage) -> None:
    await storage.mark_period_open(P, "n1", 1000.0)
    closed = await storage.mark_period_closed(P, "n1", 2000.0, "n1")
    assert await storage.mark_period_open(P, "n1", 3000.0) == closed  # never reopened
    assert await storage.period_marks(P) == [closed]
    alone = await storage.mark_period_closed(P, "n2", 1500.0, "operator")
    assert await storage.mark_period_open(P, "n2", 1600.0) == alone
    assert await storage.period_marks(P) == [closed, alone]


async def test_period_mark_close_twice_keeps_the_first_close(storage: Storage) -> None:
    await storage.mark_period_open(P, "n1", 1000.0)
    first = await storage.mark_period_closed(P, "n1", 2000.0, "n1")
    assert await storage.mark_period_closed(P, "n1", 2000.0, "n1") == first  # a retry
    assert await storage.mark_period_closed(P, "n1", 2500.0, "operator") == first
    assert await storage.mark_period_closed(P, "n1", 1.0, "n1") == first
    assert await storage.period_marks(P) == [first]


async def test_period_mark_drained_replaces_open(storage: Storage) -> None:
    await storage.mark_period_open(P, "n1", 1000.0)
    await storage.mark_period_open(P, "n2", 1000.0)
    drained = await storage.mark_period_drained(P, "n1", 2000.5)
    assert drained == _drained("n1", 2000.5)
    assert await storage.period_marks(P) == [drained, _open("n2", 1000.0)]
    # A drain already there is kept (a retry, or a later drain).
    assert await storage.mark_period_drained(P, "n1", 2000.5) == drained
    assert await storage.mark_period_drained(P, "n1", 3000.0) == drained
    assert await storage.period_marks(P) == [drained, _open("n2", 1000.0)]


async def test_period_mark_open_after_drained_reopens(storage: Storage) -> None:
    await storage.mark_period_open(P, "n1", 1000.0)
    await storage.mark_period_drained(P, "n1", 2000.0)
    reopened = await storage.mark_period_open(P, "n1", 3000.25)
    assert reopened == _open("n1", 3000.25)  # the new time
    assert await storage.period_marks(P) == [reopened]
    assert await storage.mark_period_open(P, "n1", 4000.0) == reopened  # open: kept
    # Drained and reopened again, as often as the node restarts.
    assert await storage.mark_period_drained(P, "n1", 5000.0) == _drained("n1", 5000.0)
    assert await storage.mark_period_open(P, "n1", 6000.0) == _open("n1", 6000.0)
    assert await storage.period_marks(P) == [_open("n1", 6000.0)]


async def test_period_mark_drained_on_a_close_keeps_the_close(storage: Storage) -> None:
    await storage.mark_period_open(P, "n1", 1000.0)
    closed = await storage.mark_period_closed(P, "n1", 2000.0, "n1")
    assert await storage.mark_period_drained(P, "n1", 3000.0) == closed
    by_hand = await storage.mark_period_closed(P, "n2", 1500.0, "operator")
    assert await storage.mark_period_drained(P, "n2", 1600.0) == by_hand
    assert await storage.period_marks(P) == [closed, by_hand]


async def test_period_mark_drained_where_none_is_writes_nothing(storage: Storage) -> None:
    assert await storage.mark_period_drained(P, "n1", 1000.0) is None
    assert await storage.period_marks(P) == []
    # Another node's mark, or the node's mark of another period, is not this one.
    await storage.mark_period_open(P, "n2", 1000.0)
    await storage.mark_period_open("2026-12", "n1", 1000.0)
    assert await storage.mark_period_drained(P, "n1", 2000.0) is None
    assert await storage.period_marks(P) == [_open("n2", 1000.0)]
    assert await storage.period_marks("2026-12") == [_open("n1", 1000.0)]
    # Still none: an open afterwards is written as on an empty period.
    assert await storage.mark_period_open(P, "n1", 3000.0) == _open("n1", 3000.0)


async def test_period_mark_close_after_drained_closes(storage: Storage) -> None:
    await storage.mark_period_open(P, "n1", 1000.0)
    await storage.mark_period_drained(P, "n1", 2000.0)
    closed = await storage.mark_period_closed(P, "n1", 3000.0, "n1")
    assert closed == _closed("n1", 3000.0, "n1")
    assert await storage.period_marks(P) == [closed]
    # By hand, too; and the close is never reopened nor drained.
    await storage.mark_period_open(P, "n2", 1000.0)
    await storage.mark_period_drained(P, "n2", 2000.0)
    by_hand = await storage.mark_period_closed(P, "n2", 3500.0, "operator")
    assert by_hand == _closed("n2", 3500.0, "operator")
    assert await storage.mark_period_open(P, "n1", 4000.0) == closed
    assert await storage.mark_period_drained(P, "n2", 4000.0) == by_hand
    assert await storage.period_marks(P) == [closed, by_hand]


async def test_concurrent_period_open_and_drained_leave_one_consistent_mark(
    storage: Storage,
) -> None:
    import asyncio

    await storage.mark_period_open(P, "n1", 1.0)
    opens = [storage.mark_period_open(P, "n1", 1000.0 + i) for i in range(6)]
    drains = [storage.mark_period_drained(P, "n1", 2000.0 + i) for i in range(6)]
    got = await asyncio.gather(*[c for pair in zip(opens, drains, strict=True) for c in pair])
    marks = await storage.period_marks(P)
    assert len(marks) == 1 and marks[0].state in ("open", "drained"), marks
    # An open answers an open mark (its own or one there), a drain a drained one; the mark
    # that stays is one some call wrote (or the first open, every drain then losing).
    written = {_open("n1", 1.0)}
    for i, mark in enumerate(got):
        assert mark is not None
        assert mark.state == ("open" if i % 2 == 0 else "drained"), (i, mark)
        assert mark.node == "n1" and mark.by == "n1"
        written.add(mark)
    assert marks[0] in written
    # With a close among them: the close stays, and every close answers it.
    await storage.mark_period_open(P, "n2", 1.0)
    calls = [
        storage.mark_period_open(P, "n2", 1000.0),
        storage.mark_period_drained(P, "n2", 2000.0),
        storage.mark_period_closed(P, "n2", 3000.0, "n2"),
        storage.mark_period_drained(P, "n2", 2001.0),
        storage.mark_period_open(P, "n2", 1001.0),
        storage.mark_period_closed(P, "n2", 3001.0, "operator"),
        storage.mark_period_open(P, "n2", 1002.0),
    ]
    done = await asyncio.gather(*calls)
    final = (await storage.period_marks(P))[1]
    assert final.state == "closed" and final in (done[2], done[5])
    assert done[2] == done[5] == final
    for mark in (done[0], done[4], done[6]):
        assert mark is not None and mark.state in ("open", "closed")
    for mark in (done[1], done[3]):
        assert mark is not None and mark.state in ("drained", "closed")
    assert [m.node for m in await storage.period_marks(P)] == ["n1", "n2"]


async def test_a_close_or_a_drain_keeps_the_units_its_node_counted(storage: Storage) -> None:
    units = {"api": 12, "tokens": 2**63 - 1, "neg": -3, "é" * 128: 0}  # (a feature's longest)
    await storage.mark_period_open(P, "n1", 1.0)
    closed = await storage.mark_period_closed(P, "n1", 2.0, "n1", units)
    assert closed == PeriodMark("n1", "closed", 2.0, "n1", units)
    # A close already there is kept, its units too.
    assert await storage.mark_period_closed(P, "n1", 3.0, "n1", {"api": 1}) == closed
    await storage.mark_period_open(P, "n2", 1.0)
    drained = await storage.mark_period_drained(P, "n2", 2.0, {"api": 5})
    assert drained == PeriodMark("n2", "drained", 2.0, "n2", {"api": 5})
    assert await storage.period_marks(P) == [closed, drained]
    # Opened again, a drained mark says nothing more; closed by hand, nothing either.
    assert await storage.mark_period_open(P, "n2", 4.0) == _open("n2", 4.0)
    assert await storage.mark_period_closed(P, "n2", 5.0, "operator") == _closed(
        "n2", 5.0, "operator"
    )
    assert await storage.period_marks(P) == [closed, _closed("n2", 5.0, "operator")]
    for bad in ({"api": 1.5}, {"api": 2**63}, {"": 1}, {"x" * 257: 1}, ["api"], {"api": True}):
        with pytest.raises(StoragePermanentError):
            await storage.mark_period_closed(P, "n3", 1.0, "n3", bad)  # type: ignore[arg-type]
    too_many = {f"f{i}": i for i in range(1001)}
    with pytest.raises(StoragePermanentError):
        await storage.mark_period_closed(P, "n3", 1.0, "n3", too_many)
    assert [m.node for m in await storage.period_marks(P)] == ["n1", "n2"]


async def test_sqlite_a_marks_table_without_units_gets_them(tmp_path: Path) -> None:
    """A ``period_marks`` table an older build made (no ``units``) keeps its marks, none
    saying units, and keeps them from then on."""
    store = await _older_table(
        tmp_path / "m.db",
        "CREATE TABLE period_marks (period TEXT NOT NULL, node TEXT NOT NULL, state TEXT NOT"
        " NULL, at REAL NOT NULL, by TEXT NOT NULL, PRIMARY KEY (period, node)) WITHOUT ROWID",
        "INSERT INTO period_marks VALUES (?, 'n1', 'closed', 1.0, 'n1')",
        [(P,)],
    )
    await store.open()
    try:
        assert await store.period_marks(P) == [_closed("n1", 1.0, "n1")]
        got = await store.mark_period_closed(P, "n2", 2.0, "n2", {"api": 3})
        assert (await store.period_marks(P))[1] == got and got.units == {"api": 3}
    finally:
        await store.close()


async def test_concurrent_period_marks_close_once(storage: Storage) -> None:
    import asyncio

    opens = [storage.mark_period_open(P, "n1", 1000.0 + i) for i in range(5)]
    closes = [storage.mark_period_closed(P, "n1", 2000.0 + i, "n1") for i in range(5)]
    got = await asyncio.gather(*opens, *closes)
    marks = await storage.period_marks(P)
    assert len(marks) == 1 and marks[0].state == "closed", marks
    # Every close answered the one close that stays; no open came after it.
    assert set(got[5:]) == {marks[0]}
    assert all(m == marks[0] or m.state == "open" for m in got[:5])


async def test_period_marks_are_listed_by_node_and_only_of_their_period(
    storage: Storage,
) -> None:
    nodes = ["n2", "b", "n10", "A", "node:1/a.b", "a", "x" * 128, "2026-11", "_-.:@/"]
    for i, node in enumerate(nodes):
        await storage.mark_period_open(P, node, float(i))
    others = ["2026-11-01", "2026-11-30", "2026-12", "2026-10", "2025-11"]
    for i, period in enumerate(others):
        await storage.mark_period_open(period, "n1", 100.0 + i)
        await storage.mark_period_closed(period, "n9", 200.0 + i, "operator")
    await storage.mark_period_closed(P, "n10", 50.0, "n10")
    want = [_open(n, float(i)) for i, n in enumerate(nodes) if n != "n10"]
    want.append(_closed("n10", 50.0, "n10"))
    got = await storage.period_marks(P)
    assert [m.node for m in got] == sorted(nodes)
    assert sorted(got, key=lambda m: m.node) == got
    assert sorted(want, key=lambda m: m.node) == got
    for i, period in enumerate(others):
        assert await storage.period_marks(period) == [
            _open("n1", 100.0 + i),
            _closed("n9", 200.0 + i, "operator"),
        ]
    assert await storage.period_marks("2026-09") == []
    assert await storage.period_marks("2026-11-02") == []


async def test_bad_period_mark_inputs_are_refused_and_write_nothing(storage: Storage) -> None:
    nan, inf = float("nan"), float("inf")
    # (period, node, at) of an open; a close takes these and by.
    bad_open: list[tuple[object, object, object]] = [
        ("2026-13", "n1", 1.0),
        ("2026-11-31", "n1", 1.0),
        ("x", "n1", 1.0),
        (202611, "n1", 1.0),
        (P, "", 1.0),
        (P, "n#1", 1.0),  # (a node id with "#" could look like a counter's sort key)
        (P, "n 1", 1.0),
        (P, "x" * 129, 1.0),
        (P, "é", 1.0),
        (P, 7, 1.0),
        (P, None, 1.0),
        (P, "n1", nan),
        (P, "n1", inf),
        (P, "n1", -1.0),
        (P, "n1", "1"),
        (P, "n1", True),
        (P, "n1", None),
        (P, "n1", 10**400),
        (P, "n1", 2.0**54),
        (P, "n1", 1e126),  # (past what a DynamoDB number holds)
    ]
    for period, node, at in bad_open:
        with pytest.raises(StoragePermanentError):
            await storage.mark_period_open(period, node, at)  # type: ignore[arg-type]
        with pytest.raises(StoragePermanentError):
            await storage.mark_period_closed(period, node, at, "n1")  # type: ignore[arg-type]
        with pytest.raises(StoragePermanentError):
            await storage.mark_period_drained(period, node, at)  # type: ignore[arg-type]
    bad_by: list[object] = [
        "",
        "x" * 129,
        "é" * 65,  # 130 bytes
        "a\nb",
        "a\x1fb",
        "\ud800",
        7,
        None,
    ]
    for by in bad_by:
        with pytest.raises(StoragePermanentError):
            await storage.mark_period_closed(P, "n1", 1.0, by)  # type: ignore[arg-type]
    for period in ["2026-13", "", "2026-11#", None, 202611]:
        with pytest.raises(StoragePermanentError):
            await storage.period_marks(period)  # type: ignore[arg-type]
    assert await storage.period_marks(P) == []
    # The edges are kept.
    edge = await storage.mark_period_closed(P, "x" * 128, 0, "é" * 64)
    assert edge == _closed("x" * 128, 0.0, "é" * 64)
    assert await storage.mark_period_closed(P, "n1", 1.5e15, "operator 7") == _closed(
        "n1", 1.5e15, "operator 7"
    )
    assert await storage.period_marks(P) == [_closed("n1", 1.5e15, "operator 7"), edge]
    # Times are kept to the microsecond (no number a backend cannot store exactly).
    assert await storage.mark_period_open(P, "n2", 1e-200) == _open("n2", 0.0)
    assert await storage.mark_period_open(P, "n3", 1000.1234567) == _open("n3", 1000.123457)
    assert await storage.mark_period_open(P, "n4", 2**53) == _open("n4", 2.0**53)
    assert [m.at for m in await storage.period_marks(P)][1:4] == [0.0, 1000.123457, 2.0**53]


async def test_period_marks_never_show_as_counters(storage: Storage) -> None:
    month: Key = ("acme", "api_calls", P)
    await storage.apply("n1", [Delta(month, 1, 5, "2026-11-03")])
    await _ok(storage, "n1", ("acme", "api_calls", "2026-11-03"), 1, 2)

    async def read() -> tuple[object, ...]:
        return (
            await storage.list_period("acme", P),
            await storage.list_between("acme", P, "", "\U0010ffff"),
            await _export_all(storage, P, 3),
            await storage.list_period("acme", "2026-11-03"),
            await _export_all(storage, "2026-11-03", 3),
            await storage.counters_between("acme", "api_calls", "2026-01", "2026-12"),
            await storage.counters_between("acme", "api_calls", "2026-11-01", "2026-11-30"),
            await storage.day_buckets("acme", "api_calls", "2026-11-01", "2026-11-30"),
        )

    before = await read()
    nodes = ["n1", "acme", "api_calls", "2026-11", "2026-11-03", "2026-11.x", "@/"]
    for period in (P, "2026-11-03"):
        for node in nodes:
            await storage.mark_period_open(period, node, 1.0)
            await storage.mark_period_drained(period, node, 1.5)
            await storage.mark_period_closed(period, node, 2.0, "operator")
        await storage.mark_period_open(period, "drained", 1.0)
        await storage.mark_period_drained(period, "drained", 1.5)
    assert await read() == before
    assert before[0] == {"api_calls": Snapshot(5, {"n1": 1})}
    assert before[2] == [ExportRow("acme", "api_calls", P, 5)]
    assert before[4] == [ExportRow("acme", "api_calls", "2026-11-03", 2)]
    assert await storage.list_period("#periods#" + P, P) == {}
    assert await _export_all(storage, "2026-10", 3) == []
    assert await storage.load([month, ("acme", "n1", P)]) == {
        month: Snapshot(5, {"n1": 1}),
        ("acme", "n1", P): EMPTY,
    }
    assert len(await storage.period_marks(P)) == len(nodes) + 1


async def test_sqlite_purges_period_marks_only_with_the_last_counter_of_their_period(
    tmp_path: Path,
) -> None:
    import time

    store = SQLiteStorage(tmp_path / "m.db", retention_days=1)
    await store.open()
    try:
        old, later = "2020-01", "2999-01"
        for period in (old, "2020-02", later):
            await store.mark_period_open(period, "n1", 1.0)
        await _ok(store, "n1", ("acme", "users", old), 1, 1)  # expires a day after now
        now = time.time()
        assert await store.purge_expired(now + 3600) == 0
        # 2020-02 has no counter and is past its retention: its marks go; 2020-01 keeps its
        # marks while its counter is there.
        assert await store.period_marks("2020-02") == []
        assert await store.period_marks(old) == [_open("n1", 1.0)]
        assert await store.purge_expired(now + 3 * 86400) == 1
        assert await store.period_marks(old) == []
        assert await store.period_marks(later) == [_open("n1", 1.0)]
    finally:
        await store.close()


async def test_sqlite_a_file_of_the_older_layout_gets_the_period_marks_table(
    tmp_path: Path,
) -> None:
    import sqlite3

    path = tmp_path / "m.db"
    store, version = await _older_layout(path, "period_marks")
    await store.open()
    try:
        assert await store.mark_period_open(P, "n1", 1.0) == _open("n1", 1.0)
        assert await store.period_marks(P) == [_open("n1", 1.0)]
        assert (await store.load([U]))[U].total == 3
    finally:
        await store.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == version  # additive
    conn.close()


@pytest.mark.dynamodb
async def test_dynamodb_period_mark_item_layout_and_ttl(
    dynamodb_storage: DynamoDBStorage,
) -> None:
    """The mark item's keys and attributes, and its TTL: its period's counters'."""
    await _ok(dynamodb_storage, "n1", ("acme", "users", "2099-11"), 1, 1)
    await dynamodb_storage.mark_period_open("2099-11", "n1", 1000.5)
    await dynamodb_storage.mark_period_closed("2099-11", "n2", 2000.25, "operator")
    await dynamodb_storage.mark_period_open("2099-11", "n3", 1000.5)
    await dynamodb_storage.mark_period_drained("2099-11", "n3", 3000.125)

    async def item(pk: str, sk: str) -> dict[str, Any]:
        resp = await dynamodb_storage._call(
            "get_item",
            "test",
            TableName=dynamodb_storage.table,
            Key={"pk": {"S": pk}, "sk": {"S": sk}},
            ConsistentRead=True,
        )
        got: dict[str, Any] = resp["Item"]
        return got

    counter = await item("acme", "2099-11#users")
    opened = await item("#periods#2099-11", "n1")
    assert {k: v for k, v in opened.items() if k != "at"} == {
        "pk": {"S": "#periods#2099-11"},
        "sk": {"S": "n1"},
        "state": {"S": "open"},
        "by": {"S": "n1"},
        "ttl": counter["ttl"],
    }
    assert float(opened["at"]["N"]) == 1000.5
    closed = await item("#periods#2099-11", "n2")
    assert closed["state"] == {"S": "closed"} and "units" not in closed
    assert closed["by"] == {"S": "operator"} and closed["ttl"] == counter["ttl"]
    drained = await item("#periods#2099-11", "n3")
    assert drained["state"] == {"S": "drained"} and float(drained["at"]["N"]) == 3000.125
    assert drained["by"] == {"S": "n3"} and drained["ttl"] == counter["ttl"]


async def test_dynamodb_a_refused_period_mark_is_answered_from_all_old_or_a_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A refused mark is answered from ``ALL_OLD`` (DynamoDB), else a consistent GetItem
    (DynamoDB Local returns no item); bad inputs are refused before any request."""
    from storage.dynamodb import DynamoDBStorage, _ConditionFailed

    store = DynamoDBStorage("t")
    calls: list[tuple[str, dict[str, Any]]] = []
    stored: dict[str, Any] = {
        "pk": {"S": "#periods#2026-11"},
        "sk": {"S": "n1"},
        "state": {"S": "closed"},
        "at": {"N": "5"},
        "by": {"S": "operator"},
    }
    old: dict[str, Any] | None = stored

    async def call(op: str, what: str, **params: Any) -> dict[str, Any]:
        calls.append((op, params))
        if op == "put_item":
            assert params["ReturnValuesOnConditionCheckFailure"] == "ALL_OLD"
            raise _ConditionFailed(old)
        assert op == "get_item" and params["ConsistentRead"] is True
        return {"Item": stored}

    monkeypatch.setattr(store, "_call", call)
    held = _closed("n1", 5.0, "operator")
    assert await store.mark_period_open(P, "n1", 9.0) == held
    assert [op for op, _ in calls] == ["put_item"]
    assert calls[0][1]["ConditionExpression"] == "attribute_not_exists(pk) OR #s = :drained"
    calls.clear()
    old = None
    assert await store.mark_period_closed(P, "n1", 9.0, "n1") == held
    assert [op for op, _ in calls] == ["put_item", "get_item"]
    put = calls[0][1]
    assert put["ConditionExpression"] == "attribute_not_exists(pk) OR #s <> :closed"
    assert put["ExpressionAttributeNames"] == {"#s": "state"}
    assert put["ExpressionAttributeValues"] == {":closed": {"S": "closed"}}
    calls.clear()
    assert await store.mark_period_drained(P, "n1", 9.0) == held
    assert [op for op, _ in calls] == ["put_item", "get_item"]
    put = calls[0][1]
    assert put["ConditionExpression"] == "#s = :open"
    assert put["ExpressionAttributeNames"] == {"#s": "state"}
    assert put["ExpressionAttributeValues"] == {":open": {"S": "open"}}
    assert put["Item"]["state"] == {"S": "drained"} and put["Item"]["by"] == {"S": "n1"}
    calls.clear()
    old = stored
    assert await store.mark_period_open(P, "n1", 9.0) == held
    put = calls[0][1]
    assert put["ConditionExpression"] == "attribute_not_exists(pk) OR #s = :drained"
    assert put["ExpressionAttributeValues"] == {":drained": {"S": "drained"}}
    calls.clear()
    with pytest.raises(StoragePermanentError):
        await store.mark_period_open(P, "n#1", 1.0)
    with pytest.raises(StoragePermanentError):
        await store.mark_period_closed("2026-13", "n1", 1.0, "n1")
    with pytest.raises(StoragePermanentError):
        await store.mark_period_drained(P, "n1", -1.0)
    assert calls == []


async def test_dynamodb_a_refused_drain_where_no_mark_is_answers_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A drain refused with no ``ALL_OLD`` and no item read back answers ``None``; a mark
    read back that the write replaces (changed since the refusal) has the write tried again,
    and one that keeps changing is :class:`StorageUnavailable` after a few tries."""
    from storage.base import StorageUnavailable
    from storage.dynamodb import DynamoDBStorage, _ConditionFailed

    store = DynamoDBStorage("t")
    calls: list[str] = []
    reads: list[dict[str, Any]] = []
    refusals = [0]

    async def call(op: str, what: str, **params: Any) -> dict[str, Any]:
        calls.append(op)
        if op == "put_item":
            if refusals[0] == 0:
                return {}
            refusals[0] -= 1
            raise _ConditionFailed(None)
        return reads.pop(0) if reads else {}

    def opened(at: str) -> dict[str, Any]:
        return {
            "pk": {"S": "#periods#2026-11"},
            "sk": {"S": "n1"},
            "state": {"S": "open"},
            "at": {"N": at},
            "by": {"S": "n1"},
        }

    monkeypatch.setattr(store, "_call", call)
    refusals[0] = 1
    assert await store.mark_period_drained(P, "n1", 9.0) is None
    assert calls == ["put_item", "get_item"]
    calls.clear()
    # Refused (no mark then), an open one read back: tried again, and written.
    refusals[0], reads[:] = 1, [{"Item": opened("5")}]
    assert await store.mark_period_drained(P, "n1", 9.0) == _drained("n1", 9.0)
    assert calls == ["put_item", "get_item", "put_item"]
    calls.clear()
    # An open refused, no mark read back (deleted in between): tried again, and written.
    refusals[0] = 1
    assert await store.mark_period_open(P, "n1", 9.0) == _open("n1", 9.0)
    assert calls == ["put_item", "get_item", "put_item"]
    refusals[0], reads[:] = 5, [{"Item": opened(str(i))} for i in range(5)]
    with pytest.raises(StorageUnavailable):
        await store.mark_period_drained(P, "n1", 9.0)


def test_every_backend_is_every_concern() -> None:
    """The per-concern Protocols are what ``Storage`` is: mypy checks these assignments (a
    method missing or differently shaped in ``Storage`` fails ``mypy --strict``), and each
    backend is a ``Storage``."""
    from storage.base import (
        AlertClaims,
        BudgetRecords,
        Counters,
        DayBuckets,
        GaugeRecords,
        LedgerRecords,
        LimitRecords,
        Owners,
        PeriodMarks,
        UniqueValues,
    )
    from storage.dynamodb import DynamoDBStorage

    def concerns(s: Storage) -> tuple[object, ...]:
        c: Counters = s
        o: Owners = s
        lim: LimitRecords = s
        b: BudgetRecords = s
        a: AlertClaims = s
        led: LedgerRecords = s
        g: GaugeRecords = s
        d: DayBuckets = s
        u: UniqueValues = s
        m: PeriodMarks = s
        return (c, o, lim, b, a, led, g, d, u, m)

    for backend in (MemoryStorage, SQLiteStorage, DynamoDBStorage):
        assert issubclass(backend, Storage)
    assert len(concerns(MemoryStorage())) == 10
