"""The pipelined fast path (``Service.warm_tracks`` + the server's use of it) answers exactly
like one-by-one dispatch, and keeps pipelined requests in order."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from meter.core.keys import QTY_MAX
from meter.core.server import RpcServer
from meter.core.service import Service
from meter.core.table import CounterTable
from meter.node.wiring import build_service, serve
from storage.base import EMPTY, Delta
from storage.memory import MemoryStorage
from tests.support.nodes import short_tmpdir


class CountingService:
    """A service whose server counts the requests the fast path answered, so the tests know
    it was taken. (It wraps the server's fast path: a compiled ``Service`` takes no
    interpreted subclass.)"""

    def __init__(self, svc: Service) -> None:
        self.svc = svc
        self.fast_answered = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.svc, name)

    def count(self, server: RpcServer) -> None:
        fast = server._warm_tracks
        assert fast is not None

        def counting(requests: list[Any]) -> list[int]:
            values = fast(requests)
            self.fast_answered += len(values)
            return values

        server._warm_tracks = counting


@pytest.fixture
async def node() -> AsyncIterator[tuple[CountingService, Path]]:
    path = short_tmpdir() / "m.sock"
    svc = build_service(CounterTable("n1"), MemoryStorage())
    server: RpcServer = await serve(path, svc)
    counting = CountingService(svc)
    counting.count(server)
    try:
        yield counting, path
    finally:
        await server.close()


async def pipeline(path: Path, calls: list[tuple[str, list[Any]]]) -> list[tuple[Any, Any]]:
    """Send every call in one write from a raw socket; return (error, result) per call."""
    import asyncio

    def run() -> list[tuple[Any, Any]]:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(str(path))
            s.sendall(b"".join(msgpack.packb([0, i, m, p]) for i, (m, p) in enumerate(calls)))
            unpacker = msgpack.Unpacker(raw=False)
            got: dict[int, tuple[Any, Any]] = {}
            while len(got) < len(calls):
                unpacker.feed(s.recv(1 << 16))
                for kind, msgid, error, result in unpacker:
                    assert kind == 1
                    got[msgid] = (error, result)
            return [got[i] for i in range(len(calls))]

    return await asyncio.to_thread(run)


async def test_a_usage_between_tracks_sees_exactly_the_tracks_before_it(
    node: tuple[CountingService, Path],
) -> None:
    svc, path = node
    await pipeline(path, [("track", ["acme", "api", 1])])  # warm the key and the name cache
    out = await pipeline(
        path,
        [("track", ["acme", "api", 1])] * 3
        + [("usage", ["acme", "api"])]
        + [("track", ["acme", "api", 1])] * 2,
    )
    assert out == [(None, 2), (None, 3), (None, 4), (None, 4), (None, 5), (None, 6)]
    assert svc.fast_answered >= 3, "the leading tracks took the fast path"


async def test_a_usage_all_between_tracks_sees_exactly_the_tracks_before_it(
    node: tuple[CountingService, Path],
) -> None:
    svc, path = node
    await svc.storage.apply("old", [Delta(svc.key_for("acme", "stored"), 1, 7)])
    await pipeline(path, [("track", ["acme", "api", 1])])
    out = await pipeline(
        path,
        [("track", ["acme", "api", 1])] * 3
        + [("usage_all", ["acme"])]
        + [("track", ["acme", "api", 1])] * 2
        + [("track", ["acme", "stored", 1])]
        + [("usage_all", ["acme"])],
    )
    assert out[3] == (None, {"api": 4, "stored": 7}), "the tracks after it are not in it"
    assert out[:3] == [(None, 2), (None, 3), (None, 4)] and out[4:6] == [(None, 5), (None, 6)]
    assert out[6] == (None, 8)
    assert out[7] == (None, {"api": 6, "stored": 8})


async def test_a_reservation_in_a_batch_checks_its_limit_in_order(
    node: tuple[CountingService, Path],
) -> None:
    svc, path = node
    await pipeline(path, [("track", ["acme", "api", 1])])
    out = await pipeline(
        path,
        [
            ("track", ["acme", "api", 5]),  # 6
            ("reserve", ["acme", "api", 4, {"limit": 10}]),  # 6 + 4 = 10: fits
            ("track", ["acme", "api", 1]),  # 11 (usage is not limited)
            ("reserve", ["acme", "api", 1, {"limit": 10}]),  # 11 + 1 > 10: refused
        ],
    )
    assert out[0] == (None, 6)
    assert out[1][0] is None and isinstance(out[1][1], str)
    assert out[2] == (None, 11)
    assert out[3][0]["code"] == "limit_exceeded"
    assert svc.fast_answered >= 1


async def test_bad_and_cold_requests_inside_a_run_are_answered_like_dispatch(
    node: tuple[CountingService, Path],
) -> None:
    svc, path = node
    await svc.storage.apply("old", [Delta(svc.key_for("acme", "cold"), 1, 100)])
    await pipeline(path, [("track", ["acme", "api", 1]), ("track", ["acme", "other", 1])])
    out = await pipeline(
        path,
        [
            ("track", ["acme", "api", 1]),
            ("track", ["acme", "api", "x"]),  # bad qty: an error, the rest still served
            ("track", ["acme", "api", QTY_MAX + 1]),
            ("track", ["acme", "cold", 1]),  # cold: seeded from storage first
            ("track", ["acme", "other", 2]),
            ("track", ["acme", "api", 1, {}]),  # with opts: the general path
            ("track", ["acme", "api", 1]),
        ],
    )
    assert out[0] == (None, 2)
    assert out[1][0]["code"] == out[2][0]["code"] == "invalid_argument"
    assert out[3] == (None, 101)
    assert out[4] == (None, 3)
    assert out[5] == (None, 3)
    assert out[6] == (None, 4)
    assert svc.table.value(svc.key_for("acme", "api")) == 4
    assert svc.fast_answered >= 1


def test_warm_tracks_counts_only_the_leading_run() -> None:
    svc = build_service(CounterTable("n1"), MemoryStorage())
    warm = svc.key_for("acme", "api")
    svc.table.seed(warm, EMPTY)
    reqs: list[Any] = [
        [0, 1, "track", ["acme", "api", 2]],
        [0, 2, "track", ["acme", "api", 3]],
        [0, 3, "usage", ["acme", "api"]],
        [0, 4, "track", ["acme", "api", 4]],
    ]
    assert svc.warm_tracks(reqs) == [2, 5]
    assert svc.table.value(warm) == 5, "nothing after the first other request is counted"
    assert svc.warm_tracks([[0, 1, "track", ["nobody", "api", 1]]]) == []
    assert svc.warm_tracks([]) == []
