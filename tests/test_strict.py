"""Strict limits (escrowed shares, ADR 0009) through real nodes and their sockets.

Several nodes in this process share one SQLite file (each its own data dir, node id and
connection), so the budget is contended as across a fleet; the multi-process proofs on
DynamoDB Local and Redis are in test_strict_cluster.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from meter.client import AsyncClient
from meter.config import CounterConfig, FlushConfig, NodeConfig, ServerConfig, StorageConfig
from meter.errors import LimitExceeded
from meter.escrow import Budget
from meter.node import Node
from storage.sqlite import SQLiteStorage


@pytest.fixture
def tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp") as d:  # short path: socket paths are limited
        yield Path(d)


def _config(tmp: Path, name: str, **counters: Any) -> NodeConfig:
    return NodeConfig(
        data_dir=tmp / name,
        node_id=name,
        server=ServerConfig(socket=tmp / f"{name}.sock"),
        storage=StorageConfig(kind="sqlite", sqlite_file=str(tmp / "shared.db")),
        flush=FlushConfig(interval_ms=100),
        counters=CounterConfig(**counters),
    )


@contextlib.asynccontextmanager
async def _nodes(tmp: Path, n: int, **counters: Any) -> AsyncIterator[list[AsyncClient]]:
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for i in range(n):
            cfg = _config(tmp, f"n{i}", **counters)
            await stack.enter_async_context(Node(cfg))
            c = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
            stack.push_async_callback(c.close)
            clients.append(c)
        yield clients


async def _burst(c: AsyncClient, tenant: str, feature: str, qty: int = 1) -> int:
    """Track until refused; how many units were admitted."""
    ok = 0
    while True:
        try:
            await c.track(tenant, feature, qty)
        except LimitExceeded:
            return ok
        ok += qty


def _period() -> str:
    return time.strftime("%Y-%m", time.gmtime())


async def _stored(tmp: Path, key: tuple[str, str, str]) -> int:
    storage = SQLiteStorage(tmp / "shared.db")
    await storage.open()
    try:
        return (await storage.load([key]))[key].total
    finally:
        await storage.close()


async def _budget(tmp: Path, key: tuple[str, str, str]) -> Budget | None:
    storage = SQLiteStorage(tmp / "shared.db")
    await storage.open()
    try:
        _, body = await storage.budget_read(key)
    finally:
        await storage.close()
    return None if body is None else Budget.from_json(body)


async def test_a_strict_limit_admits_exactly_the_limit_across_nodes(tmp: Path) -> None:
    async with _nodes(tmp, 3, strict_share_max=50) as (a, b, c):
        await a.set_limit("acme", "api", 1000, "hard", "strict")
        # Every node has the limit before the burst (each polls the stored version).
        for node in (a, b, c):
            await _wait_for_limit(node, "acme", "api", "strict")
        conns = [x for x in (a, b, c) for _ in range(4)]
        got = await asyncio.gather(*(_burst(x, "acme", "api") for x in conns))
        assert sum(got) == 1000
        # The limit stays reached.
        with pytest.raises(LimitExceeded, match="strict limit 1000"):
            await b.track("acme", "api", 1)
        st = await a.status()
        assert st["limits"]["strict"]["writes"] >= 1
        key = ("acme", "api", _period())
    # Drained: refused calls counted nothing, and the budget matches what was admitted.
    assert await _stored(tmp, key) == 1000
    budget = await _budget(tmp, key)
    assert budget is not None and budget.granted == 1000
    assert all(s.g == s.c for s in budget.shares.values())  # every share given back or used


async def test_shares_given_back_at_a_clean_stop_are_admitted_by_the_others(tmp: Path) -> None:
    async with _nodes(tmp, 1, strict_share_max=400) as (a,):
        await a.set_limit("acme", "api", 1000, "hard", "strict")
        assert await a.track("acme", "api", 10) == 10  # takes a share of up to 400
    # n0 stopped cleanly: what it held and did not admit is back in the budget.
    async with _nodes(tmp, 2, strict_share_max=400) as (a, b):
        await _wait_for_limit(b, "acme", "api", "strict")
        got = await asyncio.gather(_burst(b, "acme", "api"), _burst(b, "acme", "api"))
        assert sum(got) == 990


async def _wait_for_limit(c: AsyncClient, tenant: str, feature: str, enforcement: str) -> None:
    deadline = asyncio.get_running_loop().time() + 5
    while True:
        lim = await c.limits(tenant)
        eff = lim["limits"].get(feature)
        if eff and eff.get("enforcement") == enforcement:
            return
        assert asyncio.get_running_loop().time() < deadline, lim
        await asyncio.sleep(0.02)


async def _wait_value(c: AsyncClient, tenant: str, feature: str, value: int) -> None:
    deadline = asyncio.get_running_loop().time() + 10
    while (got := await c.usage(tenant, feature)) != value:
        assert asyncio.get_running_loop().time() < deadline, got
        await asyncio.sleep(0.05)
