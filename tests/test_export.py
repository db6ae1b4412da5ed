"""Usage export for invoicing: the ``export`` method through a real node, and ``meter export``
(the CLI, reading storage with the node's configuration) end to end on SQLite.

The storage side (every backend, paging, the period filter, bad cursors) is in
``test_storage_contract.py``; 100,000 counters on DynamoDB Local in ``test_export_dynamodb.py``.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import pty
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from meter.client import Client
from meter.core.keys import period_start
from storage.base import Delta, ExportRow, Key
from storage.sqlite import SQLiteStorage
from tests.support.nodes import BACKFILL, ROOT, NodeProcess, raw_call, wait_for
from tests.test_node_process import cli, workdir  # noqa: F401 (workdir: a fixture)

#: 2020-01-15T00:00:00Z: an instant in a month other than the current one.
JANUARY_2020 = 1579046400.0


def stored_everything(node: NodeProcess) -> bool:
    """Whether the node has stored every unit it counted (nothing dirty, in flight or held)."""
    st = node.call("status")
    keys, flush = st["keys"], st["flush"]
    return bool(
        keys["dirty"] == 0
        and keys["inflight"] == 0
        and keys["unseeded"] == 0
        and flush["backlog_keys"] == 0
    )


def test_the_export_method_pages_through_the_nodes_storage(workdir: Path) -> None:  # noqa: F811
    month = period_start("month")
    tracked: Counter[tuple[str, str]] = Counter()
    with NodeProcess(workdir, METER_FLUSH_INTERVAL_MS="50", **BACKFILL) as node:
        with Client.connect(str(node.socket)) as client:
            items: list[tuple[str, str, int]] = []
            for i in range(230):
                tenant, feature, qty = f"t{i % 11}", f"f{i}", i % 7 + 1
                items.append((tenant, feature, qty))
                tracked[(tenant, feature)] += qty
            client.track_many(items)
            client.track_many(items[:50])  # a second round on some counters
            for tenant, feature, qty in items[:50]:
                tracked[(tenant, feature)] += qty
            client.track("t0", "old", 9, at=JANUARY_2020)  # another period: not exported
            wait_for(lambda: stored_everything(node), 20, "every unit stored")

            # The Python client's iterator, in pages of 7 rows.
            rows = list(client.export(month, limit=7))
            assert len(rows) == len(tracked)
            assert {(r.tenant, r.feature): r.total for r in rows} == dict(tracked)
            assert {r.period for r in rows} == {month}
            assert list(client.export("2020-01")) == [ExportRow("t0", "old", "2020-01", 9)]

            # Page by page: each within its limit, a cursor until the last.
            page, cursor = client.export_page(month, limit=100)
            assert len(page) == 100 and isinstance(cursor, str)
            seen = {(r.tenant, r.feature) for r in page}
            while cursor is not None:
                page, cursor = client.export_page(month, cursor, 100)
                assert len(page) <= 100
                seen |= {(r.tenant, r.feature) for r in page}
            assert seen == set(tracked)

        # Any MessagePack-RPC client: [period, {cursor, limit}] -> {rows, cursor}.
        error, result = raw_call(node.socket, "export", month, {"limit": 1000})
        assert error is None and result["cursor"] is None
        assert sorted(map(tuple, result["rows"])) == sorted(
            (t, f, month, v) for (t, f), v in tracked.items()
        )
        error, old = raw_call(node.socket, "export", "1999-01")
        assert error is None and old["rows"] == [] and old["cursor"] is None
        assert old["final"] is True and old["open_nodes"] == []  # (no node counted there)
        assert result["final"] is False  # (this month: calls may still count)
        assert [n["node"] for n in result["open_nodes"]] == [node.call("status")["node_id"]]

        _, first = raw_call(node.socket, "export", month, {"limit": 1})
        bad: list[tuple[list[Any], str]] = [
            (["2026-13"], "is not a period name"),
            (["2026-11-31"], "is not a period name"),
            (["2026-11#f0"], "is not a period name"),
            ([202611], "is not a period name"),
            ([], "export takes 1 to 2 params"),
            ([month, {}, 3], "export takes 1 to 2 params"),
            ([month, "cursor"], "opts must be a map"),
            ([month, {"limit": 1001}], "limit must be in 1..1000"),
            ([month, {"limit": 0}], "limit must be in 1..1000"),
            ([month, {"limit": "10"}], "limit must be an integer"),
            ([month, {"limit": True}], "limit must be an integer"),
            ([month, {"at": 1}], "unknown option"),
            ([month, {"cursor": 5}], "cursor must be a string"),
            ([month, {"cursor": "not-a-cursor"}], "cursor"),
            (["2020-01", {"cursor": first["cursor"]}], "not one handed out for period"),
        ]
        for params, message in bad:
            error, result = raw_call(node.socket, "export", *params)
            assert result is None, params
            assert error["code"] == "invalid_argument", (params, error)
            assert message in error["message"], (params, error)
        assert raw_call(node.socket, "ping") == (None, "pong")  # the connection is fine


def test_export_reads_stored_totals_and_a_drain_completes_it(workdir: Path) -> None:  # noqa: F811
    """What docs/operations.md says: units not flushed yet are not in an export; after the
    node drains (SIGTERM), `meter export` has every acknowledged unit."""
    month = period_start("month")
    env = {"METER_FLUSH_INTERVAL_MS": "3600000"}  # no flush round during the test
    node = NodeProcess(workdir, **env).start()
    try:
        with Client.connect(str(node.socket)) as client:
            assert client.track("acme", "api", 5) == 5
            assert list(client.export(month)) == []  # counted, not stored yet
    finally:
        assert node.stop() == 0, node.log()
    res = cli("export", "--period", month, env={"METER_DATA_DIR": str(node.data_dir)})
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"tenant,feature,period,total,dims,gauge\nacme,api,{month},5,,\n"
    # Not a terminal: no progress line; whether the period is final, always.
    assert res.stderr.startswith(f"meter: export: {month} is NOT final: calls may still count")
    assert res.stderr.count("\n") == 1


# -- meter export, end to end on SQLite ------------------------------------------------------


def fill(data_dir: Path, counters: dict[Key, int]) -> None:
    """Store ``counters`` in the SQLite file a node on ``data_dir`` uses."""

    async def go() -> None:
        store = SQLiteStorage(data_dir / "counters.sqlite3")
        await store.open()
        try:
            out = await store.apply("n1", [Delta(k, 1, v) for k, v in counters.items()])
            assert len(out) == len(counters)
        finally:
            await store.close()

    asyncio.run(go())


COUNTERS: dict[Key, int] = {
    **{(f"tenant-{i % 37}", f"feature.{i}", "2026-11"): i * 3 + 1 for i in range(2500)},
    ("acme/user,1", 'odd"name', "2026-11"): 2**70,  # csv quoting; a total past 64 bits
    ("acme", "api", "2026-10"): 4,  # other periods are not exported
    ("acme", "api", "2026-11-05"): 6,
}
NOVEMBER = {k: v for k, v in COUNTERS.items() if k[2] == "2026-11"}


def test_meter_export_writes_csv_and_jsonl_that_parse_back(workdir: Path) -> None:  # noqa: F811
    fill(workdir / "d", COUNTERS)
    env = {"METER_DATA_DIR": str(workdir / "d")}

    res = cli("export", "--period", "2026-11", env=env)
    assert res.returncode == 0, res.stderr
    final = (
        "meter: export: 2026-11 is final: no node marked it (none counted there, or only "
        "builds before period marks)\n"
    )
    assert res.stderr == final  # (no node marked it: written straight into storage)
    parsed = list(csv.DictReader(io.StringIO(res.stdout)))
    assert res.stdout.startswith("tenant,feature,period,total,dims,gauge\n")
    assert len(parsed) == len(NOVEMBER)
    assert {(r["tenant"], r["feature"], r["period"]): int(r["total"]) for r in parsed} == NOVEMBER

    out = workdir / "nov.jsonl"
    res = cli("export", "--period", "2026-11", "--format", "jsonl", "--out", str(out), env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "" and res.stderr == final
    lines = out.read_text().splitlines()
    assert len(lines) == len(NOVEMBER)
    objs = [json.loads(line) for line in lines]
    assert {(o["tenant"], o["feature"], o["period"]): o["total"] for o in objs} == NOVEMBER
    assert all(set(o) == {"tenant", "feature", "period", "total", "dims", "gauge"} for o in objs)
    assert all(o["dims"] == {} and o["gauge"] is False for o in objs)

    res = cli("export", "--period", "2026-11-05", "--format", "jsonl", env=env)
    assert res.returncode == 0 and json.loads(res.stdout) == {
        "tenant": "acme",
        "feature": "api",
        "period": "2026-11-05",
        "total": 6,
        "dims": {},
        "gauge": False,
    }
    res = cli("export", "--period", "2027-01", env=env)
    assert (res.returncode, res.stdout) == (0, "tenant,feature,period,total,dims,gauge\n")


def on_a_terminal(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    """``meter ARGS`` with its stderr on a pseudo-terminal: (exit code, stdout, stderr)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("METER_")}
    leader, follower = pty.openpty()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "meter", *args],
            env={**base, "PYTHONPATH": str(ROOT), **env},
            stdout=subprocess.PIPE,
            stderr=follower,
            timeout=300,
        )
        os.close(follower)
        follower = -1
        seen = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's other side is closed and drained
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(leader)
        if follower != -1:
            os.close(follower)
    return proc.returncode, proc.stdout.decode(), seen.decode()


