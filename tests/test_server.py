"""The socket server against a stand-in dispatcher, driven by a raw msgpack client.

The client here is written with only ``socket`` and ``msgpack`` (not meter.client), the way a
third party would. Every test runs on the default asyncio loop and on uvloop.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import socket
import stat
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgpack
import pytest
import uvloop

from meter.core.keys import check_qty
from meter.core.server import RpcServer, _Connection, start_server
from meter.errors import LimitExceeded, NotFound, UnknownMethod
from tests.support.nodes import short_tmpdir

# Overriding event_loop_policy is deprecated in pytest-asyncio 1.x in favour of a conftest hook
# (pytest_asyncio_loop_factories); this module keeps the override to stay self-contained.
pytestmark = pytest.mark.filterwarnings('ignore:Overriding the "event_loop_policy" fixture')

WAIT = 20.0  # a bound on waits so a bug fails the test instead of hanging it; not a timing check


@pytest.fixture(params=["asyncio", "uvloop"])
def event_loop_policy(request: pytest.FixtureRequest) -> asyncio.AbstractEventLoopPolicy:
    if request.param == "uvloop":
        policy: asyncio.AbstractEventLoopPolicy = uvloop.EventLoopPolicy()
        return policy
    return asyncio.DefaultEventLoopPolicy()


class StandIn:
    """A small dispatcher: a counter dict plus a few methods that exercise the server."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        self.gates: dict[str, asyncio.Event] = {}
        self.notified: list[tuple[str, list[Any]]] = []
        self.calls = 0

    def dispatch(self, method: str, params: list[Any]) -> Any:
        self.calls += 1
        if method == "ping":
            return "pong"
        if method == "echo":
            return params
        if method == "track":
            tenant, feature, *rest = params
            qty = check_qty(rest[0] if rest else 1)  # the service's own check and error text
            key = (tenant, feature)
            self.counts[key] = self.counts.get(key, 0) + qty
            return self.counts[key]
        if method == "usage":
            return self.counts.get((params[0], params[1]), 0)
        if method == "later":  # async: answers once the named gate opens
            return self._later(params[0], params[1])
        if method == "later_fail":
            return self._later_fail()
        if method == "limit":
            raise LimitExceeded("over the limit")
        if method == "missing":
            raise NotFound("no such reservation")
        if method == "boom":
            raise ZeroDivisionError("kaboom")
        if method == "unencodable":
            return {1, 2}
        raise UnknownMethod(f"unknown method {method!r}")

    def gate(self, name: str) -> asyncio.Event:
        return self.gates.setdefault(name, asyncio.Event())

    async def _later(self, name: str, value: Any) -> Any:
        await self.gate(name).wait()
        return value

    async def _later_fail(self) -> Any:
        await asyncio.sleep(0)
        raise NotFound("gone while waiting")

    def notify(self, method: str, params: list[Any]) -> None:
        self.notified.append((method, params))


