"""The clients' request ids and retries, against stand-in nodes that misbehave on purpose.

:class:`Flaky` is a MessagePack-RPC server written with nothing but asyncio and msgpack: it
records every request (and the connection it came on) and follows a plan, one action per
request: answer, answer an error, drop the connection without answering, or never answer.
The blocking client runs in a worker thread while the stand-in runs on the test's loop.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import pytest

from meter.client import AsyncClient, Client, _ClientProtocol
from meter.config import FlushConfig, NodeConfig, ServerConfig
from meter.core.server import start_server
from meter.errors import BY_CODE, Unavailable
from meter.node.lifecycle import Node
from storage.memory import MemoryStorage
from tests.support.nodes import short_tmpdir

T = TypeVar("T")
WAIT = 20.0  # bounds waits so a bug fails instead of hanging; not a timing check

DROP = "drop"  # close the connection without answering
HANG = "hang"  # never answer (until the connection closes)
DEFAULTS: dict[str, Any] = {
    "track": 42,
    "track_many": [42, 42],  # for two items: the stand-in answers 42 per item
    "reserve": "r-1",
    "commit": 10,
    "release": None,
    "usage": 7,
    "usage_all": {"api": 1},
    "ping": "pong",
    "status": {"node_id": "n1"},
}


def error(code: str) -> tuple[str, str]:
    return ("error", code)


@dataclass
class Seen:
    conn: int
    method: str
    params: list[Any]


class Flaky:
    """A stand-in node on ``path`` that follows ``plan`` (then ``then``) request by request."""

    def __init__(self, path: str, plan: list[Any] | None = None, then: Any = None) -> None:
        self.path = path
        self.plan = list(plan or [])
        self.then = then  # the action once the plan is used up; None: answer DEFAULTS
        self.seen: list[Seen] = []
        self.connections = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> Flaky:
        self._server = await asyncio.start_unix_server(self._serve, self.path)
        return self

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for w in list(self._writers):
            w.close()
        await self._server.wait_closed()
        if os.path.exists(self.path):
            os.unlink(self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = self.connections
        self._writers.add(writer)
        unpacker = msgpack.Unpacker(raw=False)
        try:
            while data := await reader.read(65536):
                unpacker.feed(data)
                for kind, msgid, method, params in unpacker:
                    assert kind == 0
                    self.seen.append(Seen(conn, method, params))
                    action = self.plan.pop(0) if self.plan else self.then
                    if action == DROP:
                        return
                    if action == HANG:
                        continue
                    if isinstance(action, tuple) and action[0] == "error":
                        answer = [1, msgid, {"code": action[1], "message": "planned"}, None]
                    elif method == "track_many":
                        answer = [1, msgid, None, [42] * len(params[0])]
                    else:
                        answer = [1, msgid, None, DEFAULTS[method]]
                    writer.write(msgpack.packb(answer))
        except ConnectionError:
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    def params(self) -> list[list[Any]]:
        return [s.params for s in self.seen]


async def bounded(aw: Awaitable[T], release: Callable[[], Awaitable[None]]) -> T:
    """``await aw``, but fail (not hang) if it has not finished within WAIT: ``release()``
    then lets a client that never gives up finish (a worker thread cannot be cancelled)."""
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=WAIT)
    if not done:
        await release()
        await asyncio.wait({task}, timeout=WAIT)
        task.cancel()
        pytest.fail(f"the call did not finish within {WAIT}s")
    return task.result()


async def until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


@pytest.fixture
def path() -> Iterator[str]:
    d = str(short_tmpdir("mtr"))
    yield os.path.join(d, "m.sock")
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def flaky(path: str) -> AsyncIterator[Flaky]:
    node = await Flaky(path).start()
    yield node
    await node.close()


KINDS = ["async", "blocking"]


async def use(kind: str, path: str, fn: Callable[[Any], Any], **kw: Any) -> Any:
    """Run ``fn(client)`` with a fresh client of ``kind`` connected to ``path``."""
    kw.setdefault("timeout", WAIT)
    kw.setdefault("retry_timeout", WAIT)
    if kind == "async":
        async with await AsyncClient.connect(path, **kw) as client:
            return await fn(client)

    def run() -> Any:
        with Client.connect(path, **kw) as client:
            return fn(client)

    return await asyncio.to_thread(run)


def request_ids(params: list[Any]) -> list[str]:
    """Every request id in one request's params (track_many: one per item)."""
    if params and isinstance(params[0], list):  # track_many
        return [item[3]["id"] for item in params[0] if len(item) == 4]
    return [p["id"] for p in params if isinstance(p, dict) and "id" in p]


