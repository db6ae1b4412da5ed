"""Period close on real nodes (docs/invoicing.md; correctness F03): 3 nodes on one DynamoDB
Local table and one redis-server count into last month with ``at`` (its grace made to end a
few seconds later); one is killed (``kill -9``) holding units of it not stored. The export
says ``final: false`` naming that node until it restarts from its data dir, stores them and
closes; then ``final: true``, with every acknowledged unit less the voided ones, and it stays
so. While open, each node's last known backlog of the period (the note of its last renewal)
is in ``open_nodes``."""

from __future__ import annotations

import time
from typing import Any

import pytest

from meter.client import Client
from meter.core.keys import period_start
from storage.periods import bounds
from tests.support.cluster_harness import Fleet, wait_until
from tests.support.nodes import NodeProcess, raw_call

pytestmark = [pytest.mark.slow, pytest.mark.dynamodb, pytest.mark.redis]


def export_all(node: NodeProcess, period: str) -> tuple[dict[str, Any], dict[tuple[str, str], int]]:
    """Every page of ``period``'s export from ``node``: the first page's close state (final
    then: the rows are all the period will hold), and the rows' totals by (tenant, feature)."""
    rows: dict[tuple[str, str], int] = {}
    cursor = None
    first: dict[str, Any] | None = None
    while True:
        page = node.call("export", period, {"cursor": cursor, "limit": 2})
        if first is None:
            first = {k: v for k, v in page.items() if k not in ("rows", "cursor")}
        else:  # (a page after a final one is final: the close never goes back)
            assert page["final"] or not first["final"], (page, first)
        for tenant, feature, _, total, *_ in page["rows"]:
            rows[(tenant, feature)] = total
        cursor = page["cursor"]
        if cursor is None:
            assert first is not None
            return first, rows


def test_a_node_killed_with_units_of_last_month_keeps_it_open_until_it_restarts(
    fleet: Fleet,
) -> None:
    now = time.time()
    month = period_start("month", now)
    start = bounds(month)[0]
    last = period_start("month", start - 1)
    closes_at = now + 15  # (the grace ends 15 s from now: nodes start, count, one dies)
    grace = str(closes_at - start)
    # n2 never flushes; its owner lease is renewed every second (the note: its backlog).
    slow = {"METER_FLUSH_INTERVAL_MS": "600000", "METER_OWNER_LEASE_S": "3"}
    nodes = fleet(3, METER_PERIOD_GRACE_S=grace, each={2: slow})
    at = start - 3600  # (last month)
    acked: dict[tuple[str, str], int] = {}
    for i, node in enumerate(nodes):
        for n in range(6):
            tenant, qty = f"t{n % 3}", 1 + i + n
            node.call("track", tenant, "api", qty, {"at": at, "id": f"c{i}-{n}"})
            acked[(tenant, "api")] = acked.get((tenant, "api"), 0) + qty
    # A mistaken call taken back on each node (a retried void once): the period holds the
    # calls acknowledged less the ones voided.
    for i, node in enumerate(nodes):
        for _ in range(2):
            assert node.call("void", f"c{i}-1", {"id": f"v{i}"})["voided"] == 2 + i
        acked[("t1", "api")] -= 2 + i
    counted = [sum(1 + i + n for n in range(6)) - (2 + i) for i in range(3)]
    held = {"keys": 3, "units": counted[2]}

    def n2_noted() -> bool:
        noted = {n["node"]: n for n in export_all(nodes[0], last)[0]["open_nodes"]}
        return noted["n2"]["backlog"] == held and noted["n2"]["seen_at"] is not None

    wait_until(n2_noted, 10, "n2's renewal notes its backlog of last month", nodes)
    nodes[2].kill()  # (its units of last month: in its log, not in storage)
    killed_at = time.time()
    wait_until(lambda: time.time() > closes_at, 30, "last month's grace ends", nodes)
    # The two live nodes close within 10 s (they flushed); the killed one stays open.
    wait_until(
        lambda: [n["node"] for n in export_all(nodes[0], last)[0]["open_nodes"]] == ["n2"],
        10,
        "n0 and n1 close last month",
        nodes[:2],
    )
    state, rows = export_all(nodes[0], last)
    assert state["final"] is False
    (open_node,) = state["open_nodes"]
    assert open_node["node"] == "n2" and open_node["lease_ends"] is not None
    assert open_node["backlog"] == held and open_node["seen_at"] <= killed_at, open_node
    assert sum(rows.values()) < sum(acked.values())
    nodes[2].env["METER_FLUSH_INTERVAL_MS"] = "100"
    nodes[2].start(timeout=60)
    wait_until(lambda: export_all(nodes[0], last)[0]["final"] is True, 15, "n2 closes", nodes)
    state, rows = export_all(nodes[0], last)
    assert state["open_nodes"] == [] and state["closed_by_operator"] == []
    assert rows == acked, (rows, acked)
    # Each close says what its node counted there (n2's kept by its log across the kill):
    # together, every row's total.
    said = {n["node"]: n["units"] for n in state["closed_nodes"]}
    assert said == {f"n{i}": {"api": counted[i]} for i in range(3)}, said
    with Client.connect(str(nodes[1].socket)) as client:  # (the typed client says it too)
        got = client.export_state(last)
        assert got["final"] is True and got["nodes"] == 3 and got["open_nodes"] == []
    assert nodes[2].call("status")["periods"]["oldest_open"] == month
    # Final never changes afterwards: a late call is refused, the rows stay.
    for node in nodes:
        error, _ = raw_call(node.socket, "track", "t0", "api", 1, {"at": at})
        assert error is not None and error["code"] == "period_closed", error
    again, rows_again = export_all(nodes[1], last)
    assert rows_again == rows and again["final"] is True and again["open_nodes"] == []
