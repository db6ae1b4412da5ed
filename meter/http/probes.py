"""``GET /metrics``, ``/healthz`` and ``/readyz`` (``metrics_address``): an aiohttp
application built from what the node exposes; nothing here touches the counting path."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from meter.http.listener import Handler, Limits

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


def probe_handler(endpoints: Endpoints) -> Handler:
    """The probes' handler: ``GET`` (or ``HEAD``) ``/metrics``, ``/healthz``, ``/readyz``;
    another method is 405, another path 404."""

    def metrics(request: web.BaseRequest) -> web.Response:
        # (the content type carries its own parameters: set as a header, not content_type)
        return web.Response(
            body=endpoints.metrics(), headers={"Content-Type": endpoints.metrics_content_type}
        )

    def healthz(request: web.BaseRequest) -> web.Response:
        return web.Response(text="ok\n")

    def readyz(request: web.BaseRequest) -> web.Response:
        checks = endpoints.checks()
        if "counting" in request.query:
            checks = {name: checks[name] for name in endpoints.counting_checks}
        failed = any(why is not None for why in checks.values())
        body = "".join(
            f"{name}: ok\n" if why is None else f"{name}: failed: {why}\n"
            for name, why in checks.items()
        )
        return web.Response(status=503 if failed else 200, text=body)

    paths = {"/metrics": metrics, "/healthz": healthz, "/readyz": readyz}

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        answer = paths.get(request.path)
        if answer is None:
            return web.Response(status=404, text="not found: try /metrics, /healthz or /readyz\n")
        if request.method not in ("GET", "HEAD"):
            return web.Response(
                status=405, text="method not allowed: GET or HEAD\n", headers={"Allow": "GET, HEAD"}
            )
        return answer(request)

    return handle