MUTATING: list[tuple[str, Callable[[Any], Any]]] = [
    ("track", lambda c: c.track("acme", "api", 5)),
    ("track_many", lambda c: c.track_many([("acme", "api", 1), ("acme", "db", 2, "mine")])),
    ("reserve", lambda c: c.reserve("acme", "gpu", 3, limit=10)),
    ("commit", lambda c: c.commit("r-1", 2)),
    ("release", lambda c: c.release("r-1")),
]
READS: list[tuple[str, Callable[[Any], Any]]] = [
    ("usage", lambda c: c.usage("acme", "api")),
    ("usage_all", lambda c: c.usage_all("acme")),
    ("ping", lambda c: c.ping()),
    ("status", lambda c: c.status()),
]
ALL = MUTATING + READS


# -- a call that got no answer is sent again, with the same id --------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("method", "invoke"), ALL, ids=[m for m, _ in ALL])
async def test_a_dropped_call_is_retried_on_a_new_connection_with_the_same_id(
    flaky: Flaky, path: str, kind: str, method: str, invoke: Callable[[Any], Any]
) -> None:
    flaky.plan = [DROP]
    assert await use(kind, path, invoke) == DEFAULTS[method]
    first, second = flaky.seen  # exactly two attempts
    assert first.method == second.method == method
    assert (first.conn, second.conn) == (1, 2), "the retry went over a new connection"
    assert first.params == second.params, "the retry is the same request, same id"
    if method in {m for m, _ in MUTATING}:
        assert request_ids(first.params), "a mutating call carries an id"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("method", "invoke"), MUTATING, ids=[m for m, _ in MUTATING])
async def test_an_unavailable_answer_is_retried_with_the_same_id(
    flaky: Flaky, path: str, kind: str, method: str, invoke: Callable[[Any], Any]
) -> None:
    flaky.plan = [error("unavailable"), error("unavailable")]
    assert await use(kind, path, invoke) == DEFAULTS[method]
    assert len(flaky.seen) == 3
    ids = [request_ids(p) for p in flaky.params()]
    assert ids[0] and ids[0] == ids[1] == ids[2], ids
    assert flaky.connections == 1, "an answered error leaves the connection usable"


@pytest.mark.parametrize("kind", KINDS)
async def test_track_many_retries_keep_every_items_id(flaky: Flaky, path: str, kind: str) -> None:
    flaky.plan = [DROP]
    items = [("acme", "api", 1), ("acme", "db", 2, "mine"), ("acme", "io", 3)]
    assert await use(kind, path, lambda c: c.track_many(items)) == [42, 42, 42]
    first, second = flaky.params()
    assert first == second
    ids = request_ids(first)
    assert len(ids) == 3 and ids[1] == "mine" and len(set(ids)) == 3, ids


@pytest.mark.parametrize("kind", KINDS)
async def test_a_timed_out_call_is_retried_with_the_same_id(
    flaky: Flaky, path: str, kind: str
) -> None:
    flaky.plan = [HANG]
    assert await use(kind, path, lambda c: c.track("acme", "api", 1, id="t-1"), timeout=0.2) == 42
    seen = flaky.params()
    # Two attempts, or more if a loaded machine made the second one time out too.
    assert len(seen) >= 2 and all(p == ["acme", "api", 1, {"id": "t-1"}] for p in seen), seen


