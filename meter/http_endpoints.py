"""The node's HTTP listener: ``GET /metrics``, ``/healthz`` and ``/readyz`` (``metrics_address``).

A deliberately small HTTP/1.x server on asyncio streams: one request per connection (the answer
says ``Connection: close``), a request head of at most :data:`MAX_HEAD_BYTES` read within
:data:`READ_TIMEOUT_S`, at most :data:`MAX_CONNECTIONS` at once, so a bad or slow client cannot
hold it. Nothing here touches the counting path: answers are built from what the node exposes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

log = logging.getLogger("meter.http")

#: Largest request head (request line and headers) read; a longer one is answered 431.
MAX_HEAD_BYTES = 8192
#: A client must send its whole request head within this many seconds (else 408).
READ_TIMEOUT_S = 5.0
#: Connections served at once; more are closed at once.
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


class HttpEndpoints:
    """A running listener; :meth:`start` it, :meth:`close` it with the node."""

    def __init__(self, endpoints: Endpoints) -> None:
        self.endpoints = endpoints
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
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
        """Stop listening and drop every open connection."""
        if self._server is None:
            return
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._server.wait_closed(), 2.0)
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._writers) >= MAX_CONNECTIONS:
            writer.close()
            return
        self._writers.add(writer)
        try:
            status, ctype, body, head_only, extra = await self._answer(reader)
            reason = _REASONS.get(status, "")
            headers = (
                f"HTTP/1.1 {status} {reason}\r\n"
                f"Content-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\n"
                f"{extra}"
                "Connection: close\r\n\r\n"
            )
            writer.write(headers.encode("ascii") + (b"" if head_only else body))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(writer.drain(), READ_TIMEOUT_S)
        except (ConnectionError, OSError):
            pass
        except Exception:  # a bug must not end the listener; the client sees a closed socket
            log.exception("http endpoint failed")
        finally:
            self._writers.discard(writer)
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
