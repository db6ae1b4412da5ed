"""``meter track / reserve / commit / release / track-many / usage``, against a recording
stand-in node: what goes on the wire (request ids included), what is printed, and the exit codes.

``main()`` runs in a worker thread (its client is blocking) while the server runs on the
test's event loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from meter.cli.main import main
from meter.core.server import RpcServer, start_server
from meter.errors import InvalidArgument, LimitExceeded, NotFound
from tests.support.nodes import short_tmpdir
from tests.test_client import ANY_ID


class Node:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[Any]]] = []

    def dispatch(self, method: str, params: list[Any]) -> Any:
        self.calls.append((method, params))
        if method == "track":
            return 42
        if method == "reserve":
            opts = params[3] if len(params) > 3 else {}
            if params[2] > opts.get("limit", params[2]):
                raise LimitExceeded("would exceed the limit")
            return "r-1"
        if method == "commit":
            return None if params[0] == "r-cold" else 10
        if method == "release":
            if params[0] != "r-1":
                raise NotFound(f"no reservation {params[0]!r}")
            return None
        if method == "track_many":
            if params[0][0][0] == "refused":
                raise InvalidArgument("the whole call is refused")
            return [
                {"code": "invalid_argument", "message": "feature is bad"}
                if item[1] == "bad"
                else item[2]
                for item in params[0]
            ]
        if method == "usage_all":
            return {}
        raise AssertionError(method)


@pytest.fixture
def path(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    for name in list(os.environ):
        if name.startswith("METER_"):
            monkeypatch.delenv(name)
    d = str(short_tmpdir("mcli"))
    yield os.path.join(d, "m.sock")
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def node() -> Node:
    return Node()


@pytest.fixture
async def server(path: str, node: Node) -> AsyncIterator[RpcServer]:
    srv = await start_server(path, node)
    yield srv
    await srv.close(drain_timeout=0.5)


async def meter(path: str, *args: str) -> int:
    return await asyncio.to_thread(main, [args[0], "--socket", path, *args[1:]])


CASES: list[tuple[list[str], tuple[str, list[Any]], str]] = [
    (["track", "acme", "api"], ("track", ["acme", "api", 1, {"id": ANY_ID}]), "42"),
    (
        ["track", "acme", "api", "5", "--id", "job-7"],
        ("track", ["acme", "api", 5, {"id": "job-7"}]),
        "42",
    ),
    (
        ["track", "acme", "api", "2", "--at", "1700000000", "--id", "j"],
        ("track", ["acme", "api", 2, {"at": 1700000000.0, "id": "j"}]),
        "42",
    ),
    (["reserve", "acme", "gpu", "3"], ("reserve", ["acme", "gpu", 3, {"id": ANY_ID}]), "r-1"),
    (
        ["reserve", "acme", "gpu", "3", "--limit", "10", "--ttl-ms", "500", "--id", "res-1"],
        ("reserve", ["acme", "gpu", 3, {"limit": 10, "ttl_ms": 500, "id": "res-1"}]),
        "r-1",
    ),
    (["commit", "r-1"], ("commit", ["r-1", None, {"id": ANY_ID}]), "10"),
    (["commit", "r-1", "2", "--id", "c-1"], ("commit", ["r-1", 2, {"id": "c-1"}]), "10"),
    (
        ["commit", "r-cold"],
        ("commit", ["r-cold", None, {"id": ANY_ID}]),
        "counted (total not known yet: storage unreachable)",
    ),
    (["release", "r-1"], ("release", ["r-1", {"id": ANY_ID}]), "released"),
    (["release", "r-1", "--id", "rel-1"], ("release", ["r-1", {"id": "rel-1"}]), "released"),
]


@pytest.mark.parametrize(("args", "wire", "printed"), CASES, ids=[" ".join(a) for a, _, _ in CASES])
async def test_mutating_commands(
    server: RpcServer,
    path: str,
    node: Node,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    wire: tuple[str, list[Any]],
    printed: str,
) -> None:
    assert await meter(path, *args) == 0
    assert node.calls == [wire]
    out = capsys.readouterr()
    assert out.out == printed + "\n" and out.err == ""


@pytest.mark.parametrize("bad", ["", "x" * 129, "é" * 65])
@pytest.mark.parametrize("command", [["track", "acme", "api"], ["release", "r-1"]])
async def test_a_bad_id_is_a_usage_error(
    server: RpcServer,
    path: str,
    node: Node,
    capsys: pytest.CaptureFixture[str],
    command: list[str],
    bad: str,
) -> None:
    assert await meter(path, *command, "--id", bad) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.count("\n") == 1 and out.err.startswith("meter: --id: "), out.err
    assert "1 to 128 UTF-8 bytes" in out.err
    assert node.calls == [], "nothing was sent"


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["reserve", "acme", "gpu", "11", "--limit", "10"], "meter: limit_exceeded: "),
        (["release", "r-404"], "meter: not_found: "),
    ],
)
async def test_error_answers_exit_1(
    server: RpcServer,
    path: str,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    line: str,
) -> None:
    assert await meter(path, *args) == 1
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1, err


JSON_CASES: list[tuple[list[str], dict[str, Any]]] = [
    (["track", "acme", "api"], {"tenant": "acme", "feature": "api", "value": 42}),
    (["reserve", "acme", "gpu", "3"], {"reservation_id": "r-1"}),
    (["commit", "r-1"], {"reservation_id": "r-1", "value": 10}),
    (["commit", "r-cold"], {"reservation_id": "r-cold", "value": None}),
    (["release", "r-1"], {"reservation_id": "r-1", "released": True}),
]


@pytest.mark.parametrize(("args", "printed"), JSON_CASES, ids=[" ".join(a) for a, _ in JSON_CASES])
async def test_json_output(
    server: RpcServer,
    path: str,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    printed: dict[str, Any],
) -> None:
    assert await meter(path, *args, "--json") == 0
    out = capsys.readouterr()
    assert json.loads(out.out) == printed and out.out.count("\n") == 1 and out.err == ""


async def test_usage_of_a_tenant_without_counters(
    server: RpcServer, path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await meter(path, "usage", "nobody") == 0
    assert capsys.readouterr().out == "(no counters in this period)\n"


async def test_track_many_sends_batches_of_at_most_10000_items(
    server: RpcServer, path: str, node: Node, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    items = tmp_path / "items"
    items.write_text("".join(f"t{i} api {i}\n" for i in range(10_001)))
    assert await meter(path, "track-many", str(items)) == 0
    assert [(m, len(p[0])) for m, p in node.calls] == [("track_many", 10_000), ("track_many", 1)]
    assert node.calls[1][1][0][0] == ["t10000", "api", 10_000, {"id": ANY_ID}]
    assert capsys.readouterr().out == "10001 counted, 0 failed\n"


async def test_track_many_reports_each_failed_item_and_exits_1(
    server: RpcServer, path: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    items = tmp_path / "items"
    items.write_text("acme api 2 id-1\nacme bad\n")
    assert await meter(path, "track-many", str(items)) == 1
    out = capsys.readouterr()
    assert out.out == "1 counted, 1 failed\n"
    assert out.err == "meter: line 2: invalid_argument: feature is bad\n"
    assert await meter(path, "track-many", str(items), "--json") == 1
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows == [
        {"line": 1, "tenant": "acme", "feature": "api", "value": 2},
        {
            "line": 2,
            "tenant": "acme",
            "feature": "bad",
            "error": {"code": "invalid_argument", "message": "feature is bad"},
        },
    ]


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (b"acme\n", "line 20001: expected 'TENANT FEATURE [QTY [ID]]', got 1 words"),
        (b"acme api 1 id extra\n", "line 20001: expected 'TENANT FEATURE [QTY [ID]]', got 5 words"),
        (b"acme api many\n", "line 20001: QTY must be an integer, got 'many'"),
        (b"acme api 1 " + b"x" * 129 + b"\n", "line 20001: ID: request id must be 1 to 128"),
        (b"acme api \xff\n", "codec can't decode"),
    ],
)
async def test_track_many_checks_all_its_input_before_sending_any(
    server: RpcServer,
    path: str,
    node: Node,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    bad: bytes,
    why: str,
) -> None:
    items = tmp_path / "items"
    items.write_bytes(b"".join(b"t%d api\n" % i for i in range(20_000)) + bad)
    assert await meter(path, "track-many", str(items)) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("meter: track-many: ") and why in out.err, out.err
    assert out.err.count("\n") == 1
    assert node.calls == [], "nothing was sent"


async def test_track_many_of_a_missing_file_is_a_usage_error(
    server: RpcServer, path: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert await meter(path, "track-many", str(tmp_path / "none")) == 2
    assert "No such file" in capsys.readouterr().err


async def test_track_many_says_which_lines_a_failed_call_leaves_unsettled(
    server: RpcServer, path: str, node: Node, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    items = tmp_path / "items"
    lines = [f"t{i} api" for i in range(10_000)] + ["refused api", "t api", "# end"]
    lines += [f"u{i} api" for i in range(10_000)]
    items.write_text("\n".join(lines) + "\n")
    assert await meter(path, "track-many", str(items)) == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith(
        "meter: track-many: lines before 10001 were sent and answered; lines 10001 to 20001 "
        "failed as a whole (invalid_argument: the whole call is refused): if no answer came "
        "they may have been counted, so re-send them only with the same IDs; later lines were "
        "not sent"
    ), out.err
    assert [len(p[0]) for _, p in node.calls] == [10_000, 10_000], "the third call never went"