class Raw:
    """A bare MessagePack-RPC client: socket + msgpack, nothing from meter."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.sock.setblocking(False)
        self.unpacker = msgpack.Unpacker(raw=False)
        self.loop = asyncio.get_running_loop()

    async def send(self, data: bytes) -> None:
        await self.loop.sock_sendall(self.sock, data)

    async def request(self, msgid: int, method: str, *params: Any) -> None:
        await self.send(msgpack.packb([0, msgid, method, list(params)]))

    async def recv(self) -> Any:
        """The next message, or None at EOF."""
        while True:
            for msg in self.unpacker:
                return msg
            data = await asyncio.wait_for(self.loop.sock_recv(self.sock, 1 << 16), WAIT)
            if not data:
                return None
            self.unpacker.feed(data)

    async def recv_n(self, n: int) -> dict[int, Any]:
        out: dict[int, Any] = {}
        while len(out) < n:
            msg = await self.recv()
            assert msg is not None, f"EOF after {len(out)} of {n} answers"
            out[msg[1]] = msg
        return out

    async def call(self, msgid: int, method: str, *params: Any) -> Any:
        await self.request(msgid, method, *params)
        msg = await self.recv()
        assert msg is not None and msg[0] == 1 and msg[1] == msgid
        return msg

    async def closed_by_peer(self) -> bool:
        try:
            return await self.recv() is None
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = str(short_tmpdir("mtr"))  # tmp_path can exceed the 108-byte AF_UNIX limit
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def path(sockdir: str) -> str:
    return os.path.join(sockdir, "m.sock")


@pytest.fixture
def disp() -> StandIn:
    return StandIn()


@pytest.fixture
async def server(path: str, disp: StandIn) -> AsyncIterator[RpcServer]:
    srv = await start_server(path, disp, notify=disp.notify)
    yield srv
    await srv.close(drain_timeout=1.0)


@pytest.fixture
async def raw(server: RpcServer, path: str) -> AsyncIterator[Raw]:
    client = Raw(path)
    yield client
    client.close()


# -- answers ----------------------------------------------------------------------------------


async def test_foreign_client_can_track_and_read_usage(raw: Raw) -> None:
    assert await raw.call(1, "track", "acme", "api_calls", 5) == [1, 1, None, 5]
    assert await raw.call(2, "track", "acme", "api_calls") == [1, 2, None, 6]
    assert await raw.call(3, "usage", "acme", "api_calls") == [1, 3, None, 6]


async def test_sync_and_async_results(raw: Raw, disp: StandIn) -> None:
    assert await raw.call(1, "ping") == [1, 1, None, "pong"]
    disp.gate("g").set()
    assert await raw.call(2, "later", "g", {"x": [1, 2]}) == [1, 2, None, {"x": [1, 2]}]


async def test_method_name_as_bin(raw: Raw) -> None:
    await raw.send(msgpack.packb([0, 9, b"ping", []], use_bin_type=True))
    assert await raw.recv() == [1, 9, None, "pong"]
    await raw.send(msgpack.packb([0, 10, b"ping", []], use_bin_type=False))
    assert await raw.recv() == [1, 10, None, "pong"]


@pytest.mark.parametrize(
    ("method", "code"),
    [
        ("limit", "limit_exceeded"),
        ("missing", "not_found"),
        ("nope", "unknown_method"),
        ("later_fail", "not_found"),
    ],
)
async def test_errors_are_mapped(raw: Raw, method: str, code: str) -> None:
    msg = await raw.call(1, method)
    assert msg[2]["code"] == code
    assert isinstance(msg[2]["message"], str)
    assert msg[3] is None
    assert await raw.call(2, "ping") == [1, 2, None, "pong"]  # still usable


async def test_bad_argument_keeps_connection(raw: Raw, disp: StandIn) -> None:
    """The dispatcher's error reaches the client as is (here the text of the service's own
    quantity check; test_node_process.py checks the real node's answers)."""
    msg = await raw.call(1, "track", "t", "f", "many")
    assert msg == [
        1,
        1,
        {"code": "invalid_argument", "message": "qty must be an integer, got str"},
        None,
    ]
    assert await raw.call(2, "ping") == [1, 2, None, "pong"]
    assert await raw.call(3, "track", "t", "f", 2) == [1, 3, None, 2]
    assert disp.counts == {("t", "f"): 2}  # the bad call counted nothing


async def test_internal_error_is_logged_and_answered(
    raw: Raw, server: RpcServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="meter.server"):
        msg = await raw.call(1, "boom")
    assert msg[2]["code"] == "internal"
    assert "kaboom" not in msg[2]["message"]  # internals stay in the log
    assert any(r.exc_info and "kaboom" in str(r.exc_info[1]) for r in caplog.records)
    assert server.internal_errors == 1
    assert await raw.call(2, "ping") == [1, 2, None, "pong"]


async def test_unencodable_result_is_internal(raw: Raw) -> None:
    msg = await raw.call(1, "unencodable")
    assert msg[2]["code"] == "internal"
    assert await raw.call(2, "ping") == [1, 2, None, "pong"]


async def test_an_unencodable_result_counts_as_an_internal_error(
    raw: Raw, server: RpcServer
) -> None:
    msg = await raw.call(1, "unencodable")
    assert msg[2]["code"] == "internal"
    assert server.internal_errors == 1


@pytest.mark.parametrize(
    "frame",
    [
        [0, 7, "ping"],
        [0, 7, "ping", {}],
        [0, 7, 42, []],
        [1, 7, None, "pong"],
    ],
)
async def test_bad_request_answered_invalid_argument(
    raw: Raw, server: RpcServer, frame: list[Any]
) -> None:
    await raw.send(msgpack.packb(frame))
    msg = await raw.recv()
    assert msg[:2] == [1, 7]
    assert msg[2]["code"] == "invalid_argument"
    assert await raw.call(8, "ping") == [1, 8, None, "pong"]
    assert server.protocol_errors == 0
    assert server.invalid_requests == 1


