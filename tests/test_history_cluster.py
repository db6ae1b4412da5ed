"""History across a fleet: three real nodes on one redis-server and one DynamoDB Local table
(docs/history.md). Every node's current bucket agrees with its ``usage``, and once flushed the
stored day buckets of the month sum to the stored month counter, which is what was tracked."""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime

import pytest

from storage.dynamodb import DynamoDBStorage
from tests.support.cluster_harness import KEY_TENANT, Fleet, wait_until
from tests.support.nodes import NodeProcess

pytestmark = [pytest.mark.slow, pytest.mark.dynamodb, pytest.mark.redis]


def _today(p: NodeProcess) -> list[int]:
    """``[today's bucket, usage]`` from one node, as its history answers."""
    days = p.call("history", KEY_TENANT, "api", {"granularity": "day"})
    return [days[-1][1], p.call("usage", KEY_TENANT, "api")]


def test_history_on_three_nodes_agrees_with_usage_and_storage(
    fleet: Fleet,
    dynamodb_local: str,
    dynamodb_table: str,
) -> None:
    nodes = fleet(3)
    acked = [0]
    stop = threading.Event()

    def load(p: NodeProcess, qty: int) -> None:
        while not stop.is_set() and acked[0] < 3000:
            p.call("track", KEY_TENANT, "api", qty)
            with lock:
                acked[0] += qty

    lock = threading.Lock()
    threads = [threading.Thread(target=load, args=(p, i + 1)) for i, p in enumerate(nodes)]
    for t in threads:
        t.start()
    # While units are tracked, gossiped and flushed (some pending, some in flight), no node's
    # current bucket ever shows more than was acknowledged (plus the calls under way: three
    # at most, of at most 3 units): nothing stored is counted again with what is unstored.
    checks = 0
    while any(t.is_alive() for t in threads) and checks < 30:
        for p in nodes:
            days = p.call("history", KEY_TENANT, "api", {"granularity": "day"})
            with lock:
                bound = acked[0] + 9
            assert 0 <= days[-1][1] <= bound, (days[-1], bound)
            assert sum(v for _, v in days) <= bound
        checks += 1
    stop.set()
    for t in threads:
        t.join()
    total = acked[0]
    wait_until(
        lambda: all(_today(p) == [total, total] for p in nodes),
        20,
        "every node's history and usage show every acknowledged unit",
        nodes,
    )
    wait_until(
        lambda: all(p.call("status")["flush"]["backlog_keys"] == 0 for p in nodes),
        20,
        "every node flushed",
        nodes,
    )
    today = datetime.now(tz=UTC).date().isoformat()
    month = today[:7]

    async def stored() -> tuple[int, dict[str, int]]:
        store = DynamoDBStorage(dynamodb_table, endpoint_url=dynamodb_local)
        await store.open()
        try:
            snap = (await store.load([(KEY_TENANT, "api", month)]))[(KEY_TENANT, "api", month)]
            days = await store.day_buckets(KEY_TENANT, "api", f"{month}-01", today)
            return snap.total, days
        finally:
            await store.close()

    month_total, days = asyncio.run(stored())
    assert month_total == total
    # Flushed today (or, across midnight UTC, yesterday too): the days sum to the month.
    assert sum(days.values()) == total, days
    for p in nodes:
        months = p.call("history", KEY_TENANT, "api", {"granularity": "month"})
        assert months[-1] == [month, total]
        assert _today(p) == [days.get(today, 0) + total - sum(days.values()), total]