def test_meter_export_shows_progress_only_on_a_terminal(workdir: Path) -> None:  # noqa: F811
    fill(workdir / "d", COUNTERS)
    code, out, err = on_a_terminal(
        "export", "--period", "2026-11", env={"METER_DATA_DIR": str(workdir / "d")}
    )
    assert code == 0
    assert f"exported {len(NOVEMBER)} rows of 2026-11, done" in err
    assert "segments" not in err  # SQLite is read in one part
    assert len(out.splitlines()) == len(NOVEMBER) + 1  # the rows stay on stdout


def test_meter_export_out_is_atomic_and_bad_input_is_refused(workdir: Path) -> None:  # noqa: F811
    fill(workdir / "d", COUNTERS)
    env = {"METER_DATA_DIR": str(workdir / "d")}
    out = workdir / "nov.csv"
    out.write_text("the previous export\n")

    # A storage error part-way: the first page (10,000 rows) is written, the second holds a
    # row whose total is not a number.
    broken = workdir / "broken"
    fill(broken, {(f"t{i:05d}", "api", "2026-11"): i for i in range(10_050)})
    with sqlite3.connect(broken / "counters.sqlite3") as db:
        db.execute("UPDATE counters SET total = 'garbage' WHERE tenant = 't10040'")
    res = cli(
        "export", "--period", "2026-11", "--out", str(out), env={"METER_DATA_DIR": str(broken)}
    )
    assert res.returncode == 1
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert res.stderr.startswith("meter: export failed: ")
    assert "bad stored total" in res.stderr, res.stderr
    assert out.read_text() == "the previous export\n"  # untouched, and no temp file left
    assert sorted(p.name for p in workdir.iterdir()) == ["broken", "d", "nov.csv"]

    res = cli("export", "--period", "2026-11", "--out", str(out), env=env)
    assert res.returncode == 0, res.stderr
    assert len(out.read_text().splitlines()) == len(NOVEMBER) + 1
    assert sorted(p.name for p in workdir.iterdir()) == ["broken", "d", "nov.csv"]

    cases: list[tuple[list[str], dict[str, str], int, str]] = [
        (["--period", "2026-13"], env, 2, "meter: --period: period '2026-13' is not a period name"),
        (["--period", "2026-11-31"], env, 2, "meter: --period: period '2026-11-31' is not"),
        (["--period", "november"], env, 2, "meter: --period: period 'november' is not"),
        (["--period", "2026-11", "--out", str(workdir / "no" / "x.csv")], env, 2, "no such dir"),
        (["--period", "2026-11", "--out", str(workdir)], env, 2, "is a directory"),
        (["--period", "2026-11"], {"METER_STORAGE": "memory"}, 2, "memory storage keeps nothing"),
        (
            ["--period", "2026-11"],
            {"METER_DATA_DIR": str(workdir / "nothing")},
            1,
            "meter: export failed: no sqlite database at",
        ),
        (["--period", "2026-11", "--format", "xml"], env, 2, "invalid choice: 'xml'"),
        ([], env, 2, "the following arguments are required: --period"),
    ]
    for args, case_env, code, message in cases:
        res = cli("export", *args, env=case_env)
        assert res.returncode == code, (args, res.stderr)
        assert message in res.stderr, (args, res.stderr)
        assert res.stdout == "", args
    assert not (workdir / "nothing").exists()  # a wrong data dir is not created
