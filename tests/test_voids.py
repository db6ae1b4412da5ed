"""``void``: a counted call taken back by its request id, exactly its units on exactly its
counters, once (docs/protocol.md, ``void``; ADR 0019; correctness V01-V03)."""

from __future__ import annotations

import asyncio
import shutil
from typing import Any

import pytest

from meter.config import CounterConfig
from meter.core.idempotency import RequestIds
from meter.core.keys import period_start
from meter.core.service import Service
from meter.core.table import CounterTable
from meter.errors import Conflict, InvalidArgument, MeterError, NotFound
from meter.node.wiring import build_service
from meter.persist import recovery
from meter.persist.recovery import recover
from meter.wal.log import WriteAheadLog
from storage.memory import MemoryStorage
from tests.support.nodes import short_tmpdir
from tests.support.services import SlowLoads, logged_service
from tests.test_dimensions import call, error

MONTH = period_start("month")


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
        (["u1"], NotFound, "counted nothing a void takes back"),  # a unique value's call
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
    await call(svc, "track", "acme", "seats", 1, {"value": "ann", "id": "u1"})
    await call(svc, "track", "acme", "other", -3, {"id": "neg1"})
    err = await error(svc, "void", *params)
    assert isinstance(err, kind) and message in str(err), err
    assert await call(svc, "usage", "acme", "api") == 15  # (10 counted, 5 held)
    assert await call(svc, "usage", "acme", "seats") == 1
    assert await call(svc, "usage", "acme", "other") == -3
    assert await call(svc, "void", "t1") == {"voided": 10, "value": 5}


async def test_a_call_priced_when_counted_is_not_voided() -> None:
    """Judged by the price when the call was counted (it spent credits), not the price now;
    also after a restart from the log and from a checkpoint."""
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
        for final in (False, True):
            for rid in ("paid", "paid-item"):
                err = await error(svc, "void", rid)
                assert isinstance(err, InvalidArgument) and "priced" in str(err), err
            assert await call(svc, "usage", "acme", "api") == 15
            await wal.durable()
            await wal.close(final_checkpoint=final)
            svc, wal = await logged_service(d, store)
        assert await call(svc, "void", "free") == {"voided": 4, "value": 11}
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
