"""An in-process node's drain (what SIGTERM runs): it reports success only if storage has
every acknowledged unit."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from meter.client import AsyncClient
from meter.config import FlushConfig, NodeConfig, ServerConfig
from meter.node import Node
from storage.base import Applied, Delta, Key, StorageError, StoragePermanentError
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
