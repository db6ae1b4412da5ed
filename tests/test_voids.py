"""``void``: a counted call taken back by its request id, exactly its units on exactly its
counters, once (docs/protocol.md, ``void``; ADR 0019; correctness V01-V04)."""

from __future__ import annotations

import asyncio
import calendar
import inspect
import shutil
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from meter.config import CounterConfig
from meter.core.gate import pool_key
from meter.core.idempotency import Effect, RequestIds
from meter.core.keys import period_start
from meter.core.service import Service
from meter.core.table import CounterTable
from meter.errors import Conflict, InvalidArgument, MeterError, NotFound, PeriodClosed
from meter.node.wiring import build_service
from meter.persist import recovery
from meter.persist.recovery import recover
from meter.quotas.shares import Shares
from meter.wal.log import WriteAheadLog
from storage.memory import MemoryStorage
from tests.support.nodes import short_tmpdir
from tests.support.services import SlowLoads, logged_service
from tests.test_dimensions import call, error
from tests.test_wal_service import broken, disk_full, settle

MONTH = period_start("month")
KEY = ("acme", "api", MONTH)


def service(**config: Any) -> Service:
    return build_service(CounterTable("n1"), MemoryStorage(), CounterConfig(**config))


async def groups(svc: Service, tenant: str) -> dict[tuple[str | None, ...], int]:
    got = await call(svc, "usage", tenant, "tokens", {"group_by": ["model", "region"]})
    return {(g["dims"]["model"], g["dims"]["region"]): g["value"] for g in got["groups"]}


async def test_a_void_takes_back_a_track_on_every_counter_it_counted_on() -> None:
    svc = service(tenant_hierarchy=True)
    await call(svc, "set_feature", "tokens", {"dimensions": ["model", "region"]})
    dims = {"dims": {"model": "a", "region": "x"}}
    await call(svc, "track", "acme/bob", "tokens", 5, dims)
    await call(svc, "track", "acme/bob", "tokens", 7, {**dims, "id": "t1"})
    await call(svc, "track", "acme/ann", "tokens", 3, {"dims": {"model": "a"}})
    assert await groups(svc, "acme") == {("a", "x"): 12, ("a", None): 3}
    assert await call(svc, "void", "t1") == {"voided": 7, "value": 5}
    assert await call(svc, "usage", "acme/bob", "tokens") == 5
    assert await call(svc, "usage", "acme", "tokens") == 8
    assert await groups(svc, "acme") == {("a", "x"): 5, ("a", None): 3}
    assert await groups(svc, "acme/bob") == {("a", "x"): 5}
    # Once, however often, under any void id: the call's own retry counts nothing either.
    assert await call(svc, "void", "t1", {"id": "v1"}) == {"voided": 0, "value": 5}
    assert await call(svc, "void", "t1") == {"voided": 0, "value": 5}
    assert await call(svc, "track", "acme/bob", "tokens", 7, {**dims, "id": "t1"}) == 12
    assert await call(svc, "usage", "acme", "tokens") == 8
    assert (await call(svc, "status"))["request_ids"]["voided"] == 1


async def test_a_void_takes_back_one_track_many_item_and_a_commit() -> None:
    svc = service()
    items = [["acme", "api", 2, {"id": "i1"}], ["acme", "api", 3, {"id": "i2"}], ["acme", "api", 4]]
    assert await call(svc, "track_many", items) == [2, 5, 9]
    assert await call(svc, "void", "i1") == {"voided": 2, "value": 7}
    lease = await call(svc, "reserve", "acme", "api", 10)
    assert await call(svc, "commit", lease, 6, {"id": "c1"}) == 13
    assert await call(svc, "void", "c1", {"id": "v-c1"}) == {"voided": 6, "value": 7}
    assert await call(svc, "void", "c1", {"id": "v-c1"}) == {"voided": 6, "value": 7}  # retry
    assert await call(svc, "usage", "acme", "api") == 7


