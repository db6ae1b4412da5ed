"""The node's HTTP side started from its settings: the probes (``metrics_address``), the
HTTP/JSON API (``http_socket``, ``http_address``; docs/http.md) and the alerts' webhooks
(``webhook_urls``; docs/quotas.md)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from meter.config import NodeConfig, WebhookConfig
from meter.core.counts import RequestStats
from meter.core.server import group_id
from meter.core.service import Service
from meter.errors import ConfigError
from meter.http.api import Api
from meter.http.listener import Limits, Listener
from meter.http.probes import LIMITS, Endpoints, probe_handler
from meter.quotas.alerts import Alerts
from meter.quotas.webhooks import Webhooks
from meter.wal.log import WriteAheadLog

log = logging.getLogger("meter.node")

#: The API's listeners: connections at once (a new one past it closes an idle one), seconds
#: a new connection has to send a request head, seconds an idle keep-alive one is kept.
API_MAX_CONNECTIONS = 1024
API_HEAD_TIMEOUT_S = 10.0
API_KEEPALIVE_S = 75.0


async def start_probes(address: tuple[str, int], endpoints: Endpoints) -> tuple[Listener, str]:
    """The probes' listener on ``address``, and the ``host:port`` it bound; ConfigError
    naming ``metrics_address`` if it cannot listen."""
    listener = Listener(LIMITS, probe_handler(endpoints))
    return listener, await _listen_tcp(listener, "metrics_address", address)


async def _listen_tcp(listener: Listener, setting: str, address: tuple[str, int]) -> str:
    """``listener`` on ``address``; ConfigError naming ``setting`` if it cannot listen."""
    host, port = address
    try:
        return await listener.start_tcp(host, port)
    except OSError as exc:
        raise ConfigError(
            setting, f"cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from None


async def start_api(
    config: NodeConfig,
    service: Service,
    wal: WriteAheadLog | None,
    request_stats: RequestStats | None,
    listeners: list[Listener],
) -> Api | None:
    """The API over ``service``, served on the socket and the address ``config`` names
    (``None``: neither is set), each listener added to ``listeners`` before it starts (so the
    caller closes what started); ConfigError naming the setting if one cannot listen."""
    h = config.http
    if h.socket is None and h.address is None:
        return None
    api = Api(service, wal=wal, watch=service.watch, request_stats=request_stats)
    limits = Limits(
        max_connections=API_MAX_CONNECTIONS,
        head_timeout_s=API_HEAD_TIMEOUT_S,
        keepalive_s=API_KEEPALIVE_S,
        max_body=config.server.max_frame_bytes,
        shutdown_s=config.server.request_drain_timeout_s,
    )
    if h.socket is not None:
        listener = Listener(limits, api.handler())
        listeners.append(listener)
        group = config.server.socket_group  # (the RPC socket's: 0660 for it, else 0600)
        gid = None if group is None else group_id(group)
        try:
            await listener.start_unix(str(h.socket), 0o600 if gid is None else 0o660, gid)
        except FileExistsError:
            raise ConfigError("http_socket", f"{h.socket} exists and is not a socket") from None
        except OSError as exc:
            raise ConfigError(
                "http_socket", f"cannot listen on {h.socket}: {exc.strerror or exc}"
            ) from None
        log.info("HTTP/JSON API on unix:%s", h.socket)
    if h.address is not None:
        listener = Listener(limits, api.handler(h.token, tcp=True))
        listeners.append(listener)
        bound = await _listen_tcp(listener, "http_address", h.address)
        log.info("HTTP/JSON API on http://%s%s", bound, " (bearer token)" if h.token else "")
    return api


def webhooks(config: WebhookConfig, data_dir: Path) -> Webhooks | None:
    """The webhooks' outbox in ``data_dir``, if ``webhook_urls`` names any URL."""
    if not config.urls:
        outbox = data_dir / "webhooks.sqlite"
        if outbox.exists():
            log.warning("webhooks: %s is left unread without webhook_urls (its deliveries "
                        "wait until it is set again)", outbox)  # fmt: skip
        return None
    assert config.secret is not None  # (checked with the settings)
    data_dir.mkdir(parents=True, exist_ok=True)
    return Webhooks(
        config.urls,
        config.secret,
        data_dir,
        max_age_s=config.max_age_s,
        timeout_s=config.timeout_s,
    )


def deliver_webhooks(hooks: Webhooks | None, alerts: Alerts) -> list[asyncio.Task[None]]:
    """The alerts the outbox holds unclaimed claimed again, and its sender's task."""
    if hooks is None:
        return []
    resumed = hooks.resume(alerts)
    if resumed:
        log.info("webhooks: %d alerts' claims resumed from the outbox", resumed)
    return [asyncio.create_task(hooks.run(), name="webhooks")]
