"""Strict limits across a fleet (ADR 0009): real node processes on one redis-server and one
DynamoDB Local table, bursts from many connections per node, and a node killed mid-burst.

The figures asserted are the ones docs/quotas.md promises: a strict limit admits exactly the
limit (Q13); with a node ``kill -9``'d mid-burst at most the limit, and after the dead node's
lease ends everything but the part of its share it had promised (its cap, less what it used)
is admitted again (Q14); the restarted node stores what it had acknowledged, and the stored
total never passes the limit.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from meter.quotas.escrow import Budget
from meter.quotas.shares import decode
from storage.dynamodb import DynamoDBStorage
from tests.support.cluster_harness import Conn, Fleet, wait_until
from tests.support.nodes import NodeProcess

pytestmark = [pytest.mark.slow, pytest.mark.dynamodb, pytest.mark.redis]


class Burst:
    """``clients`` connections per node, each tracking ``qty`` until its node refuses (or dies);
    counts the units each node acknowledged."""

    def __init__(self, nodes: list[NodeProcess], clients: int, tenant: str, feature: str) -> None:
        self.nodes = nodes
        self.tenant, self.feature = tenant, feature
        self.acked = [0] * len(nodes)
        self.errors: list[Any] = []
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True)
            for i in range(len(nodes))
            for _ in range(clients)
        ]

    def start(self) -> Burst:
        for t in self.threads:
            t.start()
        return self

    def join(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a burst did not finish"

    @property
    def total(self) -> int:
        return sum(self.acked)

    def _run(self, i: int) -> None:
        try:
            conn = Conn(self.nodes[i].socket)
        except OSError:
            return  # the node is gone
        try:
            while True:
                try:
                    error, _ = conn.call("track", self.tenant, self.feature, 1)
                except (OSError, ConnectionError):
                    return  # killed
                if error is None:
                    with self._lock:
                        self.acked[i] += 1
                elif error["code"] == "limit_exceeded":
                    return
                elif error["code"] != "unavailable":  # contention: the client retries
                    self.errors.append(error)
                    return
        finally:
            conn.close()


def _budget(endpoint: str, table: str, key: tuple[str, str, str]) -> Budget | None:
    async def read() -> Budget | None:
        storage = DynamoDBStorage(table, endpoint_url=endpoint)
        await storage.open()
        try:
            item = await storage.budget_read(key)
        finally:
            await storage.close()
        return decode(item)

    return asyncio.run(read())


def _period() -> str:
    return time.strftime("%Y-%m", time.gmtime())


def _set_strict(nodes: list[NodeProcess], tenant: str, feature: str, limit: int) -> None:
    version = nodes[0].call(
        "set_limit", tenant, feature, {"limit": limit, "enforcement": "strict"}
    )["version"]
    wait_until(
        lambda: all(p.call("limits", tenant)["version"] >= version for p in nodes),
        5,
        "every node holds the strict limit",
        nodes,
    )


def test_a_strict_limit_admits_exactly_the_limit_under_a_burst_from_four_nodes(
    fleet: Fleet,
    dynamodb_local: str,
    dynamodb_table: str,
) -> None:
    nodes = fleet(4)
    runs = []
    for run in range(3):  # repeated: a race that loses a unit now and then would show
        feature = f"api{run}"
        _set_strict(nodes, "acme", feature, 1000)
        burst = Burst(nodes, 8, "acme", feature).start()
        burst.join()
        assert not burst.errors, burst.errors[:3]
        runs.append(burst.acked)
        assert burst.total == 1000, burst.acked
        # Every view converges on what was admitted (gossip), and refused calls counted
        # nothing anywhere.

        def converged(f: str = feature) -> bool:
            return all(p.call("usage", "acme", f) == 1000 for p in nodes)

        wait_until(converged, 10, "every node sees 1000", nodes)
    writes = sum(p.call("status")["limits"]["strict"]["writes"] for p in nodes)
    print(f"\nstrict 1000, 4 nodes x 8 clients: admitted per node {runs}; {writes} budget writes")
    budget = _budget(dynamodb_local, dynamodb_table, ("acme", "api0", _period()))
    assert budget is not None and budget.granted <= 1000


def test_near_a_strict_limit_nodes_admit_onto_the_record_instead_of_racing(fleet: Fleet) -> None:
    """Q18 through real nodes: a burst of 3 nodes x 4 clients to a strict limit of 300 (near
    it from the start) admits exactly 300 with writes that add onto the budget record, a
    write per several calls, and few lost races (compare-and-swap alone lost more than half
    its writes here: 62 of 113)."""
    nodes = fleet(3)
    _set_strict(nodes, "acme", "near", 300)
    before = [p.call("status")["limits"]["strict"] for p in nodes]
    burst = Burst(nodes, 4, "acme", "near").start()
    burst.join()
    assert not burst.errors, burst.errors[:3]
    assert burst.total == 300, burst.acked
    after = [p.call("status")["limits"]["strict"] for p in nodes]
    got = {
        k: sum(a[k] - b[k] for a, b in zip(after, before, strict=True))
        for k in ("writes", "direct_writes", "conflicts")
    }
    assert got["direct_writes"] >= 1, got
    assert got["writes"] <= 300 // 4, got  # (a write per call would be 300)
    # Fewer than half the writes lose a race (compare-and-swap alone lost more than half);
    # how many fewer depends on the machine's load (5 of 18 under a full suite's).
    assert got["conflicts"] * 2 < got["writes"], got
    print(f"\nstrict 300, 3 nodes x 4 clients: {burst.acked} admitted; {got}")


def test_a_node_killed_mid_burst_never_lets_the_fleet_pass_the_limit(
    fleet: Fleet,
    dynamodb_local: str,
    dynamodb_table: str,
) -> None:
    # Long enough that the burst after the kill ends within the dead node's lease (and
    # grace) on a loaded machine: the take-back checked below is then the first one. (The
    # burst took up to 8 s here with the machine loaded: 1.5 s and 5 s leases were too short.)
    lease_ms = 10_000
    # Far enough from the limit when the node is killed that its share is a grant with a cap
    # below it (near the limit a node admits onto the record, all promised: ADR 0014).
    limit = 4000
    nodes = fleet(4, METER_STRICT_LEASE_MS=str(lease_ms), METER_STRICT_SHARE_MAX="100")
    key = ("acme", "api", _period())
    _set_strict(nodes, "acme", "api", limit)
    burst = Burst(nodes, 8, "acme", "api").start()
    wait_until(lambda: burst.total >= 300, 30, "300 units admitted", nodes, step=0.01)
    victim = nodes[3]
    victim.kill()
    burst.join()
    assert not burst.errors, burst.errors[:3]
    first = burst.total
    assert first <= limit, burst.acked
    dead = _budget(dynamodb_local, dynamodb_table, key)
    assert dead is not None
    share = dead.shares.get("n3")
    if share is None:
        # Killed before its first grant landed: it promised nothing, so admitted nothing.
        assert burst.acked[3] == 0, burst.acked
    else:
        # The dead node promised at most its cap; what it acknowledged is within it.
        assert burst.acked[3] <= share.c <= share.g
        # After its lease (and the grace for clocks), the survivors take back what it never
        # promised and admit it: everything but its unused promise is reachable again.
        lease_end = share.t + lease_ms / 2 + 50
        wait_until(
            lambda: time.time() * 1000 > lease_end, 30, "the dead node's lease has ended", nodes[:3]
        )
    promised = 0 if share is None else share.c
    again = Burst(nodes[:3], 4, "acme", "api").start()
    again.join()
    assert not again.errors, again.errors[:3]
    total = first + again.total
    after = _budget(dynamodb_local, dynamodb_table, key)
    assert after is not None
    if share is not None and share.g > share.c:
        moved = after.shares["n3"]
        assert moved.e == share.e + 1 and moved.g == moved.c == share.c  # taken back, not more
        taken_back = sum(p.call("status")["limits"]["strict"]["taken_back"] for p in nodes[:3])
        assert taken_back >= 1
    elif share is not None:  # (admitted onto the record near the limit: all promised)
        assert after.shares["n3"] == share
    assert total <= limit
    # Reachable: only the dead node's promised-and-unused units (<= its cap step) are lost.
    assert total >= limit - (promised - burst.acked[3]), (total, share, burst.acked)
    # The killed node comes back with its log: what it acknowledged is stored, and the
    # stored total never passes the limit.
    victim.start()
    wait_until(
        lambda: all(p.call("usage", "acme", "api") == nodes[0].call("usage", "acme", "api")
                    for p in nodes),
        20,
        "the views agree after the restart",
        nodes,
    )  # fmt: skip
    stored = nodes[0].call("usage", "acme", "api")
    assert total <= stored <= limit, (total, stored)
    print(
        f"\nkill -9 mid-burst: {first} admitted before the lease ended, {again.total} after, "
        f"{stored} stored; the dead share: {share}, acked {burst.acked[3]}"
    )


def test_an_account_and_its_users_under_strict_limits_across_three_nodes(fleet: Fleet) -> None:
    """Account 100, users 60 each, tracked from every node: exactly 100 in all once idle
    shares have gone back, at most 60 per user, and refused calls counted at no level."""
    lease_ms = 1000
    nodes = fleet(3, METER_TENANT_HIERARCHY="true", METER_STRICT_LEASE_MS=str(lease_ms))
    users = ["acme/alice", "acme/bob", "acme/carol"]
    _set_strict(nodes, "acme", "api", 100)
    for user in users:
        _set_strict(nodes, user, "api", 60)
    acked = dict.fromkeys(users, 0)
    rounds = 0
    while True:  # until a round admits nothing: units in other nodes' idle shares come back
        bursts = {u: Burst(nodes, 2, u, "api").start() for u in users}
        for b in bursts.values():
            b.join()
            assert not b.errors, b.errors[:3]
        got = {u: b.total for u, b in bursts.items()}
        for u in users:
            acked[u] += got[u]
        rounds += 1
        if not any(got.values()) or rounds >= 8:
            break
        time.sleep(lease_ms * 1.5 / 1000)  # idle shares are given back after a lease
    assert sum(acked.values()) == 100, (acked, rounds)
    assert all(v <= 60 for v in acked.values()), acked

    def converged() -> bool:
        return all(
            p.call("usage", "acme", "api") == 100
            and [p.call("usage", u, "api") for u in users] == [acked[u] for u in users]
            for p in nodes
        )

    wait_until(converged, 10, "every node sees the account and its users", nodes)
    print(f"\nstrict account 100 / users 60: {acked} in {rounds} rounds")
