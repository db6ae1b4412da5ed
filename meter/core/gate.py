"""The gate: hard and soft limits, strict budgets and credit prices, checked before counting.

Every counting part (tracking, reservations) asks the gate whether a call may count, and lets
it count on every level of a tenant at once. Strict limits and credit pools admit from this
node's share of their budget (ADR 0009, ADR 0010); a share without room makes the call wait
for one storage write (:meth:`Gate.make_room`). The ``check`` method lives here too: it asks
the gate what a track would do, changing nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from typing import Any

from meter.config import CounterConfig
from meter.core.dims import FeatureSpec, check_dims, shown
from meter.core.groups import Groups
from meter.core.keycache import NAME_CACHE_SIZE, KeyCache
from meter.core.keys import QTY_MAX, Key, check_at, check_qty
from meter.core.params import args as check_args
from meter.core.params import opts as check_opts
from meter.core.ports import (
    POOL,
    AlertSink,
    Budgets,
    Limit,
    Limits,
    NoBudget,
    PeerHeld,
)
from meter.core.seeder import Seeder
from meter.core.table import CounterTable
from meter.errors import InsufficientBalance, InvalidArgument, LimitExceeded, Unavailable
from meter.wal.log import WriteAheadLog
from meter.wal.records import Spent
from storage.base import StorageError

log = logging.getLogger("meter.service")

_CHECK_OPTS = frozenset({"at", "dims"})

#: The feature name of a tenant's credit pool (``#`` never appears in a feature).
CREDITS = "#credits"


def pool_key(tenant: str) -> Key:
    """The key of ``tenant``'s credit pool (a budget record with no period)."""
    return (tenant, CREDITS, "")


