"""Declared features and dimensions in one process (docs/dimensions.md): what a call with
dimensions counts, group-by and ``where`` reads, the bound on dimension counters, bad input,
request ids, limits on one dimension value, the log, a flush, gossip from a peer, export,
live usage and history. Real nodes: tests/test_dimensions_cluster.py."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from hypothesis import given as hypothesis_given
from hypothesis import settings
from hypothesis import strategies as st

from meter.config import CounterConfig
from meter.core import dims
from meter.core.idempotency import RequestIds
from meter.core.keycache import DIM_NODES_SIZE, KeyCache
from meter.core.keys import period_start
from meter.core.service import Service
from meter.core.table import CounterTable
from meter.core.watch import Subscriber
from meter.errors import Conflict, InvalidArgument, LimitExceeded, MeterError, Unavailable
from meter.node.wiring import build_service
from meter.persist.flusher import Flusher
from meter.persist.recovery import recover
from meter.quotas.store import LimitStore
from meter.wal.log import WriteAheadLog
from storage.base import StorageUnavailable
from storage.memory import MemoryStorage
from tests.support.nodes import short_tmpdir
from tests.support.services import logged_service

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


def service(store: MemoryStorage | None = None, node: str = "n1", **config: Any) -> Service:
    return build_service(CounterTable(node), store or MemoryStorage(), CounterConfig(**config))


def limits_of(svc: Service) -> LimitStore:
    """The service's limits and declarations (a node reads them before its socket opens)."""
    return cast(LimitStore, svc.limits)


async def declared(svc: Service, **options: Any) -> Service:
    opts = {"dimensions": ["model", "region"], **options}
    await call(svc, "set_feature", "tokens", opts)
    return svc


CALLS: list[tuple[int, dict[str, str]]] = [
    (10, {"model": "gpt-4", "region": "eu"}),
    (5, {"model": "gpt-4"}),
    (7, {"model": "o1", "region": "us"}),
    (2, {"region": "eu"}),
    (3, {}),
    (1, {"model": "o1", "region": "us"}),
]


def expected(calls: list[tuple[int, dict[str, str]]], by: tuple[str, ...]) -> dict[Any, int]:
    """What a group-by must answer, summed from the calls themselves."""
    out: dict[Any, int] = {}
    for qty, given in calls:
        at = tuple(given.get(n) for n in by)
        out[at] = out.get(at, 0) + qty
    return {k: v for k, v in out.items() if v}


def groups_of(answer: dict[str, Any], by: tuple[str, ...]) -> dict[Any, int]:
    got = {tuple(g["dims"][n] for n in by): g["value"] for g in answer["groups"]}
    assert sum(got.values()) == answer["total"]
    return got


async def track_all(svc: Service, tenant: str = "acme") -> int:
    last = 0
    for qty, given in CALLS:
        opts = {"dims": given} if given else {}
        last = await call(svc, "track", tenant, "tokens", qty, opts)
    return last


async def test_a_call_with_dimensions_counts_on_the_total_and_every_group() -> None:
    svc = await declared(service())
    assert await track_all(svc) == 28  # track answers the feature's total
    assert await call(svc, "usage", "acme", "tokens") == 28
    for by in [("model",), ("region",), ("model", "region"), ("region", "model")]:
        got = await call(svc, "usage", "acme", "tokens", {"group_by": list(by)})
        assert got["total"] == 28
        assert groups_of(got, by) == expected(CALLS, by), by
    assert await call(svc, "usage", "acme", "tokens", {"where": {"model": "gpt-4"}}) == 15
    assert await call(svc, "usage", "acme", "tokens", {"where": {"region": "eu"}}) == 12
    assert await call(svc, "usage", "acme", "tokens", {"where": {"model": "none"}}) == 0
    # usage_all answers totals only: dimension counters are read with group_by.
    assert await call(svc, "usage_all", "acme") == {"tokens": 28}
    got = await call(svc, "usage", "acme", "tokens", {"group_by": ["model"]})
    assert got["groups"][-1] == {"dims": {"model": None}, "value": 5}  # gave no model


@settings(max_examples=60, deadline=None)
@hypothesis_given(
    st.lists(
        st.tuples(
            st.integers(-5, 20),
            st.fixed_dictionaries(
                {},
                optional={
                    "a": st.sampled_from(["x", "y", "z=1,{w}"]),
                    "b": st.sampled_from(["p", "q"]),
                    "c": st.sampled_from(["#", "é"]),
                },
            ),
        ),
        max_size=30,
    )
)
def test_group_by_any_dimensions_adds_up_to_what_the_calls_gave(
    calls: list[tuple[int, dict[str, str]]],
) -> None:
    """D01's algebra: the counters a call counts on (``counter_names``) summed, then grouped
    by any list of the declared names, give each group exactly the calls of its values."""
    spec = dims.FeatureSpec(dimensions=("a", "b", "c"))
    counters: dict[str, int] = {}
    total = 0
    for qty, given in calls:
        total += qty
        pairs = dims.check_dims("f", spec, given)
        for name in dims.counter_names("f", pairs):
            counters[name] = counters.get(name, 0) + qty
    for n in (1, 2, 3):
        for by in itertools.permutations("abc", n):
            got = dims.group(total, counters, by)
            assert got["total"] == total
            assert groups_of(got, by) == expected(calls, by)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"tier": "pro"}, "has no dimension 'tier'"),
        ({"model": 4}, "value must be a string"),
        ({"model": ""}, "value must be 1..64 bytes"),
        ({"model": "x" * 65}, "value must be 1..64 bytes"),
        ({"model": "a\nb"}, "is not printable"),
        ({"model": "a\x1fb"}, "is not printable"),
        ({"model": "\udcff"}, "not valid UTF-8"),
        (["model", "x"], "dims must be a map"),
        ({3: "x"}, "has no dimension"),
    ],
)
async def test_bad_dimensions_are_refused_and_count_nothing(given: Any, message: str) -> None:
    svc = await declared(service())
    await call(svc, "track", "acme", "tokens", 1, {"dims": {"model": "a"}})
    exc = await error(svc, "track", "acme", "tokens", 5, {"dims": given})
    assert exc.code == "invalid_argument" and message in exc.message, exc
    answers = await call(svc, "track_many", [["acme", "tokens", 5, {"dims": given}]])
    assert answers[0]["code"] == "invalid_argument", answers
    assert await call(svc, "usage", "acme", "tokens") == 1
    got = await call(svc, "usage", "acme", "tokens", {"group_by": ["model", "region"]})
    assert got["groups"] == [{"dims": {"model": "a", "region": None}, "value": 1}]


