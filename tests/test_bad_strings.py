"""Strings that are not valid UTF-8 (the node decodes them with surrogateescape) are refused as
``invalid_argument`` wherever a name or an id is read, never answered ``internal`` (issue 12,
item 2). Through the real service and socket server, with bytes a foreign client can send."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest

from meter.core.server import RpcServer
from meter.core.service import Service
from meter.core.table import CounterTable
from meter.node.wiring import build_service, serve
from storage.memory import MemoryStorage
from tests.support.nodes import short_tmpdir

#: Stands for a string; replaced by the same-length str whose bytes are not UTF-8.
MARK = "\x01\x02"
BAD = b"\xa2\xff\xfe"  # fixstr of 2 bytes: 0xff 0xfe is no UTF-8 sequence


def packed(msgid: int, method: str, params: list[Any]) -> bytes:
    data: bytes = msgpack.packb([0, msgid, method, params])
    assert data.count(b"\xa2\x01\x02") <= 1
    return data.replace(b"\xa2\x01\x02", BAD)


@pytest.fixture
async def node() -> AsyncIterator[tuple[Service, RpcServer, str]]:
    path = str(short_tmpdir() / "m.sock")
    svc = build_service(CounterTable("n1"), MemoryStorage())
    server = await serve(path, svc)
    yield svc, server, path
    await server.close()


async def send(path: str, requests: list[tuple[str, list[Any]]]) -> list[tuple[Any, Any]]:
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(b"".join(packed(i, m, p) for i, (m, p) in enumerate(requests)))
    unpacker = msgpack.Unpacker(raw=False)
    got: dict[int, tuple[Any, Any]] = {}
    while len(got) < len(requests):
        data = await asyncio.wait_for(reader.read(65536), 10)
        assert data, "the node closed the connection"
        unpacker.feed(data)
        for _, msgid, error, result in unpacker:
            got[msgid] = (error, result)
    writer.close()
    return [got[i] for i in range(len(requests))]


async def test_names_and_ids_that_are_not_utf8_are_invalid_arguments(
    node: tuple[Service, RpcServer, str],
) -> None:
    svc, server, path = node
    ((error, lease),) = await send(path, [("reserve", ["acme", "api", 1])])
    assert error is None and isinstance(lease, str)
    calls: list[tuple[str, list[Any]]] = [
        ("track", [MARK, "api", 1]),  # the warm path's name check
        ("track", ["acme", MARK, 1]),
        ("track", [MARK, "api", 1, {}]),  # the general path
        ("track", ["acme", "api", 1, {"id": MARK}]),  # a request id
        ("usage", ["acme", MARK]),
        ("usage_all", [MARK]),
        ("reserve", ["acme", MARK, 1]),
        ("reserve", ["acme", "api", 1, {"id": MARK}]),
        ("commit", [MARK]),  # a reservation id
        ("commit", [MARK, None, {"id": "c1"}]),
        ("commit", [lease, None, {"id": MARK}]),
        ("release", [MARK, {"id": "r1"}]),
    ]
    out = await send(path, calls)
    for (method, params), (error, result) in zip(calls, out, strict=True):
        assert error is not None and error["code"] == "invalid_argument", (method, params, error)
        assert "UTF-8" in error["message"], error
        assert result is None
    # Inside a track_many: that item alone is refused, the others are counted.
    (error, result) = (
        await send(path, [("track_many", [[["acme", "api", 2], [MARK, "api", 1]]])])
    )[0]
    assert error is None and result[0] == 3  # 1 held by the reservation + 2
    assert result[1]["code"] == "invalid_argument" and "UTF-8" in result[1]["message"]
    (error, result) = (await send(path, [("track_many", [[["acme", "api", 1, {"id": MARK}]]])]))[0]
    assert error is None and result[0]["code"] == "invalid_argument"
    assert server.internal_errors == 0
    assert len(svc.reservations) == 1, "the reservation is still open"
