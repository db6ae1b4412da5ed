"""Plans, overrides and their enforcement on one node (docs/quotas.md).

The pure book (meter/quotas/limits.py) directly; everything else through a real node on SQLite and
its socket, with the Python clients, as users call it.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from meter.client import AsyncClient
from meter.config import FlushConfig, NodeConfig, ServerConfig
from meter.errors import (
    ConfigError,
    Conflict,
    InvalidArgument,
    LimitExceeded,
    NotFound,
    Unavailable,
)
from meter.node.lifecycle import Node
from meter.quotas.limits import (
    SOFT_STRICT,
    Effective,
    LimitBook,
    assign_record,
    override_record,
    parse_features,
    parse_limit,
    plan_record,
)
from storage.memory import MemoryStorage
from tests.support.stores import DownStorage, SlowStorage

# -- the book ---------------------------------------------------------------------------------


def _book(*records: tuple[str, str, str, str | None]) -> LimitBook:
    return LimitBook.from_records(len(records), [(a, b, c, d) for a, b, c, d in records if d])


def test_an_override_beats_the_plan_and_a_plan_applies_to_its_tenants_only() -> None:
    pro = parse_features({"api": {"limit": 100}, "gpu": {"limit": 5, "kind": "soft"}})
    book = _book(
        plan_record("pro", pro),
        assign_record("acme", "pro"),
        assign_record("beta", "pro"),
        override_record("acme", "api", parse_limit({"limit": 7})),
    )
    assert book.effective("acme", "api") == Effective(7, "hard", "fast", "override")
    assert book.effective("acme", "gpu") == Effective(5, "soft", "fast", "plan:pro")
    assert book.effective("beta", "api") == Effective(100, "hard", "fast", "plan:pro")
    assert book.effective("gamma", "api") is None  # no plan
    assert book.effective("acme", "other") is None  # not in the plan
    assert set(book.for_tenant("acme")) == {"api", "gpu"}
    # A tenant on a plan that does not exist has only its overrides.
    one = parse_limit({"limit": 1})
    book = _book(assign_record("acme", "gone"), override_record("acme", "x", one))
    assert book.for_tenant("acme") == {"x": Effective(1, "hard", "fast", "override")}


def test_a_book_without_limits_answers_nothing_and_is_falsy() -> None:
    book = LimitBook.from_records(0, [])
    assert not book.by_pair and book.by_pair.count == 0
    assert book.effective("acme", "api") is None
    # A plan nobody is on limits no pair: the hot path stays unchecked.
    assert not _book(plan_record("pro", {"api": parse_limit({"limit": 1})})).by_pair


def test_a_book_is_not_built_per_tenant_and_feature() -> None:
    """20,000 tenants on a 20-feature plan: the book holds per plan and per override, not
    400,000 pairs (a change would stall every node's event loop for seconds at 100,000)."""
    import tracemalloc

    features = {f"f{i}": parse_limit({"limit": i + 1}) for i in range(20)}
    records = [assign_record(f"t{i}", "pro") for i in range(20_000)]
    records += [override_record("t7", "f3", parse_limit({"limit": 99, "kind": "soft"}))]
    stored = [plan_record("pro", features)] + [(a, b, c, d) for a, b, c, d in records if d]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        book = LimitBook.from_records(1, stored)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 8 * 1024 * 1024, f"{grown / 2**20:.1f} MiB for the book"
    assert book.by_pair.count == 400_000
    assert book.effective("t19999", "f19") == Effective(20, "hard", "fast", "plan:pro")
    assert book.effective("t7", "f3") == Effective(99, "soft", "fast", "override")
    assert ("t7", "f4") in book.by_pair and ("t7", "nope") not in book.by_pair
    assert book.effective("nobody", "f1") is None


def test_undecodable_records_are_skipped_and_listed() -> None:
    book = LimitBook.from_records(
        3,
        [
            ("plan", "p", "", "not json"),
            ("limit", "acme", "api", '{"limit": -1, "kind": "hard", "enforcement": "fast"}'),
            ("limit", "acme", "ok", '{"limit": 2, "kind": "soft", "enforcement": "fast"}'),
            ("weird", "x", "", "{}"),
        ],
    )
    assert len(book.bad) == 3
    assert book.effective("acme", "ok") == Effective(2, "soft", "fast", "override")
    # A plan with one undecodable feature keeps its other features.
    plan = '{"api": {"limit": 10, "kind": "hard", "enforcement": "fast"}, "gpu": {"limit": -3}}'
    book = LimitBook.from_records(2, [("plan", "pro", "", plan), ("assign", "acme", "", "pro")])
    assert book.bad == [(("plan", "pro", "gpu"), "bad limit -3")]
    assert book.effective("acme", "api") == Effective(10, "hard", "fast", "plan:pro")
    assert book.effective("acme", "gpu") is None
    # A strict limit stored by a later build is kept (and enforced as fast by this one).
    stored = '{"limit": 4, "kind": "hard", "enforcement": "strict"}'
    book = LimitBook.from_records(1, [("limit", "acme", "api", stored)])
    assert book.bad == [] and book.effective("acme", "api") == Effective(
        4, "hard", "strict", "override"
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (5, "must be a map"),
        ({}, "limit is missing"),
        ({"limit": "5"}, "must be an integer"),
        ({"limit": True}, "must be an integer"),
        ({"limit": -1}, "must be 0.."),
        ({"limit": 2**63}, "must be 0.."),
        ({"limit": 1, "kind": "medium"}, "kind must be hard or soft"),
        ({"limit": 1, "enforcement": "eventual"}, "enforcement must be fast or strict"),
        ({"limit": 1, "kind": "soft", "enforcement": "strict"}, SOFT_STRICT),
        ({"limit": 1, "colour": "red"}, "unknown field 'colour'"),
    ],
)
def test_bad_limit_specs_are_refused_with_a_clear_error(spec: Any, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message.replace(".", r"\.")):
        parse_limit(spec)


