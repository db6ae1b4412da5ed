"""Reservations: ``reserve``, ``commit`` and ``release``, and the leases' expiry.

A reservation holds units in the counter table (counted in ``usage``, never flushed or
gossiped until committed) under a lease with a deadline (:mod:`meter.core.leases`). Under a
strict limit its units are admitted from this node's share of the budget, and what a commit
does not use goes back to it. ``commit`` and ``release`` are idempotent by reservation id.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Any, cast

from meter.config import CounterConfig
from meter.core.dims import Pairs, check_dims, shown
from meter.core.fence import Fence
from meter.core.gate import Gate, Short, pool_key, soft_crossing
from meter.core.groups import Groups
from meter.core.idempotency import Effect, RequestIds, check_id, fingerprint
from meter.core.keycache import KeyCache
from meter.core.keys import Key, check_at, check_qty
from meter.core.leases import Lease, Reservations
from meter.core.params import args as check_args
from meter.core.params import opts as check_opts
from meter.core.params import reservation_id
from meter.core.seeder import Seeder
from meter.core.table import CounterTable
from meter.errors import Conflict, InvalidArgument, LimitExceeded, NotFound, Unavailable
from meter.wal import records as R
from meter.wal.records import spent_to_log
from meter.wal.replay import COMMITTED, RELEASED

_RESERVE_OPTS = frozenset({"limit", "ttl_ms", "at", "id", "dims"})
_FINISH_OPTS = frozenset({"id"})
#: Writes a reservation waits for when its strict share keeps running out under it.
MAX_ROOM_TRIES = 8


class Reserving:
    """The reservation methods over one table (see the module docstring)."""

    def __init__(
        self,
        table: CounterTable,
        keys: KeyCache,
        gate: Gate,
        fence: Fence,
        ids: RequestIds,
        seeder: Seeder,
        groups: Groups,
        config: CounterConfig,
    ) -> None:
        self.table = table
        #: Dimension counters: a reservation's entered within their bound (docs/dimensions.md).
        self.groups = groups
        self.keys = keys
        self.gate = gate
        self.fence = fence
        self.wal = fence.wal
        self.ids = ids
        self.seeder = seeder
        self.config = config
        #: Open reservations, by id.
        self.reservations = Reservations()
        #: Finished reservations (commit/release are idempotent by reservation id).
        self.done = RequestIds(ids.window_s, ids.max_ids)
        #: Reservations whose units were admitted from a strict share (given back when they
        #: are released, expire or are committed for less).
        self.escrowed: set[str] = set()

    # -- reserve ------------------------------------------------------------------------------

    def reserve(self, params: list[Any]) -> Any:
        """The ``reserve`` method."""
        tenant, feature, qty, opts = check_args("reserve", params, 3, 4, ({},))
        o = check_opts("reserve", opts, _RESERVE_OPTS)
        at = o.get("at")
        at_s = None if at is None else check_at(at)
        key = self.keys.key_for(tenant, feature, at_s)
        qty = check_qty(qty, allow_negative=False)
        if key[1] in self.gate.gauges:
            raise InvalidArgument(
                f"{key[1]!r} is a gauge (max or latest): its values are observed with track, "
                "not reserved"
            )
        if key[1] in self.gate.uniques:
            raise InvalidArgument(
                f"{key[1]!r} counts unique values: each is counted once by track, not reserved"
            )
        if self.gate.hier and "/" in key[0]:
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
        dims = o.get("dims")
        pairs: Pairs = () if dims is None else check_dims(key[1], self.keys.spec(key[1]), dims)
        spread: list[Key] = []
        if pairs:
            assert dims is not None
            spread = self.keys.spread(key, pairs, dims)[1:]
        idem: tuple[str, int] | None = None
        rid = o.get("id")
        if rid is not None:
            parts: tuple[Any, ...] = (key[0], key[1], qty, limit, ttl_ms, at)
            idem = (check_id(rid), fingerprint("reserve", *parts, pairs) if pairs else
                    fingerprint("reserve", *parts))  # fmt: skip
            entry = self.ids.lookup(idem[0], idem[1], time.time())
            if entry is not None:
                return entry[1]
        for k in spread:  # (after a retry's answer: a reservation made stays answered)
            if self.gate.effective(k) is not None:
                raise InvalidArgument(
                    f"reserve with dims: {key[0]}/{shown(k[1])} has a limit of its own, which "
                    "a reservation cannot hold units under: track it"
                )
        if at_s is not None:  # (after a retry's answer, as for track)
            self.keys.check_open(key, at_s, time.time())
        self.fence.check()
        names = tuple(k[1] for k in spread)
        if self.table.is_seeded(key) and all(self.table.is_warm(k) for k in spread):
            try:
                return self._reserve_now(key, qty, limit, ttl_ms, idem, names)
            except Short:
                pass  # the strict share needs room first: _reserve_cold makes it
        return self._reserve_cold(key, qty, limit, ttl_ms, idem, at_s, spread)

    async def _reserve_cold(
        self,
        key: Key,
        qty: int,
        limit: int | None,
        ttl_ms: int,
        idem: tuple[str, int] | None,
        at: float | None,
        spread: list[Key],
    ) -> str:
        if not self.table.is_seeded(key):
            await self.seeder.seed(key)
        if spread:
            # The dimension counters its commit counts on are entered within the feature's
            # bound now, and held in memory (a commit never finds the bound full).
            entered = await self.groups.enter_new(self.keys.spec(key[1]), spread)
            try:
                await self.seeder.seed_many(spread)
                for k in spread:  # (a row now; the reservation's units keep it)
                    if not self.table.is_warm(k):
                        self.table.incr(k, 0)
            finally:
                self.groups.leave(entered)
        names = tuple(k[1] for k in spread)
        for _ in range(MAX_ROOM_TRIES):
            if idem is not None:
                entry = self.ids.lookup(idem[0], idem[1], time.time())
                if entry is not None:
                    return cast(str, entry[1])
            if at is not None:  # (after each wait: its period may have closed meanwhile)
                self.keys.check_open(key, at, time.time())
            self.fence.check()
            try:
                return self._reserve_now(key, qty, limit, ttl_ms, idem, names)
            except Short as exc:
                short = exc
            await self.gate.make_room(short)  # (not in the except block: see ADR 0011)
        raise Unavailable(f"{key[0]}/{key[1]}: the strict share kept running out; retry")

    def _reserve_now(
        self,
        key: Key,
        qty: int,
        limit: int | None,
        ttl_ms: int,
        idem: tuple[str, int] | None,
        dims: tuple[str, ...] = (),
    ) -> str:
        gate = self.gate
        eff = gate.effective(key)
        if eff is not None and eff.price:
            raise InvalidArgument(
                f"reserve on a credit-metered feature ({key[0]}/{key[1]} costs {eff.price} "
                "credits a unit) is not supported yet: track it"
            )
        strict = eff is not None and eff.kind == "hard" and eff.enforcement == "strict"
        if strict:
            assert eff is not None
            gate.gate(key, qty, eff)  # raises Short without room in this node's share
        elif eff is not None and eff.kind == "hard":
            # The tighter of the call's own limit and the tenant's hard limit applies.
            limit = eff.limit if limit is None else min(limit, eff.limit)
        elsewhere = gate.held_elsewhere(key)
        value = self.table.value(key)
        if (
            limit is not None
            and elsewhere
            and value is not None
            and (value + elsewhere + qty > limit)
        ):
            gate.limit_refusals += 1
            raise LimitExceeded(
                f"{key[0]}/{key[1]}: {value} + {elsewhere} held by peers + {qty} would pass "
                f"the limit {limit}"
            )
        try:
            held = self.table.reserve(key, qty, limit)
        except LimitExceeded:
            gate.limit_refusals += 1
            raise
        tenant, _, period = key
        done: list[Key] = [key]
        try:  # held on its dimension counters too (groups add up), all or none
            for name in dims:
                self.table.reserve((tenant, name, period), qty, None)
                done.append((tenant, name, period))
        except InvalidArgument:  # past the 64-bit range on one: none held
            for k in done:
                self.table.release(k, qty)
            raise
        if gate.alerting and eff is not None and eff.alerts and held is not None:
            gate.alerts.detect(key, eff.limit, eff.alerts, held - qty, held)
        lease = self.reservations.open(key, qty, time.monotonic() + ttl_ms / 1000, dims)
        if strict and qty > 0:
            gate.shares.hold(key, qty)
            self.escrowed.add(lease.id)
        now = time.time()
        rid = fp = expires = None
        if idem is not None:
            rid, fp = idem
            expires = self.ids.remember(rid, fp, lease.id, now)
        if self.wal is not None:
            deadline = now + ttl_ms / 1000
            self.wal.append(
                [R.RESERVE, lease.id, *key, qty, deadline, rid, fp, expires, *_listed(dims)]
            )
        return lease.id

    # -- commit and release -------------------------------------------------------------------

    def commit(self, params: list[Any]) -> Any:
        """The ``commit`` method."""
        lease_id, actual, opts = check_args("commit", params, 1, 3, (None, {}))
        lease_id = reservation_id(lease_id)
        if actual is not None:
            actual = check_qty(actual, what="actual_qty", allow_negative=False)
        now = time.time()
        idem = self._finish_id("commit", opts, lease_id, actual, now)
        if isinstance(idem, _Answer):
            return idem.value
        lease = self._open_lease(lease_id)
        if lease is None:
            done = self.done.get(lease_id)
            if done is not None and done[2] > now:
                if done[0] == COMMITTED and (actual is None or actual == done[1][0]):
                    return done[1][1]  # a repeated commit answers as the first did
                what = "committed" if done[0] == COMMITTED else "released"
                raise Conflict(f"reservation {lease_id!r} was already {what} differently")
            raise NotFound(f"reservation {lease_id!r} is unknown or expired")
        self.fence.check()
        if actual is None:
            actual = lease.qty
        if actual > lease.qty:
            try:
                self._gate_commit(lease, actual)
            except Short as short:
                return self._commit_after_room(short, params)
        for k in dim_keys(lease):
            if self.gate.effective(k) is not None:
                raise Conflict(
                    f"reservation {lease_id!r}: {k[0]}/{shown(k[1])} has had a limit of its own "
                    "since it was made, which a reservation cannot hold units under; nothing "
                    "changed: release it and track the units"
                )
        # First the table, which may refuse (past the 64-bit range) with nothing changed.
        value = self._commit_rows(lease, actual)
        self.settle_escrow(lease, actual)
        gate = self.gate
        if actual > lease.qty and gate.limited:  # the extra units may cross a soft limit
            key = lease.key
            eff = gate.effective(key)
            view = self.table.value(key)
            if soft_crossing(eff, view, actual - lease.qty):
                gate.crossed(key, eff, view)
            if gate.alerting and eff is not None and eff.alerts and view is not None:
                gate.alerts.detect(key, eff.limit, eff.alerts, view - actual + lease.qty, view)
        self.reservations.close(lease_id)
        done_exp = self.done.remember(lease_id, COMMITTED, [actual, value], now)
        counted = (lease.key, *dim_keys(lease))
        # (only units past the reservation spend credits: a priced feature takes none)
        spent = () if idem is None else self.gate.spent((lease.key,), actual - lease.qty)
        rid, fp, expires = self._remember_finish(
            idem, value, now, Effect(actual, counted, credits=spent)
        )
        if self.wal is not None:
            rec = [R.COMMIT, lease_id, *lease.key, lease.qty, wall(lease.deadline), actual,
                   value, done_exp, rid, fp, expires, *_listed(lease.dims)]  # fmt: skip
            if rid is not None:  # (the credits it spent, none or some, after the dims)
                rec[13:] = [list(lease.dims), spent_to_log(spent)]
            self.wal.append(rec)
        return value

    async def _commit_after_room(self, short: Short, params: list[Any]) -> Any:
        """A commit above its reservation whose extra units need room in the strict share
        first: make it, then commit as if called now (the reservation may have ended)."""
        for _ in range(MAX_ROOM_TRIES):
            await self.gate.make_room(short)
            answer = self.commit(params)
            if not isinstance(answer, Awaitable):
                return answer
            answer.close()  # type: ignore[attr-defined]  # the share ran out again
        raise Unavailable("commit: the strict share kept running out; retry")

    def settle_escrow(self, lease: Lease, actual: int | None) -> None:
        """Move a finished reservation's units in this node's strict share: units not used
        go back to it (``actual`` None: released or expired), extra units were admitted by
        :meth:`_gate_commit`."""
        key = lease.key
        gate = self.gate
        if lease.id in self.escrowed:
            self.escrowed.discard(lease.id)
            unused = lease.qty if actual is None else max(0, lease.qty - actual)
            gate.shares.settle(key, lease.qty, unused)
        if actual is not None and actual > lease.qty and gate.limited:
            eff = gate.effective(key)
            if eff is not None and eff.price:  # (checked by _gate_commit, as the strict share)
                gate.take(pool_key(key[0]), eff.price * (actual - lease.qty))
            if eff is not None and eff.kind == "hard" and eff.enforcement == "strict":
                gate.take(key, actual - lease.qty)

    def _commit_rows(self, lease: Lease, actual: int) -> int | None:
        """Commit ``lease`` on its counter and its dimension counters, all or none (one past
        the 64-bit range refuses, the others taken back); the counter's value."""
        done: list[Key] = []
        try:
            for k in dim_keys(lease):
                self.table.commit(k, lease.qty, actual)
                done.append(k)
            return self.table.commit(lease.key, lease.qty, actual)
        except InvalidArgument:
            for k in done:
                self.table.incr(k, -actual, check=False)
                self.table.reserve(k, lease.qty, None, check=False)
            raise

    def _gate_commit(self, lease: Lease, actual: int) -> None:
        """Refuse a commit above its reservation whose extra units would pass a hard limit;
        the reservation still holds (commit at most what fits, or release it)."""
        key = lease.key
        eff = self.gate.effective(key)
        try:
            self.gate.gate(key, actual - lease.qty, eff)
        except LimitExceeded:
            raise LimitExceeded(
                f"{key[0]}/{key[1]}: committing {actual} units on a reservation of {lease.qty} "
                f"would pass the hard limit {eff.limit if eff else 0}; nothing changed, the "
                "reservation still holds"
            ) from None

    def release(self, params: list[Any]) -> None:
        """The ``release`` method."""
        lease_id, opts = check_args("release", params, 1, 2, ({},))
        lease_id = reservation_id(lease_id)
        now = time.time()
        idem = self._finish_id("release", opts, lease_id, None, now)
        if isinstance(idem, _Answer):
            return None
        lease = self._open_lease(lease_id)
        if lease is None:
            done = self.done.get(lease_id)
            if done is not None and done[2] > now:
                if done[0] == RELEASED:
                    return None
                raise Conflict(f"reservation {lease_id!r} was already committed")
            raise NotFound(f"reservation {lease_id!r} is unknown or expired")
        self.fence.check()
        self.reservations.close(lease_id)
        self.table.release(lease.key, lease.qty)
        for k in dim_keys(lease):
            self.table.release(k, lease.qty)
        self.settle_escrow(lease, None)
        done_exp = self.done.remember(lease_id, RELEASED, None, now)
        rid, fp, expires = self._remember_finish(idem, None, now)
        if self.wal is not None:
            self.wal.append(
                [R.RELEASE, lease_id, *lease.key, lease.qty, wall(lease.deadline), done_exp,
                 rid, fp, expires, *_listed(lease.dims)]
            )  # fmt: skip
        return None

    def _open_lease(self, lease_id: str) -> Lease | None:
        """The open lease ``lease_id``, if its deadline has not passed: one past it is expired
        for its callers, also before the expiry tick (or a log that cannot write yet) has
        released it."""
        lease = self.reservations.get(lease_id)
        if lease is None or lease.deadline <= time.monotonic():
            return None
        return lease

    def _finish_id(
        self, method: str, opts: Any, lease_id: str, actual: int | None, now: float
    ) -> tuple[str, int] | _Answer | None:
        """A commit/release request id: ``None``, the (id, fingerprint) to remember, or the
        remembered answer of a retry."""
        rid = check_opts(method, opts, _FINISH_OPTS).get("id")
        if rid is None:
            return None
        idem = (check_id(rid), fingerprint(method, lease_id, actual))
        entry = self.ids.lookup(idem[0], idem[1], now)
        if entry is not None:
            return _Answer(entry[1])
        return idem

    def _remember_finish(
        self, idem: tuple[str, int] | None, value: Any, now: float, effect: Effect | None = None
    ) -> tuple[str | None, int | None, float | None]:
        if idem is None:
            return None, None, None
        return idem[0], idem[1], self.ids.remember(idem[0], idem[1], value, now, effect)

    def expire(self, now: float | None = None) -> int:
        """Release every reservation past its deadline (by the monotonic clock); return how
        many. Each expiry is logged, so a restart never brings the lease back, whatever the
        wall clock did; while the log cannot write, leases wait for it (held, not expired)."""
        wal = self.wal
        if wal is not None and wal.broken is not None:
            return 0
        leases = self.reservations.expire(time.monotonic() if now is None else now)
        for lease in leases:
            escrowed = lease.id in self.escrowed
            self.table.release(lease.key, lease.qty)
            for k in dim_keys(lease):
                self.table.release(k, lease.qty)
            self.settle_escrow(lease, None)
            if wal is not None:
                wal.append(
                    [R.EXPIRE, lease.id, *lease.key, lease.qty, wall(lease.deadline), escrowed,
                     *_listed(lease.dims)]
                )  # fmt: skip
        return len(leases)


class _Answer:
    """The remembered answer of a retried call."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def dim_keys(lease: Lease) -> list[Key]:
    """The keys of the dimension counters ``lease`` holds units on (none without dims)."""
    tenant, _, period = lease.key
    return [(tenant, name, period) for name in lease.dims]


def _listed(dims: tuple[str, ...]) -> list[list[str]]:
    """A record's trailing ``dims`` field: the names, if any (older records end before it)."""
    return [list(dims)] if dims else []


def wall(deadline: float) -> float:
    """A monotonic deadline as epoch seconds (what the log keeps)."""
    return time.time() + (deadline - time.monotonic())


def mono(deadline: float) -> float:
    """An epoch-seconds deadline as a monotonic one."""
    return time.monotonic() + (deadline - time.time())
