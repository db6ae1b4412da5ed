"""A node's lifecycle: data dir and id, storage, table, server, background loops, drain.

``Node.run()`` serves until SIGTERM or SIGINT, then drains: it stops accepting connections,
answers what is in flight, flushes every pending unit, closes the socket and returns 0 (or 1
if storage could not take everything within the drain timeout; the log says how much).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import logging
import os
import secrets
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import IO, Any

from cluster.bus import BusUnavailable
from cluster.codec import AlertItem, DeltaItem
from cluster.gossip import Gossip, GossipSettings
from meter import BUILD, compiled
from meter.config import NodeConfig
from meter.core.counts import FeatureUnits, RequestStats
from meter.core.idempotency import RequestIds
from meter.core.keys import Key, PeriodKind
from meter.core.server import RpcServer, start_server
from meter.core.service import Service
from meter.core.table import CounterTable
from meter.errors import ConfigError, Unavailable
from meter.node.gc import tune_gc
from meter.ops.http import Endpoints, HttpEndpoints
from meter.persist.flusher import Flusher
from meter.persist.owner import Ownership, State
from meter.persist.recovery import recover, warm_up
from meter.persist.rollover import kinds_in_use, period_end
from meter.quotas.alerts import Alert, from_peer_ok
from meter.quotas.holds import STALE_AFTER_HEARTBEATS
from meter.wal.log import WriteAheadLog
from storage.base import BadItems, Snapshot, Storage, StorageError

log = logging.getLogger("meter.node")


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
        )
    raise ConfigError("storage", f"unknown storage kind {s.kind!r}")


def resync_from(
    storage: Storage, table: CounterTable, chunk: int = 100
) -> Callable[[list[Key] | None], Awaitable[int]]:
    """The gossip layer's resync callback: re-read keys (``None``: every warm, seeded key) from
    storage in chunks and re-base on them. Storage errors propagate (gossip retries later)."""

    async def resync(keys: list[Key] | None) -> int:
        wanted = [k for k in (table.keys() if keys is None else keys) if table.is_seeded(k)]
        rebased = 0
        for start in range(0, len(wanted), chunk):
            try:
                snaps = await storage.load(wanted[start : start + chunk])
            except BadItems as exc:  # re-base what can be read; the flusher reports the rest
                snaps = exc.good
            for key, snap in snaps.items():
                rebased += table.rebase(key, snap, "read")
        return rebased

    return resync


def build_gossip(
    cfg: NodeConfig,
    table: CounterTable,
    storage: Storage,
    incarnation: int,
    *,
    after_commit: Callable[[Callable[[], object]], None] | None = None,
) -> Gossip[Snapshot]:
    """The gossip layer over Redis pub/sub the configuration names (not started yet);
    ``incarnation`` comes from :meth:`DataDir.incarnation`, and ``after_commit`` delays each
    gossip take until the write-ahead log holds every state change made so far
    (:meth:`meter.wal.log.WriteAheadLog.at_commit`)."""
    from cluster.bus import channel_name
    from cluster.redis_bus import RedisBus

    c = cfg.cluster
    assert c.redis_url is not None
    return Gossip(
        table,
        RedisBus(c.redis_url, channel_name(c.cluster_name)),
        node_id=table.node,
        cluster=c.cluster_name,
        make_snapshot=Snapshot,
        resync=resync_from(storage, table),
        secret=c.secret,
        incarnation=incarnation,
        settings=GossipSettings(
            interval=c.gossip_interval_ms / 1000,
            heartbeat=c.heartbeat_ms / 1000,
            peer_timeout=c.peer_timeout_ms / 1000,
            reconcile=c.reconcile_s,
        ),
        after_commit=after_commit,
    )


#: Warm keys mapped to the next period per event-loop pass when reading ahead.
READ_AHEAD_SLICE = 5000
#: Read-ahead passes per period end (at 1, 3/4, 1/2 and 1/4 of the lead before it).
READ_AHEAD_PASSES = 4

#: Earlier owner tokens a data dir keeps (starts whose claim never succeeded).
MAX_EARLIER_TOKENS = 8
#: Longest a clean stop waits to give back strict shares (ADR 0009).
STRICT_DRAIN_S = 5.0


class DataDir:
    """The node's data dir: holds its id, its owner token, its gossip incarnation and a lock so
    two nodes never share it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock_file: IO[str] | None = None

    def acquire(self) -> None:
        """Create the dir and take its lock; :class:`ConfigError` if another node holds it."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fh = (self.path / "lock").open("a+")
        except OSError as exc:
            raise ConfigError("data_dir", f"cannot use {self.path}: {exc.strerror}") from None
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            owner = fh.read().strip() or "?"
            fh.close()
            raise ConfigError(
                "data_dir", f"{self.path} is in use by another node (pid {owner})"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        self._lock_file = fh

    def release(self) -> None:
        """Drop the lock."""
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def owner_tokens(self) -> tuple[str, list[str]]:
        """A new owner token for this start, and the earlier ones of this data dir, which its
        claim accepts (ADR 0004): same data dir, same owner.

        The new token is kept (synced) with the earlier ones *before* it is claimed, so a crash
        between the claim and :meth:`owner_claimed` cannot lock the data dir out of its id. A
        fresh token per start also tells a copy of this data dir from a restart: the copy's
        claim takes the id over and the process it was copied from stops (it finds another
        owner) instead of both flushing under one id.
        """
        file = self.path / "owner"
        try:
            lines = file.read_text().splitlines()
        except FileNotFoundError:
            lines = []
        earlier = [t for t in (line.strip() for line in lines) if t][:MAX_EARLIER_TOKENS]
        new = secrets.token_hex(16)
        _write_synced(file, "\n".join([new, *earlier]) + "\n")
        return new, earlier

    def owner_claimed(self, token: str) -> None:
        """``token`` owns the id now: the earlier tokens are no longer needed."""
        _write_synced(self.path / "owner", token + "\n")

    def incarnation(self) -> int:
        """This start's gossip incarnation: ``max(now in ns, the last one + 1)``, kept here.

        Peers refuse messages of an incarnation older than one they saw (a replay), so it must
        grow across restarts even when this host's clock went back (set right after running
        ahead, a VM restored on another host): the wall clock alone would make the node stale
        to its peers for good. Written and synced before it is used.
        """
        file = self.path / "incarnation"
        try:
            last = int(file.read_text().strip() or "0")
        except FileNotFoundError:
            last = 0
        except ValueError:
            raise ConfigError("data_dir", f"{file} does not hold an integer") from None
        new = max(time.time_ns(), last + 1)
        _write_synced(file, f"{new}\n")
        return new

    def node_id(self, configured: str | None) -> str:
        """The configured id, else the one kept in the dir, else a new one (then kept)."""
        if configured:
            return configured
        file = self.path / "node_id"
        try:
            existing = file.read_text().strip()
        except FileNotFoundError:
            existing = ""
        if existing:
            return existing
        new = "n" + secrets.token_hex(6)
        tmp = file.with_suffix(".tmp")
        tmp.write_text(new + "\n")
        os.replace(tmp, file)
        return new


def _write_synced(file: Path, text: str) -> None:
    """Replace ``file`` with ``text`` atomically, synced to disk (file and directory)."""
    tmp = file.with_suffix(".tmp")
    with tmp.open("w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, file)
    fd = os.open(file.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        self.flusher: Flusher | None = None
        self.server: RpcServer | None = None
        self.gossip: Gossip[Snapshot] | None = None
        self.wal: WriteAheadLog | None = None
        self.owner: Ownership | None = None
        #: The HTTP listener for metrics and probes (``metrics_address``; ``None``: none).
        self.http: HttpEndpoints | None = None
        self._claimed_task: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        #: Live usage push: a tick waits for the log's commit; when the last one ran.
        self._watch_pending = False
        self._watch_stopping = False
        self._watch_last = 0.0
        self._watch_timer: asyncio.TimerHandle | None = None
        self._watch_due = 0.0
        #: Threshold alerts being added to the Redis Stream.
        self._stream_tasks: set[asyncio.Task[None]] = set()
        self._stop = asyncio.Event()
        self.drained: bool | None = None

    async def start(self) -> None:
        """Take the data dir, open storage, start the loops and the socket server."""
        cfg = self.config
        self.data_dir.acquire()
        try:
            node_id = self.data_dir.node_id(cfg.node_id)
            if self.storage is None:
                self.storage = build_storage(cfg)
            try:
                await self.storage.open()
            except StorageError as exc:
                raise Unavailable(f"cannot open {self.storage.kind} storage: {exc}") from None
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
            )
            await self.owner.claim()
            # Alone, nobody would take the gossip columns: the table does not keep them.
            self.table = CounterTable(node_id, gossip=bool(cfg.cluster.redis_url))
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
            if cfg.cluster.redis_url:
                incarnation = self.data_dir.incarnation()
                self.gossip = build_gossip(
                    cfg,
                    self.table,
                    self.storage,
                    incarnation,
                    after_commit=None if self.wal is None else self.wal.at_commit,
                )
            self.flusher = Flusher(
                self.table,
                self.storage,
                interval=cfg.flush.interval_ms / 1000,
                batch_keys=cfg.flush.batch_keys,
                max_backoff=cfg.flush.max_backoff_ms / 1000,
                on_flushed=None if self.gossip is None else self.gossip.on_flushed,
                wal=self.wal,
                owner=self.owner,
            )
            self.service = Service(
                self.table,
                self.storage,
                cfg.counters,
                status_extra=self._status_extra,
                wal=self.wal,
                ids=RequestIds(d.idempotency_window_s, d.idempotency_max_ids),
                limits_poll_s=cfg.counters.limits_poll_ms / 1000,
            )
            if self.gossip is not None:
                gossip = self.gossip
                # Grants of strict budgets are sized to the nodes sharing them (ADR 0009).
                self.service.shares.nodes = lambda: 1 + len(gossip.peers.live())
            service, owner = self.service, self.owner
            # Shares are the node id's: written only while this process owns the id (not
            # while its claim is unknown, storage unreachable at start, nor once lost).
            service.shares.fenced = lambda: (
                service.fenced
                or (None if owner.owned else "this process does not own its node id (yet)")
            )
            await self._load_limits()
            self._owner_state(self.owner.state, settled=True)  # nothing read yet
            warm: list[Key] = []
            if self.wal is not None:
                # Before the socket opens: every acknowledged call is back in memory.
                warm = await recover(self.wal, self.service)
            if self.own_process:
                # Before the socket opens: the one full collection pauses no request, and the
                # rows just recovered are frozen with the rest.
                tune_gc(cfg.server.gc_young_threshold)
            request_stats = await self._start_metrics() if cfg.metrics.address else None
            try:
                self.server = await start_server(
                    cfg.server.socket,
                    self.service,
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
            if self.http is not None:
                await self.http.close()
            if self.wal is not None:
                await self.wal.close(final_checkpoint=False)
            self.data_dir.release()
            raise
        self._tasks = [
            asyncio.create_task(self.flusher.run(), name="flusher"),
            asyncio.create_task(self._expire_loop(), name="reservation-expiry"),
            asyncio.create_task(self._evict_loop(), name="eviction"),
            asyncio.create_task(self._purge_loop(), name="retention-purge"),
            asyncio.create_task(self._read_ahead_loop(), name="rollover-read-ahead"),
            asyncio.create_task(self.owner.run(), name="owner"),
            asyncio.create_task(self._watch_loop(), name="usage-push"),
            asyncio.create_task(self.service.limits.run(), name="limits"),
            asyncio.create_task(self._escrow_loop(), name="strict-shares"),
            asyncio.create_task(self.service.alerts.run(), name="alerts"),
        ]
        if warm:
            # Right after the socket opens: requests arriving meanwhile are read first.
            self._tasks.append(asyncio.create_task(warm_up(self.service, warm), name="warm-up"))
        if self.gossip is not None:
            await self.gossip.start()  # connects in the background; serving does not wait
            self._tasks.append(asyncio.create_task(self._holds_loop(), name="holds"))
        log.info(
            "node %s serving on %s (storage %s, data dir %s; %s)",
            node_id,
            cfg.server.socket,
            self.storage.kind,
            cfg.data_dir,
            compiled.running(BUILD).describe(),
        )

    async def _start_metrics(self) -> RequestStats:
        """Start the HTTP listener of ``metrics_address``; return the request counters the
        socket server is to keep for it."""
        from meter.ops.metrics import build_registry, exposition

        cfg = self.config.metrics
        assert cfg.address is not None and self.service is not None and self.flusher is not None
        requests = RequestStats(self.service.methods)
        units = FeatureUnits(cfg.feature_labels)
        self.flusher.feature_units = units
        registry = build_registry(self, requests, units)
        from prometheus_client import CONTENT_TYPE_LATEST

        self.http = HttpEndpoints(
            Endpoints(
                metrics=lambda: exposition(registry),
                metrics_content_type=CONTENT_TYPE_LATEST,
                checks=self.health_checks,
            )
        )
        host, port = cfg.address
        try:
            bound = await self.http.start(host, port)
        except OSError as exc:
            self.http = None
            raise ConfigError(
                "metrics_address", f"cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from None
        log.info("metrics and probes on http://%s (/metrics, /healthz, /readyz)", bound)
        return requests

    async def _load_limits(self) -> None:
        """Read the limits before the socket opens, and wire their propagation (gossip)."""
        assert self.service is not None
        limits = self.service.limits
        gossip = self.gossip
        alerts = self.service.alerts
        alerts.on_fired = self._alert_fired
        alerts.on_deliver = self._deliver_alert
        if gossip is not None:
            gossip.on_holds = self.service.peer_holds.replace
            gossip.on_deltas = self._peer_deltas
            gossip.on_limits = limits.invalidate
            gossip.on_alert = self._peer_alert
            limits.publish = gossip.limits_changed
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

    async def _escrow_loop(self) -> None:
        """Renew this node's strict shares and give back idle ones (ADR 0009)."""
        assert self.service is not None
        shares = self.service.shares
        while True:
            await asyncio.sleep(shares.lease_ms / 3000)
            try:
                await shares.step()
            except Exception:  # a bug must not end renewals (and then the drain) for good
                log.exception("strict shares: upkeep failed")

    async def _holds_loop(self) -> None:
        """Gossip this node's reservation holds each tick they changed, and every heartbeat
        while it holds any (or held any lately: a lost frame must not leave peers with holds
        that are gone); peers count them against hard limits (docs/quotas.md)."""
        assert self.service is not None and self.gossip is not None
        c = self.config.cluster
        tick, beat = c.gossip_interval_ms / 1000, c.heartbeat_ms / 1000
        peer_holds = self.service.peer_holds
        peer_holds.max_age = STALE_AFTER_HEARTBEATS * beat
        sent: list[Any] = []
        sent_at = last_held = 0.0
        while True:
            await asyncio.sleep(tick)
            for peer in peer_holds.expire():  # holders resend every beat: this one is silent
                log.warning("holds of peer %s not refreshed for %.1f s: no longer counted",
                            peer, peer_holds.max_age)  # fmt: skip
            items = self.service.local_holds()
            now = time.monotonic()
            if items:
                last_held = now
            due = now - sent_at >= beat and now - last_held <= 10 * beat
            if (items != sent or due) and self.gossip.holds_changed(items):
                sent, sent_at = items, now

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
            return await self.stop()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    async def stop(self) -> int:
        """Drain: stop accepting, finish requests, flush everything, close. Returns 0 or 1."""
        assert self.server is not None and self.flusher is not None and self.storage is not None
        self._watch_stopping = True  # no more usage push ticks or timers
        if self._watch_timer is not None:
            self._watch_timer.cancel()
        self.server.stop_accepting()
        await self.server.close(drain_timeout=self.config.server.request_drain_timeout_s)
        if self._claimed_task is not None:
            self._tasks.append(self._claimed_task)
        for task in self._tasks:
            task.cancel()
        if self._watch_timer is not None:
            self._watch_timer.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self.service is not None:
            await self.service.seeder.close()  # reads ahead nobody waits for any more
            # Nothing is admitted any more: what this node's strict shares hold and it did
            # not admit goes back to the budgets (a crash would leave it until its lease ends).
            try:
                await asyncio.wait_for(self.service.shares.drain(), STRICT_DRAIN_S)
            except TimeoutError:
                log.warning("drain: strict shares not all given back within %s s", STRICT_DRAIN_S)
        self.drained = await self.flusher.drain(self.config.flush.drain_timeout_s)
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
        if self._stream_tasks:  # alerts being added to the Redis Stream: a moment to finish
            await asyncio.wait(self._stream_tasks, timeout=2.0)
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
        self.data_dir.release()
        log.info("node stopped (%s)", "drained" if self.drained else "NOT drained")
        return 0 if self.drained else 1

    async def __aenter__(self) -> Node:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.server is not None and self._tasks:
            await self.stop()

    async def _expire_loop(self) -> None:
        assert self.service is not None
        ticks = 0
        while True:
            await asyncio.sleep(0.05)
            self.service.expire_reservations()
            ticks += 1
            if ticks % 20 == 0:
                now = time.time()
                self.service.ids.expire(now)
                self.service.done.expire(now)

    async def _purge_loop(self) -> None:
        """Delete stored counters past their retention (SQLite; DynamoDB's TTL does it)."""
        assert self.storage is not None
        while True:
            await asyncio.sleep(self.config.storage.purge_interval_s)
            try:
                n = await self.storage.purge_expired()
            except StorageError as exc:
                log.warning("retention purge failed (retried next interval): %s", exc)
                continue
            if n:
                log.info("retention purge: deleted %d expired counters", n)

    async def _read_ahead_loop(self) -> None:
        """Before each period ends, read the next period's keys of the warm keys of the
        ending one (ADR 0005), so the first calls of the new period find them seeded.

        Four passes per period end, ``lead``, 3/4, 1/2 and 1/4 of it before, each for the
        keys first used since the one before (keys queued or seeded already are skipped).
        An error in one pass is logged and the loop goes on.
        """
        c = self.config.counters
        # A row read ahead must outlive the wait for the boundary: eviction keeps an idle row
        # at least evict_after_s.
        lead = min(c.rollover_read_ahead_s, c.evict_after_s)
        if lead <= 0:
            return
        done: dict[tuple[str, float], int] = {}  # (kind, period end) -> passes made
        while True:
            try:
                wait = await self._read_ahead_step(time.time(), lead, done)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not end the read-ahead for good (nor the drain)
                log.exception("rollover read-ahead failed unexpectedly (retried)")
                wait = 1.0
            await asyncio.sleep(wait)

    async def _read_ahead_step(
        self, now: float, lead: float, done: dict[tuple[str, float], int]
    ) -> float:
        """Make the read-ahead passes whose moment has come at ``now``; return how long to
        wait before the next look: until the next pass's moment, at most a second (the wall
        clock may jump, NTP), so a lead shorter than a second is not slept through."""
        c = self.config.counters
        wait = 1.0
        for kind in kinds_in_use(c.feature_periods):
            end = period_end(kind, now)
            passes = done.get((kind, end), 0)
            if passes < READ_AHEAD_PASSES and now >= end - lead * (1 - passes / 4):
                for k in [k for k in done if k[0] == kind and k[1] < end]:
                    del done[k]
                # Passes whose moment has come already are one.
                while passes < READ_AHEAD_PASSES and now >= end - lead * (1 - passes / 4):
                    passes += 1
                done[(kind, end)] = passes
                queued = await self._read_ahead(kind, now)
                log.info(
                    "%s ends in %.0f s: reading %d keys of the next one ahead",
                    kind,
                    end - now,
                    queued,
                )
            if passes < READ_AHEAD_PASSES:
                wait = min(wait, end - lead * (1 - passes / 4) - now)
        return max(wait, 0.001)

    async def _read_ahead(self, kind: PeriodKind, now: float) -> int:
        """Queue the next period's keys of every warm key, a slice per loop pass (a million
        keys mapped in one go would hold the loop for a good part of a second)."""
        assert self.service is not None and self.table is not None
        keys = list(self.table.keys())
        queued = 0
        for start in range(0, len(keys), READ_AHEAD_SLICE):
            queued += self.service.read_ahead(kind, now, keys[start : start + READ_AHEAD_SLICE])
            await asyncio.sleep(0)
        return queued

    async def _watch_loop(self) -> None:
        """Live usage push (``subscribe``): once per gossip interval (alone too), send each
        subscriber the watched counters that changed since they were last sent, once each,
        with their latest value. The tick reads the table once the write-ahead log holds every
        change made so far, so no value is pushed that a crash could take back."""
        assert self.service is not None
        interval = self.config.cluster.gossip_interval_ms / 1000
        watch = self.service.watch
        while True:
            await asyncio.sleep(interval)
            if watch:
                self._watch_schedule()

    # -- threshold alerts (docs/quotas.md) ---------------------------------------------------

    def _alert_fired(self, alert: Alert) -> None:
        """This node won ``alert``'s claim: announce it to the fleet (every peer delivers it
        to its subscribers), deliver it here, and add it to the Redis Stream."""
        assert self.service is not None
        if self.gossip is not None:
            item: AlertItem = (
                alert.id, alert.tenant, alert.feature, alert.period, alert.threshold,
                alert.threshold_units, alert.limit, alert.value, alert.node, alert.at,
            )  # fmt: skip
            if not self.gossip.alert_fired(item):
                log.warning("alert %s: the bus is down, peers' subscribers will not get it",
                            alert.id)  # fmt: skip
            task = asyncio.create_task(self._stream_alert(alert), name="alert-stream")
            self._stream_tasks.add(task)
            task.add_done_callback(self._stream_tasks.discard)
        self.service.alerts.deliver(alert)

    async def _stream_alert(self, alert: Alert, attempts: int = 5) -> None:
        """``XADD`` ``alert`` to ``alerts_stream``; tried again (up to ``attempts`` times in
        all, backing off) while Redis does not answer."""
        assert self.gossip is not None
        bus = self.gossip.bus
        xadd = getattr(bus, "xadd", None)
        if xadd is None:
            return
        c = self.config.cluster
        fields = {k: str(v) for k, v in alert.to_wire().items()}
        pause = 0.2
        for attempt in range(attempts):
            try:
                await xadd(c.alerts_stream, fields, c.alerts_stream_maxlen)
                return
            except BusUnavailable as exc:
                if attempt == attempts - 1:
                    log.error("alert %s not added to the stream %s: %s",
                              alert.id, c.alerts_stream, exc)  # fmt: skip
                    if self.service is not None:
                        self.service.alerts.stream_failures += 1
                    return
            await asyncio.sleep(pause)
            pause = min(5.0, pause * 2)

    def _peer_alert(self, sender: str, item: AlertItem) -> None:
        """A peer's ``alert`` frame: delivered here only if it is what that peer could have
        fired (its own claim, under the id of its fields, of a current period): a signed
        frame replayed from another node, or from a past period, is dropped (logged)."""
        assert self.service is not None
        alert = Alert(*item)
        if not from_peer_ok(alert, sender, time.time()):
            log.warning("alert frame from %s dropped: not one it could fire now (%s)",
                        sender, alert.id)  # fmt: skip
            return
        self.service.alerts.deliver(alert)

    def _deliver_alert(self, alert: Alert) -> None:
        assert self.service is not None
        log.info("alert %s delivered: %s/%s %d%% (fired by %s)",
                 alert.id, alert.tenant, alert.feature, alert.threshold, alert.node)  # fmt: skip
        if self.service.watch.offer_alert(alert.to_wire()) and self.server is not None:
            self.server.push_notifications()

    def _peer_deltas(self, deltas: Sequence[DeltaItem] = ()) -> None:
        """A peer's gossip changed this node's views: detect the threshold alerts it crossed,
        and push them now, not a tick later, so a
        unit tracked on a peer reaches a subscriber here within the peer's tick and delivery.
        Ticks run at least a quarter of an interval apart (a frame sooner after one sets a
        timer for then), and no counter is sent more than once per interval whatever the
        ticks (:meth:`Watch.tick`)."""
        assert self.service is not None
        self.service.peer_deltas(deltas)
        if self._watch_stopping or not self.service.watch or self._watch_pending:
            return
        interval = self.config.cluster.gossip_interval_ms / 1000
        next_ok = self._watch_last + interval / 4
        if time.monotonic() >= next_ok:
            self._watch_schedule()
        else:
            self._watch_at(next_ok)

    def _watch_schedule(self) -> None:
        if self._watch_pending or self._watch_stopping:
            return
        self._watch_pending = True
        if self.wal is None:
            self._watch_tick()
        else:
            self.wal.at_commit(self._watch_tick)

    def _watch_at(self, due: float) -> None:
        """Tick at ``due`` (monotonic seconds), unless a timer is set for earlier: one timer."""
        timer = self._watch_timer
        if timer is not None and not timer.cancelled() and self._watch_due <= due:
            return
        if timer is not None:
            timer.cancel()
        self._watch_due = due
        # (+2 ms: the loop's clock is not time.monotonic(), and uvloop's is cached to the ms;
        # a timer firing early would find the counter still held and wait a whole tick)
        delay = max(0.0, due - time.monotonic()) + 0.002
        self._watch_timer = asyncio.get_running_loop().call_later(delay, self._watch_due_now)

    def _watch_due_now(self) -> None:
        self._watch_timer = None
        if not self._stop.is_set():
            self._watch_schedule()

    def _watch_tick(self) -> None:
        assert self.service is not None and self.server is not None
        self._watch_pending = False
        if self._watch_stopping:
            return
        now = self._watch_last = time.monotonic()
        try:
            interval = self.config.cluster.gossip_interval_ms / 1000
            if self.service.watch_tick(now, interval):
                self.server.push_notifications()
            due = self.service.watch.next_due
            if due is not None and due > now:
                # A counter held back (sent less than an interval ago) goes as soon as it may.
                self._watch_at(due)
        except Exception:  # a bug must not end the push for good
            log.exception("usage push tick failed (tried again next tick)")

    async def _evict_loop(self) -> None:
        assert self.table is not None
        while True:
            await asyncio.sleep(self.config.counters.evict_after_s)
            dropped = self.table.evict_idle()
            if dropped:
                log.debug("evicted %d idle keys", dropped)

    def _owner_state(self, state: State, settled: bool = False) -> None:
        """Follow the node's hold on its id: count, flush and gossip only while it owns it.

        A claim made at start comes before anything is read (``settled``). One made later
        (the holder stopped, or storage answered at last) may follow reads made while another
        process still wrote under this id: seeding reads issued before the claim are refused
        when they land (:meth:`~meter.core.table.CounterTable.refuse_earlier_reads`; their keys are
        read again), and every warm key is re-read before the node counts, flushes or gossips
        again (:meth:`_after_claim`; the flusher re-reads before writing).
        """
        if self.owner is None:
            return
        if state == "owned" and not settled and self.flusher is not None:
            assert self.table is not None
            # Seeding reads issued before now (while fenced) may predate the last holder's
            # writes and land after the re-read below: the table refuses them, and their keys
            # are read again (C06).
            self.table.refuse_earlier_reads()
            self.flusher.reread_before_writing()
            if self.service is not None:
                self.service.fenced = f"node id {self.owner.node!r} was just claimed: retry"
            self._claimed_task = asyncio.create_task(self._after_claim(), name="after-claim")
            return
        if self.service is not None:
            self.service.fenced = self.owner.refusal()
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

    def _status_extra(self) -> dict[str, Any]:
        assert self.flusher is not None and self.table is not None
        fs = self.flusher.stats
        backlog, backlog_units = self.flusher.backlog()
        now = time.time()
        out: dict[str, Any] = {
            "socket": str(self.config.server.socket),
            "data_dir": str(self.config.data_dir),
            "flush": {
                "interval_ms": self.config.flush.interval_ms,
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
                "backlog_age_s": None
                if fs.backlog_since is None
                else round(now - fs.backlog_since, 3),
                "poisoned": [
                    {"key": list(k), "error": e} for k, e in list(fs.poisoned.items())[:20]
                ],
            },
        }
        out["gc"] = {
            "threshold": list(gc.get_threshold()),
            "frozen": gc.get_freeze_count(),
            "collections": [s["collections"] for s in gc.get_stats()],
        }
        if self.owner is not None:
            # counting: mutating calls are taken (owned, and re-read since the claim).
            counting = self.service is None or self.service.fenced is None
            out["owner"] = {**self.owner.status(), "counting": counting}
        if self.server is not None:
            out["server"] = self.server.stats()
        out["durability"] = {
            "mode": "off" if self.wal is None else self.wal.mode,
            "wal": None if self.wal is None else self.wal.status(),
        }
        if self.gossip is not None:
            out["cluster"] = self.gossip.status()
        out["not_ready"] = self._not_ready()
        out["ready"] = not out["not_ready"]
        out["degraded"] = self._degraded()
        out["metrics"] = {
            "address": None if self.http is None else self.http.address,
            "feature_labels": self.config.metrics.feature_labels,
        }
        return out

    def health_checks(self) -> dict[str, str | None]:
        """``/readyz``'s checks: ``counting``, ``log``, ``storage`` and ``bus``, each ``None``
        (ok, or not configured) or why it fails; the first two say whether the node can count
        (:meth:`_not_ready`), the others what works less than fully (:meth:`_degraded`)."""
        not_ready = self._not_ready()
        if self.server is None:
            not_ready.append("starting: the socket is not open yet")
        degraded = self._degraded()

        def joined(reasons: list[str], prefix: str, keep: bool = True) -> str | None:
            picked = [
                r.removeprefix(prefix).lstrip() if keep else r
                for r in reasons
                if r.startswith(prefix) is keep
            ]
            return "; ".join(picked) or None

        return {
            "counting": joined(not_ready, "log:", keep=False),
            "log": joined(not_ready, "log:"),
            "storage": joined(degraded, "storage:"),
            "bus": joined(degraded, "bus:"),
        }

    @staticmethod
    def can_count(checks: dict[str, str | None]) -> bool:
        """Whether :meth:`health_checks` say the node can take counting calls."""
        return checks["counting"] is None and checks["log"] is None

    def _not_ready(self) -> list[str]:
        """Why the node cannot take counting calls now (empty: ready), for ``meter status
        --check``: another process holds its id (or it was just claimed), its log cannot be
        written, or it is stopping. What shared services do is not here but in
        :meth:`_degraded`: every sidecar's probe failing at once with them would take every
        application pod out together, while the node serves on (docs/operations.md)."""
        out: list[str] = []
        if self._stop.is_set():
            out.append("draining: the node is stopping")
        if self.service is not None and self.service.fenced is not None:
            out.append(f"owner: not counting: {self.service.fenced}")
        if self.wal is not None and self.wal.broken is not None:
            out.append(f"log: cannot write: {self.wal.broken}")
        return out

    def _degraded(self) -> list[str]:
        """What works less than fully while the node still counts (``meter status --check
        --strict`` fails on these too): storage not answering (the last flush round failed, or
        could not write: the id's claim is not confirmed), or the bus down where one is
        configured."""
        out: list[str] = []
        fs = self.flusher.stats if self.flusher is not None else None
        fenced = self.service is not None and self.service.fenced is not None
        if fs is not None and not fenced and fs.last_result in ("error", "not owner"):
            out.append(f"storage: the last flush round failed: {fs.last_error}")
        elif self.owner is not None and self.owner.state == "unknown":
            out.append(f"storage: the node id's claim is not confirmed: {self.owner.last_error}")
        if self.gossip is not None and not self.gossip.bus.connected:
            out.append("bus: not connected (gossip paused; views lack peers' recent units)")
        return out