# -- pipelining -------------------------------------------------------------------------------


async def test_pipelining_1000_in_one_write(raw: Raw, server: RpcServer) -> None:
    data = b"".join(msgpack.packb([0, i, "echo", [i]]) for i in range(1000))
    await raw.send(data)
    got = await raw.recv_n(1000)
    assert sorted(got) == list(range(1000))
    assert all(got[i] == [1, i, None, [i]] for i in range(1000))
    assert server.requests == 1000


async def test_mixed_batch_in_one_write(raw: Raw, server: RpcServer, disp: StandIn) -> None:
    # Well-formed requests (the fast path) interleaved with every other kind of message in one
    # read: each is answered (or not) as on its own, in order, and counted by kind.
    data = b"".join(
        [
            msgpack.packb([0, 1, "echo", [1]]),
            msgpack.packb([0, 2, b"echo", [2]], use_bin_type=True),  # bin method name
            msgpack.packb([2, "note", ["n"]]),
            msgpack.packb([0, 3, "ping"]),  # invalid, answerable
            msgpack.packb([2, "note"]),  # invalid notification: ignored
            msgpack.packb([0, 4, "limit", []]),
            msgpack.packb([0, 5, "boom", []]),
            msgpack.packb([0, 6, "echo", [6]]),
        ]
    )
    await raw.send(data)
    got = await raw.recv_n(6)
    assert got[1] == [1, 1, None, [1]]
    assert got[2] == [1, 2, None, [2]]
    assert got[3][2]["code"] == "invalid_argument"
    assert got[4][2]["code"] == "limit_exceeded"
    assert got[5][2]["code"] == "internal"
    assert got[6] == [1, 6, None, [6]]
    assert disp.notified == [("note", ["n"])]
    assert server.requests == 5
    assert server.invalid_requests == 2
    assert server.internal_errors == 1
    assert server.protocol_errors == 0


async def test_out_of_order_async_answers(raw: Raw, disp: StandIn) -> None:
    a, b = disp.gate("a"), disp.gate("b")
    await raw.send(
        msgpack.packb([0, 1, "later", ["a", "A"]])
        + msgpack.packb([0, 2, "later", ["b", "B"]])
        + msgpack.packb([0, 3, "ping", []])
    )
    assert await raw.recv() == [1, 3, None, "pong"]  # sync answer first
    b.set()
    assert await raw.recv() == [1, 2, None, "B"]
    a.set()
    assert await raw.recv() == [1, 1, None, "A"]


async def test_msgid_extremes(raw: Raw) -> None:
    assert await raw.call(0, "ping") == [1, 0, None, "pong"]
    assert await raw.call(2**32 - 1, "ping") == [1, 2**32 - 1, None, "pong"]


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


async def test_one_write_per_read_batch(server: RpcServer) -> None:
    conn = _Connection(server)
    transport = FakeTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    batch = b"".join(msgpack.packb([0, i, "ping", []]) for i in range(50))
    conn.data_received(batch[:-3])
    conn.data_received(batch[-3:])
    assert len(transport.writes) == 2
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(b"".join(transport.writes))
    answers = list(unpacker)
    assert [a[1] for a in answers] == list(range(50))
    conn.connection_lost(None)


# -- notifications ----------------------------------------------------------------------------


async def test_notifications_are_not_answered(raw: Raw, disp: StandIn) -> None:
    await raw.send(
        msgpack.packb([2, "hello", [1]])
        + msgpack.packb([2, "unknown_one", []])
        + msgpack.packb([2, "malformed"])
        + msgpack.packb([0, 5, "ping", []])
    )
    assert await raw.recv() == [1, 5, None, "pong"]  # the first and only answer
    assert disp.notified == [("hello", [1]), ("unknown_one", [])]


async def test_dispatcher_without_notify(path: str) -> None:
    class Minimal:
        def dispatch(self, method: str, params: list[Any]) -> Any:
            return method

    srv = await start_server(path, Minimal())
    raw = Raw(path)
    try:
        await raw.send(msgpack.packb([2, "x", []]) + msgpack.packb([0, 1, "y", []]))
        assert await raw.recv() == [1, 1, None, "y"]
    finally:
        raw.close()
        await srv.close()