# -- through a node ---------------------------------------------------------------------------


@pytest.fixture
def tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp") as d:  # short path: socket paths are limited
        yield Path(d)


def _config(tmp: Path) -> NodeConfig:
    return NodeConfig(
        data_dir=tmp / "data",
        node_id="n1",
        server=ServerConfig(socket=tmp / "m.sock"),
        flush=FlushConfig(interval_ms=200),
    )


@pytest.fixture
async def client(tmp: Path) -> AsyncIterator[AsyncClient]:
    cfg = _config(tmp)
    async with Node(cfg):
        c = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
        try:
            yield c
        finally:
            await c.close()


async def test_plans_assignments_and_overrides_round_trip(client: AsyncClient) -> None:
    v1 = await client.set_plan("pro", {"api": {"limit": 100}, "gpu": {"limit": 5, "kind": "soft"}})
    v2 = await client.assign_plan("acme", "pro")
    v3 = await client.set_limit("acme", "api", 7)
    assert v1 < v2 < v3
    got = await client.limits("acme")
    assert got == {
        "tenant": "acme",
        "plan": "pro",
        "cycle": [],
        "version": v3,
        "limits": {
            "api": {"limit": 7, "kind": "hard", "enforcement": "fast", "source": "override"},
            "gpu": {"limit": 5, "kind": "soft", "enforcement": "fast", "source": "plan:pro"},
        },
    }
    await client.clear_limit("acme", "api")
    assert (await client.limits("acme"))["limits"]["api"]["source"] == "plan:pro"
    await client.assign_plan("acme", None)
    assert (await client.limits("acme"))["limits"] == {}
    assert (await client.limits("nobody")) == {
        "tenant": "nobody",
        "plan": None,
        "cycle": [],
        "version": v3 + 2,
        "limits": {},
    }


