"""Real node processes on ``METER_STORAGE=dynamodb`` against Amazon DynamoDB Local.

Every test ends the same way: a *fresh* node on the same table reads back exactly the units that
were acknowledged, whatever happened in between (lost responses, an outage of the database).
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from meter.client import AsyncClient
from meter.core.keys import period_start
from meter.errors import Unavailable
from storage.dynamodb import DynamoDBStorage
from tests.support.dynamodb_local import TEST_JAVA_OPTIONS, DynamoDBLocal
from tests.support.fixtures_dynamodb import create_table, new_table_name
from tests.support.lossy_proxy import LossyProxy
from tests.support.nodes import ROOT, NodeProcess, short_tmpdir

pytestmark = [pytest.mark.dynamodb, pytest.mark.slow]

FEATURES = [f"f{i}" for i in range(12)]


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = short_tmpdir()
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def dynamo_env(endpoint: str, table: str, **extra: str) -> dict[str, str]:
    return {
        "METER_STORAGE": "dynamodb",
        "METER_DYNAMODB_ENDPOINT": endpoint,
        "METER_DYNAMODB_TABLE": table,
        **extra,
    }


async def load(sock: Path, acked: Counter[str], stop: asyncio.Event, seed: int) -> int:
    """Track random units until ``stop``; count every acknowledged unit per feature."""
    rng = random.Random(seed)
    calls = 0
    client = await AsyncClient.connect(str(sock))
    try:
        while not stop.is_set():
            feature = rng.choice(FEATURES)
            qty = rng.randint(1, 9)
            await client.track("acme", feature, qty)
            acked[feature] += qty  # acknowledged: the answer arrived (nil or a total)
            calls += 1
            if calls % 50 == 0:
                await asyncio.sleep(0)
    finally:
        await client.close()
    return calls


async def read_back(workdir: Path, endpoint: str, table: str) -> dict[str, int]:
    """What a brand-new node on the same table answers."""
    fresh = NodeProcess(workdir, "fresh", **dynamo_env(endpoint, table))
    await asyncio.to_thread(fresh.start)
    try:
        client = await AsyncClient.connect(str(fresh.socket))
        try:
            result: dict[str, int] = await client.usage_all("acme")
        finally:
            await client.close()
    finally:
        assert await asyncio.to_thread(fresh.stop) == 0, fresh.log()
    return result


async def stored_totals(endpoint: str, table: str) -> dict[str, int]:
    store = DynamoDBStorage(table, endpoint_url=endpoint)
    await store.open()
    try:
        listed = await store.list_period("acme", period_start("month"))
    finally:
        await store.close()
    return {f: s.total for f, s in listed.items()}


async def status(sock: Path) -> dict[str, Any]:
    client = await AsyncClient.connect(str(sock))
    try:
        st: dict[str, Any] = await client.status()
        return st
    finally:
        await client.close()


async def test_node_serves_and_a_fresh_node_reads_back(
    workdir: Path, dynamodb_local: str, dynamodb_table: str
) -> None:
    node = NodeProcess(workdir, **dynamo_env(dynamodb_local, dynamodb_table))
    await asyncio.to_thread(node.start)
    client = await AsyncClient.connect(str(node.socket))
    try:
        assert await client.track("acme", "f0", 5) == 5
        assert await client.usage("acme", "f0") == 5
        rid = await client.reserve("acme", "f1", 3, limit=10)
        assert await client.commit(rid, 2) == 2
        st = await client.status()
        assert st["storage"] == "dynamodb"
    finally:
        await client.close()
    assert await asyncio.to_thread(node.stop) == 0, node.log()
    assert await read_back(workdir, dynamodb_local, dynamodb_table) == {"f0": 5, "f1": 2}


@pytest.mark.parametrize("mode", ["single", "auto"])
async def test_lossy_connection_to_dynamodb_counts_exactly_once(
    workdir: Path, dynamodb_local: str, dynamodb_table: str, mode: str
) -> None:
    """Lost answers of a node's flush writes: ``UpdateItem`` calls answered again by their
    conditions (duplicates), or transactions (``auto``, the default), sent again under their
    token (DynamoDB answers without writing twice) or in a later round (duplicates)."""
    upstream = int(dynamodb_local.rsplit(":", 1)[1])
    acked: Counter[str] = Counter()
    async with LossyProxy(upstream, loss=0.25, seed=3) as proxy:
        node = NodeProcess(
            workdir,
            **dynamo_env(proxy.endpoint, dynamodb_table, METER_FLUSH_INTERVAL_MS="50"),
            METER_DYNAMODB_READ_TIMEOUT_S="1",
            METER_FLUSH_MODE=mode,
        )
        await asyncio.to_thread(node.start)
        stop = asyncio.Event()
        loaders = [asyncio.create_task(load(node.socket, acked, stop, seed=s)) for s in range(4)]
        for _ in range(200):  # until enough flush rounds went through the lossy link
            await asyncio.sleep(0.1)
            st = await status(node.socket)
            faults = st["flush"]["duplicates"] >= 5 if mode == "single" else proxy.lost >= 10
            if faults and st["flush"]["rounds"] >= 20:
                break
        stop.set()
        calls = sum(await asyncio.gather(*loaders))
        st = await status(node.socket)
        code = await asyncio.to_thread(node.stop)
        assert code == 0, node.log()
    print(
        f"\nnode through lossy proxy: {calls} track calls, {sum(acked.values())} units, "
        f"{proxy.lost} responses lost, {st['flush']['duplicates']} duplicate flushes answered "
        f"from the item, {st['flush']['keys_written']} keys written"
    )
    assert proxy.lost > 0, "the fault path was exercised"
    writes = st["flush"]["writes"]
    if mode == "single":
        assert st["flush"]["duplicates"] > 0 and writes["transactions"] == 0
    else:
        assert writes["mode"] == "auto" and writes["transactions"] > 0
    assert await stored_totals(dynamodb_local, dynamodb_table) == dict(acked)
    assert await read_back(workdir, dynamodb_local, dynamodb_table) == dict(acked)


async def test_dynamodb_outage_under_load_loses_nothing(
    workdir: Path, dynamodb_local_home: Path
) -> None:
    server = DynamoDBLocal(
        dynamodb_local_home, db_path=workdir / "ddb", java_options=TEST_JAVA_OPTIONS
    )
    await asyncio.to_thread(server.start)
    try:
        table = await create_table(server.endpoint)
        node = NodeProcess(
            workdir,
            **dynamo_env(server.endpoint, table, METER_FLUSH_INTERVAL_MS="100"),
            METER_FLUSH_MAX_BACKOFF_MS="500",
            METER_DYNAMODB_CONNECT_TIMEOUT_S="0.5",
            METER_DYNAMODB_READ_TIMEOUT_S="1",
        )
        await asyncio.to_thread(node.start)
        acked: Counter[str] = Counter()
        stop = asyncio.Event()
        loaders = [asyncio.create_task(load(node.socket, acked, stop, seed=s)) for s in range(3)]
        await asyncio.sleep(1.0)
        await asyncio.to_thread(server.stop)
        await asyncio.sleep(4.0)  # several seconds down, under load
        during = await status(node.socket)
        # retry_timeout=0: the node's unavailable answer itself is checked, not the client
        # waiting out the outage.
        client = await AsyncClient.connect(str(node.socket), retry_timeout=0)
        try:
            # A counter never seen before cannot be seeded: counted, but no total is invented.
            assert await client.track("other", "cold", 7) is None
            with pytest.raises(Unavailable):
                await client.usage("other", "cold")
            # Warm counters keep answering from memory.
            assert isinstance(await client.track("acme", "f0", 1), int)
            acked["f0"] += 1
        finally:
            await client.close()
        await asyncio.to_thread(server.start)
        await asyncio.sleep(1.5)
        stop.set()
        await asyncio.gather(*loaders)
        client = await AsyncClient.connect(str(node.socket))
        try:
            assert await client.usage("other", "cold") == 7
        finally:
            await client.close()
        assert await asyncio.to_thread(node.stop) == 0, node.log()
        flush = during["flush"]
        print(
            f"\noutage: backlog {flush['backlog_keys']} keys / {flush['backlog_units']} units, "
            f"age {flush['backlog_age_s']} s, last error: {flush['last_error']}"
        )
        assert flush["backlog_keys"] > 0 and flush["backlog_units"] > 0
        assert flush["backlog_age_s"] is not None and flush["backlog_age_s"] > 1
        assert flush["last_result"] == "error"
        assert await read_back(workdir, server.endpoint, table) == dict(acked)
    finally:
        await asyncio.to_thread(server.__exit__)


def test_storage_init_creates_the_table_and_is_idempotent(dynamodb_local: str) -> None:
    table = new_table_name()
    env = {k: v for k, v in os.environ.items() if not k.startswith("METER_")}
    env.update(dynamo_env(dynamodb_local, table), PYTHONPATH=str(ROOT))
    for _ in range(2):
        res = subprocess.run(
            [sys.executable, "-m", "meter", "storage", "init"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, res.stderr
        assert table in res.stdout
