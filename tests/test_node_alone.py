"""An in-process node without a cluster: nobody gossips, so nothing may pile up for gossip."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from meter.client import AsyncClient
from meter.config import FlushConfig, NodeConfig, ServerConfig
from meter.node.lifecycle import Node
from storage.memory import MemoryStorage


@pytest.fixture
def tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:  # short path: Unix socket paths are limited
        yield Path(d)


def _config(tmp: Path) -> NodeConfig:
    return NodeConfig(
        data_dir=tmp / "data",
        node_id="n1",
        server=ServerConfig(socket=tmp / "m.sock"),
        flush=FlushConfig(interval_ms=3_600_000),  # rounds are driven by the test
    )


async def test_a_node_alone_lets_flushed_keys_go_idle_and_be_evicted(tmp: Path) -> None:
    """Without peers no broadcaster takes the gossip columns. Every flush used to seal the
    units in another ``sealed_gossip`` entry that nobody took: one more tuple per key per
    flush, for ever, and no row ever idle, so no key was ever evicted (memory grew until
    the node died)."""
    store = MemoryStorage()
    cfg = _config(tmp)
    async with Node(cfg, storage=store) as node:
        assert node.table is not None and node.flusher is not None
        client = await AsyncClient.connect(cfg.server.socket)
        for _ in range(50):
            await client.track("acme", "api", 1)
            assert await node.flusher.flush_once()
        await client.close()
        (key,) = node.table.keys()
        assert store.items[key].total == 50
        assert node.table.columns(key)["pending_gossip"] == 0  # type: ignore[index]
        assert node.table.touched_keys() == []
        node.table.evict_idle()
        node.table.evict_idle()
        assert not node.table.is_warm(key), "a flushed, unused key is evicted"


async def test_a_failing_store_shows_as_degraded_not_as_unready(tmp: Path) -> None:
    """A flush round that fails (storage not answering) marks the node degraded (``meter
    status --check --strict`` fails) but ready: it still counts, and keeps the units. The next
    round that writes clears it."""
    store = MemoryStorage()
    cfg = _config(tmp)
    async with Node(cfg, storage=store) as node:
        assert node.flusher is not None
        client = await AsyncClient.connect(cfg.server.socket)
        try:
            await client.track("acme", "api", 2)
            store.fail_next = 10**6
            assert not await node.flusher.flush_once()
            st = await client.status()
            assert st["ready"] is True and st["not_ready"] == []
            assert [r for r in st["degraded"] if r.startswith("storage: the last flush round")]
            assert await client.track("acme", "api", 1) == 3  # still counting
            store.fail_next = 0
            assert await node.flusher.flush_once()
            st = await client.status()
            assert st["degraded"] == [] and st["ready"] is True
        finally:
            await client.close()