@pytest.mark.parametrize(
    ("method", "params", "code", "message"),
    [
        ("set_plan", ["pro"], "invalid_argument", "takes 2 params"),
        ("set_plan", ["", {}], "invalid_argument", "plan must not be empty"),
        ("set_plan", ["a b", {}], "invalid_argument", "characters outside"),
        ("set_plan", ["p" * 200, {}], "invalid_argument", "longer than 128"),
        ("set_plan", [7, {}], "invalid_argument", "plan must be a string"),
        ("set_plan", ["pro", []], "invalid_argument", "features must be a map"),
        ("set_plan", ["pro", {"bad feature": {"limit": 1}}], "invalid_argument", "feature"),
        ("set_plan", ["pro", {"api": {"limit": -5}}], "invalid_argument", "must be 0.."),
        ("set_plan", ["pro", {"api": {"limit": 1, "kind": "x"}}], "invalid_argument", "kind"),
        (
            "set_plan",
            ["pro", {"api": {"limit": 1, "kind": "soft", "enforcement": "strict"}}],
            "invalid_argument",
            SOFT_STRICT,
        ),
        (
            "set_plan",
            ["pro", {f"f{i}": {"limit": 1} for i in range(1001)}],
            "invalid_argument",
            "at most 1000 features",
        ),
        ("assign_plan", ["acme"], "invalid_argument", "takes 2 to 3 params"),
        ("assign_plan", ["bad tenant", "pro"], "invalid_argument", "tenant"),
        ("assign_plan", ["acme", ""], "invalid_argument", "plan must not be empty"),
        ("assign_plan", ["acme", "missing"], "not_found", "does not exist"),
        ("assign_plan", ["acme", None, {"anchor_day": 0}], "invalid_argument", "1..31"),
        ("assign_plan", ["acme", None, {"tz": "No/Where"}], "invalid_argument", "IANA zone"),
        ("assign_plan", ["acme", None, {"day": 3}], "invalid_argument", "unknown option"),
        ("assign_plan", ["acme", None, 5], "invalid_argument", "opts must be a map"),
        ("set_limit", ["acme", "api"], "invalid_argument", "takes 3 params"),
        ("set_limit", ["", "api", {"limit": 1}], "invalid_argument", "tenant must not be empty"),
        ("set_limit", ["acme", "a/b", {"limit": 1}], "invalid_argument", "feature"),
        ("set_limit", ["acme", "api", 5], "invalid_argument", "must be a map"),
        ("set_limit", ["acme", "api", {"limit": 1.5}], "invalid_argument", "must be an integer"),
        (
            "set_limit",
            ["acme", "api", {"limit": 1, "kind": "soft", "enforcement": "strict"}],
            "invalid_argument",
            SOFT_STRICT,
        ),
        ("clear_limit", ["acme"], "invalid_argument", "takes 2 to 3 params"),
        ("clear_limit", ["acme", ""], "invalid_argument", "feature must not be empty"),
        ("limits", [], "invalid_argument", "takes 1 params"),
        ("limits", [b"\xff"], "invalid_argument", "not valid UTF-8"),
        ("check", ["acme"], "invalid_argument", "takes 2 to 4 params"),
        ("check", ["acme", "api", "x"], "invalid_argument", "qty must be an integer"),
        ("check", ["acme", "api", 1, {"detail": True}], "invalid_argument", "unknown option"),
        ("track", ["acme", "api", 1, {"detail": 1}], "invalid_argument", "detail must be"),
    ],
)
async def test_every_bad_input_of_the_limits_methods_gets_a_clear_error(
    client: AsyncClient, method: str, params: list[Any], code: str, message: str
) -> None:
    with pytest.raises(Exception) as info:
        await client.call(method, *params)
    assert getattr(info.value, "code", None) == code, info.value
    assert message in str(info.value)
    assert await client.ping() == "pong"  # the connection stays usable