async def test_dimensions_of_an_undeclared_feature_are_refused() -> None:
    svc = await declared(service())
    exc = await error(svc, "track", "acme", "api", 1, {"dims": {"model": "a"}})
    assert isinstance(exc, InvalidArgument) and "declares no dimensions" in exc.message
    exc = await error(svc, "usage", "acme", "api", {"group_by": ["model"]})
    assert isinstance(exc, InvalidArgument) and "no dimension 'model'" in exc.message
    assert await call(svc, "usage", "acme", "api") == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"aggregation": "median"}, "aggregation must be one of"),
        ({"dimensions": "model"}, "dimensions must be a list"),
        ({"dimensions": ["a", "b", "c", "d", "e"]}, "at most 4"),
        ({"dimensions": ["a", "a"]}, "named twice"),
        ({"dimensions": ["a b"]}, "characters outside"),
        ({"dimensions": ["x" * 33]}, "1..32 bytes"),
        ({"dimensions": [7]}, "must be a string"),
        ({"max_combinations": 0}, "max_combinations must be 1..100000"),
        ({"max_combinations": True}, "must be an integer"),
        ({"bound": 3}, "unknown option 'bound'"),
        ("x", "options must be a map"),
    ],
)
async def test_bad_declarations_are_refused_and_change_nothing(options: Any, message: str) -> None:
    svc = await declared(service())
    exc = await error(svc, "set_feature", "tokens", options)
    assert exc.code == "invalid_argument" and message in exc.message, exc
    got = await call(svc, "get_feature", "tokens")
    assert got["dimensions"] == ["model", "region"] and got["declared"] is True


async def test_get_feature_answers_undeclared_features_as_sums() -> None:
    svc = service()
    got = await call(svc, "get_feature", "api")
    assert got == {"feature": "api", "declared": False, "version": 0, "aggregation": "sum",
                   "dimensions": [], "max_combinations": 1000}  # fmt: skip
    exc = await error(svc, "get_feature", "a b")
    assert exc.code == "invalid_argument"


async def test_the_bound_refuses_new_dimension_counters_and_counts_nothing() -> None:
    # Bound 4: one model and one region with their combination are 3 counters.
    svc = await declared(service(), max_combinations=4)
    assert await call(svc, "track", "acme", "tokens", 1, {"dims": {"model": "a", "region": "x"}})
    # A new model alone: 1 more counter (4 in all): counted.
    assert await call(svc, "track", "acme", "tokens", 1, {"dims": {"model": "b"}}) == 2
    exc = await error(svc, "track", "acme", "tokens", 1, {"dims": {"model": "c"}})
    assert exc.code == "invalid_argument" and "max_combinations" in exc.message
    exc = await error(svc, "track", "acme", "tokens", 1, {"dims": {"model": "b", "region": "x"}})
    assert "bound of 4" in exc.message
    # Known counters still count, at the bound; other tenants have bounds of their own.
    assert await call(svc, "track", "acme", "tokens", 5, {"dims": {"model": "a", "region": "x"}})
    assert await call(svc, "track", "bob", "tokens", 1, {"dims": {"model": "c"}}) == 1
    assert await call(svc, "usage", "acme", "tokens") == 7
    got = await call(svc, "usage", "acme", "tokens", {"group_by": ["model"]})
    assert groups_of(got, ("model",)) == {("a",): 6, ("b",): 1}
    answers = await call(
        svc,
        "track_many",
        [
            ["acme", "tokens", 1, {"dims": {"model": "c"}}],
            ["acme", "tokens", 2, {"dims": {"model": "a"}}],
        ],
    )
    assert answers[0]["code"] == "invalid_argument" and answers[1] == 9, answers
    assert svc.groups.refused == 3


