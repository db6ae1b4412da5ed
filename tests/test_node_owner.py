"""One process per node id (ADR 0004): a second process started with an id another one holds
(another data dir: an explicit ``METER_NODE_ID`` on two hosts) refuses to count or flush, on
every backend; a restart on the same data dir takes its id back at once; a crashed holder's id
is free once its lease ends; a holder that finds another owner stops."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from meter.client import AsyncClient
from meter.config import ClusterConfig, FlushConfig, NodeConfig, OwnerConfig, ServerConfig
from meter.core.keys import period_start
from meter.errors import Unavailable
from meter.node.lifecycle import Node
from storage.base import Delta, Key, Snapshot, Storage
from storage.memory import MemoryStorage
from storage.sqlite import SQLiteStorage
from tests.support.dynamodb_local import TEST_JAVA_OPTIONS, DynamoDBLocal
from tests.support.fixtures_dynamodb import create_table
from tests.support.nodes import NodeProcess, raw_call, short_tmpdir
from tests.support.redis_server import RedisServer

KEY = ("acme", "api", period_start("month"))


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = short_tmpdir("mo-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def nodes() -> Iterator[list[NodeProcess]]:
    started: list[NodeProcess] = []
    yield started
    for p in started:
        if p.proc is not None and p.proc.poll() is None:
            p.kill()


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting until {what}")
        time.sleep(0.02)


async def until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting until {what}")
        await asyncio.sleep(0.01)


def owner_state(node: NodeProcess) -> str:
    """``owned`` only once the node also counts again (re-read since its claim)."""
    owner = node.call("status")["owner"]
    state: str = owner["state"]
    return state if state != "owned" or owner["counting"] else "claimed"


def storage_for(backend: str, workdir: Path, request: pytest.FixtureRequest) -> dict[str, str]:
    """The environment of a node on ``backend`` that every node of the test shares."""
    if backend == "sqlite":
        # Two data dirs, one database: the file is named by an absolute path.
        return {"METER_STORAGE": "sqlite", "METER_SQLITE_FILE": str(workdir / "shared.sqlite3")}
    endpoint: str = request.getfixturevalue("dynamodb_local")
    table: str = request.getfixturevalue("dynamodb_table")
    return {
        "METER_STORAGE": "dynamodb",
        "METER_DYNAMODB_ENDPOINT": endpoint,
        "METER_DYNAMODB_TABLE": table,
    }


async def stored_total(backend: str, env: dict[str, str]) -> int:
    store: Storage
    if backend == "sqlite":
        store = SQLiteStorage(env["METER_SQLITE_FILE"])
    else:
        from storage.dynamodb import DynamoDBStorage

        store = DynamoDBStorage(
            env["METER_DYNAMODB_TABLE"], endpoint_url=env["METER_DYNAMODB_ENDPOINT"]
        )
    await store.open()
    try:
        return (await store.load([KEY]))[KEY].total
    finally:
        await store.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("dynamodb", marks=pytest.mark.dynamodb)]
)
def test_a_second_process_with_the_same_node_id_refuses_to_count_and_flush(
    backend: str,
    workdir: Path,
    nodes: list[NodeProcess],
    request: pytest.FixtureRequest,
) -> None:
    """Without owners both processes flush under one id: the store takes the second one's
    sequences for retries of the first one's and drops their units (K07)."""
    env = {
        **storage_for(backend, workdir, request),
        "METER_NODE_ID": "same",
        "METER_FLUSH_INTERVAL_MS": "50",
        "METER_OWNER_LEASE_S": "3",
    }
    a = NodeProcess(workdir, "a", **env).start()
    nodes.append(a)
    b = NodeProcess(workdir, "b", **env).start()
    nodes.append(b)
    acked = refused = 0
    deadline = time.monotonic() + 1.5  # many flush rounds of both
    while time.monotonic() < deadline:
        for node in (a, b):
            error, _ = raw_call(node.socket, "track", *KEY[:2], 1)
            if error is None:
                acked += 1
            else:
                assert error["code"] == "unavailable", error
                refused += 1
    assert refused > 0, "the second process counted"
    assert owner_state(a) == "owned"
    st = b.call("status")["owner"]
    assert st["state"] == "waiting" and st["holder_lease_left_s"] > 0, st
    assert "owned by another process" in b.log()
    assert b.call("usage", *KEY[:2]) >= 0  # reads still work
    # The holder stops cleanly: it flushes, releases its id, and the other takes it over.
    assert a.stop() == 0
    wait_until(lambda: owner_state(b) == "owned", "the second process owns the id")
    assert b.call("track", *KEY[:2], 1) == acked + 1
    acked += 1
    assert b.stop() == 0
    assert asyncio.run(stored_total(backend, env)) == acked