async def test_a_hard_limit_admits_exactly_the_limit_under_concurrent_clients(
    tmp: Path,
) -> None:
    cfg = _config(tmp)
    async with Node(cfg):
        admin = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
        await admin.set_limit("acme", "api", 100)
        clients = [await AsyncClient.connect(cfg.server.socket, retry_timeout=0) for _ in range(8)]

        async def burst(c: AsyncClient) -> tuple[int, int]:
            ok = refused = 0
            for _ in range(30):
                try:
                    await c.track("acme", "api", 1)
                    ok += 1
                except LimitExceeded:
                    refused += 1
            return ok, refused

        got = await asyncio.gather(*(burst(c) for c in clients))
        assert sum(ok for ok, _ in got) == 100
        assert sum(r for _, r in got) == 8 * 30 - 100
        assert await admin.usage("acme", "api") == 100  # refused calls counted nothing
        st = await admin.status()
        assert st["limits"]["refused"] == 140
        # Other counters of the tenant, and other tenants, are not limited.
        assert await admin.track("acme", "other", 10**6) == 10**6
        assert await admin.track("beta", "api", 500) == 500
        # Units taken away are never refused, and make room again.
        assert await admin.track("acme", "api", -10) == 90
        assert await admin.track("acme", "api", 10) == 100
        for c in [admin, *clients]:
            await c.close()


async def test_pipelined_plain_tracks_are_checked_too(client: AsyncClient) -> None:
    """The server counts a pipelined run of plain warm tracks in one step (warm_tracks):
    a limited pair must leave that path."""
    await client.track("acme", "api", 1)  # warm, and its names validated today
    await client.set_limit("acme", "api", 10)
    answers = await client.pipeline([("track", ["acme", "api", 1])] * 20, return_exceptions=True)
    assert answers[:9] == list(range(2, 11))
    assert all(isinstance(a, LimitExceeded) for a in answers[9:])
    assert await client.usage("acme", "api") == 10


async def test_a_soft_limit_counts_past_it_and_reports_the_crossing(client: AsyncClient) -> None:
    await client.set_plan("free", {"api": {"limit": 10, "kind": "soft"}})
    await client.assign_plan("acme", "free")
    assert await client.track("acme", "api", 8) == 8
    got = await client.track_detail("acme", "api", 5)
    assert got == {
        "allowed": True,
        "value": 13,
        "limit": 10,
        "remaining": 0,
        "kind": "soft",
        "source": "plan:free",
        "over": True,
        "tenant": "acme",
    }
    assert await client.track("acme", "api", 5) == 18
    st = await client.status()
    assert st["limits"]["soft_crossings"] == 1  # crossed once, not on every call past it
    assert st["limits"]["refused"] == 0


async def test_check_answers_without_counting(client: AsyncClient) -> None:
    assert await client.check("acme", "api", 5) == {
        "allowed": True,
        "value": 0,
        "limit": None,
        "remaining": None,
        "kind": None,
        "source": None,
        "over": False,
        "tenant": "acme",
    }
    await client.set_limit("acme", "api", 10)
    await client.track("acme", "api", 7)
    ok = await client.check("acme", "api", 3)
    assert ok["allowed"] is True and ok["remaining"] == 3 and ok["value"] == 7
    assert ok["source"] == "override" and ok["kind"] == "hard" and ok["over"] is False
    no = await client.check("acme", "api", 4)
    assert no["allowed"] is False and no["over"] is True and no["value"] == 7
    assert await client.usage("acme", "api") == 7
    # A cold counter is read first.
    assert (await client.check("acme", "cold", 1))["value"] == 0
    # With detail, track answers the same map after counting.
    d = await client.track_detail("acme", "api", 1)
    assert d["value"] == 8 and d["remaining"] == 2 and d["allowed"] is True


async def test_track_many_refuses_only_the_items_over_a_hard_limit(client: AsyncClient) -> None:
    await client.set_limit("acme", "api", 5)
    await client.track("acme", "api", 3)
    got = await client.track_many(
        [("acme", "api", 2), ("acme", "api", 1), ("acme", "free", 9), ("beta", "api", 4)]
    )
    assert got[0] == 5 and isinstance(got[1], LimitExceeded)
    assert got[2:] == [9, 4]
    assert await client.usage("acme", "api") == 5
    # A batch of cold keys under a limit: seeded, then checked in order.
    await client.set_limit("gamma", "api", 3)
    got = await client.track_many([("gamma", "api", 2), ("gamma", "api", 2), ("gamma", "x", 1)])
    assert got[0] == 2 and isinstance(got[1], LimitExceeded) and got[2] == 1


