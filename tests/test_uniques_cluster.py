"""Unique counts across a fleet (docs/dimensions.md, "Unique counts"): 3 real nodes on one
redis-server and one DynamoDB Local table. The same new values sent to every node at once are
counted once each, on every node's view and in storage; a node killed with ``kill -9`` in the
middle of a load and restarted from its data dir neither loses nor doubles a value (G12 of
docs/correctness.md)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from meter.core.keys import period_start
from tests.support.cluster_harness import Conn, Fleet, NodeThreads, wait_until
from tests.support.nodes import NodeProcess

pytestmark = [pytest.mark.slow, pytest.mark.dynamodb, pytest.mark.redis]


@pytest.fixture(scope="module")
def nodes(module_fleet: Fleet) -> list[NodeProcess]:
    nodes = module_fleet(3)
    version = nodes[0].call("set_feature", "seats", {"aggregation": "unique"})["version"]
    wait_until(
        lambda: all(p.call("get_feature", "seats")["version"] >= version for p in nodes),
        5,
        "every node holds the declaration",
        nodes,
    )
    return nodes


class Burst(NodeThreads):
    """One thread per node sending ``values`` (the same list to every node, in the same
    order) to ``tenant``'s ``seats``, each call with a request id of its node; the threads
    start together. A call whose answer never came (its node died) is kept to be sent again
    under its id (:meth:`resend`)."""

    def __init__(self, nodes: list[NodeProcess], tenant: str, values: list[str]) -> None:
        super().__init__(nodes)
        self.tenant = tenant
        self.values = values
        self.go = threading.Barrier(len(nodes))
        self.acked: list[set[str]] = [set() for _ in nodes]
        self.in_doubt: dict[int, list[list[Any]]] = {}
        self.errors: list[Any] = []
        self._lock = threading.Lock()

    def _params(self, i: int, n: int) -> list[Any]:
        return [self.tenant, "seats", 1, {"value": self.values[n], "id": f"{self.tenant}-{i}-{n}"}]

    def _run(self, i: int) -> None:
        conn = Conn(self.nodes[i].socket, timeout=30)
        try:
            self.go.wait()
            for n in range(len(self.values)):
                params = self._params(i, n)
                try:
                    error, _ = conn.call("track", *params)
                except OSError:
                    self.in_doubt[i] = [self._params(i, m) for m in range(n, len(self.values))]
                    return
                self._answered(i, params, error)
        finally:
            conn.close()

    def _answered(self, i: int, params: list[Any], error: Any) -> None:
        with self._lock:
            if error is None:
                self.acked[i].add(params[3]["value"])
            else:
                self.errors.append(error)

    def resend(self, i: int) -> None:
        conn = Conn(self.nodes[i].socket, timeout=30)
        try:
            for params in self.in_doubt.pop(i, []):
                error, _ = conn.call("track", *params)
                self._answered(i, params, error)
        finally:
            conn.close()


def stored_count(node: NodeProcess, tenant: str) -> int | None:
    """The tenant's stored distinct count (the ``export`` method)."""
    cursor = None
    while True:
        opts: dict[str, str] = {} if cursor is None else {"cursor": cursor}
        page = node.call("export", period_start("month"), opts)
        for row in page["rows"]:
            if row[0] == tenant and row[1] == "seats" and len(row) == 4:
                return int(row[3])
        cursor = page["cursor"]
        if cursor is None:
            return None


def counts(nodes: list[NodeProcess], tenant: str) -> list[int]:
    return [p.call("usage", tenant, "seats") for p in nodes]


def claims(nodes: list[NodeProcess]) -> tuple[int, int]:
    """Claims won and lost over the fleet."""
    got = [p.call("status")["uniques"] for p in nodes]
    return sum(u["claims_won"] for u in got), sum(u["claims_lost"] for u in got)


def test_the_same_new_values_sent_to_every_node_at_once_count_once_each(
    nodes: list[NodeProcess],
) -> None:
    won, lost = claims(nodes)
    values = [f"user-{n}" for n in range(20)]
    burst = Burst(nodes, "burst", values).start()
    burst.join()
    assert not burst.errors, burst.errors[:3]
    assert all(acked == set(values) for acked in burst.acked)
    wait_until(lambda: counts(nodes, "burst") == [20, 20, 20], 10, "every node counts 20", nodes)
    wait_until(lambda: stored_count(nodes[0], "burst") == 20, 10, "storage holds 20", nodes)
    won_after, lost_after = claims(nodes)
    assert won_after - won == 20
    assert won_after - won + lost_after - lost <= 60  # (a value a node knows is not claimed)
    # Sent again anywhere: answered from what the nodes know, nothing more counted.
    again = Burst(nodes, "burst", values).start()
    again.join()
    assert not again.errors
    assert counts(nodes, "burst") == [20, 20, 20]


def test_a_node_killed_mid_load_neither_loses_nor_doubles_a_value(
    nodes: list[NodeProcess],
) -> None:
    values = [f"member-{n}" for n in range(600)]
    burst = Burst(nodes, "kill", values).start()
    wait_until(lambda: len(burst.acked[2]) >= 40, 30, "n2 has answered 40 values", nodes)
    nodes[2].kill()
    burst.join()
    nodes[2].start(timeout=60)
    burst.resend(2)
    assert not burst.errors, burst.errors[:3]
    assert all(acked == set(values) for acked in burst.acked)
    want = [len(values)] * 3
    wait_until(lambda: counts(nodes, "kill") == want, 30, "every node counts 600", nodes)
    wait_until(lambda: stored_count(nodes[0], "kill") == 600, 30, "storage holds 600", nodes)
    wait_until(
        lambda: nodes[2].call("status")["uniques"]["claims_unresolved"] == 0,
        10,
        "the restarted node resolved its claims",
        nodes,
    )
    assert counts(nodes, "kill") == want


def test_a_value_one_node_counted_is_answered_by_its_peers_from_what_gossip_told(
    nodes: list[NodeProcess],
) -> None:
    for p in nodes[1:]:
        p.call("usage", "told", "seats")  # (they hold the counter: they learn its values)
    values = [f"guest-{n}" for n in range(10)]
    learned = [p.call("status")["uniques"]["values_learned"] for p in nodes[1:]]
    for v in values:
        nodes[0].call("track", "told", "seats", 1, {"value": v})
    wait_until(
        lambda: all(
            p.call("status")["uniques"]["values_learned"] >= n + 10
            for p, n in zip(nodes[1:], learned, strict=True)
        ),
        10,
        "the peers learned the values",
        nodes,
    )
    before = claims(nodes[1:])
    for p in nodes[1:]:
        for v in values:
            p.call("track", "told", "seats", 1, {"value": v})
    assert claims(nodes[1:]) == before  # (answered from memory: no claim made)
    wait_until(lambda: counts(nodes, "told") == [10, 10, 10], 10, "every node counts 10", nodes)
