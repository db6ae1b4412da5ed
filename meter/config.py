"""Configuration: one dataclass per subsystem, from defaults, a TOML file, ``METER_*`` environment
variables and command-line flags, in that order of precedence (later wins).

Every setting has one name used everywhere: the TOML key ``flush_interval_ms`` is the variable
``METER_FLUSH_INTERVAL_MS`` and the flag ``--flush-interval-ms``. A bad value raises
:class:`~meter.errors.ConfigError` naming the setting.

Why one module: a setting's name, variable, parser and dataclass field are read together
(the table ``_SETTINGS`` names each once), and the dataclasses are small.
"""

from __future__ import annotations

import ipaddress
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cluster.shards import MAX_SHARDS
from meter.compiled import PURE_ENV
from meter.core.keys import FEATURE_RE, PeriodKind
from meter.errors import ConfigError

STORAGE_KINDS = ("sqlite", "memory", "dynamodb")
NODE_ID_RE = re.compile(r"[A-Za-z0-9_\-]{1,64}")
#: DynamoDB's rule for table names.
DYNAMODB_TABLE_RE = re.compile(r"[a-zA-Z0-9_.-]{3,255}")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The Unix socket the node listens on."""

    socket: Path = Path("./meter.sock")
    #: When set, the socket is group-accessible (0660) and owned by this group.
    socket_group: str | None = None
    #: Largest request frame accepted, in bytes; a larger one closes the connection.
    max_frame_bytes: int = 1 << 20
    #: How long a draining node waits for requests in flight (waiting on storage) before it
    #: answers them ``unavailable``.
    request_drain_timeout_s: float = 5.0
    #: Python's youngest garbage-collector generation is collected after this many
    #: allocations (Python's default, 700, made a loaded node collect every few hundred
    #: decoded gossip items; ADR 0007). 0: Python's default.
    gc_young_threshold: int = 20_000


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """Where counters are flushed to and seeded from."""

    kind: str = "sqlite"
    #: SQLite file (inside the data dir unless absolute).
    sqlite_file: str = "counters.sqlite3"
    dynamodb_table: str = "meter_counters"
    dynamodb_endpoint: str | None = None
    dynamodb_region: str | None = None
    dynamodb_concurrency: int = 64
    dynamodb_max_pool_connections: int = 64
    dynamodb_connect_timeout_s: float = 2.0
    dynamodb_read_timeout_s: float = 5.0
    #: How DynamoDB flushes: ``batched`` (transactions), ``single`` (one UpdateItem a key)
    #: or ``auto`` (transactions but for keys that met a conflicting write lately; ADR 0015).
    flush_mode: str = "auto"
    #: Items per flush transaction (``None``: 10 on a loopback endpoint, DynamoDB Local's
    #: limit, else 100, DynamoDB's).
    dynamodb_transact_items: int | None = None
    #: How long stored counters live after their period ends (or their last write, if later).
    retention_days: int = 400
    #: How often expired counters are deleted (SQLite; DynamoDB expires them by TTL).
    purge_interval_s: float = 3600.0


#: Distinct tenants one node may watch, every connection together: each tick reads each
#: watched tenant's loaded counters (the ``max_watched_tenants`` setting's default).
MAX_WATCHED_TENANTS = 1024
#: Longest ``period_grace_s``: ten years (late calls reach back that far at most).
MAX_PERIOD_GRACE_S = 3650 * 86400


@dataclass(frozen=True, slots=True)
class CounterConfig:
    """Counter periods and reservations."""

    #: Feature -> period kind; features not listed count per UTC calendar month.
    feature_periods: Mapping[str, PeriodKind] = field(default_factory=dict)
    #: A call with ``at`` in an ended period is counted until its end plus this many seconds,
    #: then refused with ``period_closed`` (docs/protocol.md).
    period_grace_s: float = 3600.0
    #: Lease of a reservation when the caller gives no ``ttl_ms``.
    reservation_ttl_ms: int = 30_000
    #: Longest lease a caller may ask for.
    max_reservation_ttl_ms: int = 24 * 3600 * 1000
    #: A warm key unused for this long (and with nothing pending) is dropped from memory.
    evict_after_s: float = 600.0
    #: Seconds before a period ends at which the next period's keys of every warm key are
    #: read ahead (0: off). Capped at ``evict_after_s`` so the rows read survive to be used.
    rollover_read_ahead_s: float = 120.0
    #: Most keys a checkpoint of the write-ahead log lists as warm, and a restarted node reads
    #: ahead (docs/durability.md, "Warm-up after a restart"); 0: no warm-up.
    warm_up_max_keys: int = 1_000_000
    #: How often the stored limits' version is read while the gossip bus is down or absent
    #: (with it up, changes arrive as frames; docs/quotas.md).
    limits_poll_ms: int = 500
    #: ``acme/alice`` also counts on ``acme`` (docs/quotas.md, ADR 0008); fleet-wide.
    tenant_hierarchy: bool = False
    #: A TOML file of plans written to storage at start (docs/quotas.md), if set.
    plans_file: Path | None = None
    #: Distinct tenants the node's live usage subscriptions may watch, every connection
    #: together (each push tick reads every watched tenant's loaded counters).
    max_watched_tenants: int = MAX_WATCHED_TENANTS
    #: How long a node's share of a strict budget stays its own without a renewal; after it
    #: (plus half of it for clocks) another node may take back what the share did not
    #: promise (docs/quotas.md, ADR 0009).
    strict_lease_ms: int = 10_000
    #: Most units one grant of a strict budget gives a node.
    strict_share_max: int = 10_000
    #: Credit balances whose crossing downwards is alerted, once per crossing
    #: (docs/ledger.md, "Balance alerts"); empty: none.
    balance_alerts: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class FlushConfig:
    """The flusher."""

    interval_ms: int = 1000
    #: Keys per storage batch (one SQLite transaction; bounded concurrent writes for DynamoDB).
    batch_keys: int = 10_000
    #: Backoff after a failed flush: doubles from ``interval_ms`` up to this.
    max_backoff_ms: int = 30_000
    #: How long a draining node keeps trying to flush before it gives up and exits 1.
    drain_timeout_s: float = 30.0


DURABILITY_MODES = ("fsync", "interval", "off")


@dataclass(frozen=True, slots=True)
class DurabilityConfig:
    """The write-ahead log and request ids (see docs/durability.md)."""

    #: ``fsync`` (answer after fsync), ``interval`` (answer after write, fsync every
    #: ``fsync_interval_ms``) or ``off`` (no log). ``None``: ``off`` on ``memory`` storage,
    #: else ``fsync``.
    mode: str | None = None
    fsync_interval_ms: int = 1000
    #: A log segment is closed (and the log compacted) once it grows past this.
    segment_bytes: int = 64 << 20
    #: How long a request id is remembered.
    idempotency_window_s: float = 86400.0
    #: Most request ids remembered; past it the oldest are dropped (counted in ``status``).
    idempotency_max_ids: int = 250_000

    def effective_mode(self, storage_kind: str) -> str:
        """The mode in force for ``storage_kind`` (resolves the default)."""
        if self.mode is not None:
            return self.mode
        return "off" if storage_kind == "memory" else "fsync"


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Gossip to peers (off when neither ``redis_url`` nor ``redis_cluster_nodes`` is set)."""

    redis_url: str | None = None
    #: A Redis Cluster's startup nodes (``host:port``; one may be a ``redis://`` or
    #: ``rediss://`` URL, whose AUTH and TLS serve all): sharded pub/sub (ADR 0024).
    redis_cluster_nodes: tuple[str, ...] = ()
    gossip_interval_ms: int = 100
    cluster_name: str = "meter"
    secret: str | None = None
    #: A heartbeat is sent when nothing else was for this long.
    heartbeat_ms: int = 1000
    #: A peer silent this long is dead (its un-flushed gossip is forgotten).
    peer_timeout_ms: int = 5000
    #: Every warm key is re-read from storage this often to bound drift (0: never).
    reconcile_s: float = 60.0
    #: The Redis Stream threshold alerts are added to (docs/quotas.md), and its MAXLEN (~).
    alerts_stream: str = "meter:alerts"
    alerts_stream_maxlen: int = 100_000
    #: Gossip shards K (ADR 0024): fixed when the cluster is created, stored with it; 1 is
    #: one channel for everything.
    gossip_shards: int = 1
    #: ``all``: listen to every shard; ``warm``: only to the shards of tenants held warm.
    gossip_subscribe: str = "all"

    @property
    def gossip(self) -> bool:
        """Whether the node gossips (a Redis or a Redis Cluster is set)."""
        return bool(self.redis_url or self.redis_cluster_nodes)