async def test_holds_count_against_limits_and_the_tighter_limit_applies(
    client: AsyncClient,
) -> None:
    await client.set_limit("acme", "gpu", 100)
    rid = await client.reserve("acme", "gpu", 60)
    with pytest.raises(LimitExceeded):
        await client.track("acme", "gpu", 41)  # 60 held + 41 > 100
    assert await client.track("acme", "gpu", 40) == 100
    with pytest.raises(LimitExceeded):
        await client.reserve("acme", "gpu", 1)
    await client.release(rid)
    # The call's own limit and the tenant's: the tighter one.
    with pytest.raises(LimitExceeded):
        await client.reserve("acme", "gpu", 30, limit=60)  # own 60 is tighter than 100
    rid = await client.reserve("acme", "gpu", 20, limit=1000)  # 100 is tighter; 60 fits
    with pytest.raises(LimitExceeded, match="reservation still holds"):
        await client.commit(rid, 70)  # 40 + 70 > 100: refused, nothing changed
    assert await client.usage("acme", "gpu") == 60  # 40 counted + 20 held
    assert await client.commit(rid, 25) == 65  # 5 over the hold still fits
    rid = await client.reserve("acme", "gpu", 10)
    await client.set_limit("acme", "gpu", 50)  # lowered below the usage meanwhile
    assert await client.commit(rid, 10) == 75  # at most the hold: always accepted
    with pytest.raises(LimitExceeded):
        await client.reserve("acme", "gpu", 0)  # already past the new limit


async def test_a_soft_limit_does_not_refuse_reservations(client: AsyncClient) -> None:
    await client.set_limit("acme", "gpu", 10, kind="soft")
    rid = await client.reserve("acme", "gpu", 50)
    assert await client.commit(rid, 60) == 60
    with pytest.raises(LimitExceeded):
        await client.reserve("acme", "gpu", 1, limit=60)  # its own limit still applies


async def test_limits_survive_a_restart_and_assigning_a_missing_plan_is_not_found(
    tmp: Path,
) -> None:
    cfg = _config(tmp)
    async with Node(cfg):
        c = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
        await c.set_plan("pro", {"api": {"limit": 2}})
        await c.assign_plan("acme", "pro")
        with pytest.raises(NotFound):
            await c.assign_plan("acme", "enterprise")
        await c.close()
    async with Node(cfg):  # read from storage before the socket opens
        c = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
        assert (await c.limits("acme"))["plan"] == "pro"
        await c.track("acme", "api", 2)
        with pytest.raises(LimitExceeded):
            await c.track("acme", "api", 1)
        await c.close()


# -- the plans file ---------------------------------------------------------------------------

PLANS = """
[plans.pro]
api = 100
gpu = { limit = 60, kind = "soft" }

[plans.free]
api = 10
"""


