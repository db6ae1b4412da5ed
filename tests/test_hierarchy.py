"""The account -> user hierarchy (``tenant_hierarchy``, ADR 0008): a unit tracked on
``acme/alice`` counts on ``acme/alice`` and on ``acme``, checked against every level's limit
at once. Real nodes on SQLite, through their sockets."""

from __future__ import annotations

import asyncio
import signal
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from meter.client import AsyncClient
from meter.config import CounterConfig, FlushConfig, NodeConfig, ServerConfig
from meter.errors import InvalidArgument, LimitExceeded
from meter.node.lifecycle import Node
from tests.support.nodes import NodeProcess, short_tmpdir

USERS = ["acme/alice", "acme/bob", "acme/carol"]


@pytest.fixture
def tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        yield Path(d)


def _config(tmp: Path, hierarchy: bool = True) -> NodeConfig:
    return NodeConfig(
        data_dir=tmp / "data",
        node_id="n1",
        server=ServerConfig(socket=tmp / "m.sock"),
        flush=FlushConfig(interval_ms=200),
        counters=CounterConfig(tenant_hierarchy=hierarchy),
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


async def _plans(c: AsyncClient) -> None:
    await c.set_plan("account", {"api": {"limit": 100}})
    await c.set_plan("user", {"api": {"limit": 60}})
    await c.assign_plan("acme", "account")
    for user in USERS:
        await c.assign_plan(user, "user")


async def test_an_account_of_100_with_users_at_60_admits_exactly_100_and_60_per_user(
    tmp: Path,
) -> None:
    cfg = _config(tmp)
    async with Node(cfg):
        admin = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
        await _plans(admin)
        clients = [await AsyncClient.connect(cfg.server.socket, retry_timeout=0) for _ in range(6)]

        async def burst(c: AsyncClient, user: str) -> int:
            ok = 0
            for i in range(40):
                try:
                    await c.track(user, "api", 1 + i % 2)
                    ok += 1 + i % 2
                except LimitExceeded:
                    pass
            return ok

        got = await asyncio.gather(*(burst(c, USERS[i % 3]) for i, c in enumerate(clients)))
        per_user = {u: await admin.usage(u, "api") for u in USERS}
        account = await admin.usage("acme", "api")
        # Refused calls counted nowhere: the account is exactly the sum of its users, which
        # is exactly what was acknowledged.
        assert account == sum(per_user.values()) == sum(got)
        assert account <= 100 and all(v <= 60 for v in per_user.values()), per_user
        assert account >= 99  # 240 tries of 1 or 2 units: the account is (nearly) full
        for c in [admin, *clients]:
            await c.close()


async def test_a_refusal_at_any_level_counts_at_none(client: AsyncClient) -> None:
    await _plans(client)
    assert await client.track("acme/alice", "api", 60) == 60
    with pytest.raises(LimitExceeded, match="acme/alice"):
        await client.track("acme/alice", "api", 1)  # the user's limit
    assert await client.track("acme/bob", "api", 30) == 30
    with pytest.raises(LimitExceeded, match="acme/api"):
        await client.track("acme/carol", "api", 11)  # the account's: 90 + 11 > 100
    assert [await client.usage(t, "api") for t in ["acme", *USERS]] == [90, 60, 30, 0]
    # Units taken away leave every level too, and make room again.
    assert await client.track("acme/alice", "api", -20) == 40
    assert await client.usage("acme", "api") == 70
    d = await client.track_detail("acme/carol", "api", 30)
    assert d["value"] == 30 and d["source"] == "plan:user" and d["remaining"] == 30
    assert await client.usage("acme", "api") == 100
    # check looks at every level: the first that would refuse answers.
    no = await client.check("acme/carol", "api", 1)
    assert no["allowed"] is False and no["tenant"] == "acme" and no["source"] == "plan:account"
    assert (await client.check("acme/carol", "api", 0))["tenant"] == "acme/carol"
    assert (await client.check("beta/new", "api", 5))["allowed"] is True  # cold levels read
    # A unit tracked on the account itself counts there only.
    with pytest.raises(LimitExceeded):
        await client.track("acme", "api", 1)
    # Without limits the levels still add up.
    await client.track("acme/alice", "storage", 5)
    await client.track("acme/bob", "storage", 7)
    assert await client.usage("acme", "storage") == 12
    assert (await client.usage_all("acme"))["storage"] == 12


async def test_track_many_items_count_on_every_level_or_fail_alone(client: AsyncClient) -> None:
    await _plans(client)
    got = await client.track_many(
        [("acme/alice", "api", 50), ("acme/alice", "api", 20), ("acme/bob", "api", 45),
         ("acme/carol", "api", 10), ("acme/bob", "x", 3), ("other/one", "api", 1)]
    )  # fmt: skip
    assert got[0] == 50 and isinstance(got[1], LimitExceeded)  # alice's 60
    assert got[2] == 45 and isinstance(got[3], LimitExceeded)  # the account's 100
    assert got[4:] == [3, 1]
    assert await client.usage("acme", "api") == 95
    assert await client.usage("acme", "x") == 3
    assert await client.usage("other", "api") == 1


async def test_pipelined_plain_tracks_on_a_user_count_on_the_account(client: AsyncClient) -> None:
    await client.track("acme/alice", "api", 1)  # names validated, key warm
    answers = await client.pipeline([("track", ["acme/alice", "api", 1])] * 10)
    assert answers == list(range(2, 12))
    assert await client.usage("acme", "api") == 11


@pytest.mark.parametrize(
    ("tenant", "message"),
    [("a/b/c/d/e", "at most 4"), ("acme//x", "empty level"), ("acme/", "empty level"),
     ("/acme", "empty level")],
)  # fmt: skip
async def test_bad_levels_are_refused(client: AsyncClient, tenant: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        await client.track(tenant, "api", 1)
    got = await client.track_many([(tenant, "api", 1), ("ok/one", "api", 1)])
    assert isinstance(got[0], InvalidArgument) and got[1] == 1
    assert await client.track("a/b/c/d", "api", 2) == 2  # four levels are fine
    assert [await client.usage(t, "api") for t in ["a", "a/b", "a/b/c"]] == [2, 2, 2]


async def test_reserve_below_an_account_is_refused_clearly(client: AsyncClient) -> None:
    with pytest.raises(InvalidArgument, match="not supported with tenant_hierarchy yet"):
        await client.reserve("acme/alice", "gpu", 1)
    assert await client.reserve("acme", "gpu", 1)  # on the account itself: fine


async def test_without_the_setting_a_user_is_a_tenant_of_its_own(tmp: Path) -> None:
    cfg = _config(tmp, hierarchy=False)
    async with Node(cfg):
        c = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
        await c.track("acme/alice", "api", 5)
        assert await c.usage("acme", "api") == 0
        await c.close()


async def test_cold_levels_are_read_before_the_check_after_a_restart(tmp: Path) -> None:
    cfg = _config(tmp)
    async with Node(cfg):
        c = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
        await _plans(c)
        await c.track("acme/alice", "api", 55)
        await c.track("acme/bob", "api", 40)
        await c.close()
    async with Node(cfg) as node:  # drained and flushed; a fresh table
        assert node.table is not None
        node.table.evict_idle()
        node.table.evict_idle()
        c = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
        with pytest.raises(LimitExceeded, match="acme/api"):
            await c.track("acme/carol", "api", 6)  # the account's stored 95 is read first
        assert await c.track("acme/carol", "api", 5) == 5
        assert await c.usage("acme", "api") == 100
        await c.close()


def test_kill_9_keeps_every_level_of_an_acknowledged_track() -> None:
    """The levels of one track are one record in the write-ahead log."""
    workdir = short_tmpdir("mh-")
    env = {"METER_TENANT_HIERARCHY": "true", "METER_FLUSH_INTERVAL_MS": "3600000"}
    node = NodeProcess(workdir, "h", **env).start()
    try:
        for i in range(20):
            node.call("track", "acme/alice", "api", 1, {"id": f"t-{i}"})
        node.call("track_many", [["acme/bob", "api", 2], ["acme/bob/x", "api", 3]])
        assert node.stop(signal.SIGKILL) == -signal.SIGKILL
        node.start()
        got: dict[str, Any] = {t: node.call("usage", t, "api") for t in
                               ["acme", "acme/alice", "acme/bob", "acme/bob/x"]}  # fmt: skip
        assert got == {"acme": 25, "acme/alice": 20, "acme/bob": 5, "acme/bob/x": 3}
        # A retried id counts on no level.
        assert node.call("track", "acme/alice", "api", 1, {"id": "t-3"}) == 4
        assert node.call("usage", "acme", "api") == 25
    finally:
        node.stop()


def test_the_setting_takes_true_or_false_and_refuses_anything_else() -> None:
    from meter.config import load
    from meter.errors import ConfigError

    assert load(env={"METER_TENANT_HIERARCHY": "true"}).counters.tenant_hierarchy is True
    assert load(env={"METER_TENANT_HIERARCHY": "0"}).counters.tenant_hierarchy is False
    assert load(env={}).counters.tenant_hierarchy is False
    with pytest.raises(ConfigError, match="tenant_hierarchy: must be true or false"):
        load(env={"METER_TENANT_HIERARCHY": "maybe"})
    with pytest.raises(ConfigError, match="limits_poll_ms"):
        load(env={"METER_LIMITS_POLL_MS": "10"})
