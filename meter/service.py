"""The node's methods: validate the parameters, answer from the table, seed cold keys.

``dispatch`` answers warm keys synchronously (no await on the hot path) and returns a coroutine
only when a cold key must first be seeded from storage. See docs/protocol.md for the methods.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from meter import __version__
from meter.config import CounterConfig
from meter.errors import InvalidArgument, MeterError, Unavailable, UnknownMethod
from meter.keys import (
    QTY_MAX,
    QTY_MIN,
    Key,
    PeriodKind,
    check_at,
    check_feature,
    check_qty,
    check_tenant,
    period_start,
)
from meter.reservations import Reservations
from meter.table import CounterTable
from storage.base import Storage, StorageError

log = logging.getLogger("meter.service")

#: Longest ``track_many`` batch.
MAX_BATCH_ITEMS = 10_000

#: Most (tenant, feature) pairs whose current key is cached; the cache starts over when full.
KEY_CACHE_SIZE = 65_536

_TRACK_OPTS = frozenset({"at"})
_USAGE_OPTS = frozenset({"at"})
_RESERVE_OPTS = frozenset({"limit", "ttl_ms", "at"})


class Service:
    """The methods a node serves, over one table and one storage backend."""

    def __init__(
        self,
        table: CounterTable,
        storage: Storage,
        config: CounterConfig | None = None,
        *,
        status_extra: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        self.table = table
        self.storage = storage
        self.config = config or CounterConfig()
        self.reservations = Reservations()
        self.status_extra = status_extra
        self.started_at = time.time()
        self.calls = 0
        self._seeding: dict[Key, asyncio.Future[None]] = {}
        self._periods: Mapping[str, PeriodKind] = self.config.feature_periods
        # Hot-path cache: (tenant, feature) -> its validated key in the current period. Valid
        # only within [_day_start, _day_end): the current UTC day, inside which neither a day
        # nor a month period changes. Validation and period building then happen once per
        # pair per day instead of once per call, and every row of a pair shares one key tuple.
        self._keys: dict[tuple[str, str], Key] = {}
        self._day_start = 0.0
        self._day_end = 0.0
        self._methods: dict[str, Callable[[list[Any]], Any]] = {
            "track": self._track,
            "track_many": self._track_many,
            "usage": self._usage,
            "usage_all": self._usage_all,
            "reserve": self._reserve,
            "commit": self._commit,
            "release": self._release,
            "ping": self._ping,
            "status": self._status,
        }

    # -- entry point ----------------------------------------------------------------------

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
        """Count the leading run of plain warm ``track`` requests of a pipelined batch.

        ``requests`` are MessagePack-RPC requests ``[0, msgid, method, params]``. From the
        first, every request that is ``track(tenant, feature, qty)`` on a seeded key whose
        names this node has already validated today is counted, under one hold of the table's
        lock; the run stops at the first other request. Returns the new values of the
        requests counted (answers to the first ``len(result)`` requests, in order); the caller
        dispatches the rest one by one, in order, so pipelined requests keep their order.
        """
        now = time.time()
        if not self._day_start <= now < self._day_end:
            return []
        cache = self._keys
        items: list[tuple[Key, int]] = []
        append = items.append
        for req in requests:
            if type(req) is not list or req[2] != "track":
                break
            params = req[3]
            if len(params) != 3:
                break
            tenant, feature, qty = params
            if type(tenant) is not str or type(feature) is not str or type(qty) is not int:
                break
            key = cache.get((tenant, feature))
            if key is None or not QTY_MIN <= qty <= QTY_MAX:
                break
            append((key, qty))
        if not items:
            return []
        values = self.table.incr_prefix(items)
        self.calls += len(values)
        return values

    def notify(self, method: str, params: list[Any]) -> None:
        """Notifications are accepted and ignored (none is defined yet)."""

    # -- keys ---------------------------------------------------------------------------------

    def key_for(self, tenant: object, feature: object, at: float | None = None) -> Key:
        """Validate names and build the key of the period containing ``at`` (default now)."""
        if at is None and type(tenant) is str and type(feature) is str:
            now = time.time()
            if self._day_start <= now < self._day_end:
                key = self._keys.get((tenant, feature))
                if key is not None:
                    return key
            else:
                self._new_day(now)
            t = check_tenant(tenant)
            f = check_feature(feature)
            key = (t, f, period_start(self._periods.get(f, "month"), now))
            if len(self._keys) >= KEY_CACHE_SIZE:
                self._keys.clear()
            self._keys[(t, f)] = key
            return key
        t = check_tenant(tenant)
        f = check_feature(feature)
        return (t, f, period_start(self._periods.get(f, "month"), at))

    def _new_day(self, now: float) -> None:
        """Start the key cache over for the UTC day containing ``now``."""
        self._keys.clear()
        self._day_start = now - now % 86400
        self._day_end = self._day_start + 86400

    async def seed(self, key: Key) -> bool:
        """Make ``key`` seeded from storage; one load per key however many callers wait.

        Returns False (and leaves the key unseeded) if storage cannot be read.
        """
        if self.table.is_seeded(key):
            return True
        fut = self._seeding.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._seeding[key] = fut
            try:
                # A read overtaken by an eviction pass may predate a flush of the key (warm
                # meanwhile): the table refuses it, and we read again.
                for _ in range(3):
                    evictions = self.table.evictions
                    snaps = await self.storage.load([key])
                    if self.table.seed(key, snaps[key], evictions) or self.table.is_seeded(key):
                        break
            except StorageError as exc:
                log.warning("cannot seed %s: %s", key, exc)
            finally:
                del self._seeding[key]
                # Whatever happened (a backend bug, a cancelled request), waiters must wake;
                # each looks at the table itself.
                if not fut.done():
                    fut.set_result(None)
        else:
            # Shielded: one waiter's cancellation must not cancel the future all waiters share.
            await asyncio.shield(fut)
        return self.table.is_seeded(key)

    # -- methods ------------------------------------------------------------------------------

    def _track(self, params: list[Any]) -> Any:
        if len(params) == 3:  # the common shape: no opts, so no period choice to check
            tenant, feature, qty = params
            key = None
            if type(tenant) is str and type(feature) is str:
                # key_for's cache, inlined: this is the node's hottest path.
                now = time.time()
                if self._day_start <= now < self._day_end:
                    key = self._keys.get((tenant, feature))
            if key is None:
                key = self.key_for(tenant, feature)
            if type(qty) is not int or not QTY_MIN <= qty <= QTY_MAX:
                qty = check_qty(qty)  # raises the usual error
            value = self.table.try_incr(key, qty)
            if value is not None:
                return value
            return self._track_cold(key, qty)
        tenant, feature, qty, opts = _args("track", params, 2, 4, (1, {}))
        at = _opts("track", opts, _TRACK_OPTS).get("at")
        key = self.key_for(tenant, feature, None if at is None else check_at(at))
        qty = check_qty(qty)
        if self.table.is_seeded(key):
            return self.table.incr(key, qty)
        return self._track_cold(key, qty)

    async def _track_cold(self, key: Key, qty: int) -> int | None:
        await self.seed(key)
        # Counted whether or not seeding worked: usage is never dropped. An unseeded key
        # answers None, because its total is not known.
        return self.table.incr(key, qty)

    def _track_many(self, params: list[Any]) -> Any:
        (items,) = _args("track_many", params, 1, 1, ())
        if not isinstance(items, list):
            raise InvalidArgument("track_many: items must be an array of [tenant, feature, qty]")
        if len(items) > MAX_BATCH_ITEMS:
            raise InvalidArgument(f"track_many: at most {MAX_BATCH_ITEMS} items per call")
        now = time.time()
        # The key cache answers for the whole batch if it is valid now (see key_for).
        cache = self._keys if self._day_start <= now < self._day_end else {}
        if cache:
            # The common batch: every item a plain [str, str, int] on a known name pair and a
            # seeded key. One pass builds it; anything else takes the general path below.
            fast: list[tuple[Key, int]] = []
            append = fast.append
            for item in items:
                if type(item) is not list or len(item) != 3:
                    break
                tenant, feature, qty = item
                if type(tenant) is not str or type(feature) is not str or type(qty) is not int:
                    break
                key = cache.get((tenant, feature))
                if key is None or not QTY_MIN <= qty <= QTY_MAX:
                    break
                append((key, qty))
            else:
                values = self.table.incr_seeded(fast)
                if values is not None:
                    return values
        out: list[Any] = []
        good: list[tuple[Key, int]] = []
        where: list[int] = []  # out index of each good item
        for i, item in enumerate(items):
            try:
                if (type(item) is list or isinstance(item, list | tuple)) and len(item) == 3:
                    tenant, feature, qty = item
                else:
                    raise InvalidArgument("item must be [tenant, feature, qty]")
                key = (
                    cache.get((tenant, feature))
                    if type(tenant) is str and type(feature) is str
                    else None
                )
                if key is None:
                    key = self.key_for(tenant, feature)
                if type(qty) is not int or not QTY_MIN <= qty <= QTY_MAX:
                    qty = check_qty(qty)
            except MeterError as exc:
                out.append(exc.to_wire())
                continue
            out.append(None)
            good.append((key, qty))
            where.append(i)
        # All warm: every item is counted under one hold of the table's lock. Otherwise nothing
        # is counted until the cold keys are seeded, so a batch cut short (a draining node
        # cancels it, a read fails unexpectedly) has counted nothing and its error answer is
        # true: a client retrying it counts nothing twice.
        values = self.table.incr_seeded(good)
        if values is not None:
            for i, value in zip(where, values, strict=True):
                out[i] = value
            return out
        return self._track_many_cold(out, where, good)

    async def _track_many_cold(
        self, out: list[Any], where: list[int], good: list[tuple[Key, int]]
    ) -> Any:
        cold = {k for k, _ in good if not self.table.is_seeded(k)}
        await asyncio.gather(*(self.seed(k) for k in cold))
        # Counted whether or not seeding worked, as track does: unseeded keys answer nil.
        for i, (key, qty) in zip(where, good, strict=True):
            out[i] = self.table.incr(key, qty)
        return out

    def _usage(self, params: list[Any]) -> Any:
        tenant, feature, opts = _args("usage", params, 2, 3, ({},))
        at = _opts("usage", opts, _USAGE_OPTS).get("at")
        key = self.key_for(tenant, feature, None if at is None else check_at(at))
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
        tenant, opts = _args("usage_all", params, 1, 2, ({},))
        at = _opts("usage_all", opts, _USAGE_OPTS).get("at")
        at_f = None if at is None else check_at(at)
        return self._usage_all_async(check_tenant(tenant), at_f)

    async def _usage_all_async(self, tenant: str, at: float | None) -> dict[str, int]:
        kinds: set[PeriodKind] = {"month", *self._periods.values()}
        out: dict[str, int] = {}
        for kind in sorted(kinds):
            period = period_start(kind, at)
            for _ in range(3):
                evictions = self.table.evictions
                try:
                    stored = await self.storage.list_period(tenant, period)
                except StorageError as exc:
                    raise Unavailable(f"storage is unreachable: {exc}") from None
                refused = [
                    f
                    for f, snap in stored.items()
                    if not self.table.seed((tenant, f, period), snap, evictions)
                    and not self.table.is_seeded((tenant, f, period))
                ]
                if not refused:  # else an eviction pass overtook the listing: list again
                    break
            else:
                raise Unavailable("counters were evicted while being listed; retry")
            for feature, value in self.table.all_for(tenant, period).items():
                if self._periods.get(feature, "month") == kind:
                    out[feature] = value
        return out

    def _reserve(self, params: list[Any]) -> Any:
        tenant, feature, qty, opts = _args("reserve", params, 3, 4, ({},))
        o = _opts("reserve", opts, _RESERVE_OPTS)
        at = o.get("at")
        key = self.key_for(tenant, feature, None if at is None else check_at(at))
        qty = check_qty(qty, allow_negative=False)
        limit = o.get("limit")
        if limit is not None:
            limit = check_qty(limit, what="limit", allow_negative=False)
        ttl_ms = o.get("ttl_ms", self.config.reservation_ttl_ms)
        ttl_ms = check_qty(ttl_ms, what="ttl_ms", allow_negative=False)
        if not 1 <= ttl_ms <= self.config.max_reservation_ttl_ms:
            raise InvalidArgument(f"ttl_ms must be 1..{self.config.max_reservation_ttl_ms}")
        if self.table.is_seeded(key):
            return self._reserve_now(key, qty, limit, ttl_ms)
        return self._reserve_cold(key, qty, limit, ttl_ms)

    async def _reserve_cold(self, key: Key, qty: int, limit: int | None, ttl_ms: int) -> str:
        await self.seed(key)
        return self._reserve_now(key, qty, limit, ttl_ms)

    def _reserve_now(self, key: Key, qty: int, limit: int | None, ttl_ms: int) -> str:
        self.table.reserve(key, qty, limit)
        lease = self.reservations.open(key, qty, time.monotonic() + ttl_ms / 1000)
        return lease.id

    def _commit(self, params: list[Any]) -> Any:
        rid, actual = _args("commit", params, 1, 2, (None,))
        lease = self.reservations.close(_reservation_id(rid))
        if actual is None:
            actual = lease.qty
        else:
            try:
                actual = check_qty(actual, what="actual_qty", allow_negative=False)
            except InvalidArgument:
                # A bad argument must not cost the caller the reservation.
                self.reservations.open_again(lease)
                raise
        return self.table.commit(lease.key, lease.qty, actual)

    def _release(self, params: list[Any]) -> None:
        (rid,) = _args("release", params, 1, 1, ())
        lease = self.reservations.close(_reservation_id(rid))
        self.table.release(lease.key, lease.qty)

    def expire_reservations(self, now: float | None = None) -> int:
        """Release every reservation past its deadline; return how many."""
        leases = self.reservations.expire(time.monotonic() if now is None else now)
        for lease in leases:
            self.table.release(lease.key, lease.qty)
        return len(leases)

    def _ping(self, params: list[Any]) -> str:
        _args("ping", params, 0, 0, ())
        return "pong"

    def _status(self, params: list[Any]) -> dict[str, Any]:
        _args("status", params, 0, 0, ())
        stats = self.table.stats()
        out: dict[str, Any] = {
            "node_id": self.table.node,
            "version": __version__,
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
        }
        if self.status_extra is not None:
            out.update(self.status_extra())
        return out


def _args(
    method: str, params: list[Any], least: int, most: int, defaults: tuple[Any, ...]
) -> list[Any]:
    """Check the arity of ``params`` and fill the optional trailing ones from ``defaults``."""
    n = len(params)
    if not least <= n <= most:
        want = str(least) if least == most else f"{least} to {most}"
        raise InvalidArgument(f"{method} takes {want} params, got {n}")
    if n == most:
        return params
    return [*params, *defaults[n - least :]]


def _opts(method: str, opts: Any, allowed: frozenset[str]) -> Mapping[str, Any]:
    if opts is None:
        return {}
    if not isinstance(opts, dict):
        raise InvalidArgument(f"{method}: opts must be a map, got {type(opts).__name__}")
    for name in opts:
        if name not in allowed:
            names = ", ".join(sorted(allowed))
            raise InvalidArgument(f"{method}: unknown option {str(name)[:32]!r} (allowed: {names})")
    return opts


def _reservation_id(rid: Any) -> str:
    if isinstance(rid, bytes):
        rid = rid.decode("utf-8", "replace")
    if not isinstance(rid, str) or not rid or len(rid) > 64:
        raise InvalidArgument("reservation id must be a non-empty string of at most 64 chars")
    return rid