@pytest.mark.slow
def test_a_restart_on_the_same_data_dir_takes_its_id_back_at_once(
    workdir: Path, nodes: list[NodeProcess]
) -> None:
    env = {"METER_NODE_ID": "same", "METER_OWNER_LEASE_S": "600"}
    a = NodeProcess(workdir, "a", **env).start()
    nodes.append(a)
    assert a.call("track", *KEY[:2], 4) == 4
    a.kill()  # the lease is not released: it runs for another ten minutes
    again = NodeProcess(workdir, "a", **env).start()  # same name: same data dir
    nodes.append(again)
    assert owner_state(again) == "owned"
    assert again.call("track", *KEY[:2], 1) == 5
    assert again.stop() == 0


@pytest.mark.slow
def test_a_crashed_holders_id_is_taken_over_from_another_data_dir_once_its_lease_ends(
    workdir: Path, nodes: list[NodeProcess]
) -> None:
    env = {
        "METER_NODE_ID": "same",
        "METER_SQLITE_FILE": str(workdir / "shared.sqlite3"),
        "METER_FLUSH_INTERVAL_MS": "50",
        "METER_OWNER_LEASE_S": "2",
    }
    a = NodeProcess(workdir, "a", **env).start()
    nodes.append(a)
    assert a.call("track", *KEY[:2], 4) == 4
    wait_until(lambda: a.call("status")["flush"]["backlog_units"] == 0, "a flushed")
    a.kill()
    b = NodeProcess(workdir, "b", **env).start()
    nodes.append(b)
    t0 = time.monotonic()
    wait_until(lambda: owner_state(b) == "owned", "b owns the id after a's lease", timeout=10)
    assert b.call("track", *KEY[:2], 1) == 5
    assert b.stop() == 0
    print(f"took over after {time.monotonic() - t0:.2f} s")


@pytest.mark.slow
@pytest.mark.dynamodb
def test_a_node_started_while_storage_is_down_counts_and_claims_its_id_when_it_returns(
    workdir: Path, nodes: list[NodeProcess], dynamodb_local_home: Path
) -> None:
    """Storage cannot be asked at start: the node counts (C10) without flushing, claims its id
    once storage answers, re-reads and writes."""
    server = DynamoDBLocal(
        dynamodb_local_home, db_path=workdir / "ddb", java_options=TEST_JAVA_OPTIONS
    )
    server.start()
    try:
        table = asyncio.run(create_table(server.endpoint))
        server.stop()
        env = {
            "METER_STORAGE": "dynamodb",
            "METER_DYNAMODB_ENDPOINT": server.endpoint,
            "METER_DYNAMODB_TABLE": table,
            "METER_FLUSH_INTERVAL_MS": "100",
            "METER_FLUSH_MAX_BACKOFF_MS": "500",
            "METER_DYNAMODB_CONNECT_TIMEOUT_S": "0.5",
        }
        node = NodeProcess(workdir, "a", **env).start()
        nodes.append(node)
        assert node.call("track", *KEY[:2], 7) is None  # counted; the total is not known
        assert owner_state(node) == "unknown"
        server.start()
        wait_until(lambda: owner_state(node) == "owned", "the node claims its id")
        wait_until(lambda: node.call("status")["flush"]["backlog_units"] == 0, "stored")
        assert node.call("usage", *KEY[:2]) == 7
        assert node.stop() == 0, node.log()
        assert asyncio.run(stored_total("dynamodb", env)) == 7
    finally:
        server.__exit__()


def config(tmp: Path, name: str, node_id: str, **cluster: Any) -> NodeConfig:
    return NodeConfig(
        data_dir=tmp / name,
        node_id=node_id,
        server=ServerConfig(socket=tmp / f"{name}.sock"),
        flush=FlushConfig(interval_ms=3_600_000),  # rounds are driven by the test
        cluster=ClusterConfig(**cluster),
        owner=OwnerConfig(lease_s=30),
    )


@pytest.fixture
def tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:  # short path: Unix socket paths are limited
        yield Path(d)


async def test_two_in_process_nodes_with_one_id_on_one_memory_store(tmp: Path) -> None:
    store = MemoryStorage()
    async with (
        Node(config(tmp, "a", "same"), storage=store) as a,
        Node(config(tmp, "b", "same"), storage=store) as b,
    ):
        assert a.owner is not None and b.owner is not None and a.flusher is not None
        ca = await AsyncClient.connect(str(tmp / "a.sock"), retry_timeout=0)
        cb = await AsyncClient.connect(str(tmp / "b.sock"), retry_timeout=0)
        try:
            assert await ca.track(*KEY[:2], 3) == 3
            with pytest.raises(Unavailable, match="owned by another process"):
                await cb.track(*KEY[:2], 5)
            with pytest.raises(Unavailable):
                await cb.track_many([(KEY[0], KEY[1], 5)])
            with pytest.raises(Unavailable):
                await cb.reserve(*KEY[:2], 5)
            assert (await cb.status())["owner"]["state"] == "waiting"
            assert await a.flusher.flush_once()
            assert store.items[KEY].total == 3
            # Another process takes the id over (a copy of a's data dir, or a forced claim):
            # a notices before its next write, stops flushing and refuses to count.
            await store.claim_owner(
                "same", "intruder", lease_s=60, now=time.time(), accept=[a.owner.token]
            )
            assert await ca.track(*KEY[:2], 2) == 5  # counted before the next flush round
            assert not await a.flusher.flush_once()
            assert a.owner.state == "lost"
            assert store.items[KEY].total == 3, "nothing written after the id was taken"
            with pytest.raises(Unavailable, match="owned by another process"):
                await ca.track(*KEY[:2], 1)
            st = (await ca.status())["owner"]
            assert st["state"] == "lost" and st["last_error"], st
            assert (await ca.status())["flush"]["backlog_units"] == 2  # kept, not stored
        finally:
            await ca.close()
            await cb.close()
    # Neither could drain (a lost its id with units left, b never had it): they say so at once
    # instead of waiting out the drain timeout.
    assert a.drained is False and b.drained is True


