"""``void`` on real node processes (correctness V02, V04, V05): a void retried 10 times, with
the node killed (``kill -9``) right after some of the attempts are sent, takes back once, the
credits its call spent included, a unique value included; the units taken back reach storage,
the voided values leave the export; the CLI's ``meter void``."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from meter.core.keys import period_start
from tests.support.nodes import ROOT, NodeProcess, short_tmpdir, wait_for
from tests.test_node_process import cli

MONTH = period_start("month")

FLUSH = {"METER_FLUSH_INTERVAL_MS": "50"}


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = short_tmpdir("voidn-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def send_only(sock: Path, method: str, *params: object) -> None:
    """Write one request and wait for nothing (the node may die before it answers)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(sock))
        s.sendall(msgpack.packb([0, 1, method, list(params)]))


def test_a_void_retried_across_kill_9s_takes_back_once_and_reaches_storage(
    workdir: Path,
) -> None:
    node = NodeProcess(
        workdir, METER_TENANT_HIERARCHY="true", METER_DURABILITY="fsync", **FLUSH
    ).start()
    node.call("set_feature", "tokens", {"dimensions": ["model"]})
    calls = {f"t{i}": 1 + i % 7 for i in range(30)}
    for rid, qty in calls.items():
        node.call("track", "acme/bob", "tokens", qty, {"id": rid, "dims": {"model": "a"}})
    total = sum(calls.values())
    # A priced feature: 3 credits a unit from bob's pool, 1 from acme's.
    for tenant, price in (("acme", 1), ("acme/bob", 3)):
        node.call("grant", tenant, 1000)
        node.call("set_limit", tenant, "gpu", {"price": price})
    paid = {f"g{i}": 1 + i for i in range(5)}
    for rid, qty in paid.items():
        node.call("track", "acme/bob", "gpu", qty, {"id": rid})
    calls.update(paid)
    # A unique feature: a voided value stays claimed, and storage marks it voided.
    node.call("set_feature", "seats", {"aggregation": "unique"})
    for i in range(6):
        assert (
            node.call("track", "acme/bob", "seats", 1, {"value": f"s{i}", "id": f"s{i}"}) == i + 1
        )
    calls["s1"] = 1
    for rid in ("t3", "t11", "t20", "g1", "g4", "s1"):
        answers = []
        for attempt in range(10):
            # Sent, then the node killed before or after it lands: the first attempt too, so
            # a void whose first try never answered is applied (or found applied) by a retry.
            if attempt in (0, 4, 7):
                send_only(node.socket, "void", rid, {"id": f"v-{rid}"})
                node.kill()
                node.start()
                continue
            answers.append(node.call("void", rid, {"id": f"v-{rid}"}))
        assert all(a == answers[0] for a in answers), answers
        assert answers[0]["voided"] == calls[rid], answers
        if rid in paid:
            assert answers[0]["credits"] == 4 * paid[rid], answers
    assert node.call("void", "s4") == {"voided": 1, "value": 4}
    assert node.call("track", "acme/bob", "seats", 1, {"value": "s4"}) == 4  # (claimed still)
    seats = ["s0", "s2", "s3", "s5"]
    voided = ["t3", "t11", "t20"]
    left = total - sum(calls[r] for r in voided)
    spent = sum(paid.values()) - paid["g1"] - paid["g4"]
    assert node.call("usage", "acme/bob", "gpu") == spent
    assert node.call("balance", "acme/bob")["available"] == 1000 - 3 * spent
    assert node.call("balance", "acme")["available"] == 1000 - spent
    assert node.call("usage", "acme/bob", "tokens") == left
    assert node.call("usage", "acme", "tokens") == left
    got = node.call("usage", "acme", "tokens", {"group_by": ["model"]})
    assert got["groups"] == [{"dims": {"model": "a"}, "value": left}], got
    # Stored: a node without a log, on the first node's SQLite file, reads every level.
    node.stop()
    sqlite_file = str(node.data_dir / "counters.sqlite3")
    fresh = NodeProcess(
        workdir, "fresh", METER_DURABILITY="off", METER_SQLITE_FILE=sqlite_file
    ).start()
    try:
        for tenant in ("acme/bob", "acme"):
            assert fresh.call("usage", tenant, "tokens") == left, tenant
            assert fresh.call("usage", tenant, "seats") == len(seats), tenant
    finally:
        fresh.stop()
    # The values an invoice reads leave the voided ones out (marked by the node's loop, the
    # last after a kill -9 from the log).
    got = cli("export", "--period", MONTH, "--values", env={"METER_SQLITE_FILE": sqlite_file})
    assert got.returncode == 0, got.stderr
    rows = sorted(line.split(",")[3] for line in got.stdout.splitlines()[1:])
    assert rows == sorted(seats * 2), got.stdout  # (both levels)
    # Once more on the first node's own log: the voids are remembered, nothing moves.
    node.start()
    try:
        for rid in voided:
            again = node.call("void", rid)
            assert again == {"voided": 0, "value": left}, again
        assert node.call("usage", "acme", "tokens") == left
    finally:
        node.stop()


def test_the_cli_voids_a_call(workdir: Path) -> None:
    with NodeProcess(workdir) as node:
        node.call("track", "acme", "api", 9, {"id": "call-1"})
        node.call("track", "acme", "api", 1)
        env = {"METER_SOCKET": str(node.socket), "PYTHONPATH": str(ROOT)}

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "meter", *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )

        done = cli("void", "call-1", "--id", "v1", "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"call_id": "call-1", "voided": 9, "value": 1}
        again = cli("void", "call-1")
        assert again.returncode == 0 and again.stdout.strip() == "voided 0, total 1", again
        node.call("grant", "acme", 100)
        node.call("set_limit", "acme", "gpu", {"price": 4})
        node.call("track", "acme", "gpu", 5, {"id": "paid"})
        paid = cli("void", "paid")
        assert paid.stdout.strip() == "voided 5, total 0, 20 credits given back", paid
        assert node.call("balance", "acme")["available"] == 100
        missing = cli("void", "nope")
        assert missing.returncode != 0 and "not_found" in missing.stderr, missing
        wait_for(lambda: node.call("usage", "acme", "api") == 1, what="the total")
