"""The node's own background loops on a real process: reservations expire (R03) and idle keys
are evicted (C08) without anyone calling ``expire_reservations`` or ``evict_idle`` by hand.

Observed from outside only, through ``usage``, ``commit`` and ``status``.
"""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from meter.core.keys import period_start
from storage.sqlite import SQLiteStorage
from tests.support.nodes import NodeProcess, raw_call, short_tmpdir

pytestmark = pytest.mark.slow

EVICT_AFTER_S = 1.0


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = short_tmpdir("loops-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def wait_for(cond: Any, timeout: float, what: str, node: NodeProcess) -> float:
    """Poll ``cond`` until true; return the seconds it took, or fail with the node's log."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting until {what}\n{node.log()}")
        time.sleep(0.02)
    return time.monotonic() - t0


def test_the_node_releases_an_expired_reservation_by_itself(workdir: Path) -> None:
    with NodeProcess(workdir) as node:
        node.call("track", "acme", "gpu", 30)
        t0 = time.monotonic()  # before the reservation exists: its deadline is after t0 + ttl
        rid = node.call("reserve", "acme", "gpu", 60, {"limit": 100, "ttl_ms": 500})
        assert node.call("usage", "acme", "gpu") == 90  # held
        error, _ = raw_call(node.socket, "reserve", "acme", "gpu", 11, {"limit": 100})
        assert error["code"] == "limit_exceeded"
        wait_for(lambda: node.call("usage", "acme", "gpu") == 30, 5, "the hold is released", node)
        took = time.monotonic() - t0
        assert took >= 0.5, f"released {took:.3f}s after the reserve, before its ttl of 0.5s"
        st = node.call("status")["reservations"]
        assert st == {"open": 0, "expired_total": 1}, st
        error, _ = raw_call(node.socket, "commit", rid)
        assert error["code"] == "not_found"
        assert node.call("usage", "acme", "gpu") == 30  # the late commit counted nothing
        node.call("reserve", "acme", "gpu", 70, {"limit": 100})  # the limit is free again


def test_the_node_evicts_idle_keys_and_keeps_those_in_use_or_held(workdir: Path) -> None:
    node = NodeProcess(
        workdir, METER_EVICT_AFTER_S=str(EVICT_AFTER_S), METER_FLUSH_INTERVAL_MS="100"
    ).start()
    try:
        busy = 0

        def use_busy() -> None:
            nonlocal busy
            busy += 1
            assert node.call("track", "acme", "busy", 1) == busy

        def warm() -> int:
            use_busy()
            return int(node.call("status")["keys"]["warm"])

        t0 = time.monotonic()  # before the idle key's last use
        node.call("track", "acme", "idle", 5)
        rid = node.call("reserve", "acme", "held", 3, {"ttl_ms": 600_000})
        assert warm() == 3
        # The idle key goes once it is flushed and unused for a full interval (1-2 of them).
        wait_for(lambda: warm() == 2, 2 * EVICT_AFTER_S + 4, "the idle key is evicted", node)
        assert time.monotonic() - t0 >= EVICT_AFTER_S
        # The key in use and the held key stay, interval after interval.
        until = time.monotonic() + 2.5 * EVICT_AFTER_S
        while time.monotonic() < until:
            assert warm() == 2
            time.sleep(0.1)
        assert node.call("status")["keys"]["reserved"] == 1
        assert node.call("usage", "acme", "held") == 3
        # Released, the held key is idle too and goes; then the busy one, once left alone.
        node.call("release", rid)
        wait_for(lambda: warm() == 1, 2 * EVICT_AFTER_S + 4, "the released key is evicted", node)
        wait_for(
            lambda: node.call("status")["keys"]["warm"] == 0,
            2 * EVICT_AFTER_S + 4,
            "the busy key, left alone, is evicted",
            node,
        )
        # Nothing was lost: evicted keys are read back from storage when used again.
        assert node.call("usage_all", "acme") == {"idle": 5, "busy": busy}
        assert node.call("usage", "acme", "held") == 0
        assert node.call("status")["keys"]["warm"] >= 1
    finally:
        assert node.stop() == 0


@pytest.mark.parametrize("unstored", ["pending", "in_flight"])
def test_the_node_keeps_keys_with_unstored_units(workdir: Path, unstored: str) -> None:
    """A key whose units are not stored yet is never evicted, however long it is unused:
    ``pending`` (the flush interval is longer than the test) or ``in_flight`` (the flush
    was taken but cannot be written: another process holds the SQLite write lock)."""
    flush_ms = "60000" if unstored == "pending" else "100"
    node = NodeProcess(
        workdir, METER_EVICT_AFTER_S=str(EVICT_AFTER_S), METER_FLUSH_INTERVAL_MS=flush_ms
    )
    node.start()
    lock: sqlite3.Connection | None = None
    try:
        if unstored == "in_flight":
            lock = sqlite3.connect(node.data_dir / "counters.sqlite3", timeout=5)
            lock.execute("BEGIN IMMEDIATE")  # the node's flushes wait, fail and retry
        node.call("track", "acme", "unstored", 7)
        if unstored == "in_flight":
            wait_for(
                lambda: node.call("status")["keys"]["inflight"] == 1,
                5,
                "the flush is taken",
                node,
            )
        until = time.monotonic() + 3 * EVICT_AFTER_S
        while time.monotonic() < until:
            assert node.call("status")["keys"]["warm"] == 1, "an unstored key was evicted"
            time.sleep(0.1)
        if lock is not None:
            lock.rollback()
            wait_for(
                lambda: node.call("status")["keys"]["warm"] == 0,
                2 * EVICT_AFTER_S + 8,
                "the key, stored at last, is evicted",
                node,
            )
        assert node.call("usage", "acme", "unstored") == 7
    finally:
        if lock is not None:
            lock.close()
        assert node.stop() == 0
    assert asyncio.run(_stored(node.data_dir / "counters.sqlite3")) == {"unstored": 7}


async def _stored(path: Path) -> dict[str, int]:
    store = SQLiteStorage(path)
    await store.open()
    try:
        listed = await store.list_period("acme", period_start("month"))
        return {feature: snap.total for feature, snap in listed.items()}
    finally:
        await store.close()