@pytest.mark.redis
async def test_a_process_without_its_id_says_nothing_on_the_bus(
    tmp: Path, redis_server: RedisServer, cluster_name: str
) -> None:
    """A second process with a held id must not gossip: peers would take its messages for a
    restart of the holder and refuse the holder's as an older incarnation."""
    store = MemoryStorage()
    bus = {"redis_url": redis_server.url, "cluster_name": cluster_name, "heartbeat_ms": 50}
    async with (
        Node(config(tmp, "x1", "x", **bus), storage=store) as x1,
        Node(config(tmp, "y", "y", **bus), storage=store) as y,
    ):
        assert y.gossip is not None and x1.gossip is not None
        yg = y.gossip
        await until(lambda: "x" in yg.peers.live(), "y hears x")
        async with Node(config(tmp, "x2", "x", **bus), storage=store) as x2:
            assert x2.owner is not None and x2.owner.state == "waiting"
            heard = yg.status()["received"]["messages"]
            await until(lambda: yg.status()["received"]["messages"] > heard + 10, "more heartbeats")
            st = yg.status()
            assert st["peers"]["x"]["restarts"] == 0 and st["rejected"]["stale"] == 0, st
            assert x1.gossip.status()["rejected"]["own_id"] == 0
            cy = await AsyncClient.connect(str(tmp / "y.sock"), retry_timeout=0)
            cx = await AsyncClient.connect(str(tmp / "x1.sock"), retry_timeout=0)
            try:
                assert await cy.usage(*KEY[:2]) == 0  # warm at y
                await cx.track(*KEY[:2], 7)
            finally:
                await cx.close()
                await cy.close()
            await until(lambda: y.table is not None and y.table.value(KEY) == 7, "y sees x's 7")


class HeldReads(MemoryStorage):
    """A memory store whose seeding reads take their snapshot when issued and, while
    ``hold`` is set, answer only once ``release`` is set (a slow answer on its way)."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = True
        self.release = asyncio.Event()
        self.held = 0

    async def load(self, keys: Sequence[Key]) -> dict[Key, Snapshot]:
        snaps = await super().load(keys)
        if self.hold:
            self.held += 1
            await self.release.wait()
        return snaps


async def test_a_read_issued_before_a_claim_never_seeds_after_it(tmp: Path) -> None:
    """A seeding read issued while another process held the id, answered only after this
    node claimed it and re-read its warm keys, is refused and read again: seeded from it,
    the row would hold the holder's older sequence and the next flush would reuse one the
    store has, which drops its units as a duplicate (C06, K07)."""
    store = HeldReads()
    await store.claim_owner("same", "holder", lease_s=60, now=time.time())
    await store.apply("same", [Delta(KEY, 2, 10)])  # the holder stored under the id
    async with Node(config(tmp, "b", "same"), storage=store) as b:
        assert b.owner is not None and b.service is not None and b.flusher is not None
        assert b.owner.state == "waiting"
        cb = await AsyncClient.connect(str(tmp / "b.sock"), retry_timeout=0)
        try:
            st = await cb.status()  # not counting: not ready (meter status --check fails)
            assert st["ready"] is False, st["not_ready"]
            assert [r for r in st["not_ready"] if r.startswith("owner: not counting")]
            usage = asyncio.create_task(cb.usage(*KEY[:2]))  # fenced, reads still served
            await until(lambda: store.held == 1, "the seeding read is out")
            store.hold = False  # reads issued from now on answer at once
            # The holder stores 5 more units under the id, then stops (its lease released).
            await store.apply("same", [Delta(KEY, 3, 5)])
            # Its lease ends a second ago (ends are whole ms, rounded: "now" could be in the
            # future by half a millisecond, and the claim below refused as still held).
            await store.renew_owner("same", "holder", lease_s=0, now=time.time() - 1)
            await b.owner.step()  # b claims the id and re-reads its warm keys
            assert b.owner.owned
            service = b.service
            await until(lambda: service.fenced is None, "b counts again")
            store.release.set()  # the answer read before the claim lands
            assert await usage == 15
            assert await cb.track(*KEY[:2], 7) == 22
            assert await b.flusher.flush_once()
            assert b.flusher.stats.duplicates == 0
            assert store.items[KEY].total == 22, store.items[KEY]
        finally:
            await cb.close()
