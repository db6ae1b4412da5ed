"""The node's methods, called directly (no socket): arguments, answers, every error code."""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any

import pytest

from meter.config import CounterConfig
from meter.core.keys import MAX_FEATURE_BYTES, MAX_TENANT_BYTES, QTY_MAX, QTY_MIN, period_start
from meter.core.service import Service
from meter.core.table import CounterTable
from meter.core.tracking import MAX_BATCH_ITEMS
from meter.errors import (
    Conflict,
    InvalidArgument,
    LimitExceeded,
    NotFound,
    Unavailable,
    UnknownMethod,
)
from meter.node.wiring import build_service
from storage.base import Delta, Snapshot
from tests.support.nodes import BACKFILL_GRACE_S
from tests.support.stores import DownStorage


async def call(svc: Service, method: str, *params: Any) -> Any:
    result = svc.dispatch(method, list(params))
    if inspect.isawaitable(result):
        return await result
    return result


@pytest.fixture
def store() -> DownStorage:
    return DownStorage()


@pytest.fixture
def svc(store: DownStorage) -> Service:
    config = CounterConfig(feature_periods={"daily": "day"}, period_grace_s=BACKFILL_GRACE_S)
    return build_service(CounterTable("n1"), store, config)


async def test_track_counts_and_returns_new_value(svc: Service) -> None:
    assert await call(svc, "track", "acme", "api") == 1
    assert await call(svc, "track", "acme", "api", 5) == 6
    assert await call(svc, "track", "acme", "api", -2, {}) == 4
    assert await call(svc, "usage", "acme", "api") == 4


async def test_cold_key_is_seeded_from_storage_once(svc: Service, store: DownStorage) -> None:
    period = period_start("month")
    await store.apply("old", [Delta(("acme", "api", period), 1, 100)])
    first = svc.dispatch("track", ["acme", "api", 1])
    assert inspect.isawaitable(first), "a cold key must be seeded first"
    assert await first == 101
    warm = svc.dispatch("track", ["acme", "api", 1])
    assert warm == 102, "a warm key is answered synchronously"


async def test_track_with_at_chooses_the_period(svc: Service) -> None:
    jan = 1767225600  # 2026-01-01T00:00:00Z
    assert await call(svc, "track", "acme", "api", 3, {"at": jan}) == 3
    assert await call(svc, "usage", "acme", "api", {"at": jan + 86400 * 30}) == 3
    assert await call(svc, "usage", "acme", "api", {"at": jan - 1}) == 0


async def test_day_period_feature_rolls_over_daily(svc: Service) -> None:
    day = 1767225600
    await call(svc, "track", "acme", "daily", 2, {"at": day})
    assert await call(svc, "usage", "acme", "daily", {"at": day + 3600}) == 2
    assert await call(svc, "usage", "acme", "daily", {"at": day + 86400}) == 0


async def test_usage_all(svc: Service, store: DownStorage) -> None:
    period = period_start("month")
    await store.apply("other", [Delta(("acme", "stored", period), 1, 7)])
    await call(svc, "track", "acme", "api", 2)
    await call(svc, "track", "acme", "daily", 4)
    await call(svc, "track", "acme2", "api", 9)
    assert await call(svc, "usage_all", "acme") == {"api": 2, "stored": 7, "daily": 4}
    assert await call(svc, "usage_all", "nobody") == {}


async def test_usage_all_includes_counters_counted_while_storage_was_down(
    svc: Service, store: DownStorage
) -> None:
    period = period_start("month")
    await store.apply("other", [Delta(("acme", "stored", period), 1, 7)])
    store.down = True
    assert await call(svc, "track", "acme", "api", 4) is None  # counted, total unknown
    assert await call(svc, "track", "acme", "stored", 1) is None
    with pytest.raises(Unavailable):
        await call(svc, "usage_all", "acme")
    store.down = False
    # Storage is back; the flusher has not seeded the keys yet. The listing says what the
    # store holds (nothing for api), so every counter this node counted is in the answer.
    assert svc.table.unseeded_keys()
    assert await call(svc, "usage_all", "acme") == {"api": 4, "stored": 8}
    assert not svc.table.unseeded_keys()
    assert await call(svc, "usage", "acme", "api") == 4


async def test_track_many_counts_good_items_and_reports_bad_ones(svc: Service) -> None:
    out = await call(
        svc,
        "track_many",
        [["acme", "api", 2], ["acme", "", 1], ["acme", "api", "x"], ["acme", "api", 3], 7],
    )
    assert out[0] == 2 and out[3] == 5
    assert out[1]["code"] == out[2]["code"] == out[4]["code"] == "invalid_argument"
    assert await call(svc, "usage", "acme", "api") == 5


