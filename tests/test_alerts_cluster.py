"""Threshold alerts across a fleet: 4 real nodes on one redis-server and one DynamoDB Local
table (docs/quotas.md, "Threshold alerts"). Every node counts on one counter past 80 % and
100 % of its limit; each threshold fires once across the fleet: one claim wins, one Redis
Stream entry, one notification per subscriber on every node, with the same id everywhere."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from meter.client import Client
from meter.core.keys import period_start
from meter.quotas.alerts import alert_id
from tests.support.cluster_harness import KEY_TENANT, Fleet, wait_until
from tests.support.dynamodb_proxy import DynamoDBProxy
from tests.support.nodes import NodeProcess
from tests.support.redis_server import RedisServer
from tests.support.webhook_receiver import WebhookReceiver

pytestmark = [pytest.mark.slow, pytest.mark.dynamodb, pytest.mark.redis]

LIMIT = 400
PER_NODE = 120  # 4 x 120 = 480: past 100 %


def track_on_each(nodes: list[NodeProcess], feature: str, units: int) -> None:
    """``units`` tracks of one unit on every node at once (a thread each)."""

    def load(p: NodeProcess) -> None:
        with Client.connect(p.socket, timeout=10) as c:
            for _ in range(units):
                c.track(KEY_TENANT, feature, 1)

    threads = [threading.Thread(target=load, args=(p,)) for p in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


@pytest.fixture
def proxy(dynamodb_local: str) -> Iterator[DynamoDBProxy]:
    """A proxy in front of DynamoDB Local on its own event loop thread (the test is blocking)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    px = DynamoDBProxy(int(dynamodb_local.rsplit(":", 1)[1]))
    asyncio.run_coroutine_threadsafe(px.start(), loop).result(10)
    try:
        yield px
    finally:
        asyncio.run_coroutine_threadsafe(px.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_each_threshold_fires_once_across_four_nodes(
    fleet: Fleet,
    redis_server: RedisServer,
    cluster_name: str,
    proxy: DynamoDBProxy,
) -> None:
    stream = f"{cluster_name}:alerts"
    # n0 reaches DynamoDB through the proxy (which can refuse its claims, below).
    nodes = fleet(
        4, each={0: {"METER_DYNAMODB_ENDPOINT": proxy.endpoint}}, METER_ALERTS_STREAM=stream
    )
    ids = {p.name for p in nodes}
    feature = "api"
    with Client.connect(nodes[0].socket, timeout=10) as c:
        version = c.set_limit(KEY_TENANT, feature, LIMIT, "soft", alerts=[80, 100])
    wait_until(
        lambda: all(p.call("limits", KEY_TENANT)["version"] >= version for p in nodes),
        5,
        "every node holds the limit",
        nodes,
    )
    subs: list[Any] = [Client.connect(p.socket, timeout=10) for p in nodes]
    try:
        for s in subs[:4]:
            s.subscribe_alerts()

        track_on_each(nodes, feature, PER_NODE)
        month = period_start("month")
        want = {alert_id(KEY_TENANT, feature, month, pct): pct for pct in (80, 100)}
        for i, s in enumerate(subs[:4]):
            got: list[dict[str, Any]] = []
            while len(got) < 2:
                a = s.next_alert(10)
                assert a is not None, (i, got, nodes[i].log()[-3000:])
                got.append(a)
            assert s.next_alert(1.0) is None, (i, got)  # one per threshold, no more
            assert {a["id"]: a["threshold"] for a in got} == want, (i, got)
            for a in got:
                assert a["tenant"] == KEY_TENANT and a["period"] == month
                assert a["limit"] == LIMIT and a["value"] >= a["threshold_units"]
        statuses = [p.call("status")["alerts"] for p in nodes]
        assert sum(st["fired"] for st in statuses) == 2, statuses
        assert all(st["delivered"] == 2 and st["pending"] == 0 for st in statuses), statuses
        r = redis.Redis.from_url(redis_server.url, decode_responses=True)
        subs.append(r)  # (closed with them)
        wait_until(lambda: len(_stream(r, stream)) >= 2, 5, "stream entries", nodes)
        rows = _stream(r, stream)
        assert sorted(row["id"] for row in rows) == sorted(want), rows
        assert {row["id"]: int(row["threshold"]) for row in rows} == want
        assert {row["node"] for row in rows} <= ids

        # Units counted on n0 only, whose claims storage refuses for a while: its peers
        # detect the crossing from n0's gossip (its deltas, or its flush's announcement when
        # that comes first), one of them wins the claim, and every
        # subscriber (n0's too) gets the alert once; n0's pending claim is dropped when the
        # winner's frame arrives.
        for p in nodes:
            assert p.call("usage", KEY_TENANT, "gpu") == 0  # warm everywhere
        with Client.connect(nodes[0].socket, timeout=10) as c:
            version = c.set_limit(KEY_TENANT, "gpu", 10, "soft", alerts=[50])
            wait_until(
                lambda: all(p.call("limits", KEY_TENANT)["version"] >= version for p in nodes),
                5,
                "every node holds the gpu limit",
                nodes,
            )
            # Refused until a peer's claim has landed (however slow the machine), then let
            # through: n0's next try finds the claim taken.
            for _ in range(10_000):
                proxy.answer_next("PutItem", "ValidationException", "refused by the test")
            c.track(KEY_TENANT, "gpu", 6)
            wait_until(
                lambda: (
                    sum(p.call("status")["alerts"]["fired"] for p in nodes[1:])
                    == sum(st["fired"] for st in statuses[1:]) + 1
                ),
                30,
                "a peer claims the gpu crossing",
                nodes,
            )
            proxy.forget_answers("PutItem")
        gpu = alert_id(KEY_TENANT, "gpu", month, 50)
        for s in subs[:4]:
            a = s.next_alert(10)
            assert a is not None and a["id"] == gpu and a["node"] != "n0", a
            assert s.next_alert(0.5) is None
        after = [p.call("status")["alerts"] for p in nodes]
        assert after[0]["claim_failures"] >= 1 and after[0]["pending"] == 0, after[0]
        assert after[0]["fired"] == statuses[0]["fired"], after[0]
        assert sum(st["fired"] for st in after) == 3, after
        wait_until(lambda: len(_stream(r, stream)) >= 3, 5, "the third stream entry", nodes)
        assert [row["id"] for row in _stream(r, stream)] == [*[row["id"] for row in rows], gpu]
    finally:
        for s in subs:
            s.close()


def _stream(r: Any, stream: str) -> list[dict[str, str]]:
    """The stream's entries' fields, oldest first (``XRANGE - +``)."""
    return [dict(fields) for _, fields in r.xrange(stream)]


def test_three_nodes_crossing_one_threshold_send_one_webhook(fleet: Fleet) -> None:
    """Signed webhooks (docs/quotas.md): 3 nodes count on one counter past 50 % of its limit
    at once; exactly one of them (the claim's winner) POSTs the alert, once."""
    with WebhookReceiver() as receiver:
        nodes = fleet(3, METER_WEBHOOK_URLS=receiver.url, METER_WEBHOOK_SECRET="s3")
        feature = "hooked"
        with Client.connect(nodes[0].socket, timeout=10) as c:
            version = c.set_limit(KEY_TENANT, feature, 30, "soft", alerts=[50])
        wait_until(
            lambda: all(p.call("limits", KEY_TENANT)["version"] >= version for p in nodes),
            5,
            "every node holds the limit",
            nodes,
        )

        track_on_each(nodes, feature, 8)

        def settled() -> bool:
            statuses = [p.call("status") for p in nodes]
            return (
                sum(st["alerts"]["fired"] for st in statuses) == 1
                and all(st["alerts"]["pending"] == 0 for st in statuses)
                and all(st["webhooks"]["pending"] == 0 for st in statuses)
                and sum(st["webhooks"]["delivered"] for st in statuses) == 1
            )

        wait_until(settled, 30, "one claim won and its webhook delivered", nodes)
        want = alert_id(KEY_TENANT, feature, period_start("month"), 50)
        assert [e["id"] for e in receiver.events()] == [want]
        (event,) = receiver.events()
        assert event["type"] == "alert.threshold" and event["data"]["threshold"] == 50
