"""A node's lifecycle: data dir and id, storage, the parts (built by :mod:`meter.node.wiring`),
the socket server, the background loops, and the drain.

``Node.run()`` serves until SIGTERM or SIGINT, then drains: it stops accepting connections,
answers what is in flight, flushes every pending unit, closes the socket and returns 0 (or 1
if storage could not take everything within the drain timeout; the log says how much).

The node holds every part, so it is where parts that need each other meet: gossip, the
limits, the alerts and the owner's claim call the node's own methods below, which pass what
they hear on to the part that acts on it.

Why one module: the start builds the parts in an order the drain undoes, and both must be read
side by side (what was started is what a failed start closes); the listeners and webhooks
are built in :mod:`meter.node.web`, the parts in :mod:`meter.node.wiring`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Iterator, Sequence
from typing import Any

from cluster.codec import AlertItem, DeltaItem, HoldItem
from cluster.gossip import Gossip
from meter import BUILD, compiled
from meter.config import NodeConfig
from meter.core.counts import FeatureUnits, PeriodUnits, RequestStats
from meter.core.gauges import GaugeTable
from meter.core.idempotency import RequestIds
from meter.core.keys import Key
from meter.core.knownvalues import KnownValues
from meter.core.periods import kinds_in_use
from meter.core.server import RpcServer
from meter.core.service import Service
from meter.core.table import CounterTable
from meter.errors import ConfigError, Unavailable
from meter.http.api import Api
from meter.http.listener import Listener
from meter.http.probes import Endpoints
from meter.node import loops, web, wiring
from meter.node.datadir import DataDir
from meter.node.gc import tune_gc
from meter.node.push import AlertFanout, UsagePush
from meter.ops import health
from meter.persist.closing import PeriodCloser, backlog_note
from meter.persist.flusher import Flusher
from meter.persist.gauges import GaugeFlusher
from meter.persist.owner import Ownership, State
from meter.persist.recovery import recover, warm_up
from meter.persist.rollover import ReadAhead
from meter.quotas.alerts import Alert, Alerts
from meter.quotas.holds import STALE_AFTER_HEARTBEATS
from meter.quotas.shares import Shares
from meter.quotas.webhooks import Webhooks
from meter.wal.log import WriteAheadLog
from storage.base import Snapshot, Storage, StorageError

log = logging.getLogger("meter.node")

#: Longest a clean stop waits to give back strict shares (ADR 0009).
STRICT_DRAIN_S = 5.0


class Node:
    """One running node. ``start()`` then ``run()``, or ``async with Node(cfg)`` in tests."""

    def __init__(
        self, config: NodeConfig, *, storage: Storage | None = None, own_process: bool = False
    ) -> None:
        self.config = config
        #: The node is its process's only tenant (``meter serve``): it may set the process's
        #: garbage collector (``gc_young_threshold``, ADR 0007). Tests run nodes in theirs.
        self.own_process = own_process
        self.data_dir = DataDir(config.data_dir)
        self.storage = storage
        self.table: CounterTable | None = None
        self.service: Service | None = None
        self.parts: wiring.Parts | None = None
        self.flusher: Flusher | None = None
        self.gauge_flusher: GaugeFlusher | None = None
        self.server: RpcServer | None = None
        self.gossip: Gossip[Snapshot] | None = None
        self.wal: WriteAheadLog | None = None
        self.owner: Ownership | None = None
        #: The HTTP listener for metrics and probes (``metrics_address``; ``None``: none).
        self.http: Listener | None = None
        #: The HTTP/JSON API (``http_socket``, ``http_address``), and its listeners.
        self.api: Api | None = None
        self.api_listeners: list[Listener] = []
        #: The alerts' webhooks and their outbox (``webhook_urls``; ``None``: none).
        self.webhooks: Webhooks | None = None
        self.push: UsagePush | None = None
        self.fanout: AlertFanout | None = None
        self.read_ahead: ReadAhead | None = None
        #: This node's marks of the periods it counts in, and their close (docs/invoicing.md).
        self.closer: PeriodCloser | None = None
        self._claimed_task: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        self.drained: bool | None = None
        #: The cluster's stored ``gossip_shards`` turned out to be another (exit code 2).
        self.refused = False

    def _unstored_keys(self) -> Iterator[Key]:
        """Keys of everything this node holds that storage may not hold yet: units, open
        reservations, claims of unique values without an outcome, voided values not marked,
        gauges' readings."""
        assert self.table is not None and self.parts is not None
        service = self.parts.service
        yield from self.table.unstored_keys()
        for lease in service.reservations.held():
            yield lease.key
        uniques = service.uniques
        for t, f, p, *_ in uniques.restated(uniques.unresolved()):
            yield (t, f, p)
        yield from uniques.voids.keys()
        for key, _, _ in service.gauging.table.dirty():
            yield key

    # -- what health and metrics read (meter.ops.health.NodeView) -------------------------

    @property
    def shares(self) -> Shares | None:
        return None if self.parts is None else self.parts.shares

    @property
    def alerts(self) -> Alerts | None:
        return None if self.parts is None else self.parts.alerts

    @property
    def metrics_address(self) -> str | None:
        return None if self.http is None else self.http.address

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def health_checks(self) -> dict[str, str | None]:
        """``/readyz``'s checks (:func:`meter.ops.health.health_checks`)."""
        return health.health_checks(self)

    @staticmethod
    def can_count(checks: dict[str, str | None]) -> bool:
        """Whether :meth:`health_checks` say the node can take counting calls."""
        return health.can_count(checks)

    # -- start --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Take the data dir, open storage, start the loops and the socket server."""
        cfg = self.config
        self.data_dir.acquire()
        try:
            node_id = self.data_dir.node_id(cfg.node_id)
            if self.storage is None:
                self.storage = wiring.build_storage(cfg)
            try:
                await self.storage.open()
            except StorageError as exc:
                raise Unavailable(f"cannot open {self.storage.kind} storage: {exc}") from None
            # The cluster's K is this node's (ADR 0024), or it refuses before it claims or
            # serves anything (storage unreachable: checked again in the background).
            shards_known = not cfg.cluster.gossip or await loops.shards_match(
                self.storage, cfg.cluster
            )
            # Claim the id before anything counts: a second process with it refuses from the
            # first call (storage unreachable: try again in the background, count meanwhile).
            token, earlier = self.data_dir.owner_tokens()
            self.owner = Ownership(
                self.storage,
                node_id,
                token,
                earlier,
                lease_s=cfg.owner.lease_s,
                on_state=self._owner_state,
                on_claimed=lambda: self.data_dir.owner_claimed(token),
                note=self._owner_note,
            )
            await self.owner.claim()
            # Alone, nobody would take the gossip columns: the table does not keep them.
            self.table = CounterTable(node_id, gossip=cfg.cluster.gossip)
            gauges = GaugeTable(node_id, gossip=self.table.gossip)
            values = KnownValues(gossip=self.table.gossip, warm=self.table.is_warm)
            d = cfg.durability
            mode = d.effective_mode(self.storage.kind)
            if mode != "off":
                self.wal = WriteAheadLog(
                    cfg.data_dir / "wal",
                    node_id=node_id,
                    mode=mode,
                    fsync_interval=d.fsync_interval_ms / 1000,
                    segment_bytes=d.segment_bytes,
                )
            bus = None
            if cfg.cluster.gossip:
                bus = wiring.build_bus(cfg)
                self.gossip = wiring.build_gossip(
                    cfg,
                    self.table,
                    self.storage,
                    bus,
                    self.data_dir.incarnation(),
                    listener=self,
                    gauges=gauges,
                    values=values,
                    after_commit=None if self.wal is None else self.wal.at_commit,
                )
            units = FeatureUnits(cfg.metrics.feature_labels) if cfg.metrics.address else None
            period_units = PeriodUnits(kept=self.wal is not None)
            self.flusher = Flusher(
                self.table,
                self.storage,
                interval=cfg.flush.interval_ms / 1000,
                batch_keys=cfg.flush.batch_keys,
                max_backoff=cfg.flush.max_backoff_ms / 1000,
                on_flushed=None if self.gossip is None else self.gossip.on_flushed,
                wal=self.wal,
                owner=self.owner,
                feature_units=units,
                limited=self._limited,
                period_units=period_units,
            )
            self.gauge_flusher = GaugeFlusher(
                gauges,
                self.storage,
                interval=cfg.flush.interval_ms / 1000,
                max_backoff=cfg.flush.max_backoff_ms / 1000,
                on_stored=None if self.gossip is None else self.gossip.readings_stored,
                wal=self.wal,
            )
            owner = self.owner
            self.webhooks = web.webhooks(cfg.webhooks, self.data_dir.path)
            self.parts = wiring.assemble(
                self.table,
                self.storage,
                cfg.counters,
                gauges=gauges,
                known_values=values,
                period_units=period_units,
                wal=self.wal,
                ids=RequestIds(d.idempotency_window_s, d.idempotency_max_ids),
                limits_poll_s=cfg.counters.limits_poll_ms / 1000,
                status_extra=lambda: health.status_fields(self),
                owned=lambda: owner.owned,
                # Grants of strict budgets are sized to the nodes sharing them (ADR 0009).
                nodes=self._nodes,
                publish_limits=None if self.gossip is None else self.gossip.limits_changed,
                on_alert_fired=self._alert_fired,
                on_alert_deliver=self._deliver_alert,
                alert_journal=self.webhooks,
                peer_holds_max_age=STALE_AFTER_HEARTBEATS * cfg.cluster.heartbeat_ms / 1000,
            )
            self.service = service = self.parts.service
            interval = cfg.cluster.gossip_interval_ms / 1000
            self.push = UsagePush(
                service, self.wal, interval, self._push_notifications, self._stop.is_set
            )
            self.fanout = AlertFanout(
                self.parts.alerts, self.gossip, bus, cfg.cluster, offer=self._offer_alert
            )
            self.read_ahead = ReadAhead(service, cfg.counters)
            await self._load_limits()
            self._owner_state(self.owner.state, settled=True)  # nothing read yet
            warm: list[Key] = []
            if self.wal is not None:
                # Before the socket opens: every acknowledged call is back in memory.
                warm = await recover(self.wal, service)
            if self.own_process:
                # Before the socket opens: the one full collection pauses no request, and the
                # rows just recovered are frozen with the rest.
                tune_gc(cfg.server.gc_young_threshold)
            periods = cfg.counters.feature_periods
            self.closer = PeriodCloser(
                node_id,
                self.storage,
                lambda: kinds_in_use(periods),
                service.keys.calendars,
                cfg.counters.period_grace_s,
                self._unstored_keys,
                self.data_dir.marks_id(),
                period_units,
            )
            # Before the socket opens: the periods it may count in are marked open first.
            await self.closer.start()
            request_stats = (
                await self._start_metrics(units) if cfg.metrics.address and units else None
            )
            # Before the socket: a setting it cannot listen on stops the node before any call.
            self.api = await web.start_api(
                cfg, service, self.wal, request_stats, self.api_listeners
            )
            try:
                self.server = await wiring.serve(
                    cfg.server.socket,
                    service,
                    group=cfg.server.socket_group,
                    max_frame=cfg.server.max_frame_bytes,
                    request_stats=request_stats,
                )
            except FileExistsError:
                raise ConfigError(
                    "socket", f"{cfg.server.socket} exists and is not a socket"
                ) from None
            except OSError as exc:
                raise ConfigError(
                    "socket", f"cannot listen on {cfg.server.socket}: {exc.strerror or exc}"
                ) from None
        except BaseException:
            for listener in [*self.api_listeners, *([self.http] if self.http else [])]:
                await listener.close()
            if self.server is not None:
                await self.server.close(drain_timeout=0)
            if self.webhooks is not None:
                self.webhooks.close()
            if self.wal is not None:
                await self.wal.close(final_checkpoint=False)
            self.data_dir.release()
            raise
        parts = self.parts
        c = cfg.cluster
        self._tasks = [
            asyncio.create_task(self.flusher.run(), name="flusher"),
            asyncio.create_task(self.gauge_flusher.run(), name="gauge-flusher"),
            asyncio.create_task(loops.expire_reservations(service), name="reservation-expiry"),
            asyncio.create_task(
                loops.evict_idle(cfg.counters.evict_after_s, self.table, gauges, service.uniques),
                name="eviction",
            ),
            asyncio.create_task(
                loops.purge_expired(self.storage, cfg.storage.purge_interval_s),
                name="retention-purge",
            ),
            asyncio.create_task(self.read_ahead.run(), name="rollover-read-ahead"),
            asyncio.create_task(self.owner.run(), name="owner"),
            asyncio.create_task(self.push.run(), name="usage-push"),
            asyncio.create_task(parts.limits.run(), name="limits"),
            asyncio.create_task(loops.keep_shares(parts.shares), name="strict-shares"),
            asyncio.create_task(parts.alerts.run(), name="alerts"),
            asyncio.create_task(loops.resolve_claims(service.uniques), name="unique-claims"),
            asyncio.create_task(self.closer.run(), name="period-close"),
            *web.deliver_webhooks(self.webhooks, parts.alerts),
        ]
        if warm:
            # Right after the socket opens: requests arriving meanwhile are read first.
            self._tasks.append(asyncio.create_task(warm_up(service, warm), name="warm-up"))
        if self.gossip is not None:
            await self.gossip.start()  # connects in the background; serving does not wait
            if not shards_known:
                check = loops.check_shards(self.storage, c, refuse=self._refuse)
                self._tasks.append(asyncio.create_task(check, name="gossip-shards"))
            holds = loops.HoldsAnnouncer(
                service.reservations,
                parts.peer_holds,
                self.gossip,
                c.gossip_interval_ms / 1000,
                c.heartbeat_ms / 1000,
            )
            self._tasks.append(asyncio.create_task(holds.run(), name="holds"))
        log.info(
            "node %s serving on %s (storage %s, data dir %s; %s)",
            node_id,
            cfg.server.socket,
            self.storage.kind,
            cfg.data_dir,
            compiled.running(BUILD).describe(),
        )

    async def _start_metrics(self, units: FeatureUnits) -> RequestStats:
        """Start the HTTP listener of ``metrics_address``; return the request counters the
        socket server is to keep for it."""
        from prometheus_client import CONTENT_TYPE_LATEST

        from meter.ops.metrics import build_registry, exposition

        cfg = self.config.metrics
        assert cfg.address is not None and self.service is not None
        requests = RequestStats(self.service.methods)
        registry = build_registry(self, requests, units)
        endpoints = Endpoints(
            metrics=lambda: exposition(registry),
            metrics_content_type=CONTENT_TYPE_LATEST,
            checks=self.health_checks,
        )
        self.http, bound = await web.start_probes(cfg.address, endpoints)
        log.info("metrics and probes on http://%s (/metrics, /healthz, /readyz)", bound)
        return requests

    async def _load_limits(self) -> None:
        """Read the limits (and the plans file) before the socket opens."""
        assert self.parts is not None
        limits = self.parts.limits
        plans_file = self.config.counters.plans_file
        try:
            await limits.refresh()
            if plans_file is not None:
                written = await limits.apply_plans_file(plans_file)
                log.info("plans file %s: %d plans written, the others unchanged",
                         plans_file, written)  # fmt: skip
        except StorageError as exc:  # enforced from the first read that succeeds (the loop)
            log.warning("limits could not be read at start; none enforced until they are: %s", exc)
            if plans_file is not None:
                log.warning("plans file %s not applied (storage unreachable): restart to apply",
                            plans_file)  # fmt: skip

    # -- where parts that need each other meet ---------------------------------------------

    def _limited(self, key: Key) -> bool:
        """The flusher: whether ``key`` is under a limit, a price or alerts (never stretched,
        docs/storage.md)."""
        parts = self.parts
        return parts is None or parts.limits.book.effective(key[0], key[1]) is not None

    def _nodes(self) -> int:
        """How many nodes share the strict budgets: this one and its live peers."""
        return 1 if self.gossip is None else 1 + len(self.gossip.peers.live())

    def on_limits(self, version: int) -> None:
        """Gossip: a peer changed the limits (``-1``: a frame may have been missed)."""
        assert self.parts is not None
        self.parts.limits.invalidate(version)

    def on_holds(self, peer: str, holds: Sequence[HoldItem]) -> None:
        """Gossip: ``peer``'s reservation holds (``()``: it is gone)."""
        assert self.parts is not None
        self.parts.peer_holds.replace(peer, holds)

    def on_deltas(self, deltas: Sequence[DeltaItem]) -> None:
        """Gossip: a peer's deltas changed this node's views: detect the threshold alerts
        they crossed, and push the watched counters soon (:meth:`UsagePush.peer_changed`)."""
        assert self.service is not None and self.push is not None
        self.service.peer_deltas(deltas)
        self.push.peer_changed()

    def on_alert(self, sender: str, alert: AlertItem) -> None:
        """Gossip: a peer's ``alert`` frame (:meth:`AlertFanout.from_peer`)."""
        assert self.fanout is not None
        self.fanout.from_peer(sender, alert)

    def _alert_fired(self, alert: Alert) -> None:
        assert self.fanout is not None
        self.fanout.fired(alert)

    def _deliver_alert(self, alert: Alert) -> None:
        assert self.fanout is not None
        self.fanout.delivered(alert)

    def _offer_alert(self, alert: Alert) -> None:
        assert self.service is not None
        if self.service.watch.offer_alert(alert.to_wire()):
            self._push_notifications()

    def _push_notifications(self) -> None:
        if self.server is not None:
            self.server.push_notifications()
        if self.api is not None:
            self.api.push()

    def _owner_note(self) -> str | None:
        """What each renewal of the node id says of this node for exports: the units of each
        period it holds not stored (:func:`~meter.persist.closing.backlog_note`)."""
        if self.table is None:
            return None
        return backlog_note(self.table.unflushed(()), time.time())

    def _owner_state(self, state: State, settled: bool = False) -> None:
        """Follow the node's hold on its id: count, flush and gossip only while it owns it.

        A claim made at start comes before anything is read (``settled``). One made later
        (the holder stopped, or storage answered at last) may follow reads made while another
        process still wrote under this id: seeding reads issued before the claim are refused
        when they land (:meth:`~meter.core.table.CounterTable.refuse_earlier_reads`; their keys
        are read again), and every warm key is re-read before the node counts, flushes or
        gossips again (:meth:`_after_claim`; the flusher re-reads before writing).
        """
        if self.owner is None:
            return
        fence = None if self.parts is None else self.parts.fence
        if state == "owned" and not settled and self.flusher is not None:
            assert self.table is not None
            # Seeding reads issued before now (while fenced) may predate the last holder's
            # writes and land after the re-read below: the table refuses them, and their keys
            # are read again (C06).
            self.table.refuse_earlier_reads()
            self.flusher.reread_before_writing()
            if fence is not None:
                fence.close(f"node id {self.owner.node!r} was just claimed: retry")
            self._claimed_task = asyncio.create_task(self._after_claim(), name="after-claim")
            return
        if fence is not None:
            fence.close(self.owner.refusal())
        if self.gossip is not None:
            self.gossip.set_muted(state != "owned")

    async def _after_claim(self) -> None:
        assert self.flusher is not None and self.owner is not None
        pause = 0.1
        while self.owner.owned and not await self.flusher.reread():
            await asyncio.sleep(pause)
            pause = min(5.0, pause * 2)
        if self.owner.owned:  # (else it was lost meanwhile: that state holds)
            log.info("node id %r claimed: warm keys re-read, counting again", self.owner.node)
            self._owner_state("owned", settled=True)
            self.flusher.wake()

    # -- run and stop -------------------------------------------------------------------------

    def _refuse(self) -> None:
        self.refused = True
        self.request_stop()

    def request_stop(self) -> None:
        """Ask ``run()`` to drain and return (what SIGTERM does)."""
        self._stop.set()

    async def run(self) -> int:
        """Serve until asked to stop (SIGTERM/SIGINT), drain, and return the exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        try:
            await self._stop.wait()
            log.info("stop requested: draining")
            code = await self.stop()
            return 2 if self.refused else code
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    async def stop(self) -> int:
        """Drain: stop accepting, finish requests, flush everything, close. Returns 0 or 1."""
        assert self.server is not None and self.flusher is not None and self.storage is not None
        assert self.parts is not None and self.push is not None and self.fanout is not None
        self.push.stop()  # no more usage push ticks or timers
        self.server.stop_accepting()
        if self.api is not None:
            self.api.close()  # calls from now on are refused; event streams end
        await asyncio.gather(
            self.server.close(drain_timeout=self.config.server.request_drain_timeout_s),
            *(listener.close() for listener in self.api_listeners),
        )
        if self._claimed_task is not None:
            self._tasks.append(self._claimed_task)
        for task in self._tasks:
            task.cancel()
        self.push.stop()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self.parts.service.seeder.close()  # reads ahead nobody waits for any more
        # Nothing is admitted any more: what this node's strict shares hold and it did not
        # admit goes back to the budgets (a crash would leave it until its lease ends).
        try:
            await asyncio.wait_for(self.parts.shares.drain(), STRICT_DRAIN_S)
        except TimeoutError:
            log.warning("drain: strict shares not all given back within %s s", STRICT_DRAIN_S)
        drain_s = self.config.flush.drain_timeout_s
        uniques = self.parts.service.uniques
        if uniques.pending:  # counted before the flush drains, if storage answers now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(uniques.resolve(), drain_s)
            if uniques.pending:
                log.error(
                    "drain: %d claims of unique values unresolved (they stay in the "
                    "write-ahead log, if it is on)",
                    len(uniques.pending),
                )
        if uniques.voids.unmarked:  # (a voided value's mark: stored before the node goes)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(uniques.voids.mark(), drain_s)
            if uniques.voids.unmarked:
                log.error(
                    "drain: %d voided unique values not marked in storage (they stay in the "
                    "write-ahead log, if it is on)",
                    len(uniques.voids.unmarked),
                )
        assert self.gauge_flusher is not None
        # (the same deadline: storage that takes one takes the other)
        gauges_drained, self.drained = await asyncio.gather(
            self.gauge_flusher.drain(drain_s), self.flusher.drain(drain_s)
        )
        if not gauges_drained:
            log.error(
                "drain: %d gauges' readings not stored (they stay in the write-ahead log): %s",
                len(self.gauge_flusher.table.dirty()),
                self.gauge_flusher.stats.last_error,
            )
        if not self.drained:
            left, units = self.flusher.backlog()
            refusal = None if self.owner is None else self.owner.refusal()
            log.error(
                "drain %s: %d keys (%d units) not stored (they stay in the write-ahead log): %s",
                "refused" if refusal else "timed out",
                len(left),
                units,
                refusal or self.flusher.stats.last_error,
            )
        # Keys parked after a permanent write error are not retried, so the drain does not
        # wait for them; but their units are not stored either: that is not a clean drain.
        assert self.table is not None
        parked = [k for k in self.flusher.stats.poisoned if self.table.pending(k)]
        if parked:
            log.error(
                "drain: %d parked keys (%d units) not stored after permanent write errors: %s",
                len(parked),
                sum(self.table.pending(k) for k in parked),
                "; ".join(f"{k}: {self.flusher.stats.poisoned[k]}" for k in parked[:20]),
            )
            self.drained = False
        self.drained = self.drained and gauges_drained
        if self.closer is not None and self.drained:  # (nothing unstored: close or drain)
            await self.closer.drained(time.time())
        await self.fanout.close()  # alerts being added to the Redis Stream: a moment
        if self.gossip is not None:
            # The drain's announcements are queued: send them and any last gossip, then close.
            await self.gossip.stop()
        if self.wal is not None:
            await self.wal.close()
        if self.owner is not None and self.drained:
            # Everything is stored: another data dir may take this id at once.
            await self.owner.release()
        await self.storage.close()
        if self.http is not None:
            # Last: until here /readyz answered 503 (draining) to a probe that asked.
            await self.http.close()
        if self.webhooks is not None:
            self.webhooks.close()
        self.data_dir.release()
        log.info("node stopped (%s)", "drained" if self.drained else "NOT drained")
        return 0 if self.drained else 1

    async def __aenter__(self) -> Node:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.server is not None and self._tasks:
            await self.stop()