async def test_track_many_limits(svc: Service) -> None:
    with pytest.raises(InvalidArgument):
        await call(svc, "track_many", "not a list")
    with pytest.raises(InvalidArgument):
        await call(svc, "track_many", [["a", "b", 1]] * (MAX_BATCH_ITEMS + 1))
    assert await call(svc, "track_many", []) == []


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("track", []),
        ("track", ["acme"]),
        ("track", ["acme", "api", 1, {}, "extra"]),
        ("track", ["", "api"]),
        ("track", ["acme", ""]),
        ("track", [1, "api"]),
        ("track", ["acme", None]),
        ("track", ["a" * (MAX_TENANT_BYTES + 1), "api"]),
        ("track", ["acme", "f" * (MAX_FEATURE_BYTES + 1)]),
        ("track", ["ac me", "api"]),
        ("track", ["acme", "a/b"]),
        ("track", ["acme", "api\x00"]),
        ("track", ["é", "api"]),
        ("track", [b"\xff\xfe", "api"]),
        ("track", ["acme", "api", 1.5]),
        ("track", ["acme", "api", True]),
        ("track", ["acme", "api", "1"]),
        ("track", ["acme", "api", QTY_MAX + 1]),
        ("track", ["acme", "api", QTY_MIN - 1]),
        ("track", ["acme", "api", 1, []]),
        ("track", ["acme", "api", 1, {"bogus": 1}]),
        ("track", ["acme", "api", 1, {"at": "now"}]),
        ("track", ["acme", "api", 1, {"at": -1}]),
        ("track", ["acme", "api", 1, {"at": float("nan")}]),
        ("track", ["acme", "api", 1, {"at": 10**12}]),
        ("usage", ["acme"]),
        ("usage", ["acme", "api", {"limit": 3}]),
        ("usage_all", []),
        ("usage_all", [""]),
        ("reserve", ["acme", "api"]),
        ("reserve", ["acme", "api", -1]),
        ("reserve", ["acme", "api", 1, {"limit": -1}]),
        ("reserve", ["acme", "api", 1, {"limit": "10"}]),
        ("reserve", ["acme", "api", 1, {"ttl_ms": 0}]),
        ("reserve", ["acme", "api", 1, {"ttl_ms": 10**12}]),
        ("commit", []),
        ("commit", [123]),
        ("commit", [""]),
        ("commit", ["x" * 65]),
        ("release", []),
        ("release", [None]),
        ("ping", ["extra"]),
        ("status", [1]),
    ],
)
async def test_bad_arguments_are_invalid_argument(
    svc: Service, method: str, params: list[Any]
) -> None:
    with pytest.raises(InvalidArgument) as info:
        await call(svc, method, *params)
    assert info.value.to_wire()["code"] == "invalid_argument"
    assert info.value.message


async def test_tenant_and_feature_at_their_documented_limits_are_accepted(svc: Service) -> None:
    tenant = "a" * MAX_TENANT_BYTES
    feature = "f" * MAX_FEATURE_BYTES
    assert await call(svc, "track", tenant, feature, QTY_MAX) == QTY_MAX
    assert await call(svc, "track", "acct/user-1:x@y.z_", "f.x-y:z_", QTY_MIN) == QTY_MIN


async def test_raw_bytes_names_are_accepted(svc: Service) -> None:
    assert await call(svc, "track", b"acme", b"api", 2) == 2
    assert await call(svc, "usage", "acme", "api") == 2


async def test_unknown_method(svc: Service) -> None:
    with pytest.raises(UnknownMethod):
        svc.dispatch("incr", [])


async def test_ping_and_status(svc: Service) -> None:
    assert await call(svc, "ping") == "pong"
    await call(svc, "track", "acme", "api")
    st = await call(svc, "status")
    assert st["node_id"] == "n1"
    assert st["storage"] == "memory"
    assert st["keys"]["warm"] == 1 and st["keys"]["dirty"] == 1


