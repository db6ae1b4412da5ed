"""The one place a node's parts are built and wired together, through their constructors.

Nothing assigns collaborators onto a part after it is built: a part that needs another gets
it as a constructor argument, typed by what it uses of it (a Protocol where the part sits
below it, :mod:`meter.core.ports`). Where two parts need each other (gossip tells the limits
of a change; the limits tell gossip of theirs), one of them is handed a bound method of the
:class:`~meter.node.lifecycle.Node`, which holds both. :func:`build_service` is also what
tests use to get a service over a table and a store without a node around it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.codec import DeltaItem
from cluster.gossip import Gossip, GossipSettings, Listener
from cluster.redis_bus import RedisBus
from cluster.redis_cluster_bus import RedisClusterBus
from cluster.shards import ShardMap
from meter.catalog.methods import FeatureMethods
from meter.config import CounterConfig, NodeConfig
from meter.core.children import ChildrenMethod
from meter.core.counts import PeriodUnits
from meter.core.fence import Fence
from meter.core.gate import Gate
from meter.core.gauges import GaugeTable
from meter.core.gauging import Gauging
from meter.core.groups import Groups
from meter.core.idempotency import RequestIds
from meter.core.journal import Journal
from meter.core.keycache import KeyCache
from meter.core.keys import Key
from meter.core.knownvalues import KnownValues
from meter.core.reserving import Reserving
from meter.core.seeder import Seeder
from meter.core.server import RpcServer, start_server
from meter.core.service import Service
from meter.core.table import CounterTable
from meter.core.tracking import Tracking
from meter.core.uniques import Uniques
from meter.core.valuevoids import ValueVoids
from meter.core.voids import Voids
from meter.core.watch import Watch
from meter.errors import ConfigError
from meter.history.methods import HistoryMethods
from meter.ledger import model as ledger
from meter.ledger.funding import LedgerFunder
from meter.ledger.methods import LedgerMethods
from meter.ledger.store import LedgerStore
from meter.ops.export import ExportMethod
from meter.persist.closing import PeriodMethods
from meter.quotas.alerts import Alert, Alerts, ClaimJournal
from meter.quotas.holds import PeerHolds
from meter.quotas.limits import LimitBook
from meter.quotas.methods import LimitMethods
from meter.quotas.shares import Shares
from meter.quotas.store import LimitStore
from meter.wal.log import WriteAheadLog
from storage.base import BadItems, Snapshot, Storage


def build_storage(cfg: NodeConfig) -> Storage:
    """The storage backend the configuration names (not opened yet)."""
    s = cfg.storage
    if s.kind == "memory":
        from storage.memory import MemoryStorage

        return MemoryStorage()
    if s.kind == "sqlite":
        from storage.sqlite import SQLiteStorage

        return SQLiteStorage(cfg.data_dir / s.sqlite_file, retention_days=s.retention_days)
    if s.kind == "dynamodb":
        from storage.dynamodb import DynamoDBStorage

        return DynamoDBStorage(
            s.dynamodb_table,
            endpoint_url=s.dynamodb_endpoint,
            region=s.dynamodb_region,
            max_pool_connections=s.dynamodb_max_pool_connections,
            connect_timeout=s.dynamodb_connect_timeout_s,
            read_timeout=s.dynamodb_read_timeout_s,
            concurrency=s.dynamodb_concurrency,
            retention_days=s.retention_days,
            flush_mode=s.flush_mode,
            transact_items=s.dynamodb_transact_items,
            children=cfg.counters.tenant_hierarchy,
        )
    raise ConfigError("storage", f"unknown storage kind {s.kind!r}")


def resync_from(
    storage: Storage,
    table: CounterTable,
    listener: Listener,
    gauges: GaugeTable | None = None,
    chunk: int = 100,
) -> Callable[[Callable[[Key], bool] | None], Awaitable[int]]:
    """The gossip layer's resync callback: re-read the warm, seeded keys and warm gauges
    ``which`` picks (``None``: all) from storage in chunks and re-base on them; ``listener``
    hears the views that moved (a crossing found only in storage still alerts). Storage
    errors propagate (gossip retries later)."""

    async def resync(which: Callable[[Key], bool] | None) -> int:
        # Peers' words may have been lost (what a resync is for): the dimension counters a
        # peer made meanwhile are unknown here, so every listing is read again when needed.
        table.missed.forget()
        seeded, warm = table.is_seeded, table.keys()
        wanted = [k for k in warm if seeded(k) and (which is None or which(k))]
        rebased = 0
        for start in range(0, len(wanted), chunk):
            try:
                snaps = await storage.load(wanted[start : start + chunk])
            except BadItems as exc:  # re-base what can be read; the flusher reports the rest
                snaps = exc.good
            moved: list[DeltaItem] = []
            for key, snap in snaps.items():
                by = table.rebase_moved(key, snap, "read")
                if by is not None:
                    rebased += 1
                    if by:
                        moved.append((key[0], key[1], key[2], 0, by))
            if moved:
                listener.on_deltas(moved)
        if gauges is not None:  # (after the counters: a bad gauge item fails this resync,
            await _reread_gauges(storage, gauges, chunk, which)  # not theirs)
        return rebased

    return resync


async def _reread_gauges(
    storage: Storage, gauges: GaugeTable, chunk: int, which: Callable[[Key], bool] | None
) -> None:
    """Merge the stored reading of every warm gauge ``which`` picks (a peer's reading lost
    with a frame)."""
    warm = [(key, kind) for key, kind in gauges.warm() if which is None or which(key)]
    for start in range(0, len(warm), chunk):
        part = warm[start : start + chunk]
        read = await storage.load_gauges([key for key, _ in part])
        for key, kind in part:
            gauges.seed(key, kind, read.get(key))


def build_bus(cfg: NodeConfig) -> RedisBus | RedisClusterBus:
    """The pub/sub bus of the configured Redis or Redis Cluster (also the alerts' stream), on
    the control channel (the only channel of an unsharded cluster)."""
    c = cfg.cluster
    control = ShardMap(c.cluster_name, c.gossip_shards).control
    if c.redis_cluster_nodes:
        try:
            return RedisClusterBus(c.redis_cluster_nodes, control)
        except ValueError as exc:
            raise ConfigError("redis_cluster_nodes", str(exc)) from None
    assert c.redis_url is not None
    return RedisBus(c.redis_url, control)


def build_gossip(
    cfg: NodeConfig,
    table: CounterTable,
    storage: Storage,
    bus: RedisBus | RedisClusterBus,
    incarnation: int,
    *,
    listener: Listener,
    gauges: GaugeTable,
    values: KnownValues | None = None,
    after_commit: Callable[[Callable[[], object]], None] | None = None,
) -> Gossip[Snapshot]:
    """The gossip layer over ``bus`` (not started yet); ``incarnation`` comes from
    :meth:`~meter.node.datadir.DataDir.incarnation`, ``listener`` hears what peers send
    beside deltas, ``gauges`` are the node's gauges (their readings gossiped), ``values``
    the unique values it knows claimed (told and learned), and
    ``after_commit`` delays each gossip take until the write-ahead log holds every state
    change made so far (:meth:`meter.wal.log.WriteAheadLog.at_commit`)."""
    c = cfg.cluster
    return Gossip(
        table,
        bus,
        node_id=table.node,
        cluster=c.cluster_name,
        make_snapshot=Snapshot,
        resync=resync_from(storage, table, listener, gauges),
        secret=c.secret,
        incarnation=incarnation,
        settings=GossipSettings(
            interval=c.gossip_interval_ms / 1000,
            heartbeat=c.heartbeat_ms / 1000,
            peer_timeout=c.peer_timeout_ms / 1000,
            reconcile=c.reconcile_s,
            shards=c.gossip_shards,
            subscribe=c.gossip_subscribe,
        ),
        after_commit=after_commit,
        listener=listener,
        gauges=gauges,
        values=values,
    )


@dataclass(frozen=True, slots=True)
class Parts:
    """What :func:`assemble` builds: the service and the feature parts the node runs."""

    service: Service
    fence: Fence
    limits: LimitStore
    shares: Shares
    alerts: Alerts
    ledger: LedgerStore
    peer_holds: PeerHolds


def assemble(
    table: CounterTable,
    storage: Storage,
    config: CounterConfig | None = None,
    *,
    gauges: GaugeTable | None = None,
    known_values: KnownValues | None = None,
    period_units: PeriodUnits | None = None,
    wal: WriteAheadLog | None = None,
    ids: RequestIds | None = None,
    limits_poll_s: float = 0.5,
    status_extra: Callable[[], Mapping[str, Any]] | None = None,
    owned: Callable[[], bool] | None = None,
    nodes: Callable[[], int] = lambda: 1,
    publish_limits: Callable[[int], None] | None = None,
    on_alert_fired: Callable[[Alert], None] | None = None,
    on_alert_deliver: Callable[[Alert], None] | None = None,
    alert_journal: ClaimJournal | None = None,
    peer_holds_max_age: float = 3.0,
) -> Parts:
    """Every part of a node's request path and the features it serves, wired.

    ``gauges`` is the node's gauge table, ``known_values`` its unique values known claimed
    and ``period_units`` the units its flusher takes by period (``None``: new ones; the
    journal restates the units in checkpoints). ``owned()`` says whether
    this process owns its node id (``None``: not checked): strict shares are written only
    while it does. ``nodes()`` is how many nodes share the budgets; ``publish_limits`` tells
    peers of a limit change; the alert callbacks are those of
    :class:`~meter.quotas.alerts.Alerts`.
    """
    config = config or CounterConfig()
    ids = ids if ids is not None else RequestIds()
    fence = Fence(wal)
    keys = KeyCache(config.feature_periods, config.tenant_hierarchy, config.period_grace_s)
    seeder = Seeder(table, storage, chunk=storage.load_chunk, concurrency=storage.load_concurrency)

    def fenced() -> str | None:
        # Shares are the node id's: written only while this process owns the id (not while
        # its claim is unknown, storage unreachable at start, nor once lost).
        if fence.reason is not None or owned is None or owned():
            return fence.reason
        return "this process does not own its node id (yet)"

    alerts = Alerts(
        table.node,
        storage.claim_alert,
        on_fired=on_alert_fired,
        on_deliver=on_alert_deliver,
        journal=alert_journal,
    )
    amounts = config.balance_alerts
    ledger_store = LedgerStore(
        storage, on_entries=_balance_alerts(alerts, amounts) if amounts else None
    )
    funder = LedgerFunder(ledger_store)
    shares = Shares(
        storage,
        table.node,
        lease_ms=config.strict_lease_ms,
        share_max=config.strict_share_max,
        nodes=nodes,
        fenced=fenced,
        # (only the fsync mode's log holds every answered call's count: docs/quotas.md)
        logged=wal is not None and wal.mode == "fsync",
        funder=funder,
    )
    peer_holds = PeerHolds(peer_holds_max_age)
    groups = Groups(table, storage)
    gate = Gate(
        table,
        keys,
        seeder,
        config,
        shares=shares,
        alerts=alerts,
        peer_holds=peer_holds,
        groups=groups,
        wal=fence.wal,
    )

    def new_book(book: LimitBook) -> None:
        gate.new_limits(book.by_pair, book.alerting)
        keys.new_specs(book.features)
        keys.new_cycles(book.cycles)
        specs = book.features.items()
        gate.new_aggregations(
            {f: spec.aggregation for f, spec in specs if spec.aggregation in ("max", "latest")},
            frozenset(f for f, spec in specs if spec.aggregation == "unique"),
        )

    limits = LimitStore(storage, new_book, poll_s=limits_poll_s, publish=publish_limits)
    gauges = gauges if gauges is not None else GaugeTable(table.node, gossip=table.gossip)
    gauging = Gauging(gauges, keys, gate, fence, ids, storage)
    value_voids = ValueVoids(storage, fence.wal)
    uniques = Uniques(table, keys, gate, fence, ids, seeder, storage, known_values, value_voids)
    tracking = Tracking(table, keys, gate, fence, ids, seeder, groups, gauging, uniques)
    reserving = Reserving(table, keys, gate, fence, ids, seeder, groups, config)
    journal = Journal(table, keys, ids, reserving, config, gauging, uniques, period_units)
    features = {
        **LimitMethods(limits, hierarchy=config.tenant_hierarchy).handlers(),
        **FeatureMethods(limits).handlers(),
        **LedgerMethods(ledger_store, shares).handlers(),
        **HistoryMethods(table, keys, seeder, storage, groups, gauging).handlers(),
        **ExportMethod(storage, config.period_grace_s).handlers(),
        **PeriodMethods(storage, config.period_grace_s).handlers(),
        **Voids(table, keys, gate, fence, ids, seeder, value_voids).handlers(),
        **ChildrenMethod(
            table, keys, seeder, storage, gate, fence, hierarchy=config.tenant_hierarchy
        ).handlers(),
    }
    service = Service(
        table,
        storage,
        config,
        keys=keys,
        fence=fence,
        seeder=seeder,
        gate=gate,
        tracking=tracking,
        reserving=reserving,
        groups=groups,
        gauging=gauging,
        uniques=uniques,
        journal=journal,
        watch=Watch(max_tenants=config.max_watched_tenants),
        limits=limits,
        features=features,
        status_extra=status_extra,
    )
    return Parts(service, fence, limits, shares, alerts, ledger_store, peer_holds)


def build_service(
    table: CounterTable,
    storage: Storage,
    config: CounterConfig | None = None,
    *,
    wal: WriteAheadLog | None = None,
    ids: RequestIds | None = None,
    limits_poll_s: float = 0.5,
) -> Service:
    """A service over ``table`` and ``storage``, alone (no node, no gossip)."""
    return assemble(table, storage, config, wal=wal, ids=ids, limits_poll_s=limits_poll_s).service


def _balance_alerts(
    alerts: Alerts, amounts: tuple[int, ...]
) -> Callable[[str, Sequence[ledger.Entry]], None]:
    """Alert the balances a ledger write took a tenant below (``balance_alerts``), judged
    on the write as a whole and named by its last entry: a pool's return of expired credits
    (``unpooled`` then ``expire``) ends where it began and crosses nothing."""

    def entries(tenant: str, written: Sequence[ledger.Entry]) -> None:
        first, last = written[0], written[-1]
        before = first.balance_after - first.amount
        alerts.balance_entry(tenant, last.seq, before, last.balance_after, amounts)

    return entries


async def serve(path: Any, service: Service, **options: Any) -> RpcServer:
    """:func:`~meter.core.server.start_server` for ``service``: its notifications, its fast
    path for pipelined tracks, its write-ahead log, its subscriptions and its reads."""
    return await start_server(
        path,
        service,
        notify=service.notify,
        warm_tracks=service.warm_tracks,
        wal=service.wal,
        watch=service.watch,
        reads=service.reads,
        **options,
    )
