"""The node's HTTP listener: ``GET /metrics``, ``/healthz`` and ``/readyz`` (``metrics_address``).

A deliberately small HTTP/1.x server on asyncio streams: one request per connection (the answer
says ``Connection: close``), a request head of at most :data:`MAX_HEAD_BYTES` read within
:data:`READ_TIMEOUT_S`, at most :data:`MAX_CONNECTIONS` at once. A connection past the limit
takes the place of the oldest one still reading its head (else of the oldest one), so idle or
slow clients cannot keep a probe out. Nothing here touches the counting path: answers are built
from what the node exposes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("meter.http")

#: Largest request head (request line and headers) read; a longer one is answered 431.
MAX_HEAD_BYTES = 8192
#: A client must send its whole request head within this many seconds (else 408): a probe
#: sends it at once, so a short limit only frees slots held by idle clients sooner.
READ_TIMEOUT_S = 2.0
#: An answer must leave within this many seconds, else the connection is aborted.
WRITE_TIMEOUT_S = 5.0
#: Connections served at once; a new one past it makes room by closing an older one.
MAX_CONNECTIONS = 64

#: ``check -> None (ok) or why it failed``, in the order the body lists them.
Checks = Callable[[], dict[str, str | None]]


@dataclass(frozen=True)
class Endpoints:
    """What the listener serves: the metrics text, and the node's checks."""

    #: The Prometheus text exposition and its content type.
    metrics: Callable[[], bytes]
    metrics_content_type: str
    #: Every readiness check (``counting``, ``log``, ``storage``, ``bus``).
    checks: Checks
    #: The checks ``/readyz?counting`` looks at (whether the node can count).
    counting_checks: tuple[str, ...] = ("counting", "log")


_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class _Conn:
    """One connection being served: its writer, and whether its request head is still being
    read (the state in which a client that sends nothing, or one byte at a time, sits)."""

    __slots__ = ("reading", "writer")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.reading = True


class HttpEndpoints:
    """A running listener; :meth:`start` it, :meth:`close` it with the node."""

    def __init__(self, endpoints: Endpoints) -> None:
        self.endpoints = endpoints
        self._server: asyncio.Server | None = None
        #: Connections being served, by their task, oldest first (dicts keep insertion order).
        self._conns: dict[asyncio.Task[Any], _Conn] = {}
        #: Connections closed to make room for a newer one.
        self.evicted = 0
        #: ``host:port`` actually bound (the port chosen when 0 was asked for).
        self.address: str | None = None

    async def start(self, host: str, port: int) -> str:
        """Listen on ``host:port``; return the bound ``host:port``. ``OSError`` if it cannot."""
        self._server = await asyncio.start_server(
            self._serve, host, port, limit=MAX_HEAD_BYTES, reuse_address=True
        )
        bound = self._server.sockets[0].getsockname()
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        self.address = f"{shown}:{bound[1]}"
        return self.address

    async def close(self) -> None:
        """Stop listening, drop every open connection and wait for their tasks to end."""
        if self._server is None:
            return
        self._server.close()
        tasks = list(self._conns)
        for task, conn in list(self._conns.items()):
            conn.writer.transport.abort()
            task.cancel()
        self._conns.clear()
        if tasks:
            # (Each task ends at its next await; none can block, the transports are gone.)
            await asyncio.wait(tasks, timeout=2.0)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._server.wait_closed(), 2.0)
        self._server = None

    def _make_room(self) -> None:
        """Close the oldest connection still reading its head (a client that sends nothing or
        trickles bytes), else the oldest one (an answer its peer does not read)."""
        oldest = next(iter(self._conns))
        victim = next((t for t, c in self._conns.items() if c.reading), oldest)
        conn = self._conns.pop(victim)
        self.evicted += 1
        conn.writer.transport.abort()
        victim.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._conns) >= MAX_CONNECTIONS:
            self._make_room()
        conn = self._conns[task] = _Conn(writer)
        try:
            status, ctype, body, head_only, extra = await self._answer(reader)
            conn.reading = False
            if writer.transport.is_closing():
                return  # the peer is gone
            reason = _REASONS.get(status, "")
            headers = (
                f"HTTP/1.1 {status} {reason}\r\n"
                f"Content-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\n"
                f"{extra}"
                "Connection: close\r\n\r\n"
            )
            writer.write(headers.encode("ascii") + (b"" if head_only else body))
            try:
                await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
            except TimeoutError:
                # A peer that does not read: close() would wait for it to take the bytes.
                writer.transport.abort()
        except asyncio.CancelledError:
            # Closed to make room, or the listener is closing: nothing to answer or log. Not
            # re-raised: asyncio's streams (3.11) log a task of theirs that ends cancelled.
            writer.transport.abort()
        except (ConnectionError, OSError):
            pass
        except Exception:  # a bug must not end the listener; the client sees a closed socket
            log.exception("http endpoint failed")
        finally:
            if self._conns.get(task) is conn:
                del self._conns[task]
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, str, bytes, bool, str]:
        """``(status, content type, body, HEAD?, extra header lines)`` for one request."""
        text = "text/plain; charset=utf-8"
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
        except TimeoutError:
            return 408, text, b"request head not received in time\n", False, ""
        except asyncio.LimitOverrunError:
            return 431, text, f"request head over {MAX_HEAD_BYTES} bytes\n".encode(), False, ""
        except asyncio.IncompleteReadError:
            return 400, text, b"incomplete request head\n", False, ""
        line = head.split(b"\r\n", 1)[0]
        parts = line.split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            return 400, text, b"malformed request line\n", False, ""
        try:
            method, target = parts[0].decode("ascii"), parts[1].decode("ascii")
        except UnicodeDecodeError:
            return 400, text, b"malformed request line\n", False, ""
        url = urlsplit(target)
        path = url.path
        if path not in ("/metrics", "/healthz", "/readyz"):
            return 404, text, b"not found: try /metrics, /healthz or /readyz\n", False, ""
        if method not in ("GET", "HEAD"):
            return 405, text, b"method not allowed: GET or HEAD\n", False, "Allow: GET, HEAD\r\n"
        head_only = method == "HEAD"
        ep = self.endpoints
        if path == "/metrics":
            return 200, ep.metrics_content_type, ep.metrics(), head_only, ""
        if path == "/healthz":
            return 200, text, b"ok\n", head_only, ""
        checks = ep.checks()
        query = url.query.split("&") if url.query else []
        if "counting" in query:
            checks = {name: checks[name] for name in ep.counting_checks}
        failed = any(why is not None for why in checks.values())
        body = "".join(
            f"{name}: ok\n" if why is None else f"{name}: failed: {why}\n"
            for name, why in checks.items()
        )
        return (503 if failed else 200), text, body.encode(), head_only, ""