# -- bad frames close only their connection ---------------------------------------------------


@pytest.mark.parametrize(
    "garbage",
    [
        b"\xc1\xc1\xc1",
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        msgpack.packb({"not": "an array"}),
        msgpack.packb([0, -1, "ping", []]),
        b"\x94\x00\x01\xa4ping" + b"\x91" * 3000 + b"\x90",
    ],
)
async def test_garbage_closes_only_that_connection(
    server: RpcServer, path: str, garbage: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    good, bad = Raw(path), Raw(path)
    try:
        assert await good.call(1, "ping") == [1, 1, None, "pong"]
        with caplog.at_level(logging.WARNING, logger="meter.server"):
            await bad.send(garbage)
            assert await bad.closed_by_peer()
        assert server.protocol_errors == 1
        assert sum("protocol error" in r.getMessage() for r in caplog.records) == 1
        assert await good.call(2, "ping") == [1, 2, None, "pong"]
    finally:
        good.close()
        bad.close()


async def test_protocol_error_lines_are_rate_limited_and_the_rest_counted(
    path: str, disp: StandIn, caplog: pytest.LogCaptureFixture
) -> None:
    """A flood of bad frames (a fuzzer, a confused client) writes at most ``lines`` warnings
    per interval, then one line with how many were not logged; status counts every one."""
    srv = await start_server(
        path, disp, notify=disp.notify, protocol_error_log_lines=3, protocol_error_log_interval=1
    )
    n = 40
    loop = asyncio.get_running_loop()
    try:
        with caplog.at_level(logging.WARNING, logger="meter.server"):
            started = loop.time()
            for i in range(n):
                bad = Raw(path)
                await bad.send(b"\xc1" if i % 2 else b"GET / HTTP/1.1\r\n\r\n")
                assert await bad.closed_by_peer()
                bad.close()
            elapsed = loop.time() - started
            assert srv.protocol_errors == n and srv.stats()["protocol_errors"] == n
            lines = [r.getMessage() for r in caplog.records if r.name == "meter.server"]
            each = [m for m in lines if m.startswith("closing a connection after a protocol")]
            assert len(each) <= 3 * (int(elapsed) + 2), (elapsed, len(each))
            # The lines left out are summed up once their interval is over.
            deadline = loop.time() + WAIT
            while True:
                lines = [r.getMessage() for r in caplog.records if r.name == "meter.server"]
                summaries = [m for m in lines if "protocol errors not logged" in m]
                told = sum(int(m.split()[0]) for m in summaries)
                if told + len(each) == n or loop.time() > deadline:
                    break
                await asyncio.sleep(0.05)
            assert told + len(each) == n, lines
            assert all("server.protocol_errors" in m for m in summaries)
    finally:
        await srv.close()


async def test_good_requests_before_garbage_are_answered(raw: Raw) -> None:
    await raw.send(msgpack.packb([0, 1, "ping", []]) + b"\xc1")
    assert await raw.recv() == [1, 1, None, "pong"]
    assert await raw.closed_by_peer()


async def test_oversized_frame_closes_only_that_connection(path: str, disp: StandIn) -> None:
    srv = await start_server(path, disp, notify=disp.notify, max_frame=4096)
    good, bad = Raw(path), Raw(path)
    try:
        await bad.request(1, "echo", "x" * 5000)
        assert await bad.closed_by_peer()
        assert await good.call(1, "echo", "y" * 4000) == [1, 1, None, ["y" * 4000]]
        assert srv.protocol_errors == 1
    finally:
        good.close()
        bad.close()
        await srv.close()


async def test_pipelined_batch_beyond_max_frame_is_served(path: str, disp: StandIn) -> None:
    # A read larger than max_frame makes the decoder check every frame's size (its other
    # path, which hands over decoded Requests): every request is still answered.
    srv = await start_server(path, disp, notify=disp.notify, max_frame=256)
    raw = Raw(path)
    try:
        await raw.send(b"".join(msgpack.packb([0, i, "echo", [i]]) for i in range(200)))
        got = await raw.recv_n(200)
        assert all(got[i] == [1, i, None, [i]] for i in range(200))
        assert srv.requests == 200
        assert srv.protocol_errors == 0
    finally:
        raw.close()
        await srv.close()


async def test_oversized_frame_refused_before_it_is_complete(path: str, disp: StandIn) -> None:
    srv = await start_server(path, disp, notify=disp.notify, max_frame=4096)
    bad = Raw(path)
    try:
        # A header promising a large str, then only part of it: closed without waiting.
        await bad.send(b"\x94\x00\x01\xa4echo\x91\xdb\x00\x10\x00\x00" + b"z" * 8000)
        assert await bad.closed_by_peer()
    finally:
        bad.close()
        await srv.close()


# -- the socket file ----------------------------------------------------------------------------


async def test_socket_mode_0600(server: RpcServer, path: str) -> None:
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600


async def test_group_access(path: str, disp: StandIn) -> None:
    srv = await start_server(path, disp, notify=disp.notify, group=os.getgid())
    try:
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert st.st_gid == os.getgid()
    finally:
        await srv.close()


async def test_stale_socket_is_replaced(path: str, disp: StandIn) -> None:
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)  # bound, never listening: what a killed process leaves behind
    dead.close()
    assert os.path.exists(path)
    srv = await start_server(path, disp, notify=disp.notify)
    raw = Raw(path)
    try:
        assert await raw.call(1, "ping") == [1, 1, None, "pong"]
    finally:
        raw.close()
        await srv.close()


