"""An aiohttp application served on a TCP address or a Unix socket, with limits on clients.

aiohttp parses and answers; what it does not do, this does: at most ``max_connections`` at
once (a connection past it takes the place of the oldest one that has not sent a whole request
yet, else of the oldest one), and a connection that has not sent a whole request within
``head_timeout_s`` of connecting is answered 408 and closed, so idle or trickling clients
cannot keep a probe or a call out. Idle keep-alive connections close after ``keepalive_s``.

The listener serves one handler on aiohttp's low-level server (``web.Server``): the API and
the probes route by a dict of paths themselves, which costs less per request than an
application's router, signals and middlewares. A request head is at most 8 KiB a line
(aiohttp answers 400 past it), a body at most ``max_body`` bytes (413).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from meter.core.server import bind_unix, clear_stale, unlink_own

_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: 34\r\nConnection: close\r\n\r\nrequest head not received in time\n"
)


#: A listener's handler: every request, answered.
Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class Limits:
    """What one listener allows its clients."""

    max_connections: int
    #: Seconds a new connection has to send its first whole request head.
    head_timeout_s: float
    #: Seconds an idle keep-alive connection is kept.
    keepalive_s: float
    #: Largest request body, bytes.
    max_body: int
    #: Seconds the close waits for requests being answered.
    shutdown_s: float = 5.0


class _Guard:
    """The connections of one listener, and which have sent a whole request."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        #: Open connections, oldest first -> whether one of its requests was read.
        self._conns: dict[RequestHandler, bool] = {}

    def factory(self, server: web.Server) -> Callable[[], RequestHandler]:
        def make() -> RequestHandler:
            conns = self._conns
            for h in [h for h in conns if h.transport is None]:  # closed since
                del conns[h]
            if len(conns) >= self.limits.max_connections:
                self._make_room()
            handler = server()
            conns[handler] = False
            asyncio.get_running_loop().call_later(
                self.limits.head_timeout_s, self._head_timeout, handler
            )
            return handler

        return make

    def _make_room(self) -> None:
        """Close the oldest connection that has not sent a whole request (nothing runs on it:
        at once), else ask the oldest one to close once the request it serves, if any, is
        answered (aiohttp's graceful ``close``: a call at work is never cut off)."""
        conns = self._conns
        victim = next((h for h, started in conns.items() if not started), None)
        if victim is not None:
            del conns[victim]
            if victim.transport is not None:
                victim.transport.abort()
            return
        victim = next(iter(conns))
        del conns[victim]
        victim.close()

    def _head_timeout(self, handler: RequestHandler) -> None:
        if self._conns.get(handler) is False and handler.transport is not None:
            transport = handler.transport
            transport.write(_TIMEOUT)
            transport.close()

    def started(self, conn: RequestHandler) -> None:
        if self._conns.get(conn) is False:
            self._conns[conn] = True


class Listener:
    """One handler served on one address; :meth:`start_tcp` or :meth:`start_unix`, then
    :meth:`close`."""

    def __init__(self, limits: Limits, handler: Handler) -> None:
        self.limits = limits
        self.handler = handler
        self._guard = _Guard(limits)
        self._runner: web.ServerRunner | None = None
        self._path: str | None = None
        self._inode: tuple[int, int, int] | None = None
        #: ``host:port`` bound (TCP), or the socket's path.
        self.address: str | None = None

    def _request(
        self,
        message: Any,
        payload: Any,
        protocol: RequestHandler,
        writer: Any,
        task: asyncio.Task[None],
    ) -> web.BaseRequest:
        """aiohttp's request factory: each request read whole spares its connection from the
        head timeout and the eviction."""
        self._guard.started(protocol)
        return web.BaseRequest(
            message,
            payload,
            protocol,
            writer,
            task,
            asyncio.get_running_loop(),
            client_max_size=self.limits.max_body,
        )

    async def _serve(self, sock: socket.socket) -> None:
        server = web.Server(
            self.handler,
            request_factory=self._request,
            keepalive_timeout=self.limits.keepalive_s,
            access_log=None,
        )
        if self._runner is None:
            # (aiohttp waits shutdown_timeout for handlers, then as long again once it has
            # cancelled them: half of it each keeps a close within ``shutdown_s``)
            runner = web.ServerRunner(server, shutdown_timeout=self.limits.shutdown_s / 2)
            await runner.setup()
            self._runner = runner
        try:
            await _Site(self._runner, sock, self._guard).start()
        except BaseException:
            await self.close()
            raise

    async def start_tcp(self, host: str, port: int) -> str:
        """Serve on ``host:port``, every address it resolves to (``localhost``: IPv4 and
        IPv6, as asyncio's servers do); return the first bound ``host:port``. OSError if
        one cannot be bound."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        seen: set[Any] = set()
        for family, type_, proto, _, addr in infos:
            if addr in seen:
                continue
            seen.add(addr)
            sock = socket.socket(family, type_, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                if self.address is not None:  # (port 0: every address on the first's port)
                    addr = (addr[0], int(self.address.rsplit(":", 1)[1]), *addr[2:])
                sock.bind(addr)
                sock.setblocking(False)
                await self._serve(sock)
            except BaseException:
                sock.close()
                await self.close()
                raise
            if self.address is None:
                bound = sock.getsockname()
                shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
                self.address = f"{shown}:{bound[1]}"
        assert self.address is not None
        return self.address

    async def start_unix(self, path: str, mode: int = 0o600, gid: int | None = None) -> str:
        """Serve on the Unix socket ``path`` (file ``mode``, group ``gid``); a stale socket
        file is replaced, a live one is OSError(EADDRINUSE), another file FileExistsError."""
        await clear_stale(path)
        sock, inode = bind_unix(path, mode, gid)
        try:
            await self._serve(sock)
        except BaseException:
            sock.close()
            unlink_own(path, inode)
            raise
        self._path, self._inode, self.address = path, inode, path
        return path

    async def close(self) -> None:
        """Stop listening, finish the requests being answered (within ``shutdown_s``), close
        every connection."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        with contextlib.suppress(Exception):
            await runner.cleanup()
        if self._path is not None:
            unlink_own(self._path, self._inode)


class _Site(web.SockSite):
    """A listening socket whose connections go through the guard."""

    def __init__(self, runner: web.ServerRunner, sock: Any, guard: _Guard) -> None:
        super().__init__(runner, sock, backlog=1024)
        self._guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)  # (registers the site with its runner)
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self._guard.factory(server), sock=self._sock, backlog=self._backlog
        )
