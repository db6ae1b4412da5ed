"""``void``: a counted call taken back by its request id, exactly its units on exactly its
counters, once (docs/protocol.md, ``void``; ADR 0019; correctness V01-V03)."""

from __future__ import annotations

import asyncio
import calendar
import inspect
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meter.config import CounterConfig
from meter.core.keys import period_start
from meter.core.service import Service
from meter.core.table import CounterTable
from meter.errors import Conflict, InvalidArgument, MeterError, NotFound, PeriodClosed
from meter.node.wiring import build_service
from storage.memory import MemoryStorage
from tests.support.nodes import short_tmpdir
from tests.support.services import logged_service
from tests.test_wal_service import broken, disk_full, settle

MONTH = period_start("month")


async def call(svc: Service, method: str, *params: Any) -> Any:
    result = svc.dispatch(method, list(params))
    if inspect.isawaitable(result):
        return await result
    return result


async def error(svc: Service, method: str, *params: Any) -> MeterError:
    with pytest.raises(MeterError) as info:
        await call(svc, method, *params)
    return info.value


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
    err = await error(svc, "void", *params)
    assert isinstance(err, kind) and message in str(err), err
    assert await call(svc, "usage", "acme", "api") == 15  # (10 counted, 5 held)
    assert await call(svc, "void", "t1") == {"voided": 10, "value": 5}


async def test_a_priced_call_is_not_voided() -> None:
    svc = service()
    await call(svc, "grant", "acme", 1000)
    await call(svc, "set_limit", "acme", "api", {"price": 2})
    await call(svc, "track", "acme", "api", 10, {"id": "t1"})
    err = await error(svc, "void", "t1")
    assert isinstance(err, InvalidArgument) and "priced" in str(err)
    assert await call(svc, "usage", "acme", "api") == 10


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
    try:
        store = MemoryStorage()
        svc, wal = await logged_service(Path(d), store, config=CounterConfig(tenant_hierarchy=True))
        await call(svc, "track", "acme/bob", "api", 5, {"id": "t1"})
        items = [["acme/bob", "api", 2, {"id": "i1"}], ["acme/ann", "api", 3, {"id": "i2"}]]
        await call(svc, "track_many", items)
        await call(svc, "void", "i1", {"id": "v1"})
        await wal.durable()
        await wal.close(final_checkpoint=False)  # (the records themselves are replayed)
        svc, wal = await logged_service(Path(d), store, config=CounterConfig(tenant_hierarchy=True))
        assert await call(svc, "usage", "acme", "api") == 8
        assert await call(svc, "void", "i1", {"id": "v1"}) == {"voided": 2, "value": 5}
        assert await call(svc, "void", "i1") == {"voided": 0, "value": 5}
        assert await call(svc, "void", "t1") == {"voided": 5, "value": 0}  # (both levels)
        assert await call(svc, "usage", "acme", "api") == 3
        await wal.durable()
        await wal.close()  # (a checkpoint restates what each call counted, and if voided)
        svc, wal = await logged_service(Path(d), store, config=CounterConfig(tenant_hierarchy=True))
        assert await call(svc, "usage", "acme", "api") == 3
        assert await call(svc, "void", "i2") == {"voided": 3, "value": 0}
        assert await call(svc, "void", "t1") == {"voided": 0, "value": 0}
        await wal.close()
    finally:
        shutil.rmtree(d)


# Calls under ids: each id always names the same call (a reused id is a retry).
CALLS_BY_ID: dict[str, tuple[str, int, dict[str, str]]] = {
    "t0": ("acme/bob", 5, {"model": "a", "region": "x"}),
    "t1": ("acme/ann", 7, {"model": "b"}),
    "t2": ("acme", 11, {}),
    "t3": ("acme/bob", 2, {"region": "y"}),
    "t4": ("other", 3, {"model": "a"}),
}
TENANTS = ["acme", "acme/bob", "acme/ann", "other"]
OP = st.one_of(
    st.tuples(st.just("track"), st.sampled_from(sorted(CALLS_BY_ID))),
    st.tuples(st.just("plain"), st.sampled_from(TENANTS[1:]), st.integers(1, 9)),
    st.tuples(st.just("many"), st.lists(st.sampled_from(sorted(CALLS_BY_ID)), max_size=3)),
    st.tuples(
        st.just("void"),
        st.sampled_from([*CALLS_BY_ID, "t9"]),
        st.sampled_from([None, "v0", "v1", "v2"]),
    ),
    st.tuples(st.just("crash")),
    st.tuples(st.just("restart")),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(OP, min_size=5, max_size=25))
