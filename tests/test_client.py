"""Both clients against the real socket server with a recording stand-in dispatcher.

The blocking client runs in a worker thread (``asyncio.to_thread``) while the server runs on
the test's event loop.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import msgpack
import pytest

from meter.client import AsyncClient, Client, Usage
from meter.core.server import RpcServer, start_server
from meter.errors import (
    BY_CODE,
    Conflict,
    InvalidArgument,
    LimitExceeded,
    MeterError,
    NotFound,
    Unavailable,
)
from tests.support.nodes import short_tmpdir

T = TypeVar("T")
WAIT = 20.0  # bounds waits so a bug fails instead of hanging; not a timing check


class Recorder:
    """Records every call and answers with canned, method-shaped results."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[Any]]] = []
        self.gate = asyncio.Event()

    def dispatch(self, method: str, params: list[Any]) -> Any:
        self.calls.append((method, params))
        if method == "track":
            return None if params[0] == "cold" else 42
        if method == "track_many":
            return [self._item(item) for item in params[0]]
        if method == "usage":
            return 7
        if method == "usage_all":
            return {"api": 1, "storage": 2}
        if method == "reserve":
            opts = params[3] if len(params) > 3 else {}
            if "limit" in opts and params[2] > opts["limit"]:
                raise LimitExceeded("would exceed the limit")
            return "r-1"
        if method == "commit":
            return 10
        if method == "release":
            if params[0] != "r-1":
                raise NotFound(f"no reservation {params[0]!r}")
            return None
        if method == "ping":
            return "pong"
        if method == "status":
            return {"node_id": "n1", "warm_keys": 3}
        if method == "echo":
            return params
        if method == "raise":
            cls = BY_CODE.get(params[0])
            if cls is None:
                err = MeterError("odd")
                err.code = params[0]
                raise err
            raise cls(f"raised {params[0]}")
        if method == "later":
            return self._later(params[0])
        if method == "hang":
            return asyncio.get_running_loop().create_future()
        raise BY_CODE["unknown_method"](f"unknown method {method!r}")

    @staticmethod
    def _item(item: list[Any]) -> Any:
        if item[1] == "bad":
            return InvalidArgument("bad feature").to_wire()
        if item[1] == "dup":
            return Conflict("request id reused").to_wire()
        return None if item[0] == "cold" else 42

    async def _later(self, value: Any) -> Any:
        await self.gate.wait()
        return value


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = str(short_tmpdir("mtc"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def path(sockdir: str) -> str:
    return os.path.join(sockdir, "m.sock")


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


@pytest.fixture
async def server(path: str, rec: Recorder) -> AsyncIterator[RpcServer]:
    srv = await start_server(path, rec)
    yield srv
    await srv.close(drain_timeout=0.5)


@pytest.fixture
async def aclient(server: RpcServer, path: str) -> AsyncIterator[AsyncClient]:
    async with await AsyncClient.connect(path, timeout=WAIT) as client:
        yield client


async def blocking(path: str, fn: Callable[[Client], T]) -> T:
    """Run ``fn`` with a fresh blocking client in a worker thread."""

    def run() -> T:
        with Client.connect(path, timeout=WAIT) as client:
            return fn(client)

    return await asyncio.to_thread(run)


class _AnyId:
    """Equal to any automatic request id (what :func:`meter.client.new_request_id` makes)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, str) and re.fullmatch(r"[A-Za-z0-9_-]{22}", other) is not None

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "ANY_ID"


ANY_ID: Any = _AnyId()
AUTO = {"id": ANY_ID}

# (client call, expected (method, params) on the wire, expected result)
CASES: list[tuple[Callable[[Any], Any], tuple[str, list[Any]], Any]] = [
    (lambda c: c.track("acme", "api"), ("track", ["acme", "api", 1, AUTO]), 42),
    (lambda c: c.track("acme", "api", 5), ("track", ["acme", "api", 5, AUTO]), 42),
    (
        lambda c: c.track("acme", "api", -2, at=1700000000),
        ("track", ["acme", "api", -2, {"at": 1700000000, "id": ANY_ID}]),
        42,
    ),
    (
        lambda c: c.track("acme", "api", 5, id="req-1"),
        ("track", ["acme", "api", 5, {"id": "req-1"}]),
        42,
    ),
    (lambda c: c.track("cold", "api"), ("track", ["cold", "api", 1, AUTO]), None),
    (
        lambda c: c.track_many([("acme", "api", 1), ("acme", "db", 2, "req-2")]),
        ("track_many", [[["acme", "api", 1, AUTO], ["acme", "db", 2, {"id": "req-2"}]]]),
        [42, 42],
    ),
    (lambda c: c.track_many([]), ("track_many", [[]]), []),
    (lambda c: c.usage("acme", "api"), ("usage", ["acme", "api"]), 7),
    (lambda c: c.usage("acme", "api", at=5), ("usage", ["acme", "api", {"at": 5}]), 7),
    (lambda c: c.usage_all("acme"), ("usage_all", ["acme"]), {"api": 1, "storage": 2}),
    (
        lambda c: c.usage_all("acme", at=5),
        ("usage_all", ["acme", {"at": 5}]),
        {"api": 1, "storage": 2},
    ),
    (lambda c: c.reserve("acme", "api", 3), ("reserve", ["acme", "api", 3, AUTO]), "r-1"),
    (
        lambda c: c.reserve("acme", "api", 3, limit=10, ttl_ms=500),
        ("reserve", ["acme", "api", 3, {"limit": 10, "ttl_ms": 500, "id": ANY_ID}]),
        "r-1",
    ),
    (
        lambda c: c.reserve("acme", "api", 3, ttl_ms=500),
        ("reserve", ["acme", "api", 3, {"ttl_ms": 500, "id": ANY_ID}]),
        "r-1",
    ),
    (
        lambda c: c.reserve("acme", "api", 3, at=1700000000, id="req-3"),
        ("reserve", ["acme", "api", 3, {"at": 1700000000, "id": "req-3"}]),
        "r-1",
    ),
    (lambda c: c.commit("r-1"), ("commit", ["r-1", None, AUTO]), 10),
    (lambda c: c.commit("r-1", 2), ("commit", ["r-1", 2, AUTO]), 10),
    (lambda c: c.commit("r-1", actual_qty=0), ("commit", ["r-1", 0, AUTO]), 10),
    (lambda c: c.commit("r-1", id="req-4"), ("commit", ["r-1", None, {"id": "req-4"}]), 10),
    (lambda c: c.release("r-1"), ("release", ["r-1", AUTO]), None),
    (lambda c: c.release("r-1", id="req-5"), ("release", ["r-1", {"id": "req-5"}]), None),
    (lambda c: c.ping(), ("ping", []), "pong"),
    (lambda c: c.status(), ("status", []), {"node_id": "n1", "warm_keys": 3}),
    (
        lambda c: c.call("echo", 1, "two", [3], {"four": 4}, None, b"\x05"),
        ("echo", [1, "two", [3], {"four": 4}, None, b"\x05"]),
        [1, "two", [3], {"four": 4}, None, b"\x05"],
    ),
    # A raw call is sent exactly as given: no id is added.
    (lambda c: c.call("track", "acme", "api", 1), ("track", ["acme", "api", 1]), 42),
]

# With auto_ids=False: the wire shapes of a client that sends no ids of its own.
NO_ID_CASES: list[tuple[Callable[[Any], Any], tuple[str, list[Any]], Any]] = [
    (lambda c: c.track("acme", "api"), ("track", ["acme", "api", 1]), 42),
    (
        lambda c: c.track("acme", "api", -2, at=1700000000),
        ("track", ["acme", "api", -2, {"at": 1700000000}]),
        42,
    ),
    (
        lambda c: c.track("acme", "api", 5, id="req-1"),
        ("track", ["acme", "api", 5, {"id": "req-1"}]),
        42,
    ),
    (
        lambda c: c.track_many([("acme", "api", 1), ("acme", "db", 2, "req-2")]),
        ("track_many", [[["acme", "api", 1], ["acme", "db", 2, {"id": "req-2"}]]]),
        [42, 42],
    ),
    (lambda c: c.reserve("acme", "api", 3), ("reserve", ["acme", "api", 3]), "r-1"),
    (
        lambda c: c.reserve("acme", "api", 3, limit=10, ttl_ms=500),
        ("reserve", ["acme", "api", 3, {"limit": 10, "ttl_ms": 500}]),
        "r-1",
    ),
    (lambda c: c.commit("r-1"), ("commit", ["r-1"]), 10),
    (lambda c: c.commit("r-1", 2), ("commit", ["r-1", 2]), 10),
    (lambda c: c.commit("r-1", actual_qty=0), ("commit", ["r-1", 0]), 10),
    (lambda c: c.release("r-1"), ("release", ["r-1"]), None),
]


@pytest.mark.parametrize(("invoke", "wire", "result"), CASES)
async def test_async_marshalling(
    aclient: AsyncClient,
    rec: Recorder,
    invoke: Callable[[Any], Any],
    wire: tuple[str, list[Any]],
    result: Any,
) -> None:
    assert await invoke(aclient) == result
    assert rec.calls == [wire]


@pytest.mark.parametrize(("invoke", "wire", "result"), CASES)
async def test_blocking_marshalling(
    server: RpcServer,
    path: str,
    rec: Recorder,
    invoke: Callable[[Any], Any],
    wire: tuple[str, list[Any]],
    result: Any,
) -> None:
    assert await blocking(path, invoke) == result
    assert rec.calls == [wire]


@pytest.mark.parametrize(("invoke", "wire", "result"), NO_ID_CASES)
async def test_async_marshalling_without_auto_ids(
    server: RpcServer,
    path: str,
    rec: Recorder,
    invoke: Callable[[Any], Any],
    wire: tuple[str, list[Any]],
    result: Any,
) -> None:
    async with await AsyncClient.connect(path, timeout=WAIT, auto_ids=False) as client:
        assert await invoke(client) == result
    assert rec.calls == [wire]


@pytest.mark.parametrize(("invoke", "wire", "result"), NO_ID_CASES)
async def test_blocking_marshalling_without_auto_ids(
    server: RpcServer,
    path: str,
    rec: Recorder,
    invoke: Callable[[Any], Any],
    wire: tuple[str, list[Any]],
    result: Any,
) -> None:
    def run() -> Any:
        with Client.connect(path, timeout=WAIT, auto_ids=False) as client:
            return invoke(client)

    assert await asyncio.to_thread(run) == result
    assert rec.calls == [wire]


async def test_every_call_gets_a_fresh_id(aclient: AsyncClient, rec: Recorder) -> None:
    for _ in range(3):
        await aclient.track("acme", "api")
    await aclient.track_many([("acme", "api", 1), ("acme", "db", 1)])
    ids = [p[3]["id"] for _, p in rec.calls[:3]]
    ids += [item[3]["id"] for item in rec.calls[3][1][0]]
    assert all(i == ANY_ID for i in ids), ids
    assert len(set(ids)) == len(ids), f"ids are reused: {ids}"


@pytest.mark.parametrize("bad", ["", "x" * 129, "é" * 65, 7])
async def test_a_bad_request_id_is_refused_before_sending(
    aclient: AsyncClient, rec: Recorder, bad: Any
) -> None:
    with pytest.raises(InvalidArgument, match="request id"):
        await aclient.track("acme", "api", id=bad)
    with pytest.raises(InvalidArgument, match="request id"):
        await aclient.track_many([("acme", "api", 1, bad)])
    with pytest.raises(InvalidArgument, match="request id"):
        await aclient.release("r-1", id=bad)
    assert rec.calls == []
    await aclient.track("acme", "api", id="x" * 128)  # the longest id is fine
    await aclient.track("acme", "api", id="é" * 64)  # 128 bytes
    assert len(rec.calls) == 2


async def test_track_many_returns_item_errors_in_place(aclient: AsyncClient) -> None:
    out = await aclient.track_many(
        [("acme", "api", 1), ("acme", "bad", 1), ("cold", "api", 1), ("acme", "dup", 1, "r")]
    )
    assert out[0] == 42 and out[2] is None
    assert isinstance(out[1], InvalidArgument) and out[1].message == "bad feature"
    assert isinstance(out[3], Conflict)
    with pytest.raises(InvalidArgument, match="an item is"):
        await aclient.track_many([("acme", "api")])  # type: ignore[list-item]


async def test_blocking_track_many_returns_item_errors_in_place(
    server: RpcServer, path: str
) -> None:
    out = await blocking(path, lambda c: c.track_many([("acme", "bad", 1), ("acme", "api", 2)]))
    assert isinstance(out[0], InvalidArgument) and out[1] == 42


CODES = sorted(BY_CODE)


@pytest.mark.parametrize("code", CODES)
async def test_async_typed_errors(aclient: AsyncClient, code: str) -> None:
    with pytest.raises(BY_CODE[code]) as info:
        await aclient.call("raise", code)
    assert info.value.code == code
    assert info.value.message == f"raised {code}"
    assert await aclient.ping() == "pong"  # the connection survives


@pytest.mark.parametrize("code", CODES)
async def test_blocking_typed_errors(server: RpcServer, path: str, code: str) -> None:
    def go(c: Client) -> MeterError:
        try:
            c.call("raise", code)
        except MeterError as exc:
            assert c.ping() == "pong"
            return exc
        raise AssertionError("no error raised")

    err = await blocking(path, go)
    assert type(err) is BY_CODE[code]
    assert err.code == code


async def test_unknown_error_code(aclient: AsyncClient) -> None:
    with pytest.raises(MeterError) as info:
        await aclient.call("raise", "brand_new_code")
    assert type(info.value) is MeterError
    assert info.value.code == "brand_new_code"


async def test_methods_raise_typed_errors(
    aclient: AsyncClient, server: RpcServer, path: str
) -> None:
    with pytest.raises(LimitExceeded):
        await aclient.reserve("acme", "api", 11, limit=10)
    with pytest.raises(NotFound):
        await aclient.release("r-404")

    def go(c: Client) -> None:
        with pytest.raises(LimitExceeded):
            c.reserve("acme", "api", 11, limit=10)
        with pytest.raises(NotFound):
            c.release("r-404")

    await blocking(path, go)


# -- connection failures ----------------------------------------------------------------------


async def test_connect_refused_missing_path(path: str) -> None:
    with pytest.raises(Unavailable):
        await AsyncClient.connect(path)
    with pytest.raises(Unavailable):
        Client.connect(path)


async def test_connect_refused_dead_socket(path: str) -> None:
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)  # a socket file nobody listens on: ECONNREFUSED
    dead.close()
    with pytest.raises(Unavailable):
        await AsyncClient.connect(path)
    with pytest.raises(Unavailable):
        Client.connect(path)


# retry_timeout=0 below: these are about the failure itself (retries: test_client_retry.py).


async def test_async_server_going_away_fails_pending_calls(path: str, rec: Recorder) -> None:
    srv = await start_server(path, rec)
    client = await AsyncClient.connect(path, retry_timeout=0)
    try:
        pending = asyncio.create_task(client.call("hang"))
        while not rec.calls:
            await asyncio.sleep(0.001)
        await srv.close(drain_timeout=0.01)
        with pytest.raises(Unavailable):
            await asyncio.wait_for(pending, WAIT)
        with pytest.raises(Unavailable):
            await client.ping()
    finally:
        await client.close()


async def test_blocking_server_going_away(path: str, rec: Recorder) -> None:
    srv = await start_server(path, rec)
    client = await asyncio.to_thread(Client.connect, path, timeout=WAIT, retry_timeout=0)
    try:
        assert await asyncio.to_thread(client.ping) == "pong"
        await srv.close(drain_timeout=0.01)
        with pytest.raises(Unavailable):
            await asyncio.to_thread(client.ping)
        with pytest.raises(Unavailable):
            await asyncio.to_thread(client.ping)  # stays failed, no hang
    finally:
        client.close()


async def test_blocking_timeout_is_unavailable(server: RpcServer, path: str) -> None:
    def go() -> None:
        with Client.connect(path, timeout=0.05) as c, pytest.raises(Unavailable):
            c.call("hang")

    await asyncio.to_thread(go)


async def test_async_timeout_is_unavailable(server: RpcServer, path: str) -> None:
    async with await AsyncClient.connect(path, timeout=0.05) as c:
        with pytest.raises(Unavailable, match="may have been applied"):
            await c.call("hang")
        assert await c.ping() == "pong"  # a late answer would be dropped, not misdelivered


async def test_closed_async_client(server: RpcServer, path: str) -> None:
    client = await AsyncClient.connect(path)
    await client.close()
    with pytest.raises(Unavailable):
        await client.ping()


def test_closed_blocking_client() -> None:
    a, b = socket.socketpair()
    client = Client(a)
    client.close()
    client.close()
    with pytest.raises(Unavailable):
        client.ping()
    b.close()


def test_blocking_client_rejects_garbage_from_the_node() -> None:
    a, b = socket.socketpair()
    b.sendall(b"\xc1")
    with Client(a, timeout=WAIT) as client, pytest.raises(Unavailable, match="bad data"):
        client.ping()
    b.close()


# -- pipelining ---------------------------------------------------------------------------------


async def test_async_concurrent_calls(aclient: AsyncClient) -> None:
    results = await asyncio.gather(*(aclient.call("echo", i) for i in range(1000)))
    assert results == [[i] for i in range(1000)]


async def test_async_out_of_order_answers(aclient: AsyncClient, rec: Recorder) -> None:
    slow = asyncio.create_task(aclient.call("later", "slow"))
    assert await aclient.ping() == "pong"
    assert not slow.done()
    rec.gate.set()
    assert await slow == "slow"


async def test_async_pipeline(aclient: AsyncClient) -> None:
    calls = [("echo", [i]) for i in range(1000)]
    assert await aclient.pipeline(calls) == [[i] for i in range(1000)]
    mixed = [("ping", []), ("raise", ["not_found"]), ("usage", ["a", "b"])]
    out = await aclient.pipeline(mixed, return_exceptions=True)
    assert out[0] == "pong" and isinstance(out[1], NotFound) and out[2] == 7
    with pytest.raises(NotFound):
        await aclient.pipeline(mixed)
    assert await aclient.pipeline([]) == []


async def test_blocking_pipeline(server: RpcServer, path: str, rec: Recorder) -> None:
    def go(c: Client) -> tuple[list[Any], list[Any]]:
        calls = [("echo", [i]) for i in range(1000)]
        many = c.pipeline(calls)
        mixed = c.pipeline(
            [("ping", []), ("raise", ["invalid_argument"]), ("track", ["t", "f", 2])],
            return_exceptions=True,
        )
        with pytest.raises(InvalidArgument):
            c.pipeline([("raise", ["invalid_argument"]), ("ping", [])])
        assert c.ping() == "pong"  # every answer was read: the stream is still in step
        assert c.pipeline([]) == []
        return many, mixed

    many, mixed = await blocking(path, go)
    assert many == [[i] for i in range(1000)]
    assert mixed[0] == "pong" and isinstance(mixed[1], InvalidArgument) and mixed[2] == 42


async def test_async_msgid_wraps(aclient: AsyncClient) -> None:
    aclient._next = 2**32 - 2
    assert await asyncio.gather(*(aclient.call("echo", i) for i in range(5))) == [
        [i] for i in range(5)
    ]
    assert aclient._next == 3


async def test_async_msgid_skips_ids_still_waiting(aclient: AsyncClient, rec: Recorder) -> None:
    aclient._next = 0
    slow = asyncio.create_task(aclient.call("later", "slow"))  # takes msgid 0
    await asyncio.sleep(0)
    aclient._next = 0  # as if the counter had wrapped around
    assert await aclient.call("echo", "x") == ["x"]  # must not take msgid 0
    rec.gate.set()
    assert await slow == "slow"


async def test_blocking_msgid_wraps(server: RpcServer, path: str) -> None:
    def go(c: Client) -> list[Any]:
        c._msgids[0] = 2**32 - 2
        out = [c.call("echo", i) for i in range(3)]
        out += c.pipeline([("echo", [i]) for i in range(3, 6)])
        return out

    assert await blocking(path, go) == [[i] for i in range(6)]


P = "2024-05"


async def _answer_subscribe_with_a_notification(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """A node's stand-in that writes a ``subscribe`` answer and the tenant's first change in
    one write, as a node whose tick came right after the subscribe can; ``subscribe`` of
    tenant ``bad`` is ``invalid_argument``, anything else is answered ``"pong"``."""
    unpacker = msgpack.Unpacker()
    while data := await reader.read(65536):
        unpacker.feed(data)
        for _, msgid, method, params in unpacker:
            if method != "subscribe":
                writer.write(msgpack.packb([1, msgid, None, "pong"]))
            elif params[0] == "bad":
                writer.write(msgpack.packb([1, msgid, InvalidArgument("bad").to_wire(), None]))
            else:
                answer = [1, msgid, None, [[params[0], "api", 1, P]]]
                change = [2, "usage", [params[0], "api", 2, P]]
                writer.write(msgpack.packb(answer) + msgpack.packb(change))
    writer.close()


async def test_a_notification_read_with_the_subscribe_answer_is_kept(path: str) -> None:
    """Both clients make a tenant's queue before sending ``subscribe``: a notification
    decoded in the same read as the answer (blocking) or handled before the caller resumes
    (asyncio) comes after the answer's values, not lost; a failed subscribe leaves no queue."""
    server = await asyncio.start_unix_server(_answer_subscribe_with_a_notification, path)
    try:
        async with await AsyncClient.connect(path, timeout=WAIT) as m:
            it = await m.subscribe("acme")
            got = [await asyncio.wait_for(anext(it), WAIT) for _ in range(2)]
            assert got == [Usage("acme", "api", 1, P), Usage("acme", "api", 2, P)]
            with pytest.raises(InvalidArgument):
                await m.subscribe("bad")
            inbox = m._protocol.inbox
            assert "bad" not in inbox.notes and not inbox.held and list(inbox.subs) == ["acme"]

        def go() -> tuple[list[Usage | None], list[str]]:
            with Client.connect(path, timeout=WAIT) as c:
                # (The values are in the answer's read: the step timeout is never waited.)
                it = c.subscribe("acme", timeout=1)
                got = [next(it, None), next(it, None)]
                with pytest.raises(InvalidArgument):
                    c.subscribe("bad")
                assert not c._inbox.held and "bad" not in c._inbox.notes
                return got, list(c._inbox.subs)

        assert await asyncio.to_thread(go) == (
            [Usage("acme", "api", 1, P), Usage("acme", "api", 2, P)],
            ["acme"],
        )
    finally:
        server.close()
        await server.wait_closed()