async def test_reserve_commit_release(svc: Service) -> None:
    rid = await call(svc, "reserve", "acme", "api", 5, {"limit": 10})
    assert isinstance(rid, str)
    assert await call(svc, "usage", "acme", "api") == 5, "held units count in usage"
    with pytest.raises(LimitExceeded):
        await call(svc, "reserve", "acme", "api", 6, {"limit": 10})
    assert await call(svc, "usage", "acme", "api") == 5, "a refused reservation holds nothing"
    assert await call(svc, "commit", rid, 3) == 3
    # Finished exactly once: a repeat answers as the first did, anything else conflicts.
    assert await call(svc, "commit", rid) == 3
    assert await call(svc, "commit", rid, 3) == 3
    with pytest.raises(Conflict):
        await call(svc, "commit", rid, 4)
    with pytest.raises(Conflict):
        await call(svc, "release", rid)
    rid2 = await call(svc, "reserve", "acme", "api", 7, {"limit": 10})
    assert await call(svc, "release", rid2) is None
    assert await call(svc, "release", rid2) is None
    with pytest.raises(Conflict):
        await call(svc, "commit", rid2)
    assert await call(svc, "usage", "acme", "api") == 3
    rid3 = await call(svc, "reserve", "acme", "api", 7, {"limit": 10})
    assert await call(svc, "commit", rid3) == 10, "commit without actual uses the reserved qty"


async def test_commit_with_bad_actual_keeps_the_reservation(svc: Service) -> None:
    rid = await call(svc, "reserve", "acme", "api", 5)
    with pytest.raises(InvalidArgument):
        await call(svc, "commit", rid, -3)
    assert await call(svc, "commit", rid, 4) == 4


async def test_reserve_limit_exactly_reached_is_allowed(svc: Service) -> None:
    await call(svc, "track", "acme", "api", 7)
    await call(svc, "reserve", "acme", "api", 3, {"limit": 10})
    with pytest.raises(LimitExceeded) as info:
        await call(svc, "reserve", "acme", "api", 1, {"limit": 10})
    assert info.value.to_wire()["code"] == "limit_exceeded"


async def test_expired_reservation_is_released(svc: Service) -> None:
    rid = await call(svc, "reserve", "acme", "api", 5, {"ttl_ms": 50})
    assert await call(svc, "usage", "acme", "api") == 5
    assert svc.expire_reservations(time.monotonic() + 0.01) == 0
    assert svc.expire_reservations(time.monotonic() + 0.06) == 1
    assert await call(svc, "usage", "acme", "api") == 0
    with pytest.raises(NotFound):
        await call(svc, "commit", rid)


async def test_a_lease_past_its_deadline_is_expired_for_its_callers_before_the_tick(
    svc: Service,
) -> None:
    """A commit or release after the deadline is not_found even if no expiry tick has run
    yet (it may be late, or wait for a log that cannot write); the tick then releases it."""
    leases = [await call(svc, "reserve", "acme", "api", 5, {"ttl_ms": 1}) for _ in range(2)]
    deadline = time.monotonic() + 0.05
    while svc.reservations.get(leases[0]).deadline > time.monotonic():  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        await asyncio.sleep(0.001)
    with pytest.raises(NotFound):
        await call(svc, "commit", leases[0])
    with pytest.raises(NotFound):
        await call(svc, "release", leases[1])
    assert await call(svc, "usage", "acme", "api") == 10  # still held, until the tick
    assert svc.expire_reservations() == 2
    assert await call(svc, "usage", "acme", "api") == 0


async def test_storage_down_cold_track_is_counted_but_total_unknown(
    svc: Service, store: DownStorage
) -> None:
    store.down = True
    assert await call(svc, "track", "acme", "api", 4) is None
    with pytest.raises(Unavailable):
        await call(svc, "usage", "acme", "api")
    with pytest.raises(Unavailable):
        await call(svc, "usage_all", "acme")
    with pytest.raises(Unavailable):
        await call(svc, "reserve", "acme", "api", 1, {"limit": 100})
    store.down = False
    # Seeding succeeds now: the stored total (0) plus the 4 units counted during the outage.
    assert await call(svc, "usage", "acme", "api") == 4
    assert await call(svc, "track", "acme", "api", 1) == 5


async def test_seeding_is_shared_by_concurrent_callers(store: DownStorage) -> None:
    loads = 0

    class Counting(DownStorage):
        async def load(self, keys: Any) -> Any:
            nonlocal loads
            loads += 1
            return await super().load(keys)

    svc = build_service(CounterTable("n1"), Counting())
    pending = [svc.dispatch("track", ["acme", "api", 1]) for _ in range(50)]
    results = [await p for p in pending]
    assert sorted(results) == list(range(1, 51))
    assert loads == 1


async def test_storage_snapshot_with_own_sequence_is_respected(store: DownStorage) -> None:
    """A restarted node continues its own flush sequence after the stored one."""
    key = ("acme", "api", period_start("month"))
    await store.apply("n1", [Delta(key, 7, 10)])
    table = CounterTable("n1")
    svc = build_service(table, store)
    assert await call(svc, "track", "acme", "api", 1) == 11
    taken = table.take_flush(key)
    assert taken == (8, 1)
    assert store.items[key] == Snapshot(10, {"n1": 7})