async def test_a_retried_void_answers_as_the_first_and_takes_back_once() -> None:
    svc = service()
    await call(svc, "track", "acme", "api", 10, {"id": "t1"})
    await call(svc, "track", "acme", "api", 1)
    first = await call(svc, "void", "t1", {"id": "v1"})
    for _ in range(10):
        assert await call(svc, "void", "t1", {"id": "v1"}) == first == {"voided": 10, "value": 1}
    assert await call(svc, "usage", "acme", "api") == 1


@pytest.mark.parametrize(
    ("params", "kind", "message"),
    [
        (["nope"], NotFound, "no call with id 'nope'"),
        (["r1"], NotFound, "counted nothing a void takes back"),  # a reserve's id
        (["g1"], NotFound, "counted nothing a void takes back"),  # a gauge's observation
        (["rel1"], NotFound, "counted nothing a void takes back"),  # a release's id
        (["u1"], NotFound, "counted nothing a void takes back"),  # a value counted before
        (["neg1"], InvalidArgument, "took 3 units away"),
        ([], InvalidArgument, "void"),
        ([7], InvalidArgument, "id must be a string"),
        (["t1", {"id": 5}], InvalidArgument, "id must be a string"),
        (["t1", {"bogus": 1}], InvalidArgument, "bogus"),
        (["t1", {"id": "t1"}], Conflict, "already used by a different call"),
        (["t1", "x"], InvalidArgument, ""),
    ],
)
async def test_bad_voids_are_refused_and_change_nothing(
    params: list[Any], kind: type[MeterError], message: str
) -> None:
    svc = service()
    await call(svc, "set_feature", "temp", {"aggregation": "max"})
    await call(svc, "track", "acme", "api", 10, {"id": "t1"})
    await call(svc, "reserve", "acme", "api", 5, {"id": "r1"})
    await call(svc, "track", "acme", "temp", 40, {"id": "g1"})
    await call(svc, "release", await call(svc, "reserve", "acme", "api", 2), {"id": "rel1"})
    await call(svc, "set_feature", "seats", {"aggregation": "unique"})
    await call(svc, "track", "acme", "seats", 1, {"value": "ann"})
    await call(svc, "track", "acme", "seats", 1, {"value": "ann", "id": "u1"})  # (counted before)
    await call(svc, "track", "acme", "other", -3, {"id": "neg1"})
    err = await error(svc, "void", *params)
    assert isinstance(err, kind) and message in str(err), err
    assert await call(svc, "usage", "acme", "api") == 15  # (10 counted, 5 held)
    assert await call(svc, "usage", "acme", "seats") == 1
    assert await call(svc, "usage", "acme", "other") == -3
    assert await call(svc, "void", "t1") == {"voided": 10, "value": 5}


async def available(svc: Service, tenant: str = "acme") -> int:
    return int((await call(svc, "balance", tenant))["available"])


