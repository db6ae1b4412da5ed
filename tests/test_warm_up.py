"""Warm-up after a restart, on real node processes: the keys a node was using are read back
ahead of need after ``kill -9`` and after SIGTERM (on SQLite and on DynamoDB Local), so the
first calls on them read nothing; keys of an ended period are not read; a request arriving
during the warm-up is read before the rest of it."""

from __future__ import annotations

import asyncio
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from meter.client import Client
from meter.core.keys import period_start
from tests.support.dynamodb_proxy import DynamoDBProxy
from tests.support.fixtures_dynamodb import create_table
from tests.support.nodes import NodeProcess, raw_call, short_tmpdir, wait_for

pytestmark = pytest.mark.slow

#: Keys tracked before the restart.
K = 500
#: Flushes every 50 ms; no roll-over read-ahead (ADR 0005), whose reads near a month's end
#: would mix with the warm-up's in the counts these tests check.
BASE = {"METER_FLUSH_INTERVAL_MS": "50", "METER_ROLLOVER_READ_AHEAD_S": "0"}


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = short_tmpdir("warm-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def features(n: int) -> list[str]:
    return [f"k{i:05d}" for i in range(n)]


def track_all(node: NodeProcess, names: list[str], tenant: str = "acme") -> None:
    """Track ``names[i]`` by ``i + 1``, then wait until every unit is stored."""
    with Client.connect(node.socket, timeout=30) as client:
        for start in range(0, len(names), 1000):
            items = [(tenant, f, i + 1) for i, f in enumerate(names) if start <= i < start + 1000]
            client.track_many(items)
    wait_for(lambda: flushed(node), timeout=60, what="every key to be flushed")


def flushed(node: NodeProcess) -> bool:
    st = node.call("status")
    return bool(st["flush"]["backlog_keys"] == 0 and st["keys"]["dirty"] == 0)


def restart(node: NodeProcess, how: str, **env: str) -> NodeProcess:
    """Stop ``node`` by ``kill -9`` or SIGTERM and start it again on its data dir."""
    if how == "kill":
        assert node.kill() == -9
    else:
        assert node.stop(signal.SIGTERM) == 0, node.log()[-3000:]
    again = NodeProcess(node.workdir, node.name, **{**node.env, **env})
    again.clock_shift = node.clock_shift
    return again.start()


def warmed(node: NodeProcess, n: int) -> dict[str, Any] | None:
    """``status`` once ``n`` keys were read ahead and are in memory."""
    st: dict[str, Any] = node.call("status")
    if st["seeding"]["prefetched"] >= n and st["keys"]["warm"] >= n:
        return st
    return None


def check_served_from_memory(node: NodeProcess, names: list[str], tenant: str = "acme") -> None:
    """``usage`` and ``track`` on every key answer exactly, without one storage read."""
    with Client.connect(node.socket, timeout=30) as client:
        got = client.pipeline(("usage", [tenant, f]) for f in names)
        assert got == [i + 1 for i in range(len(names))]
        got = client.pipeline(("track", [tenant, f, 1]) for f in names)
        assert got == [i + 2 for i in range(len(names))]
        seeding = client.status()["seeding"]
    assert seeding["on_demand"] == 0, f"requests had to read storage: {seeding}"


def warm_up_line(node: NodeProcess) -> str:
    lines = [ln for ln in node.log().splitlines() if "warm-up done" in ln]
    return lines[-1] if lines else ""


def dynamo_env(endpoint: str, table: str) -> dict[str, str]:
    return {
        "METER_STORAGE": "dynamodb",
        "METER_DYNAMODB_ENDPOINT": endpoint,
        "METER_DYNAMODB_TABLE": table,
    }


def storage_env(request: pytest.FixtureRequest, storage: str) -> dict[str, str]:
    if storage == "sqlite":
        return {}
    endpoint = request.getfixturevalue("dynamodb_local")
    return dynamo_env(endpoint, asyncio.run(create_table(endpoint)))


@pytest.mark.parametrize("how", ["kill", "term"])
@pytest.mark.parametrize(
    "storage", ["sqlite", pytest.param("dynamodb", marks=pytest.mark.dynamodb)]
)
def test_a_restart_reads_the_keys_it_was_using_ahead_of_the_first_calls(
    workdir: Path, request: pytest.FixtureRequest, storage: str, how: str
) -> None:
    names = features(K)
    node = NodeProcess(workdir, **storage_env(request, storage), **BASE).start()
    try:
        track_all(node, names)
        node = restart(node, how)
        st = wait_for(lambda: warmed(node, K), timeout=60, what=f"{K} keys read ahead")
        assert st["seeding"]["on_demand"] == 0
        check_served_from_memory(node, names)
        line = wait_for(lambda: warm_up_line(node), what="the warm-up's log line")
        assert f"{K} of {K} recently active keys warm" in line, line
    finally:
        node.stop()


def test_kill_9_after_the_log_rotated_reads_keys_used_only_before_the_rotation(
    workdir: Path,
) -> None:
    # Small segments: the log rotates a few calls after the keys were flushed, and the
    # records that named them are deleted; only the checkpoints' list of warm keys is left.
    env = {"METER_WAL_SEGMENT_BYTES": str(64 << 10), **BASE}
    names = features(K)
    node = NodeProcess(workdir, **env).start()
    try:
        track_all(node, names)
        before = node.call("status")["durability"]["wal"]["checkpoints"]

        def rotated_twice() -> bool:
            node.call("track_many", [["other", "filler", 1]] * 500)
            st = node.call("status")["durability"]["wal"]
            # Two: the newest complete checkpoint was begun after the keys' last records.
            return bool(st["checkpoints"] >= before + 2)

        wait_for(rotated_twice, timeout=60, what="the log to rotate twice")
        node = restart(node, "kill")
        st = wait_for(lambda: warmed(node, K), timeout=60, what=f"{K} keys read ahead")
        assert st["seeding"]["on_demand"] == 0
        check_served_from_memory(node, names)
    finally:
        node.stop()


def test_keys_of_an_ended_period_are_not_read_ahead(workdir: Path) -> None:
    day, month = [f"d{i}" for i in range(50)], [f"m{i}" for i in range(50)]
    env = {"METER_FEATURE_PERIODS": ",".join(f"{f}=day" for f in day), **BASE}
    # Restarted a day later (clocks moved), within one month: the day counters are over, the
    # month counters go on.
    now = time.time()
    if period_start("month", now) == period_start("month", now + 86400):
        before, after = 0.0, 86400.0
    else:  # today is a month's last day: the node that tracks runs a day behind
        before, after = -86400.0, 0.0
    node = NodeProcess(workdir, **env)
    node.clock_shift = before
    node.start()
    try:
        track_all(node, day + month)  # month[j] holds 51 + j
        assert node.stop() == 0
        node = NodeProcess(workdir, **env)
        node.clock_shift = after
        node.start()
        line = wait_for(lambda: warm_up_line(node), what="the warm-up's log line")
        assert "50 of 50 recently active keys warm" in line, line
        assert "50 keys of ended periods skipped" in line, line
        st = node.call("status")
        assert st["seeding"]["prefetched"] == 50 and st["keys"]["warm"] == 50, st
        with Client.connect(node.socket, timeout=30) as client:
            assert client.pipeline(("usage", ["acme", f]) for f in month) == list(range(51, 101))
            assert client.status()["seeding"]["on_demand"] == 0
    finally:
        node.stop()


async def until(cond: Callable[[], Any], what: str, timeout: float = 30) -> Any:
    """:func:`wait_for` for a test whose event loop serves a proxy: ``cond`` runs in a thread
    (it may call the node), the loop sleeps between tries."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (got := await asyncio.to_thread(cond)):
        assert loop.time() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(0.01)
    return got


@pytest.mark.dynamodb
async def test_a_request_during_the_warm_up_is_read_before_the_rest_of_it(
    workdir: Path, dynamodb_local: str, dynamodb_table: str
) -> None:
    n = 3000  # 30 reads of 100 keys, 8 at a time: four waves
    names = features(n)
    last = names[-1]  # the key the warm-up reads last: the last one the node loaded

    def first_life() -> None:
        node = NodeProcess(workdir, **dynamo_env(dynamodb_local, dynamodb_table), **BASE)
        node.start()
        try:
            with Client.connect(node.socket, timeout=30) as client:
                # Read, not written: warm keys need no stored item (and DynamoDB Local is
                # slow to write thousands).
                got = client.pipeline(("usage", ["acme", f]) for f in names[:-1])
                assert got == [0] * (n - 1)
                assert client.track("acme", last, 7) == 7
            wait_for(lambda: flushed(node), what="the tracked key to be flushed")
            assert node.stop() == 0
        finally:
            node.stop()

    await asyncio.to_thread(first_life)
    async with DynamoDBProxy(int(dynamodb_local.rsplit(":", 1)[1])) as proxy:
        proxy.hold()
        # Held reads must not time out and be sent again.
        env = {**dynamo_env(proxy.endpoint, dynamodb_table), **BASE}
        node = NodeProcess(workdir, **env, METER_DYNAMODB_READ_TIMEOUT_S="300")
        await asyncio.to_thread(node.start)
        try:
            # The warm-up's first wave of reads is out, its answers held: no read is free.
            await until(lambda: proxy.held == 8, "eight reads ahead held")
            assert (await asyncio.to_thread(node.call, "status"))["seeding"]["in_flight"] == 800
            asking = asyncio.ensure_future(
                asyncio.to_thread(raw_call, node.socket, "usage", "acme", last, timeout=60)
            )
            await until(
                lambda: node.call("status")["server"]["in_flight"] == 1,
                "the usage call to wait for its key",
            )
            # The first wave lands; the second takes the request's key first ...
            proxy.release_held()
            await until(lambda: proxy.released == 8 and proxy.held == 8, "the second wave held")
            # ... so its answer needs no more than that wave.
            proxy.release_held()
            done, _ = await asyncio.wait({asking}, timeout=30)
            assert done, "the request's key was not read in the second wave: it waits behind"
            assert asking.result() == (None, 7)
            st = (await asyncio.to_thread(node.call, "status"))["seeding"]
            assert st["on_demand"] == 1, st  # read for the request, not ahead
            # The warm-up is far from done: its third wave is held, and more is queued.
            assert st["prefetched"] <= 1500 and st["queued"] >= 600, st
            proxy.stop_holding()
            got = await until(lambda: warmed(node, n - 1), "the warm-up to end", timeout=60)
            assert got["seeding"]["on_demand"] == 1 and got["keys"]["warm"] == n
            line = await until(lambda: warm_up_line(node), "the warm-up's log line")
            assert f"{n} of {n} recently active keys warm" in line, line
        finally:
            proxy.stop_holding()
            await asyncio.to_thread(node.stop)
