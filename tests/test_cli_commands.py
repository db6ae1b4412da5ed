"""``meter track / reserve / commit / release`` against a recording stand-in node: what goes on
the wire (request ids included), what is printed, and the exit codes.

``main()`` runs in a worker thread (its client is blocking) while the server runs on the
test's event loop.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from meter.cli import main
from meter.errors import LimitExceeded, NotFound
from meter.server import RpcServer, start_server
from tests.nodes import short_tmpdir
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