@pytest.mark.parametrize("kind", KINDS)
async def test_a_restarted_node_gets_the_same_id(path: str, kind: str) -> None:
    """The node is drained mid-call (the call is answered unavailable, then the connection is
    closed) and a new node starts on the same path: the client reconnects and resends."""

    class Node:
        def __init__(self, hang: bool) -> None:
            self.calls: list[list[Any]] = []
            self.hang = hang

        def dispatch(self, method: str, params: list[Any]) -> Any:
            self.calls.append(params)
            if self.hang:
                return asyncio.get_running_loop().create_future()  # never answered
            return 42

    old, new = Node(hang=True), Node(hang=False)
    srv = await start_server(path, old)
    call = asyncio.create_task(use(kind, path, lambda c: c.track("acme", "api", 3)))
    try:
        await until(lambda: bool(old.calls), "the first attempt to reach the old node")
        await srv.close(drain_timeout=0.01)
        assert not call.done()
        srv = await start_server(path, new)
        assert await asyncio.wait_for(call, WAIT) == 42
    finally:
        call.cancel()
        await srv.close(drain_timeout=0.01)
    assert new.calls == old.calls, "the new node got the same request, same id"
    assert request_ids(old.calls[0])


# -- what is not retried ----------------------------------------------------------------------

NOT_RETRIED = ["invalid_argument", "conflict", "limit_exceeded", "not_found", "internal"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("code", NOT_RETRIED)
async def test_other_errors_are_raised_at_once(
    flaky: Flaky, path: str, kind: str, code: str
) -> None:
    flaky.plan = [error(code)]
    with pytest.raises(BY_CODE[code]):
        await use(kind, path, lambda c: c.track("acme", "api", 1))
    assert len(flaky.seen) == 1


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("action", [DROP, error("unavailable")])
async def test_gives_up_after_retry_timeout(
    flaky: Flaky, path: str, kind: str, action: Any
) -> None:
    flaky.then = action
    started = time.monotonic()

    async def answer() -> None:
        flaky.then = None

    with pytest.raises(Unavailable, match="gave up after") as info:
        call = use(kind, path, lambda c: c.track("acme", "api", 1), retry_timeout=0.5)
        await bounded(call, answer)
    took = time.monotonic() - started
    assert type(info.value) is Unavailable
    assert 0.5 <= took < WAIT, took
    assert len(flaky.seen) >= 2
    assert all(p == flaky.seen[0].params for p in flaky.params()), "one id for every attempt"


@pytest.mark.parametrize("kind", KINDS)
async def test_gives_up_when_the_node_stays_down(path: str, kind: str) -> None:
    node = await Flaky(path, plan=[DROP]).start()
    try:

        async def stop_node() -> None:
            # Connected (and accepted: a connection still in the listen backlog would just
            # hang), then the node is gone for good.
            await until(lambda: node.connections == 1, "the connection to be accepted")
            await node.close()

        async def down_after_connect(c: Any) -> Any:
            await stop_node()
            return await c.track("acme", "api", 1)

        def down_after_connect_blocking(c: Any) -> Any:
            asyncio.run_coroutine_threadsafe(stop_node(), loop).result(WAIT)
            return c.track("acme", "api", 1)

        async def come_back() -> None:
            nonlocal node
            node = await Flaky(path).start()

        loop = asyncio.get_running_loop()
        fn = down_after_connect if kind == "async" else down_after_connect_blocking
        with pytest.raises(Unavailable, match="gave up after"):
            await bounded(use(kind, path, fn, retry_timeout=0.3), come_back)
        assert node.seen == []
    finally:
        await node.close()


@pytest.mark.parametrize("kind", KINDS)
async def test_retry_timeout_zero_disables_retries(flaky: Flaky, path: str, kind: str) -> None:
    flaky.plan = [DROP]
    with pytest.raises(Unavailable) as info:
        await use(kind, path, lambda c: c.track("acme", "api", 1), retry_timeout=0)
    assert "gave up" not in info.value.message
    assert len(flaky.seen) == 1


@pytest.mark.parametrize("kind", KINDS)
async def test_without_an_id_a_lost_answer_is_not_retried(
    flaky: Flaky, path: str, kind: str
) -> None:
    """It may have been counted: sending it again could count it twice."""
    flaky.plan = [DROP]
    with pytest.raises(Unavailable):
        await use(kind, path, lambda c: c.track("acme", "api", 1), auto_ids=False)
    assert flaky.params() == [["acme", "api", 1]]


@pytest.mark.parametrize("kind", KINDS)
async def test_without_an_id_an_unavailable_answer_is_retried(
    flaky: Flaky, path: str, kind: str
) -> None:
    """The node counted nothing, so sending it again is safe even without an id."""
    flaky.plan = [error("unavailable")]
    assert await use(kind, path, lambda c: c.track("acme", "api", 1), auto_ids=False) == 42
    assert flaky.params() == [["acme", "api", 1]] * 2


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("method", "invoke"),
    [
        ("commit", lambda c: c.commit("r-1")),
        ("release", lambda c: c.release("r-1")),
        ("ping", lambda c: c.ping()),
    ],
)
async def test_without_an_id_idempotent_calls_are_still_retried(
    flaky: Flaky, path: str, kind: str, method: str, invoke: Callable[[Any], Any]
) -> None:
    flaky.plan = [DROP]
    assert await use(kind, path, invoke, auto_ids=False) == DEFAULTS[method]
    first, second = flaky.params()
    assert first == second and not request_ids(first)