async def test_a_plans_file_is_written_at_start_and_unchanged_plans_bump_nothing(
    tmp: Path,
) -> None:
    file = tmp / "plans.toml"
    file.write_text(PLANS)
    cfg = _config(tmp)
    cfg = replace(cfg, counters=replace(cfg.counters, plans_file=file))
    async with Node(cfg):
        c = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
        await c.assign_plan("acme", "pro")
        got = await c.limits("acme")
        assert got["version"] == 3  # two plans written, then the assignment
        assert got["limits"]["gpu"] == {
            "limit": 60, "kind": "soft", "enforcement": "fast", "source": "plan:pro"
        }  # fmt: skip
        await c.close()
    async with Node(cfg):  # the same file again: nothing to write
        c = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
        assert (await c.limits("acme"))["version"] == 3
        await c.close()
    file.write_text(PLANS.replace("api = 100", "api = 200"))
    async with Node(cfg):  # one plan changed: one write
        c = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
        got = await c.limits("acme")
        assert got["version"] == 4 and got["limits"]["api"]["limit"] == 200
        await c.close()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[plans.pro]\napi = -1\n", "plan 'pro': feature 'api': limit must be 0.."),
        ("[plans.pro]\napi = 'lots'\n", "must be a map"),
        ("[plans.pro]\napi = { limit = 5, kind = 'soft', enforcement = 'strict' }\n", "cannot be"),
        ('[plans."a b"]\napi = 1\n', "characters outside"),
        ("[other]\nx = 1\n", "unknown key 'other'"),
        ("plans = 5\n", "plans must be tables"),
        ("[plans\n", "cannot read"),
    ],
)
async def test_a_bad_plans_file_stops_the_node_naming_the_setting(
    tmp: Path, text: str, message: str
) -> None:
    file = tmp / "plans.toml"
    file.write_text(text)
    cfg = _config(tmp)
    cfg = replace(cfg, counters=replace(cfg.counters, plans_file=file))
    with pytest.raises(ConfigError, match="plans_file") as info:
        async with Node(cfg):
            pass
    assert message in str(info.value)


def test_a_missing_plans_file_is_a_configuration_error(tmp: Path) -> None:
    cfg = _config(tmp)
    cfg = replace(cfg, counters=replace(cfg.counters, plans_file=tmp / "none.toml"))

    async def start() -> None:
        async with Node(cfg):
            pass

    with pytest.raises(ConfigError, match="plans_file: cannot read"):
        asyncio.run(start())


async def test_with_storage_down_a_hard_limit_on_an_unknown_total_refuses_and_changes_fail(
    tmp: Path,
) -> None:
    store = DownStorage()
    cfg = _config(tmp)
    async with Node(cfg, storage=store):
        c = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
        await c.set_limit("acme", "api", 100)
        await c.set_limit("acme", "gpu", 100, kind="soft")
        store.down = True
        with pytest.raises(Unavailable, match="hard limit cannot be checked"):
            await c.track("acme", "api", 1)  # cold: its total cannot be read
        assert await c.track("acme", "gpu", 1) is None  # soft: counted, total not known
        assert isinstance((await c.track_many([("acme", "api", 1)]))[0], Unavailable)
        with pytest.raises(Unavailable, match="nothing changed"):
            await c.set_limit("acme", "api", 5)
        deadline = asyncio.get_running_loop().time() + 5
        while not (await c.status())["limits"]["last_error"]:  # the poll says why
            assert asyncio.get_running_loop().time() < deadline, "no last_error"
            await asyncio.sleep(0.05)
        store.down = False
        assert await c.usage("acme", "api") == 0  # nothing was counted
        assert (await c.limits("acme"))["limits"]["api"]["limit"] == 100  # not changed
        await c.close()


async def test_a_limit_set_while_a_cold_key_is_read_is_checked_after_the_read(
    tmp: Path,
) -> None:
    """A track (plain, with an id, or in a track_many) waiting for its cold counter's stored
    total when a limit is set is checked against that limit once the total is read."""
    store = SlowStorage()
    cfg = _config(tmp)
    async with Node(cfg, storage=store):
        c = await AsyncClient.connect(cfg.server.socket, retry_timeout=0, auto_ids=False)
        admin = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
        store.release.clear()
        store.reading.clear()
        waiting = [
            asyncio.create_task(c.track("acme", "api", 5)),
            asyncio.create_task(c.track("acme", "api", 5, id="r1")),
            asyncio.create_task(c.track_many([("acme", "api", 5), ("acme", "gpu", 5)])),
        ]
        await asyncio.wait_for(store.reading.wait(), 5)  # no limit yet: all are unchecked
        await asyncio.sleep(0)  # let the other calls reach the read too
        await admin.set_limit("acme", "api", 3)
        store.release.set()
        plain, with_id, many = await asyncio.gather(*waiting, return_exceptions=True)
        assert isinstance(plain, LimitExceeded), plain
        assert isinstance(with_id, LimitExceeded), with_id
        assert isinstance(many, list) and isinstance(many[0], LimitExceeded), many
        assert many[1] == 5  # no limit on gpu: counted
        assert await c.usage("acme", "api") == 0
        await c.close()
        await admin.close()


