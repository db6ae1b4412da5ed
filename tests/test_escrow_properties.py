"""Escrow never admits more than the limit (meter/quotas/escrow.py, ADR 0009, Q12).

A hypothesis state machine drives four nodes against one stored budget record with the same
compare-and-swap storage gives: grants and cap raises begun, raced and finished, units
admitted while a write is in flight, writes whose answer is lost (and recognised later by
their op id), give-backs, renewals, admitted units given back (reservations released),
crashes (a process forgets its share; the next one takes over its stored share) and time
passing, so that shares of silent nodes are taken back; and, near the limit, units admitted
straight onto the record (ADR 0014: decided on the record as last seen, landing only on that
body and within what is left, maybe late or twice, folded into their process's share).
Whatever the interleaving, the units admitted by every process of every node, plus the
base, never pass the limit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from meter.core.ports import NoBudget
from meter.quotas import escrow
from meter.quotas.escrow import Budget, Local

#: Processes and the node id each runs under: p0 and p1 share n0 (a second process under one
#: id, as an explicit ``METER_NODE_ID`` on two hosts makes while its claim is unknown).
PROCS = {"p0": "n0", "p1": "n0", "p2": "n1", "p3": "n2"}
NODES = tuple(PROCS)
LIMIT = 60
BASE = 5
LEASE_MS = 1000
GRACE_MS = 500


@dataclass
class Pending:
    """A write begun (its compare-and-swap not made yet)."""

    version: int
    swap: escrow.Swap
    op: str
    kind: str  # take, give_back, renew


@dataclass
class Direct:
    """A write of units onto the record begun (``Storage.budget_admit`` not made yet)."""

    body: str  # the body it was decided on
    name: str
    units: int  # negative: given back
    most: int
    op: str


class Escrow(RuleBasedStateMachine):
    """Processes ``p*`` (``Shares`` reduced to its decisions) against one budget record."""

    def __init__(self) -> None:
        super().__init__()
        self.version = 0
        #: The record's body as last written whole, and the units admitted onto it since
        #: (name -> units, op), as storage holds them; ``budget`` is what a read returns.
        self.body: Budget | None = None
        self.entries: dict[str, tuple[int, str]] = {}
        self.local: dict[str, Local | None] = dict.fromkeys(NODES)
        self.pending: dict[str, Pending | None] = dict.fromkeys(NODES)
        self.direct: dict[str, Direct | None] = dict.fromkeys(NODES)
        self.lost_direct: dict[str, tuple[str, int] | None] = dict.fromkeys(NODES)
        self.lost: dict[str, str | None] = dict.fromkeys(NODES)  # op of a write heard of never
        self.lost_floor = dict.fromkeys(NODES, 0)
        self.lost_owed = dict.fromkeys(NODES, 0)
        #: Writes in flight when their process crashed: they may still land, unheard.
        self.orphans: list[Pending | Direct] = []
        #: Units admitted by every process of a node id, still admitted.
        self.admitted = dict.fromkeys(sorted(set(PROCS.values())), 0)
        #: Units admitted by the current process (what it may give back).
        self.by_process = dict.fromkeys(NODES, 0)
        #: Units given back while the process had no share (Shares._owed).
        self.owed = dict.fromkeys(NODES, 0)
        #: The run of each process (a crash starts a new one).
        self.runs = {p: f"{p}r0" for p in NODES}
        #: (node id, run) -> what that process had admitted under its share when it crashed,
        #: as its write-ahead log says (Shares.recovered): its successor closes it at that.
        self.logged: dict[tuple[str, str], int] = {}
        self.now_ms = 10_000
        self.ops = 0

    def _op(self, p: str) -> str:
        self.ops += 1
        return f"{self.runs[p]}.{self.ops}"

    def _busy(self, p: str) -> bool:
        return any(
            x is not None
            for x in (self.pending[p], self.lost[p], self.direct[p], self.lost_direct[p])
        )

    @property
    def budget(self) -> Budget | None:
        """The record as a read returns it: the body, the units admitted onto it folded in."""
        if self.body is None:
            return None
        rows = tuple((n, u, op) for n, (u, op) in sorted(self.entries.items()))
        return self.body.admitted(rows, self.body.to_json())

    def _write_whole(self, budget: Budget) -> None:
        self.body, self.entries, self.version = budget, {}, self.version + 1

    # -- writes ----------------------------------------------------------------------------

    @rule(p=st.sampled_from(NODES), need=st.integers(1, 8), want=st.integers(0, 30),
          step=st.integers(1, 6))  # fmt: skip
    def begin_take(self, p: str, need: int, want: int, step: int) -> None:
        if self._busy(p):
            return
        op = self._op(p)
        mine = None if self.budget is None else self.budget.shares.get(PROCS[p])
        spent = None
        if mine is not None and self.local[p] is None:
            spent = self.logged.get((PROCS[p], mine.op.partition(".")[0]))
        try:
            swap = escrow.take(
                self.budget, PROCS[p], self.local[p], run=self.runs[p], need=need, want=want,
                step=step, limit=LIMIT, base=BASE, now_ms=self.now_ms, lease_ms=LEASE_MS,
                grace_ms=GRACE_MS, op=op, owed=self.owed[p] if self.local[p] is None else 0,
                spent=spent,
            )  # fmt: skip
        except NoBudget:
            return
        self.pending[p] = Pending(self.version, swap, op, "take")

    @rule(p=st.sampled_from(NODES))
    def begin_give_back(self, p: str) -> None:
        """As Shares._give_back: the cap lowered to what was admitted, never raised back;
        the write keeps that (``kept``), whatever is freed before it lands."""
        loc = self.local[p]
        if self._busy(p) or loc is None or self.budget is None:
            return
        kept = loc.c = loc.a
        frozen = Local(loc.e, loc.g, loc.c, kept, loc.limit)
        op = self._op(p)
        swap = escrow.give_back(self.budget, PROCS[p], frozen, op, self.runs[p])
        if swap is not None:
            self.pending[p] = Pending(self.version, swap, op, "give_back")

    @rule(p=st.sampled_from(NODES))
    def renew(self, p: str) -> None:
        loc = self.local[p]
        if self._busy(p) or loc is None or self.budget is None:
            return
        op = self._op(p)
        swap = escrow.renew(self.budget, PROCS[p], loc, self.now_ms, LEASE_MS, op, self.runs[p])
        if swap is not None:
            self.pending[p] = Pending(self.version, swap, op, "renew")

    @rule(p=st.sampled_from(NODES), lose_answer=st.booleans())
    def finish(self, p: str, lose_answer: bool) -> None:
        w = self.pending[p]
        if w is None:
            return
        self.pending[p] = None
        if w.version != self.version:  # lost the race: nothing written (a cap stays lowered)
            return
        self._write_whole(w.swap.budget)
        if lose_answer:
            self.lost[p] = w.op  # the process learns of it by reading again, or never
            self.lost_floor[p] = w.swap.floor
            self.lost_owed[p] = w.swap.owed
            return
        self._keep(p, w.swap.budget, w.swap.floor, w.swap.owed)

    @rule(p=st.sampled_from(NODES), read_fails=st.booleans())
    def read_after_a_lost_answer(self, p: str, read_fails: bool) -> None:
        op = self.lost[p]
        if op is None:
            return
        self.lost[p] = None
        if read_fails:
            return  # the write raised: the process goes on with what it knew
        if escrow.applied(self.budget, PROCS[p], op):
            assert self.budget is not None
            self._keep(p, self.budget, self.lost_floor[p], self.lost_owed[p])

    def _keep(self, p: str, budget: Budget, floor: int, owed: int) -> None:
        """As Shares._keep: the stored share, with what was admitted meanwhile."""
        loc = self.local[p]
        new = escrow.adopt(PROCS[p], budget, loc, LIMIT)
        if loc is None:
            new.a = max(0, new.a - owed)  # (the take counted it; adopt did not)
            self.owed[p] = max(0, self.owed[p] - owed)
            self.local[p] = new
        else:
            loc.e, loc.g, loc.c = new.e, new.g, new.c
            loc.a = max(loc.a, floor)

    # -- near the limit: units admitted straight onto the record (ADR 0014) -----------------

    @rule(p=st.sampled_from(NODES), want=st.integers(1, 12), least=st.integers(1, 12),
          nodes=st.integers(1, 4), share_max=st.integers(1, 30))  # fmt: skip
    def begin_direct(self, p: str, want: int, least: int, nodes: int, share_max: int) -> None:
        """As Shares._admit_direct: decided on the record as it is now (it may have moved
        on by the time the write lands); a record not made yet is made by it."""
        if self._busy(p) or self.owed[p]:
            return
        budget = self.budget
        if budget is None and self.version == 0:
            fresh = Budget(BASE, {})
            budget = replace(fresh, stored=fresh.to_json())
        units = escrow.direct_units(
            budget, PROCS[p], self.local[p], run=self.runs[p], want=want,
            least=min(want, least), limit=LIMIT, nodes=nodes, share_max=share_max,
        )  # fmt: skip
        if units <= 0 or budget is None or budget.stored is None:
            return
        most = LIMIT - (budget.granted - budget.direct)
        name = escrow.admit_name(PROCS[p], self.runs[p])
        self.direct[p] = Direct(budget.stored, name, units, most, self._op(p))

    def _land(self, w: Direct) -> bool:
        """Storage's budget_admit: only on the body it was decided on (or making the record),
        within what is left, never twice under one op."""
        stored = None if self.body is None else self.body.to_json()
        mine = self.entries.get(w.name, (0, ""))
        total = sum(u for u, _ in self.entries.values())
        if (stored is not None and stored != w.body) or total + w.units > w.most:
            return False
        if mine[1] == w.op:
            return False
        if self.body is None:
            self.body = Budget.from_json(w.body)
        self.entries[w.name] = (mine[0] + w.units, w.op)
        self.version += 1
        return True

    @rule(p=st.sampled_from(NODES), lose_answer=st.booleans())
    def finish_direct(self, p: str, lose_answer: bool) -> None:
        w = self.direct[p]
        if w is None:
            return
        self.direct[p] = None
        self._finish_direct(p, w, lose_answer)

    @rule(p=st.sampled_from(NODES))
    def direct_unclear(self, p: str) -> None:
        """An admit with no clear answer that has not landed yet: it may land any time later
        (an orphan); the process, seeing it missing on its read, goes on (and may send
        added units again under a new op; units taken off it never sends again)."""
        w = self.direct[p]
        if w is not None:
            self.direct[p] = None
            self.orphans.append(w)

    def _finish_direct(self, p: str, w: Direct, lose_answer: bool) -> None:
        if not self._land(w):
            return  # a condition failed: nothing written (a released cap stays lowered)
        if lose_answer:
            self.lost_direct[p] = (w.op, w.units)
            return
        self._granted(p, w.units)

    @rule(p=st.sampled_from(NODES), read_fails=st.booleans())
    def read_after_a_lost_direct(self, p: str, read_fails: bool) -> None:
        lost = self.lost_direct[p]
        if lost is None:
            return
        self.lost_direct[p] = None
        budget = self.budget
        mine = None if budget is None else budget.shares.get(PROCS[p])
        if not read_fails and mine is not None and mine.op == lost[0]:
            self._granted(p, lost[1])

    @rule(p=st.sampled_from(NODES), want=st.integers(1, 12), nodes=st.integers(1, 4))
    def burst_onto_the_record(self, p: str, want: int, nodes: int) -> None:
        """A pass near the limit in one step: units admitted onto the record, then all the
        room the process has admitted (as its waiting calls do)."""
        self.begin_direct(p, want, want, nodes, want)
        w = self.direct[p]
        if w is not None:
            self.direct[p] = None
            self._finish_direct(p, w, False)
        loc = self.local[p]
        if loc is not None and loc.c > loc.a:
            self.admit(p, loc.c - loc.a)

    def _granted(self, p: str, units: int) -> None:
        """As Shares._granted_direct (a give-back lowered the local share before writing)."""
        if units < 0:
            return
        loc = self.local[p]
        if loc is None:
            self.local[p] = Local(0, units, units, 0, LIMIT)
        else:
            loc.g += units
            loc.c += units

    # -- the hot path ----------------------------------------------------------------------

    @rule(p=st.sampled_from(NODES), q=st.integers(1, 12))
    def admit(self, p: str, q: int) -> None:
        loc = self.local[p]
        if loc is not None and loc.a + q <= loc.c:
            loc.a += q
            self.admitted[PROCS[p]] += q
            self.by_process[p] += q

    @rule(p=st.sampled_from(NODES), q=st.integers(1, 5))
    def free(self, p: str, q: int) -> None:
        """Units admitted (held) and never used go back, any time, writes in flight or not;
        with no share they are owed to the next (Shares.free)."""
        if q > self.by_process[p]:
            return
        loc = self.local[p]
        if loc is not None:
            loc.a = max(0, loc.a - q)
        else:
            self.owed[p] += q
        self.admitted[PROCS[p]] -= q
        self.by_process[p] -= q

    @rule(p=st.sampled_from(NODES))
    def forget_share(self, p: str) -> None:
        """Shares drops a local share once given back in full (g == c == a)."""
        loc = self.local[p]
        if loc is not None and not self._busy(p) and loc.g == loc.c == loc.a:
            self.local[p] = None

    # -- failures and time -----------------------------------------------------------------

    @rule(p=st.sampled_from(NODES))
    def crash(self, p: str) -> None:
        w = self.pending[p]
        if w is not None:
            self.orphans.append(w)  # a write in flight may still land: see land_after_crash
        d = self.direct[p]
        if d is not None:
            self.orphans.append(d)
        self.direct[p] = None
        self.lost_direct[p] = None
        loc = self.local[p]
        if loc is not None and self.owed[p] == 0:  # (the log's last SHARES record of it)
            self.logged[(PROCS[p], self.runs[p])] = loc.a
        self.local[p] = None
        self.pending[p] = None
        self.lost[p] = None
        self.by_process[p] = 0
        self.owed[p] = 0
        self.runs[p] = self.runs[p] + "x"

    @precondition(lambda self: bool(self.orphans))
    @rule(data=st.data())
    def land_after_crash(self, data: st.DataObject) -> None:
        """A write in flight whose process crashed before the answer: it lands, unheard (if
        no other write came first)."""
        w = self.orphans.pop(data.draw(st.integers(0, len(self.orphans) - 1)))
        if isinstance(w, Direct):
            self._land(w)
        elif w.version == self.version:
            self._write_whole(w.swap.budget)

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
        for s in self.budget.shares.values():
            assert 0 <= s.c <= s.g
        for p, loc in self.local.items():
            if loc is not None:
                assert loc.a <= loc.c, (p, loc)


TestEscrow = Escrow.TestCase
TestEscrow.settings = settings(
    max_examples=500,
    stateful_step_count=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_a_crashed_nodes_unpromised_units_come_back_after_its_lease() -> None:
    """Node a takes 40 with a cap of 10 and dies; b gets the 30 never promised, not more."""
    b0 = escrow.take(None, "a", None, run="ra", need=5, want=40, step=5, limit=50, base=0,
                     now_ms=0, lease_ms=1000, grace_ms=500, op="ra.1").budget  # fmt: skip
    assert b0.shares["a"].g == 40 and b0.shares["a"].c == 10
    with_b = escrow.take(b0, "b", None, run="rb", need=10, want=10, step=0, limit=50, base=0,
                         now_ms=100, lease_ms=1000, grace_ms=500, op="rb.2")  # fmt: skip
    assert with_b.budget.granted == 50
    try:  # before the lease (and grace) ended, a's share stays a's
        escrow.take(with_b.budget, "b", with_b.local, run="rb", need=with_b.local.room + 1, want=1,
                    step=0, limit=50, base=0, now_ms=1400, lease_ms=1000, grace_ms=500,
                    op="rb.3")  # fmt: skip
        raise AssertionError("took from a live share")
    except NoBudget:
        pass
    after = escrow.take(with_b.budget, "b", with_b.local, run="rb", need=40, want=40, step=0,
                        limit=50, base=0, now_ms=1600, lease_ms=1000, grace_ms=500,
                        op="rb.4")  # fmt: skip
    assert after.budget.shares["a"].g == after.budget.shares["a"].c == 10
    assert after.budget.shares["a"].e == 1  # a's next write finds its share moved on
    assert after.local.room == 40  # b's 10 and a's 30 never promised
    try:
        escrow.take(after.budget, "b", after.local, run="rb",
                    need=after.local.c - after.local.a + 1, want=0, step=0, limit=50, base=0,
                    now_ms=1600, lease_ms=1000, grace_ms=500, op="rb.5")  # fmt: skip
        raise AssertionError("took a's promised units")
    except NoBudget:
        pass


@settings(max_examples=300, deadline=None)
@given(
    first=st.integers(1, 40),
    step=st.integers(1, 10),
    admitted=st.integers(0, 40),
    others=st.lists(st.integers(1, 12), max_size=4),
)
def test_a_successor_closes_its_predecessors_share_at_what_the_log_says(
    first: int, step: int, admitted: int, others: list[int]
) -> None:
    """A process takes a share, admits some of it and crashes; its successor (same node id,
    a new run) closes the share at what the log says it admitted, not at its cap: then the
    fleet can admit exactly the rest of the limit, and never more."""
    kw: dict[str, Any] = {"limit": LIMIT, "base": BASE, "lease_ms": LEASE_MS, "grace_ms": GRACE_MS}
    swap = escrow.take(None, "n0", None, run="r0", need=first, want=first, step=step,
                       now_ms=0, op="r0.1", **kw)  # fmt: skip
    dead = swap.local
    dead.a = min(admitted, dead.c)  # what it admitted, as its log's last SHARES record says
    budget = swap.budget
    # The successor's first take closes the share at exactly that.
    after = escrow.take(budget, "n0", None, run="r1", need=1, want=1, step=1, now_ms=1,
                        op="r1.1", spent=dead.a, **kw)  # fmt: skip
    assert after.floor == dead.a
    total = dead.a
    budget, loc = after.budget, after.local
    # Every node (the successor and others) admits until the budget is gone.
    nodes = [("n0", "r1", loc)] + [(f"m{i}", f"q{i}", None) for i in range(len(others))]
    ops = 10
    progress = True
    while progress:
        progress = False
        for i, (node, run, cur) in enumerate(nodes):
            want = others[i - 1] if i else 3
            if cur is not None and cur.a < cur.c:
                total += cur.c - cur.a
                cur.a = cur.c
                progress = True
            ops += 1
            try:
                s = escrow.take(budget, node, cur, run=run, need=1, want=want, step=want,
                                now_ms=2, op=f"{run}.{ops}", **kw)  # fmt: skip
            except NoBudget:
                continue
            budget = s.budget
            nodes[i] = (
                node,
                run,
                s.local if cur is None else escrow.adopt(node, budget, cur, LIMIT),
            )
            progress = True
        assert BASE + total <= LIMIT
    assert BASE + total == LIMIT, (total, budget)