async def test_a_void_gives_back_the_credits_its_call_spent_once() -> None:
    """Exactly the credits the call spent at the price when it was counted (not the price
    now), once however often the void is repeated: before a restart, after one from the log's
    records and after one from a checkpoint (correctness V04)."""
    d = short_tmpdir("voids-")
    try:
        store = MemoryStorage()
        svc, wal = await logged_service(d, store)
        await call(svc, "grant", "acme", 1000)
        await call(svc, "set_limit", "acme", "api", {"price": 2})
        await call(svc, "track", "acme", "api", 10, {"id": "paid"})
        items = [["acme", "api", 1, {"id": "paid-item"}]]
        assert await call(svc, "track_many", items) == [11]
        await call(svc, "set_limit", "acme", "api", {"limit": 10**6})  # (no price from now)
        await call(svc, "track", "acme", "api", 4, {"id": "free"})
        await call(svc, "set_limit", "acme", "api", {"price": 3})  # (priced again)
        assert await available(svc) == 1000 - 22
        assert await call(svc, "void", "free") == {"voided": 4, "value": 11}
        assert await available(svc) == 1000 - 22  # (it spent nothing)
        given = {"paid": 20, "paid-item": 2}
        left = 1000 - 22
        for final, rid in ((False, "paid"), (True, "paid-item")):
            value = await call(svc, "usage", "acme", "api") - given[rid] // 2
            first = await call(svc, "void", rid, {"id": f"v-{rid}"})
            assert first == {"voided": given[rid] // 2, "value": value, "credits": given[rid]}
            left += given[rid]
            assert await call(svc, "void", rid, {"id": f"v-{rid}"}) == first  # (a retry)
            assert await call(svc, "void", rid) == {"voided": 0, "value": value, "credits": 0}
            assert await available(svc) == left
            await wal.durable()
            await wal.close(final_checkpoint=final)
            svc, wal = await logged_service(d, store)
            assert await available(svc) == left
            assert await call(svc, "void", rid) == {"voided": 0, "value": value, "credits": 0}
            assert await available(svc) == left
        assert left == 1000 and await call(svc, "usage", "acme", "api") == 0
        await wal.close()
    finally:
        shutil.rmtree(d)


async def test_a_void_gives_credits_back_to_every_level_that_paid() -> None:
    """With the hierarchy, a call on ``acme/bob`` spent from his pool and from ``acme``'s at
    each level's own price: the void gives each back its own."""
    svc = service(tenant_hierarchy=True)
    for tenant, price in (("acme", 5), ("acme/bob", 2)):
        await call(svc, "grant", tenant, 100)
        await call(svc, "set_limit", tenant, "api", {"price": price})
    await call(svc, "track", "acme/bob", "api", 3, {"id": "t1"})
    assert (await available(svc, "acme"), await available(svc, "acme/bob")) == (85, 94)
    assert await call(svc, "void", "t1") == {"voided": 3, "value": 0, "credits": 21}
    assert (await available(svc, "acme"), await available(svc, "acme/bob")) == (100, 100)


async def test_a_void_after_the_pool_share_went_back_takes_it_again_and_gives_back_once() -> None:
    """The node gave its share of the pool back while idle (and the pool's unspent credits to
    the ledger): the void takes a share again first; voids racing on that path (under one void
    id and without one) give the credits back once."""
    svc = service()
    await call(svc, "grant", "acme", 1000)
    await call(svc, "set_limit", "acme", "gpu", {"price": 3})
    shares = svc.gate.shares
    assert isinstance(shares, Shares)
    pool = pool_key("acme")
    for n, qty in enumerate((5, 7)):
        await call(svc, "track", "acme", "gpu", qty, {"id": f"p{n}"})
        shares.local[pool].used_at -= 10**6  # (idle for long: given back at the next pass)
        await shares.step()
        assert pool not in shares.local
    assert await available(svc) == 1000 - 36
    assert await call(svc, "void", "p0", {"id": "v0"}) == {"voided": 5, "value": 7,
                                                           "credits": 15}  # fmt: skip
    assert await available(svc) == 1000 - 21
    shares.local[pool].used_at -= 10**6
    await shares.step()
    assert pool not in shares.local
    racing = [svc.dispatch("void", ["p1", *opts]) for opts in ([{"id": "v1"}], [], [{"id": "v1"}])]
    answers = [await a if inspect.isawaitable(a) else a for a in racing]
    assert sorted(a["credits"] for a in answers) == [0, 21, 21], answers
    assert answers[0] == answers[2]  # (one void id: one answer)
    assert await available(svc) == 1000 and await call(svc, "usage", "acme", "gpu") == 0


async def test_a_void_of_a_commit_gives_back_what_its_units_past_the_reservation_spent() -> None:
    """A reservation made before the feature was priced: its commit spent credits only for
    the units past what it held, and a void gives back exactly those."""
    svc = service()
    await call(svc, "grant", "acme", 1000)
    lease = await call(svc, "reserve", "acme", "gpu", 5)
    await call(svc, "set_limit", "acme", "gpu", {"price": 3})
    assert await call(svc, "commit", lease, 8, {"id": "c1"}) == 8
    assert await available(svc) == 1000 - 9
    assert await call(svc, "void", "c1") == {"voided": 8, "value": 0, "credits": 9}
    assert await available(svc) == 1000


async def test_a_void_of_a_call_whose_credits_an_older_build_logged_is_refused() -> None:
    """An older build logged only that a call spent credits: not how many, so a void cannot
    give them back; refused, nothing changed."""
    svc = service()
    await call(svc, "track", "acme", "api", 5)
    svc.ids.put("old", 1, 5, time.time() + 60, time.time(), Effect(5, (KEY,), credits=None))
    err = await error(svc, "void", "old")
    assert isinstance(err, InvalidArgument) and "older build" in str(err), err
    assert await call(svc, "usage", "acme", "api") == 5


async def test_a_call_in_a_closed_period_is_not_voided() -> None:
    """Counted inside the grace, voided inside it; refused once the period's end plus the
    grace has passed (judged when the void comes), changing nothing."""
    start = calendar.timegm(time.strptime(MONTH, "%Y-%m"))
    grace = time.time() - start + 1.5  # (last month closes in 1.5 s)
    svc = service(period_grace_s=grace)
    late = {"at": start - 10}
    await call(svc, "track", "acme", "api", 4, {**late, "id": "old1"})
    await call(svc, "track", "acme", "api", 6, {**late, "id": "old2"})
    assert await call(svc, "void", "old1") == {"voided": 4, "value": 6}
    deadline = time.monotonic() + 10
    while time.time() < start + grace:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    err = await error(svc, "void", "old2", {"id": "v2"})
    assert isinstance(err, PeriodClosed), err
    assert await call(svc, "usage", "acme", "api", {"at": start - 10}) == 6
    err = await error(svc, "void", "old2", {"id": "v2"})  # (and its retry: nothing remembered)
    assert isinstance(err, PeriodClosed), err


async def test_voids_come_back_from_the_log() -> None:
    d = short_tmpdir("voids-")
    config = CounterConfig(tenant_hierarchy=True)
    try:
        store = MemoryStorage()
        svc, wal = await logged_service(d, store, config=config)
        await call(svc, "track", "acme/bob", "api", 5, {"id": "t1"})
        items = [["acme/bob", "api", 2, {"id": "i1"}], ["acme/ann", "api", 3, {"id": "i2"}]]
        await call(svc, "track_many", items)
        await call(svc, "void", "i1", {"id": "v1"})
        await wal.durable()
        await wal.close(final_checkpoint=False)  # (the records themselves are replayed)
        svc, wal = await logged_service(d, store, config=config)
        assert await call(svc, "usage", "acme", "api") == 8
        assert await call(svc, "void", "i1", {"id": "v1"}) == {"voided": 2, "value": 5}
        assert await call(svc, "void", "i1") == {"voided": 0, "value": 5}
        assert await call(svc, "void", "t1") == {"voided": 5, "value": 0}  # (both levels)
        assert await call(svc, "usage", "acme", "api") == 3
        await wal.durable()
        await wal.close()  # (a checkpoint restates what each call counted, and if voided)
        svc, wal = await logged_service(d, store, config=config)
        assert await call(svc, "usage", "acme", "api") == 3
        assert await call(svc, "void", "i2") == {"voided": 3, "value": 0}
        assert await call(svc, "void", "t1") == {"voided": 0, "value": 0}
        await wal.close()
    finally:
        shutil.rmtree(d)


# Calls under ids: each id always names the same call (a reused id is a retry). ``gpu`` is
# priced: 3 credits a unit from ``acme/bob``'s pool, 2 from ``acme``'s.
CALLS_BY_ID: dict[str, tuple[str, str, int, dict[str, str]]] = {
    "t0": ("acme/bob", "tokens", 5, {"model": "a", "region": "x"}),
    "t1": ("acme/ann", "tokens", 7, {"model": "b"}),
    "t2": ("acme", "tokens", 11, {}),
    "t3": ("acme/bob", "tokens", 2, {"region": "y"}),
    "t4": ("other", "tokens", 3, {"model": "a"}),
    "p0": ("acme/bob", "gpu", 4, {}),
    "p1": ("acme", "gpu", 3, {}),
}
#: Calls on the unique feature ``seats`` under ids: (tenant, value).
UNIQUE_BY_ID: dict[str, tuple[str, str]] = {
    "u0": ("acme/bob", "x"),
    "u1": ("acme/ann", "x"),
    "u2": ("acme/bob", "y"),
    "u3": ("acme", "y"),
    "u4": ("other", "x"),
}
PRICES = {"acme": 2, "acme/bob": 3}
GRANT = 10_000
TENANTS = ["acme", "acme/bob", "acme/ann", "other"]
OP = st.one_of(
    st.tuples(st.just("track"), st.sampled_from(sorted(CALLS_BY_ID))),
    st.tuples(st.just("plain"), st.sampled_from(TENANTS[1:]), st.integers(1, 9)),
    st.tuples(st.just("many"), st.lists(st.sampled_from(sorted(CALLS_BY_ID)), max_size=3)),
    st.tuples(st.just("unique"), st.sampled_from(sorted(UNIQUE_BY_ID))),
    st.tuples(st.just("value"), st.sampled_from(TENANTS), st.sampled_from(["x", "y"])),
    st.tuples(
        st.just("void"),
        st.sampled_from([*CALLS_BY_ID, *UNIQUE_BY_ID, "t9"]),
        st.sampled_from([None, "v0", "v1", "v2"]),
    ),
    st.tuples(st.just("mark")),
    st.tuples(st.just("crash")),
    st.tuples(st.just("restart")),
)


def under(tenant: str, level: str) -> bool:
    return tenant == level or tenant.startswith(level + "/")


def levels(tenant: str) -> list[str]:
    parts = tenant.split("/")
    return ["/".join(parts[:n]) for n in range(len(parts), 0, -1)]


async def _calls_voids_and_restarts(ops: list[tuple[Any, ...]]) -> None:
    d = short_tmpdir("voids-")
    config = CounterConfig(tenant_hierarchy=True)
    store = MemoryStorage()
    try:
        svc, wal = await logged_service(d, store, config=config)
        await call(svc, "set_feature", "tokens", {"dimensions": ["model", "region"]})
        await call(svc, "set_feature", "seats", {"aggregation": "unique"})
        # (level, value) -> the call under an id that claimed it first there (None: plain)
        claimed: dict[tuple[str, str], str | None] = {}
        for tenant, price in PRICES.items():
            await call(svc, "grant", tenant, GRANT)
            await call(svc, "set_limit", tenant, "gpu", {"price": price})
        counted: set[str] = set()
        voided: set[str] = set()
        void_ids: dict[str, tuple[str, Any]] = {}
        plain: dict[str, int] = {}
        for op in ops:
            if op[0] == "track":
                tenant, feature, qty, dims_ = CALLS_BY_ID[op[1]]
                opts: dict[str, Any] = {"dims": dims_} if dims_ else {}
                await call(svc, "track", tenant, feature, qty, {**opts, "id": op[1]})
                counted.add(op[1])
            elif op[0] in ("unique", "value"):
                rid = op[1] if op[0] == "unique" else None
                tenant, value = UNIQUE_BY_ID[op[1]] if rid else op[1:]
                await call(svc, "track", tenant, "seats", 1, {"value": value, "id": rid})
                if rid is not None and any(w == rid for w in claimed.values()):
                    continue  # a retry
                for level in levels(tenant):
                    claimed.setdefault((level, value), rid)
                if rid is not None and claimed[(tenant, value)] == rid:
                    counted.add(rid)  # (won at its own level: a void takes it back)
            elif op[0] == "mark":
                await svc.uniques.voids.mark()
            elif op[0] == "plain":
                await call(svc, "track", op[1], "tokens", op[2])
                plain[op[1]] = plain.get(op[1], 0) + op[2]
            elif op[0] == "many":
                items = []
                for r in op[1]:
                    tenant, feature, qty, dims_ = CALLS_BY_ID[r]
                    opts = {"dims": dims_} if dims_ else {}
                    items.append([tenant, feature, qty, {**opts, "id": r}])
                answers = await call(svc, "track_many", items)
                assert all(type(a) is int for a in answers), answers
                counted.update(op[1])
            elif op[0] == "void":
                _, rid, vid = op
                with_id = [{"id": vid}] if vid else []
                if vid is not None and vid in void_ids and void_ids[vid][0] != rid:
                    err = await error(svc, "void", rid, {"id": vid})
                    assert isinstance(err, Conflict), err
                    continue
                if vid is not None and vid in void_ids:
                    assert await call(svc, "void", rid, {"id": vid}) == void_ids[vid][1]
                    continue
                if rid not in counted:
                    err = await error(svc, "void", rid, *with_id)
                    assert isinstance(err, NotFound), err
                    continue
                got = await call(svc, "void", rid, *with_id)
                qty = 1 if rid in UNIQUE_BY_ID else CALLS_BY_ID[rid][2]
                want = 0 if rid in voided else qty
                assert got["voided"] == want, (op, got)
                voided.add(rid)
                if vid is not None:
                    void_ids[vid] = (rid, got)
            else:
                await wal.durable()
                await wal.close(final_checkpoint=op[0] == "restart")
                svc, wal = await logged_service(d, store, config=config)
        live = [CALLS_BY_ID[r] for r in counted - voided if r in CALLS_BY_ID]
        for tenant in TENANTS:
            want = sum(q for t, f, q, _ in live if f == "tokens" and under(t, tenant))
            want += sum(q for t, q in plain.items() if under(t, tenant))
            assert await call(svc, "usage", tenant, "tokens") == want, tenant
            got = await call(svc, "usage", tenant, "tokens", {"group_by": ["model"]})
            by_model: dict[Any, int] = {}
            for t, f, q, dims_ in live:
                if f == "tokens" and under(t, tenant):
                    by_model[dims_.get("model")] = by_model.get(dims_.get("model"), 0) + q
            for t, q in plain.items():
                if under(t, tenant):
                    by_model[None] = by_model.get(None, 0) + q
            have = {g["dims"]["model"]: g["value"] for g in got["groups"]}
            assert have == {m: q for m, q in by_model.items() if q}, (tenant, have, by_model)
        for tenant, price in PRICES.items():  # every credit of a call not voided spent, once
            spent = sum(q for t, f, q, _ in live if f == "gpu" and under(t, tenant))
            assert await available(svc, tenant) == GRANT - price * spent, tenant
        # A unique value counts at each level until the call that claimed it there is voided
        # (tracked again after, it counts 0); storage lists the same values once marked.
        assert await svc.uniques.voids.mark() == 0
        for tenant in TENANTS:
            kept = sorted(v for (t, v), w in claimed.items() if t == tenant and w not in voided)
            assert await call(svc, "usage", tenant, "seats") == len(kept), tenant
            assert await store.values_page((tenant, "seats", MONTH), None, 10) == (kept, None)
        await wal.close()
    finally:
        shutil.rmtree(d)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(OP, min_size=5, max_size=25))
