"""A running node's health: ``status``'s node fields, and the checks behind ``/readyz`` and
``meter status --check`` (docs/operations.md).

The node is read through :class:`NodeView` (what :class:`meter.node.lifecycle.Node` has), so
this module and :mod:`meter.ops.metrics` need nothing above them.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Any, Protocol

from cluster.gossip import Gossip
from meter.config import NodeConfig
from meter.core.server import RpcServer
from meter.core.service import Service
from meter.core.table import CounterTable
from meter.http.api import Api
from meter.http.listener import Listener
from meter.persist.closing import PeriodCloser, overdue_s
from meter.persist.flusher import Flusher
from meter.persist.gauges import GaugeFlusher
from meter.persist.owner import Ownership
from meter.quotas.alerts import Alerts
from meter.quotas.shares import Shares
from meter.quotas.webhooks import Webhooks
from meter.wal.log import WriteAheadLog
from storage.base import Snapshot


class NodeView(Protocol):
    """A running node's parts, as health and metrics read them (``None``: not built yet, or
    not configured)."""

    @property
    def config(self) -> NodeConfig: ...
    @property
    def table(self) -> CounterTable | None: ...
    @property
    def service(self) -> Service | None: ...
    @property
    def flusher(self) -> Flusher | None: ...
    @property
    def gauge_flusher(self) -> GaugeFlusher | None: ...
    @property
    def server(self) -> RpcServer | None: ...
    @property
    def wal(self) -> WriteAheadLog | None: ...
    @property
    def gossip(self) -> Gossip[Snapshot] | None: ...
    @property
    def owner(self) -> Ownership | None: ...
    @property
    def shares(self) -> Shares | None: ...
    @property
    def alerts(self) -> Alerts | None: ...
    @property
    def metrics_address(self) -> str | None:
        """Where ``/metrics`` and the probes listen, once they do."""
        ...

    @property
    def closer(self) -> PeriodCloser | None: ...

    #: The HTTP/JSON API (``None``: not configured) and its listeners.
    api: Api | None
    api_listeners: list[Listener]
    #: The alerts' webhooks (``None``: no ``webhook_urls``).
    webhooks: Webhooks | None

    @property
    def stopping(self) -> bool:
        """Whether the node was asked to stop (it drains)."""
        ...


def status_fields(node: NodeView) -> dict[str, Any]:
    """What ``status`` says of the node beside its service's counts."""
    assert node.flusher is not None and node.table is not None
    fs = node.flusher.stats
    backlog, backlog_units = node.flusher.backlog()
    now = time.time()
    config = node.config
    out: dict[str, Any] = {
        "socket": str(config.server.socket),
        "data_dir": str(config.data_dir),
        "flush": {
            "interval_ms": config.flush.interval_ms,
            "last_result": fs.last_result,
            "last_at": fs.last_at,
            "last_age_s": None if fs.last_at is None else round(now - fs.last_at, 3),
            "last_error": fs.last_error,
            "rounds": fs.rounds,
            "keys_written": fs.keys_written,
            "duplicates": fs.duplicates,
            "reseeded": fs.reseeded,
            "failures": fs.failures,
            "backlog_keys": len(backlog),
            "backlog_units": backlog_units,
            "backlog_age_s": None if fs.backlog_since is None else round(now - fs.backlog_since, 3),
            "poisoned": [{"key": list(k), "error": e} for k, e in list(fs.poisoned.items())[:20]],
            "cpu_s": round(fs.cpu_seconds, 3),
            "cpu_us_per_key": (
                None if not fs.keys_written else round(fs.cpu_seconds / fs.keys_written * 1e6, 1)
            ),
            "writes": dataclasses.asdict(node.flusher.storage.write_stats()),
            "stretch": fs.stretch,
            "stretched_keys": fs.stretched,
        },
    }
    if node.gauge_flusher is not None:
        gs = node.gauge_flusher.stats
        out["gauges"] = {
            "warm": len(node.gauge_flusher.table),
            "unstored": len(node.gauge_flusher.table.dirty()),
            "rounds": gs.rounds,
            "written": gs.written,
            "failed_rounds": gs.failed_rounds,
            "last_error": gs.last_error,
            "last_at": gs.last_at,
        }
    if node.service is not None:
        out["uniques"] = node.service.uniques.status()
    if node.closer is not None:
        oldest = node.closer.oldest_open()
        grace = config.counters.period_grace_s
        out["periods"] = {
            "open": sorted(node.closer.open),
            "foreign": sorted(node.closer.foreign),
            "oldest_open": oldest,
            "overdue_s": round(overdue_s(oldest, grace, now), 3),
            "closed": node.closer.closed_total,
        }
    out["gc"] = {
        "threshold": list(gc.get_threshold()),
        "frozen": gc.get_freeze_count(),
        "collections": [s["collections"] for s in gc.get_stats()],
    }
    if node.owner is not None:
        # counting: mutating calls are taken (owned, and re-read since the claim).
        counting = node.service is None or node.service.fenced is None
        out["owner"] = {**node.owner.status(), "counting": counting}
    if node.server is not None:
        out["server"] = node.server.stats()
    out["durability"] = {
        "mode": "off" if node.wal is None else node.wal.mode,
        "wal": None if node.wal is None else node.wal.status(),
    }
    if node.gossip is not None:
        out["cluster"] = node.gossip.status()
    out["not_ready"] = not_ready(node)
    out["ready"] = not out["not_ready"]
    out["degraded"] = degraded(node)
    out["metrics"] = {
        "address": node.metrics_address,
        "feature_labels": config.metrics.feature_labels,
    }
    socket = None if config.http.socket is None else str(config.http.socket)
    if node.webhooks is not None:
        out["webhooks"] = node.webhooks.status()
    out["http"] = {  # where the API listens, its calls and event streams
        "socket": socket,
        "address": next((x.address for x in node.api_listeners if x.address != socket), None),
        **({} if node.api is None else node.api.stats()),
    }
    return out


