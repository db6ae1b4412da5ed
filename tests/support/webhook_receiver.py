"""A real HTTP receiver of webhooks for tests: an aiohttp server on a loopback port, on its own
event loop thread, that records every request and answers with the statuses it is told to."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from aiohttp import web


@dataclass(frozen=True)
class Received:
    """One request: its method, headers (lower-case names), raw body and parsed JSON."""

    method: str
    headers: dict[str, str]
    body: str
    event: Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WebhookReceiver:
    """``with WebhookReceiver() as r``: ``r.url``; ``r.fail(500, 500)`` answers the next two
    requests 500 (then 200); ``r.received`` every request, in order."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/hooks"
        self.received: list[Received] = []
        self._statuses: deque[int] = deque()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def fail(self, *statuses: int) -> None:
        with self._lock:
            self._statuses.extend(statuses)

    def events(self) -> list[Any]:
        with self._lock:
            return [r.event for r in self.received]

    async def _handle(self, request: web.Request) -> web.Response:
        body = (await request.read()).decode()
        with self._lock:
            headers = {k.lower(): v for k, v in request.headers.items()}
            event = json.loads(body) if body else None
            self.received.append(Received(request.method, headers, body, event))
            status = self._statuses.popleft() if self._statuses else 200
        # (a redirect names this URL again: a client that follows it comes back as a GET)
        location = {"Location": self.url} if 300 <= status < 400 else None
        return web.Response(status=status, text="ok", headers=location)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/hooks", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