class SlowList(MemoryStorage):
    """Listings wait until released, so calls making new counters meet inside the wait."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def list_between(self, tenant: str, period: str, first: str, last: str) -> Any:
        await self.release.wait()
        return await super().list_between(tenant, period, first, last)


async def test_calls_making_new_counters_at_once_stay_within_the_bound() -> None:
    store = SlowList()
    store.release.set()
    svc = await declared(service(store), max_combinations=3)
    store.release.clear()
    pending = [
        svc.dispatch("track", ["acme", "tokens", 1, {"dims": {"model": m}}]) for m in "abcde"
    ]
    assert all(inspect.isawaitable(p) for p in pending)
    store.release.set()
    got = await asyncio.gather(*pending, return_exceptions=True)
    assert sum(1 for g in got if isinstance(g, InvalidArgument)) == 2, got
    assert await call(svc, "usage", "acme", "tokens") == 3


async def test_a_retried_id_counts_once_and_other_dimensions_conflict() -> None:
    svc = await declared(service())
    opts = {"id": "r1", "dims": {"model": "a"}}
    assert await call(svc, "track", "acme", "tokens", 4, opts) == 4
    assert await call(svc, "track", "acme", "tokens", 4, opts) == 4
    exc = await error(svc, "track", "acme", "tokens", 4, {"id": "r1", "dims": {"model": "b"}})
    assert isinstance(exc, Conflict)
    items = [["acme", "tokens", 2, {"id": "r2", "dims": {"model": "b"}}]] * 2
    assert await call(svc, "track_many", items) == [6, 6]
    assert await call(svc, "track_many", items[:1]) == [6]
    got = await call(svc, "usage", "acme", "tokens", {"group_by": ["model"]})
    assert groups_of(got, ("model",)) == {("a",): 4, ("b",): 2}


@pytest.mark.parametrize("enforcement", ["fast", "strict"])
async def test_a_hard_limit_on_one_dimension_value_refuses_only_that_value(
    enforcement: str,
) -> None:
    svc = await declared(service())
    spec = {"limit": 10, "enforcement": enforcement, "where": {"model": "gpt-4"}}
    await call(svc, "set_limit", "acme", "tokens", spec)
    limits = await call(svc, "limits", "acme")
    assert set(limits["limits"]) == {"tokens{model=gpt-4}"}
    gpt4 = {"dims": {"model": "gpt-4", "region": "eu"}}
    assert await call(svc, "track", "acme", "tokens", 8, gpt4) == 8
    exc = await error(svc, "track", "acme", "tokens", 3, gpt4)
    assert isinstance(exc, LimitExceeded) and "tokens{model=gpt-4}" in exc.message, exc
    assert await call(svc, "track", "acme", "tokens", 50, {"dims": {"model": "o1"}}) == 58
    assert await call(svc, "track", "acme", "tokens", 2, gpt4) == 60
    check = await call(svc, "check", "acme", "tokens", 1, {"dims": {"model": "gpt-4"}})
    assert check["allowed"] is False and check["limit"] == 10
    assert (await call(svc, "check", "acme", "tokens", 1, {"dims": {"model": "o1"}}))["allowed"]
    got = await call(svc, "usage", "acme", "tokens", {"group_by": ["model"]})
    assert groups_of(got, ("model",)) == {("gpt-4",): 10, ("o1",): 50}
    await call(svc, "clear_limit", "acme", "tokens", {"where": {"model": "gpt-4"}})
    assert await call(svc, "track", "acme", "tokens", 3, gpt4) == 63


async def test_limits_where_and_plans_name_one_dimension_value() -> None:
    svc = await declared(service())
    for bad, message in [
        ({"model": "a", "region": "b"}, "one dimension value"),
        ({}, "one dimension value"),
        ({"model": "a\n"}, "not printable"),
        ("model=a", "one dimension value"),
    ]:
        exc = await error(svc, "set_limit", "acme", "tokens", {"limit": 1, "where": bad})
        assert exc.code == "invalid_argument" and message in exc.message, (bad, exc)
    plan = {"tokens{model=gpt-4}": {"limit": 2}, "tokens": {"limit": 9}}
    await call(svc, "set_plan", "pro", plan)
    await call(svc, "assign_plan", "acme", "pro")
    assert await call(svc, "track", "acme", "tokens", 2, {"dims": {"model": "gpt-4"}}) == 2
    exc = await error(svc, "track", "acme", "tokens", 1, {"dims": {"model": "gpt-4"}})
    assert isinstance(exc, LimitExceeded)
    assert await call(svc, "track", "acme", "tokens", 7) == 9
    exc = await error(svc, "track", "acme", "tokens", 1, {"dims": {"model": "o1"}})
    assert isinstance(exc, LimitExceeded) and "tokens:" in exc.message  # the total's limit
    assert (await call(svc, "limits", "acme"))["limits"]["tokens{model=gpt-4}"]["limit"] == 2


async def test_with_the_hierarchy_an_account_groups_its_users_calls() -> None:
    svc = await declared(service(tenant_hierarchy=True))
    await call(svc, "track", "acme/alice", "tokens", 3, {"dims": {"model": "a"}})
    await call(svc, "track", "acme/bob", "tokens", 4, {"dims": {"model": "a", "region": "x"}})
    await call(svc, "track", "acme", "tokens", 1, {"dims": {"model": "b"}})
    got = await call(svc, "usage", "acme", "tokens", {"group_by": ["model"]})
    assert groups_of(got, ("model",)) == {("a",): 7, ("b",): 1}
    got = await call(svc, "usage", "acme/bob", "tokens", {"group_by": ["region"]})
    assert groups_of(got, ("region",)) == {("x",): 4}


async def test_a_reservation_with_dimensions_holds_and_commits_on_them() -> None:
    """Reserved units are held on the total and on the dimension counters (the groups add
    up to the total throughout); a commit counts what it used on all of them, a release or
    an expiry gives every hold back."""
    svc = await declared(service())
    by = ("model", "region")
    dims = {"model": "gpt-4", "region": "eu"}
    lease = await call(svc, "reserve", "acme", "tokens", 100, {"dims": dims})
    got = await call(svc, "usage", "acme", "tokens", {"group_by": list(by)})
    assert got["total"] == 100 and groups_of(got, by) == {("gpt-4", "eu"): 100}
    assert await call(svc, "commit", lease, 60) == 60
    assert await call(svc, "commit", lease, 60) == 60  # (a repeated commit answers as before)
    got = await call(svc, "usage", "acme", "tokens", {"group_by": ["model"]})
    assert got["total"] == 60 and groups_of(got, ("model",)) == {("gpt-4",): 60}
    assert await call(svc, "usage", "acme", "tokens", {"where": {"region": "eu"}}) == 60
    other = await call(svc, "reserve", "acme", "tokens", 5, {"dims": {"model": "o1"}})
    await call(svc, "release", other)
    await call(svc, "reserve", "acme", "tokens", 7, {"dims": {"region": "us"}, "ttl_ms": 1000})
    assert svc.reserving.expire(time.monotonic() + 2) == 1
    got = await call(svc, "usage", "acme", "tokens", {"group_by": list(by)})
    assert got["total"] == 60 and groups_of(got, by) == {("gpt-4", "eu"): 60}


async def test_what_a_reservation_with_dimensions_refuses() -> None:
    svc = await declared(service(), max_combinations=3)
    await call(svc, "set_limit", "acme", "tokens", {"limit": 1000, "where": {"model": "gpt-4"}})
    await limits_of(svc).refresh()
    for opts, message in [
        ({"dims": {"model": "gpt-4"}}, "has a limit of its own"),
        ({"dims": {"colour": "red"}}, "colour"),
        ({"dims": {"model": 4}}, "model"),
    ]:
        exc = await error(svc, "reserve", "acme", "tokens", 5, opts)
        assert exc.code == "invalid_argument" and message in exc.message, (opts, exc)
    # The bound: a combination past it is refused at reserve time, nothing held.
    await call(svc, "reserve", "acme", "tokens", 1, {"dims": {"model": "o1", "region": "us"}})
    exc = await error(
        svc, "reserve", "acme", "tokens", 1, {"dims": {"model": "o3", "region": "eu"}}
    )
    assert "max_combinations" in exc.message
    assert await call(svc, "usage", "acme", "tokens") == 1
    # An id retried answers the same reservation (also once its value got a limit of its
    # own); with other dims it is another call.
    first = await call(svc, "reserve", "beta", "tokens", 2, {"dims": {"model": "o1"}, "id": "q"})
    await call(svc, "set_limit", "beta", "tokens", {"limit": 9, "where": {"model": "o1"}})
    await limits_of(svc).refresh()
    again = await call(svc, "reserve", "beta", "tokens", 2, {"dims": {"model": "o1"}, "id": "q"})
    assert first == again
    exc = await error(svc, "reserve", "beta", "tokens", 2, {"dims": {"model": "o1"}})
    assert "beta/tokens{model=o1} has a limit of its own" in exc.message
    exc = await error(svc, "reserve", "beta", "tokens", 2, {"dims": {"model": "x"}, "id": "q"})
    assert exc.code == "conflict"


async def test_group_by_and_where_bad_input() -> None:
    svc = await declared(service())
    for opts, message in [
        ({"group_by": []}, "non-empty list"),
        ({"group_by": "model"}, "non-empty list"),
        ({"group_by": ["model", "model"]}, "twice"),
        ({"group_by": ["tier"]}, "no dimension 'tier'"),
        ({"group_by": ["model"], "where": {"model": "a"}}, "not both"),
        ({"where": {"model": "a", "region": "b"}}, "use group_by"),
        ({"where": {"tier": "a"}}, "no dimension"),
    ]:
        exc = await error(svc, "usage", "acme", "tokens", opts)
        assert exc.code == "invalid_argument" and message in exc.message, (opts, exc)


@pytest.fixture
def tmp() -> Iterator[Path]:
    d = short_tmpdir("dims-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def test_a_restart_replays_every_counter_a_call_with_dimensions_counted(tmp: Path) -> None:
    store = MemoryStorage()

    async def start() -> tuple[Service, WriteAheadLog]:
        wal = WriteAheadLog(tmp / "wal", node_id="n1", mode="fsync")
        svc = build_service(CounterTable("n1"), store, CounterConfig(), wal=wal,
                            ids=RequestIds(3600, 1000))  # fmt: skip
        await recover(wal, svc)
        return svc, wal

    svc, wal = await start()
    await declared(svc)
    await track_all(svc)
    await call(svc, "track_many", [["acme", "tokens", 4, {"dims": {"model": "gpt-4"}}]])
    await wal.durable()
    await wal.close()  # (nothing flushed: the log holds every count)
    svc, wal = await start()
    await limits_of(svc).refresh()  # (the node reads the declarations before its socket opens)
    assert await call(svc, "usage", "acme", "tokens") == 32
    got = await call(svc, "usage", "acme", "tokens", {"group_by": ["model", "region"]})
    want = expected([*CALLS, (4, {"model": "gpt-4"})], ("model", "region"))
    assert groups_of(got, ("model", "region")) == want
    await wal.close()


async def test_a_commit_on_a_value_limited_since_is_refused_and_all_or_none() -> None:
    from meter.core.keys import QTY_MAX

    svc = await declared(service())
    lease = await call(svc, "reserve", "acme", "tokens", 10, {"dims": {"model": "gpt-4"}})
    await call(svc, "set_limit", "acme", "tokens", {"limit": 50, "where": {"model": "gpt-4"}})
    await limits_of(svc).refresh()
    exc = await error(svc, "commit", lease, 1000)
    assert exc.code == "conflict" and "release it" in exc.message
    assert await call(svc, "usage", "acme", "tokens", {"where": {"model": "gpt-4"}}) == 10
    await call(svc, "release", lease)
    # Past the 64-bit range on a dimension counter (larger than the total after a negative
    # call on another value): refused at reserve, and at commit, with nothing changed.
    beta = {"model": "a"}
    await call(svc, "track", "beta", "tokens", QTY_MAX - 5, {"dims": beta})
    await call(svc, "track", "beta", "tokens", -100, {"dims": {"model": "b"}})
    exc = await error(svc, "reserve", "beta", "tokens", 50, {"dims": beta})
    assert exc.code == "invalid_argument"
    assert await call(svc, "usage", "beta", "tokens") == QTY_MAX - 105
    lease = await call(svc, "reserve", "beta", "tokens", 3, {"dims": beta})
    exc = await error(svc, "commit", lease, 50)
    assert exc.code == "invalid_argument"
    assert await call(svc, "usage", "beta", "tokens") == QTY_MAX - 102
    assert await call(svc, "usage", "beta", "tokens", {"where": beta}) == QTY_MAX - 2
    assert await call(svc, "commit", lease, 3) == QTY_MAX - 102


async def test_a_reservation_with_dimensions_comes_back_from_the_log(tmp: Path) -> None:
    """An open reservation with dimensions is held on them again after a restart (also from
    a checkpoint's restatement); a commit logged before a crash counts on them on replay; a
    commit whose log write fails is taken back from them too."""
    from tests.test_wal_service import _kill, broken, disk_full, settle

    store = MemoryStorage()
    by = ("model", "region")

    async def start() -> tuple[Service, WriteAheadLog]:
        return await logged_service(tmp / "wal", store)

    svc, wal = await start()
    await declared(svc)
    a = await call(svc, "reserve", "acme", "tokens", 10, {"dims": {"model": "o1"}})
    b = await call(svc, "reserve", "acme", "tokens", 20, {"dims": {"model": "gpt-4"}})
    await call(svc, "commit", a, 4)
    await wal.durable()
    _kill(wal)  # (a crash: the log as it is)
    svc, wal = await start()
    got = await call(svc, "usage", "acme", "tokens", {"group_by": ["model"]})
    assert got["total"] == 24 and groups_of(got, ("model",)) == {("o1",): 4, ("gpt-4",): 20}
    await wal.close()  # (a clean stop: its checkpoint restates the open reservation)
    svc, wal = await start()
    await settle()
    with disk_full(wal):
        assert await call(svc, "commit", b, 15) == 19
        await settle()  # the commit's write fails: taken back, the reservation holds again
        assert broken(wal) is not None
    got = await call(svc, "usage", "acme", "tokens", {"group_by": list(by)})
    assert got["total"] == 24 and groups_of(got, ("model",)) == {("o1",): 4, ("gpt-4",): 20}
    for _ in range(100):
        if broken(wal) is None:
            break
        await asyncio.sleep(0.05)
    assert await call(svc, "commit", b, 15) == 19
    assert await Flusher(svc.table, store, wal=wal).flush_once()
    await wal.close()
    svc, wal = await start()
    got = await call(svc, "usage", "acme", "tokens", {"group_by": ["model"]})
    assert got["total"] == 19 and groups_of(got, ("model",)) == {("o1",): 4, ("gpt-4",): 15}
    await wal.close()


async def test_flushed_counters_are_grouped_by_another_node_and_exported() -> None:
    store = MemoryStorage()
    a = await declared(service(store, "n1"))
    await track_all(a)
    assert await Flusher(a.table, store).flush_once()
    b = service(store, "n2")
    await limits_of(b).refresh()
    got = await call(b, "usage", "acme", "tokens", {"group_by": ["model", "region"]})
    assert groups_of(got, ("model", "region")) == expected(CALLS, ("model", "region"))
    stored = await store.list_between("acme", MONTH, "tokens", "tokens" + dims.LAST)
    assert {dims.shown(f) for f in stored} >= {"tokens", "tokens{model=gpt-4,region=eu}"}
    page = await call(b, "export", MONTH)
    rows = {(r[1], tuple(sorted(r[4].items())) if len(r) == 5 else ()): r[3] for r in page["rows"]}
    assert rows[("tokens", ())] == 28
    assert rows[("tokens", (("model", "gpt-4"),))] == 15
    assert rows[("tokens", (("model", "gpt-4"), ("region", "eu")))] == 10


async def test_a_peers_new_counter_is_listed_again_and_grouped() -> None:
    """A dimension counter gossiped while cold here (a peer's new combination) makes the
    next group-by list the feature again: its units show once storage or gossip has them."""
    store = MemoryStorage()
    a = await declared(service(store, "n1"))
    b = service(store, "n2")
    await limits_of(b).refresh()
    await call(a, "track", "acme", "tokens", 2, {"dims": {"model": "x"}})
    await Flusher(a.table, store).flush_once()
    first = await call(b, "usage", "acme", "tokens", {"group_by": ["model"]})
    assert groups_of(first, ("model",)) == {("x",): 2}
    assert not inspect.isawaitable(b.dispatch("usage", ["acme", "tokens", {"group_by": ["model"]}]))
    # a counts a new model; b hears the deltas (gossip), holding that counter cold.
    await call(a, "track", "acme", "tokens", 5, {"dims": {"model": "y"}})
    deltas = [(k[0], k[1], k[2], seq, d) for k in a.table.touched_keys()
              for seq, d in a.table.take_gossip(k)]  # fmt: skip
    b.table.apply_remote_many("n1", deltas)
    assert b.table.value(("acme", "tokens", MONTH)) == 7
    assert ("acme", dims.value_counter("tokens", "model", "y"), MONTH) in b.table.missed.heard
    again = b.dispatch("usage", ["acme", "tokens", {"group_by": ["model"]}])
    assert inspect.isawaitable(again)  # listed again, the peer's deltas applied
    assert groups_of(await again, ("model",)) == {("x",): 2, ("y",): 5}
    # Once a's flush lands and b re-bases on it, nothing is counted twice.
    await Flusher(a.table, store).flush_once()
    for key, snap in (await store.load(b.table.keys())).items():
        b.table.rebase(key, snap, "read")
    got = await call(b, "usage", "acme", "tokens", {"group_by": ["model"]})
    assert groups_of(got, ("model",)) == {("x",): 2, ("y",): 5}
    # A feature b never listed keeps no deltas.
    await call(a, "track", "acme", "tokens", 1, {"dims": {"model": "z"}})
    await call(a, "track", "bob", "tokens", 1, {"dims": {"model": "z"}})
    deltas = [(k[0], k[1], k[2], seq, d) for k in a.table.touched_keys()
              for seq, d in a.table.take_gossip(k)]  # fmt: skip
    b.table.apply_remote_many("n1", deltas)
    assert {k[0] for k in b.table.missed.heard} == {"acme"}


async def test_live_usage_and_history_carry_dimensions() -> None:
    svc = await declared(service())
    sub = Subscriber()
    answer = svc.dispatch("subscribe", ["acme", ["tokens"]])
    first = answer.run(sub)
    if inspect.isawaitable(first):
        first = await first
    await call(svc, "track", "acme", "tokens", 3, {"dims": {"model": "a", "region": "x"}})
    svc.watch_tick()
    notes = sub.take(100)
    shapes = {(n[1], tuple(sorted(n[4].items())) if len(n) == 5 else ()): n[2] for n in notes}
    assert shapes == {
        ("tokens", ()): 3,
        ("tokens", (("model", "a"),)): 3,
        ("tokens", (("region", "x"),)): 3,
        ("tokens", (("model", "a"), ("region", "x"))): 3,
    }
    history = await call(svc, "history", "acme", "tokens", {"where": {"model": "a"}})
    assert history[-1][1] == 3
    history = await call(svc, "history", "acme", "tokens", {"where": {"model": "b"}})
    assert history[-1][1] == 0


async def test_dimensions_wait_for_the_declarations_to_be_read() -> None:
    svc = service()  # (its limits never read: storage unreachable since the start)
    exc = await error(svc, "track", "acme", "tokens", 1, {"dims": {"model": "a"}})
    assert isinstance(exc, Unavailable)
    assert await call(svc, "usage", "acme", "tokens") == 0


class StaleList(MemoryStorage):
    """Listings read storage when asked and answer once released: a flush can land between."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.release.set()

    async def list_between(self, tenant: str, period: str, first: str, last: str) -> Any:
        got = await super().list_between(tenant, period, first, last)
        await self.release.wait()
        return got


async def test_a_flush_announced_while_a_listing_is_read_is_not_lost() -> None:
    """A peer's flush of a counter lands after this node's listing read it, and its
    announcement arrives while the counter is still cold here: the listing seeds the older
    snapshot, then re-bases on the announced one (else the view would stay low until a
    reconcile, a minute later)."""
    store = StaleList()
    a = await declared(service(store, "n1"))
    b = service(store, "n2")
    await limits_of(b).refresh()
    await call(a, "track", "acme", "tokens", 2, {"dims": {"model": "x"}})
    await Flusher(a.table, store).flush_once()
    await call(a, "track", "acme", "tokens", 5, {"dims": {"model": "x"}})
    store.release.clear()
    reading = asyncio.ensure_future(call(b, "usage", "acme", "tokens", {"group_by": ["model"]}))
    await asyncio.sleep(0.01)  # (b's listing has read storage: x at 2)
    announced: list[tuple[Any, Any]] = []
    await Flusher(a.table, store, on_flushed=lambda done: announced.extend(done)).flush_once()
    for key, outcome in announced:
        b.table.rebase(key, outcome.snapshot, "gossip")  # (x is cold at b: noted)
    store.release.set()
    got = await reading
    assert groups_of(got, ("model",)) == {("x",): 7}, got


ITEM = st.tuples(
    st.sampled_from(["acme", "bob"]),
    st.sampled_from(["tokens", "api"]),
    st.integers(-3, 9),
    st.fixed_dictionaries(
        {}, optional={"model": st.sampled_from(["a", "b"]), "region": st.sampled_from(["x"])}
    ).flatmap(lambda d: st.permutations(list(d.items())).map(dict)),  # (in either order)
)


@settings(max_examples=40, deadline=None)
@hypothesis_given(st.lists(st.lists(ITEM, min_size=1, max_size=12), min_size=1, max_size=4))
def test_batches_answer_each_item_as_if_counted_one_after_another(
    batches: list[list[tuple[str, str, int, dict[str, str]]]],
) -> None:
    """Whatever mix of plain items and items with dimensions (the fast path sums each
    counter's units over the batch, the general path counts item by item), each item
    answers its total right after it, and the groups hold every item's units."""

    async def run() -> None:
        svc = await declared(service())
        totals: dict[tuple[str, str], int] = {}
        given: dict[str, list[tuple[int, dict[str, str]]]] = {"acme": [], "bob": []}
        for batch in [*batches, *batches]:  # (again: the names are known, the fast path)
            items: list[list[Any]] = []
            want = []
            for tenant, feature, qty, dims_ in batch:
                if feature == "api":  # (not declared: plain items only)
                    items.append([tenant, feature, qty])
                else:
                    items.append([tenant, feature, qty, {"dims": dims_}])
                    given[tenant].append((qty, dims_))
                totals[(tenant, feature)] = totals.get((tenant, feature), 0) + qty
                want.append(totals[(tenant, feature)])
            assert await call(svc, "track_many", items) == want
        for tenant, calls in given.items():
            for by in [("model",), ("model", "region")]:
                got = await call(svc, "usage", tenant, "tokens", {"group_by": list(by)})
                assert groups_of(got, by) == expected(calls, by)

    asyncio.run(run())


async def test_a_batch_item_past_64_bits_is_refused_alone_on_every_counter() -> None:
    svc = await declared(service())
    big = 2**63 - 10
    assert await call(svc, "track", "acme", "tokens", big, {"dims": {"model": "a"}}) == big
    items = [
        ["acme", "tokens", 1, {"dims": {"model": "b"}}],
        ["acme", "tokens", 20, {"dims": {"model": "a"}}],
        ["acme", "tokens", 2, {"dims": {"model": "b"}}],
    ]
    for _ in range(2):  # (the second time the names are known: the fast path gives way)
        answers = await call(svc, "track_many", items)
        assert answers[1]["code"] == "invalid_argument", answers
        assert [answers[0], answers[2]] == [await call(svc, "usage", "acme", "tokens") - 2,
                                            await call(svc, "usage", "acme", "tokens")]  # fmt: skip
    exc = await error(svc, "track", "acme", "tokens", 20, {"dims": {"model": "a"}})
    assert exc.code == "invalid_argument"
    got = await call(svc, "usage", "acme", "tokens", {"group_by": ["model"]})
    assert groups_of(got, ("model",)) == {("a",): big, ("b",): 6}


async def test_a_tenants_total_and_value_counter_spend_credits_from_one_pool_together() -> None:
    """Prices on the total and on a value counter both spend the tenant's credits: checked
    together, a call they cannot pay for together is refused (counted nowhere)."""
    svc = await declared(service())
    plan = {"tokens": {"price": 1}, "tokens{model=a}": {"price": 1}}
    await call(svc, "set_plan", "paid", plan)
    await call(svc, "assign_plan", "acme", "paid")
    await call(svc, "grant", "acme", 10, {"ref": "g1"})
    assert await call(svc, "track", "acme", "tokens", 3, {"dims": {"model": "a"}}) == 3  # 6 cr
    check = await call(svc, "check", "acme", "tokens", 3, {"dims": {"model": "a"}})
    assert check["allowed"] is False  # (6 more credits, 4 left)
    exc = await error(svc, "track", "acme", "tokens", 3, {"dims": {"model": "a"}})
    assert exc.code == "insufficient_balance", exc
    answers = await call(svc, "track_many", [["acme", "tokens", 3, {"dims": {"model": "a"}}]])
    assert answers[0]["code"] == "insufficient_balance", answers
    assert await call(svc, "track", "acme", "tokens", 2, {"dims": {"model": "a"}}) == 5  # 4 cr
    assert (await call(svc, "balance", "acme"))["available"] == 0
    got = await call(svc, "usage", "acme", "tokens", {"group_by": ["model"]})
    assert groups_of(got, ("model",)) == {("a",): 5}


async def test_reads_and_checks_make_no_counter_past_the_bound() -> None:
    """A ``where`` read (usage, history) of a value no call gave reads 0 and makes no
    counter; a check is refused past the bound as its track would be; neither lets a later
    track past the bound."""
    svc = await declared(service(), max_combinations=2)
    await call(svc, "track", "acme", "tokens", 1, {"dims": {"model": "a"}})
    await call(svc, "track", "acme", "tokens", 1, {"dims": {"model": "b"}})
    for model in "cdefg":
        where = {"where": {"model": model}}
        assert await call(svc, "usage", "acme", "tokens", where) == 0
        assert (await call(svc, "history", "acme", "tokens", where))[-1][1] == 0
        exc = await error(svc, "check", "acme", "tokens", 1, {"dims": {"model": model}})
        assert exc.code == "invalid_argument" and "max_combinations" in exc.message
        exc = await error(svc, "track", "acme", "tokens", 1, {"dims": {"model": model}})
        assert exc.code == "invalid_argument" and "max_combinations" in exc.message
    warm = svc.table.keys()
    rows = {k[1] for k in warm}
    assert rows == {"tokens", dims.value_counter("tokens", "model", "a"),
                    dims.value_counter("tokens", "model", "b")}  # fmt: skip
    assert await call(svc, "usage", "acme", "tokens", {"where": {"model": "a"}}) == 1


async def test_a_dimension_counters_name_is_never_a_feature_a_call_may_name() -> None:
    svc = await declared(service())
    await call(svc, "track", "acme", "tokens", 1, {"dims": {"model": "a"}})
    assert await call(svc, "usage", "acme", "tokens", {"where": {"model": "a"}}) == 1
    await call(svc, "history", "acme", "tokens", {"where": {"model": "a"}})
    raw = dims.value_counter("tokens", "model", "a")
    cases: list[tuple[str, list[Any]]] = [
        ("track", ["acme", raw, 100]),
        ("usage", ["acme", raw]),
        ("check", ["acme", raw, 1]),
    ]
    for method, params in cases:
        exc = await error(svc, method, *params)
        assert isinstance(exc, InvalidArgument) and "characters outside" in exc.message
    answers = await call(svc, "track_many", [["bob", raw, 1]])
    assert answers[0]["code"] == "invalid_argument", answers
    # (a restart's warm-up names counters from the log: they do not become callable names)
    svc.keys.current_keys([("acme", raw, MONTH)], 10)
    exc = await error(svc, "track", "acme", raw, 1)
    assert "characters outside" in exc.message
    assert await call(svc, "usage", "acme", "tokens") == 1


async def test_a_batch_that_goes_past_64_bits_and_back_is_counted_item_by_item() -> None:
    """Summed, +20 then -20 would stay in range; counted one after another, the first item
    passes it: it is refused, as on the general path."""
    svc = await declared(service())
    big = 2**63 - 10
    await call(svc, "track", "acme", "tokens", big, {"dims": {"model": "a"}})
    items = [
        ["acme", "tokens", 20, {"dims": {"model": "a"}}],
        ["acme", "tokens", -20, {"dims": {"model": "a"}}],
    ]
    answers = await call(svc, "track_many", items)
    assert answers[0]["code"] == "invalid_argument" and answers[1] == big - 20, answers
    assert await call(svc, "usage", "acme", "tokens") == big - 20


async def test_a_resync_gives_up_every_listing() -> None:
    from meter.node.wiring import resync_from

    store = MemoryStorage()
    svc = await declared(service(store))
    await call(svc, "track", "acme", "tokens", 1, {"dims": {"model": "a"}})
    await call(svc, "usage", "acme", "tokens", {"group_by": ["model"]})
    assert svc.groups.listed("acme", "tokens", MONTH)

    class Heard:
        def on_deltas(self, items: Any) -> None:
            pass

    await resync_from(store, svc.table, Heard())(None)  # type: ignore[arg-type]
    assert not svc.groups.listed("acme", "tokens", MONTH)


class OneFeatureDown(MemoryStorage):
    """Listings of ``tokens`` fail; everything else works."""

    async def list_between(self, tenant: str, period: str, first: str, last: str) -> Any:
        if first == "tokens":
            raise StorageUnavailable("down")
        return await super().list_between(tenant, period, first, last)


async def test_a_batch_item_whose_listing_cannot_be_read_fails_alone() -> None:
    svc = service(OneFeatureDown())
    await limits_of(svc).refresh()
    await call(svc, "set_feature", "tokens", {"dimensions": ["model"]})
    await call(svc, "set_feature", "seats", {"dimensions": ["model"]})
    answers = await call(
        svc,
        "track_many",
        [
            ["acme", "tokens", 1, {"dims": {"model": "a"}}],
            ["acme", "seats", 2, {"dims": {"model": "a"}}],
            ["acme", "api", 3],
        ],
    )
    assert answers[0]["code"] == "unavailable" and answers[1:] == [2, 3], answers
    assert await call(svc, "usage", "acme", "tokens") == 0


async def test_bad_where_and_empty_dims_read_clearly() -> None:
    svc = await declared(service())
    exc = await error(svc, "usage", "acme", "tokens", {"where": "model=a"})
    assert exc.message.startswith("where must be a map"), exc
    lease = await call(svc, "reserve", "acme", "tokens", 1, {"dims": {}})
    assert isinstance(lease, str)


def test_a_map_is_known_again_only_exactly_as_it_was_checked() -> None:
    """The trie of checked maps (KeyCache.known_dims): the same names and values in the same
    order, nothing shorter, nothing that is not a string; bounded, and emptied when the
    declarations change."""
    keys = KeyCache({}, hierarchy=False, grace_s=0.0)
    key = ("acme", "tokens", "2026-12")
    pairs = (("model", "a"), ("region", "x"))
    spread = keys.spread(key, pairs, {"model": "a", "region": "x"})
    node = keys.known_dims("tokens", {"model": "a", "region": "x"})
    assert node is not None and node.names is not None
    assert [("acme", n, "2026-12") for n in node.names] == spread
    assert spread[0] == key and len(spread) == 4
    unknowns: list[dict[str, Any]] = [
        {"region": "x", "model": "a"},  # (another order: checked again, then known too)
        {"model": "a"},
        {"model": "a", "region": "x", "extra": "1"},
        {"model": "a", "region": ["x"]},
        {"model": "b", "region": "x"},
    ]
    for unknown in unknowns:
        assert keys.known_dims("tokens", unknown) is None, unknown
    assert keys.known_dims("other", {"model": "a", "region": "x"}) is None
    assert keys.known_dims(7, {"model": "a", "region": "x"}) is None
    assert keys.spread(key, pairs, {"region": "x", "model": "a"}) == spread
    again = keys.known_dims("tokens", {"region": "x", "model": "a"})
    assert again is not None and again.names == node.names
    for i in range(DIM_NODES_SIZE):  # (past the bound the trie starts over, still right)
        keys.spread(key, (("model", f"m{i}"),), {"model": f"m{i}"})
    assert keys.known_dims("tokens", {"model": "a", "region": "x"}) is None
    assert keys.spread(key, pairs, {"model": "a", "region": "x"}) == spread
    keys.new_specs({})
    assert keys.known_dims("tokens", {"model": "a", "region": "x"}) is None