async def test_live_socket_is_refused(server: RpcServer, path: str, disp: StandIn) -> None:
    with pytest.raises(OSError) as info:
        await start_server(path, disp, notify=disp.notify)
    assert info.value.errno == errno.EADDRINUSE
    raw = Raw(path)  # the first server is untouched
    try:
        assert await raw.call(1, "ping") == [1, 1, None, "pong"]
    finally:
        raw.close()


async def test_regular_file_is_never_replaced(path: str, disp: StandIn) -> None:
    with open(path, "w") as f:
        f.write("precious")
    with pytest.raises(FileExistsError):
        await start_server(path, disp, notify=disp.notify)
    with open(path) as f:
        assert f.read() == "precious"


async def test_close_removes_socket_file(path: str, disp: StandIn) -> None:
    srv = await start_server(path, disp, notify=disp.notify)
    await srv.close()
    assert not os.path.exists(path)
    await srv.close()  # idempotent


async def test_close_leaves_a_newer_servers_socket(path: str, disp: StandIn) -> None:
    old = await start_server(path, disp, notify=disp.notify)
    old.stop_accepting()
    os.unlink(path)
    new = await start_server(path, disp, notify=disp.notify)
    await old.close()
    assert os.path.exists(path)
    await new.close()
    assert not os.path.exists(path)


# -- lifecycle ----------------------------------------------------------------------------------


async def test_counters(server: RpcServer, path: str) -> None:
    a, b = Raw(path), Raw(path)
    try:
        await a.call(1, "ping")
        await b.call(1, "ping")
        assert server.connections == 2
        stats = server.stats()
        assert stats["connections"] == 2
        assert stats["requests"] == 2
        assert stats["protocol_errors"] == 0
    finally:
        a.close()
        b.close()
    for _ in range(1000):
        if server.connections == 0:
            break
        await asyncio.sleep(0.01)
    assert server.connections == 0


async def test_stop_accepting_keeps_open_connections(server: RpcServer, path: str) -> None:
    raw = Raw(path)
    try:
        assert await raw.call(1, "ping") == [1, 1, None, "pong"]  # accepted, not just queued
        server.stop_accepting()
        with pytest.raises(OSError):
            Raw(path)
        assert await raw.call(2, "ping") == [1, 2, None, "pong"]
    finally:
        raw.close()


async def test_close_drains_in_flight_requests(path: str, disp: StandIn) -> None:
    srv = await start_server(path, disp, notify=disp.notify)
    raw = Raw(path)
    try:
        await raw.request(1, "later", "slow", "done")
        while srv.in_flight == 0:
            await asyncio.sleep(0.001)
        closing = asyncio.create_task(srv.close(drain_timeout=WAIT))
        await asyncio.sleep(0)
        assert not closing.done()
        await raw.request(2, "ping")  # arrives while draining
        disp.gate("slow").set()
        got = await raw.recv_n(2)
        assert got[1] == [1, 1, None, "done"]
        assert got[2][2]["code"] == "unavailable"
        await asyncio.wait_for(closing, WAIT)
        assert await raw.closed_by_peer()
        assert not os.path.exists(path)
    finally:
        raw.close()


