"""Dimensions across a fleet (docs/dimensions.md): 3 real nodes on one redis-server and one
DynamoDB Local table. Calls with dimensions from every node converge to the same groups on
every node, and those groups add up to the total; what storage holds after the flushes is
the same; a node killed with ``kill -9`` mid-load and restarted from its data dir loses and
doubles nothing (its unanswered calls sent again under their ids); strict limits on a total
and on one dimension value admit exactly their limit (G01, G04 and G05 of docs/correctness.md)."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest

from meter.core.keys import period_start
from tests.support.cluster_harness import Conn, Fleet, NodeThreads, until_refused, wait_until
from tests.support.nodes import NodeProcess

pytestmark = [pytest.mark.slow, pytest.mark.dynamodb, pytest.mark.redis]

MODELS = ["gpt-4", "o1", "mini"]
REGIONS = ["eu", "us"]


@pytest.fixture(scope="module")
def nodes(module_fleet: Fleet) -> list[NodeProcess]:
    nodes = module_fleet(3)
    version = nodes[0].call(
        "set_feature", "tokens", {"dimensions": ["model", "region"], "max_combinations": 100}
    )["version"]
    wait_until(
        lambda: all(p.call("get_feature", "tokens")["version"] >= version for p in nodes),
        5,
        "every node holds the declaration",
        nodes,
    )
    return nodes


def dims_of(rng: random.Random) -> dict[str, str]:
    """A call's dimensions: both, one, or none of them."""
    shape = rng.randrange(4)
    out = {}
    if shape in (0, 1):
        out["model"] = rng.choice(MODELS)
    if shape in (0, 2):
        out["region"] = rng.choice(REGIONS)
    return out


class DimLoad(NodeThreads):
    """One thread per node sending ``track_many`` batches with dimensions and request ids;
    what was acknowledged, by dimensions. A batch whose answer never came (its node died) is
    kept to be sent again under the same ids (:meth:`resend`)."""

    def __init__(
        self, nodes: list[NodeProcess], tenant: str, batches: int, without_ids: int = -1
    ) -> None:
        """``without_ids``: the node whose calls carry no request ids (the paths that count
        known dimensions at once); its unanswered batch is kept in :attr:`maybe`."""
        super().__init__(nodes)
        self.tenant = tenant
        self.batches = batches
        self.without_ids = without_ids
        self.maybe: list[list[Any]] = []
        self.acked: dict[tuple[tuple[str, str], ...], int] = {}
        self.in_doubt: dict[int, list[list[Any]]] = {}
        self.errors: list[Any] = []
        self.sent = [0] * len(nodes)
        self._lock = threading.Lock()

    def _run(self, i: int) -> None:
        rng = random.Random(i)
        conn = Conn(self.nodes[i].socket, timeout=10)
        try:
            for b in range(self.batches):
                items: list[list[Any]] = []
                for j in range(20):
                    opts: dict[str, Any] = {"dims": dims_of(rng)}
                    if i != self.without_ids:
                        opts["id"] = f"{self.tenant}-{self.nodes[i].name}-{b}-{j}"
                    items.append([self.tenant, "tokens", rng.randint(1, 5), opts])
                try:
                    error, result = conn.call("track_many", items)
                except OSError:
                    if i == self.without_ids:  # (counted all or none: C11)
                        self.maybe = items
                    else:
                        self.in_doubt[i] = items
                    return
                self._count(items, error, result)
                self.sent[i] += 1
        finally:
            conn.close()

    def _count(self, items: list[list[Any]], error: Any, result: Any) -> None:
        if error is not None:
            self.errors.append(error)
            return
        with self._lock:
            for item, answer in zip(items, result, strict=True):
                if isinstance(answer, dict):
                    self.errors.append(answer)
                    continue
                key = tuple(sorted(item[3]["dims"].items()))
                self.acked[key] = self.acked.get(key, 0) + item[2]

    def resend(self, i: int) -> None:
        items = self.in_doubt.pop(i, None)
        if items is not None:
            conn = Conn(self.nodes[i].socket)
            try:
                self._count(items, *conn.call("track_many", items))
            finally:
                conn.close()

    def want(self, by: tuple[str, ...]) -> tuple[int, dict[tuple[Any, ...], int]]:
        """The total and the groups by ``by`` that the acknowledged calls make."""
        groups: dict[tuple[Any, ...], int] = {}
        for key, qty in self.acked.items():
            given = dict(key)
            at = tuple(given.get(n) for n in by)
            groups[at] = groups.get(at, 0) + qty
        return sum(self.acked.values()), {k: v for k, v in groups.items() if v}


