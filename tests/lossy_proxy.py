"""A TCP proxy that loses responses: the request reaches the server, the answer never returns.

Put it between an HTTP client and DynamoDB Local. For each response, with probability
``loss``, it closes both connections as soon as the server starts answering instead of
forwarding the answer. The server has finished the request by then - a write has landed -
but the client only sees a dropped connection: exactly the case where a blind retry counts
twice. Requests are never dropped, so every loss is a lost acknowledgement.

It can also *hold* the answers to DynamoDB's ``BatchGetItem`` (a node's seeding reads) until
the test releases them (:meth:`LossyProxy.hold`), so reads are seen queued and in flight in a
known order, whatever the machine's speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from collections.abc import Callable, Iterator


class LossyProxy:
    """Listens on ``127.0.0.1:<port>`` and forwards to ``127.0.0.1:<upstream_port>``."""

    def __init__(self, upstream_port: int, *, loss: float = 0.25, seed: int | None = None) -> None:
        if not 0 <= loss <= 1:
            raise ValueError(f"loss must be within 0..1, got {loss}")
        self.upstream_port = upstream_port
        self.loss = loss
        self._random = random.Random(seed)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0
        #: Responses closed instead of forwarded / forwarded intact.
        self.lost = 0
        self.forwarded = 0
        #: BatchGetItem answers waiting to be released now, and released so far (:meth:`hold`).
        self.held = 0
        self.released = 0
        self._release: asyncio.Event | None = None

    @property
    def endpoint(self) -> str:
        """The endpoint URL clients should use instead of the upstream's."""
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        """Start listening on a free loopback port."""
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening and drop every open connection."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    def hold(self) -> None:
        """From now on, hold every ``BatchGetItem`` answer until :meth:`release_held`.
        Call these three on the proxy's event loop (:func:`call_in`)."""
        if self._release is None:
            self._release = asyncio.Event()

    def release_held(self) -> None:
        """Forward the answers held now; keep holding later ones."""
        if self._release is not None:
            self._release.set()
            self._release = asyncio.Event()

    def stop_holding(self) -> None:
        """Forward every held answer and hold nothing more."""
        if self._release is not None:
            self._release.set()
            self._release = None

    async def __aenter__(self) -> LossyProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            client_w.close()
            self._tasks.discard(task)
            return
        # Set when the client sent (part of) a request whose response has not started yet:
        # HTTP/1.1 clients do not pipeline, so the next bytes from upstream begin its answer.
        awaiting = asyncio.Event()
        # Whether the request being answered is a BatchGetItem (its headers name the target).
        batch_get = [False]

        async def upstream() -> None:
            while data := await client_r.read(65536):
                if not awaiting.is_set():  # the first bytes of a request
                    batch_get[0] = b"BatchGetItem" in data
                awaiting.set()
                up_w.write(data)
                await up_w.drain()

        async def downstream() -> None:
            while data := await up_r.read(65536):
                if awaiting.is_set():
                    awaiting.clear()
                    release = self._release
                    if batch_get[0] and release is not None:
                        self.held += 1
                        try:
                            await release.wait()
                        finally:
                            self.held -= 1
                        self.released += 1
                    if self._random.random() < self.loss:
                        self.lost += 1
                        return  # close both sides: the answer is lost
                    self.forwarded += 1
                client_w.write(data)
                await client_w.drain()

        pumps = [asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream())]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pass
        finally:
            for pump in pumps:
                pump.cancel()
            for pump in pumps:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pump
            for w in (client_w, up_w):
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()
            self._tasks.discard(task)


def call_in(loop: asyncio.AbstractEventLoop, fn: Callable[[], object]) -> None:
    """Run ``fn`` on ``loop`` (another thread's) and return once it has run."""

    async def run() -> None:
        fn()

    asyncio.run_coroutine_threadsafe(run(), loop).result(10)


@contextlib.contextmanager
def running(proxy: LossyProxy) -> Iterator[asyncio.AbstractEventLoop]:
    """Serve ``proxy`` from its own thread's event loop, for tests that drive real processes
    from the main thread; yields that loop (``call_in(loop, proxy.hold)``)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(proxy.start(), loop).result(10)
        yield loop
    finally:
        asyncio.run_coroutine_threadsafe(proxy.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
