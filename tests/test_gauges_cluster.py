"""Gauges across a fleet (docs/dimensions.md, "Gauges"): 3 real nodes on one redis-server
and one DynamoDB Local table. ``max`` and ``latest`` observations made on every node end
with every node and storage holding the same reading: the largest value, and the value of
the latest observation; a node killed with ``kill -9`` mid-load and restarted from its data
dir loses none of the observations it acknowledged (G09 of docs/correctness.md)."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest

from meter.core.keys import period_start
from tests.support.cluster_harness import Conn, Fleet, NodeThreads, wait_until
from tests.support.nodes import NodeProcess

pytestmark = [pytest.mark.slow, pytest.mark.dynamodb, pytest.mark.redis]


@pytest.fixture(scope="module")
def nodes(module_fleet: Fleet) -> list[NodeProcess]:
    nodes = module_fleet(3)
    nodes[0].call("set_feature", "peak_gb", {"aggregation": "max"})
    version = nodes[0].call("set_feature", "seats", {"aggregation": "latest"})["version"]
    wait_until(
        lambda: all(p.call("get_feature", "seats")["version"] >= version for p in nodes),
        5,
        "every node holds the declarations",
        nodes,
    )
    return nodes


class GaugeLoad(NodeThreads):
    """One thread per node observing both gauges with request ids: a ``track`` of ``seats``
    (with its own instant, 3 ms apart over the fleet, so the latest is one observation
    whatever a float's rounding) and a ``track_many`` of two ``peak_gb`` items (observed at
    the call's time: a batch item takes no ``at``) at a time;
    what was acknowledged is kept, and a call whose answer never came (its node died) is
    kept to be sent again under its ids (:meth:`resend`).

    ``shared``: every node observes one tenant's gauges, random values; else each node its
    own tenant's (``tenant-n<i>``), values growing with each round, so the largest and the
    latest are the node's last acknowledged observations (those its last flush may not
    have written)."""

    def __init__(
        self, nodes: list[NodeProcess], tenant: str, rounds: int, shared: bool = True
    ) -> None:
        super().__init__(nodes)
        self.tenant = tenant
        self.rounds = rounds
        self.shared = shared
        self.base_ms = int(time.time() * 1000) - 600_000
        #: (tenant, feature, value, at_ms) of every acknowledged observation.
        self.acked: list[tuple[str, str, int, int]] = []
        self.in_doubt: dict[int, list[tuple[str, list[Any]]]] = {}
        self.errors: list[Any] = []
        self.sent = [0] * len(nodes)
        self._lock = threading.Lock()

    def _item(self, rng: random.Random, i: int, r: int, j: int, feature: str) -> list[Any]:
        at_ms = self.base_ms + 3 * ((r * 3 + j) * len(self.nodes) + i)
        opts: dict[str, Any] = {"id": f"{self.tenant}-{i}-{r}-{j}"}
        if feature == "seats":
            opts["at"] = at_ms / 1000
        if self.shared:
            return [self.tenant, feature, rng.randint(1, 1_000_000), opts]
        value = (r * 3 + j) * 1_000_000 + rng.randint(0, 999_999)
        return [f"{self.tenant}-n{i}", feature, value, opts]

    def _run(self, i: int) -> None:
        rng = random.Random(i)
        conn = Conn(self.nodes[i].socket, timeout=10)
        try:
            for r in range(self.rounds):
                one = self._item(rng, i, r, 0, "seats")
                many = [self._item(rng, i, r, 1, "peak_gb"), self._item(rng, i, r, 2, "peak_gb")]
                calls: list[tuple[str, list[Any]]] = [("track", one), ("track_many", [many])]
                for n, (method, params) in enumerate(calls):
                    try:
                        error, result = conn.call(method, *params)
                    except OSError:
                        self.in_doubt[i] = calls[n:]
                        return
                    self._count(method, params, error, result)
                self.sent[i] += 1
        finally:
            conn.close()

    def _count(self, method: str, params: list[Any], error: Any, result: Any) -> None:
        items = [params] if method == "track" else params[0]
        answers = [result] if method == "track" else result
        if error is not None:
            self.errors.append(error)
            return
        with self._lock:
            for item, answer in zip(items, answers, strict=True):
                if isinstance(answer, dict):
                    self.errors.append(answer)
                    continue
                at_ms = round(item[3].get("at", 0) * 1000)
                self.acked.append((item[0], item[1], item[2], at_ms))

    def resend(self, i: int) -> None:
        conn = Conn(self.nodes[i].socket)
        try:
            for method, params in self.in_doubt.pop(i, []):
                self._count(method, params, *conn.call(method, *params))
        finally:
            conn.close()

    def want(self, tenant: str) -> dict[str, int]:
        """What every node and storage must hold of ``tenant``: the largest ``peak_gb`` and
        the latest ``seats``."""
        peaks = [v for t, f, v, _ in self.acked if t == tenant and f == "peak_gb"]
        seats = [(at, v) for t, f, v, at in self.acked if t == tenant and f == "seats"]
        return {"peak_gb": max(peaks), "seats": max(seats)[1]}

    def tenants(self) -> list[str]:
        return sorted({t for t, *_ in self.acked})


def views(node: NodeProcess, tenant: str) -> dict[str, int]:
    return {f: node.call("usage", tenant, f) for f in ("peak_gb", "seats")}


def agree(nodes: list[NodeProcess], load: GaugeLoad) -> bool:
    return all(views(p, t) == load.want(t) for t in load.tenants() for p in nodes)


def all_stored(node: NodeProcess, load: GaugeLoad) -> bool:
    return all(stored(node, t) == load.want(t) for t in load.tenants())


def stored(node: NodeProcess, tenant: str) -> dict[str, int]:
    """The tenant's gauges in storage (the ``export`` method)."""
    out: dict[str, int] = {}
    cursor = None
    while True:
        opts: dict[str, str] = {} if cursor is None else {"cursor": cursor}
        page = node.call("export", period_start("month"), opts)
        for row in page["rows"]:
            if row[0] == tenant and row[1] in ("peak_gb", "seats"):
                out[row[1]] = int(row[3])
        cursor = page["cursor"]
        if cursor is None:
            return out


def test_every_node_and_storage_hold_the_largest_and_the_latest(nodes: list[NodeProcess]) -> None:
    load = GaugeLoad(nodes, "conv", rounds=40).start()
    load.join()
    assert not load.errors, load.errors[:3]
    assert load.tenants() == ["conv"]
    wait_until(lambda: agree(nodes, load), 20, "views agree", nodes)
    wait_until(lambda: all_stored(nodes[0], load), 20, "storage holds them", nodes)


def test_a_node_killed_mid_load_loses_no_acknowledged_observation(
    nodes: list[NodeProcess],
) -> None:
    """Each node observes its own tenant, so n2's largest and latest are its last
    acknowledged observations: those the log gives back after the kill."""
    load = GaugeLoad(nodes, "kill", rounds=300, shared=False).start()
    wait_until(lambda: load.sent[2] >= 20, 30, "n2 has answered 20 rounds", nodes)
    nodes[2].kill()
    load.join()
    nodes[2].start(timeout=60)
    load.resend(2)
    assert not load.errors, load.errors[:3]
    assert len(load.tenants()) == 3
    wait_until(lambda: all_stored(nodes[0], load), 30, "storage holds them", nodes)
    wait_until(lambda: agree(nodes, load), 30, "views agree", nodes)
