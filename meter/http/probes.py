"""``GET /metrics``, ``/healthz`` and ``/readyz`` (``metrics_address``): an aiohttp
application built from what the node exposes; nothing here touches the counting path."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from meter.http.listener import Limits

#: The probes' listener: few connections, short waits (a probe sends its request at once).
LIMITS = Limits(max_connections=64, head_timeout_s=2.0, keepalive_s=2.0, max_body=0)

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


def probe_app(endpoints: Endpoints, first: Any) -> web.Application:
    """The probes' application; ``first`` runs first (the listener's limits)."""

    async def metrics(request: web.Request) -> web.Response:
        # (the content type carries its own parameters: set as a header, not content_type)
        return web.Response(
            body=endpoints.metrics(), headers={"Content-Type": endpoints.metrics_content_type}
        )

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(request: web.Request) -> web.Response:
        checks = endpoints.checks()
        if "counting" in request.query:
            checks = {name: checks[name] for name in endpoints.counting_checks}
        failed = any(why is not None for why in checks.values())
        body = "".join(
            f"{name}: ok\n" if why is None else f"{name}: failed: {why}\n"
            for name, why in checks.items()
        )
        return web.Response(status=503 if failed else 200, text=body)

    app = web.Application(middlewares=[first], client_max_size=LIMITS.max_body or 1)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app