@pytest.mark.parametrize("kind", KINDS)
async def test_raw_calls_are_not_retried_but_reconnect(flaky: Flaky, path: str, kind: str) -> None:
    flaky.plan = [DROP]

    async def go_async(c: AsyncClient) -> Any:
        with pytest.raises(Unavailable):
            await c.call("track", "acme", "api", 1)
        return await c.call("ping")  # a new connection, made lazily

    def go_blocking(c: Client) -> Any:
        with pytest.raises(Unavailable):
            c.call("track", "acme", "api", 1)
        return c.call("ping")

    fn: Callable[[Any], Any] = go_async if kind == "async" else go_blocking
    assert await use(kind, path, fn) == "pong"
    assert [(s.conn, s.method) for s in flaky.seen] == [(1, "track"), (2, "ping")]


async def test_a_blocking_client_made_from_a_socket_cannot_retry(flaky: Flaky, path: str) -> None:
    flaky.plan = [DROP]

    def go() -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        with Client(sock, timeout=WAIT) as c:
            with pytest.raises(Unavailable):
                c.track("acme", "api", 1)
            with pytest.raises(Unavailable):
                c.ping()  # no path to reconnect to

    await asyncio.to_thread(go)
    assert len(flaky.seen) == 1


async def test_an_async_client_made_from_a_transport_cannot_retry(flaky: Flaky, path: str) -> None:
    flaky.plan = [DROP]
    transport, protocol = await asyncio.get_running_loop().create_unix_connection(
        lambda: _ClientProtocol(1 << 20), path
    )
    async with AsyncClient(transport, protocol, timeout=WAIT) as c:
        with pytest.raises(Unavailable):
            await c.track("acme", "api", 1)
        with pytest.raises(Unavailable):
            await c.ping()
    assert len(flaky.seen) == 1


async def test_closing_stops_retrying(flaky: Flaky, path: str) -> None:
    flaky.then = error("unavailable")
    client = await AsyncClient.connect(path, timeout=WAIT, retry_timeout=WAIT)
    call = asyncio.create_task(client.track("acme", "api", 1))
    await until(lambda: len(flaky.seen) >= 2, "a retry")
    await client.close()
    with pytest.raises(Unavailable):
        await asyncio.wait_for(call, WAIT)


