"""In-process nodes (the real ``Node``) on a real redis-server: what the node itself hands the
gossip layer, such as the incarnation it keeps in its data dir."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from meter.config import ClusterConfig, FlushConfig, NodeConfig, ServerConfig
from meter.node.datadir import DataDir
from meter.node.lifecycle import Node
from storage.memory import MemoryStorage
from tests.support.redis_server import RedisServer

HOUR_NS = 3600 * 10**9


@pytest.fixture
def tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:  # short path: Unix socket paths are limited
        yield Path(d)


async def until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Let the loop run until ``cond()`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting until {what}")
        await asyncio.sleep(0.01)


def test_the_incarnation_kept_in_the_data_dir_only_grows(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = DataDir(tmp / "d")
    d.acquire()
    try:
        before = time.time_ns()
        first = d.incarnation()
        assert first >= before
        assert d.incarnation() > first
        # The clock was an hour ahead at the last start: the next one is still larger.
        ahead = time.time_ns() + HOUR_NS
        (tmp / "d" / "incarnation").write_text(f"{ahead}\n")
        assert d.incarnation() == ahead + 1
        assert d.incarnation() == ahead + 2
        # A clock that moved ahead of the kept value wins again.
        real = time.time_ns
        monkeypatch.setattr(time, "time_ns", lambda: real() + 2 * HOUR_NS)
        assert d.incarnation() > ahead + 2 + HOUR_NS // 2
    finally:
        d.release()


@pytest.mark.redis
async def test_a_node_restarted_with_its_clock_behind_is_not_refused_as_stale(
    tmp: Path, redis_server: RedisServer, cluster_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node's first start ran on a clock an hour ahead; it restarts (same data dir) after
    the clock was set right. Its peers must take the new start for a restart, not refuse every
    message of it as an older incarnation, for good."""

    def config(name: str) -> NodeConfig:
        return NodeConfig(
            data_dir=tmp / name,
            node_id=name,
            server=ServerConfig(socket=tmp / f"{name}.sock"),
            flush=FlushConfig(interval_ms=3_600_000),
            cluster=ClusterConfig(
                redis_url=redis_server.url,
                cluster_name=cluster_name,
                heartbeat_ms=50,
                peer_timeout_ms=60_000,
            ),
        )

    async with Node(config("b"), storage=MemoryStorage()) as b:
        bg = b.gossip
        assert bg is not None
        real = time.time_ns
        monkeypatch.setattr(time, "time_ns", lambda: real() + HOUR_NS)
        a = Node(config("a"), storage=MemoryStorage())
        await a.start()
        monkeypatch.setattr(time, "time_ns", real)
        assert a.gossip is not None
        first = a.gossip.incarnation
        assert first > time.time_ns() + HOUR_NS // 2
        await until(lambda: "a" in bg.peers.live(), "b hears a")
        assert await a.stop() == 0

        a = Node(config("a"), storage=MemoryStorage())
        await a.start()
        try:
            await until(
                lambda: bg.status()["peers"]["a"]["restarts"] == 1,
                "b takes a's new start for a restart",
                timeout=5,
            )
            assert bg.status()["rejected"]["stale"] == 0
            assert a.gossip is not None and a.gossip.incarnation == first + 1
        finally:
            await a.stop()