class Gate:
    """The limits this node enforces, and what checking them takes (see the module doc)."""

    def __init__(
        self,
        table: CounterTable,
        keys: KeyCache,
        seeder: Seeder,
        config: CounterConfig,
        *,
        shares: Budgets,
        alerts: AlertSink,
        peer_holds: PeerHeld,
        groups: Groups,
        wal: WriteAheadLog | None = None,
    ) -> None:
        self.table = table
        self.keys = keys
        self.seeder = seeder
        #: Dimension counters: a ``check`` with dimensions makes new ones only within their
        #: feature's bound, as the ``track`` it stands for would.
        self.groups = groups
        self.config = config
        #: This node's shares of strict budgets (ADR 0009): strict limits admit from these.
        self.shares = shares
        #: Threshold alerts (docs/quotas.md): detected here, claimed by the node's loop.
        self.alerts = alerts
        #: Units peers hold in open reservations (their ``holds`` frames): against limits.
        self.peer_holds = peer_holds
        #: The limits per (tenant, feature); None while no pair has one (the fast test).
        self.limited: Limits | None = None
        #: ``acme/alice`` also counts on ``acme`` (ADR 0008).
        self.hier = config.tenant_hierarchy
        #: Gauge features (docs/dimensions.md, "Gauges"): feature -> ``max`` or ``latest``.
        #: A call on one is an observation, never a count (:mod:`meter.core.gauging`).
        self.gauges: dict[str, str] = {}
        #: Unique features (docs/dimensions.md, "Unique counts"): a call on one counts a value
        #: once (:mod:`meter.core.uniques`).
        self.uniques: frozenset[str] = frozenset()
        #: Whether any call may need more than a plain count (a limit exists, a gauge is
        #: declared, or the tenant hierarchy is on): the hot paths look at this one flag.
        self.gated = self.hier
        #: Whether any limit has alert thresholds (the one test the counting paths make).
        self.alerting = False
        #: (tenant, feature) -> how the batched warm path checks it (see warm_check).
        self.warm_checks: dict[tuple[str, str], Any] = {}
        #: Calls refused by a hard limit, and soft limits crossed, since start.
        self.limit_refusals = 0
        self.soft_crossings = 0
        #: The write-ahead log, if any: what a call took from a share is given back if the
        #: log cannot write the call (:meth:`take`, :meth:`give_back`).
        self.wal = wal
        #: What the calls of the log's open batch took from shares, as (key, units), and the
        #: batch's number (older batches are committed or undone: forgotten).
        self._taken: list[tuple[Key, int]] = []
        self._taken_batch = 0

    def take(self, key: Key, qty: int) -> None:
        """Admit ``qty`` units of ``key`` from this node's share (a strict budget's units or
        a pool's credits; the caller checked they are there), to be given back by
        :meth:`give_back` if the log cannot write the call: every admit of a counting call
        goes through here, so its undo is the mirror of what it took."""
        self.shares.admit(key, qty)
        wal = self.wal
        if wal is not None:
            batch = wal.batch
            if self._taken_batch != batch:
                self._taken.clear()
                self._taken_batch = batch
            self._taken.append((key, qty))

    def give_back(self) -> None:
        """The log could not write the batch it is committing: give back what that batch's
        calls took from shares (an undo, :meth:`meter.core.journal.Journal.undo`)."""
        wal = self.wal
        if wal is not None and self._taken_batch == wal.committing:
            for key, qty in reversed(self._taken):
                self.shares.free(key, qty)
        self._taken.clear()

    def new_limits(self, limited: Limits, alerting: bool) -> None:
        """Enforce ``limited`` from now on (``alerting``: some limit has alert thresholds)."""
        self.warm_checks = {}  # decided again under the new limits
        self.limited = limited if limited else None
        self.gated = bool(limited) or self.hier or bool(self.gauges) or bool(self.uniques)
        self.alerting = alerting

    def new_aggregations(self, gauges: dict[str, str], uniques: frozenset[str]) -> None:
        """Take calls on the features of ``gauges`` (feature -> kind) as observations, and
        on those of ``uniques`` as values counted once."""
        self.warm_checks = {}
        self.gauges = gauges
        self.uniques = uniques
        self.gated = bool(self.limited) or self.hier or bool(gauges) or bool(uniques)

    def effective(self, key: Key) -> Limit | None:
        """The limit on ``key``'s (tenant, feature), if any."""
        limited = self.limited
        return limited.get((key[0], key[1])) if limited else None

    def spent(self, keys: Iterable[Key], qty: int) -> Spent:
        """The credits a count of ``qty`` on each of ``keys`` spent at today's prices, by the
        tenant whose pool paid (as :meth:`count_levels` takes them): what a void gives back."""
        limited = self.limited
        if not limited or qty <= 0:
            return ()
        out: dict[str, int] = {}
        for key in keys:
            eff = limited.get((key[0], key[1]))
            if eff is not None and eff.price:
                out[key[0]] = out.get(key[0], 0) + eff.price * qty
        return tuple(out.items())

    def refund(self, credits: Spent) -> None:
        """Give ``credits`` back to the pools that paid them (a void; the caller checked
        :meth:`refundable`): unspent again in this node's shares of them."""
        for tenant, n in credits or ():
            self.shares.free(pool_key(tenant), n)

    def refundable(self, credits: Spent) -> str | None:
        """Why ``credits`` cannot be given back now (None: they can): each pool that paid
        needs this node's share of it in memory, holding at least what it gives back."""
        if credits is None:
            return "an older build logged that it spent credits, not how many"
        for tenant, n in credits:
            if self.shares.admitted(pool_key(tenant)) < n:
                return f"this node's share of {tenant}'s credit pool is not in memory"
        return None

    def held_elsewhere(self, key: Key) -> int:
        """Units peers hold on ``key`` in open reservations."""
        total = self.peer_holds.total
        return total.get(key, 0) if total else 0

    def needs_check(self, key: Key) -> bool:
        """Whether a count on ``key`` is checked against a limit or spread over levels, or
        is a gauge's observation."""
        limited = self.limited
        return (
            bool(limited and (key[0], key[1]) in limited)
            or (self.hier and "/" in key[0])
            or key[1] in self.gauges
            or key[1] in self.uniques
        )

    def warm_check(self, key: Key) -> Any:
        """How a plain warm track on ``key``'s pair is checked, remembered until the limits
        change: ``None`` (nothing to check), ``(pool, price)`` (its price only: the batched
        path charges the pool) or ``False`` (dispatch checks it)."""
        if not self.needs_check(key):
            how: Any = None
        elif key[1] in self.gauges or key[1] in self.uniques:
            how = False  # an observation, or a value: never counted on the batched path
        else:
            credits = self.priced_only(key, 1)
            how = False if credits is None else (pool_key(key[0]), credits)
        checks = self.warm_checks
        if len(checks) >= NAME_CACHE_SIZE:
            checks.clear()
        checks[(key[0], key[1])] = how
        return how

    def priced_only(self, key: Key, qty: int) -> int | None:
        """The credits a plain track of ``qty`` on ``key`` costs if its price is the only
        thing to check (no unit limit, alerts or levels), else ``None``."""
        eff = self.effective(key)
        if (
            eff is None
            or not eff.price
            or qty <= 0
            or eff.limit != QTY_MAX
            or eff.alerts
            or eff.enforcement != "fast"
            or (self.hier and "/" in key[0])
        ):
            return None
        credits = eff.price * qty
        return credits if credits <= QTY_MAX else None  # (dispatch refuses it, clearly)

    def gate(self, key: Key, qty: int, eff: Limit | None, *, priced: bool = True) -> None:
        """Refuse (raise, nothing counted) ``qty`` more units on a seeded-or-not ``key`` that
        would take its view past a hard limit. Units taken away are never refused.
        ``priced=False``: its credits are checked by the caller (summed per pool)."""
        if eff is None or qty <= 0:
            return
        if (
            priced
            and eff.price
            and not self.shares.ready(pool_key(key[0]), credits_for(eff, qty), POOL)
        ):
            raise Short(pool_key(key[0]), eff.price * qty, eff, credits=True)
        if eff.kind != "hard":
            return
        if eff.enforcement == "strict":
            if not self.shares.ready(key, qty, eff.limit):
                raise Short(key, qty, eff)
            return
        value = self.table.value(key)
        if value is None:
            raise Unavailable(
                f"{key[0]}/{shown(key[1])}: the stored total is unknown (storage unreachable), "
                "so its hard limit cannot be checked; nothing counted"
            )
        elsewhere = self.held_elsewhere(key)
        if value + elsewhere + qty > eff.limit:
            self.limit_refusals += 1
            held = f" + {elsewhere} held by peers" if elsewhere else ""
            raise LimitExceeded(
                f"{key[0]}/{shown(key[1])}: {value}{held} + {qty} would pass the hard limit "
                f"{eff.limit} ({eff.source}); nothing counted"
            )

    def detail(self, key: Key, value: int | None, qty: int) -> dict[str, Any]:
        """The ``check`` map of ``key`` at ``value`` for ``qty`` more units (0: as it is)."""
        eff = self.effective(key)
        if eff is None:
            return {"allowed": True, "value": value, "limit": None, "remaining": None,
                    "kind": None, "source": None, "over": False, "tenant": key[0]}  # fmt: skip
        elsewhere = self.held_elsewhere(key)
        if eff.enforcement == "strict" and eff.kind == "hard":
            # Strict: this node's share decides (checked before the answer, see check).
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
            credits = credits_for(eff, max(0, qty))
            out["credits"] = credits
            if credits and not self.shares.ready(pool_key(key[0]), credits, POOL):
                out["allowed"] = False
        return out

    def count_levels(self, keys: list[Key], qty: int) -> tuple[list[int | None], list[list[Any]]]:
        """Gate then count ``qty`` on each of ``keys``; the new values and the log items of
        the levels above the first. Raises (nothing counted anywhere) if a level refuses."""
        limited = self.limited
        effs = [limited.get((k[0], k[1])) if limited else None for k in keys]
        if len(keys) > 1 and qty > 0:
            # A tenant's counters (its total, its dimension counters) spend from one pool:
            # its credits are checked for all of them at once.
            for short in self._pools_short(keys, effs, qty):
                raise short
            for k, eff in zip(keys, effs, strict=True):
                self.gate(k, qty, eff, priced=False)
        else:
            for k, eff in zip(keys, effs, strict=True):
                self.gate(k, qty, eff)
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
                self.take(pool_key(k[0]), eff.price * qty)
            if eff is not None and eff.enforcement == "strict" and qty > 0 and eff.kind == "hard":
                self.take(k, qty)
            elif soft_crossing(eff, v, qty):
                self.crossed(k, eff, v)
        if self.alerting and qty > 0:
            for k, eff, v in zip(keys, effs, values, strict=True):
                if eff is not None and eff.alerts and v is not None:
                    self.alerts.detect(k, eff.limit, eff.alerts, v - qty, v)
        return values, [[*k, qty] for k in keys[1:]]

    def _pools_short(self, keys: list[Key], effs: list[Limit | None], qty: int) -> list[Short]:
        """The credit pools that cannot pay for ``qty`` units on every priced key of
        ``keys`` together (``effs``: their limits)."""
        need: dict[Key, list[Any]] = {}
        for k, eff in zip(keys, effs, strict=True):
            if eff is not None and eff.price:
                entry = need.setdefault(pool_key(k[0]), [0, eff])
                entry[0] += credits_for(eff, qty)
        out: list[Short] = []
        for pool, (credits, eff) in need.items():
            if credits > QTY_MAX:
                raise InvalidArgument(f"{qty} units cost more than {QTY_MAX} credits")
            if not self.shares.ready(pool, credits, POOL):
                out.append(Short(pool, credits, eff, credits=True))
        return out

    def crossed(self, key: Key, eff: Limit | None, value: int | None) -> None:
        """A count took ``key`` past its soft limit: counted and logged."""
        self.soft_crossings += 1
        if eff is not None:
            log.info("soft limit crossed: %s/%s at %s > %d (%s)",
                     key[0], key[1], value, eff.limit, eff.source)  # fmt: skip

    def check(self, params: list[Any]) -> Any:
        """The ``check`` method: what a track of ``qty`` would do now, changing nothing."""
        tenant, feature, qty, opts = check_args("check", params, 2, 4, (1, {}))
        o = check_opts("check", opts, _CHECK_OPTS)
        at = o.get("at")
        at_s = None if at is None else check_at(at)
        key = self.keys.key_for(tenant, feature, at_s)
        qty = check_qty(qty)
        dims = o.get("dims")
        pairs = () if dims is None else check_dims(key[1], self.keys.spec(key[1]), dims)
        if at_s is not None:  # (as a track would be refused there)
            self.keys.check_open(key, at_s, time.time())
        # (with dimensions: every level's total and dimension counters, as a track counts)
        keys = self.keys.spread(key, pairs) if pairs else self.keys.levels(key)
        if all(self.table.is_seeded(k) for k in keys) and not self.strict_short(keys, qty):
            return self.check_levels(keys, qty)
        return self._check_cold(keys, qty, self.keys.spec(key[1]) if pairs else None)

    async def _check_cold(
        self, keys: list[Key], qty: int, spec: FeatureSpec | None = None
    ) -> dict[str, Any]:
        if spec is not None:
            # New dimension counters are made only within their feature's bound (else the
            # track it stands for would be refused: so is the check).
            entered = await self.groups.enter_new(spec, keys)
            try:
                await self.seeder.seed_many(keys)
            finally:
                self.groups.leave(entered)
        else:
            await self.seeder.seed_many(keys)
        if not all(self.table.is_seeded(k) for k in keys):
            raise Unavailable("storage is unreachable and this counter's total is not known")
        for short in self.strict_short(keys, qty):
            # Would a track be admitted? Only a share with room says yes: take one.
            with contextlib.suppress(LimitExceeded, InsufficientBalance):
                await self.make_room(short)
        return self.check_levels(keys, qty)

    def strict_short(self, keys: list[Key], qty: int) -> list[Short]:
        """The strict levels of ``keys`` whose share has no room for ``qty`` now."""
        limited = self.limited
        if not limited or qty <= 0:
            return []
        effs = [limited.get((k[0], k[1])) for k in keys]
        out = self._pools_short(keys, effs, qty)
        for k, eff in zip(keys, effs, strict=True):
            if eff is None:
                continue
            if (
                eff.enforcement == "strict"
                and eff.kind == "hard"
                and not self.shares.ready(k, qty, eff.limit)
            ):
                out.append(Short(k, qty, eff))
        return out

    async def make_rooms(self, keys: list[Key], qty: int, short: Short) -> None:
        """Make room for ``short`` and, at the same time, on every other level of ``keys``
        short of room for ``qty``: a call under the hierarchy waits for one round of writes,
        not for one write per level in turn. The first refusal (or failure) is raised once
        every write has ended."""
        shorts = [short] + [s for s in self.strict_short(keys, qty) if s.key != short.key]
        if len(keys) == 1:
            await self.make_room(short)
            return
        # Levels with room for this call but not for the next: filled in the same round (a
        # failure there is the next call's to meet).
        short_keys = {s.key for s in shorts}
        low = [s for s in self.strict_short(keys, 2 * qty) if s.key not in short_keys]
        ended = await asyncio.gather(
            *(self.make_room(s) for s in shorts + low), return_exceptions=True
        )
        failed = next((got for got in ended[: len(shorts)] if isinstance(got, BaseException)), None)
        if failed is None:
            return
        if isinstance(failed, LimitExceeded):
            # Refused at one level: room this node holds for it at the others would sit
            # unused while calls on other nodes are refused for want of it.
            refused = {s.key for s, got in zip(shorts, ended, strict=False) if got is not None}
            for k in keys:
                eff = self.limited.get((k[0], k[1])) if self.limited else None
                if k not in refused and eff is not None and eff.enforcement == "strict":
                    self.shares.release(k, eff.limit)
        raise failed

    async def make_room(self, short: Short, at_least: int | None = None) -> None:
        """Make room for what ``short`` asked for: in the tenant's credit pool, or in this
        node's share of a strict budget."""
        if short.credits:
            try:
                await self.shares.ensure_pool(short.key, short.qty)
            except StorageError as exc:
                raise Unavailable(
                    f"{short.key[0]}: the credit pool cannot be read or written ({exc}); "
                    "nothing counted"
                ) from None
            return
        await self._make_strict_room(short, at_least)

    async def _make_strict_room(self, short: Short, at_least: int | None = None) -> None:
        """One write (or a few, under contention) giving this node's share room for the
        units ``short`` asked for; ``limit_exceeded`` if the strict budget cannot cover them."""
        key, eff = short.key, short.eff
        value = self.table.value(key)
        if value is None:
            raise Unavailable(
                f"{key[0]}/{shown(key[1])}: the stored total is unknown (storage unreachable), "
                "so its strict limit cannot be checked; nothing counted"
            )
        try:
            await self.shares.ensure(key, short.qty, eff.limit, max(0, value), at_least)
        except NoBudget as exc:
            self.limit_refusals += 1
            raise LimitExceeded(
                f"{key[0]}/{shown(key[1])}: {short.qty} more would pass the strict limit "
                f"{eff.limit} ({eff.source}): {exc}; nothing counted"
            ) from None
        except StorageError as failed:
            raise Unavailable(
                f"{key[0]}/{shown(key[1])}: the strict budget cannot be read or written "
                f"({failed}); nothing counted"
            ) from None

    def check_levels(self, keys: list[Key], qty: int) -> dict[str, Any]:
        """The leaf's map, or (with the hierarchy, or dimensions) that of the first counter
        that would refuse; a credit pool that cannot pay for every counter's units together
        refuses too."""
        details = [self.detail(k, self.table.value(k), qty) for k in keys]
        out = next((d for d in details if not d["allowed"]), details[0])
        limited = self.limited
        if out["allowed"] and limited and qty > 0 and len(keys) > 1:
            effs = [limited.get((k[0], k[1])) for k in keys]
            if self._pools_short(keys, effs, qty):
                out = {**out, "allowed": False}
        return out

    def batch_short(self, good: list[tuple[list[Key], int]]) -> list[tuple[Short, int]]:
        """Per strict level whose share cannot take every item of a batch (``good``: each
        item's keys, levels and dimension counters, and its quantity) on it: what it needs
        (the items' sum) and the smallest item."""
        if not self.limited:
            return []
        sums: dict[Key, list[int]] = {}
        for keys, qty in good:
            if qty > 0:
                for k in keys:
                    acc = sums.get(k)
                    if acc is None:
                        sums[k] = [qty, qty]
                    else:
                        acc[0] += qty
                        acc[1] = min(acc[1], qty)
        out: list[tuple[Short, int]] = []
        pools: dict[Key, list[Any]] = {}  # every priced feature of a tenant: one pool
        limited = self.limited
        for k, (total, smallest) in sums.items():
            for short in self.strict_short([k], total):
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
                out.append((Short(pool, need, eff, credits=True), smallest))
        return out

    def refusal(self, short: Short, qty: int) -> InsufficientBalance | LimitExceeded:
        """The error of one item of a batch that ``short`` found no room for."""
        if short.credits:
            return InsufficientBalance(
                f"{short.key[0]}: {short.qty} credits needed, not available; nothing counted"
            )
        self.limit_refusals += 1
        return LimitExceeded(
            f"{short.key[0]}/{shown(short.key[1])}: {qty} more would pass the strict limit "
            f"{short.eff.limit} ({short.eff.source}); nothing counted"
        )

    def peer_deltas(self, deltas: Iterable[tuple[str, str, str, int, int]]) -> None:
        """A peer's gossip deltas ``(tenant, feature, period, seq, delta)`` were applied:
        detect the threshold crossings they caused (the view before a frame is taken as the
        view after it less the frame's units)."""
        limited = self.limited
        if not self.alerting or limited is None:
            return
        sums: dict[Key, int] = {}
        for t, f, p, _, delta in deltas:
            eff = limited.get((t, f))
            if eff is not None and eff.alerts and delta > 0:
                crossed: Key = (t, f, p)
                sums[crossed] = sums.get(crossed, 0) + delta
        for key, units in sums.items():
            eff = limited.get((key[0], key[1]))
            value = self.table.value(key)
            if eff is not None and value is not None:
                self.alerts.detect(key, eff.limit, eff.alerts, value - units, value)


class Short(Exception):
    """Internal: ``key``'s strict share (``credits``: ``key`` is a tenant's credit pool and
    ``qty`` credits) has no room for ``qty`` now (nothing counted); the call waits for
    :meth:`Gate.make_room` and tries again."""

    def __init__(self, key: Key, qty: int, eff: Limit, *, credits: bool = False) -> None:
        super().__init__(key, qty)
        self.key = key
        self.qty = qty
        self.eff = eff
        self.credits = credits


def credits_for(eff: Limit, qty: int) -> int:
    """What ``qty`` units of a priced feature cost; ``invalid_argument`` past 2^63 - 1."""
    credits = eff.price * qty
    if credits > QTY_MAX:
        raise InvalidArgument(
            f"{qty} units at {eff.price} credits a unit cost more than {QTY_MAX} credits"
        )
    return credits


def soft_crossing(eff: Limit | None, value: int | None, qty: int) -> bool:
    """Whether counting ``qty`` units (now at ``value``) took a counter past a soft limit."""
    return (
        eff is not None
        and eff.kind == "soft"
        and value is not None
        and qty > 0
        and value - qty <= eff.limit < value
    )
