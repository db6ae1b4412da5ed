"""``balance`` tells what the tenant can spend, through a real node process: the credits a
pool funding moved out of the ledger still count, less what was spent, and a funding moves
a chunk sized by the recent spend, not the whole balance (docs/ledger.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.support.nodes import ROOT, NodeProcess, raw_call, wait_for


def test_balance_counts_the_pools_unspent_credits(workdir: Path) -> None:
    with NodeProcess(workdir) as node:
        node.call("set_plan", "pro", {"gpu": {"price": 1}})
        node.call("assign_plan", "acme", "pro")
        node.call("grant", "acme", 10_000)
        wait_for(lambda: "gpu" in node.call("limits", "acme")["limits"], what="the plan")
        for _ in range(100):
            node.call("track", "acme", "gpu", 1)
        balance = node.call("balance", "acme")
        assert balance["available"] == 9_900
        # The first funding moved a chunk (1,000), not the whole balance.
        funded = balance["pool"]["funded"]
        assert balance["pool"] == {
            "funded": 1_000, "unspent": 900, "held_elsewhere": 0, "in_flight": 0
        }  # fmt: skip
        assert balance["ledger_available"] == 9_000
        # meter balance says where the credits are.
        env = {**os.environ, "METER_SOCKET": str(node.socket), "PYTHONPATH": str(ROOT)}
        out = subprocess.run(
            [sys.executable, "-m", "meter", "balance", "acme"],
            env=env, capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
        ledger = balance["ledger_available"]
        assert out.startswith(
            f"acme: 9900 available ({ledger} in the ledger, {funded - 100} unspent in the pool)"
        ), out
        # What it says can be spent, can: 9,900 more units, then insufficient_balance.
        for qty in (1000, 100, 1):
            while raw_call(node.socket, "track", "acme", "gpu", qty)[0] is None:
                pass
        assert node.call("usage", "acme", "gpu") == 10_000
        assert node.call("balance", "acme")["available"] == 0


def test_an_idle_pool_gives_its_unspent_credits_back_to_the_grants_they_came_from(
    workdir: Path,
) -> None:
    """``balance`` shows each grant's part of the pool; once the pool is idle (its shares
    given back a lease after the last priced call) its unspent credits go back to the ledger,
    once, onto the grants they came from, and those of a grant past its expiry expire."""
    # (A lease of 3 s: the pool is idle 3-4 s after the last priced call, long after the
    # reads of "before" below, which follow it at once.)
    with NodeProcess(workdir, METER_STRICT_LEASE_MS="3000") as node:
        node.call("set_plan", "pro", {"gpu": {"price": 1}})
        node.call("assign_plan", "acme", "pro")
        node.call("assign_plan", "beta", "pro")
        node.call("grant", "acme", 10_000, {"ref": "a1"})
        expires = int(time.time()) + 5
        node.call("grant", "beta", 1_000, {"ref": "b1"})
        node.call("grant", "beta", 500, {"ref": "b2", "priority": 5, "expires_at": expires})
        wait_for(lambda: "gpu" in node.call("limits", "beta")["limits"], what="the plan")
        for tenant in ("acme", "beta"):
            for _ in range(100):
                node.call("track", tenant, "gpu", 1)
        # Before: a funding of 1,000 took beta's grant 2 (priority 5) first, then grant 1;
        # the pool spends in that order, so its 900 unspent are grant 1's 500 and grant 2's 400.
        got = node.call("balance", "beta")
        assert got["available"] == 1_400 and got["pool"]["unspent"] == 900
        assert [(g["seq"], g["remaining"], g["pooled"], g["in_pool"]) for g in got["grants"]] == [
            (2, 0, 500, 400),
            (1, 500, 500, 500),
        ]
        got = node.call("balance", "acme")
        assert [(g["remaining"], g["pooled"], g["in_pool"]) for g in got["grants"]] == [
            (9_000, 1_000, 900)
        ]
        env = {**os.environ, "METER_SOCKET": str(node.socket), "PYTHONPATH": str(ROOT)}
        out = subprocess.run(
            [sys.executable, "-m", "meter", "balance", "beta"],
            env=env, capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
        assert out.splitlines()[1].split() == [
            "GRANT", "REMAINING", "IN_POOL", "PRIORITY", "EXPIRES_AT"
        ]  # fmt: skip
        assert out.splitlines()[2].split() == ["2", "0", "400", "5", str(expires)]
        # Idle: the 900 go back to acme's ledger, once; the pool keeps what was spent.
        wait_for(
            lambda: node.call("balance", "acme")["ledger_available"] == 9_900,
            what="acme's unspent pool credits back in the ledger",
        )
        got = node.call("balance", "acme")
        assert got["available"] == 9_900 and got["pool"]["funded"] == 100
        # (the 100 the pool spent are let go: the grant keeps nothing in the pool)
        assert [(g["remaining"], g["pooled"], g["in_pool"]) for g in got["grants"]] == [
            (9_900, 0, 0)
        ]
        entries = node.call("ledger", "acme")["entries"]
        back = [e for e in entries if e["kind"] == "unpooled"]
        assert [(e["amount"], e["grants"]) for e in back] == [(900, [[1, 900]])]
        # beta's grant 2 expires with the 400 of it the pool had not spent, whether they
        # came back before its expiry or after: 1,500 granted - 100 spent - 400 expired.
        wait_for(lambda: time.time() >= expires + 0.1, what="grant 2's expiry")
        wait_for(
            lambda: node.call("balance", "beta")["pool"]["funded"] == 100,
            what="beta's unspent pool credits back in the ledger",
        )
        got = node.call("balance", "beta")
        assert got["available"] == got["ledger_available"] == 1_000
        # Grant 2 is closed: nothing of it is left in the ledger or the pool.
        assert [(g["seq"], g["remaining"], g["pooled"]) for g in got["grants"]] == [(1, 1_000, 0)]
        entries = node.call("ledger", "beta")["entries"]
        assert -sum(e["amount"] for e in entries if e["kind"] == "expire") == 400
        # And the credits back in the ledger are spent again through a new funding.
        for _ in range(10):
            node.call("track", "acme", "gpu", 1)
        assert node.call("balance", "acme")["available"] == 9_890


def test_a_pool_in_use_expires_the_credits_of_a_grant_past_its_expiry(workdir: Path) -> None:
    """While priced calls go on, the upkeep pass after a grant's expiry gives back the node's
    share and the pool's credits of the grant, and they expire there: the tenant can no
    longer spend any of them. Nothing is lost or counted twice (every credit is spent,
    expired, or available)."""
    lease_s = 3.0
    with NodeProcess(workdir, METER_STRICT_LEASE_MS=str(int(lease_s * 1000))) as node:
        node.call("set_plan", "pro", {"gpu": {"price": 1}})
        node.call("assign_plan", "acme", "pro")
        node.call("grant", "acme", 1_000, {"ref": "a1"})
        expires = int(time.time()) + 3
        node.call("grant", "acme", 500, {"ref": "a2", "priority": 5, "expires_at": expires})
        wait_for(lambda: "gpu" in node.call("limits", "acme")["limits"], what="the plan")
        spent = 0

        def track() -> None:
            nonlocal spent
            node.call("track", "acme", "gpu", 1)
            spent += 1

        for _ in range(20):
            track()
        got = node.call("balance", "acme")
        in_pool = {g["seq"]: g["in_pool"] for g in got["grants"]}
        # The funding took grant 2 first (priority 5), all of it: none is left in the ledger.
        assert in_pool[2] > 0 and got["grants"][0]["remaining"] == 0

        def expired_entries() -> list[dict[str, Any]]:
            track()  # (the pool stays in use: a priced call every 10 ms or so)
            entries = node.call("ledger", "acme")["entries"]
            return [e for e in entries if e["kind"] == "expire"]

        gone = wait_for(expired_entries, timeout=3 * lease_s, what="grant 2's credits expired")
        # In the first upkeep pass after the expiry (a pass every third of a lease; one
        # more for a loaded machine), while the pool was in use.
        assert gone[0]["time"] <= expires + 2 * lease_s / 3, (gone, expires)
        entries = node.call("ledger", "acme")["entries"]
        back = [e for e in entries if e["kind"] == "unpooled"]
        at_expiry = -gone[0]["amount"]
        assert dict(back[0]["grants"]).get(2) == at_expiry == gone[0]["grants"][0][1]
        # All that was left of grant 2 expired there (the pool spends it first, so the
        # calls before spent the rest of its 500): it closes, and no call spends it after.
        got = node.call("balance", "acme")
        assert [g["seq"] for g in got["grants"]] == [1]
        for _ in range(20):
            track()
        got = node.call("balance", "acme")
        assert got["available"] == 1_500 - spent - at_expiry
        # Idle: the rest comes back, all grant 1's; nothing more expires.
        wait_for(
            lambda: node.call("balance", "acme")["pool"]["funded"] == spent,
            timeout=4 * lease_s,
            what="the idle pool's credits back in the ledger",
        )
        entries = node.call("ledger", "acme")["entries"]
        assert [-e["amount"] for e in entries if e["kind"] == "expire"] == [at_expiry]
        got = node.call("balance", "acme")
        assert got["available"] == 1_500 - spent - at_expiry
        assert [g["seq"] for g in got["grants"]] == [1]
        assert node.call("usage", "acme", "gpu") == spent