async def test_a_commit_above_its_reservation_reports_a_soft_crossing(
    client: AsyncClient,
) -> None:
    await client.set_limit("acme", "gpu", 10, kind="soft")
    rid = await client.reserve("acme", "gpu", 5)
    assert await client.commit(rid, 8) == 8  # 8 <= 10: no crossing
    rid = await client.reserve("acme", "gpu", 1)
    assert await client.commit(rid, 5) == 13  # the 4 extra units take it past 10
    rid = await client.reserve("acme", "gpu", 2)
    assert await client.commit(rid, 1) == 14  # less than reserved: nothing new crossed
    assert (await client.status())["limits"]["soft_crossings"] == 1


async def test_a_conflicting_id_in_a_limited_cold_batch_is_counted_as_refused(
    tmp: Path,
) -> None:
    """Two batches reusing one id for different items wait on the same cold counter: the
    second answers ``conflict`` for that item, and the node counts the refusal."""
    store = SlowStorage()
    cfg = _config(tmp)
    async with Node(cfg, storage=store) as node:
        c = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
        await c.set_limit("acme", "api", 100)
        assert node.service is not None
        store.release.clear()
        store.reading.clear()
        first = asyncio.create_task(c.track_many([("acme", "api", 1, "x")]))
        await asyncio.wait_for(store.reading.wait(), 5)
        second = asyncio.create_task(c.track_many([("acme", "api", 2, "x")]))
        waiting = node.service.seeder._waiting  # callers waiting per cold key
        deadline = asyncio.get_running_loop().time() + 5
        while sum(waiting.values()) < 2:  # the second batch waits on the same read
            assert asyncio.get_running_loop().time() < deadline, "second batch not waiting"
            await asyncio.sleep(0.01)
        store.release.set()
        assert await first == [1]
        (answer,) = await second
        assert isinstance(answer, Conflict), answer
        assert node.service.item_refusals.get("conflict") == 1
        await c.close()


def test_peer_holds_replace_what_was_known_of_a_peer() -> None:
    from meter.core.leases import Lease
    from meter.quotas.holds import PeerHolds, local_holds

    holds = PeerHolds()
    k1, k2 = ("acme", "gpu", "2026-11"), ("acme", "api", "2026-11")
    holds.replace("a", [(*k1, 60), (*k2, 5)])
    holds.replace("b", [(*k1, 10)])
    assert holds.total == {k1: 70, k2: 5}
    holds.replace("a", [(*k1, 20)])  # a whole snapshot: k2 is no longer held by a
    assert holds.total == {k1: 30}
    holds.replace("b", ())  # forgotten (dead or restarted)
    holds.replace("a", [(*k1, 0)])
    assert holds.total == {} and holds.peers() == 0
    leases = [Lease("r1", k1, 5, 0.0), Lease("r2", k1, 7, 0.0), Lease("r3", k2, 0, 0.0)]
    assert local_holds(leases) == ([(*k1, 12)], 0)


def test_a_holds_frame_is_bounded_in_bytes_and_fits_the_gossip_frame() -> None:
    """10,000 counters with the longest names: the most held that fit go, the rest are
    counted as left out, and the encoded frame is under the 1 MiB every peer accepts."""
    from cluster.codec import MAX_FRAME_BYTES, Codec, Header
    from meter.core.leases import Lease
    from meter.quotas.holds import MAX_HOLD_KEYS, local_holds

    tenant, feature = "t" * 500, "f" * 250
    leases = [
        Lease(f"r{i}", (f"{tenant}{i:05d}", feature, "2026-11"), i + 1, 0.0)
        for i in range(MAX_HOLD_KEYS)
    ]
    items, left_out = local_holds(leases)
    assert 0 < len(items) < MAX_HOLD_KEYS and left_out == MAX_HOLD_KEYS - len(items)
    assert items[0][3] == MAX_HOLD_KEYS  # the most held first
    header = Header("prod", "node-a", 1_700_000_000_000_000_000, 7, 1_760_000_000.25)
    assert len(Codec("prod").encode(header, "holds", items)) < MAX_FRAME_BYTES
    short = [Lease(f"r{i}", (f"t{i}", "api", "2026-11"), 1, 0.0) for i in range(100)]
    assert local_holds(short)[1] == 0


