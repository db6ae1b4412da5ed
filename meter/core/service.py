"""The node's methods: one dispatch table over the parts that answer them, and the reads.

``dispatch`` answers warm keys synchronously (no await on the hot path) and returns a coroutine
only when a cold key must first be seeded from storage. The counting methods live in their
parts (:mod:`~meter.core.tracking`, :mod:`~meter.core.reserving`, the ``check`` of
:mod:`~meter.core.gate`); the features' methods (limits, ledger, history, export) arrive as
handlers from the node's wiring. What stays here: the reads (``usage``, ``usage_all``,
``status``, ``ping``) and live usage subscriptions. See docs/protocol.md for the methods.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Any

from meter import BUILD, __version__, compiled
from meter.config import CounterConfig
from meter.core.dims import check_group_by, is_dimension, where_name
from meter.core.fence import Fence, log_down
from meter.core.gate import Gate
from meter.core.gauging import Gauging
from meter.core.groups import Groups
from meter.core.idempotency import RequestIds
from meter.core.journal import Journal
from meter.core.keycache import KeyCache
from meter.core.keys import Key, PeriodKind, check_at
from meter.core.leases import Reservations
from meter.core.params import args as check_args
from meter.core.params import opts as check_opts
from meter.core.ports import Handler, Reporting
from meter.core.reserving import Reserving
from meter.core.seeder import Seeder
from meter.core.table import CounterTable
from meter.core.tracking import Tracking
from meter.core.uniques import Uniques
from meter.core.watch import (
    Bind,
    Subscriber,
    View,
    Watch,
    check_features,
    notification,
    views,
    watched,
)
from meter.errors import InvalidArgument, Unavailable, UnknownMethod
from meter.wal.log import WalError, WriteAheadLog
from storage.base import EMPTY, Storage, StorageError, gauge_feature
from storage.periods import Cycle

_USAGE_OPTS = frozenset({"at"})
_USAGE_ONE_OPTS = frozenset({"at", "where", "group_by"})
#: The methods that change nothing but read what the requests before them did: the server
#: runs one only once every request sent before it on its connection has finished
#: (read-your-writes, docs/protocol.md). ``subscribe`` changes only its connection's watch
#: and answers the values as they are.
READS = frozenset(
    {
        "usage",
        "usage_all",
        "usage_children",
        "check",
        "ping",
        "status",
        "subscribe",
        "history",
        "export",
        "limits",
        "get_feature",
        "balance",
        "ledger",
        "ledger_timeline",
    }
)


class Service:
    """The methods a node serves, over one table and one storage backend.

    Built by :func:`meter.node.wiring.build_service` from its parts; it holds the dispatch
    table, the reads and the subscriptions, and names the parts others reach (the table, the
    request ids, the reservations, the seeder, the watch)."""

    def __init__(
        self,
        table: CounterTable,
        storage: Storage,
        config: CounterConfig,
        *,
        keys: KeyCache,
        fence: Fence,
        seeder: Seeder,
        gate: Gate,
        tracking: Tracking,
        reserving: Reserving,
        groups: Groups,
        gauging: Gauging,
        uniques: Uniques,
        journal: Journal,
        watch: Watch,
        limits: Reporting,
        features: Mapping[str, Handler],
        status_extra: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        self.table = table
        self.storage = storage
        self.config = config
        self.keys = keys
        self.fence = fence
        #: The write-ahead log every state change is appended to (``None``: durability off).
        self.wal: WriteAheadLog | None = fence.wal
        #: Reads cold keys from storage in batches.
        self.seeder = seeder
        self.gate = gate
        self.tracking = tracking
        self.reserving = reserving
        #: Dimension counters: listed, bounded, grouped (docs/dimensions.md).
        self.groups = groups
        #: Gauges (``max``, ``latest``): observed, read.
        self.gauging = gauging
        #: Unique features: values claimed, counted once.
        self.uniques = uniques
        self.journal = journal
        #: Request ids of calls that counted, with their first answers.
        self.ids: RequestIds = tracking.ids
        #: Open reservations, and the finished ones (by reservation id).
        self.reservations: Reservations = reserving.reservations
        self.done: RequestIds = reserving.done
        #: Live usage subscriptions (``subscribe``); ticked by the node's watch loop.
        self.watch = watch
        self.limits = limits
        self.status_extra = status_extra
        self.started_at = time.time()
        self.calls = 0
        #: ``track_many`` items refused (the call itself answered), by error code.
        self.item_refusals: dict[str, int] = tracking.item_refusals
        #: The methods served only after the requests before them on their connection.
        self.reads = READS
        self._methods: dict[str, Callable[[list[Any]], Any]] = {
            **features,
            "check": gauging.or_counters(gate.check),
            "track": tracking.track,
            "track_many": tracking.track_many,
            "usage": self._usage,
            "usage_all": self._usage_all,
            "reserve": reserving.reserve,
            "commit": reserving.commit,
            "release": reserving.release,
            "ping": self._ping,
            "status": self._status,
            "subscribe": self._subscribe,
            "unsubscribe": self._unsubscribe,
            "subscribe_alerts": self._subscribe_alerts,
            "unsubscribe_alerts": self._unsubscribe_alerts,
        }

    # -- entry points ---------------------------------------------------------------------

    @property
    def methods(self) -> tuple[str, ...]:
        """The method names this service answers."""
        return tuple(self._methods)

    @property
    def fenced(self) -> str | None:
        """Why state changes are refused now (another process owns this node's id), or None."""
        return self.fence.reason

    def dispatch(self, method: str, params: list[Any]) -> Any:
        """Run ``method``; return its result, or an awaitable of it for cold keys.

        Raises :class:`MeterError` subclasses for bad requests.
        """
        handler = self._methods.get(method)
        if handler is None:
            raise UnknownMethod(f"unknown method {method[:64]!r}")
        self.calls += 1
        return handler(params)

    def warm_tracks(self, requests: list[Any]) -> list[int]:
        """Count the leading run of plain warm ``track`` requests of a pipelined batch
        (:meth:`Tracking.warm_tracks`); the caller dispatches the rest one by one."""
        values = self.tracking.warm_tracks(requests)
        self.calls += len(values)
        return values

    def notify(self, method: str, params: list[Any]) -> None:
        """Notifications are accepted and ignored (none is defined yet)."""

    # -- keys and seeding ---------------------------------------------------------------------

    def key_for(self, tenant: object, feature: object, at: float | None = None) -> Key:
        """Validate names and build the key of the period containing ``at`` (default now)."""
        return self.keys.key_for(tenant, feature, at)

    def current_keys(self, keys: Iterable[Key], limit: int) -> tuple[list[Key], int]:
        """:meth:`KeyCache.current_keys` (recovery's warm-up)."""
        return self.keys.current_keys(keys, limit)

    async def seed(self, key: Key) -> bool:
        """Make ``key`` seeded from storage, read in a batch with every other cold key asked
        for meanwhile (:class:`~meter.core.seeder.Seeder`).

        Returns False (and leaves the key unseeded) if storage cannot be read.
        """
        if self.table.is_seeded(key):
            return True
        return await self.seeder.seed(key)

    def read_ahead(
        self, kind: PeriodKind, now: float, keys: Iterable[Key], calendar: Cycle | None = None
    ) -> int:
        """Queue reads of the next period's key of each of ``keys`` that is in the period of
        ``kind`` in ``calendar`` (``None``: UTC) containing ``now``
        (:mod:`meter.core.periods`); return how many were queued."""
        return self.seeder.prefetch(self.keys.next_keys(kind, now, keys, calendar))

    # -- the journal and the reservations' expiry ---------------------------------------------

    @property
    def warming(self) -> list[Key]:
        """Keys a restart's warm-up is reading ahead (:attr:`Journal.warming`)."""
        return self.journal.warming

    def undo(self, records: list[list[Any]]) -> None:
        """:meth:`Journal.undo`: take back records whose log write failed."""
        self.journal.undo(records)

    def checkpoint(self) -> Iterator[list[Any]]:
        """:meth:`Journal.checkpoint`: records restating what the log must keep."""
        return self.journal.checkpoint()

    def expire_reservations(self, now: float | None = None) -> int:
        """Release every reservation past its deadline; return how many."""
        return self.reserving.expire(now)

    def peer_deltas(self, deltas: Iterable[tuple[str, str, str, int, int]]) -> None:
        """A peer's gossip deltas were applied: :meth:`Gate.peer_deltas` (alerts)."""
        self.gate.peer_deltas(deltas)

    # -- reads --------------------------------------------------------------------------------

    def _usage(self, params: list[Any]) -> Any:
        tenant, feature, opts = check_args("usage", params, 2, 3, ({},))
        o = check_opts("usage", opts, _USAGE_ONE_OPTS, nil_is_absent=True)
        at = o.get("at")
        key = self.keys.key_for(tenant, feature, None if at is None else check_at(at))
        if "where" in o or "group_by" in o:
            spec = self.keys.spec(key[1])
            if "group_by" in o:
                if "where" in o:
                    raise InvalidArgument("usage: give where or group_by, not both")
                return self.groups.read(key, check_group_by(key[1], spec, o["group_by"]))
            name = where_name(key[1], spec, o["where"])
            if name != key[1]:  # one dimension value's counter: a read makes none
                return self.groups.value((key[0], name, key[2]))
        kind = self.gate.gauges.get(key[1])
        if kind is not None:
            return self.gauging.value(key, kind)
        value = self.table.value(key)
        if value is not None:
            return value
        return self._usage_cold(key)

    async def _usage_cold(self, key: Key) -> int:
        if not await self.seed(key):
            raise Unavailable("storage is unreachable and this counter's total is not known")
        value = self.table.value(key)
        if value is None:  # evicted between seeding and reading: practically never
            raise Unavailable("counter was evicted while being read; retry")
        return value

    def _usage_all(self, params: list[Any]) -> Awaitable[dict[str, int]]:
        tenant, opts = check_args("usage_all", params, 1, 2, ({},))
        at = check_opts("usage_all", opts, _USAGE_OPTS).get("at")
        at_f = None if at is None else check_at(at)
        keys = self.keys
        tenant = keys.tenant(tenant)
        periods = [(kind, keys.period(keys.period_of(tenant, kind, at_f)))
                   for kind in sorted(keys.kinds())]  # fmt: skip
        # The counters loaded now are answered as they are now, as this request arrives, so
        # requests pipelined after it (counted before its listing returns) are not in it.
        known: dict[str, int] = {}
        gauges = self.gate.gauges
        for kind, period in periods:
            for feature, value in self.table.all_for(tenant, period).items():
                if keys.kind_of(feature) == kind and counter_total(feature, gauges):
                    known[feature] = value
            for feature, value in self.gauging.table.all_for(tenant, period).items():
                if keys.kind_of(feature) == kind:
                    known[feature] = value
        wal = self.wal
        # What ``known`` shows may be in a log batch not committed yet: answer once it is.
        pending_log = wal is not None and wal.dirty
        return self._usage_all_async(tenant, periods, known, pending_log)

    async def _usage_all_async(
        self,
        tenant: str,
        periods: list[tuple[PeriodKind, str]],
        known: dict[str, int],
        pending_log: bool,
    ) -> dict[str, int]:
        if pending_log:
            assert self.wal is not None
            try:
                await self.wal.durable()
            except WalError:
                raise log_down(self.wal) from None
        out = dict(known)
        keys = self.keys
        features = keys.features
        for kind, period in periods:
            for _ in range(3):
                epoch = self.table.epoch
                try:
                    stored = await self.storage.list_period(tenant, period)
                except StorageError as exc:
                    raise Unavailable(f"storage is unreachable: {exc}") from None
                # The listing is a fresh read of every counter of the tenant in the period:
                # it seeds the listed ones and, with nothing stored, the ones this node
                # counted while storage could not be read (they are not listed). Gauges are
                # not counters: their stored values answer where this node holds none (one
                # it holds unread is read first, below), and a gauge feature's counter (calls
                # of a node that did not know it was a gauge) is not this node's to load.
                gauges = self.gate.gauges
                for name, snap in stored.items():
                    gauge = gauge_feature(name)
                    if gauge in gauges and keys.kind_of(gauge) == kind:
                        out.setdefault(gauge, snap.total)
                snaps = {f: snap for f, snap in stored.items() if counter_total(f, gauges)}
                for feature in self.table.unseeded_features(tenant, period):
                    if feature not in gauges:
                        snaps.setdefault(feature, EMPTY)
                # Stored feature names share this node's copy when it has one; they are not
                # added to it, as this node has not validated them.
                refused = [
                    f
                    for f, snap in snaps.items()
                    if not self.table.seed((tenant, features.get(f, f), period), snap, epoch)
                    and not self.table.is_seeded((tenant, f, period))
                ]
                # Else an eviction pass or a claim of the node id overtook the listing: again.
                if not refused:
                    break
            else:
                raise Unavailable(
                    "counters were evicted (or the node id claimed) while being listed; retry"
                )
            # Counters that were not loaded when the request arrived: as they are now.
            # (usage_all answers totals: dimension counters are read with group_by)
            for feature, value in self.table.all_for(tenant, period).items():
                if (
                    feature not in out
                    and keys.kind_of(feature) == kind
                    and counter_total(feature, self.gate.gauges)
                ):
                    out[feature] = value
            # Gauges this node holds unread (its log's readings after a restart): read, as
            # their rows know more than the listing's values.
            unread = self.gauging.table.unseeded_in(tenant, period)
            if unread:
                await self.gauging.load(unread)
                for feature, value in self.gauging.table.all_for(tenant, period).items():
                    if keys.kind_of(feature) == kind:
                        out[feature] = value
        return out

    # -- live usage push ---------------------------------------------------------------------

    def _subscribe(self, params: list[Any]) -> Bind:
        tenant, features = check_args("subscribe", params, 1, 2, (None,))
        tenant = self.keys.tenant(tenant)
        named = check_features(features)
        if named is not None:
            named = frozenset(self.keys.feature(f) for f in named)
        return Bind(lambda sub: self._subscribe_for(sub, tenant, named))

    def _subscribe_for(self, sub: Subscriber, tenant: str, features: frozenset[str] | None) -> Any:
        # Named counters are loaded first: gossip is applied to loaded counters only, so a
        # counter this node never loaded would never change here. (Gauges are not pushed: a
        # gauge's key never enters the counter table.)
        gauges = self.gate.gauges
        keys = [self.keys.key_for(tenant, f) for f in features or () if f not in gauges]
        cold = [k for k in keys if not self.table.is_seeded(k)]
        if cold:
            return self._subscribe_cold(sub, tenant, features, cold)
        return self._subscribe_now(sub, tenant, features)

    async def _subscribe_cold(
        self, sub: Subscriber, tenant: str, features: frozenset[str] | None, cold: list[Key]
    ) -> list[list[Any]]:
        await self.seeder.seed_many(cold)  # a counter storage could not give is watched anyway
        return self._subscribe_now(sub, tenant, features)

    def _subscribe_now(
        self, sub: Subscriber, tenant: str, features: frozenset[str] | None
    ) -> list[list[Any]]:
        """Watch, and answer the watched counters' values now, shaped as notifications."""
        now = self.watch_view(tenant, features)
        self.watch.subscribe(sub, tenant, features, now)
        return [notification(tenant, f, v, p) for (f, p), v in now.items() if watched(f, features)]

    def _unsubscribe(self, params: list[Any]) -> Bind:
        (tenant,) = check_args("unsubscribe", params, 1, 1)
        tenant = self.keys.tenant(tenant)
        return Bind(lambda sub: self.watch.unsubscribe(sub, tenant))

    def _subscribe_alerts(self, params: list[Any]) -> Bind:
        check_args("subscribe_alerts", params, 0, 0)
        return Bind(self.watch.subscribe_alerts)

    def _unsubscribe_alerts(self, params: list[Any]) -> Bind:
        check_args("unsubscribe_alerts", params, 0, 0)
        return Bind(self.watch.unsubscribe_alerts)

    def watch_view(self, tenant: str, features: frozenset[str] | None) -> View:
        """``tenant``'s loaded counters of the current periods, as ``usage`` answers them (holds
        included); the watched ones (``features``, ``None``: all) are marked used so they stay
        loaded, the others may be evicted as if nobody watched."""
        keys = self.keys
        periods = [(k, keys.period(keys.period_of(tenant, k))) for k in sorted(keys.kinds())]
        use: bool | frozenset[str] = True if features is None else features
        gauges = self.gate.gauges

        def counters(t: str, p: str) -> dict[str, int]:
            # (a gauge feature's counter, counted before it was declared, is not its value)
            held = self.table.all_for(t, p, use=use)
            return {f: v for f, v in held.items() if f not in gauges} if gauges else held

        return views(tenant, periods, counters, keys.kind_of)

    def watch_tick(self, now: float = 0.0, spacing: float = 0.0) -> list[Subscriber]:
        """One tick of the live usage push: offer every watched counter that changed since it
        was last offered (and not within ``spacing`` seconds of ``now``) to its subscribers;
        return the subscribers with notifications to send."""
        watch = self.watch
        if not watch:
            watch.next_due = None  # (nothing held: nobody watches)
            return []
        return watch.tick(lambda tenant: self.watch_view(tenant, watch.named(tenant)), now, spacing)

    # -- ping and status -----------------------------------------------------------------------

    def _ping(self, params: list[Any]) -> str:
        check_args("ping", params, 0, 0)
        return "pong"

    def _status(self, params: list[Any]) -> dict[str, Any]:
        check_args("status", params, 0, 0)
        stats = self.table.stats()
        gate = self.gate
        out: dict[str, Any] = {
            "node_id": self.table.node,
            "version": __version__,
            "build": compiled.running(BUILD).to_json(),
            "uptime_s": round(time.time() - self.started_at, 3),
            "storage": self.storage.kind,
            "keys": {
                "warm": stats.warm,
                "dirty": stats.dirty,
                "unseeded": stats.unseeded,
                "inflight": stats.inflight,
                "reserved": stats.reserved_keys,
            },
            "reservations": {
                "open": len(self.reservations),
                "expired_total": self.reservations.expired_total,
            },
            "calls": self.calls,
            "limits": {
                **self.limits.status(),
                "refused": gate.limit_refusals,
                "strict": gate.shares.status(),
                "soft_crossings": gate.soft_crossings,
            },
            "seeding": self.seeder.status(),
            "request_ids": {
                "remembered": len(self.ids),
                "dropped_early": self.ids.dropped_early,
                "voided": self.ids.voided_total - self.ids.voids_undone,
                "window_s": self.ids.window_s,
                "max": self.ids.max_ids,
                "finished_reservations": len(self.done),
            },
            "subscriptions": self.watch.status(),
            "alerts": {**gate.alerts.status(), **self.watch.alert_status()},
        }
        if self.status_extra is not None:
            out.update(self.status_extra())
        return out


def counter_total(name: str, gauges: Mapping[str, str]) -> bool:
    """Whether a stored or held name is a feature's total counter ``usage_all`` lists: not a
    dimension counter, not a gauge, nor a gauge feature's counter."""
    return not is_dimension(name) and name not in gauges and gauge_feature(name) is None
