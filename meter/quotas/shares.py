"""This node's shares of strict budgets: admitting from memory, and the writes that keep them.

The hot path (:meth:`Shares.room`, :meth:`Shares.admit`, :meth:`Shares.free`) touches only
memory. Storage is written when a share runs low (in the background, before it runs out),
when a call needs more than the share holds (the call waits for that one write), to renew a
share's lease, to give back an idle share, and at a clean stop. Each write is one
compare-and-swap of the counter's budget record (:mod:`meter.quotas.escrow` decides, ADR 0009).

Why one module: admitting, the writes that refill, renew and give back shares, pool fundings,
the balance's view of a pool and the counts the write-ahead log keeps all read and move the
same per-counter shares under the same per-counter locks; apart, each would reach into the
others' state.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from meter.core.gate import pool_key
from meter.core.keys import Key
from meter.core.ports import POOL, Funder, NoBudget
from meter.errors import InsufficientBalance
from meter.quotas import escrow
from meter.quotas.escrow import Budget, Local
from storage.base import BudgetRecords, StorageError, StorageUnavailable

log = logging.getLogger("meter.escrow")

#: Compare-and-swap attempts per write before giving up (contention from other nodes).
MAX_ATTEMPTS = 32
#: Largest funding size a pool grows to (then ``available`` bounds it anyway).
QTY_CAP = 2**62
#: Longest a call waits for a pool funding (another node's in flight) before ``unavailable``.
FUND_WAIT_S = 5.0
#: A pool funding moves about this many seconds of the pool's recent spend (its last funding
#: over the time it lasted), at least ``fund_chunk``: the rest stays in the ledger, where
#: ``balance`` lists it under its grants and their expiry applies.
FUND_HORIZON_S = 10.0
#: ...but at most this many times the last funding, and at least this many calls' worth.
FUND_GROWTH = 4
FUND_CALLS = 4


class Shares:
    """This node's shares of strict budgets, and the writes that take, renew and return them.

    ``share_max`` bounds one grant; ``nodes()`` is how many nodes are thought to share the
    budgets (a grant is at most the remaining budget over twice that, so no node sits on what
    the others need); ``lease_ms`` is how long a share stays this node's without a renewal,
    after which (plus ``grace_ms`` for clocks) another node may take back what it did not
    promise (its cap)."""

    def __init__(
        self,
        storage: BudgetRecords,
        node: str,
        *,
        lease_ms: int = 10_000,
        share_max: int = 10_000,
        nodes: Callable[[], int] = lambda: 1,
        fenced: Callable[[], str | None] = lambda: None,
        clock: Callable[[], float] = time.time,
        logged: bool = False,
    ) -> None:
        self.storage = storage
        self.node = node
        self.lease_ms = lease_ms
        self.grace_ms = max(1, lease_ms // 2)
        self.share_max = share_max
        self.nodes = nodes
        self.clock = clock
        #: Why this process may not write shares now (another process owns its node id, whose
        #: shares these are), or None.
        self.fenced = fenced
        #: Counter -> this node's share of its budget (the hot path's one lookup).
        self.local: dict[Key, Local] = {}
        self._locks: dict[Key, asyncio.Lock] = {}
        self._refills: set[asyncio.Task[None]] = set()
        self._filling: set[Key] = set()
        self._ops = itertools.count(1)
        #: This process (ops are ``<run>.<n>``): a share another process wrote is not ours.
        self.run = os.urandom(6).hex()
        #: Units held by open reservations admitted from a share, per counter: the share is
        #: kept while any are held.
        self.held: dict[Key, int] = {}
        #: Units given back while the counter had no local share (its share had gone back
        #: with them counted as admitted): taken off the next share's admitted count.
        self._owed: dict[Key, int] = {}
        #: Whether a write-ahead log (``fsync``) keeps the admitted counts: only then are
        #: changes noted (:meth:`admitted_changes`).
        self.logged = logged
        #: Counters whose admitted count changed since :meth:`admitted_changes` last ran, and
        #: the last count of shares dropped meanwhile (given back in full).
        self._changed: set[Key] = set()
        self._gone: dict[Key, int] = {}
        #: ``(key, run)`` -> what an earlier process of this node had admitted under its share
        #: of ``key``, as its write-ahead log says: its share is closed at that, not its cap.
        self._earlier: dict[tuple[Key, str], int] = {}
        self.writes = 0
        self.conflicts = 0
        self.refused = 0
        self.given_back = 0
        self.taken_back = 0
        self.errors = 0
        self.last_error: str | None = None
        #: Credits moved from a ledger to a pool at a time, at least (or what a call needs,
        #: or the recent spend of ``FUND_HORIZON_S``, if more).
        self.fund_chunk = 1_000
        #: Pool fundings this process began (it finishes its own at once).
        self._funding: set[tuple[Key, int]] = set()
        #: Per pool: (the size of this process's last funding, when it began): what sizes the
        #: next one by the recent spend rate.
        self._fund_size: dict[Key, tuple[int, float]] = {}
        self.fundings = 0

    # -- the hot path (no I/O) ---------------------------------------------------------------

    def ready(self, key: Key, qty: int, limit: int) -> bool:
        """Whether ``qty`` units can be admitted on ``key`` from this node's share now."""
        loc = self.local.get(key)
        return loc is not None and loc.limit == limit and loc.a + qty <= loc.c

    def admit(self, key: Key, qty: int) -> None:
        """Count ``qty`` units as admitted (the caller checked :meth:`ready`); ask for more
        in the background when the share runs low."""
        loc = self.local[key]
        loc.a += qty
        if self.logged:
            self._changed.add(key)
        loc.used_at = time.monotonic()
        if loc.c - loc.a < loc.low and key not in self._filling:
            self._refill(key, loc.limit)

    def hold(self, key: Key, qty: int) -> None:
        """Admit ``qty`` units a reservation holds (the caller checked :meth:`ready`)."""
        self.admit(key, qty)
        self.held[key] = self.held.get(key, 0) + qty

    def settle(self, key: Key, held: int, unused: int) -> None:
        """A reservation of ``held`` units ended with ``unused`` of them not used (released,
        expired, committed for less): those go back to this node's share."""
        left = self.held.get(key, 0) - held
        if left > 0:
            self.held[key] = left
        else:
            self.held.pop(key, None)
        self.free(key, unused)

    def free(self, key: Key, qty: int) -> None:
        """Give ``qty`` admitted units back to this node's share (never used)."""
        if qty <= 0:
            return
        loc = self.local.get(key)
        if loc is not None:
            loc.a = max(0, loc.a - qty)
            if self.logged:
                self._changed.add(key)
        else:  # the share went back with them counted: off the next one's count
            self._owed[key] = self._owed.get(key, 0) + qty

    def readmit(self, key: Key, qty: int, held: int) -> bool:
        """Count ``qty`` units as admitted again, room or not, and ``held`` as held (a
        reservation's end whose log write failed is taken back); False, changing nothing, if
        this node has no share of ``key``."""
        loc = self.local.get(key)
        if loc is None:
            return False
        loc.a += max(0, qty)
        if self.logged:
            self._changed.add(key)
        if held > 0:
            self.held[key] = self.held.get(key, 0) + held
        return True

    # -- writes ------------------------------------------------------------------------------

    async def ensure(
        self,
        key: Key,
        need: int,
        limit: int,
        base: int,
        at_least: int | None = None,
        *,
        background: bool = False,
    ) -> None:
        """Make room for ``need`` units on ``key`` (under strict limit ``limit``); ``base`` is
        the counter's value, should its budget record not exist yet. Raises
        :class:`~meter.quotas.escrow.NoBudget` when the budget cannot cover them, and
        :class:`StorageError` when storage cannot be asked. With ``at_least``, room for that
        many will do when ``need`` is more than is left."""
        try:
            async with self._lock(key):
                loc = self.local.get(key)
                if loc is not None and loc.limit != limit:
                    await self._give_back(key, loc)  # the limit moved: return, then take anew
                    loc = self.local.get(key)
                if loc is not None and loc.limit == limit and loc.a + need <= loc.c:
                    return  # another call made room meanwhile
                await self._write(
                    key, lambda b, cur, op: self._take(key, b, cur, op, need, limit, base, at_least)
                )
        except NoBudget:
            if not background:
                self.refused += 1
            raise
        finally:
            self._forget_lock(key)

    def _take(
        self,
        key: Key,
        budget: Budget | None,
        cur: Local | None,
        op: str,
        need: int,
        limit: int,
        base: int,
        at_least: int | None = None,
    ) -> escrow.Swap:
        if limit == POOL:  # a credit pool: its limit is what was moved into it
            if budget is None or budget.funded is None:
                raise NoBudget("the credit pool is empty")
            cap_limit = budget.funded
        else:
            cap_limit = limit
        left = cap_limit - (budget.granted if budget is not None else base)
        want = min(self.share_max, max(need, left // (2 * max(1, self.nodes()))))
        # A quarter of a grant, or of what this node holds unpromised if that is more (with
        # the budget spent elsewhere, steps sized by what is left would be a write a unit).
        held = 0 if cur is None else max(0, cur.g - cur.a)
        step = max(1, want // 4, held // 4)
        swap = escrow.take(
            budget,
            self.node,
            cur,
            run=self.run,
            need=need,
            want=want,
            step=step,
            limit=cap_limit,
            base=base,
            now_ms=int(self.clock() * 1000),
            lease_ms=self.lease_ms,
            grace_ms=self.grace_ms,
            op=op,
            at_least=at_least,
            owed=self._owed.get(key, 0) if cur is None else 0,
            spent=self._spent_before(key, budget) if cur is None else None,
        )
        swap.local.limit = limit
        swap.local.low = max(1, step // 2)
        if budget is not None:
            before = {n: s.e for n, s in budget.shares.items() if n != self.node}
            self.taken_back += sum(
                1 for n, s in swap.budget.shares.items() if n in before and s.e != before[n]
            )
        return swap

    def _spent_before(self, key: Key, budget: Budget | None) -> int | None:
        """What the earlier process that last wrote this node's share of ``key`` admitted
        under it, if its log said (None: not known, the share closes at its cap)."""
        mine = None if budget is None else budget.shares.get(self.node)
        if mine is None or not self._earlier:
            return None
        return self._earlier.get((key, mine.op.partition(".")[0]))

    async def pool(self, tenant: str) -> dict[str, Any]:
        """What ``tenant``'s credit pool holds unspent, as its record and this node's share
        say now: ``funded`` (moved in from the ledger), ``unspent`` (funded less what is
        spent, counting other nodes' shares as spent up to their caps) and
        ``held_elsewhere`` (those caps: exact on one node, else ``unspent`` is low by at most
        the part of it those nodes have not used yet) and ``in_flight`` (a funding begun and
        not finished, in neither the ledger nor ``funded``)."""
        key = pool_key(tenant)
        _, budget = await self._read(key)
        if budget is None or budget.funded is None:
            return {"funded": 0, "unspent": 0, "held_elsewhere": 0, "in_flight": 0}
        loc = self.local.get(key)
        spent = budget.base
        elsewhere = 0
        for node, s in budget.shares.items():
            if node != self.node:
                spent += s.c
                elsewhere += s.c
            elif loc is not None and escrow.ours(s, self.run):
                spent += loc.a  # (admitted: spent; a cap not used yet is not)
            else:  # an earlier process's share, closed at its logged count or its cap
                before = self._spent_before(key, budget)
                spent += s.c if before is None else min(s.c, before)
        return {
            "funded": budget.funded,
            "unspent": max(0, budget.funded - spent),
            "held_elsewhere": elsewhere,
            # A funding begun and not finished: it may have left the ledger already.
            "in_flight": 0 if budget.fund is None else budget.fund[1],
        }

    # -- what the write-ahead log keeps (nothing stranded by a crash) --------------------------

    def admitted_changes(self) -> list[list[Any]]:
        """``[t, f, p, run, admitted]`` of each share whose admitted count changed since the
        last call (the log writes them with the calls that changed them)."""
        out = []
        for key in self._changed:
            loc = self.local.get(key)
            if loc is not None:
                out.append([*key, self.run, loc.a])
            elif key in self._gone:
                out.append([*key, self.run, self._gone[key]])
        self._changed.clear()
        self._gone.clear()
        return out

    def admitted_all(self) -> list[list[Any]]:
        """``[t, f, p, run, admitted]`` of every share this process holds, and of the earlier
        processes' shares not closed yet (a checkpoint restates them)."""
        out = [[*key, self.run, loc.a] for key, loc in self.local.items()]
        out.extend([*key, run, a] for (key, run), a in self._earlier.items())
        return out

    def relog(self, keys: list[Key]) -> None:
        """Give these shares' counts with the next commit again (the log could not write
        them, or a checkpoint restated them from an earlier reading)."""
        if self.logged:
            self._changed.update(k for k in keys if k in self.local)

    def recovered(self, admitted: dict[tuple[Key, str], int]) -> None:
        """What earlier processes of this node had admitted under their shares, as the log
        replayed them: their shares are closed at that (:meth:`_take`)."""
        self._earlier.update({k: a for k, a in admitted.items() if k[1] != self.run})

    async def _write(
        self,
        key: Key,
        make: Callable[[Budget | None, Local | None, str], escrow.Swap | None],
    ) -> bool:
        """Read, decide, compare-and-swap, until a write lands (True) or there is nothing to
        write (False). A write whose answer was lost is recognised by its op id on the next
        read; a write that lost a race is decided again on what won it."""
        why = self.fenced()
        if why is not None:
            raise StorageUnavailable(f"escrow: not writing shares: {why}")
        version, budget = await self._read(key)
        for _ in range(MAX_ATTEMPTS):
            op = f"{self.run}.{next(self._ops)}"
            swap = make(budget, self.local.get(key), op)
            if swap is None:
                return False
            try:
                done = await self.storage.budget_swap(key, version, swap.budget.to_json())
            except StorageUnavailable:
                done = False  # it may have landed: the next read tells
            except StorageError as exc:
                self._failed(exc)
                raise
            self.writes += 1
            if not done:
                version, budget = await self._read(key)
                if not escrow.applied(budget, self.node, op):
                    self.conflicts += 1
                    continue
                assert budget is not None
                swap = escrow.Swap(budget, swap.local, swap.floor, swap.owed)
            self._keep(key, swap)
            return True
        raise StorageUnavailable(f"escrow: the budget of {key!r} kept changing; retry")

    def _keep(self, key: Key, swap: escrow.Swap) -> None:
        """Take the written share as this node's, keeping what was admitted meanwhile (the
        hot path admitted only within the old cap, which the new one is not below)."""
        new = escrow.adopt(self.node, swap.budget, self.local.get(key), swap.local.limit)
        loc = self.local.get(key)
        if loc is None:
            now = time.monotonic()
            a = swap.local.a  # (units owed were taken off it by the take: settled now)
            left = self._owed.get(key, 0) - swap.owed
            if left > 0:
                self._owed[key] = left
            else:
                self._owed.pop(key, None)
            self.local[key] = Local(new.e, new.g, new.c, a, swap.local.limit, now, swap.local.low)
        else:
            loc.e, loc.g, loc.c = new.e, new.g, new.c
            loc.a = max(loc.a, swap.floor)  # a share of another process closed: all spent
            loc.limit, loc.low = swap.local.limit, swap.local.low or loc.low
        if self.logged:
            self._changed.add(key)
        if self._earlier:  # the share is this process's now: earlier ones are closed
            for k in [k for k in self._earlier if k[0] == key]:
                del self._earlier[k]
        self.last_error = None

    async def _read(self, key: Key) -> tuple[int, Budget | None]:
        try:
            version, body = await self.storage.budget_read(key)
        except StorageError as exc:
            self._failed(exc)
            raise
        if body is None:
            return version, None
        try:
            return version, Budget.from_json(body)
        except ValueError as exc:
            raise StorageUnavailable(
                f"escrow: the budget of {key!r} cannot be read: {exc}"
            ) from None

    def _failed(self, exc: StorageError) -> None:
        self.errors += 1
        self.last_error = str(exc)

    async def _give_back(self, key: Key, loc: Local) -> None:
        """Return what this node has not admitted of its share on ``key`` (lock held). The cap
        is lowered here first, so nothing is admitted past what the write keeps."""
        # Nothing is admitted past ``kept`` from here on, and the write keeps ``kept``: units
        # freed meanwhile stay room here. The cap is never raised back, even if the write
        # fails (it may have landed, answer lost): the next take reads it from storage.
        kept = loc.c = loc.a

        def back(b: Budget | None, cur: Local | None, op: str) -> escrow.Swap | None:
            if b is None or cur is None:
                return None
            frozen = Local(cur.e, cur.g, cur.c, kept, cur.limit, cur.used_at, cur.low)
            return escrow.give_back(b, self.node, frozen, op, self.run)

        if await self._write(key, back):
            self.given_back += 1
        if loc.g == loc.c == loc.a and not self.held.get(key):
            if self.logged:
                self._gone[key] = loc.a  # (its last count may not be in the log yet)
            self.local.pop(key, None)

    def _lock(self, key: Key) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock

    def _refill(self, key: Key, limit: int) -> None:
        loc = self.local[key]
        self._filling.add(key)

        async def fill() -> None:
            try:
                await self.ensure(key, max(1, loc.low * 2), limit, 0, background=True)
            except (NoBudget, StorageError):
                pass  # the next call that finds no room asks again, and answers
            finally:
                self._filling.discard(key)

        task = asyncio.get_running_loop().create_task(fill())
        self._refills.add(task)
        task.add_done_callback(self._refills.discard)

    # -- credit pools (docs/ledger.md) -------------------------------------------------------

    async def ensure_pool(self, key: Key, need: int, funder: Funder) -> None:
        """Room for ``need`` credits in this node's share of ``key``'s credit pool (``key``:
        ``(tenant, CREDITS, "")``), moving credits from the tenant's ledger into the pool when
        it runs dry. Raises :class:`InsufficientBalance` when the ledger cannot cover it, and
        :class:`StorageUnavailable` when no funding could be made or finished within
        ``FUND_WAIT_S`` (another node's funding in flight, storage down)."""
        deadline = time.monotonic() + FUND_WAIT_S
        pause = 0.01
        while True:
            try:
                await self.ensure(key, need, POOL, 0, background=True)
                return
            except NoBudget:
                if await self._fund(key, need, funder):
                    continue
            if time.monotonic() >= deadline:
                raise StorageUnavailable(
                    f"credit pool of {key[0]!r}: another node's funding is in flight; retry"
                )
            await asyncio.sleep(pause)  # another node's funding: wait for it to land
            pause = min(pause * 2, 0.2)

    async def _fund(self, key: Key, need: int, funder: Funder) -> bool:
        """One funding of ``key``'s pool from the ledger, or the finish of one in flight;
        False if nothing could be done yet (another node's young funding, a lost race).
        The funding is in the pool's record before the ledger is debited under its ref, so
        any node can finish it, and the ledger's ref makes it count once."""
        tenant = key[0]
        began: float | None = None  # (when this process began the funding, if it did)
        async with self._lock(key):
            version, budget = await self._read(key)
            now_ms = int(self.clock() * 1000)
            if budget is not None and budget.fund is not None:
                n, amount, started = budget.fund
                if (key, n) not in self._funding and now_ms - started < 2 * self.lease_ms:
                    # Another node's, young: it finishes it (a late ledger write of a
                    # crashed node must not land after we decided it did not).
                    return False
            else:
                funded = 0 if budget is None or budget.funded is None else budget.funded
                free = funded - (0 if budget is None else budget.granted)
                loc = self.local.get(key)
                mine = 0 if loc is None else max(0, loc.g - loc.a)
                short = max(1, need - mine - max(0, free))
                available = await funder.available(tenant)
                if available < short:
                    self.refused += 1
                    raise InsufficientBalance(
                        f"{tenant}: {need} credits needed, {available} available; nothing counted"
                    )
                # At least fund_chunk, or a few calls' worth; more for a fast recent spend:
                # the last funding over how long it lasted (at least a second), times the
                # horizon, growing at most FUND_GROWTH times a funding (a burst moves a few
                # chunks, not the whole ledger).
                size = max(self.fund_chunk, FUND_CALLS * need)
                last = self._fund_size.get(key)
                began = time.monotonic()
                if last is not None:
                    lasted = max(began - last[1], 1.0)
                    rate_size = int(last[0] * FUND_HORIZON_S / lasted)
                    size = max(size, min(rate_size, FUND_GROWTH * last[0], QTY_CAP))
                amount = min(available, max(short, size))
                new = escrow.begin_fund(budget, amount, now_ms, os.urandom(6).hex())
                assert new.fund is not None
                n = new.fund[0]
                if not await self._swap(key, version, new):
                    return False  # raced (or unsure): read again
                self._funding.add((key, n))  # ours: finished at once, by this process
                budget = new
            assert budget is not None
            # (Any failure from here leaves (key, n) ours: the next call finishes it, under
            # the same ref, which lands at most once.)
            landed = await funder.take(tenant, amount, escrow.fund_ref(budget, n))
            self.fundings += 1
            if landed and began is not None:  # (what moved, and when: the next one's size)
                self._fund_size[key] = (amount, began)
            for _ in range(MAX_ATTEMPTS):
                version, stored = await self._read(key)
                done = None if stored is None else escrow.end_fund(stored, n, landed)
                if done is None or await self._swap(key, version, done):
                    self._funding.discard((key, n))
                    return True
            raise StorageUnavailable(f"credit pool of {tenant!r}: the funding kept racing; retry")

    async def _swap(self, key: Key, version: int, new: Budget) -> bool:
        """One compare-and-swap of a whole record; a lost answer settled by reading it."""
        body = new.to_json()
        try:
            if await self.storage.budget_swap(key, version, body):
                return True
        except StorageUnavailable:
            pass
        _, stored = await self._read(key)
        return stored is not None and stored.to_json() == body

    # -- upkeep ------------------------------------------------------------------------------

    async def step(self) -> None:
        """Renew the leases of shares with units promised to nobody yet (``g > c``), and give
        back shares idle for a lease. Run every third of a lease."""
        now = time.monotonic()
        for key, loc in list(self.local.items()):
            if self._lock(key).locked():
                continue
            try:
                async with self._lock(key):
                    if self.local.get(key) is not loc:
                        continue
                    if now - loc.used_at >= self.lease_ms / 1000:
                        await self._give_back(key, loc)
                    elif loc.g > loc.c:
                        await self._write(key, lambda b, cur, op: self._renew(b, cur, op))
            except (NoBudget, StorageError) as exc:
                log.warning("escrow: upkeep of %r failed: %s", key, exc)
            self._forget_lock(key)

    def _renew(self, budget: Budget | None, cur: Local | None, op: str) -> escrow.Swap | None:
        if budget is None or cur is None:
            return None
        now_ms = int(self.clock() * 1000)
        swap = escrow.renew(budget, self.node, cur, now_ms, self.lease_ms, op, self.run)
        if swap is not None:
            swap.local.limit, swap.local.low = cur.limit, cur.low
        return swap

    def _forget_lock(self, key: Key) -> None:
        lock = self._locks.get(key)
        if key not in self.local and lock is not None and not lock.locked():
            del self._locks[key]

    async def drain(self) -> None:
        """Give back every share (a clean stop): what this node did not admit is the others'."""
        for task in list(self._refills):
            task.cancel()
        for key, loc in list(self.local.items()):
            try:
                async with self._lock(key):
                    await self._give_back(key, loc)
            except (NoBudget, StorageError) as exc:
                log.warning("escrow: could not give back the share of %r: %s", key, exc)

    def status(self) -> dict[str, Any]:
        return {
            "shares": len(self.local),
            "room": sum(max(0, loc.c - loc.a) for loc in self.local.values()),
            "writes": self.writes,
            "conflicts": self.conflicts,
            "refused": self.refused,
            "given_back": self.given_back,
            "taken_back": self.taken_back,
            "errors": self.errors,
            "last_error": self.last_error,
        }