@example(  # unique values voided after a restart from the log's records, and from a checkpoint
    [
        ("unique", "u0"),
        ("unique", "u1"),
        ("crash",),
        ("void", "u0", None),
        ("unique", "u2"),
        ("restart",),
        ("void", "u2", "v0"),
        ("void", "u1", None),
        ("crash",),
        ("value", "acme/bob", "x"),
    ]
)
def test_whatever_the_calls_voids_and_restarts_each_call_counts_until_voided_once(
    ops: list[tuple[Any, ...]],
) -> None:
    """Tracks (under ids, plain, batched; some priced; unique values), voids (under void ids
    or none, repeated, of unknown ids) and restarts from the log (its records alone, or a
    checkpoint): every level of every tenant holds exactly the calls counted and not voided,
    every pool that paid has spent exactly their credits, and each level counts and storage
    lists the unique values whose claim there was not voided; a void answers its units once,
    and its retry as it first did."""
    asyncio.run(_calls_voids_and_restarts(ops))


async def log_back(wal: WriteAheadLog) -> None:
    """Wait (10 s at most) for a broken log to write again."""
    deadline = time.monotonic() + 10
    while broken(wal) is not None:
        assert time.monotonic() < deadline, "the log did not come back"
        await asyncio.sleep(0.05)


