"""The credits of a tenant's ledger and its credit pool, together, whatever the order of
grants, debits, priced spends on two processes, fundings, idle give-backs, give-backs of
expired grants' credits from a pool in use, clean stops, kill -9s (with the ``fsync`` log's
counts) and restarts, and time passing over expiries (docs/ledger.md, "Credit-metered
features"; correctness L10).

At every step, read straight from storage (no write): the ledger's own invariants hold; the
pool's ``funded`` is what the ledger moved into it less what it gave back (every funding and
every return counted once), and the grants note at most that as pooled; nothing is spent
past what was funded; and ``grants - debits - expired - spent = ledger balance + pool unspent``.
Once every process has stopped cleanly, the pool holds exactly what was spent: every unspent
credit is back in the ledger, those of a killed process too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from meter.core.gate import pool_key
from meter.core.keys import Key
from meter.core.ports import POOL
from meter.errors import InsufficientBalance
from meter.ledger import model as ledger
from meter.ledger.funding import LedgerFunder
from meter.ledger.store import LedgerStore
from meter.quotas.shares import Shares, decode
from storage.memory import MemoryStorage

T = TypeVar("T")
TENANT = "acme"
POOL_KEY = pool_key(TENANT)
NODES = ("n0", "n1")


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


class PoolLedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.store = MemoryStorage()
        self.clock = Clock()
        self.book = LedgerStore(self.store, clock=self.clock, backoff_cap=0)
        self.funder = LedgerFunder(self.book)
        self.chunk = 40
        self.procs = [self._process(node) for node in NODES]
        self.seq = 0
        #: Credits spent by priced calls (admitted from the pool), by every process.
        self.spent = 0

    def teardown(self) -> None:
        self.loop.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro``, then every task it started (refills, fundings ahead) to its end, so
        each step's writes are all in before the invariants read."""

        async def step() -> T:
            out = await coro
            while rest := [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                await asyncio.gather(*rest, return_exceptions=True)
            return out

        return self.loop.run_until_complete(step())

    def _process(self, node: str) -> Shares:
        shares = Shares(
            self.store, node, lease_ms=10_000, clock=self.clock, logged=True, funder=self.funder
        )
        shares.fund_chunk = self.chunk
        return shares

    @initialize(chunk=st.sampled_from([40, 400]))
    def funding_size(self, chunk: int) -> None:
        """Small fundings (many fundings and returns in a short run), or large ones (pools
        with credits no share holds, of grants that expire while it is in use)."""
        self.chunk = chunk
        for shares in self.procs:
            shares.fund_chunk = chunk

    def _ref(self) -> str:
        self.seq += 1
        return f"r{self.seq}"

    @rule(
        amount=st.integers(1, 150),
        priority=st.integers(-1, 1),
        expires_in=st.none() | st.integers(1, 40),
    )
    def grant(self, amount: int, priority: int, expires_in: int | None) -> None:
        at = None if expires_in is None else int(self.clock.now) + expires_in
        op = ledger.credit(amount, self._ref(), priority=priority, expires_at=at)
        self._run(self.book.apply(TENANT, op))

    @rule(amount=st.integers(1, 60))
    def debit(self, amount: int) -> None:
        with contextlib.suppress(InsufficientBalance):
            self._run(self.book.apply(TENANT, ledger.debit(amount, self._ref())))

    @rule(proc=st.integers(0, 1), qty=st.integers(1, 30))
    def spend(self, proc: int, qty: int) -> None:
        """A priced call of ``qty`` credits on a process: room made in its pool share (a
        funding if needed), then admitted from memory."""
        shares = self.procs[proc]

        async def call() -> bool:
            try:
                await shares.ensure_pool(POOL_KEY, qty)
            except InsufficientBalance:
                return False
            assert shares.ready(POOL_KEY, qty, POOL)
            shares.admit(POOL_KEY, qty)
            return True

        if self._run(call()):
            self.spent += qty

    @rule(proc=st.integers(0, 1))
    def idle(self, proc: int) -> None:
        """The process's upkeep after its shares were idle for a lease: given back, and the
        pool's unshared credits returned if no share is in use."""
        shares = self.procs[proc]
        for loc in shares.local.values():
            loc.used_at = float("-inf")  # (idle for a lease, without waiting one)
        self._run(shares.step())

    @rule(proc=st.integers(0, 1), wait=st.sampled_from([0, 41]))
    def give_back_expired(self, proc: int, wait: int) -> None:
        """The upkeep's look for credits of grants past their expiry in the pool (in use or
        not), at once or after every grant so far has expired: afterwards none is left in
        the pool as the process sees it, unless every credit of the pool is in the other
        process's share (those may still be spent): its own holds none it could admit."""
        self.clock.now += wait
        shares = self.procs[proc]
        self._run(shares.return_expired(POOL_KEY, self.funder))
        pool = self._pool()
        if pool is None or pool.funded is None:
            return
        _, body = self._run(self.store.ledger_read(TENANT))
        grants = ledger.decode_state(body).grants
        unspent = self._run(shares.pool(TENANT))["unspent"]
        gone, _ = ledger.expired_in_pool(grants, unspent, self.clock.now)
        loc = shares.local.get(POOL_KEY)
        room = 0 if loc is None else loc.g - loc.a
        assert gone == 0 or (pool.funded == pool.granted and room == 0), (gone, pool, loc)

    @rule(proc=st.integers(0, 1))
    def stop_and_start(self, proc: int) -> None:
        self._run(self.procs[proc].drain())
        self.procs[proc] = self._process(NODES[proc])

    @rule(proc=st.integers(0, 1))
    def kill_and_restart(self, proc: int) -> None:
        """kill -9: nothing given back; the next process of the node replays what the
        ``fsync`` log holds, every admitted count of the dead one's shares."""
        dead = self.procs[proc]
        logged: dict[tuple[Key, str], int] = {
            ((t, f, p), run): a for t, f, p, run, a in dead.admitted_all()
        }
        self.procs[proc] = self._process(NODES[proc])
        self.procs[proc].recovered(logged)

    @rule(seconds=st.integers(1, 25))
    def time_passes(self, seconds: int) -> None:
        self.clock.now += seconds

    @precondition(lambda self: self.spent > 0)
    @rule()
    def every_process_stops(self) -> None:
        """Both stop cleanly: the pool keeps exactly what was spent, nothing more."""
        for i, shares in enumerate(self.procs):
            self._run(shares.drain())
            self.procs[i] = self._process(NODES[i])
        pool = self._pool()
        assert pool is not None and pool.funded == self.spent, (pool, self.spent)
        assert pool.granted == pool.funded

    def _pool(self) -> Any:
        return decode(self._run(self.store.budget_read(POOL_KEY)))

    @invariant()
    def credits_add_up(self) -> None:
        _, body = self._run(self.store.ledger_read(TENANT))
        state = ledger.decode_state(body)
        entries = [
            ledger.decode_entry(b)
            for _, b in self._run(self.store.ledger_entries(TENANT, 0, 100_000))
        ]
        ledger.check(state, entries)
        pool = self._pool()
        funded = 0 if pool is None or pool.funded is None else pool.funded
        assert pool is None or pool.fund is None  # (every step awaits its writes)
        moved = sum(-e.amount for e in entries if e.kind == ledger.POOLED)
        back = sum(e.amount for e in entries if e.kind == ledger.UNPOOLED)
        assert funded == moved - back
        # Grants keep count of the pool's credits not known to be spent, at most all of them.
        assert sum(g.pooled for g in state.grants) <= funded
        assert self.spent <= funded  # never an overdraft
        granted = sum(e.amount for e in entries if e.kind == ledger.GRANT)
        debited = sum(-e.amount for e in entries if e.kind == ledger.DEBIT)
        expired = sum(-e.amount for e in entries if e.kind == ledger.EXPIRE)
        unspent = funded - self.spent
        assert granted - debited - expired - self.spent == state.balance + unspent
        shown = ledger.in_pool(state.grants, unspent)
        assert sum(shown.values()) <= unspent
        pooled = {g.seq: g.pooled for g in state.grants}
        assert all(0 < n <= pooled[seq] for seq, n in shown.items())
        # Only grants past their expiry expire, at most what they granted.
        grants = {e.seq: e for e in entries if e.kind == ledger.GRANT}
        gone: dict[int, int] = {}
        for e in (e for e in entries if e.kind == ledger.EXPIRE):
            for seq, n in e.alloc:
                g = grants.get(seq)  # (a grant of its own for credits no grant kept: none)
                assert g is not None and g.expires_at is not None and e.time >= g.expires_at, e
                gone[seq] = gone.get(seq, 0) + n
        assert all(n <= grants[seq].amount for seq, n in gone.items()), gone


TestPoolLedger = PoolLedgerMachine.TestCase
TestPoolLedger.settings = settings(
    max_examples=250,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