def test_whatever_the_calls_voids_and_restarts_each_call_counts_until_voided_once(
    ops: list[tuple[Any, ...]],
) -> None:
    """Tracks (under ids, plain, batched), voids (under void ids or none, repeated, of
    unknown ids) and restarts from the log (its records alone, or a checkpoint): every
    level of every tenant holds exactly the calls counted and not voided; a void answers
    its units once, and its retry as it first did."""

    async def run() -> None:
        d = short_tmpdir("voids-")
        config = CounterConfig(tenant_hierarchy=True)
        store = MemoryStorage()
        try:
            svc, wal = await logged_service(d, store, config=config)
            await call(svc, "set_feature", "tokens", {"dimensions": ["model", "region"]})
            counted: set[str] = set()
            voided: set[str] = set()
            void_ids: dict[str, tuple[str, Any]] = {}
            plain: dict[str, int] = {}
            for op in ops:
                if op[0] == "track":
                    tenant, qty, dims_ = CALLS_BY_ID[op[1]]
                    await call(svc, "track", tenant, "tokens", qty, {"dims": dims_, "id": op[1]})
                    counted.add(op[1])
                elif op[0] == "plain":
                    await call(svc, "track", op[1], "tokens", op[2])
                    plain[op[1]] = plain.get(op[1], 0) + op[2]
                elif op[0] == "many":
                    items = [[CALLS_BY_ID[r][0], "tokens", CALLS_BY_ID[r][1],
                              {"dims": CALLS_BY_ID[r][2], "id": r}] for r in op[1]]  # fmt: skip
                    answers = await call(svc, "track_many", items)
                    assert all(type(a) is int for a in answers), answers
                    counted.update(op[1])
                elif op[0] == "void":
                    _, rid, vid = op
                    if vid is not None and vid in void_ids and void_ids[vid][0] != rid:
                        err = await error(svc, "void", rid, {"id": vid})
                        assert isinstance(err, Conflict), err
                        continue
                    if vid is not None and vid in void_ids:
                        assert await call(svc, "void", rid, {"id": vid}) == void_ids[vid][1]
                        continue
                    if rid not in counted:
                        err = await error(svc, "void", rid, *([{"id": vid}] if vid else []))
                        assert isinstance(err, NotFound), err
                        continue
                    got = await call(svc, "void", rid, *([{"id": vid}] if vid else []))
                    want = 0 if rid in voided else CALLS_BY_ID[rid][1]
                    assert got["voided"] == want, (op, got)
                    voided.add(rid)
                    if vid is not None:
                        void_ids[vid] = (rid, got)
                else:
                    await wal.durable()
                    await wal.close(final_checkpoint=op[0] == "restart")
                    svc, wal = await logged_service(d, store, config=config)
            for tenant in TENANTS:
                want = sum(
                    CALLS_BY_ID[r][1]
                    for r in counted - voided
                    if CALLS_BY_ID[r][0] == tenant or CALLS_BY_ID[r][0].startswith(tenant + "/")
                ) + sum(q for t, q in plain.items() if t == tenant or t.startswith(tenant + "/"))
                assert await call(svc, "usage", tenant, "tokens") == want, tenant
                got = await call(svc, "usage", tenant, "tokens", {"group_by": ["model"]})
                by_model: dict[Any, int] = {}
                for r in counted - voided:
                    t, q, dims_ = CALLS_BY_ID[r]
                    if t == tenant or t.startswith(tenant + "/"):
                        by_model[dims_.get("model")] = by_model.get(dims_.get("model"), 0) + q
                for t, q in plain.items():
                    if t == tenant or t.startswith(tenant + "/"):
                        by_model[None] = by_model.get(None, 0) + q
                have = {g["dims"]["model"]: g["value"] for g in got["groups"]}
                assert have == {m: q for m, q in by_model.items() if q}, (tenant, have, by_model)
            await wal.close()
        finally:
            shutil.rmtree(d)

    asyncio.run(run())


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
        deadline = time.monotonic() + 10
        while broken(wal) is not None:
            assert time.monotonic() < deadline, "the log did not come back"
            await asyncio.sleep(0.05)
        assert await call(svc, "usage", "acme", "api") == 7
        assert await call(svc, "void", "t1", {"id": "v1"}) == {"voided": 5, "value": 2}
        assert await call(svc, "usage", "acme", "api") == 2
        await wal.close()
    finally:
        shutil.rmtree(d)