async def test_a_void_whose_log_write_fails_is_undone_and_may_be_sent_again() -> None:
    """The log cannot write the void: its units are counted again, the call is not voided,
    and the void's id is not remembered; once the log writes again, the void takes back."""
    d = short_tmpdir("voids-")
    try:
        config = CounterConfig(tenant_hierarchy=True)
        svc, wal = await logged_service(d, MemoryStorage(), config=config)
        await call(svc, "track", "acme/bob", "api", 5, {"id": "t1"})
        await call(svc, "track", "acme/bob", "api", 2)
        await settle()
        with disk_full(wal):
            assert await call(svc, "void", "t1", {"id": "v1"}) == {"voided": 5, "value": 2}
            await settle()  # the commit fails: the void is undone
            assert broken(wal) is not None
        await log_back(wal)
        assert await call(svc, "usage", "acme", "api") == 7
        assert await call(svc, "void", "t1", {"id": "v1"}) == {"voided": 5, "value": 2}
        assert await call(svc, "usage", "acme", "api") == 2
        await wal.close()
    finally:
        shutil.rmtree(d)


async def test_a_void_of_a_unique_value_whose_log_write_fails_is_not_marked() -> None:
    """Undone, a void of a unique value leaves it counted and unmarked in storage, at every
    level (its mark is written only once its log record is on disk); sent again once the log
    writes, it takes back and the value is marked; storage that does not answer the mark
    leaves it waiting, with its key among those the node holds unstored (correctness V05)."""
    d = short_tmpdir("voids-")
    try:
        config = CounterConfig(tenant_hierarchy=True)
        store = MemoryStorage()
        svc, wal = await logged_service(d, store, config=config)
        await call(svc, "set_feature", "seats", {"aggregation": "unique"})
        await call(svc, "track", "acme/bob", "seats", 1, {"value": "ann", "id": "u1"})
        await call(svc, "track", "acme/bob", "seats", 1, {"value": "bea"})
        await settle()
        keys = [("acme/bob", "seats", MONTH), ("acme", "seats", MONTH)]
        with disk_full(wal):
            assert await call(svc, "void", "u1", {"id": "v1"}) == {"voided": 1, "value": 1}
            # The mark waits for the log, whose commit fails: the void is undone, unmarked.
            assert await svc.uniques.voids.mark() == 0
            assert broken(wal) is not None
        assert svc.uniques.voids.unmarked == {}
        for key in keys:
            assert await store.values_page(key, None, 10) == (["ann", "bea"], None)
        await log_back(wal)
        assert await call(svc, "usage", "acme", "seats") == 2
        assert await call(svc, "void", "u1", {"id": "v1"}) == {"voided": 1, "value": 1}
        store.fail_next = 1  # (the first mark is not written: it waits for the next pass)
        assert await svc.uniques.voids.mark() == 2
        assert sorted(svc.uniques.voids.keys()) == sorted(keys)
        assert await svc.uniques.voids.mark() == 0
        for key in keys:
            assert await store.values_page(key, None, 10) == (["bea"], None)
        assert await call(svc, "usage", "acme", "seats") == 1
        await wal.close()
    finally:
        shutil.rmtree(d)


