"""The node's methods: validate the parameters, answer from the table, seed cold keys.

``dispatch`` answers warm keys synchronously (no await on the hot path) and returns a coroutine
only when a cold key must first be seeded from storage. See docs/protocol.md for the methods.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

from meter import BUILD, __version__, compiled
from meter.config import CounterConfig
from meter.core.idempotency import RequestIds, check_id, fingerprint
from meter.core.keys import (
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
from meter.core.leases import Lease, Reservations
from meter.core.table import CounterTable, PartlyRefused
from meter.core.watch import Bind, Subscriber, View, Watch, check_features, views
from meter.errors import (
    Conflict,
    InsufficientBalance,
    InvalidArgument,
    LimitExceeded,
    MeterError,
    NotFound,
    Unavailable,
    UnknownMethod,
)
from meter.history.days import HistoryMethod
from meter.ledger import model as ledger
from meter.ledger.methods import LedgerMethods
from meter.ledger.store import LedgerBook
from meter.ops import export
from meter.persist.rollover import next_keys, period_end
from meter.persist.seeder import Seeder
from meter.quotas.alerts import Alerts
from meter.quotas.escrow import NoBudget
from meter.quotas.holds import MAX_HOLD_BYTES, MAX_HOLD_KEYS, HoldItem, PeerHolds, local_holds
from meter.quotas.limits import Effective, LimitBook, PairLimits
from meter.quotas.methods import LimitMethods
from meter.quotas.shares import POOL, Shares
from meter.quotas.store import LimitsSync
from meter.wal import records as R
from meter.wal.log import WalError, WriteAheadLog
from meter.wal.replay import COMMITTED, RELEASED
from storage.base import EMPTY, Storage, StorageError

log = logging.getLogger("meter.service")

#: Longest ``track_many`` batch.
MAX_BATCH_ITEMS = 10_000
#: Most levels of a tenant name with the tenant hierarchy on (``a/b/c/d``).
MAX_LEVELS = 4
#: Writes a call waits for when strict shares keep running out under it (other calls take
#: the room each write makes) before it answers ``unavailable``.
MAX_ROOM_TRIES = 8

#: Most (tenant, feature) pairs whose current key is cached; the cache starts over when full.
#: (65,536 made track_many leave its fast path past that many active pairs: 2.5x per item.)
KEY_CACHE_SIZE = 262_144
#: Most names kept in one copy, per kind (tenants, features, periods); each starts over when full.
NAME_CACHE_SIZE = 262_144

_TRACK_OPTS = frozenset({"at", "id", "detail"})
_USAGE_OPTS = frozenset({"at"})
_RESERVE_OPTS = frozenset({"limit", "ttl_ms", "at", "id"})
_FINISH_OPTS = frozenset({"id"})
_ITEM_OPTS = frozenset({"id"})
#: Items per record when the state is restated in a checkpoint.
CHECKPOINT_ITEMS = 1000


#: At most one warning per this many seconds while holds are left out of the frame.
WARN_HOLDS_EVERY_S = 60.0


class Service:
    """The methods a node serves, over one table and one storage backend."""

    def __init__(
        self,
        table: CounterTable,
        storage: Storage,
        config: CounterConfig | None = None,
        *,
        status_extra: Callable[[], Mapping[str, Any]] | None = None,
        wal: WriteAheadLog | None = None,
        ids: RequestIds | None = None,
        limits_poll_s: float = 0.5,
    ) -> None:
        self.table = table
        self.storage = storage
        self.config = config or CounterConfig()
        self.reservations = Reservations()
        #: The write-ahead log every state change is appended to (``None``: durability off).
        self.wal = wal
        #: Request ids of calls that counted, with their first answers.
        self.ids = ids if ids is not None else RequestIds()
        #: Finished reservations (commit/release are idempotent by reservation id).
        self.done = RequestIds(self.ids.window_s, self.ids.max_ids)
        self.status_extra = status_extra
        #: Why state changes are refused now (another process owns this node's id), or None.
        self.fenced: str | None = None
        self.started_at = time.time()
        self.calls = 0
        #: ``track_many`` items refused (the call itself answered), by error code.
        self.item_refusals: dict[str, int] = {}
        #: Reads cold keys from storage in batches.
        self.seeder = Seeder(
            table, storage, chunk=storage.load_chunk, concurrency=storage.load_concurrency
        )
        #: Keys a restart is reading ahead (recovery's warm-up) and may not have loaded yet:
        #: checkpoints list them as warm until the warm-up ends.
        self.warming: list[Key] = []
        #: Live usage subscriptions (``subscribe``); ticked by the node's watch loop.
        self.watch = Watch(max_tenants=self.config.max_watched_tenants)
        self._periods: Mapping[str, PeriodKind] = self.config.feature_periods
        # Hot-path cache: (tenant, feature) -> its validated key in the current period. Valid
        # only within [_day_start, _day_end): the current UTC day, inside which neither a day
        # nor a month period changes. Validation and period building then happen once per
        # pair per day instead of once per call, and every row of a pair shares one key tuple.
        self._keys: dict[tuple[str, str], Key] = {}
        self._day_start = 0.0
        self._day_end = 0.0
        #: The current day's period of each kind, made once a day (see _new_day).
        self._day_periods: dict[PeriodKind, str] = {}
        # Names already validated, each the one copy every key made since shares: a name
        # decoded from a request is a new string each time, and a key keeps the strings of the
        # request that made it, so without these a million keys would hold a million copies
        # of a hundred feature names (and of each tenant's, and of the period). Bounded dicts,
        # not sys.intern: names come from clients, and interned strings are never freed on
        # 3.12 releases before the gh-113993 backport (August 2024) nor on free-threaded
        # builds. Not tied to the day: a name's validity never changes.
        self._tenants: dict[str, str] = {}
        self._features: dict[str, str] = {}
        self._period_names: dict[str, str] = {}
        #: The limits this node enforces (docs/quotas.md), kept current with storage.
        self.limits = LimitsSync(storage, self._new_limits, poll_s=limits_poll_s)
        # (tenant, feature) -> its effective limit: the hot path's one lookup, an empty dict
        # (false) while no limit exists anywhere.
        #: The limits per (tenant, feature); None while no pair has one (the fast test).
        self._limited: PairLimits | None = None
        #: ``acme/alice`` also counts on ``acme`` (ADR 0008).
        self._hier = self.config.tenant_hierarchy
        #: Whether any call may need more than a plain count (a limit exists, or the tenant
        #: hierarchy is on): the hot paths look at this one flag.
        self._gated = self._hier
        #: Units peers hold in open reservations (their ``holds`` frames): against limits.
        self.peer_holds = PeerHolds()
        #: Counters this node holds units on that its last ``holds`` frame left out (too many
        #: or too long for one frame), and when that was last logged.
        self.holds_left_out = 0
        self._holds_warned_at = -WARN_HOLDS_EVERY_S
        #: Calls refused by a hard limit, and soft limits crossed, since start.
        self.limit_refusals = 0
        self.soft_crossings = 0
        #: This node's shares of strict budgets (ADR 0009): strict limits admit from these.
        self.shares = Shares(
            storage,
            table.node,
            lease_ms=self.config.strict_lease_ms,
            share_max=self.config.strict_share_max,
        )
        self.shares.fenced = lambda: self.fenced  # (the node adds its ownership to this)
        #: Reservations whose units were admitted from a strict share (given back when they
        #: are released, expire or are committed for less).
        self._escrowed: set[str] = set()
        #: Threshold alerts (docs/quotas.md): detected here, claimed by the node's loop.
        self.alerts = Alerts(table.node, storage.claim_alert)
        #: Whether any limit has alert thresholds (the one test the counting paths make).
        self._alerting = False
        #: (tenant, feature) -> how the batched warm path checks it (see _warm_check).
        self._warm_checks: dict[tuple[str, str], Any] = {}
        #: Credits ledgers (docs/ledger.md): every call writes or reads storage.
        self.ledgers = LedgerBook(storage)
        #: Credit-metered features spend from pools funded by the ledgers (docs/ledger.md).
        self._funder = _LedgerFunder(self.ledgers)
        if self.config.balance_alerts:
            self.ledgers.on_entries = self._balance_entries
        self._methods: dict[str, Callable[[list[Any]], Any]] = {
            **LimitMethods(self.limits).handlers(),
            **LedgerMethods(self.ledgers).handlers(),
            **HistoryMethod(self).handlers(),
            "check": self._check,
            "track": self._track,
            "track_many": self._track_many,
            "usage": self._usage,
            "usage_all": self._usage_all,
            "reserve": self._reserve,
            "commit": self._commit,
            "release": self._release,
            "ping": self._ping,
            "status": self._status,
            "subscribe": self._subscribe,
            "unsubscribe": self._unsubscribe,
            "subscribe_alerts": self._subscribe_alerts,
            "unsubscribe_alerts": self._unsubscribe_alerts,
            "export": self._export,
        }

    # -- entry point ----------------------------------------------------------------------

    @property
    def methods(self) -> tuple[str, ...]:
        """The method names this service answers."""
        return tuple(self._methods)

    def _refused_item(self, code: str) -> None:
        self.item_refusals[code] = self.item_refusals.get(code, 0) + 1

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
        if not self._day_start <= now < self._day_end or self.fenced is not None:
            return []  # (fenced: dispatch answers each one unavailable)
        wal = self.wal
        if wal is not None and wal.broken is not None:
            return []  # dispatch answers each one unavailable
        cache = self._keys
        gated = self._gated
        items: list[tuple[Key, int]] = []
        # Credit-metered items with no other check ride along when their pool's share has
        # room for them all: (item index, pool, credits), admitted once counted.
        priced: list[tuple[int, Key, int]] = []
        needs: dict[Key, int] = {}
        checks = self._warm_checks
        shares_local = self.shares.local
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
            if gated:
                how = checks.get((tenant, feature), _UNKNOWN)
                if how is _UNKNOWN:
                    how = self._warm_check(key)
                if how is not None:
                    if how is False or qty <= 0:
                        break  # checked (limits, levels) by dispatch
                    pool, price = how
                    credits = price * qty
                    if credits > QTY_MAX:
                        break  # dispatch refuses it, clearly
                    need = needs.get(pool, 0) + credits
                    loc = shares_local.get(pool)
                    if loc is None or loc.limit != POOL or loc.a + need > loc.c:
                        break  # the pool needs a write first (or a clear refusal): dispatch
                    needs[pool] = need
                    priced.append((len(items), pool, credits))
            items.append((key, qty))
        if not items:
            return []
        values = self.table.incr_prefix(items)
        if priced:
            if len(values) < len(items):  # a prefix was counted: only its credits are spent
                needs = {}
                for n, pool, credits in priced:
                    if n < len(values):
                        needs[pool] = needs.get(pool, 0) + credits
            for pool, need in needs.items():
                self.shares.admit(pool, need)
        self.calls += len(values)
        if wal is not None and values:
            counted = items if len(values) == len(items) else items[: len(values)]
            wal.append([R.TRACK_MANY, [[*k, q] for k, q in counted]])
        return values

    def _warm_check(self, key: Key) -> Any:
        """How a plain warm track on ``key``'s pair is checked, remembered until the limits
        change: ``None`` (nothing to check), ``(pool, price)`` (its price only: the batched
        path charges the pool) or ``False`` (dispatch checks it)."""
        if not self._needs_check(key):
            how: Any = None
        else:
            credits = self._priced_only(key, 1)
            how = False if credits is None else (pool_key(key[0]), credits)
        checks = self._warm_checks
        if len(checks) >= NAME_CACHE_SIZE:
            checks.clear()
        checks[(key[0], key[1])] = how
        return how

    def _priced_only(self, key: Key, qty: int) -> int | None:
        """The credits a plain track of ``qty`` on ``key`` costs if its price is the only
        thing to check (no unit limit, alerts or levels), else ``None``."""
        limited = self._limited
        eff = limited.get((key[0], key[1])) if limited else None
        if (
            eff is None
            or not eff.price
            or qty <= 0
            or eff.limit != QTY_MAX
            or eff.alerts
            or eff.enforcement != "fast"
            or (self._hier and "/" in key[0])
        ):
            return None
        credits = eff.price * qty
        return credits if credits <= QTY_MAX else None  # (dispatch refuses it, clearly)

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
            t = self._tenants.get(tenant)
            if t is None:
                t = _one_copy(self._tenants, check_tenant(tenant))
            f = self._features.get(feature)
            if f is None:
                f = _one_copy(self._features, check_feature(feature))
            key = (t, f, self._day_periods[self._periods.get(f, "month")])
            if len(self._keys) >= KEY_CACHE_SIZE:
                self._keys.clear()
            self._keys[(t, f)] = key
            return key
        t = self._tenant(tenant)
        f = _one_copy(self._features, check_feature(feature))
        period = period_start(self._periods.get(f, "month"), at)
        return (t, f, _one_copy(self._period_names, period))

    def _tenant(self, tenant: object) -> str:
        """``tenant`` validated, as this node's one copy of the name."""
        if type(tenant) is str:
            t = self._tenants.get(tenant)
            if t is not None:
                return t
        return _one_copy(self._tenants, check_tenant(tenant))

    def current_keys(self, keys: Iterable[Key], limit: int) -> tuple[list[Key], int]:
        """The first ``limit`` keys of ``keys`` whose period is the current one for their
        feature, each made of this node's one copy of its names, and how many keys were passed
        over for a period that is not current (recovery's warm-up: names from the log were
        validated when their calls were accepted)."""
        now = time.time()
        if not self._day_start <= now < self._day_end:
            self._new_day(now)
        current = self._day_periods
        periods = self._periods
        tenants, features = self._tenants, self._features
        out: list[Key] = []
        skipped = 0
        for t, f, p in keys:
            if len(out) >= limit:
                break
            period = current[periods.get(f, "month")]
            if p != period:
                skipped += 1
                continue
            out.append(
                (tenants.get(t) or _one_copy(tenants, t), features.get(f) or _one_copy(features, f),
                 period)
            )  # fmt: skip
        return out, skipped

    def _new_day(self, now: float) -> None:
        """Start the key cache over for the UTC day containing ``now``."""
        self._keys.clear()
        self._day_start = now - now % 86400
        self._day_end = self._day_start + 86400
        names = self._period_names
        self._day_periods = {
            "month": _one_copy(names, period_start("month", now)),
            "day": _one_copy(names, period_start("day", now)),
        }

    async def seed(self, key: Key) -> bool:
        """Make ``key`` seeded from storage, read in a batch with every other cold key asked
        for meanwhile (:class:`~meter.persist.seeder.Seeder`).

        Returns False (and leaves the key unseeded) if storage cannot be read.
        """
        if self.table.is_seeded(key):
            return True
        return await self.seeder.seed(key)

    def read_ahead(self, kind: PeriodKind, now: float, keys: Iterable[Key]) -> int:
        """Queue reads of the next period's key of each of ``keys`` that is in the period of
        ``kind`` containing ``now`` (:mod:`meter.persist.rollover`); return how many were queued."""
        upcoming = period_start(kind, period_end(kind, now))
        _one_copy(self._period_names, upcoming)
        return self.seeder.prefetch(next_keys(keys, kind, now, self._periods, self._period_names))

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
            if self.fenced is not None:
                raise Unavailable(self.fenced)
            if self._gated and self._needs_check(key):
                self._check_log()
                return self._track_checked(key, qty, None, False)
            wal = self.wal
            if wal is None:
                value = self.table.try_incr(key, qty)
                if value is not None:
                    return value
                return self._track_cold(key, qty, None)
            if wal.broken is not None:
                raise _log_down(wal)
            value = self.table.try_incr(key, qty)
            if value is not None:
                wal.append([R.TRACK, key[0], key[1], key[2], qty])
                return value
            return self._track_cold(key, qty, None)
        tenant, feature, qty, opts = _args("track", params, 2, 4, (1, {}))
        o = _opts("track", opts, _TRACK_OPTS)
        at = o.get("at")
        rid = o.get("id")
        detail = o.get("detail", False)
        if type(detail) is not bool:
            raise InvalidArgument(f"track: detail must be true or false, got {detail!r:.32}")
        key = self.key_for(tenant, feature, None if at is None else check_at(at))
        qty = check_qty(qty)
        idem: tuple[str, int] | None = None
        if rid is not None:
            # The period is named by ``at`` only: a retry that crosses midnight or a month end
            # is still the same call (it answers as the first did).
            idem = (check_id(rid), fingerprint("track", key[0], key[1], qty, at))
            entry = self.ids.lookup(idem[0], idem[1], time.time())
            if entry is not None:
                # A retry: counts nothing, answers as the first call did.
                return self._detail(key, entry[1], 0) if detail else entry[1]
        self._check_log()
        if detail or (self._gated and self._needs_check(key)):
            return self._track_checked(key, qty, idem, detail)
        if self.table.is_seeded(key):
            return self._count(key, qty, idem)
        return self._track_cold(key, qty, idem)

    async def _track_cold(self, key: Key, qty: int, idem: tuple[str, int] | None) -> int | None:
        await self.seed(key)
        if idem is not None:
            # A call with the same id may have counted while this one waited.
            entry = self.ids.lookup(idem[0], idem[1], time.time())
            if entry is not None:
                return cast(int | None, entry[1])
        if self._gated and self._needs_check(key):  # a limit was set while the read waited
            value = await self._track_checked_cold(self._levels(key), qty, idem, False)
            return cast(int | None, value)
        self._check_log()
        # Counted whether or not seeding worked: usage is never dropped. An unseeded key
        # answers None, because its total is not known.
        return self._count(key, qty, idem)

    # -- limits (docs/quotas.md) --------------------------------------------------------------

    def _new_limits(self, book: LimitBook) -> None:
        self._warm_checks = {}  # decided again under the new limits
        self._limited = book.by_pair if book.by_pair else None
        self._gated = bool(book.by_pair) or self._hier
        self._alerting = book.alerting

    def _gate(self, key: Key, qty: int, eff: Effective | None) -> None:
        """Refuse (raise, nothing counted) ``qty`` more units on a seeded-or-not ``key`` that
        would take its view past a hard limit. Units taken away are never refused."""
        if eff is None or qty <= 0:
            return
        if eff.price and not self.shares.ready(pool_key(key[0]), _credits(eff, qty), POOL):
            raise _Short(pool_key(key[0]), eff.price * qty, eff, credits=True)
        if eff.kind != "hard":
            return
        if eff.enforcement == "strict":
            if not self.shares.ready(key, qty, eff.limit):
                raise _Short(key, qty, eff)
            return
        value = self.table.value(key)
        if value is None:
            raise Unavailable(
                f"{key[0]}/{key[1]}: the stored total is unknown (storage unreachable), so its "
                "hard limit cannot be checked; nothing counted"
            )
        elsewhere = self.peer_holds.total.get(key, 0) if self.peer_holds.total else 0
        if value + elsewhere + qty > eff.limit:
            self.limit_refusals += 1
            held = f" + {elsewhere} held by peers" if elsewhere else ""
            raise LimitExceeded(
                f"{key[0]}/{key[1]}: {value}{held} + {qty} would pass the hard limit "
                f"{eff.limit} ({eff.source}); nothing counted"
            )

    def _detail(self, key: Key, value: int | None, qty: int) -> dict[str, Any]:
        """The ``check`` map of ``key`` at ``value`` for ``qty`` more units (0: as it is)."""
        eff = self._limited.get((key[0], key[1])) if self._limited else None
        if eff is None:
            return {"allowed": True, "value": value, "limit": None, "remaining": None,
                    "kind": None, "source": None, "over": False, "tenant": key[0]}  # fmt: skip
        elsewhere = self.peer_holds.total.get(key, 0) if self.peer_holds.total else 0
        if eff.enforcement == "strict" and eff.kind == "hard":
            # Strict: this node's share decides (checked before the answer, see _check).
            over = qty > 0 and not self.shares.ready(key, qty, eff.limit)
        else:
            over = value is not None and value + elsewhere + qty > eff.limit
        allowed = not over or qty <= 0 or eff.kind == "soft"
        if value is None and eff.kind == "hard" and qty > 0:
            allowed = False  # the total is unknown: a track would be refused
        out = {
            "allowed": allowed,
            "value": value,
            "limit": eff.limit,
            "remaining": None if value is None else max(0, eff.limit - value - elsewhere),
            "kind": eff.kind,
            "source": eff.source,
            "over": over,
            "tenant": key[0],
        }
        if eff.price:  # credit-metered: the credits it costs, and whether they are there
            credits = _credits(eff, max(0, qty))
            out["credits"] = credits
            if credits and not self.shares.ready(pool_key(key[0]), credits, POOL):
                out["allowed"] = False
        return out

    def _needs_check(self, key: Key) -> bool:
        """Whether a count on ``key`` is checked against a limit or spread over levels."""
        limited = self._limited
        return bool(limited and (key[0], key[1]) in limited) or (self._hier and "/" in key[0])

    def _levels(self, key: Key) -> list[Key]:
        """``key`` and, with the tenant hierarchy on, the same counter of every ancestor of
        its tenant, leaf first: ``acme/alice`` -> ``[acme/alice, acme]``."""
        tenant = key[0]
        if not self._hier or "/" not in tenant:
            return [key]
        parts = tenant.split("/")
        if len(parts) > MAX_LEVELS:
            raise InvalidArgument(
                f"tenant {tenant[:64]!r} has {len(parts)} levels; at most {MAX_LEVELS}"
            )
        if "" in parts:
            raise InvalidArgument(f"tenant {tenant[:64]!r} has an empty level")
        names = self._tenants
        return [key] + [
            (_one_copy(names, "/".join(parts[:n])), key[1], key[2])
            for n in range(len(parts) - 1, 0, -1)
        ]

    def _levels_or_leaf(self, key: Key) -> list[Key]:
        try:
            return self._levels(key)
        except InvalidArgument:
            return [key]  # refused when counted

    def _track_checked(self, key: Key, qty: int, idem: tuple[str, int] | None, detail: bool) -> Any:
        keys = self._levels(key)
        if all(self.table.is_seeded(k) for k in keys):
            try:
                return self._count_checked(keys, qty, idem, detail)
            except _Short:
                pass  # a strict share needs more room: one storage write, below
        return self._track_checked_cold(keys, qty, idem, detail)

    async def _track_checked_cold(
        self, keys: list[Key], qty: int, idem: tuple[str, int] | None, detail: bool
    ) -> Any:
        # Every level is seeded before any is checked: a level's limit is checked against
        # its stored total, not against what this node happens to hold.
        await self.seeder.seed_many(keys)
        for _ in range(MAX_ROOM_TRIES):
            if idem is not None:
                entry = self.ids.lookup(idem[0], idem[1], time.time())
                if entry is not None:
                    return self._detail(keys[0], entry[1], 0) if detail else entry[1]
            self._check_log()
            try:
                return self._count_checked(keys, qty, idem, detail)
            except _Short as exc:
                short = exc
            # Not awaited inside the except block: compiled, the caught exception would stay
            # the thread's current one, and every later exception would chain onto it.
            await self._make_room(short)
        raise Unavailable(f"{keys[0][0]}/{keys[0][1]}: the strict share kept running out; retry")

    def _count_checked(
        self, keys: list[Key], qty: int, idem: tuple[str, int] | None, detail: bool
    ) -> Any:
        """Check every level, then count on every level (no await between: on one node
        they are one step); refused at any level means counted at none."""
        values, log_items = self._count_levels(keys, qty)
        value = values[0]
        if len(keys) == 1:
            self._log_track(keys[0], qty, idem, value)
        else:
            leaf = [*keys[0], qty]
            if idem is not None:
                expires = self.ids.remember(idem[0], idem[1], value, time.time())
                leaf += [idem[0], idem[1], value, expires]
            if self.wal is not None:  # one record: a torn log keeps all levels or none
                self.wal.append([R.TRACK_MANY, [leaf, *log_items]])
        return self._detail(keys[0], value, 0) if detail else value

    def _count_levels(self, keys: list[Key], qty: int) -> tuple[list[int | None], list[list[Any]]]:
        """Gate then count ``qty`` on each of ``keys``; the new values and the log items of
        the levels above the first. Raises (nothing counted anywhere) if a level refuses."""
        limited = self._limited
        effs = [limited.get((k[0], k[1])) if limited else None for k in keys]
        for k, eff in zip(keys, effs, strict=True):
            self._gate(k, qty, eff)
        values: list[int | None] = []
        try:
            for k in keys:
                values.append(self.table.incr(k, qty))
        except InvalidArgument:  # past the 64-bit range at some level: take back the others
            for k in keys[: len(values)]:
                self.table.incr(k, -qty, check=False)
            raise
        for k, eff, v in zip(keys, effs, values, strict=True):
            if eff is not None and eff.price and qty > 0:  # credit-metered: spend its credits
                self.shares.admit(pool_key(k[0]), eff.price * qty)
            if eff is not None and eff.enforcement == "strict" and qty > 0 and eff.kind == "hard":
                self.shares.admit(k, qty)
            elif _soft_crossing(eff, v, qty):
                self._crossed(k, eff, v)
        if self._alerting and qty > 0:
            for k, eff, v in zip(keys, effs, values, strict=True):
                if eff is not None and eff.alerts and v is not None:
                    self.alerts.detect(k, eff.limit, eff.alerts, v - qty, v)
        return values, [[*k, qty] for k in keys[1:]]

    def _balance_entries(self, tenant: str, entries: Sequence[ledger.Entry]) -> None:
        """Alert the balances a ledger write took ``tenant`` below (``balance_alerts``)."""
        for e in entries:
            before = e.balance_after - e.amount
            self.alerts.balance_entry(
                tenant, e.seq, before, e.balance_after, self.config.balance_alerts
            )

    def _crossed(self, key: Key, eff: Effective | None, value: int | None) -> None:
        self.soft_crossings += 1
        if eff is not None:
            log.info("soft limit crossed: %s/%s at %s > %d (%s)",
                     key[0], key[1], value, eff.limit, eff.source)  # fmt: skip

    def _check(self, params: list[Any]) -> Any:
        tenant, feature, qty, opts = _args("check", params, 2, 4, (1, {}))
        at = _opts("check", opts, _USAGE_OPTS).get("at")
        key = self.key_for(tenant, feature, None if at is None else check_at(at))
        qty = check_qty(qty)
        keys = self._levels(key)
        if all(self.table.is_seeded(k) for k in keys) and not self._strict_short(keys, qty):
            return self._check_levels(keys, qty)
        return self._check_cold(keys, qty)

    async def _check_cold(self, keys: list[Key], qty: int) -> dict[str, Any]:
        await self.seeder.seed_many(keys)
        if not all(self.table.is_seeded(k) for k in keys):
            raise Unavailable("storage is unreachable and this counter's total is not known")
        for short in self._strict_short(keys, qty):
            # Would a track be admitted? Only a share with room says yes: take one.
            with contextlib.suppress(LimitExceeded, InsufficientBalance):
                await self._make_room(short)
        return self._check_levels(keys, qty)

    def _strict_short(self, keys: list[Key], qty: int) -> list[_Short]:
        """The strict levels of ``keys`` whose share has no room for ``qty`` now."""
        limited = self._limited
        if not limited or qty <= 0:
            return []
        out = []
        for k in keys:
            eff = limited.get((k[0], k[1]))
            if eff is None:
                continue
            if eff.price and not self.shares.ready(pool_key(k[0]), _credits(eff, qty), POOL):
                out.append(_Short(pool_key(k[0]), eff.price * qty, eff, credits=True))
            if (
                eff.enforcement == "strict"
                and eff.kind == "hard"
                and not self.shares.ready(k, qty, eff.limit)
            ):
                out.append(_Short(k, qty, eff))
        return out

    async def _make_room(self, short: _Short, at_least: int | None = None) -> None:
        if short.credits:
            try:
                await self.shares.ensure_pool(short.key, short.qty, self._funder)
            except StorageError as exc:
                raise Unavailable(
                    f"{short.key[0]}: the credit pool cannot be read or written ({exc}); "
                    "nothing counted"
                ) from None
            return
        await self._make_strict_room(short, at_least)

    async def _make_strict_room(self, short: _Short, at_least: int | None = None) -> None:
        """One write (or a few, under contention) giving this node's share room for the
        units ``short`` asked for; ``limit_exceeded`` if the strict budget cannot cover them."""
        key, eff = short.key, short.eff
        value = self.table.value(key)
        if value is None:
            raise Unavailable(
                f"{key[0]}/{key[1]}: the stored total is unknown (storage unreachable), so its "
                "strict limit cannot be checked; nothing counted"
            )
        try:
            await self.shares.ensure(key, short.qty, eff.limit, max(0, value), at_least)
        except NoBudget as exc:
            self.limit_refusals += 1
            raise LimitExceeded(
                f"{key[0]}/{key[1]}: {short.qty} more would pass the strict limit {eff.limit} "
                f"({eff.source}): {exc}; nothing counted"
            ) from None
        except StorageError as failed:
            raise Unavailable(
                f"{key[0]}/{key[1]}: the strict budget cannot be read or written ({failed}); "
                "nothing counted"
            ) from None

    def _check_levels(self, keys: list[Key], qty: int) -> dict[str, Any]:
        """The leaf's map, or (with the hierarchy) that of the first level that would refuse."""
        details = [self._detail(k, self.table.value(k), qty) for k in keys]
        return next((d for d in details if not d["allowed"]), details[0])

    def _count(self, key: Key, qty: int, idem: tuple[str, int] | None) -> int | None:
        """Count one track, remember its id, and log it."""
        return self._log_track(key, qty, idem, self.table.incr(key, qty))

    def _log_track(
        self, key: Key, qty: int, idem: tuple[str, int] | None, value: int | None
    ) -> int | None:
        """Remember the id of a track just counted and log it."""
        if idem is None:
            if self.wal is not None:
                self.wal.append([R.TRACK, key[0], key[1], key[2], qty])
            return value
        expires = self.ids.remember(idem[0], idem[1], value, time.time())
        if self.wal is not None:
            self.wal.append([R.TRACK_ID, *key, qty, idem[0], idem[1], value, expires])
        return value

    def _check_log(self) -> None:
        """Refuse a state change the log could not hold, or that this node may not make
        because another process owns its id (raise before counting)."""
        wal = self.wal
        if wal is not None and wal.broken is not None:
            raise _log_down(wal)
        if self.fenced is not None:
            raise Unavailable(self.fenced)

    def _track_many(self, params: list[Any]) -> Any:
        (items,) = _args("track_many", params, 1, 1, ())
        if not isinstance(items, list):
            raise InvalidArgument("track_many: items must be an array of [tenant, feature, qty]")
        if len(items) > MAX_BATCH_ITEMS:
            raise InvalidArgument(f"track_many: at most {MAX_BATCH_ITEMS} items per call")
        now = time.time()
        # The key cache answers for the whole batch if it is valid now (see key_for).
        cache = self._keys if self._day_start <= now < self._day_end else {}
        gated = self._gated
        if cache:
            # The common batch: every item a plain [str, str, int] on a known name pair and a
            # seeded key. One pass builds it; anything else takes the general path below.
            fast: list[tuple[Key, int]] = []
            for item in items:
                if type(item) is not list or len(item) != 3:
                    break
                tenant, feature, qty = item
                if type(tenant) is not str or type(feature) is not str or type(qty) is not int:
                    break
                key = cache.get((tenant, feature))
                if key is None or not QTY_MIN <= qty <= QTY_MAX:
                    break
                if gated and self._needs_check(key):
                    break  # checked item by item below
                fast.append((key, qty))
            else:
                self._check_log()
                try:
                    values = self.table.incr_seeded(fast)
                except PartlyRefused as refused:  # items past the 64-bit range: not counted
                    return self._finish_refused(fast, refused.answers)
                if values is not None:
                    if self.wal is not None and fast:
                        self.wal.append([R.TRACK_MANY, [[*k, q] for k, q in fast]])
                    return values
        batch = _Batch()
        out = batch.out
        for i, item in enumerate(items):
            try:
                if (type(item) is list or isinstance(item, list | tuple)) and 3 <= len(item) <= 4:
                    tenant, feature, qty = item[0], item[1], item[2]
                else:
                    raise InvalidArgument(
                        "item must be [tenant, feature, qty] or [tenant, feature, qty, {id}]"
                    )
                key = (
                    cache.get((tenant, feature))
                    if type(tenant) is str and type(feature) is str
                    else None
                )
                if key is None:
                    key = self.key_for(tenant, feature)
                if type(qty) is not int or not QTY_MIN <= qty <= QTY_MAX:
                    qty = check_qty(qty)
                idem: tuple[str, int] | None = None
                if len(item) == 4:
                    rid = _opts("track_many item", item[3], _ITEM_OPTS).get("id")
                    if rid is not None:
                        idem = (check_id(rid), fingerprint("track", key[0], key[1], qty, None))
                        if batch.repeat(i, idem):
                            continue
                        entry = self.ids.lookup(idem[0], idem[1], now)
                        if entry is not None:
                            out.append(entry[1])  # a retry: counts nothing
                            continue
            except MeterError as exc:
                out.append(exc.to_wire())
                self._refused_item(exc.code)
                continue
            batch.add(i, key, qty, idem)
        if batch.good:
            self._check_log()
        if gated and any(self._needs_check(k) for k, _ in batch.good):
            return self._track_many_limited(batch)
        # All warm: every item is counted under one hold of the table's lock. Otherwise nothing
        # is counted until the cold keys are seeded, so a batch cut short (a draining node
        # cancels it, a read fails unexpectedly) has counted nothing and its error answer is
        # true: a client retrying it counts nothing twice.
        done = self._count_seeded(batch)
        return self._track_many_cold(batch) if done is None else done

    def _count_seeded(self, batch: _Batch) -> Any | None:
        """Count the whole batch under one hold of the table's lock and answer it, or ``None``
        (nothing counted) if a key is cold or unseeded."""
        try:
            values = self.table.incr_seeded(batch.good)
        except PartlyRefused as refused:
            return self._finish_many(batch, refused.answers)
        return None if values is None else self._finish_many(batch, values)

    def _answer_repeated_ids(self, batch: _Batch) -> None:
        """After a wait: items whose ids calls counted meanwhile are answered as those were
        (a conflicting id answers its error alone, uncounted)."""
        now = time.time()
        for n, idem in enumerate(batch.idems):
            if idem is not None:
                try:
                    entry = self.ids.lookup(idem[0], idem[1], now)
                except Conflict as exc:
                    entry = (0, exc.to_wire(), 0.0)
                    self._refused_item(exc.code)
                if entry is not None:
                    batch.answered[n] = entry
        self._check_log()

    async def _track_many_cold(self, batch: _Batch) -> Any:
        await self.seeder.seed_many(k for k, _ in batch.good)
        # Calls with the same ids may have counted while this one waited: answer those items
        # as they were answered, and count the rest.
        self._answer_repeated_ids(batch)
        if self._gated and any(self._needs_check(k) for k, _ in batch.good):
            # A limit was set while the read waited: check item by item (an unseeded key
            # under a hard limit is refused, as it would have been had the limit come first).
            return self._count_gated(batch)
        if not batch.answered:
            # Every key seeded (the usual case): the whole batch under one hold of the lock.
            done = self._count_seeded(batch)
            if done is not None:
                return done
        # Counted whether or not seeding worked, as track does: unseeded keys answer nil. An
        # item past the 64-bit range is refused alone; the others are counted.
        values: list[Any] = []
        for n, (key, qty) in enumerate(batch.good):
            entry = batch.answered.get(n)
            if entry is not None:
                values.append(entry[1])
                continue
            try:
                values.append(self.table.incr(key, qty))
            except InvalidArgument as exc:
                values.append(exc)
        return self._finish_many(batch, values)

    def _track_many_limited(self, batch: _Batch) -> Any:
        """A batch with items under a limit: each item checked and counted in turn (an item
        over a hard limit fails alone, counting nothing), once every key is seeded."""
        keys = [level for k, _ in batch.good for level in self._levels_or_leaf(k)]
        if all(self.table.is_seeded(k) for k in keys) and not self._batch_short(batch):
            return self._count_gated(batch)
        return self._track_many_limited_cold(batch, keys)

    async def _track_many_limited_cold(self, batch: _Batch, keys: list[Key]) -> Any:
        await self.seeder.seed_many(keys)
        for _ in range(3):  # strict shares, credit pools: room for every item first
            shorts = self._batch_short(batch)
            if not shorts:
                break
            for short, smallest in shorts:
                try:  # room for every item, or for as many as are left (the smallest at least)
                    await self._make_room(short, smallest)
                except MeterError:
                    break  # none left, or storage: the items that find no room are refused
        self._answer_repeated_ids(batch)
        return self._count_gated(batch)

    def _batch_short(self, batch: _Batch) -> list[tuple[_Short, int]]:
        """Per strict level whose share cannot take every item of ``batch`` on it: what it
        needs (the items' sum) and the smallest item."""
        if not self._limited:
            return []
        sums: dict[Key, list[int]] = {}
        for key, qty in batch.good:
            if qty > 0:
                for k in self._levels_or_leaf(key):
                    acc = sums.get(k)
                    if acc is None:
                        sums[k] = [qty, qty]
                    else:
                        acc[0] += qty
                        acc[1] = min(acc[1], qty)
        out: list[tuple[_Short, int]] = []
        pools: dict[Key, list[Any]] = {}  # every priced feature of a tenant: one pool
        limited = self._limited
        for k, (total, smallest) in sums.items():
            for short in self._strict_short([k], total):
                if not short.credits:
                    out.append((short, smallest))
            eff = limited.get((k[0], k[1]))
            if eff is not None and eff.price:
                # (its own name: mypyc would check its items as ``sums``' ints)
                entry: list[Any] = pools.setdefault(pool_key(k[0]), [0, None, eff])
                entry[0] = min(entry[0] + eff.price * total, QTY_MAX)  # (past it: fail alone)
                cost = min(eff.price * smallest, QTY_MAX)
                entry[1] = cost if entry[1] is None else min(entry[1], cost)
        for pool, (need, smallest, eff) in pools.items():
            if not self.shares.ready(pool, need, POOL):
                out.append((_Short(pool, need, eff, credits=True), smallest))
        return out

    def _count_gated(self, batch: _Batch) -> list[Any]:
        values: list[Any] = []
        above: list[list[Any]] = []  # log items of the levels above the items counted
        for n, (key, qty) in enumerate(batch.good):
            entry = batch.answered.get(n)
            if entry is not None:
                values.append(entry[1])
                continue
            try:
                counted, items = self._count_levels(self._levels(key), qty)
            except MeterError as exc:  # over a hard limit, past the 64-bit range, too deep
                values.append(exc)
                continue
            except _Short as short:  # its strict share (or credit pool) had no room left for it
                if short.credits:
                    values.append(
                        InsufficientBalance(
                            f"{short.key[0]}: {short.qty} credits needed, not available; "
                            "nothing counted"
                        )
                    )
                    continue
                self.limit_refusals += 1
                values.append(
                    LimitExceeded(
                        f"{short.key[0]}/{short.key[1]}: {qty} more would pass the strict limit "
                        f"{short.eff.limit} ({short.eff.source}); nothing counted"
                    )
                )
                continue
            values.append(counted[0])
            above += items
        return self._finish_many(batch, values, above)

    def _finish_refused(self, items: list[tuple[Key, int]], answers: list[Any]) -> list[Any]:
        """The answers of a fast-path batch some of whose items were refused (not counted)."""
        counted = [[*k, q] for (k, q), a in zip(items, answers, strict=True) if type(a) is int]
        if self.wal is not None and counted:
            self.wal.append([R.TRACK_MANY, counted])
        for a in answers:
            if isinstance(a, MeterError):
                self._refused_item(a.code)
        return [a.to_wire() if isinstance(a, MeterError) else a for a in answers]

    def _finish_many(
        self, batch: _Batch, values: list[Any], above: list[list[Any]] | None = None
    ) -> list[Any]:
        """Fill a batch's answers, remember its ids and log what it counted (items refused
        by the range check carry their error instead of a value: not remembered, not logged),
        with ``above`` (the upper levels' counts) in the same record."""
        out = batch.out
        now = time.time()
        logged: list[list[Any]] = [] if above is None else above
        for n, ((key, qty), idem, value) in enumerate(
            zip(batch.good, batch.idems, values, strict=True)
        ):
            if isinstance(value, MeterError):
                out[batch.where[n]] = values[n] = value.to_wire()
                self._refused_item(value.code)
                continue
            out[batch.where[n]] = value
            if n in batch.answered:
                continue
            if idem is None:
                logged.append([*key, qty])
            else:
                expires = self.ids.remember(idem[0], idem[1], value, now)
                logged.append([*key, qty, idem[0], idem[1], value, expires])
        for i, n in batch.dups:
            out[i] = values[n]
        if self.wal is not None and logged:
            self.wal.append([R.TRACK_MANY, logged])
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
        tenant = self._tenant(tenant)
        periods = [
            (kind, _one_copy(self._period_names, period_start(kind, at_f)))
            for kind in sorted(self._kinds())
        ]
        # The counters loaded now are answered as they are now, as this request arrives, so
        # requests pipelined after it (counted before its listing returns) are not in it.
        known: dict[str, int] = {}
        for kind, period in periods:
            for feature, value in self.table.all_for(tenant, period).items():
                if self._periods.get(feature, "month") == kind:
                    known[feature] = value
        wal = self.wal
        # What ``known`` shows may be in a log batch not committed yet: answer once it is.
        pending_log = wal is not None and wal.dirty
        return self._usage_all_async(tenant, periods, known, pending_log)

    def _kinds(self) -> set[PeriodKind]:
        return {"month", *self._periods.values()}

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
                raise _log_down(self.wal) from None
        out = dict(known)
        features = self._features
        for kind, period in periods:
            for _ in range(3):
                epoch = self.table.epoch
                try:
                    stored = await self.storage.list_period(tenant, period)
                except StorageError as exc:
                    raise Unavailable(f"storage is unreachable: {exc}") from None
                # The listing is a fresh read of every counter of the tenant in the period:
                # it seeds the listed ones and, with nothing stored, the ones this node
                # counted while storage could not be read (they are not listed).
                snaps = dict(stored)
                for feature in self.table.unseeded_features(tenant, period):
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
            for feature, value in self.table.all_for(tenant, period).items():
                if feature not in out and self._periods.get(feature, "month") == kind:
                    out[feature] = value
        return out

    def _reserve(self, params: list[Any]) -> Any:
        tenant, feature, qty, opts = _args("reserve", params, 3, 4, ({},))
        o = _opts("reserve", opts, _RESERVE_OPTS)
        at = o.get("at")
        key = self.key_for(tenant, feature, None if at is None else check_at(at))
        qty = check_qty(qty, allow_negative=False)
        if self._hier and "/" in key[0]:
            raise InvalidArgument(
                "reserve on a tenant below an account (a name with '/') is not supported with "
                "tenant_hierarchy yet: reserve on the account, or track"
            )
        limit = o.get("limit")
        if limit is not None:
            limit = check_qty(limit, what="limit", allow_negative=False)
        ttl_ms = o.get("ttl_ms", self.config.reservation_ttl_ms)
        ttl_ms = check_qty(ttl_ms, what="ttl_ms", allow_negative=False)
        if not 1 <= ttl_ms <= self.config.max_reservation_ttl_ms:
            raise InvalidArgument(f"ttl_ms must be 1..{self.config.max_reservation_ttl_ms}")
        idem: tuple[str, int] | None = None
        rid = o.get("id")
        if rid is not None:
            idem = (check_id(rid), fingerprint("reserve", key[0], key[1], qty, limit, ttl_ms, at))
            entry = self.ids.lookup(idem[0], idem[1], time.time())
            if entry is not None:
                return entry[1]
        self._check_log()
        if self.table.is_seeded(key):
            try:
                return self._reserve_now(key, qty, limit, ttl_ms, idem)
            except _Short:
                pass  # the strict share needs room first: _reserve_cold makes it
        return self._reserve_cold(key, qty, limit, ttl_ms, idem)

    async def _reserve_cold(
        self, key: Key, qty: int, limit: int | None, ttl_ms: int, idem: tuple[str, int] | None
    ) -> str:
        await self.seed(key)
        for _ in range(MAX_ROOM_TRIES):
            if idem is not None:
                entry = self.ids.lookup(idem[0], idem[1], time.time())
                if entry is not None:
                    return cast(str, entry[1])
            self._check_log()
            try:
                return self._reserve_now(key, qty, limit, ttl_ms, idem)
            except _Short as exc:
                short = exc
            await self._make_room(short)  # (not in the except block: see _track_checked_cold)
        raise Unavailable(f"{key[0]}/{key[1]}: the strict share kept running out; retry")

    def _reserve_now(
        self, key: Key, qty: int, limit: int | None, ttl_ms: int, idem: tuple[str, int] | None
    ) -> str:
        eff = self._limited.get((key[0], key[1])) if self._limited else None
        if eff is not None and eff.price:
            raise InvalidArgument(
                f"reserve on a credit-metered feature ({key[0]}/{key[1]} costs {eff.price} "
                "credits a unit) is not supported yet: track it"
            )
        strict = eff is not None and eff.kind == "hard" and eff.enforcement == "strict"
        if strict:
            assert eff is not None
            self._gate(key, qty, eff)  # raises _Short without room in this node's share
        elif eff is not None and eff.kind == "hard":
            # The tighter of the call's own limit and the tenant's hard limit applies.
            limit = eff.limit if limit is None else min(limit, eff.limit)
        elsewhere = self.peer_holds.total.get(key, 0) if self.peer_holds.total else 0
        value = self.table.value(key)
        if (
            limit is not None
            and elsewhere
            and value is not None
            and (value + elsewhere + qty > limit)
        ):
            self.limit_refusals += 1
            raise LimitExceeded(
                f"{key[0]}/{key[1]}: {value} + {elsewhere} held by peers + {qty} would pass "
                f"the limit {limit}"
            )
        try:
            held = self.table.reserve(key, qty, limit)
        except LimitExceeded:
            self.limit_refusals += 1
            raise
        if self._alerting and eff is not None and eff.alerts and held is not None:
            self.alerts.detect(key, eff.limit, eff.alerts, held - qty, held)
        lease = self.reservations.open(key, qty, time.monotonic() + ttl_ms / 1000)
        if strict and qty > 0:
            self.shares.hold(key, qty)
            self._escrowed.add(lease.id)
        now = time.time()
        rid = fp = expires = None
        if idem is not None:
            rid, fp = idem
            expires = self.ids.remember(rid, fp, lease.id, now)
        if self.wal is not None:
            deadline = now + ttl_ms / 1000
            self.wal.append([R.RESERVE, lease.id, *key, qty, deadline, rid, fp, expires])
        return lease.id

    def _commit(self, params: list[Any]) -> Any:
        lease_id, actual, opts = _args("commit", params, 1, 3, (None, {}))
        lease_id = _reservation_id(lease_id)
        if actual is not None:
            actual = check_qty(actual, what="actual_qty", allow_negative=False)
        now = time.time()
        idem = self._finish_id("commit", opts, lease_id, actual, now)
        if isinstance(idem, _Answer):
            return idem.value
        lease = self.reservations.get(lease_id)
        if lease is None:
            done = self.done.get(lease_id)
            if done is not None and done[2] > now:
                if done[0] == COMMITTED and (actual is None or actual == done[1][0]):
                    return done[1][1]  # a repeated commit answers as the first did
                what = "committed" if done[0] == COMMITTED else "released"
                raise Conflict(f"reservation {lease_id!r} was already {what} differently")
            raise NotFound(f"reservation {lease_id!r} is unknown or expired")
        self._check_log()
        if actual is None:
            actual = lease.qty
        if actual > lease.qty:
            try:
                self._gate_commit(lease, actual)
            except _Short as short:
                return self._commit_after_room(short, params)
        # First the table, which may refuse (past the 64-bit range) with nothing changed.
        value = self.table.commit(lease.key, lease.qty, actual)
        self._settle_escrow(lease, actual)
        if actual > lease.qty and self._limited:  # the extra units may cross a soft limit
            key = lease.key
            eff = self._limited.get((key[0], key[1]))
            view = self.table.value(key)
            if _soft_crossing(eff, view, actual - lease.qty):
                self._crossed(key, eff, view)
            if self._alerting and eff is not None and eff.alerts and view is not None:
                self.alerts.detect(key, eff.limit, eff.alerts, view - actual + lease.qty, view)
        self.reservations.close(lease_id)
        done_exp = self.done.remember(lease_id, COMMITTED, [actual, value], now)
        rid, fp, expires = self._remember_finish(idem, value, now)
        if self.wal is not None:
            self.wal.append(
                [R.COMMIT, lease_id, *lease.key, lease.qty, _wall(lease.deadline), actual,
                 value, done_exp, rid, fp, expires]
            )  # fmt: skip
        return value

    async def _commit_after_room(self, short: _Short, params: list[Any]) -> Any:
        """A commit above its reservation whose extra units need room in the strict share
        first: make it, then commit as if called now (the reservation may have ended)."""
        for _ in range(MAX_ROOM_TRIES):
            await self._make_room(short)
            answer = self._commit(params)
            if not isinstance(answer, Awaitable):
                return answer
            answer.close()  # type: ignore[attr-defined]  # the share ran out again
        raise Unavailable("commit: the strict share kept running out; retry")

    def _settle_escrow(self, lease: Lease, actual: int | None) -> None:
        """Move a finished reservation's units in this node's strict share: units not used
        go back to it (``actual`` None: released or expired), extra units were admitted by
        :meth:`_gate_commit`."""
        key = lease.key
        if lease.id in self._escrowed:
            self._escrowed.discard(lease.id)
            unused = lease.qty if actual is None else max(0, lease.qty - actual)
            self.shares.settle(key, lease.qty, unused)
        if actual is not None and actual > lease.qty and self._limited:
            eff = self._limited.get((key[0], key[1]))
            if eff is not None and eff.price:  # (checked by _gate_commit, as the strict share)
                self.shares.admit(pool_key(key[0]), eff.price * (actual - lease.qty))
            if eff is not None and eff.kind == "hard" and eff.enforcement == "strict":
                self.shares.admit(key, actual - lease.qty)

    def _gate_commit(self, lease: Lease, actual: int) -> None:
        """Refuse a commit above its reservation whose extra units would pass a hard limit;
        the reservation still holds (commit at most what fits, or release it)."""
        key = lease.key
        eff = self._limited.get((key[0], key[1])) if self._limited else None
        try:
            self._gate(key, actual - lease.qty, eff)
        except LimitExceeded:
            raise LimitExceeded(
                f"{key[0]}/{key[1]}: committing {actual} units on a reservation of {lease.qty} "
                f"would pass the hard limit {eff.limit if eff else 0}; nothing changed, the "
                "reservation still holds"
            ) from None

    def _release(self, params: list[Any]) -> None:
        lease_id, opts = _args("release", params, 1, 2, ({},))
        lease_id = _reservation_id(lease_id)
        now = time.time()
        idem = self._finish_id("release", opts, lease_id, None, now)
        if isinstance(idem, _Answer):
            return None
        lease = self.reservations.get(lease_id)
        if lease is None:
            done = self.done.get(lease_id)
            if done is not None and done[2] > now:
                if done[0] == RELEASED:
                    return None
                raise Conflict(f"reservation {lease_id!r} was already committed")
            raise NotFound(f"reservation {lease_id!r} is unknown or expired")
        self._check_log()
        self.reservations.close(lease_id)
        self.table.release(lease.key, lease.qty)
        self._settle_escrow(lease, None)
        done_exp = self.done.remember(lease_id, RELEASED, None, now)
        rid, fp, expires = self._remember_finish(idem, None, now)
        if self.wal is not None:
            self.wal.append(
                [R.RELEASE, lease_id, *lease.key, lease.qty, _wall(lease.deadline), done_exp,
                 rid, fp, expires]
            )  # fmt: skip
        return None

    def _finish_id(
        self, method: str, opts: Any, lease_id: str, actual: int | None, now: float
    ) -> tuple[str, int] | _Answer | None:
        """A commit/release request id: ``None``, the (id, fingerprint) to remember, or the
        remembered answer of a retry."""
        rid = _opts(method, opts, _FINISH_OPTS).get("id")
        if rid is None:
            return None
        idem = (check_id(rid), fingerprint(method, lease_id, actual))
        entry = self.ids.lookup(idem[0], idem[1], now)
        if entry is not None:
            return _Answer(entry[1])
        return idem

    def _remember_finish(
        self, idem: tuple[str, int] | None, value: Any, now: float
    ) -> tuple[str | None, int | None, float | None]:
        if idem is None:
            return None, None, None
        return idem[0], idem[1], self.ids.remember(idem[0], idem[1], value, now)

    def local_holds(self) -> list[HoldItem]:
        """The units this node's open reservations hold, per counter (its ``holds`` frame),
        bounded in counters and bytes; what is left out is logged (once a minute at most)."""
        items, left_out = local_holds(self.reservations.held())
        self.holds_left_out = left_out
        if left_out:
            now = time.monotonic()
            if now - self._holds_warned_at >= WARN_HOLDS_EVERY_S:
                self._holds_warned_at = now
                log.warning("holds: %d counters held on are not announced to peers (one frame "
                            "carries at most %d counters, %d bytes; the most held go first)",
                            left_out, MAX_HOLD_KEYS, MAX_HOLD_BYTES)  # fmt: skip
        return items

    def expire_reservations(self, now: float | None = None) -> int:
        """Release every reservation past its deadline; return how many."""
        leases = self.reservations.expire(time.monotonic() if now is None else now)
        for lease in leases:
            self.table.release(lease.key, lease.qty)
            self._settle_escrow(lease, None)
        return len(leases)

    # -- the write-ahead log ----------------------------------------------------------------

    def undo(self, records: list[list[Any]]) -> None:
        """Take back the effects of records whose log write failed (newest first)."""
        for rec in records[::-1]:
            kind = rec[0]
            if kind == R.TRACK or kind == R.TRACK_ID:
                self._undo_track(rec, 1)
            elif kind == R.TRACK_MANY:
                for item in rec[1][::-1]:
                    self._undo_track(item, 0)
            elif kind == R.RESERVE:
                lease_id, t, f, p, qty = rec[1:6]
                if self.reservations.get(lease_id) is not None:
                    self.reservations.close(lease_id)
                    self.table.release((t, f, p), qty)
                    if lease_id in self._escrowed:  # its share's units stay spoken for
                        self._escrowed.discard(lease_id)
                        self.shares.settle((t, f, p), qty, 0)
                if rec[7] is not None:
                    self.ids.forget(rec[7])
            elif kind == R.COMMIT or kind == R.RELEASE:
                lease_id, t, f, p, qty, deadline = rec[1:7]
                key = (t, f, p)
                # Units a strict share got back are spoken for again (never fewer than used).
                back = qty if kind == R.RELEASE else max(0, qty - (rec[7] or 0))
                if self.shares.readmit(key, back, qty):
                    self._escrowed.add(lease_id)
                if kind == R.COMMIT and rec[7]:
                    self.table.incr(key, -rec[7], check=False)
                self.table.reserve(key, qty, None, check=False)
                self.reservations.open_again(Lease(lease_id, key, qty, _mono(deadline)))
                self.done.forget(lease_id)
                rid = rec[10] if kind == R.COMMIT else rec[8]
                if rid is not None:
                    self.ids.forget(rid)

    def _undo_track(self, rec: list[Any], at: int) -> None:
        t, f, p, qty = rec[at : at + 4]
        if qty:
            self.table.incr((t, f, p), -qty, check=False)
        if len(rec) > at + 4:
            self.ids.forget(rec[at + 4])

    def checkpoint(self) -> Iterator[list[Any]]:
        """Records restating everything the log must keep, then the warm keys (``WARM``: a
        hint for the next start's warm-up, not state).

        What to restate is listed now (every key with unstored units, every lease and id, every
        warm key); each record is read when it is yielded, so it holds the state as it is then.
        """
        keys = self.table.unstored_keys()
        leases = [lease.id for lease in self.reservations.held()]
        ids = (self.ids.ids(), self.done.ids())
        # The warm keys as they are now (a copy of the table's key list); read a chunk at a time.
        warm = self.table.keys() if self.config.warm_up_max_keys > 0 else []
        return self._restate(keys, leases, ids, self.warming, warm)

    def _restate(
        self,
        keys: list[Key],
        leases: list[str],
        ids: tuple[list[str], list[str]],
        warming: list[Key],
        warm: list[Key],
    ) -> Iterator[list[Any]]:
        for start in range(0, len(keys), CHECKPOINT_ITEMS):
            state = self.table.unstored_state(keys[start : start + CHECKPOINT_ITEMS])
            yield [R.STATE, [[*k, seq, inflight, pending] for k, seq, inflight, pending in state]]
        for start in range(0, len(leases), CHECKPOINT_ITEMS):
            items = []
            for lease_id in leases[start : start + CHECKPOINT_ITEMS]:
                lease = self.reservations.get(lease_id)
                if lease is not None:
                    items.append([lease.id, *lease.key, lease.qty, _wall(lease.deadline)])
            if items:
                yield [R.LEASES, items]
        for kind, registry, listed in ((R.IDS, self.ids, ids[0]), (R.DONE, self.done, ids[1])):
            for start in range(0, len(listed), CHECKPOINT_ITEMS):
                now = time.time()
                items = []
                for rid in listed[start : start + CHECKPOINT_ITEMS]:
                    entry = registry.get(rid)
                    if entry is not None and entry[2] > now:
                        items.append([rid, *entry])
                if items:
                    yield [kind, items]
        yield from self._warm_records(warming, warm)

    def _warm_records(self, warming: list[Key], warm: list[Key]) -> Iterator[list[Any]]:
        """``WARM`` records: the keys a warm-up is still reading ahead, then the table's keys
        used since the last eviction pass, then its other keys; only keys of a current
        period, at most ``warm_up_max_keys`` of them. Read a chunk at a time, like the rest
        of a checkpoint (a key evicted meanwhile is left out)."""
        left = self.config.warm_up_max_keys
        if left <= 0:
            return
        now = time.time()
        current = {kind: period_start(kind, now) for kind in ("month", "day")}
        periods = self._periods
        already = set(warming) if warming and warm else None
        recently_used = self.table.recently_used
        for source, used in ((warming, None), (warm, True), (warm, False)):
            for start in range(0, len(source), CHECKPOINT_ITEMS):
                chunk = source[start : start + CHECKPOINT_ITEMS]
                if used is not None:
                    flags = recently_used(chunk)
                    chunk = [k for k, u in zip(chunk, flags, strict=True) if u is used]
                    if already is not None:
                        chunk = [k for k in chunk if k not in already]
                items = [[*k] for k in chunk if k[2] == current[periods.get(k[1], "month")]]
                if not items:
                    continue
                if len(items) >= left:
                    yield [R.WARM, items[:left]]
                    return
                left -= len(items)
                yield [R.WARM, items]

    # -- live usage push ---------------------------------------------------------------------

    def _subscribe(self, params: list[Any]) -> Bind:
        tenant, features = _args("subscribe", params, 1, 2, (None,))
        tenant = self._tenant(tenant)
        named = check_features(features)
        if named is not None:
            named = frozenset(_one_copy(self._features, f) for f in named)
        return Bind(lambda sub: self._subscribe_for(sub, tenant, named))

    def _subscribe_for(self, sub: Subscriber, tenant: str, features: frozenset[str] | None) -> Any:
        # Named counters are loaded first: gossip is applied to loaded counters only, so a
        # counter this node never loaded would never change here.
        keys = [self.key_for(tenant, f) for f in features or ()]
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
        return [[tenant, f, v, p] for (f, p), v in now.items() if features is None or f in features]

    def _unsubscribe(self, params: list[Any]) -> Bind:
        (tenant,) = _args("unsubscribe", params, 1, 1, ())
        tenant = self._tenant(tenant)
        return Bind(lambda sub: self.watch.unsubscribe(sub, tenant))

    def _subscribe_alerts(self, params: list[Any]) -> Bind:
        _args("subscribe_alerts", params, 0, 0, ())
        return Bind(self.watch.subscribe_alerts)

    def _unsubscribe_alerts(self, params: list[Any]) -> Bind:
        _args("unsubscribe_alerts", params, 0, 0, ())
        return Bind(self.watch.unsubscribe_alerts)

    def peer_deltas(self, deltas: Iterable[tuple[str, str, str, int, int]]) -> None:
        """A peer's gossip deltas were applied: detect the threshold crossings they caused
        (the view before a frame is taken as the view after it less the frame's units)."""
        limited = self._limited
        if not self._alerting or limited is None:
            return
        sums: dict[Key, int] = {}
        for t, f, p, _, delta in deltas:
            eff = limited.get((t, f))
            if eff is not None and eff.alerts and delta > 0:
                key = (t, f, p)
                sums[key] = sums.get(key, 0) + delta
        for key, units in sums.items():
            eff = limited.get((key[0], key[1]))
            value = self.table.value(key)
            if eff is not None and value is not None:
                self.alerts.detect(key, eff.limit, eff.alerts, value - units, value)

    def watch_view(self, tenant: str, features: frozenset[str] | None) -> View:
        """``tenant``'s loaded counters of the current periods, as ``usage`` answers them (holds
        included); the watched ones (``features``, ``None``: all) are marked used so they stay
        loaded, the others may be evicted as if nobody watched."""
        names = self._period_names
        periods = [(k, _one_copy(names, period_start(k, None))) for k in sorted(self._kinds())]
        kinds = self._periods
        use: bool | frozenset[str] = True if features is None else features
        return views(
            tenant,
            periods,
            lambda t, p: self.table.all_for(t, p, use=use),
            lambda f: kinds.get(f, "month"),
        )

    def watch_tick(self, now: float = 0.0, spacing: float = 0.0) -> list[Subscriber]:
        """One tick of the live usage push: offer every watched counter that changed since it
        was last offered (and not within ``spacing`` seconds of ``now``) to its subscribers;
        return the subscribers with notifications to send."""
        watch = self.watch
        if not watch:
            watch.next_due = None  # (nothing held: nobody watches)
            return []
        return watch.tick(lambda tenant: self.watch_view(tenant, watch.named(tenant)), now, spacing)

    def _export(self, params: list[Any]) -> Awaitable[dict[str, Any]]:
        # A read of storage only: units not flushed yet are not in it (docs/operations.md).
        period, cursor, limit = export.parse_params(params)
        return export.rpc_page(self.storage, period, cursor, limit)

    def _ping(self, params: list[Any]) -> str:
        _args("ping", params, 0, 0, ())
        return "pong"

    def _status(self, params: list[Any]) -> dict[str, Any]:
        _args("status", params, 0, 0, ())
        stats = self.table.stats()
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
                "refused": self.limit_refusals,
                "strict": self.shares.status(),
                "soft_crossings": self.soft_crossings,
            },
            "seeding": self.seeder.status(),
            "request_ids": {
                "remembered": len(self.ids),
                "dropped_early": self.ids.dropped_early,
                "window_s": self.ids.window_s,
                "max": self.ids.max_ids,
                "finished_reservations": len(self.done),
            },
            "subscriptions": self.watch.status(),
            "alerts": {**self.alerts.status(), **self.watch.alert_status()},
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
        try:
            rid = rid.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument("reservation id is not valid UTF-8") from None
    if not isinstance(rid, str) or not rid or len(rid) > 64:
        raise InvalidArgument("reservation id must be a non-empty string of at most 64 chars")
    try:
        rid.encode("utf-8")
    except UnicodeEncodeError:  # invalid UTF-8 from the wire, decoded with surrogateescape
        raise InvalidArgument("reservation id is not valid UTF-8") from None
    return rid