@dataclass(frozen=True, slots=True)
class OwnerConfig:
    """The node's hold on its id in storage (one process per node id, ADR 0004)."""

    #: How long a claim lasts unless renewed (every third of it). Another data dir can take the
    #: id of a crashed node after this; a clean stop releases it at once.
    lease_s: float = 30.0


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """The HTTP listener for Prometheus metrics and health probes (docs/operations.md)."""

    #: ``(host, port)`` to listen on; port 0 takes any free port. ``None``: no listener at
    #: all, and nothing on the request path is counted for metrics.
    address: tuple[str, int] | None = None
    #: Units stored are labelled by feature for at most this many features (the rest as
    #: ``other``); 0: no feature label. Never a tenant label.
    feature_labels: int = 0


@dataclass(frozen=True, slots=True)
class HttpConfig:
    """The HTTP/JSON API (docs/http.md): on a Unix socket of its own, and on a TCP address."""

    #: The API's Unix socket (mode 0600); ``None``: none.
    socket: Path | None = None
    #: ``(host, port)`` of the API on TCP; ``None``: none. A host that is not a loopback
    #: address needs ``token``.
    address: tuple[str, int] | None = None
    #: With it, every request on ``address`` must send ``Authorization: Bearer <token>``.
    token: str | None = None