async def test_an_id_reused_after_its_window_drops_what_its_first_call_counted() -> None:
    """An id forgotten early (past the most ids kept) and reused by a reserve is not a
    counted call any more: before a restart and after one from the log's records."""
    d = short_tmpdir("voids-")
    try:
        store = MemoryStorage()

        async def start() -> tuple[Service, WriteAheadLog]:
            wal = WriteAheadLog(d, node_id="n1", mode="fsync")
            svc = build_service(CounterTable("n1"), store, CounterConfig(), wal=wal,
                                ids=RequestIds(3600, 3))  # fmt: skip
            await recover(wal, svc)
            return svc, wal

        svc, wal = await start()
        await call(svc, "track", "acme", "api", 5, {"id": "X"})
        for rid in ("Y", "Z", "W"):  # (X is dropped: at most 3 ids kept)
            await call(svc, "track", "acme", "api", 1, {"id": rid})
        await call(svc, "reserve", "acme", "api", 1, {"id": "X"})
        for restart in (False, True):
            if restart:
                await wal.durable()
                await wal.close(final_checkpoint=False)
                svc, wal = await start()
            err = await error(svc, "void", "X")
            assert isinstance(err, NotFound), err
            assert await call(svc, "usage", "acme", "api") == 9  # (8 counted, 1 held)
        await wal.close()
    finally:
        shutil.rmtree(d)