class _Batch:
    """A ``track_many`` call being answered: the items to count and where answers go."""

    __slots__ = ("answered", "dups", "firsts", "good", "idems", "out", "where")

    def __init__(self) -> None:
        self.out: list[Any] = []
        self.good: list[tuple[Key, int]] = []
        self.where: list[int] = []  # out index of each good item
        self.idems: list[tuple[str, int] | None] = []
        self.firsts: dict[str, int] = {}  # request id -> its first good item
        self.dups: list[tuple[int, int]] = []  # (out index, good item it repeats)
        self.answered: dict[int, tuple[int, Any, float]] = {}  # good item -> remembered entry

    def add(self, i: int, key: Key, qty: int, idem: tuple[str, int] | None) -> None:
        self.out.append(None)
        if idem is not None:
            self.firsts[idem[0]] = len(self.good)
        self.good.append((key, qty))
        self.where.append(i)
        self.idems.append(idem)

    def repeat(self, i: int, idem: tuple[str, int]) -> bool:
        """Whether an earlier item of this batch has the same id (then this one repeats it);
        :class:`Conflict` if that item's payload differs."""
        n = self.firsts.get(idem[0])
        if n is None:
            return False
        first = self.idems[n]
        if first is None or first[1] != idem[1]:
            raise Conflict(f"request id {idem[0][:64]!r} was already used by a different call")
        self.out.append(None)
        self.dups.append((i, n))
        return True