@dataclass(frozen=True, slots=True)
class WebhookConfig:
    """Signed webhooks of alerts (docs/quotas.md, "Webhooks")."""

    #: ``(url, kinds)`` each; none: no webhooks.
    urls: tuple[tuple[str, frozenset[str]], ...] = ()
    #: The HMAC-SHA256 key every body is signed with (needed with ``urls``).
    secret: str | None = None
    #: A delivery is tried for this long, then given up (counted ``failed``).
    max_age_s: float = 86_400.0
    #: One try's time limit.
    timeout_s: float = 10.0


#: Most features ``metrics_feature_labels`` may label (each is a series on every scrape).
MAX_FEATURE_LABELS = 1000


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """Everything a node needs, one object per subsystem."""

    data_dir: Path = Path("./.meter")
    #: Stable id of this node; generated once and kept in the data dir when not given.
    node_id: str | None = None
    log_level: str = "INFO"
    #: ``text`` (a line per record for people) or ``json`` (one object per line).
    log_format: str = "text"
    server: ServerConfig = field(default_factory=ServerConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    counters: CounterConfig = field(default_factory=CounterConfig)
    flush: FlushConfig = field(default_factory=FlushConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    durability: DurabilityConfig = field(default_factory=DurabilityConfig)
    owner: OwnerConfig = field(default_factory=OwnerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    webhooks: WebhookConfig = field(default_factory=WebhookConfig)


def _str(setting: str, raw: Any) -> str:
    if not isinstance(raw, str) or not raw:
        raise ConfigError(setting, f"must be a non-empty string, got {raw!r}")
    return raw


def _opt_str(setting: str, raw: Any) -> str | None:
    if raw is None or raw == "":
        return None
    return _str(setting, raw)


def _choice(options: tuple[str, ...]) -> Any:
    """A parser of one of ``options`` (any case)."""

    def parse(setting: str, raw: Any) -> str:
        value = _str(setting, raw).lower()
        if value not in options:
            raise ConfigError(setting, f"must be one of {', '.join(options)}, got {raw!r}")
        return value

    return parse


def _path(setting: str, raw: Any) -> Path:
    return Path(_str(setting, raw))


def _opt_path(setting: str, raw: Any) -> Path | None:
    value = _opt_str(setting, raw)
    return None if value is None else Path(value)


def _bool(setting: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in ("true", "1", "yes", "on"):
        return True
    if isinstance(raw, str) and raw.strip().lower() in ("false", "0", "no", "off"):
        return False
    raise ConfigError(setting, f"must be true or false, got {raw!r}")


def _int(lo: int, hi: int) -> Any:
    def parse(setting: str, raw: Any) -> int:
        if isinstance(raw, str):
            try:
                raw = int(raw.strip())
            except ValueError:
                raise ConfigError(setting, f"must be an integer, got {raw!r}") from None
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ConfigError(setting, f"must be an integer, got {raw!r}")
        if not lo <= raw <= hi:
            raise ConfigError(setting, f"must be between {lo} and {hi}, got {raw}")
        return raw

    return parse


def _opt_int(lo: int, hi: int) -> Any:
    parse_int = _int(lo, hi)

    def parse(setting: str, raw: Any) -> int | None:
        if raw is None or raw == "":
            return None
        return int(parse_int(setting, raw))

    return parse


def _float(lo: float, hi: float) -> Any:
    def parse(setting: str, raw: Any) -> float:
        if isinstance(raw, str):
            try:
                raw = float(raw.strip())
            except ValueError:
                raise ConfigError(setting, f"must be a number, got {raw!r}") from None
        if isinstance(raw, bool) or not isinstance(raw, int | float) or raw != raw:
            raise ConfigError(setting, f"must be a number, got {raw!r}")
        if not lo <= raw <= hi:
            raise ConfigError(setting, f"must be between {lo} and {hi}, got {raw}")
        return float(raw)

    return parse


FLUSH_MODES = ("auto", "batched", "single")
GOSSIP_SUBSCRIBE = ("all", "warm")


def _node_id(setting: str, raw: Any) -> str | None:
    value = _opt_str(setting, raw)
    if value is not None and NODE_ID_RE.fullmatch(value) is None:
        raise ConfigError(setting, f"must be 1-64 of [A-Za-z0-9_-], got {raw!r}")
    return value


def _dynamodb_table(setting: str, raw: Any) -> str:
    value = _str(setting, raw)
    if DYNAMODB_TABLE_RE.fullmatch(value) is None:
        raise ConfigError(
            setting, f"must be 3-255 of [a-zA-Z0-9_.-] (DynamoDB's rule), got {raw!r}"
        )
    return value


def _log_level(setting: str, raw: Any) -> str:
    level = _str(setting, raw).upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ConfigError(setting, f"must be DEBUG, INFO, WARNING or ERROR, got {raw!r}")
    return level


def _log_format(setting: str, raw: Any) -> str:
    fmt = _str(setting, raw).lower()
    if fmt not in ("text", "json"):
        raise ConfigError(setting, f"must be text or json, got {raw!r}")
    return fmt


def _url(schemes: tuple[str, ...]) -> Any:
    def parse(setting: str, raw: Any) -> str | None:
        value = _opt_str(setting, raw)
        if value is not None and not value.startswith(schemes):
            raise ConfigError(setting, f"must start with {' or '.join(schemes)}, got {raw!r}")
        return value

    return parse


def _cluster_nodes(setting: str, raw: Any) -> tuple[str, ...]:
    """``host:port,host:port`` (or a TOML list); each item is checked when the bus is built
    (:func:`cluster.redis_cluster_bus.startup_nodes`)."""
    items = raw.split(",") if isinstance(raw, str) else raw
    if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
        raise ConfigError(setting, "must be host:port items, comma-separated")
    return tuple(i.strip() for i in items if i.strip())


def _address(setting: str, raw: Any) -> tuple[str, int] | None:
    """``host:port`` (``[v6]:port`` for an IPv6 address), port 0..65535; empty: none."""
    value = _opt_str(setting, raw)
    if value is None:
        return None
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if (
        not sep
        or not host
        or any(c in host for c in "[]/ ")
        or (":" in host and not value.startswith("["))
        or not port.isdigit()
        or not 0 <= int(port) <= 65535
    ):
        raise ConfigError(setting, f"must be host:port (port 0-65535, [ipv6]:port), got {raw!r}")
    return host, int(port)


#: The kinds of alert a webhook URL may be limited to (``https://...#balance``).
WEBHOOK_KINDS = frozenset({"threshold", "balance"})


def _webhook_urls(setting: str, raw: Any) -> tuple[tuple[str, frozenset[str]], ...]:
    """``url,url#balance,...`` (a list in TOML): each an http(s) URL, its fragment (never
    sent) the kinds it gets: ``threshold``, ``balance``, joined by ``+``; none: both."""
    items = raw.split(",") if isinstance(raw, str) else raw
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise ConfigError(setting, f"must be comma-separated URLs, got {raw!r}")
    out = []
    for item in (x.strip() for x in items if x.strip()):
        url, _, selector = item.partition("#")
        parts = urlsplit(url)
        try:
            ok = parts.scheme in ("http", "https") and bool(parts.hostname)
            (parts.hostname or "").encode("idna")  # (a label over 63 characters: no host)
        except (UnicodeError, ValueError):
            ok = False
        if not ok:
            raise ConfigError(setting, f"{item!r} is not an http:// or https:// URL")
        kinds = frozenset(selector.split("+")) if selector else WEBHOOK_KINDS
        if not kinds <= WEBHOOK_KINDS:
            raise ConfigError(setting, f"{item!r}: kinds are balance and threshold, joined by +")
        out.append((url, kinds))
    return tuple(out)


def _loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name that may resolve anywhere


def _balance_alerts(setting: str, raw: Any) -> tuple[int, ...]:
    """``[1000, 100]`` in TOML, or ``1000,100`` in env/flags: credit amounts, each 1..2^63-1."""
    if isinstance(raw, str):
        try:
            raw = [int(p) for p in filter(None, (p.strip() for p in raw.split(",")))]
        except ValueError:
            raise ConfigError(setting, f"expected amounts like 1000,100, got {raw!r}") from None
    if not isinstance(raw, list) or len(raw) > 10:
        raise ConfigError(setting, "must be a list of at most 10 credit amounts")
    for n in raw:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 2**63 - 1:
            raise ConfigError(setting, f"amounts must be integers 1..2^63-1, got {n!r}")
    if len(set(raw)) != len(raw):
        raise ConfigError(setting, "an amount is listed twice")
    return tuple(sorted(raw))


def _feature_periods(setting: str, raw: Any) -> dict[str, PeriodKind]:
    """``{"api_calls": "day"}`` in TOML, or ``api_calls=day,seats=month`` in env/flags."""
    if isinstance(raw, str):
        pairs: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in raw.split(","))):
            name, sep, kind = part.partition("=")
            if not sep:
                raise ConfigError(setting, f"expected feature=month|day, got {part!r}")
            pairs[name.strip()] = kind.strip()
        raw = pairs
    if not isinstance(raw, dict):
        raise ConfigError(setting, "must be a table of feature = 'month' | 'day'")
    out: dict[str, PeriodKind] = {}
    for name, kind in raw.items():
        if not isinstance(name, str) or FEATURE_RE.fullmatch(name) is None:
            raise ConfigError(setting, f"bad feature name {name!r}")
        if kind not in ("month", "day"):
            raise ConfigError(setting, f"period of {name!r} must be 'month' or 'day', got {kind!r}")
        out[name] = kind
    return out


# setting name -> (subsystem, or "" for the top level; field name; parser)
_SETTINGS: dict[str, tuple[str, str, Any]] = {
    "data_dir": ("", "data_dir", _path),
    "node_id": ("", "node_id", _node_id),
    "log_level": ("", "log_level", _log_level),
    "log_format": ("", "log_format", _log_format),
    "socket": ("server", "socket", _path),
    "socket_group": ("server", "socket_group", _opt_str),
    "max_frame_bytes": ("server", "max_frame_bytes", _int(1024, 64 << 20)),
    "request_drain_timeout_s": ("server", "request_drain_timeout_s", _float(0, 3600)),
    "gc_young_threshold": ("server", "gc_young_threshold", _int(0, 1_000_000)),
    "storage": ("storage", "kind", _choice(STORAGE_KINDS)),
    "sqlite_file": ("storage", "sqlite_file", _str),
    "dynamodb_table": ("storage", "dynamodb_table", _dynamodb_table),
    "dynamodb_endpoint": ("storage", "dynamodb_endpoint", _url(("http://", "https://"))),
    "dynamodb_region": ("storage", "dynamodb_region", _opt_str),
    "dynamodb_concurrency": ("storage", "dynamodb_concurrency", _int(1, 1024)),
    "dynamodb_max_pool_connections": ("storage", "dynamodb_max_pool_connections", _int(1, 1024)),
    "dynamodb_connect_timeout_s": ("storage", "dynamodb_connect_timeout_s", _float(0.05, 120)),
    "dynamodb_read_timeout_s": ("storage", "dynamodb_read_timeout_s", _float(0.05, 600)),
    "flush_mode": ("storage", "flush_mode", _choice(FLUSH_MODES)),
    "dynamodb_transact_items": ("storage", "dynamodb_transact_items", _opt_int(2, 100)),
    "retention_days": ("storage", "retention_days", _int(1, 36500)),
    "retention_purge_interval_s": ("storage", "purge_interval_s", _float(0.1, 10**7)),
    "feature_periods": ("counters", "feature_periods", _feature_periods),
    "period_grace_s": ("counters", "period_grace_s", _float(0, MAX_PERIOD_GRACE_S)),
    "reservation_ttl_ms": ("counters", "reservation_ttl_ms", _int(1, 24 * 3600 * 1000)),
    "evict_after_s": ("counters", "evict_after_s", _float(1, 10**7)),
    "rollover_read_ahead_s": ("counters", "rollover_read_ahead_s", _float(0, 86400)),
    "warm_up_max_keys": ("counters", "warm_up_max_keys", _int(0, 100_000_000)),
    "limits_poll_ms": ("counters", "limits_poll_ms", _int(50, 600_000)),
    "tenant_hierarchy": ("counters", "tenant_hierarchy", _bool),
    "plans_file": ("counters", "plans_file", _path),
    "max_watched_tenants": ("counters", "max_watched_tenants", _int(1, 1_000_000)),
    "strict_lease_ms": ("counters", "strict_lease_ms", _int(300, 3_600_000)),
    "strict_share_max": ("counters", "strict_share_max", _int(1, 10**15)),
    "balance_alerts": ("counters", "balance_alerts", _balance_alerts),
    "flush_interval_ms": ("flush", "interval_ms", _int(1, 3_600_000)),
    "flush_batch_keys": ("flush", "batch_keys", _int(1, 1_000_000)),
    "flush_max_backoff_ms": ("flush", "max_backoff_ms", _int(1, 3_600_000)),
    "drain_timeout_s": ("flush", "drain_timeout_s", _float(0, 3600)),
    "redis_url": ("cluster", "redis_url", _url(("redis://", "rediss://", "unix://"))),
    "redis_cluster_nodes": ("cluster", "redis_cluster_nodes", _cluster_nodes),
    "gossip_interval_ms": ("cluster", "gossip_interval_ms", _int(1, 60_000)),
    "cluster_name": ("cluster", "cluster_name", _str),
    "cluster_secret": ("cluster", "secret", _opt_str),
    "cluster_heartbeat_ms": ("cluster", "heartbeat_ms", _int(10, 600_000)),
    "cluster_peer_timeout_ms": ("cluster", "peer_timeout_ms", _int(100, 3_600_000)),
    "cluster_reconcile_s": ("cluster", "reconcile_s", _float(0, 10**7)),
    "alerts_stream": ("cluster", "alerts_stream", _str),
    "alerts_stream_maxlen": ("cluster", "alerts_stream_maxlen", _int(1, 1_000_000_000)),
    "gossip_shards": ("cluster", "gossip_shards", _int(1, MAX_SHARDS)),
    "gossip_subscribe": ("cluster", "gossip_subscribe", _choice(GOSSIP_SUBSCRIBE)),
    "durability": ("durability", "mode", _choice(DURABILITY_MODES)),
    "wal_fsync_interval_ms": ("durability", "fsync_interval_ms", _int(1, 60_000)),
    "wal_segment_bytes": ("durability", "segment_bytes", _int(4096, 1 << 40)),
    "idempotency_window_s": ("durability", "idempotency_window_s", _float(1, 30 * 86400)),
    "idempotency_max_ids": ("durability", "idempotency_max_ids", _int(1, 100_000_000)),
    "owner_lease_s": ("owner", "lease_s", _float(1, 86400)),
    "metrics_address": ("metrics", "address", _address),
    "metrics_feature_labels": ("metrics", "feature_labels", _int(0, MAX_FEATURE_LABELS)),
    "http_socket": ("http", "socket", _opt_path),
    "http_address": ("http", "address", _address),
    "http_token": ("http", "token", _opt_str),
    "webhook_urls": ("webhooks", "urls", _webhook_urls),
    "webhook_secret": ("webhooks", "secret", _opt_str),
    "webhook_max_age_s": ("webhooks", "max_age_s", _float(1, 30 * 86_400)),
    "webhook_timeout_s": ("webhooks", "timeout_s", _float(0.1, 600)),
}

#: Every setting name (TOML key; ``METER_`` + upper case is its environment variable).
SETTING_NAMES = tuple(_SETTINGS)


def env_name(setting: str) -> str:
    """The environment variable of a setting (``flush_interval_ms`` -> ``METER_FLUSH_...``)."""
    return "METER_" + setting.upper()


def load(
    *,
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> NodeConfig:
    """Build a :class:`NodeConfig` from a TOML file, the environment and flags (later wins).

    ``file`` defaults to ``$METER_CONFIG`` when set. Unknown TOML keys and unknown ``METER_*``
    variables are errors, so a typo never silently falls back to a default.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    file = file or env.get("METER_CONFIG") or None
    if file is not None:
        values.update(_read_toml(Path(file)))
    # METER_PURE_PYTHON is read at import, before any setting (meter.compiled).
    known_env = {env_name(s): s for s in _SETTINGS} | {"METER_CONFIG": "", PURE_ENV: ""}
    for name, raw in env.items():
        if not name.startswith("METER_"):
            continue
        setting = known_env.get(name)
        if setting is None:
            raise ConfigError(name, "unknown setting (see docs/configuration.md)")
        if setting:
            values[setting] = raw
    for setting, raw in (flags or {}).items():
        if raw is not None:
            values[setting] = raw
    return _build(values)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError("config", f"file {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError("config", f"cannot read {path}: {exc}") from None
    for key in data:
        if key not in _SETTINGS:
            raise ConfigError(key, f"unknown setting in {path}")
    return data


def _build(values: Mapping[str, Any]) -> NodeConfig:
    parts: dict[str, dict[str, Any]] = {
        "": {},
        "server": {},
        "storage": {},
        "counters": {},
        "flush": {},
        "cluster": {},
        "durability": {},
        "owner": {},
        "metrics": {},
        "http": {},
        "webhooks": {},
    }
    for setting, raw in values.items():
        if setting not in _SETTINGS:
            raise ConfigError(setting, "unknown setting")
        group, name, parse = _SETTINGS[setting]
        parts[group][name] = parse(setting, raw)
    cfg = NodeConfig(
        **parts[""],
        server=ServerConfig(**parts["server"]),
        storage=StorageConfig(**parts["storage"]),
        counters=CounterConfig(**parts["counters"]),
        flush=FlushConfig(**parts["flush"]),
        cluster=ClusterConfig(**parts["cluster"]),
        durability=DurabilityConfig(**parts["durability"]),
        owner=OwnerConfig(**parts["owner"]),
        metrics=MetricsConfig(**parts["metrics"]),
        http=HttpConfig(**parts["http"]),
        webhooks=WebhookConfig(**parts["webhooks"]),
    )
    for setting, path in (("socket", cfg.server.socket), ("http_socket", cfg.http.socket)):
        if path is not None and len(str(path).encode()) > 100:
            raise ConfigError(setting, "path longer than 100 bytes (the AF_UNIX limit is 107)")
    if cfg.http.socket is not None and cfg.http.socket == cfg.server.socket:
        raise ConfigError("http_socket", "must differ from socket (each has its own protocol)")
    if cfg.webhooks.urls and not (cfg.webhooks.secret or "").strip():
        raise ConfigError("webhook_secret", "webhook_urls needs a secret to sign with")
    address = cfg.http.address
    if address is not None and cfg.http.token is None and not _loopback(address[0]):
        raise ConfigError(
            "http_address",
            f"{address[0]} is not a loopback address: set http_token too (docs/deployment.md)",
        )
    c = cfg.cluster
    if c.redis_url and c.redis_cluster_nodes:
        raise ConfigError("redis_cluster_nodes", "set redis_url or redis_cluster_nodes, not both")
    if c.gossip_subscribe == "warm" and c.gossip_shards == 1:
        raise ConfigError("gossip_subscribe", "warm needs gossip_shards above 1 (ADR 0024)")
    if c.peer_timeout_ms <= 2 * c.heartbeat_ms:
        # An idle peer speaks once per heartbeat: with one heartbeat lost (or late) it must
        # not be declared dead, which forgets its gossip and costs a resync.
        raise ConfigError(
            "cluster_peer_timeout_ms",
            f"must be more than twice cluster_heartbeat_ms ({c.heartbeat_ms} ms), "
            f"got {c.peer_timeout_ms}",
        )
    return cfg