def grouped(node: NodeProcess, tenant: str, by: tuple[str, ...]) -> tuple[int, dict[Any, int]]:
    got = node.call("usage", tenant, "tokens", {"group_by": list(by)})
    groups = {tuple(g["dims"][n] for n in by): g["value"] for g in got["groups"]}
    assert sum(groups.values()) == got["total"], got  # groups add up to the total, always
    return got["total"], groups


def converged(nodes: list[NodeProcess], load: DimLoad) -> bool:
    for by in [("model",), ("region",), ("model", "region")]:
        want = load.want(by)
        if any(grouped(p, load.tenant, by) != want for p in nodes):
            return False
    return True


def stored(node: NodeProcess, tenant: str) -> dict[tuple[tuple[str, str], ...], int]:
    """The tenant's tokens counters in storage (the ``export`` method), by dimensions."""
    out: dict[tuple[tuple[str, str], ...], int] = {}
    cursor = None
    while True:
        opts: dict[str, str] = {} if cursor is None else {"cursor": cursor}
        page = node.call("export", period_start("month"), opts)
        for row in page["rows"]:
            if row[0] == tenant and row[1] == "tokens":
                out[tuple(sorted(row[4].items())) if len(row) == 5 else ()] = int(row[3])
        cursor = page["cursor"]
        if cursor is None:
            return out


def stored_want(load: DimLoad) -> dict[tuple[tuple[str, str], ...], int]:
    """What storage must hold: the total, each value's counter, each combination of two."""
    out: dict[tuple[tuple[str, str], ...], int] = {(): sum(load.acked.values())}
    for key, qty in load.acked.items():
        for pair in key:
            out[(pair,)] = out.get((pair,), 0) + qty
        if len(key) > 1:
            out[key] = out.get(key, 0) + qty
    return out


def test_groups_converge_on_every_node_and_in_storage(nodes: list[NodeProcess]) -> None:
    load = DimLoad(nodes, "conv", batches=30).start()
    load.join()
    assert not load.errors, load.errors[:3]
    wait_until(lambda: converged(nodes, load), 20, "every node's groups are the acked", nodes)
    wait_until(lambda: stored(nodes[0], "conv") == stored_want(load), 20, "storage holds them")


def test_a_node_killed_mid_load_loses_and_doubles_nothing(nodes: list[NodeProcess]) -> None:
    """n2 is killed mid-load; its calls carry no ids (its batches of known dimensions are
    counted summed, logged, and replayed after the kill): its unanswered batch was counted
    all or none, and the rest exactly once."""
    load = DimLoad(nodes, "kill", batches=400, without_ids=2).start()
    wait_until(lambda: load.sent[2] >= 20, 30, "n2 has answered 20 batches", nodes)
    nodes[2].kill()
    load.join()
    nodes[2].start(timeout=60)
    load.resend(2)
    assert not load.errors, load.errors[:3]
    acked = sum(load.acked.values())
    total = wait_until_value(lambda: nodes[0].call("usage", "kill", "tokens"), nodes)
    if total != acked:  # the unanswered batch was counted: all of it
        assert load.maybe and total == acked + sum(item[2] for item in load.maybe), total
        load._count(load.maybe, None, [0] * len(load.maybe))
    wait_until(lambda: converged(nodes, load), 30, "every node's groups are the acked", nodes)
    wait_until(lambda: stored(nodes[0], "kill") == stored_want(load), 30, "storage holds them")


def wait_until_value(read: Any, nodes: list[NodeProcess], quiet_s: float = 2.0) -> int:
    """``read()`` once it has not moved for ``quiet_s`` (the views settled)."""
    last, since = read(), time.monotonic()
    deadline = since + 30
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = read()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return int(last)
    raise AssertionError(f"the value kept moving: {last}")


