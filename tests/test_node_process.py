"""A real ``meter serve`` process: answers a foreign msgpack client, drains on SIGTERM, restarts
with every acknowledged unit, refuses a shared data dir, and the CLI around it."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import re
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from meter.core.keys import period_start
from storage.sqlite import SQLiteStorage
from tests.support.cluster_harness import wait_until
from tests.support.dynamodb_local import free_port
from tests.support.nodes import ROOT, NodeProcess, raw_call, short_tmpdir
from tests.support.redis_server import RedisServer


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = short_tmpdir()
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("METER_")}
    base["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "meter", *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_foreign_msgpack_client_tracks_and_reads(workdir: Path) -> None:
    with NodeProcess(workdir, METER_FLUSH_INTERVAL_MS="50") as node:
        assert raw_call(node.socket, "track", "acme", "api", 5) == (None, 5)
        assert raw_call(node.socket, "track", "acme", "api") == (None, 6)
        assert raw_call(node.socket, "usage", "acme", "api") == (None, 6)
        assert raw_call(node.socket, "usage_all", "acme") == (None, {"api": 6})
        error, result = raw_call(node.socket, "track", "", "api")
        assert result is None and error["code"] == "invalid_argument"
        error, _ = raw_call(node.socket, "nope")
        assert error["code"] == "unknown_method"


def test_bad_requests_get_the_services_errors_and_the_connection_stays_usable(
    workdir: Path,
) -> None:
    """Each bad request on one connection is answered with its code and the service's own
    message (the one docs/protocol.md shows for a qty of "many"), counts nothing, and the
    connection keeps serving."""
    bad: list[tuple[list[Any], str, str]] = [
        (
            [0, 1, "track", ["acme", "api", "many"]],
            "invalid_argument",
            "qty must be an integer, got str",
        ),
        ([0, 2, "track", ["", "api"]], "invalid_argument", "tenant must not be empty"),
        ([0, 3, "track", ["acme"]], "invalid_argument", "track takes 2 to 4 params, got 1"),
        (
            [0, 4, "track", ["acme", "api", 2**63]],
            "invalid_argument",
            "qty 9223372036854775808 is outside the signed 64-bit range",
        ),
        (
            [0, 5, "track", ["acme", "api", 1, {"color": 1}]],
            "invalid_argument",
            "track: unknown option 'color' (allowed: at, detail, dims, id, value)",
        ),
        ([0, 6, "nope", []], "unknown_method", "unknown method 'nope'"),
        ([0, 7, "ping"], "invalid_argument", "a request has 4 elements, got 3"),
        (
            [0, 8, "commit", ["no-such-id"]],
            "not_found",
            "reservation 'no-such-id' is unknown or expired",
        ),
    ]
    with NodeProcess(workdir) as node, socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(node.socket))
        unpacker = msgpack.Unpacker(raw=False)

        def ask(frame: list[Any]) -> Any:
            s.sendall(msgpack.packb(frame))
            while True:
                for msg in unpacker:
                    return msg
                data = s.recv(1 << 16)
                assert data, "the node closed the connection"
                unpacker.feed(data)

        for frame, code, message in bad:
            assert ask(frame) == [1, frame[1], {"code": code, "message": message}, None]
        assert ask([0, 9, "track", ["acme", "api", 2]]) == [1, 9, None, 2]
        assert ask([0, 10, "ping", []]) == [1, 10, None, "pong"]
        assert node.call("status")["server"]["internal_errors"] == 0


def test_requests_before_garbage_are_answered_before_the_close(workdir: Path) -> None:
    with NodeProcess(workdir) as node, socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(node.socket))
        s.sendall(
            msgpack.packb([0, 1, "track", ["cold", "api", 1]])
            + msgpack.packb([0, 2, "usage", ["colder", "api"]])
            + b"\xc1"  # never valid MessagePack: the node closes the connection
        )
        unpacker = msgpack.Unpacker(raw=False)
        while data := s.recv(1 << 16):
            unpacker.feed(data)
        answers = sorted(unpacker, key=lambda a: a[1])
        assert node.call("usage", "cold", "api") == 1  # the track was counted
        assert answers == [[1, 1, None, 1], [1, 2, None, 0]]


def test_socket_is_private(workdir: Path) -> None:
    with NodeProcess(workdir) as node:
        mode = stat.S_IMODE(node.socket.stat().st_mode)
        assert mode == 0o600


def test_pipelined_raw_requests_on_one_connection(workdir: Path) -> None:
    with NodeProcess(workdir) as node, socket.socket(socket.AF_UNIX) as s:
        s.connect(str(node.socket))
        n = 2000
        s.sendall(b"".join(msgpack.packb([0, i, "track", ["acme", "p", 1]]) for i in range(n)))
        unpacker = msgpack.Unpacker(raw=False)
        seen: dict[int, int] = {}
        while len(seen) < n:
            unpacker.feed(s.recv(1 << 16))
            for _, msgid, error, result in unpacker:
                assert error is None
                seen[msgid] = result
        assert sorted(seen.values()) == list(range(1, n + 1))
        assert node.call("usage", "acme", "p") == n


def test_sigterm_drains_and_restart_keeps_every_unit(workdir: Path) -> None:
    # A flush interval far longer than the test: only the drain can have written the units.
    node = NodeProcess(workdir, METER_FLUSH_INTERVAL_MS="3600000").start()
    expected: dict[str, int] = {}
    for i in range(300):
        feature = f"f{i % 7}"
        node.call("track", "acme", feature, i)
        expected[feature] = expected.get(feature, 0) + i
    rid = node.call("reserve", "acme", "f0", 1000)
    assert node.stop(signal.SIGTERM) == 0, node.log()
    assert not node.socket.exists(), "the socket file is removed on exit"
    assert "node stopped (drained)" in node.log()
    # Stored before the exit: read the SQLite file itself (a restart would replay the
    # write-ahead log and answer every unit even if the drain had stored nothing).
    assert asyncio.run(_stored(node.data_dir / "counters.sqlite3", "acme")) == expected

    again = NodeProcess(workdir).start()
    try:
        # The open reservation survives the restart (it is in the write-ahead log): it is
        # held in the view until released.
        assert again.call("usage_all", "acme") == dict(expected, f0=expected["f0"] + 1000)
        assert again.call("release", rid) is None
        assert again.call("usage_all", "acme") == expected
        assert again.call("track", "acme", "f1", 1) == expected["f1"] + 1
    finally:
        assert again.stop() == 0


async def _stored(path: Path, tenant: str) -> dict[str, int]:
    """Every stored total of ``tenant`` this month, read from the SQLite file."""
    store = SQLiteStorage(path)
    await store.open()
    try:
        listed = await store.list_period(tenant, period_start("month"))
        return {feature: snap.total for feature, snap in listed.items()}
    finally:
        await store.close()


def test_node_id_is_kept_in_the_data_dir(workdir: Path) -> None:
    with NodeProcess(workdir) as node:
        first = node.call("status")["node_id"]
    with NodeProcess(workdir) as node:
        assert node.call("status")["node_id"] == first
    assert (workdir / "node-data" / "node_id").read_text().strip() == first


def test_two_nodes_cannot_share_a_data_dir(workdir: Path) -> None:
    with NodeProcess(workdir):
        res = cli(
            "serve",
            env={"METER_DATA_DIR": str(workdir / "node-data"), "METER_SOCKET": str(workdir / "b")},
        )
        assert res.returncode == 2
        assert "data_dir" in res.stderr and "in use" in res.stderr


def test_cli_track_usage_status(workdir: Path) -> None:
    with NodeProcess(workdir) as node:
        env = {"METER_SOCKET": str(node.socket)}
        assert cli("track", "acme", "api", "4", env=env).stdout.strip() == "4"
        assert cli("track", "acme", "api", env=env).stdout.strip() == "5"
        assert cli("usage", "acme", "api", env=env).stdout.strip() == "5"
        assert cli("usage", "acme", env=env).stdout.splitlines() == ["FEATURE  VALUE", "api      5"]
        assert json.loads(cli("usage", "acme", "--json", env=env).stdout) == {
            "tenant": "acme",
            "usage": {"api": 5},
        }
        assert cli("ping", env=env).stdout == "pong\n"
        items = workdir / "items.txt"
        items.write_text("# tenant feature qty\nacme api 3\n\nacme api\nbeta api 2 job-1\n")
        many = cli("track-many", str(items), "--json", env=env)
        assert many.returncode == 0, many.stderr
        assert [json.loads(line) for line in many.stdout.splitlines()] == [
            {"line": 2, "tenant": "acme", "feature": "api", "value": 8},
            {"line": 4, "tenant": "acme", "feature": "api", "value": 9},
            {"line": 5, "tenant": "beta", "feature": "api", "value": 2},
        ]
        # The same item id again is counted once (docs/protocol.md, request ids).
        again = cli("track-many", str(items), env=env)
        assert again.returncode == 0 and again.stdout == "3 counted, 0 failed\n"
        assert cli("usage", "beta", "api", env=env).stdout.strip() == "2"
        human = cli("status", env=env)
        assert human.returncode == 0
        for word in ("node", "storage", "sqlite", "backlog", "flush"):
            assert word in human.stdout
        raw = json.loads(cli("status", "--json", env=env).stdout)
        assert raw["keys"]["warm"] == 2  # acme/api and beta/api
        bad = cli("track", "acme", "bad feature", env=env)
        assert bad.returncode == 1 and "invalid_argument" in bad.stderr


def test_cli_errors(workdir: Path) -> None:
    res = cli("status", env={"METER_SOCKET": str(workdir / "nobody.sock")})
    assert res.returncode == 1 and "unavailable" in res.stderr
    res = cli("serve", env={"METER_FLUSH_INTERVAL_MS": "soon"})
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "meter: configuration error: flush_interval_ms: must be an integer, got 'soon'"
    ]
    res = cli("serve", "--storage", "oracle")
    assert res.returncode == 2 and "storage" in res.stderr


def test_storage_init_sqlite_says_nothing_to_do(workdir: Path) -> None:
    res = cli("storage", "init", env={"METER_DATA_DIR": str(workdir / "d")})
    assert res.returncode == 0, res.stderr
    assert "sqlite" in res.stdout.lower()


def test_a_served_node_freezes_its_startup_objects_and_raises_the_young_gc_threshold(
    workdir: Path,
) -> None:
    """ADR 0007: ``meter serve`` tunes its own collector once recovered; 0 leaves Python's."""
    with NodeProcess(workdir, "tuned") as node:
        got = node.call("status")["gc"]
        assert got["threshold"][0] == 20_000
        assert got["frozen"] > 0
    with NodeProcess(workdir, "plain", METER_GC_YOUNG_THRESHOLD="0") as node:
        got = node.call("status")["gc"]
        assert got["threshold"][0] == gc.get_threshold()[0]  # Python's default, as here
        assert got["frozen"] == 0