async def test_concurrent_calls_share_one_reconnection(flaky: Flaky, path: str) -> None:
    flaky.plan = [DROP]
    async with await AsyncClient.connect(path, timeout=WAIT, retry_timeout=WAIT) as client:
        calls = [client.track("acme", "api", 1) for _ in range(20)]
        assert await asyncio.gather(*calls) == [42] * 20
    assert flaky.connections == 2
    first = [request_ids(s.params)[0] for s in flaky.seen if s.conn == 1]
    second = [request_ids(s.params)[0] for s in flaky.seen if s.conn == 2]
    assert len(second) == len(set(second)) == 20, "each call answered once, on the new connection"
    assert set(first) <= set(second), "a call sent on the dropped connection kept its id"


# -- against a real node: the lost answer's call is counted once ------------------------------


class LosesFirstAnswer:
    """A Unix-socket proxy in front of a node that cuts the first connection as soon as the
    node's first answer comes back (the node did the work; the client never hears of it)."""

    def __init__(self, path: str, upstream: str) -> None:
        self.path = path
        self.upstream = upstream
        self.lost: list[bytes] = []
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> LosesFirstAnswer:
        self._server = await asyncio.start_unix_server(self._serve, self.path)
        return self

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_unix_connection(self.upstream)
        cut = not self.lost and not self._tasks

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter, back: bool) -> None:
            try:
                while data := await r.read(65536):
                    if back and cut:
                        self.lost.append(data)
                        return
                    w.write(data)
                    await w.drain()
            except ConnectionError:
                pass
            finally:
                w.close()
                (writer if w is up_w else up_w).close()

        tasks = [
            asyncio.create_task(pump(reader, up_w, back=False)),
            asyncio.create_task(pump(up_r, writer, back=True)),
        ]
        self._tasks.update(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.difference_update(tasks)


@pytest.fixture
async def real_node(path: str) -> AsyncIterator[tuple[str, LosesFirstAnswer]]:
    """A node with a :class:`LosesFirstAnswer` proxy on ``path``: (the node's own socket,
    the proxy)."""
    cfg = NodeConfig(
        data_dir=Path(os.path.dirname(path)) / "data",
        node_id="n1",
        server=ServerConfig(socket=Path(os.path.dirname(path)) / "node.sock"),
        flush=FlushConfig(interval_ms=3_600_000),
    )
    async with Node(cfg, storage=MemoryStorage()):
        proxy = await LosesFirstAnswer(path, str(cfg.server.socket)).start()
        try:
            yield str(cfg.server.socket), proxy
        finally:
            await proxy.close()


@pytest.mark.parametrize("kind", KINDS)
async def test_a_real_node_counts_a_call_whose_answer_was_lost_once(
    real_node: tuple[str, LosesFirstAnswer], path: str, kind: str
) -> None:
    direct, proxy = real_node
    assert await use(kind, path, lambda c: c.track("acme", "api", 5)) == 5
    assert proxy.lost, "the first answer was lost"
    assert await use(kind, direct, lambda c: c.usage("acme", "api")) == 5, "counted once"
    assert await use(kind, path, lambda c: c.track("acme", "api", 5)) == 10, "a new call counts"


@pytest.mark.parametrize("kind", KINDS)
async def test_a_real_node_reserves_once_when_the_answer_was_lost(
    real_node: tuple[str, LosesFirstAnswer], path: str, kind: str
) -> None:
    direct, proxy = real_node
    rid = await use(kind, path, lambda c: c.reserve("acme", "gpu", 7, limit=10))
    assert proxy.lost, "the first answer was lost"
    status = await use(kind, direct, lambda c: c.status())
    assert status["reservations"]["open"] == 1, "one reservation, not two"
    assert await use(kind, direct, lambda c: c.commit(rid)) == 7