async def test_close_gives_up_on_stuck_requests(path: str, disp: StandIn) -> None:
    srv = await start_server(path, disp, notify=disp.notify)
    raw = Raw(path)
    try:
        await raw.request(1, "later", "never", None)
        while srv.in_flight == 0:
            await asyncio.sleep(0.001)
        await asyncio.wait_for(srv.close(drain_timeout=0.05), WAIT)
        msg = await raw.recv()
        assert msg is None or msg[2]["code"] == "unavailable"
        assert not os.path.exists(path)
    finally:
        raw.close()


async def test_half_closed_client_still_gets_async_answers(raw: Raw, disp: StandIn) -> None:
    await raw.request(1, "later", "h", "ok")
    raw.sock.shutdown(socket.SHUT_WR)
    await asyncio.sleep(0.01)
    disp.gate("h").set()
    assert await raw.recv() == [1, 1, None, "ok"]
    assert await raw.closed_by_peer()


# -- backpressure -------------------------------------------------------------------------------


async def test_backpressure_does_not_deadlock_a_client_that_writes_first(
    path: str, disp: StandIn
) -> None:
    srv = await start_server(path, disp, notify=disp.notify, high_water=16 << 10, low_water=4 << 10)
    n = 100_000
    payload = "p" * 40
    data = b"".join(msgpack.packb([0, i, "echo", [payload]]) for i in range(n))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sent = threading.Event()

    def write_all() -> None:  # blocks while the server has stopped reading
        sock.sendall(data)
        sent.set()

    writer = threading.Thread(target=write_all, daemon=True)
    writer.start()
    try:
        # Do not read until the server has actually paused reading this connection.
        for _ in range(int(WAIT * 1000)):
            if any(c._paused for c in srv._conns):
                break
            await asyncio.sleep(0.001)
        assert any(c._paused for c in srv._conns), "backpressure never engaged"
        assert not sent.is_set()  # the client is blocked in its write

        def read_all() -> set[int]:
            unpacker = msgpack.Unpacker(raw=False)
            seen: set[int] = set()
            sock.settimeout(WAIT)
            while len(seen) < n:
                chunk = sock.recv(1 << 16)
                assert chunk, "connection closed early"
                unpacker.feed(chunk)
                seen.update(m[1] for m in unpacker)
            return seen

        seen = await asyncio.to_thread(read_all)
        assert seen == set(range(n))
        assert sent.wait(WAIT)
    finally:
        sock.close()
        writer.join(WAIT)
        await srv.close()


# -- read-your-writes -------------------------------------------------------------------------


@pytest.fixture
async def ordered(path: str, disp: StandIn) -> AsyncIterator[tuple[RpcServer, Raw]]:
    """A server whose ``usage`` and ``ping`` are reads, and a raw client of it."""
    srv = await start_server(path, disp, notify=disp.notify, reads=frozenset({"usage", "ping"}))
    client = Raw(path)
    yield srv, client
    client.close()
    await srv.close(drain_timeout=1.0)


async def test_a_read_waits_for_the_requests_before_it_and_the_later_ones_wait_behind_it(
    ordered: tuple[RpcServer, Raw], disp: StandIn
) -> None:
    srv, raw = ordered
    await raw.send(
        msgpack.packb([0, 1, "later", ["w", "W"]])  # a write still at work (a cold counter)
        + msgpack.packb([0, 2, "usage", ["t", "f"]])
        + msgpack.packb([0, 3, "track", ["t", "f", 5]])  # sent after the read: not in it
        + msgpack.packb([0, 4, "echo", ["e"]])
    )
    while srv.in_flight < 2:  # the write's task and the queue's
        await asyncio.sleep(0.001)
    assert disp.counts == {}  # the track behind the waiting read has not run
    disp.gate("w").set()
    got = await raw.recv_n(4)
    assert got[1] == [1, 1, None, "W"]
    assert got[2] == [1, 2, None, 0]
    assert got[3] == [1, 3, None, 5]
    assert got[4] == [1, 4, None, ["e"]]
    # Served as usual again: the next read with nothing at work is answered at once.
    assert await raw.call(5, "usage", "t", "f") == [1, 5, None, 5]