def test_json_logs_are_one_object_a_line_with_stable_fields(workdir: Path) -> None:
    """``log_format = json``: every line of a served node's log parses on its own, with the
    documented fields, a protocol error's warning included."""
    with NodeProcess(workdir, METER_LOG_FORMAT="json", METER_LOG_LEVEL="INFO") as node:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(str(node.socket))
            # A method name that is not a string: a protocol error the node logs and closes on.
            s.sendall(msgpack.packb([0, 1, b'x"\n\xff', []]) + b"\xc1")
            while s.recv(1 << 16):
                pass
        node.stop()
    lines = [line for line in node.log().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert records, "the node logged nothing"
    for r in records:
        assert {"ts", "level", "logger", "message", "pid"} <= set(r), r
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", r["ts"]), r
        assert r["level"] in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
    assert any(r["logger"] == "meter.node" and "serving on" in r["message"] for r in records)
    assert any(r["level"] == "WARNING" and "protocol error" in r["message"] for r in records)


def test_status_check_strict_fails_while_the_bus_is_down_and_passes_once_it_is_up(
    workdir: Path,
) -> None:
    """``meter status --check`` (an exec probe) passes while the node counts; with
    ``--strict`` it also fails, with the reason, while a configured Redis is unreachable
    (degraded: gossip paused), and passes once Redis answers. A node alone is ready at once."""
    with NodeProcess(workdir, "alone") as node:
        ok = cli("status", "--check", "--strict", env={"METER_SOCKET": str(node.socket)})
        assert ok.returncode == 0, ok.stderr
        assert "ready        yes" in ok.stdout
    port = free_port()
    with NodeProcess(workdir, "clustered", METER_REDIS_URL=f"redis://127.0.0.1:{port}/0") as node:
        env = {"METER_SOCKET": str(node.socket)}
        assert cli("status", "--check", env=env).returncode == 0  # it counts: ready
        down = cli("status", "--check", "--strict", env=env)
        assert down.returncode == 1
        assert "meter: not ready: bus: not connected" in down.stderr
        got = node.call("status")
        assert got["ready"] is True and got["not_ready"] == []
        assert [r for r in got["degraded"] if r.startswith("bus: not connected")]
        with RedisServer(port=port):
            wait_until(
                lambda: cli("status", "--check", "--strict", env=env).returncode == 0,
                30,
                "the node whole again once Redis answers",
            )
            assert node.call("status")["degraded"] == []


def test_a_json_record_is_one_line_whatever_its_message_holds() -> None:
    from meter.ops.logs import JsonFormatter

    fmt = JsonFormatter()
    try:
        raise ValueError("boom\nline two")
    except ValueError:
        exc = sys.exc_info()
    rec = logging.LogRecord(
        "meter.x", logging.ERROR, __file__, 1, 'bad "%s"', ("a\nb\u2028c\x00",), exc
    )
    line = fmt.format(rec)
    assert "\n" not in line and "\u2028" not in line
    got = json.loads(line)
    assert got["message"] == 'bad "a\nb\u2028c\x00"'
    assert got["level"] == "ERROR" and got["logger"] == "meter.x"
    assert "ValueError: boom" in got["exc"]
    odd = logging.LogRecord("meter.x", logging.WARNING, __file__, 1, "%d items", ("many",), None)
    assert "%d items" in json.loads(fmt.format(odd))["message"]  # a bad format keeps the record