def health_checks(node: NodeView) -> dict[str, str | None]:
    """``/readyz``'s checks: ``counting``, ``log``, ``storage`` and ``bus``, each ``None``
    (ok, or not configured) or why it fails; the first two say whether the node can count
    (:func:`not_ready`), the others what works less than fully (:func:`degraded`)."""
    reasons = not_ready(node)
    if node.server is None:
        reasons.append("starting: the socket is not open yet")
    weak = degraded(node)

    def joined(reasons: list[str], prefix: str, keep: bool = True) -> str | None:
        picked = [
            r.removeprefix(prefix).lstrip() if keep else r
            for r in reasons
            if r.startswith(prefix) is keep
        ]
        return "; ".join(picked) or None

    return {
        "counting": joined(reasons, "log:", keep=False),
        "log": joined(reasons, "log:"),
        "storage": joined(weak, "storage:"),
        "bus": joined(weak, "bus:"),
    }


def can_count(checks: dict[str, str | None]) -> bool:
    """Whether :func:`health_checks` say the node can take counting calls."""
    return checks["counting"] is None and checks["log"] is None


def not_ready(node: NodeView) -> list[str]:
    """Why the node cannot take counting calls now (empty: ready), for ``meter status
    --check``: another process holds its id (or it was just claimed), its log cannot be
    written, or it is stopping. What shared services do is not here but in
    :func:`degraded`: every sidecar's probe failing at once with them would take every
    application pod out together, while the node serves on (docs/operations.md)."""
    out: list[str] = []
    if node.stopping:
        out.append("draining: the node is stopping")
    if node.service is not None and node.service.fenced is not None:
        out.append(f"owner: not counting: {node.service.fenced}")
    if node.wal is not None and node.wal.broken is not None:
        out.append(f"log: cannot write: {node.wal.broken}")
    return out


def degraded(node: NodeView) -> list[str]:
    """What works less than fully while the node still counts (``meter status --check
    --strict`` fails on these too): storage not answering (the last flush round failed, or
    could not write: the id's claim is not confirmed), or the bus down where one is
    configured."""
    out: list[str] = []
    fs = node.flusher.stats if node.flusher is not None else None
    fenced = node.service is not None and node.service.fenced is not None
    if fs is not None and not fenced and fs.last_result in ("error", "not owner"):
        out.append(f"storage: the last flush round failed: {fs.last_error}")
    elif node.owner is not None and node.owner.state == "unknown":
        out.append(f"storage: the node id's claim is not confirmed: {node.owner.last_error}")
    if node.gossip is not None and not node.gossip.bus.connected:
        out.append("bus: not connected (gossip paused; views lack peers' recent units)")
    return out