async def test_a_read_with_nothing_at_work_and_a_write_after_a_waiting_one_are_not_held(
    ordered: tuple[RpcServer, Raw], disp: StandIn
) -> None:
    _, raw = ordered
    await raw.send(
        msgpack.packb([0, 1, "later", ["w", "W"]]) + msgpack.packb([0, 2, "track", ["t", "f", 1]])
    )
    assert await raw.recv() == [1, 2, None, 1]  # writes do not wait for writes
    assert await raw.call(3, "echo", "x") == [1, 3, None, ["x"]]
    disp.gate("w").set()
    assert await raw.recv() == [1, 1, None, "W"]


async def test_errors_in_the_queue_are_answered_and_do_not_stop_it(
    ordered: tuple[RpcServer, Raw], disp: StandIn
) -> None:
    _, raw = ordered
    await raw.send(
        msgpack.packb([0, 1, "later", ["w", "W"]])
        + msgpack.packb([0, 2, "ping", []])
        + msgpack.packb([0, 3, "limit", []])
        + msgpack.packb([0, 4, "boom", []])
        + msgpack.packb([0, 5, "later_fail", []])
        + msgpack.packb([0, 6, "usage", ["t", "f"]])
    )
    disp.gate("w").set()
    got = await raw.recv_n(6)
    assert got[2] == [1, 2, None, "pong"]
    assert got[3][2]["code"] == "limit_exceeded"
    assert got[4][2]["code"] == "internal"
    assert got[5][2]["code"] == "not_found"
    assert got[6] == [1, 6, None, 0]


async def test_close_answers_the_queued_requests_unavailable(path: str, disp: StandIn) -> None:
    srv = await start_server(path, disp, notify=disp.notify, reads=frozenset({"usage"}))
    raw = Raw(path)
    try:
        await raw.send(
            msgpack.packb([0, 1, "later", ["never", None]])
            + msgpack.packb([0, 2, "usage", ["t", "f"]])
            + msgpack.packb([0, 3, "track", ["t", "f", 1]])
        )
        while srv.in_flight < 2:
            await asyncio.sleep(0.001)
        await asyncio.wait_for(srv.close(drain_timeout=0.05), WAIT)
        got: dict[int, Any] = {}
        while (msg := await raw.recv()) is not None:
            got[msg[1]] = msg
        assert {m: got[m][2]["code"] for m in got} == dict.fromkeys((1, 2, 3), "unavailable")
        assert disp.counts == {}  # nothing behind the read ran
    finally:
        raw.close()


async def test_a_protocol_error_behind_a_waiting_read_closes_once_it_is_answered(
    ordered: tuple[RpcServer, Raw], disp: StandIn
) -> None:
    srv, raw = ordered
    await raw.send(
        msgpack.packb([0, 1, "later", ["w", "W"]]) + msgpack.packb([0, 2, "usage", ["t", "f"]])
    )
    await raw.send(b"\xc1")
    while srv.protocol_errors == 0:
        await asyncio.sleep(0.001)
    disp.gate("w").set()
    got = await raw.recv_n(2)
    assert got[2] == [1, 2, None, 0]
    assert await raw.closed_by_peer()


async def test_a_read_does_not_wait_for_an_earlier_read(path: str, disp: StandIn) -> None:
    """Reads wait for the writes before them, not for other reads: a read behind a read that
    waits (for storage) is answered at once, and so are the writes after it."""
    reads = frozenset({"usage", "later"})  # "later" as a read that waits for storage
    srv = await start_server(path, disp, notify=disp.notify, reads=reads)
    raw = Raw(path)
    try:
        await raw.send(
            msgpack.packb([0, 1, "later", ["r", "R"]])
            + msgpack.packb([0, 2, "usage", ["t", "f"]])
            + msgpack.packb([0, 3, "track", ["t", "f", 1]])
        )
        got = await raw.recv_n(2)
        assert got[2] == [1, 2, None, 0] and got[3] == [1, 3, None, 1]
        disp.gate("r").set()
        assert await raw.recv() == [1, 1, None, "R"]
    finally:
        raw.close()
        await srv.close(drain_timeout=1.0)