class _Short(Exception):
    """Internal: ``key``'s strict share (``credits``: ``key`` is a tenant's credit pool and
    ``qty`` credits) has no room for ``qty`` now (nothing counted); the call waits for
    :meth:`Service._make_room` and tries again."""

    def __init__(self, key: Key, qty: int, eff: Effective, *, credits: bool = False) -> None:
        super().__init__(key, qty)
        self.key = key
        self.qty = qty
        self.eff = eff
        self.credits = credits


def _credits(eff: Effective, qty: int) -> int:
    """What ``qty`` units of a priced feature cost; ``invalid_argument`` past 2^63 - 1."""
    credits = eff.price * qty
    if credits > QTY_MAX:
        raise InvalidArgument(
            f"{qty} units at {eff.price} credits a unit cost more than {QTY_MAX} credits"
        )
    return credits


#: Not decided yet (see Service._warm_check).
_UNKNOWN = object()

#: The feature name of a tenant's credit pool (``#`` never appears in a feature).
CREDITS = "#credits"


def pool_key(tenant: str) -> Key:
    """The key of ``tenant``'s credit pool (a budget record with no period)."""
    return (tenant, CREDITS, "")


class _LedgerFunder:
    """Credit pools are funded by metered debits of the tenant's ledger (docs/ledger.md)."""

    def __init__(self, book: LedgerBook) -> None:
        self.book = book

    async def available(self, tenant: str) -> int:
        return int((await self.book.balance(tenant))["available"])

    async def take(self, tenant: str, amount: int, ref: str) -> bool:
        try:
            await self.book.apply(tenant, ledger.debit(amount, ref, kind="metered"))
        except InsufficientBalance:
            return False
        return True


class _Answer:
    """The remembered answer of a retried call."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _one_copy(names: dict[str, str], name: str) -> str:
    """The copy of ``name`` kept in ``names`` (``name`` itself, kept, if none yet)."""
    kept = names.get(name)
    if kept is None:
        if len(names) >= NAME_CACHE_SIZE:
            names.clear()
        names[name] = kept = name
    return kept


def _wall(deadline: float) -> float:
    """A monotonic deadline as epoch seconds (what the log keeps)."""
    return time.time() + (deadline - time.monotonic())


def _mono(deadline: float) -> float:
    """An epoch-seconds deadline as a monotonic one."""
    return time.monotonic() + (deadline - time.time())


def _soft_crossing(eff: Effective | None, value: int | None, qty: int) -> bool:
    """Whether counting ``qty`` units (now at ``value``) took a counter past a soft limit."""
    return (
        eff is not None
        and eff.kind == "soft"
        and value is not None
        and qty > 0
        and value - qty <= eff.limit < value
    )


def _log_down(wal: WriteAheadLog) -> Unavailable:
    return Unavailable(f"write-ahead log cannot be written, nothing counted: {wal.broken}")
