"""A TCP proxy that loses responses: the request reaches the server, the answer never returns.

Put it between an HTTP client and DynamoDB Local. For each response, with probability
``loss``, it closes both connections as soon as the server starts answering instead of
forwarding the answer. The server has finished the request by then - a write has landed -
but the client only sees a dropped connection: exactly the case where a blind retry counts
twice. Requests are never dropped, so every loss is a lost acknowledgement.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Self


class LoopbackProxy:
    """A TCP proxy on a free loopback port: ``start``/``close`` (or ``async with``), the
    ``endpoint`` clients use; subclasses handle each connection (``_handle``), registering
    its task in ``_tasks`` so :meth:`close` can drop it."""

    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

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

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        raise NotImplementedError


class LossyProxy(LoopbackProxy):
    """Listens on ``127.0.0.1:<port>`` and forwards to ``127.0.0.1:<upstream_port>``."""

    def __init__(self, upstream_port: int, *, loss: float = 0.25, seed: int | None = None) -> None:
        if not 0 <= loss <= 1:
            raise ValueError(f"loss must be within 0..1, got {loss}")
        self.upstream_port = upstream_port
        self.loss = loss
        self._random = random.Random(seed)
        super().__init__()
        #: Responses closed instead of forwarded / forwarded intact.
        self.lost = 0
        self.forwarded = 0

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

        async def upstream() -> None:
            while data := await client_r.read(65536):
                awaiting.set()
                up_w.write(data)
                await up_w.drain()

        async def downstream() -> None:
            while data := await up_r.read(65536):
                if awaiting.is_set():
                    awaiting.clear()
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