async def test_a_void_waiting_for_a_cold_counter_judges_again_after_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a restart the counters are cold: a void reads them first; a call undone while
    it waited (its id forgotten) is then not taken back, the other is."""

    d = short_tmpdir("voids-")
    try:
        store = SlowLoads()
        svc, wal = await logged_service(d, store)
        await call(svc, "track", "acme", "api", 5, {"id": "t1"})
        await call(svc, "track", "acme", "api", 6, {"id": "t2"})
        await wal.durable()
        await wal.close(final_checkpoint=False)
        store.gate = asyncio.Event()  # (storage slow: the restart leaves them unseeded)
        monkeypatch.setattr(recovery, "SEED_BUDGET_S", 0.05)
        svc, wal = await logged_service(d, store)
        assert not svc.table.is_seeded(("acme", "api", MONTH))
        first = asyncio.ensure_future(call(svc, "void", "t1"))
        second = asyncio.ensure_future(call(svc, "void", "t2"))
        await asyncio.sleep(0.05)
        assert not first.done() and not second.done()
        svc.ids.forget("t2")  # (as a failed log write's undo forgets a call's id)
        store.gate.set()
        assert await first == {"voided": 5, "value": 6}
        with pytest.raises(NotFound):
            await second
        assert await call(svc, "usage", "acme", "api") == 6
        await wal.close()
    finally:
        shutil.rmtree(d)


async def test_a_commit_with_dimensions_is_voided_on_every_counter_after_a_restart() -> None:
    d = short_tmpdir("voids-")
    try:
        store = MemoryStorage()
        svc, wal = await logged_service(d, store)
        await call(svc, "set_feature", "tokens", {"dimensions": ["model"]})
        await call(svc, "track", "acme", "tokens", 2, {"dims": {"model": "a"}})
        lease = await call(svc, "reserve", "acme", "tokens", 10, {"dims": {"model": "a"}})
        assert await call(svc, "commit", lease, 7, {"id": "c1"}) == 9
        for final in (False, True):
            await wal.durable()
            await wal.close(final_checkpoint=final)
            svc, wal = await logged_service(d, store)
            got = await call(svc, "usage", "acme", "tokens", {"group_by": ["model"]})
            assert got["groups"] == [{"dims": {"model": "a"}, "value": 9}], got
        assert await call(svc, "void", "c1") == {"voided": 7, "value": 2}
        got = await call(svc, "usage", "acme", "tokens", {"group_by": ["model"]})
        assert got == {"total": 2, "groups": [{"dims": {"model": "a"}, "value": 2}]}, got
        await wal.close()
    finally:
        shutil.rmtree(d)