async def test_track_many_fast_and_general_paths_agree(store: DownStorage) -> None:
    """A batch of plain items on known names (the fast path) and the same batch with one odd
    item (the general path) count alike."""
    fast = build_service(CounterTable("n1"), DownStorage())
    slow = build_service(CounterTable("n1"), DownStorage())
    for svc in (fast, slow):
        await call(svc, "track", "acme", "api", 1)
        await call(svc, "track", "acme", "seats", 1)
    items = [["acme", "api", 2], ["acme", "seats", 3], ["acme", "api", -1]]
    assert await call(fast, "track_many", items) == [3, 4, 2]
    assert await call(slow, "track_many", [*items, ("acme", "api", 0)]) == [3, 4, 2, 2]
    assert await call(fast, "track_many", [["acme", "new", 5]]) == [5], "unknown names: general"


async def test_unknown_reservation_ids_are_not_found(svc: Service) -> None:
    for method in ("commit", "release"):
        with pytest.raises(NotFound) as info:
            await call(svc, method, "r-never-issued")
        assert info.value.to_wire()["code"] == "not_found"


def _fresh(name: str) -> str:
    """An equal string that is not the same object, as the decoder makes for each request."""
    copy = "".join(list(name))
    assert copy == name and copy is not name
    return copy


async def test_keys_share_one_copy_of_each_name(svc: Service) -> None:
    """Names decoded afresh for every request are kept once: every key of a tenant holds the
    same tenant string, every key of a feature the same feature string, and every key of a
    period the same period string, whichever path made the key."""
    now = time.time()
    jan = 1767225600
    await call(svc, "track", _fresh("acme"), _fresh("api"), 1)
    await call(svc, "track", _fresh("acme"), _fresh("seats"), 1)
    await call(svc, "track", _fresh("beta"), _fresh("api"), 1)
    await call(svc, "track", b"beta", b"seats", 1)
    await call(svc, "track_many", [[_fresh("gamma"), _fresh("api"), 1]])
    await call(svc, "reserve", _fresh("acme"), _fresh("api"), 1, {"at": now})
    await call(svc, "track", _fresh("acme"), _fresh("api"), 1, {"at": jan})
    await call(svc, "track", _fresh("acme"), _fresh("api"), 1, {"at": jan + 60})
    keys = list(svc.table.keys())
    assert len(keys) == 6
    for i in range(3):
        by_value: dict[str, str] = {}
        for key in keys:
            assert by_value.setdefault(key[i], key[i]) is key[i], f"two copies of {key[i]!r}"
    assert len({id(k[2]) for k in keys}) == 2  # this month and January
    assert svc.key_for(_fresh("acme"), _fresh("api")) in keys


async def test_known_names_still_checked_per_kind(svc: Service) -> None:
    """A name valid as a tenant is not thereby valid as a feature."""
    await call(svc, "track", "acct/user", "api", 1)
    with pytest.raises(InvalidArgument):
        await call(svc, "track", "acme", "acct/user", 1)
    with pytest.raises(InvalidArgument):
        await call(svc, "track", "acme", "acct/user", 1, {"at": time.time()})


async def test_key_cache_periods_follow_the_utc_day(
    svc: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The periods made once a day are the ones period_start gives, across midnight and a
    month's end, for month and day features."""
    clock = [1769903999.5]  # 2026-01-31T23:59:59.5Z
    monkeypatch.setattr(time, "time", lambda: clock[0])
    assert svc.key_for("acme", "api") == ("acme", "api", "2026-01")
    assert svc.key_for("acme", "daily") == ("acme", "daily", "2026-01-31")
    clock[0] += 1  # 2026-02-01T00:00:00.5Z
    assert svc.key_for("acme", "api") == ("acme", "api", "2026-02")
    assert svc.key_for("acme", "daily") == ("acme", "daily", "2026-02-01")
    assert svc.key_for("acme", "api")[2] is svc.key_for("beta", "api")[2]


async def test_name_copies_start_over_when_full(
    svc: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("meter.core.keycache.NAME_CACHE_SIZE", 4)
    monkeypatch.setattr("meter.core.keycache.KEY_CACHE_SIZE", 4)
    for i in range(20):
        await call(svc, "track", f"t{i}", "api", 1)
    assert len(svc.keys.tenants) <= 4 and len(svc.keys.cache) <= 4
    assert await call(svc, "usage", "t0", "api") == 1
    assert await call(svc, "track", "t19", "api", 1) == 2
