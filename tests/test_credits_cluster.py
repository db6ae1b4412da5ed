"""Credit-metered `track` across three real nodes on one redis-server and one DynamoDB Local
table: concurrent calls from every node never spend more credits than were granted, and what
the nodes' pool took from the ledger is exactly what the ledger lost (docs/ledger.md)."""

from __future__ import annotations

import pytest

from tests.support.cluster_harness import Fleet, until_refused, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.dynamodb, pytest.mark.redis]


def test_metered_tracks_from_three_nodes_never_overdraw(fleet: Fleet) -> None:
    nodes = fleet(3)
    try:
        version = nodes[0].call("set_plan", "metered", {"gpu": {"price": 2}})["version"]
        nodes[0].call("assign_plan", "acme", "metered")
        wait_until(
            lambda: all(p.call("limits", "acme")["version"] > version for p in nodes),
            5,
            "every node holds the plan",
            nodes,
        )
        nodes[1].call("grant", "acme", 1001, {"ref": "g1"})
        acked = until_refused(
            nodes, lambda n: ("track", ["acme", "gpu", 1]), "insufficient_balance"
        )
        spent = 2 * sum(acked)
        # Never more than granted; each node strands at most one unit's price in its share.
        assert 1001 - 3 * 2 < spent <= 1001, acked
        balance = nodes[2].call("balance", "acme")
        entries = nodes[2].call("ledger", "acme", {"limit": 1000})["entries"]
        metered = sum(-e["amount"] for e in entries if e["kind"] == "metered")
        assert balance["ledger_available"] >= 0
        assert balance["ledger_available"] + metered == 1001
        assert metered >= spent
        print(f"\ncredit-metered, 3 nodes x 4 clients, 1001 credits at 2 a unit: {acked}")
    finally:
        for p in nodes:
            p.kill()