def burst(nodes: list[NodeProcess], tenant: str, dims: list[dict[str, str]]) -> int:
    """Calls of 1 unit from 4 connections per node, cycling through ``dims``, until each is
    refused for the limit; the units acknowledged."""

    def request(n: int) -> tuple[str, list[Any]]:
        return "track", [tenant, "tokens", 1, {"dims": dims[n % len(dims)]}]

    return sum(until_refused(nodes, request, "limit_exceeded"))


def _limit(nodes: list[NodeProcess], tenant: str, spec: dict[str, Any]) -> None:
    version = nodes[0].call("set_limit", tenant, "tokens", spec)["version"]
    wait_until(
        lambda: all(p.call("limits", tenant)["version"] >= version for p in nodes),
        5,
        "every node holds the limit",
        nodes,
    )


def test_strict_limits_on_a_total_and_on_one_value_admit_exactly_their_limit(
    nodes: list[NodeProcess],
) -> None:
    _limit(nodes, "lim1", {"limit": 300, "enforcement": "strict", "where": {"model": "gpt-4"}})
    gpt4 = [{"model": "gpt-4", "region": r} for r in REGIONS] + [{"model": "gpt-4"}]
    assert burst(nodes, "lim1", gpt4) == 300
    # Other models are not limited by it.
    nodes[1].call("track", "lim1", "tokens", 7, {"dims": {"model": "o1"}})
    _limit(nodes, "lim2", {"limit": 400, "enforcement": "strict"})
    mixed = [{"model": m} for m in MODELS] + [{"region": "eu"}, {}]
    assert burst(nodes, "lim2", mixed) == 400

    def exact() -> bool:
        for p in nodes:
            t1, g1 = grouped(p, "lim1", ("model",))
            t2, _ = grouped(p, "lim2", ("model",))
            if (t1, g1) != (307, {("gpt-4",): 300, ("o1",): 7}) or t2 != 400:
                return False
        return True

    wait_until(exact, 15, "every node sees exactly the limits admitted", nodes)


def test_voids_of_a_track_an_item_and_a_commit_reach_every_node_and_storage(
    nodes: list[NodeProcess],
) -> None:
    """A ``track`` with dimensions, one ``track_many`` item and a ``commit`` with dimensions,
    voided on the node that counted them (a retried void once): every node's view and groups
    drop exactly their units within the gossip's reach, and storage keeps only the rest; a
    node that does not remember an id answers ``not_found``."""
    n0, tenant = nodes[0], "voided"
    bys = [("model",), ("region",), ("model", "region")]
    n0.call("track", tenant, "tokens", 5, {"id": "vt", "dims": {"model": "o1", "region": "eu"}})
    items = [[tenant, "tokens", 7, {"id": "vm1"}], [tenant, "tokens", 11, {"id": "vm2"}]]
    assert n0.call("track_many", items) == [12, 23]
    lease = n0.call("reserve", tenant, "tokens", 20, {"dims": {"model": "mini"}})
    assert n0.call("commit", lease, 13, {"id": "vc"}) == 36

    def agree(total: int) -> bool:
        want = [grouped(n0, tenant, by) for by in bys]
        return want[0][0] == total and all(
            [grouped(p, tenant, by) for by in bys] == want for p in nodes
        )

    wait_until(lambda: agree(36), 20, "every node sees the calls", nodes)
    assert n0.call("void", "vt") == {"voided": 5, "value": 31}
    assert n0.call("void", "vm2") == {"voided": 11, "value": 20}
    for _ in range(2):  # (a retry answers as the first and takes back nothing more)
        assert n0.call("void", "vc", {"id": "v-vc"}) == {"voided": 13, "value": 7}
    with pytest.raises(AssertionError, match="not_found"):
        nodes[1].call("void", "vm1")
    wait_until(lambda: agree(7), 20, "every node sees the voids", nodes)
    by_model = grouped(n0, tenant, ("model",))[1]
    assert by_model.get(("o1",), 0) == by_model.get(("mini",), 0) == 0, by_model

    def rest() -> dict[tuple[tuple[str, str], ...], int]:
        return {k: v for k, v in stored(n0, tenant).items() if v}

    wait_until(lambda: rest() == {(): 7}, 20, "storage keeps only the rest", nodes)
