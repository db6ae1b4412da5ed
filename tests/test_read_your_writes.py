"""Read-your-writes on one connection, through a real node process: a read pipelined after
writes sees every one of them, whatever had to be loaded first (docs/protocol.md, "Transport").

Every request goes out in one ``sendall`` before any answer is read: the node gets them in one
read pass, which is where a read used to overtake the writes still loading their counters.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import msgpack
import pytest

from meter.client import calls
from meter.client.calls import Kind
from tests.support.nodes import NodeProcess

NO_FLUSH = {"METER_FLUSH_INTERVAL_MS": "3600000"}


def pipeline(path: Path, requests: list[tuple[str, list[Any]]]) -> list[tuple[Any, Any]]:
    """Send ``requests`` in one write on one connection; ``(error, result)`` of each, in the
    order sent (answers are matched by msgid)."""
    out: dict[int, tuple[Any, Any]] = {}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        s.sendall(b"".join(msgpack.packb([0, i, m, p]) for i, (m, p) in enumerate(requests)))
        unpacker = msgpack.Unpacker(raw=False)
        while len(out) < len(requests):
            data = s.recv(65536)
            assert data, "the node closed the connection"
            unpacker.feed(data)
            for msg in unpacker:
                out[msg[1]] = (msg[2], msg[3])
    return [out[i] for i in range(len(requests))]


@pytest.fixture(params=["sqlite", "memory"])
def node(request: pytest.FixtureRequest, workdir: Path) -> Any:
    with NodeProcess(workdir, METER_STORAGE=request.param, **NO_FLUSH) as n:
        yield n


def test_usage_all_pipelined_after_tracks_of_fresh_tenants_sees_them(node: NodeProcess) -> None:
    for i in range(20):
        tenant = f"ord{i}"
        got = pipeline(node.socket, [("track", [tenant, "a", 2]), ("usage_all", [tenant])])
        assert got == [(None, 2), (None, {"a": 2})], tenant


def test_usage_all_pipelined_after_a_new_feature_of_a_warm_tenant_sees_it(
    node: NodeProcess,
) -> None:
    node.call("track", "warm", "a", 1)
    for i in range(20):
        feature = f"b{i}"
        got = pipeline(node.socket, [("track", ["warm", feature, 1]), ("usage_all", ["warm"])])
        assert got[0] == (None, 1)
        err, values = got[1]
        assert err is None and values.get(feature) == 1, (feature, values)


def test_every_read_sees_the_writes_before_it_and_later_writes_still_count(
    node: NodeProcess,
) -> None:
    """usage, usage_all, balance, limits and check after cold writes; and the writes sent after
    a waiting read are all counted."""
    got = pipeline(
        node.socket,
        [
            ("track", ["t1", "x", 3]),
            ("usage", ["t1", "x"]),
            ("grant", ["t1", 50]),
            ("balance", ["t1"]),
            ("set_limit", ["t1", "x", {"limit": 100}]),
            ("limits", ["t1"]),
            ("track", ["t1", "x", 4]),
            ("track", ["t1", "y", 5]),
            ("usage_all", ["t1"]),
        ],
    )
    assert all(err is None for err, _ in got), got
    assert got[1] == (None, 3)
    assert got[3][1]["available"] == 50
    assert got[5][1]["limits"]["x"]["limit"] == 100, got[5]
    assert got[8] == (None, {"x": 7, "y": 5})


def test_a_bad_request_in_the_queue_is_answered_and_the_rest_still_run(
    node: NodeProcess,
) -> None:
    got = pipeline(
        node.socket,
        [
            ("track", ["t2", "x", 1]),
            ("usage", ["t2", "x"]),
            ("track", ["t2", "x", "one"]),
            ("no_such_method", []),
            ("usage", ["t2"]),
            ("track", ["t2", "x", 1]),
            ("usage", ["t2", "x"]),
        ],
    )
    assert got[1] == (None, 1)
    assert got[2][0]["code"] == "invalid_argument"
    assert got[3][0]["code"] == "unknown_method"
    assert got[4][0]["code"] == "invalid_argument"
    assert got[6] == (None, 2)
    assert node.call("usage", "t2", "x") == 2


def test_the_node_serves_every_client_read_after_the_requests_before_it() -> None:
    """Every call the client table marks as a read (and ``subscribe``) is in the server's set."""
    from meter.core.service import READS

    read_calls = {
        c.wire for c in vars(calls).values() if isinstance(c, calls.Method) and c.kind is Kind.READ
    }
    assert read_calls, "no read calls found"
    assert read_calls | {"subscribe"} <= READS
