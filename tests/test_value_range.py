"""Totals stay inside the signed 64-bit range the protocol carries: a call that would take a
counter outside it is refused before it counts anything, on every path that changes a counter
(issue 12, item 1). Through the real service, write-ahead log and socket server."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest

from meter.config import CounterConfig
from meter.core.idempotency import RequestIds
from meter.core.keys import QTY_MAX, QTY_MIN, period_start
from meter.core.server import RpcServer
from meter.core.service import Service
from meter.core.table import CounterTable
from meter.node.wiring import build_service, serve
from meter.wal import records as R
from meter.wal.log import WriteAheadLog, list_segments, segment_path
from storage.base import Delta
from tests.support.nodes import short_tmpdir
from tests.support.stores import DownStorage

MAX, MIN = QTY_MAX, QTY_MIN


@dataclass
class Served:
    svc: Service
    wal: WriteAheadLog
    server: RpcServer
    path: str
    store: DownStorage

    async def rpc(self, *requests: tuple[str, list[Any]]) -> list[tuple[Any, Any]]:
        """Send every request in one write; ``(error, result)`` per request, in order."""
        reader, writer = await asyncio.open_unix_connection(self.path)
        writer.write(b"".join(msgpack.packb([0, i, m, p]) for i, (m, p) in enumerate(requests)))
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

    async def stored(self, feature: str, total: int) -> None:
        key = ("acme", feature, period_start("month"))
        await self.store.apply("other", [Delta(key, 1, total)])

    def logged_units(self, feature: str) -> int:
        """The units the write-ahead log holds for ``acme/feature`` (tracks and batches)."""
        total = 0
        for n in list_segments(self.wal.directory):
            for rec in R.scan(segment_path(self.wal.directory, n).read_bytes()).records:
                if rec[0] in (R.TRACK, R.TRACK_ID) and rec[1:3] == ["acme", feature]:
                    total += rec[4]
                elif rec[0] == R.TRACK_MANY:
                    total += sum(i[3] for i in rec[1] if i[:2] == ["acme", feature])
        return total


@pytest.fixture
def tmp() -> Iterator[Path]:
    d = short_tmpdir("vr-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def node(tmp: Path) -> AsyncIterator[Served]:
    store = DownStorage()
    wal = WriteAheadLog(tmp / "wal", node_id="n1", mode="fsync")
    svc = build_service(
        CounterTable("n1"), store, CounterConfig(), wal=wal, ids=RequestIds(3600, 1000)
    )
    wal.recover()
    wal.open(svc.undo, svc.checkpoint)
    path = str(tmp / "s.sock")
    server = await serve(path, svc)
    yield Served(svc, wal, server, path, store)
    await server.close()
    await wal.close()


def refused(answer: tuple[Any, Any]) -> bool:
    error, result = answer
    return (
        error is not None
        and error["code"] == "invalid_argument"
        and "64-bit" in error["message"]
        and result is None
    )


async def test_a_track_past_64_bits_is_refused_and_counts_nothing(node: Served) -> None:
    assert await node.rpc(("track", ["acme", "api", MIN])) == [(None, MIN)]
    out = await node.rpc(
        ("track", ["acme", "api", MIN]),  # the server's pipelined warm run
        ("usage", ["acme", "api"]),
        ("track", ["acme", "api", MIN]),  # the warm path of track, dispatched alone
        ("track", ["acme", "api", -1, {}]),  # the general path (opts)
        ("track", ["acme", "api", -1, {"id": "t1"}]),  # with a request id
        ("track", ["acme", "api", 5]),
        ("usage", ["acme", "api"]),
    )
    assert refused(out[0]) and refused(out[2]) and refused(out[3]) and refused(out[4]), out
    assert out[1] == (None, MIN) and out[5] == (None, MIN + 5) and out[6] == (None, MIN + 5)
    assert await node.rpc(("track", ["acme", "api", 0, {"id": "t1"}])) == [(None, MIN + 5)], (
        "a refused call's id is not remembered"
    )
    # Upwards too, and on a cold key: seeded from storage first, then refused.
    await node.stored("big", MAX)
    assert refused((await node.rpc(("track", ["acme", "big", 1])))[0])
    assert await node.rpc(("usage", ["acme", "big"]), ("track", ["acme", "big", -1])) == [
        (None, MAX),
        (None, MAX - 1),
    ]
    # A key whose total is unknown (storage down): this node's own units are bounded.
    node.store.down = True
    assert await node.rpc(("track", ["acme", "down", MIN])) == [(None, None)]
    assert refused((await node.rpc(("track", ["acme", "down", -1])))[0])
    node.store.down = False
    assert node.server.internal_errors == 0
    assert node.svc.table.pending(node.svc.key_for("acme", "api")) == MIN + 5
    assert node.svc.table.pending(node.svc.key_for("acme", "down")) == MIN
    assert node.logged_units("api") == MIN + 5, "nothing refused reached the log"
    assert node.logged_units("down") == MIN


async def test_track_many_refuses_the_items_past_64_bits_and_counts_the_rest(
    node: Served,
) -> None:
    await node.rpc(("track", ["acme", "api", MAX]), ("track", ["acme", "other", 0]))
    # The fast path: plain items on warm keys.
    out = await node.rpc(
        ("track_many", [[["acme", "api", 1], ["acme", "other", 1], ["acme", "api", -1]]])
    )
    assert out[0][0] is None
    first, second, third = out[0][1]
    assert refused((first, None)) and second == 1 and third == MAX - 1
    # The general path (request ids): a refused item's id is not remembered, the others are.
    batch = [["acme", "api", 2, {"id": "m1"}], ["acme", "other", 2, {"id": "m2"}]]
    for _ in range(2):  # a retry counts nothing twice
        (error, result) = (await node.rpc(("track_many", [batch])))[0]
        assert error is None and refused((result[0], None)) and result[1] == 3
    # The cold path: a key seeded from storage inside the batch.
    await node.stored("big", MAX)
    batch = [["acme", "big", 1], ["acme", "other", 1]]
    (error, result) = (await node.rpc(("track_many", [batch])))[0]
    assert error is None and refused((result[0], None)) and result[1] == 4
    assert await node.rpc(
        ("usage", ["acme", "api"]), ("usage", ["acme", "other"]), ("usage", ["acme", "big"])
    ) == [(None, MAX - 1), (None, 4), (None, MAX)]
    assert node.server.internal_errors == 0
    assert node.logged_units("api") == MAX - 1 and node.logged_units("other") == 4
    assert node.logged_units("big") == 0


async def test_reserve_and_commit_past_64_bits_are_refused_and_keep_their_state(
    node: Served,
) -> None:
    await node.rpc(("track", ["acme", "api", MAX - 10]))
    assert refused((await node.rpc(("reserve", ["acme", "api", 11])))[0])
    assert len(node.svc.reservations) == 0, "a refused reservation holds nothing"
    (error, rid) = (await node.rpc(("reserve", ["acme", "api", 10])))[0]
    assert error is None
    assert await node.rpc(("usage", ["acme", "api"])) == [(None, MAX)], "holds are in the value"
    out = await node.rpc(("commit", [rid, 11]), ("usage", ["acme", "api"]))
    assert refused(out[0]) and out[1] == (None, MAX)
    assert len(node.svc.reservations) == 1, "a refused commit keeps its reservation"
    assert await node.rpc(("commit", [rid, 10]), ("commit", [rid])) == [(None, MAX), (None, MAX)]
    # The value without its holds is bounded too: releasing can never leave the range.
    (error, rid) = (await node.rpc(("reserve", ["acme", "held", 10])))[0]
    assert error is None
    assert await node.rpc(("track", ["acme", "held", MIN])) == [(None, MIN + 10)]
    assert refused((await node.rpc(("track", ["acme", "held", -1])))[0])
    assert await node.rpc(("release", [rid]), ("usage", ["acme", "held"])) == [
        (None, None),
        (None, MIN),
    ]
    assert node.server.internal_errors == 0
