"""This node's shares of strict budgets: admitting from memory, and the writes that keep them.

The hot path (:meth:`Shares.room`, :meth:`Shares.admit`, :meth:`Shares.free`) touches only
memory. Storage is written when a share runs low (in the background, before it runs out),
when a call needs more than the share holds (the call waits for that one write), to renew a
share's lease, to give back an idle share, and at a clean stop. Each write is one
compare-and-swap of the counter's budget record (:mod:`meter.quotas.escrow` decides, ADR 0009).

Why one module: admitting, the writes that refill, renew and give back shares, the admits
onto a record near the limit (ADR 0014), pool fundings, the balance's view of a pool and the
counts the write-ahead log keeps all read and move the same per-counter shares under the same
per-counter locks; apart, each would reach into the others' state.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from meter.core.gate import pool_key
from meter.core.keys import Key
from meter.core.ports import POOL, Funder, NoBudget
from meter.errors import InsufficientBalance, MeterError
from meter.quotas import escrow
from meter.quotas.escrow import Budget, Local
from storage.base import BudgetItem, BudgetRecords, StorageError, StorageUnavailable

log = logging.getLogger("meter.escrow")

#: Compare-and-swap attempts per write before giving up (contention from other nodes).
MAX_ATTEMPTS = 32
#: Largest funding size a pool grows to (then ``available`` bounds it anyway).
QTY_CAP = 2**62
#: Pools whose return the upkeep looks at per pass, at most, and the longest it waits
#: between two looks at one (in leases; the wait doubles while another node keeps a share
#: of it in use).
POOLS_PER_PASS = 16
RETURN_BACKOFF_MAX = 16
#: Longest a call waits for a pool funding (another node's in flight) before ``unavailable``.
FUND_WAIT_S = 5.0
#: A pool funding moves about this many seconds of the pool's recent spend (its last funding
#: over the time it lasted), at least ``fund_chunk``: the rest stays in the ledger, where
#: ``balance`` lists it under its grants and their expiry applies.
FUND_HORIZON_S = 10.0
#: ...but at most this many times the last funding, and at least this many calls' worth.
FUND_GROWTH = 4
FUND_CALLS = 4


class _Direct(Exception):
    """Internal: a take found the record near the limit; the calls are admitted onto it
    instead (:meth:`Shares._admit_direct`)."""


def fewest_of(at_least: int | None, need: int) -> int:
    """The fewest units of ``need`` that will do (``at_least``, if given)."""
    return need if at_least is None else min(need, at_least)


def decode(item: BudgetItem) -> Budget | None:
    """A stored budget record, the units admitted onto it folded into their shares (None:
    there is none); ``ValueError`` if it is not one."""
    if item.body is None:
        return None
    stored = item.body if item.admits else None
    return Budget.from_json(item.body).admitted(item.admitted, stored)


class Shares:
    """This node's shares of strict budgets, and the writes that take, renew and return them.

    ``share_max`` bounds one grant; ``nodes()`` is how many nodes are thought to share the
    budgets (a grant is at most the remaining budget over twice that, so no node sits on what
    the others need); ``lease_ms`` is how long a share stays this node's without a renewal,
    after which (plus ``grace_ms`` for clocks) another node may take back what it did not
    promise (its cap).

    Why one class: every method reads or moves the same per-counter state (the local shares,
    the record as last seen, the waiting calls' demand, the locks that order the writes);
    the takes, the admits onto a record, the give-backs and the pool fundings must see one
    another's effects at every await, which parts holding copies could not."""

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
        funder: Funder | None = None,
    ) -> None:
        self.storage = storage
        #: Where an idle credit pool's unshared credits go back to (None: they stay).
        self.funder = funder
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
        #: Units asked for by the calls waiting on a counter (one write serves them all).
        self._demand: dict[Key, int] = {}
        #: The record as this process last wrote or read it, per counter: the next write's
        #: first try decides on it, without a read (a compare-and-swap tells if it is old).
        #: With when (monotonic) it was seen so: the read's start, or the write's send.
        self._known: dict[Key, tuple[int, Budget | None, float]] = {}
        #: The last refusal decided on a read of a counter's record: ``(limit, when the read
        #: began, units it left this node)``.
        self._verdicts: dict[Key, tuple[int, float, int]] = {}
        self.writes = 0
        #: Of ``writes``, those that admitted calls straight onto a record.
        self.direct_writes = 0
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
        #: Per pool: (what the pool had been funded with when this process's last funding
        #: began, when that was, its amount): the next funding is sized by what every node
        #: moved in since (that one included), over the time since (the pool's spend rate).
        self._fund_size: dict[Key, tuple[int, float, int]] = {}
        #: Pools being funded ahead of running dry (:meth:`_fund_ahead`), awaited by a
        #: clean stop (a funding cut off midway would hold the pool for two leases), and when
        #: one may be tried again after one that did not fund.
        self._ahead: dict[Key, asyncio.Task[None]] = {}
        self._ahead_not_before: dict[Key, float] = {}
        self.fundings = 0
        #: Returns of a pool's credits to the ledger sent (idle pools, expired grants), and
        #: the credits they gave; pools whose idle return is to be looked at (again), and
        #: when (monotonic).
        self.returns = 0
        self.returned = 0
        self._returning: dict[Key, tuple[float, float]] = {}
        #: Per pool this node holds a share of: when (epoch seconds) to look for credits of
        #: expired grants in it, to give back so that they expire.
        self._expiry: dict[Key, float] = {}

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

    def admitted(self, key: Key) -> int:
        """What this node's share of ``key`` in memory counts as admitted (0: none there)."""
        loc = self.local.get(key)
        return 0 if loc is None else loc.a

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
        many will do when ``need`` is more than is left.

        Calls waiting on one counter are served together: the write takes room for every
        call queued behind it (at least its own), and a call that arrived before a read that
        found too little left for it is refused by that read, not by one of its own."""
        fewest = fewest_of(at_least, need)
        arrived = time.monotonic()
        if not background:
            self._demand[key] = self._demand.get(key, 0) + need
        try:
            async with self._lock(key):
                loc = self.local.get(key)
                if loc is not None and loc.limit != limit:
                    await self._give_back(key, loc)  # the limit moved: return, then take anew
                    loc = self.local.get(key)
                if loc is not None and loc.limit == limit and loc.a + need <= loc.c:
                    return  # another call made room meanwhile
                seen = self._verdicts.get(key) if limit != POOL else None
                if seen is not None and seen[0] == limit and arrived <= seen[1]:
                    # (``left`` counted this node's room then; its room now is added again,
                    # so this refuses less than it could, never more)
                    room = 0 if loc is None or loc.limit != limit else max(0, loc.c - loc.a)
                    if fewest > seen[2] + room:
                        raise NoBudget(f"{seen[2] + room} units left, {need} asked", seen[2])
                want = max(need, self._demand.get(key, 0)) if not background else need
                for _ in range(MAX_ATTEMPTS):
                    if limit != POOL and await self._admit_direct(
                        key, want, fewest, limit, base, background
                    ):
                        return
                    try:
                        await self._write(
                            key,
                            lambda b, cur, op: self._take(
                                key, b, cur, op, want, limit, base, fewest
                            ),
                            arrived,
                        )
                        return
                    except _Direct:
                        continue  # a race moved the record near the limit: admit onto it
                    except NoBudget as exc:
                        # (a pool's refusal is not the call's answer: it funds the pool)
                        if exc.read_at is not None and limit != POOL:
                            self._verdicts[key] = (limit, exc.read_at, exc.left)
                        raise
                raise StorageUnavailable(f"escrow: the budget of {key!r} kept changing; retry")
        except NoBudget:
            if not background:
                self.refused += 1
            raise
        finally:
            if not background:
                left = self._demand.get(key, 0) - need
                if left > 0:
                    self._demand[key] = left
                else:
                    self._demand.pop(key, None)
            self._forget_lock(key)

    async def _admit_direct(
        self, key: Key, want: int, least: int, limit: int, base: int, background: bool
    ) -> bool:
        """Near the limit, room for the calls waiting on ``key`` by admitting them straight
        onto its record (:func:`~meter.quotas.escrow.direct_units`): one conditional write,
        which only a whole write of the record in between makes fail (then it is read and
        decided again). False: take a share instead (far from the limit, no share known, too
        little left by the record as last seen); True with ``background``: nothing to do,
        the next call admits onto the record."""
        if self.fenced() is not None or key in self._owed:
            return False  # (the take path says why, or settles what is owed)
        if key not in self._known:
            if any(k == key for k, _ in self._earlier):
                # An earlier process of this node admitted on it: read, so that its share is
                # closed at what its log says (a take), not merged with this one's.
                version, budget, seen = await self._read_timed(key)
                self._known[key] = (version, budget, seen)
            else:
                # Not seen yet: as if there were no record (if there is one, the write onto
                # it fails and reads it; if not, it makes it, as every node would, at once).
                self._known[key] = (0, None, 0.0)
        version, budget, seen = self._known[key]
        if budget is None:  # none yet: made by the first write onto it (the same for all)
            fresh = Budget(base, {})
            budget = replace(fresh, stored=fresh.to_json())
            self._known[key] = (version, budget, seen)
        units = escrow.direct_units(
            budget, self.node, self.local.get(key), run=self.run, want=want, least=least,
            limit=limit, nodes=self.nodes(), share_max=self.share_max,
        )  # fmt: skip
        if units <= 0:
            if self._known[key][1] is budget and version == 0:
                self._known[key] = (version, None, seen)  # (the take path makes it)
            return False
        if background:
            return True  # (a share refilled near the limit would race the others)
        if not await self._direct_write(key, units, limit, want, least):
            return False
        self.direct_writes += 1
        self._granted_direct(key, units, limit)
        return True

    async def _direct_write(self, key: Key, units: int, limit: int, want: int, least: int) -> bool:
        """Add ``units`` to this process's units admitted onto ``key``'s record, deciding on
        the record as last seen; a lost race reads it and decides again (still
        :func:`escrow.direct_units` of it, or False). True once written. A write with no
        clear answer that the read does not show is decided again: should both land, the
        second's units stay spent, never admitted (only taking units off could pass the
        limit so, and that is done by a whole-record give-back)."""
        for _ in range(MAX_ATTEMPTS):
            _, budget, _ = self._known[key]
            if budget is None or budget.stored is None:
                return False
            op = f"{self.run}.{next(self._ops)}"
            most = limit - (budget.granted - budget.direct)
            name = escrow.admit_name(self.node, self.run)
            sent = time.monotonic()
            try:
                item = await self.storage.budget_admit(key, budget.stored, name, units, most, op)
            except StorageUnavailable:
                item = None  # it may have landed: the read tells
            except StorageError as exc:
                self._failed(exc)
                raise
            self.writes += 1
            if item is not None:
                self._known[key] = (item.version, self._decode(key, item), sent)
                return True
            version, stored, sent = await self._read_timed(key)
            self._known[key] = (version, stored, sent)
            mine = None if stored is None else stored.shares.get(self.node)
            if mine is not None and mine.op == op:
                return True
            self.conflicts += 1
            again = escrow.direct_units(
                stored, self.node, self.local.get(key), run=self.run, want=want,
                least=least, limit=limit, nodes=self.nodes(), share_max=self.share_max,
            )  # fmt: skip
            if again < units:
                return False  # (less left than decided on: decide again)
        return False

    def release(self, key: Key, limit: int) -> None:
        """Near the limit (the record as last seen is in the direct zone), give back the
        room this node holds unused on ``key``, in the background (:meth:`_release`): one
        whole-record give-back, as an idle share's."""
        task = asyncio.get_running_loop().create_task(self._release(key, limit))
        self._refills.add(task)
        task.add_done_callback(self._refills.discard)

    async def _release(self, key: Key, limit: int) -> None:
        """:meth:`release` (a failed give-back leaves the units spent in the record, never
        admitted here: the local cap is lowered first and never raised back)."""
        try:
            async with self._lock(key):
                await self._release_held(key, limit)
        except (NoBudget, StorageError) as exc:
            log.warning("escrow: could not give back the share of %r: %s", key, exc)
        finally:
            self._forget_lock(key)

    async def _release_held(self, key: Key, limit: int) -> None:
        loc = self.local.get(key)
        known = self._known.get(key)
        if loc is None or loc.limit != limit or loc.c <= loc.a or known is None:
            return
        budget = known[1]
        if budget is None or budget.stored is None or self.fenced() is not None:
            return
        mine = budget.shares.get(self.node)
        if mine is None or mine.e != loc.e or not escrow.ours(mine, self.run):
            return
        free = limit - budget.granted
        if not escrow.near_limit(free, self.nodes()):
            return  # far from the limit: the room is this node's to use
        # A whole-record give-back (g and c down to what was admitted, the local cap lowered
        # first), not a negative admit: a swap lands at most once however often storage or
        # its client sends it again, where an add sent twice would give back twice.
        await self._give_back(key, loc)

    def _granted_direct(self, key: Key, units: int, limit: int) -> None:
        """``units`` admitted onto the record for this process: its local share's grant and
        cap up by exactly them (the stored share may hold more: another process's, all
        spent, which a later take settles)."""
        loc = self.local.get(key)
        if loc is None:
            self.local[key] = Local(0, units, units, 0, limit, time.monotonic(), 1)
        else:
            loc.g += units
            loc.c += units
            loc.limit = limit  # (a share kept under an old limit for its held units)
        if self.logged:
            self._changed.add(key)
        self.last_error = None

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
            if escrow.direct_units(
                budget, self.node, cur, run=self.run, want=need, least=fewest_of(at_least, need),
                limit=limit, nodes=self.nodes(), share_max=self.share_max,
            ) and key not in self._owed:  # fmt: skip
                raise _Direct
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
        unspent, elsewhere = self._unspent(key, budget)
        return {
            "funded": budget.funded,
            "unspent": unspent,
            "held_elsewhere": elsewhere,
            # A funding begun and not finished: it may have left the ledger already.
            "in_flight": 0 if budget.fund is None else abs(budget.fund[1]),
        }

    def _unspent(self, key: Key, budget: Budget | None) -> tuple[int, int]:
        """What ``key``'s pool holds unspent as ``budget`` and this node's share say, and
        the caps of other nodes' shares, counted as spent in it."""
        if budget is None or budget.funded is None:
            return 0, 0
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
        return max(0, budget.funded - spent), elsewhere

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
        # A return the earlier process may have left in flight: looked at by the upkeep.
        if self.funder is not None:
            lease = self.lease_ms / 1000
            self._returning.update((k, (0.0, lease)) for k, _ in admitted if k == pool_key(k[0]))

    async def _write(
        self,
        key: Key,
        make: Callable[[Budget | None, Local | None, str], escrow.Swap | None],
        since: float | None = None,
    ) -> bool:
        """Decide, compare-and-swap, until a write lands (True) or there is nothing to
        write (False). The first try decides on the record as this node last wrote or read
        it (one round trip when no other node wrote since); a lost race or a lost answer
        reads it first, and so does a refusal (:class:`NoBudget` from ``make``) decided on a
        record seen before ``since`` (None: before this write). A write whose answer was
        lost is recognised by its op id on the read; a write that lost a race is decided
        again on what won it."""
        why = self.fenced()
        if why is not None:
            raise StorageUnavailable(f"escrow: not writing shares: {why}")
        known = self._known.pop(key, None)
        if known is None:
            version, budget, seen = await self._read_timed(key)
            since = seen if since is None else since
        else:
            version, budget, seen = known
        for _ in range(MAX_ATTEMPTS):
            op = f"{self.run}.{next(self._ops)}"
            try:
                swap = make(budget, self.local.get(key), op)
            except NoBudget as exc:
                if since is not None and seen >= since:
                    exc.read_at = seen
                    raise  # decided on a record seen after the call came
                version, budget, seen = await self._read_timed(key)  # kept: maybe old
                since = seen if since is None else since
                continue
            except _Direct:
                self._known[key] = (version, budget, seen)
                raise
            if swap is None:
                self._known[key] = (version, budget, seen)
                return False
            body = swap.budget.to_json()
            sent = time.monotonic()
            try:
                done = await self.storage.budget_swap(key, version, body)
            except StorageUnavailable:
                done = False  # it may have landed: the next read tells
            except StorageError as exc:
                self._failed(exc)
                raise
            self.writes += 1
            if not done:
                version, budget, seen = await self._read_timed(key)
                if not escrow.applied(budget, self.node, op):
                    self.conflicts += 1
                    continue
                assert budget is not None
                swap = escrow.Swap(budget, swap.local, swap.floor, swap.owed)
            else:  # (written whole: nothing admitted onto it yet)
                version, seen = version + 1, sent
                swap = replace(swap, budget=replace(swap.budget, direct=0, stored=body))
            self._known[key] = (version, swap.budget, seen)
            self._keep(key, swap)
            return True
        raise StorageUnavailable(f"escrow: the budget of {key!r} kept changing; retry")

    def _keep(self, key: Key, swap: escrow.Swap) -> None:
        """Take the written share as this node's, keeping what was admitted meanwhile (the
        hot path admitted only within the old cap, which the new one is not below)."""
        new = escrow.adopt(self.node, swap.budget, self.local.get(key), swap.local.limit)
        mine = swap.budget.shares.get(self.node)
        op = "" if mine is None else mine.op
        loc = self.local.get(key)
        if loc is None:
            now = time.monotonic()
            a = swap.local.a  # (units owed were taken off it by the take: settled now)
            left = self._owed.get(key, 0) - swap.owed
            if left > 0:
                self._owed[key] = left
            else:
                self._owed.pop(key, None)
            self.local[key] = Local(
                new.e, new.g, new.c, a, swap.local.limit, now, swap.local.low, op
            )
        else:
            loc.e, loc.g, loc.c, loc.op = new.e, new.g, new.c, op
            loc.a = max(loc.a, swap.floor)  # a share of another process closed: all spent
            loc.limit, loc.low = swap.local.limit, swap.local.low or loc.low
        if self.logged:
            self._changed.add(key)
        if self._earlier:  # the share is this process's now: earlier ones are closed
            for k in [k for k in self._earlier if k[0] == key]:
                del self._earlier[k]
        self.last_error = None

    async def _read(self, key: Key) -> tuple[int, Budget | None]:
        version, budget, _ = await self._read_timed(key)
        return version, budget

    async def _read_timed(self, key: Key) -> tuple[int, Budget | None, float]:
        """The stored record, and when (monotonic) the read began: a refusal decided on it
        answers the calls that arrived before then."""
        self._known.pop(key, None)
        started = time.monotonic()
        try:
            item = await self.storage.budget_read(key)
        except StorageError as exc:
            self._failed(exc)
            raise
        return item.version, self._decode(key, item), started

    def _decode(self, key: Key, item: BudgetItem) -> Budget | None:
        try:
            return decode(item)
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
            frozen = Local(cur.e, cur.g, cur.c, kept, cur.limit, cur.used_at, cur.low, cur.op)
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

    async def ensure_pool(self, key: Key, need: int) -> None:
        """Room for ``need`` credits in this node's share of ``key``'s credit pool (``key``:
        ``(tenant, CREDITS, "")``), moving credits from the tenant's ledger into the pool when
        it runs dry. Raises :class:`InsufficientBalance` when the ledger cannot cover it, and
        :class:`StorageUnavailable` when no funding could be made or finished within
        ``FUND_WAIT_S`` (another node's funding in flight, storage down). The credits come
        from the constructor's ``funder``."""
        funder = self.funder
        if funder is None:
            raise StorageUnavailable("credit pools: this node has no ledger to fund them from")
        deadline = time.monotonic() + FUND_WAIT_S
        pause = 0.01
        while True:
            try:
                await self.ensure(key, need, POOL, 0, background=True)
                self._fund_ahead(key, funder)
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

    def _fund_ahead(self, key: Key, funder: Funder) -> None:
        """Fund the pool in the background once what is left unshared in it is under half
        this process's last funding: a pool near dry hands out slivers that every node
        races for (and calls wait for the funding), so it is topped up before. At most one
        at a time per pool, none for a second after one that did not fund."""
        known = self._known.get(key)
        budget = None if known is None else known[1]
        last = self._fund_size.get(key)
        if budget is None or budget.funded is None or budget.fund is not None or last is None:
            return
        if key in self._ahead or (budget.funded - budget.granted) * 2 >= last[2]:
            return
        if time.monotonic() < self._ahead_not_before.get(key, 0.0):
            return

        async def fund() -> None:
            funded = False
            try:
                funded = await self._fund(key, 1, funder, ahead=True)
            except Exception as exc:  # (a background task: nothing else would see it)
                log.info("credit pool of %r: funding ahead failed: %s", key[0], exc)
            finally:
                del self._ahead[key]
                if not funded:
                    self._ahead_not_before[key] = time.monotonic() + 1.0

        self._ahead[key] = asyncio.get_running_loop().create_task(fund())

    async def _fund(self, key: Key, need: int, funder: Funder, *, ahead: bool = False) -> bool:
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
                granted = 0 if budget is None else budget.granted
                free = funded - granted
                last = self._fund_size.get(key)
                if ahead and (last is None or free * 2 >= last[2]):
                    return False  # (another node topped it up meanwhile)
                loc = self.local.get(key)
                mine = 0 if loc is None else max(0, loc.g - loc.a)
                short = max(1, need - mine - max(0, free))
                available = await funder.available(tenant)
                if ahead and available < short:
                    return False  # (nothing to move ahead: the call that needs it says so)
                if available < short:
                    self.refused += 1
                    raise InsufficientBalance(
                        f"{tenant}: {need} credits needed, {available} available; nothing counted"
                    )
                # At least fund_chunk, or a few calls' worth; more for a fast recent spend:
                # what every node moved into the pool since this process's last funding
                # began, over the time since (at least a second), times the horizon, at most
                # FUND_GROWTH times that (a burst moves a few chunks, not the whole ledger).
                size = max(self.fund_chunk, FUND_CALLS * need)
                began = time.monotonic()
                if last is not None and funded > last[0]:
                    moved = funded - last[0]
                    lasted = max(began - last[1], 1.0)
                    rate_size = int(moved * FUND_HORIZON_S / lasted)
                    size = max(size, min(rate_size, FUND_GROWTH * moved, QTY_CAP))
                amount = min(available, max(short, size))
                new = escrow.begin_fund(budget, amount, now_ms, os.urandom(6).hex())
                assert new.fund is not None
                n = new.fund[0]
                if not await self._swap(key, version, new):
                    return False  # raced (or unsure): read again
                self._funding.add((key, n))  # ours: finished at once, by this process
                budget = new
            assert budget is not None
            landed = await self._finish(key, budget, n, amount, funder)
            if landed and began is not None:  # (the pool's funding then: the next one's size)
                self._fund_size[key] = (funded, began, amount)
            if landed and amount > 0:  # (its grants may expire before the ones in it did)
                self._expire_at(key, funder.pool_expiry(tenant))
            return True

    def _expire_at(self, key: Key, due: float | None) -> None:
        """Look at ``key``'s pool for credits of expired grants at ``due`` at the latest."""
        set_for = self._expiry.get(key)
        if due is not None and (set_for is None or due < set_for):
            self._expiry[key] = due

    async def return_expired(self, key: Key, funder: Funder) -> float | None:
        """Give back to the ledger the part of ``key``'s pool that is of grants past their
        expiry (they expire there in the same write), as far as it is unshared or in this
        node's share (given back first, its cap lowered to what it admitted); the rest, in
        other nodes' shares, may still be spent until they look. When to look again (epoch
        seconds): a lease later while some is left or another node's young funding or
        return is in flight, else at the next expiry, and at most
        :data:`RETURN_BACKOFF_MAX` leases later (another node's funding may bring in
        credits of a grant expiring sooner); ``None``: no pool."""
        tenant = key[0]
        gave = False
        async with self._lock(key):
            for _ in range(MAX_ATTEMPTS):
                settled = await self._settled(key, funder)
                now = self.clock()
                later = now + self.lease_ms / 1000
                if settled is None:
                    return later
                version, budget = settled
                if budget is None or budget.funded is None:
                    return None
                unspent, _ = self._unspent(key, budget)
                gone, next_due = await funder.expired_in_pool(tenant, unspent)
                due = now + RETURN_BACKOFF_MAX * self.lease_ms / 1000
                if next_due is not None:
                    due = min(due, next_due)
                unshared = budget.funded - budget.granted
                loc = self.local.get(key)
                if gone > unshared and loc is not None and loc.g > loc.a and not gave:
                    # Some are in this node's share, unused: given back (nothing more is
                    # admitted from it), so they are unshared, and returned, next time round.
                    await self._give_back(key, loc)
                    gave = True
                    if key not in self.local:  # (no share now: the rest goes back when idle)
                        self._returning[key] = (time.monotonic(), self.lease_ms / 1000)
                    continue
                amount = min(gone, unshared)
                if amount <= 0:
                    return due if gone == 0 else later
                new = escrow.begin_return(budget, amount, int(now * 1000))
                assert new.fund is not None
                n = new.fund[0]
                if not await self._swap(key, version, new):
                    continue  # raced (a share taken or renewed meanwhile): read again
                self._funding.add((key, n))
                landed = await self._finish(key, new, n, -amount, funder)
                return due if landed and gone == amount else later
            return self.clock() + self.lease_ms / 1000

    async def _settled(self, key: Key, funder: Funder) -> tuple[int, Budget | None] | None:
        """``key``'s pool record and its version, with no funding or return in flight: as
        read, or read again after finishing the one in flight if it is this process's or two
        leases old (lock held); ``None`` while another node's young one is, or the record is
        gone meanwhile. A record that is no pool (``None``, or no ``funded``) as read."""
        version, budget = await self._read(key)
        if budget is None or budget.fund is None:
            return version, budget
        n, amount, started = budget.fund
        if (key, n) not in self._funding and self.clock() * 1000 - started < 2 * self.lease_ms:
            return None
        await self._finish(key, budget, n, amount, funder)
        version, again = await self._read(key)
        if again is None or again.fund is not None:
            return None
        return version, again

    async def _finish(self, key: Key, budget: Budget, n: int, amount: int, funder: Funder) -> bool:
        """Send funding or return ``n`` of ``budget`` (``amount`` credits; negative: a return)
        to the ledger under its ref and record the outcome in the pool (lock held); whether
        the ledger took it. Any failure leaves ``(key, n)`` as it was: the next call finishes
        it under the same ref, which lands at most once."""
        tenant = key[0]
        ref = escrow.fund_ref(budget, n)
        # (before a funding, after a return: ``funded`` holds neither in flight)
        unspent, _ = self._unspent(key, budget)
        if amount < 0:
            landed = await funder.give(tenant, -amount, ref, unspent)
            self.returns += 1
            self.returned += -amount if landed else 0
        else:
            landed = await funder.take(tenant, amount, ref, unspent)
            self.fundings += 1
        for _ in range(MAX_ATTEMPTS):
            version, stored = await self._read(key)
            done = None if stored is None else escrow.end_fund(stored, n, landed)
            if done is None or await self._swap(key, version, done):
                self._funding.discard((key, n))
                return landed
        raise StorageUnavailable(f"credit pool of {tenant!r}: the funding kept racing; retry")

    async def return_idle(self, key: Key, funder: Funder) -> bool:
        """Give ``key``'s pool's unshared credits back to the ledger once it is idle
        (:func:`~meter.quotas.escrow.idle_return`: no share with credits promised to nobody
        under a live lease; the unpromised part of expired ones is taken back); first
        finish a funding or return in flight that is this process's or two leases old.
        True when nothing is left to do: returned, or nothing unshared and no share holding
        credits promised to nobody; False to look again later (a share in use, another
        node's young funding or return, a lost race). The return is in the pool's record
        before the ledger is credited under its ref, so a crash between the two is finished
        by the next node, once."""
        async with self._lock(key):
            settled = await self._settled(key, funder)
            if settled is None:
                return False
            version, budget = settled
            if budget is None or budget.funded is None:
                return True
            now_ms = int(self.clock() * 1000)
            unshared = budget.funded is not None and budget.funded > budget.granted
            if not unshared and not any(s.g > s.c for s in budget.shares.values()):
                return True  # (nothing unshared, nothing promised to nobody)
            new = escrow.idle_return(budget, now_ms, self.grace_ms)
            if new is None:
                return False  # a share in use: looked at again later
            assert new.fund is not None
            n, amount, _ = new.fund
            if not await self._swap(key, version, new):
                return False
            self._funding.add((key, n))
            await self._finish(key, new, n, amount, funder)
            return True

    async def _swap(self, key: Key, version: int, new: Budget) -> bool:
        """One compare-and-swap of a whole record; a lost answer settled by reading it."""
        body = new.to_json()
        sent = time.monotonic()
        try:
            if await self.storage.budget_swap(key, version, body):
                # (the next write decides on it without a read)
                self._known[key] = (version + 1, replace(new, direct=0, stored=body), sent)
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
        idle: list[Key] = []
        for key, loc in list(self.local.items()):
            if self._lock(key).locked():
                continue
            try:
                async with self._lock(key):
                    if self.local.get(key) is not loc:
                        continue
                    if now - loc.used_at >= self.lease_ms / 1000:
                        await self._give_back(key, loc)
                        if key == pool_key(key[0]):
                            idle.append(key)
                    elif loc.g > loc.c:
                        await self._write(key, lambda b, cur, op: self._renew(b, cur, op))
            except (NoBudget, StorageError) as exc:
                log.warning("escrow: upkeep of %r failed: %s", key, exc)
            self._forget_lock(key)
        await self._close_earlier_pools()
        await self._return_idle(idle)
        await self._return_expired()

    async def _close_earlier_pools(self, most: int | None = POOLS_PER_PASS) -> None:
        """Close the pool shares an earlier process of this node left (its log says what it
        admitted under each) by taking a share anew: the rest of the old share is free again
        at once, and the new one, idle, goes back with the pool's unspent credits a lease
        later, instead of waiting for this process's next priced call. A pool with no room
        left has nothing of the old share to free: forgotten."""
        pools = sorted({k for k, _ in self._earlier if k == pool_key(k[0]) and k not in self.local})
        for key in pools[:most]:  # (the upkeep: the rest on its next passes; a stop: all)
            if self._lock(key).locked():
                continue
            try:
                await self.ensure(key, 1, POOL, 0, background=True)
            except NoBudget:
                for k in [k for k in self._earlier if k[0] == key]:
                    del self._earlier[k]
            except StorageError as exc:
                log.warning("credit pool of %r: could not close an earlier share: %s", key[0], exc)
            self._forget_lock(key)

    async def _return_idle(self, keys: list[Key], most: int | None = POOLS_PER_PASS) -> None:
        """:meth:`return_idle` for the pools of ``keys`` (whose share this node just gave
        back) and for those whose return must be looked at again (at most once a lease),
        ``most`` of them (None: all), if this node has a funder; a failure is logged, and the
        pool looked at again."""
        funder = self.funder
        if funder is None:
            return
        now = time.monotonic()
        lease = self.lease_ms / 1000
        for key in keys:
            self._returning[key] = (now, lease)
        looked = 0
        for key, (due, wait) in list(self._returning.items()):
            if most is not None and looked >= most:
                break  # (the rest on the next pass: renewals must not wait for them all)
            if due > now or key in self.local or self._lock(key).locked():
                continue
            looked += 1
            try:
                done = await self.return_idle(key, funder)
            except (MeterError, StorageError) as exc:
                log.warning("credit pool of %r: could not give credits back: %s", key[0], exc)
                done = False
            if done:  # (its grants are looked at again when it is used again)
                self._returning.pop(key, None)
                self._expiry.pop(key, None)
            else:  # looked at again later, less often while another node keeps it in use
                self._returning[key] = (now + wait, min(wait * 2, RETURN_BACKOFF_MAX * lease))
            self._forget_lock(key)

    async def _return_expired(self, most: int = POOLS_PER_PASS) -> None:
        """:meth:`return_expired` for the pools whose time has come, ``most`` of them; a
        failure is logged, and the pool looked at again a lease later."""
        funder = self.funder
        if funder is None:
            return
        now = self.clock()
        for key in self.local:  # (a share of a pool, however taken: its grants looked at)
            if key not in self._expiry and key == pool_key(key[0]):
                self._expiry[key] = now
        due = sorted((t, k) for k, t in self._expiry.items() if t <= now)
        for _, key in due[:most]:
            if self._lock(key).locked():
                continue
            again: float | None = now + self.lease_ms / 1000
            try:
                again = await self.return_expired(key, funder)
            except (MeterError, StorageError) as exc:
                log.warning(
                    "credit pool of %r: could not give expired credits back: %s", key[0], exc
                )
            except Exception:  # (the next pools must still be looked at)
                log.exception("credit pool of %r: giving expired credits back failed", key[0])
            if again is None or (key not in self.local and again > now + self.lease_ms / 1000):
                # (nothing left to look at soon, and no share here: looked at again once it
                # holds one; a look to finish a lease later is kept)
                self._expiry.pop(key, None)
            else:
                self._expiry[key] = again
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
        """Forget a counter this node holds no share of once no call waits on it."""
        lock = self._locks.get(key)
        if key in self.local or key in self._demand or (lock is not None and lock.locked()):
            return
        self._locks.pop(key, None)
        self._known.pop(key, None)
        self._verdicts.pop(key, None)

    async def drain(self) -> None:
        """Give back every share (a clean stop): what this node did not admit is the others'."""
        for task in list(self._refills):
            task.cancel()
        if self._ahead:  # (not cancelled: a funding cut off midway holds the pool)
            await asyncio.gather(*self._ahead.values(), return_exceptions=True)
        idle = await self._give_back_all(list(self.local))
        # (then the earlier process's pool shares: closed by taking one, given back at once)
        earlier = {k for k, _ in self._earlier}
        await self._close_earlier_pools(None)
        idle += await self._give_back_all([k for k in self.local if k in earlier])
        for key in self._returning:
            self._returning[key] = (0.0, self._returning[key][1])  # (a stop looks at all now)
        await self._return_idle(idle, None)

    async def _give_back_all(self, keys: list[Key]) -> list[Key]:
        """Give back this process's shares of ``keys`` (the current one of each: a call may
        have replaced it meanwhile); the credit pools among them."""
        pools = []
        for key in keys:
            try:
                async with self._lock(key):
                    loc = self.local.get(key)
                    if loc is not None:
                        await self._give_back(key, loc)
                if key == pool_key(key[0]):
                    pools.append(key)
            except (NoBudget, StorageError) as exc:
                log.warning("escrow: could not give back the share of %r: %s", key, exc)
        return pools

    def status(self) -> dict[str, Any]:
        return {
            "shares": len(self.local),
            "room": sum(max(0, loc.c - loc.a) for loc in self.local.values()),
            "writes": self.writes,
            "direct_writes": self.direct_writes,
            "conflicts": self.conflicts,
            "refused": self.refused,
            "given_back": self.given_back,
            "taken_back": self.taken_back,
            "errors": self.errors,
            "last_error": self.last_error,
        }
