"""Credits ledgers across a fleet: three real nodes on one redis-server and one DynamoDB Local
table (docs/ledger.md). Concurrent debits from every node whose sum passes the balance never
overdraw it; every debit sent twice with its ref lands once; the entries sum to the balance;
expiry and spending order hold whichever node writes."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.support.cluster_harness import Conn, Fleet
from tests.support.nodes import NodeProcess

pytestmark = [pytest.mark.slow, pytest.mark.dynamodb, pytest.mark.redis]


@pytest.fixture(scope="module")
def nodes(module_fleet: Fleet) -> list[NodeProcess]:
    """One fleet for the module's tests: each uses tenants of its own (acme, t1)."""
    return module_fleet(3)


def _entries(node: NodeProcess, tenant: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    after = 0
    while True:
        page = node.call("ledger", tenant, {"after": after, "limit": 50})
        out += page["entries"]
        if page["cursor"] is None:
            return out
        after = page["cursor"]


def test_concurrent_debits_from_three_nodes_never_overdraw_and_land_once(
    nodes: list[NodeProcess],
) -> None:
    balance = 1000
    nodes[0].call("grant", "acme", balance, {"ref": "g"})
    # 3 nodes x 4 threads x 40 debits of 1..5: about 1440 asked, more than the 1000 there.
    landed: dict[str, int] = {}
    refused: list[str] = []
    errors: list[Any] = []
    lock = threading.Lock()

    def debits(i: int, t: int) -> None:
        conn = Conn(nodes[i].socket, timeout=30)
        try:
            for n in range(40):
                ref = f"n{i}-t{t}-{n}"
                amount = 1 + (n + t + i) % 5
                answers = [conn.call("debit", "acme", amount, {"ref": ref}) for _ in range(2)]
                (e1, r1), (e2, r2) = answers
                with lock:
                    if e1 is None:
                        assert e2 is None and r2 == r1, (answers, ref)  # sent twice: once
                        landed[ref] = amount
                    elif e1["code"] == "insufficient_balance":
                        refused.append(ref)
                    else:
                        errors.append(e1)
        finally:
            conn.close()

    threads = [threading.Thread(target=debits, args=(i, t)) for i in range(3) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors[:5]
    assert refused, "the debits asked for more than the balance: some must be refused"
    spent = sum(landed.values())
    assert spent <= balance
    # Every node reads the same stored ledger: entries are the landed debits, once each.
    for p in nodes:
        bal = p.call("balance", "acme")
        assert bal["available"] == balance - spent >= 0
        entries = _entries(p, "acme")
        assert sum(e["amount"] for e in entries) == bal["available"]
        debits_seen = {e["ref"]: -e["amount"] for e in entries if e["kind"] == "debit"}
        assert debits_seen == landed
        assert [e["seq"] for e in entries] == list(range(1, len(entries) + 1))
    # What was refused was refused only because the rest did not fit then: at the end the
    # balance is less than the largest amount asked.
    assert balance - spent < 5


def test_expiry_and_spending_order_hold_whichever_node_writes(
    nodes: list[NodeProcess],
) -> None:
    soon = int(time.time()) + 2
    far = int(time.time()) + 3600
    a, b, c = nodes
    a.call("grant", "t1", 10, {"ref": "plain"})
    b.call("grant", "t1", 10, {"ref": "late", "expires_at": far})
    c.call("grant", "t1", 10, {"ref": "soon", "expires_at": soon})
    a.call("grant", "t1", 10, {"ref": "vip", "priority": 9})
    # Priority first, then the earliest expiry, then the never-expiring, oldest first.
    d = b.call("debit", "t1", 15, {"ref": "d1"})
    assert d["grants"] == [[4, 10], [3, 5]]
    d = c.call("debit", "t1", 7, {"ref": "d2"})
    assert d["grants"] == [[3, 5], [2, 2]]
    while time.time() < soon:
        time.sleep(0.05)
    # "soon" was spent before it expired: nothing of it is left to expire.
    assert a.call("balance", "t1")["available"] == 18
    c.call("grant", "t1", 4, {"ref": "soon2", "expires_at": int(time.time()) + 1})
    time.sleep(1.1)
    for p in nodes:
        assert p.call("balance", "t1")["available"] == 18
    entries = _entries(b, "t1")
    expired = [e for e in entries if e["kind"] == "expire"]
    assert [(e["amount"], e["grants"]) for e in expired] == [(-4, [[7, 4]])]  # once
    assert sum(e["amount"] for e in entries) == 18