def test_a_peers_holds_not_refreshed_within_max_age_are_dropped() -> None:
    """Holders resend every heartbeat: holds heard longer ago (this node's bus down, or the
    holder's) stop counting instead of counting for the whole outage."""
    from meter.quotas.holds import PeerHolds

    now = [100.0]
    holds = PeerHolds(max_age=3.0, clock=lambda: now[0])
    k1 = ("acme", "gpu", "2026-11")
    holds.replace("a", [(*k1, 60)])
    holds.replace("b", [(*k1, 10)])
    now[0] += 2.0
    holds.replace("b", [(*k1, 10)])  # b refreshed, a not
    assert holds.expire() == [] and holds.total == {k1: 70}
    now[0] += 1.5  # a: 3.5 s old; b: 1.5 s
    assert holds.expire() == ["a"]
    assert holds.total == {k1: 10} and holds.peers() == 1
    now[0] += 10.0
    assert holds.expire() == ["b"] and holds.total == {} and holds.peers() == 0
    holds.replace("a", [(*k1, 5)])  # a frame after the outage counts again
    assert holds.total == {k1: 5} and holds.expire() == []


async def test_limits_are_read_within_a_poll_of_storage_answering_again() -> None:
    """A node that could not read its limits (started with storage down, or a ``limits``
    frame heard during a blip) reads them within a poll of storage answering again, bus up
    or not, and says it reads them again (``last_error`` cleared)."""
    from meter.quotas.store import LimitStore

    store = DownStorage()
    version = await store.write_limit(*override_record("acme", "api", parse_limit({"limit": 100})))
    store.down = True
    sync = LimitStore(store, lambda book: None, poll_s=0.05)
    task = asyncio.create_task(sync.run())
    loop = asyncio.get_running_loop()

    def error() -> str | None:  # a call: mypy would narrow the attribute across awaits
        return sync.last_error

    try:
        deadline = loop.time() + 5
        while error() is None:  # never loaded: the node enforces nothing yet
            assert loop.time() < deadline, "the loop never tried storage"
            await asyncio.sleep(0.01)
        store.down = False
        back = loop.time()
        while sync.book.version != version:
            assert loop.time() - back < 1.0, "not read within a second of storage answering"
            await asyncio.sleep(0.01)
        # A frame heard while storage blips: retried every poll, and the error clears on
        # the first read that answers.
        store.down = True
        sync.invalidate(-1)
        while error() is None:
            assert loop.time() - back < 5, "the frame was not acted on"
            await asyncio.sleep(0.01)
        version = await MemoryStorage.write_limit(
            store, *override_record("acme", "api", parse_limit({"limit": 5}))
        )
        store.down = False
        back = loop.time()
        while sync.book.version != version or error() is not None:
            assert loop.time() - back < 1.0, "stale after the blip"
            await asyncio.sleep(0.01)
        # A blip with no change: the read that answers finds the version unchanged and
        # clears the error all the same.
        store.down = True
        sync.invalidate(-1)  # a reconnect: re-read
        while error() is None:
            assert loop.time() - back < 10, "the re-read was not tried"
            await asyncio.sleep(0.01)
        store.down = False
        back = loop.time()
        while error() is not None:
            assert loop.time() - back < 1.0, "last_error kept after storage came back"
            await asyncio.sleep(0.01)
        assert sync.book.version == version
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
