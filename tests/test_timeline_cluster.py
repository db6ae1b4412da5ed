"""The ledger timeline across a fleet (docs/ledger.md, "Timeline"): entries of 1,000 tenants
written by 3 real node processes sharing storage come back from any node in time order, each
once, across pages; on a shared SQLite file and on DynamoDB Local."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from meter.client import AsyncClient
from tests.support.fixtures_dynamodb import create_table
from tests.support.nodes import NodeProcess, short_tmpdir

TENANTS = 1_000


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = short_tmpdir("tlc-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def _env(backend: str, workdir: Path, request: pytest.FixtureRequest) -> dict[str, str]:
    if backend == "sqlite":
        return {"METER_STORAGE": "sqlite", "METER_SQLITE_FILE": str(workdir / "shared.sqlite3")}
    endpoint: str = request.getfixturevalue("dynamodb_local")
    return {
        "METER_STORAGE": "dynamodb",
        "METER_DYNAMODB_ENDPOINT": endpoint,
        "METER_DYNAMODB_TABLE": await create_table(endpoint),
    }


async def _write(sock: Path, tenants: list[str]) -> list[tuple[str, int, str, int]]:
    """A grant to each tenant and a debit from every third, 32 calls at once; what was
    written, as ``(tenant, seq, kind, amount)``."""
    client = await AsyncClient.connect(str(sock))
    out: list[tuple[str, int, str, int]] = []
    gate = asyncio.Semaphore(32)

    async def one(n: int, tenant: str) -> None:
        async with gate:
            got = await client.grant(tenant, 10 + n % 7)
            out.append((tenant, got["seq"], "grant", 10 + n % 7))
            if n % 3 == 0:
                got = await client.debit(tenant, 4)
                out.append((tenant, got["seq"], "debit", -4))

    try:
        await asyncio.gather(*(one(n, t) for n, t in enumerate(tenants)))
    finally:
        await client.close()
    return out


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("dynamodb", marks=pytest.mark.dynamodb)]
)
async def test_three_nodes_entries_of_1000_tenants_come_back_in_order_once(
    backend: str, workdir: Path, request: pytest.FixtureRequest
) -> None:
    env = await _env(backend, workdir, request)
    nodes = [NodeProcess(workdir, f"n{i}", METER_NODE_ID=f"n{i}", **env) for i in range(3)]
    await asyncio.gather(*(asyncio.to_thread(n.start) for n in nodes))
    try:
        start = time.time()
        tenants = [f"t{n:04d}" for n in range(TENANTS)]
        parts = await asyncio.gather(
            *(_write(node.socket, tenants[i::3]) for i, node in enumerate(nodes))
        )
        written = sorted(e for part in parts for e in part)
        assert len(written) == TENANTS + (TENANTS + 2) // 3
        for reader, size in ((nodes[0], 97), (nodes[2], 1000)):
            client = await AsyncClient.connect(str(reader.socket))
            try:
                got: list[dict[str, Any]] = []
                cursor = None
                end = time.time() + 0.001
                while True:
                    page = await client.ledger_timeline_page(start, end, cursor, size)
                    assert page["entries"] or page["cursor"] is None
                    got += page["entries"]
                    cursor = page["cursor"]
                    if cursor is None:
                        break
            finally:
                await client.close()
            order = [(e["time"], e["tenant"], e["seq"]) for e in got]
            assert order == sorted(order), size
            assert sorted((e["tenant"], e["seq"], e["kind"], e["amount"]) for e in got) == written
    finally:
        for node in nodes:
            node.stop()
