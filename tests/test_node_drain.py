"""An in-process node's drain (what SIGTERM runs): it reports success only if storage has
every acknowledged unit."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from meter.client import AsyncClient
from meter.config import FlushConfig, NodeConfig, ServerConfig
from meter.errors import Unavailable
from meter.node.lifecycle import Node
from storage.base import Applied, Delta, Key, Snapshot, StorageError, StoragePermanentError
from storage.memory import MemoryStorage


class RefusesOneFeature(MemoryStorage):
    """Answers every write of feature ``bad`` with a permanent error (e.g. a validation
    error), like DynamoDB refusing a total beyond 38 digits."""

    async def apply(self, node: str, deltas: Sequence[Delta]) -> dict[Key, Applied | StorageError]:
        good = [d for d in deltas if d.key[1] != "bad"]
        out: dict[Key, Applied | StorageError] = dict(await super().apply(node, good))
        for d in deltas:
            if d.key[1] == "bad":
                out[d.key] = StoragePermanentError("ValidationException: refused")
        return out


@pytest.fixture
def tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:  # short path: Unix socket paths are limited
        yield Path(d)


async def test_drain_with_a_parked_key_reports_units_not_stored(tmp: Path) -> None:
    store = RefusesOneFeature()
    cfg = NodeConfig(
        data_dir=tmp / "data",
        node_id="n1",
        server=ServerConfig(socket=tmp / "m.sock"),
        flush=FlushConfig(interval_ms=3_600_000, drain_timeout_s=0.5),
    )
    node = Node(cfg, storage=store)
    await node.start()
    client = await AsyncClient.connect(cfg.server.socket)
    await client.track("acme", "good", 2)
    await client.track("acme", "bad", 3)  # acknowledged: money the store must get
    await client.close()
    code = await node.stop()
    assert sum(s.total for s in store.items.values()) == 2, "the bad key's units never landed"
    assert node.drained is False and code == 1, (
        "3 acknowledged units are not stored, yet the drain reported success (exit 0)"
    )


class StuckReads(MemoryStorage):
    """Reads never answer (a database that hangs); writes work."""

    def __init__(self) -> None:
        super().__init__()
        self.reads_started = asyncio.Event()

    async def load(self, keys: Sequence[Key]) -> dict[Key, Snapshot]:
        self.reads_started.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


@pytest.mark.parametrize("timeout", [0.2, 1.5])
async def test_the_request_drain_timeout_bounds_the_wait_for_in_flight_requests(
    tmp: Path, timeout: float
) -> None:
    """SIGTERM waits ``request_drain_timeout_s`` for requests in flight, then answers them
    ``unavailable`` (nothing was counted) and goes on draining."""
    store = StuckReads()
    cfg = NodeConfig(
        data_dir=tmp / "data",
        node_id="n1",
        server=ServerConfig(socket=tmp / "m.sock", request_drain_timeout_s=timeout),
        flush=FlushConfig(drain_timeout_s=5),
    )
    node = Node(cfg, storage=store)
    await node.start()
    client = await AsyncClient.connect(cfg.server.socket, retry_timeout=0)
    try:
        stuck = asyncio.ensure_future(client.track("acme", "cold", 1))  # waits on a read
        await asyncio.wait_for(store.reads_started.wait(), 10)
        loop = asyncio.get_running_loop()
        started = loop.time()
        stopping = asyncio.ensure_future(node.stop())
        with pytest.raises(Unavailable):
            await asyncio.wait_for(stuck, 30)
        waited = loop.time() - started
        assert await asyncio.wait_for(stopping, 30) == 0
    finally:
        await client.close()
    assert timeout <= waited < timeout + 2.5, waited
    assert store.items == {}, "the cut-short track counted nothing"
