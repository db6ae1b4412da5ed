"""Escrow never admits more than the limit (meter/escrow.py, ADR 0009, Q12).

A hypothesis state machine drives four nodes against one stored budget record with the same
compare-and-swap storage gives: grants and cap raises begun, raced and finished, units
admitted while a write is in flight, writes whose answer is lost (and recognised later by
their op id), give-backs, renewals, admitted units given back (reservations released),
crashes (a process forgets its share; the next one takes over its stored share) and time
passing, so that shares of silent nodes are taken back. Whatever the interleaving, the units
admitted by every process of every node, plus the base, never pass the limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from meter import escrow
from meter.escrow import Budget, Local, NoBudget

NODES = ("n0", "n1", "n2", "n3")
LIMIT = 60
BASE = 5
LEASE_MS = 1000
GRACE_MS = 500


@dataclass
class Pending:
    """A write begun (its compare-and-swap not made yet)."""

    version: int
    plan: escrow.Plan
    op: str
    give_back: bool
    saved_c: int = 0


class Escrow(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.version = 0
        self.budget: Budget | None = None
        self.local: dict[str, Local | None] = dict.fromkeys(NODES)
        self.pending: dict[str, Pending | None] = dict.fromkeys(NODES)
        self.lost: dict[str, str | None] = dict.fromkeys(NODES)  # op of a write heard of never
        #: Writes in flight when their node crashed: they may still land, unheard.
        self.orphans: list[Pending] = []
        #: Units admitted by every process of a node, still admitted.
        self.admitted = dict.fromkeys(NODES, 0)
        #: Units admitted by the node's current process (what it may give back).
        self.by_process = dict.fromkeys(NODES, 0)
        self.now_ms = 10_000
        self.ops = 0

    def _op(self) -> str:
        self.ops += 1
        return f"op{self.ops}"

    # -- writes ----------------------------------------------------------------------------

    @rule(node=st.sampled_from(NODES), need=st.integers(1, 8), want=st.integers(0, 30),
          step=st.integers(1, 6))  # fmt: skip
    def begin_take(self, node: str, need: int, want: int, step: int) -> None:
        if self.pending[node] is not None or self.lost[node] is not None:
            return
        op = self._op()
        try:
            plan = escrow.take(
                self.budget, node, self.local[node], need=need, want=want, step=step,
                limit=LIMIT, base=BASE, now_ms=self.now_ms, lease_ms=LEASE_MS,
                grace_ms=GRACE_MS, op=op,
            )  # fmt: skip
        except NoBudget:
            return
        self.pending[node] = Pending(self.version, plan, op, give_back=False)

    @rule(node=st.sampled_from(NODES))
    def begin_give_back(self, node: str) -> None:
        loc = self.local[node]
        if self.pending[node] is not None or self.lost[node] is not None or loc is None:
            return
        if self.budget is None:
            return
        saved = loc.c
        loc.c = loc.a  # as Shares._give_back: nothing admitted past what the write keeps
        op = self._op()
        plan = escrow.give_back(self.budget, node, loc, op)
        if plan is None:
            loc.c = saved
            return
        self.pending[node] = Pending(self.version, plan, op, give_back=True, saved_c=saved)

    @rule(node=st.sampled_from(NODES))
    def renew(self, node: str) -> None:
        loc = self.local[node]
        if self.pending[node] is not None or self.lost[node] is not None or loc is None:
            return
        if self.budget is None:
            return
        plan = escrow.renew(self.budget, node, loc, self.now_ms, LEASE_MS, self._op())
        if plan is not None:
            self.pending[node] = Pending(self.version, plan, plan.budget.shares[node].op, False)

    @rule(node=st.sampled_from(NODES), lose_answer=st.booleans())
    def finish(self, node: str, lose_answer: bool) -> None:
        p = self.pending[node]
        if p is None:
            return
        self.pending[node] = None
        if p.version != self.version:  # lost the race: nothing written
            if p.give_back and self.local[node] is not None:
                loc = self.local[node]
                assert loc is not None
                loc.c = max(loc.c, p.saved_c)
            return
        self.budget, self.version = p.plan.budget, self.version + 1
        if lose_answer:
            self.lost[node] = p.op  # the node learns of it by reading again, below
            return
        self._keep(node, p.plan.budget)

    @rule(node=st.sampled_from(NODES))
    def read_after_a_lost_answer(self, node: str) -> None:
        op = self.lost[node]
        if op is None:
            return
        self.lost[node] = None
        if escrow.applied(self.budget, node, op):
            assert self.budget is not None
            self._keep(node, self.budget)

    def _keep(self, node: str, budget: Budget) -> None:
        """As Shares._keep: the stored share, with what was admitted meanwhile."""
        loc = self.local[node]
        new = escrow.adopt(node, budget, loc, LIMIT)
        if loc is None:
            # A new process: everything up to the stored cap counted as spent.
            self.local[node] = new
        else:
            loc.e, loc.g, loc.c = new.e, new.g, new.c

    # -- the hot path ----------------------------------------------------------------------

    @rule(node=st.sampled_from(NODES), q=st.integers(1, 12))
    def admit(self, node: str, q: int) -> None:
        loc = self.local[node]
        if loc is not None and loc.a + q <= loc.c:
            loc.a += q
            self.admitted[node] += q
            self.by_process[node] += q

    @rule(node=st.sampled_from(NODES), q=st.integers(1, 5))
    def free(self, node: str, q: int) -> None:
        loc = self.local[node]
        if loc is not None and q <= self.by_process[node]:
            loc.a = max(0, loc.a - q)
            self.admitted[node] -= q
            self.by_process[node] -= q

    # -- failures and time -----------------------------------------------------------------

    @rule(node=st.sampled_from(NODES))
    def crash(self, node: str) -> None:
        p = self.pending[node]
        if p is not None:
            self.orphans.append(p)  # a write in flight may still land: see land_after_crash
        self.local[node] = None
        self.pending[node] = None
        self.lost[node] = None
        self.by_process[node] = 0

    @precondition(lambda self: bool(self.orphans))
    @rule(data=st.data())
    def land_after_crash(self, data: st.DataObject) -> None:
        """A write in flight whose node crashed before the answer: it lands, unheard (if no
        other write came first)."""
        p = self.orphans.pop(data.draw(st.integers(0, len(self.orphans) - 1)))
        if p.version == self.version:
            self.budget, self.version = p.plan.budget, self.version + 1

    @rule(ms=st.integers(1, 2000))
    def time_passes(self, ms: int) -> None:
        self.now_ms += ms

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def never_past_the_limit(self) -> None:
        assert BASE + sum(self.admitted.values()) <= LIMIT, (self.admitted, self.budget)

    @invariant()
    def grants_fit_and_caps_hold(self) -> None:
        if self.budget is None:
            return
        assert self.budget.granted <= LIMIT
        for node, s in self.budget.shares.items():
            assert 0 <= s.c <= s.g
            loc = self.local[node]
            if loc is not None:
                assert loc.a <= loc.c, (node, loc, s)
                if loc.e == s.e:
                    assert loc.c <= s.c, (node, loc, s)


TestEscrow = Escrow.TestCase
TestEscrow.settings = settings(
    max_examples=400,
    stateful_step_count=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_a_crashed_nodes_unpromised_units_come_back_after_its_lease() -> None:
    """Node a takes 40 with a cap of 10 and dies; b gets the 30 never promised, not more."""
    b0 = escrow.take(None, "a", None, need=5, want=40, step=5, limit=50, base=0,
                     now_ms=0, lease_ms=1000, grace_ms=500, op="1").budget  # fmt: skip
    assert b0.shares["a"].g == 40 and b0.shares["a"].c == 10
    with_b = escrow.take(b0, "b", None, need=10, want=10, step=0, limit=50, base=0,
                         now_ms=100, lease_ms=1000, grace_ms=500, op="2")  # fmt: skip
    assert with_b.budget.granted == 50
    try:  # before the lease (and grace) ended, a's share stays a's
        escrow.take(with_b.budget, "b", with_b.local, need=with_b.local.room + 1, want=1,
                    step=0, limit=50, base=0, now_ms=1400, lease_ms=1000, grace_ms=500,
                    op="3")  # fmt: skip
        raise AssertionError("took from a live share")
    except NoBudget:
        pass
    after = escrow.take(with_b.budget, "b", with_b.local, need=40, want=40, step=0, limit=50,
                        base=0, now_ms=1600, lease_ms=1000, grace_ms=500, op="4")  # fmt: skip
    assert after.budget.shares["a"].g == after.budget.shares["a"].c == 10
    assert after.budget.shares["a"].e == 1  # a's next write finds its share moved on
    assert after.local.room == 40  # b's 10 and a's 30 never promised
    try:
        escrow.take(after.budget, "b", after.local, need=after.local.c - after.local.a + 1,
                    want=0, step=0, limit=50, base=0, now_ms=1600, lease_ms=1000,
                    grace_ms=500, op="5")  # fmt: skip
        raise AssertionError("took a's promised units")
    except NoBudget:
        pass
