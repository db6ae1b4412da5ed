"""``balance`` tells what the tenant can spend, through a real node process: the credits a
pool funding moved out of the ledger still count, less what was spent, and a funding moves
a chunk sized by the recent spend, not the whole balance (docs/ledger.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
