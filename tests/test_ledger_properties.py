"""The credits ledger keeps its invariants whatever happens (docs/ledger.md, B01-B06).

A hypothesis state machine drives two ledger books (two nodes) over one store - grants,
debits, time passing (grants expire), the same ref sent twice, a ref reused with another
request, writes refused because the other node moved the version, writes whose answer is lost
after they landed, writes that fail before landing, and storage down - and checks every step
against a simple model: a list of grants with what is left of each.

Checked after every step: the balance is the sum of the entries and of the open grants and
never negative; an insufficient debit changes nothing; a ref lands at most once and repeats
its first answer; a debit takes from grants in spending order; an expired grant stops counting
without touching the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from meter.errors import Conflict, InsufficientBalance, InvalidArgument, Unavailable
from meter.ledger import model as ledger
from meter.ledger.store import LedgerStore
from storage.memory import MemoryStorage

T = TypeVar("T")
TENANT = "acme"
REFS = [f"r{i}" for i in range(12)]


@dataclass
class MGrant:
    seq: int
    remaining: int
    priority: int
    expires_at: int | None


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.store = MemoryStorage()
        self.clock = Clock()
        self.books = [LedgerStore(self.store, clock=self.clock, backoff_cap=0) for _ in range(2)]
        self.grants: list[MGrant] = []
        #: ref -> (fingerprint, first answer) of every change that landed.
        self.refs: dict[str, tuple[str, dict[str, Any]]] = {}
        self.expired_total = 0

    def teardown(self) -> None:
        self.loop.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    # -- the model ---------------------------------------------------------------------------

    def _expire(self) -> None:
        now = self.clock.now
        keep = []
        for g in self.grants:
            if g.expires_at is not None and now >= g.expires_at:
                self.expired_total += g.remaining
            else:
                keep.append(g)
        self.grants = keep

    def _available(self) -> int:
        return sum(g.remaining for g in self.grants)

    def _apply(self, book: int, op: ledger.Op) -> None:
        """Send ``op`` and check the answer against the model."""
        self._expire()
        before = self._available()
        seen = self.refs.get(op.ref)
        try:
            got = self._run(self.books[book].apply(TENANT, op))
        except Conflict:
            assert seen is not None and seen[0] != op.fingerprint()
            return
        except InsufficientBalance:
            assert seen is None and not op.credit and op.amount > before
            return
        if seen is not None:
            assert seen[0] == op.fingerprint(), "a reused ref must be a conflict"
            assert got == seen[1], "a repeated ref answers its first answer"
            return
        if op.credit:
            assert got["amount"] == op.amount
            self.grants.append(MGrant(got["seq"], op.amount, op.priority, op.expires_at))
        else:
            assert op.amount <= before, "a debit past the balance must be refused"
            assert got["amount"] == -op.amount
            # Spending order: higher priority, then earliest expiry (never last), then oldest.
            order = sorted(
                self.grants,
                key=lambda g: (-g.priority, g.expires_at is None, g.expires_at or 0, g.seq),
            )
            left, want = op.amount, []
            for g in order:
                if left == 0:
                    break
                take = min(left, g.remaining)
                want.append([g.seq, take])
                g.remaining -= take
                left -= take
            assert got["grants"] == want
            self.grants = [g for g in self.grants if g.remaining > 0]
        assert got["balance_after"] == self._available()
        self.refs[op.ref] = (op.fingerprint(), got)

    # -- rules -------------------------------------------------------------------------------

    @rule(
        book=st.integers(0, 1),
        amount=st.integers(1, 50),
        ref=st.sampled_from(REFS),
        priority=st.integers(0, 2),
        expires_in=st.none() | st.integers(1, 30),
    )
    def grant(
        self, book: int, amount: int, ref: str, priority: int, expires_in: int | None
    ) -> None:
        expires_at = None if expires_in is None else int(self.clock.now) + expires_in
        self._apply(book, ledger.credit(amount, ref, priority=priority, expires_at=expires_at))

    @rule(book=st.integers(0, 1), amount=st.integers(1, 60), ref=st.sampled_from(REFS))
    def debit(self, book: int, amount: int, ref: str) -> None:
        self._apply(book, ledger.debit(amount, ref))

    @rule(book=st.integers(0, 1))
    def repeat_a_landed_ref(self, book: int) -> None:
        """The same ref and request again: its first answer, nothing written."""
        if not self.refs:
            return
        ref = sorted(self.refs)[0]
        first = self.refs[ref][1]
        if first["amount"] > 0:
            op = ledger.credit(
                first["amount"], ref, priority=first["priority"], expires_at=first["expires_at"]
            )
        else:
            op = ledger.debit(-first["amount"], ref)
        seq = self.store.ledgers[TENANT][0]
        assert self._run(self.books[book].apply(TENANT, op)) == first
        self._expire()
        assert self.store.ledgers[TENANT][0] == seq or self.expired_total > 0

    @rule(seconds=st.integers(1, 20))
    def time_passes(self, seconds: int) -> None:
        self.clock.now += seconds

    @rule(
        book=st.integers(0, 1),
        amount=st.integers(1, 30),
        credit=st.booleans(),
        ref=st.sampled_from(REFS),
    )
    def answer_lost_after_the_write(self, book: int, amount: int, credit: bool, ref: str) -> None:
        """The write lands but its answer is lost: recognised by its ref, never written twice."""
        self.store.ledger_lose_next = 1
        op = ledger.credit(amount, ref) if credit else ledger.debit(amount, ref)
        self._apply(book, op)
        self.store.ledger_lose_next = 0

    @rule(book=st.integers(0, 1), amount=st.integers(1, 30), ref=st.sampled_from(REFS))
    def write_fails_before_landing(self, book: int, amount: int, ref: str) -> None:
        self.store.ledger_fail_next = 1
        self._apply(book, ledger.credit(amount, ref))
        self.store.ledger_fail_next = 0

    @rule(book=st.integers(0, 1), amount=st.integers(1, 30), ref=st.sampled_from(REFS))
    def storage_down_then_retried(self, book: int, amount: int, ref: str) -> None:
        """Storage down: unavailable and nothing changed; the retry with the ref lands once."""
        snapshot = (dict(self.store.ledgers), dict(self.store.ledger_entries_.get(TENANT, {})))
        self.store.ledger_down = True
        with pytest.raises(Unavailable):
            self._run(self.books[book].apply(TENANT, ledger.debit(amount, ref)))
        self.store.ledger_down = False
        assert snapshot == (
            dict(self.store.ledgers),
            dict(self.store.ledger_entries_.get(TENANT, {})),
        )
        self._apply(1 - book, ledger.debit(amount, ref))

    @rule(book=st.integers(0, 1))
    def read_the_balance(self, book: int) -> None:
        got = self._run(self.books[book].balance(TENANT))
        self._expire()
        assert got["available"] == self._available()
        assert sorted(g["seq"] for g in got["grants"]) == sorted(g.seq for g in self.grants)

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def ledger_is_consistent(self) -> None:
        held = self.store.ledgers.get(TENANT)
        state = ledger.decode_state(None if held is None else held[1])
        stored = self.store.ledger_entries_.get(TENANT, {})
        entries = [ledger.decode_entry(stored[s]) for s in sorted(stored)]
        assert [e.seq for e in entries] == list(range(1, len(entries) + 1))
        ledger.check(state, entries)
        # Every change landed once: one entry per ref.
        refs = [e.ref for e in entries if e.ref is not None]
        assert len(refs) == len(set(refs)) == len(self.refs)
        # Expired grants left as expire entries, each of one grant's remainder.
        assert all(len(e.alloc) == 1 for e in entries if e.kind == ledger.EXPIRE)
        # What storage holds, with the expiries due, is what the model holds.
        self._expire()
        after = ledger.expiry_write(state, self.clock.now, limit=10**6)
        live = state if after is None else after.state
        assert live.balance == self._available()
        assert {g.seq: g.remaining for g in live.grants} == {
            g.seq: g.remaining for g in self.grants
        }


TestLedger = LedgerMachine.TestCase
TestLedger.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# -- the pure model's edges -------------------------------------------------------------------


def test_spending_order_is_priority_then_expiry_then_age() -> None:
    grants = [
        ledger.Grant(1, 5, 0, None),
        ledger.Grant(2, 5, 0, 100),
        ledger.Grant(3, 5, 1, None),
        ledger.Grant(4, 5, 0, 50),
        ledger.Grant(5, 5, 1, 200),
        ledger.Grant(6, 5, 0, 50),
    ]
    assert [g.seq for g in ledger.spending_order(grants)] == [5, 3, 4, 6, 2, 1]


def test_an_expiry_touches_only_the_expired_grant() -> None:
    state = ledger.State(3, 30, (ledger.Grant(1, 10), ledger.Grant(2, 10, 0, 100),
                                 ledger.Grant(3, 10, 5, 200)))  # fmt: skip
    step = ledger.expiry_write(state, 100)
    assert step is not None
    assert [(e.kind, e.amount, e.alloc) for e in step.entries] == [("expire", -10, ((2, 10),))]
    assert step.state == ledger.State(4, 20, (ledger.Grant(1, 10), ledger.Grant(3, 10, 5, 200)))
    assert ledger.expiry_write(state, 99.999) is None


def test_many_expiries_are_written_over_several_writes_first() -> None:
    n = ledger.MAX_EXPIRE_PER_WRITE + 5
    grants = (*(ledger.Grant(i, 1, 0, 10) for i in range(1, n + 1)), ledger.Grant(n + 1, 7))
    state = ledger.State(n + 1, n + 7, grants)
    op = ledger.debit(3, "d")
    first = ledger.next_write(state, op, 10)
    assert not first.done and len(first.entries) == ledger.MAX_EXPIRE_PER_WRITE
    second = ledger.next_write(first.state, op, 10)
    assert second.done and [e.kind for e in second.entries] == ["expire"] * 5 + ["debit"]
    assert second.state.balance == 4


def test_a_debit_past_the_balance_changes_nothing() -> None:
    state = ledger.State(1, 10, (ledger.Grant(1, 10),))
    with pytest.raises(InsufficientBalance, match="11 exceeds the available balance of 10"):
        ledger.next_write(state, ledger.debit(11, "d"), 0)
    assert ledger.next_write(state, ledger.debit(10, "d"), 0).state == ledger.State(2, 0, ())


def test_the_balance_never_passes_the_largest_amount() -> None:
    state = ledger.State(1, ledger.MAX_AMOUNT, (ledger.Grant(1, ledger.MAX_AMOUNT),))
    with pytest.raises(InvalidArgument, match="amount: the balance would exceed"):
        ledger.next_write(state, ledger.credit(1, "g"), 0)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: ledger.credit(0, "r"), "amount"),
        (lambda: ledger.credit(-5, "r"), "amount"),
        (lambda: ledger.credit(2**63, "r"), "amount"),
        (lambda: ledger.credit(True, "r"), "amount"),
        (lambda: ledger.credit("5", "r"), "amount"),
        (lambda: ledger.credit(1.5, "r"), "amount"),
        (lambda: ledger.debit(1, ""), "ref"),
        (lambda: ledger.debit(1, "x" * 129), "ref"),
        (lambda: ledger.debit(1, 7), "ref"),
        (lambda: ledger.debit(1, "a\nb"), "ref"),
        (lambda: ledger.credit(1, "r", priority=1.5), "priority"),
        (lambda: ledger.credit(1, "r", priority=2**63), "priority"),
        (lambda: ledger.credit(1, "r", expires_at=-1), "expires_at"),
        (lambda: ledger.credit(1, "r", expires_at="soon"), "expires_at"),
        (lambda: ledger.credit(1, "r", kind="expire"), "kind"),
        (lambda: ledger.debit(1, "r", kind="Bad Kind"), "kind"),
    ],
)
def test_bad_inputs_name_the_field(make: Any, field: str) -> None:
    with pytest.raises(InvalidArgument, match=f"^{field}"):
        make()


def test_caller_kinds_and_refs_are_reusable_from_another_module() -> None:
    """Another module (e.g. a credit-metered track) writes its own kinds under its own refs."""
    state = ledger.State()
    g = ledger.next_write(state, ledger.credit(10, "topup-1", kind="topup"), 0)
    d = ledger.next_write(g.state, ledger.debit(4, "track:n1:7", kind="usage"), 0)
    assert [e.kind for e in (*g.entries, *d.entries)] == ["topup", "usage"]
    assert d.state.balance == 6 and d.ref == "track:n1:7"
    assert ledger.repeated(ledger.debit(4, "track:n1:7", kind="usage"), d.ref_body or "")
    with pytest.raises(Conflict):
        ledger.repeated(ledger.debit(4, "track:n1:7"), d.ref_body or "")  # another kind


# -- credits moved into a credit pool and given back (docs/ledger.md) --------------------------


def _write(state: ledger.State, op: ledger.Op, now: float = 0) -> ledger.Write:
    w = ledger.next_write(state, op, now)
    assert w.done
    return w


def test_a_funding_notes_on_each_grant_what_went_into_the_pool() -> None:
    """A ``metered`` debit takes in spending order and notes it as the grants' ``pooled``;
    a grant whose ledger part is spent stays open while credits of it are in the pool, and
    other debits pass over it."""
    state = ledger.State(2, 15, (ledger.Grant(1, 10), ledger.Grant(2, 5, 1, 100)))
    w = _write(state, ledger.pool_funding(8, "pool:p:1", 0))
    assert [(e.kind, e.amount, e.alloc) for e in w.entries] == [("metered", -8, ((2, 5), (1, 3)))]
    assert w.state.grants == (ledger.Grant(1, 7, 0, None, 3), ledger.Grant(2, 0, 1, 100, 5))
    d = _write(w.state, ledger.debit(7, "d"))
    assert d.entries[-1].alloc == ((1, 7),)  # (grant 2 has nothing left in the ledger)
    assert d.state.grants == (ledger.Grant(1, 0, 0, None, 3), ledger.Grant(2, 0, 1, 100, 5))
    ledger.check(d.state, [ledger.Entry(2, 0, "grant", 15, 15), *w.entries, *d.entries])
    # A plain debit closes a grant it spends to 0 that has nothing in the pool.
    plain = _write(ledger.State(1, 4, (ledger.Grant(1, 4),)), ledger.debit(4, "d"))
    assert plain.state.grants == ()


def test_credits_given_back_go_to_the_last_grants_in_spending_order_and_expire_if_due() -> None:
    """The pool spends what it holds in spending order, so the credits it gives back are the
    last grants': the never-expiring grant 1 first, then grant 2, whose restored credits
    expire in the same write when it is past its expiry; what is still pooled past the
    pool's unspent (0 here: the pool is idle) is spent, and let go: grant 2 closes."""
    state = ledger.State(2, 0, (ledger.Grant(1, 0, 0, None, 3), ledger.Grant(2, 0, 1, 100, 5)))
    assert ledger.in_pool(state.grants, 6) == {1: 3, 2: 3}
    assert ledger.in_pool(state.grants, 2) == {1: 2}
    w = _write(state, ledger.pool_return(6, "pool:p:2", 0), now=100)
    assert [(e.kind, e.amount, e.alloc) for e in w.entries] == [
        ("unpooled", 6, ((1, 3), (2, 3))),
        ("expire", -3, ((2, 3),)),
    ]
    assert w.state.balance == 3 and w.state.grants == (ledger.Grant(1, 3),)
    assert w.answer is not None and w.answer["grants"] == [[1, 3], [2, 3]]
    # Before its expiry the same credits stay spendable, with grant 2's priority.
    early = _write(state, ledger.pool_return(6, "pool:p:2", 0), now=99)
    assert [e.kind for e in early.entries] == ["unpooled"]
    assert early.state.grants == (ledger.Grant(1, 3), ledger.Grant(2, 3, 1, 100))
    # A grant expired in the ledger while credits of it are pooled stays open for them.
    pooled = ledger.State(3, 4, (ledger.Grant(1, 4, 0, 50, 2),))
    gone = ledger.expiry_write(pooled, 50)
    assert gone is not None and gone.state.grants == (ledger.Grant(1, 0, 0, 50, 2),)


def test_a_funding_lets_go_of_pooled_credits_the_pool_has_spent() -> None:
    """A funding says what the pool held unspent before it: grants keep that much as in the
    pool (the last in spending order), the rest is spent and let go, so a grant funded
    later with a higher priority is not taken as spent for credits spent before it came."""
    state = ledger.State(2, 500, (ledger.Grant(1, 0, 0, None, 1000), ledger.Grant(2, 500, 5, 100)))
    w = _write(state, ledger.pool_funding(500, "pool:p:2", 100))
    assert w.state.grants == (ledger.Grant(1, 0, 0, None, 100), ledger.Grant(2, 0, 5, 100, 500))
    assert ledger.in_pool(w.state.grants, 600) == {1: 100, 2: 500}
    back = _write(w.state, ledger.pool_return(600, "pool:p:3", 0), now=200)
    assert [(e.kind, e.amount) for e in back.entries] == [("unpooled", 600), ("expire", -500)]
    assert back.state.grants == (ledger.Grant(1, 100),)
    # Nothing said (a funding of an earlier version finished now): everything kept.
    keep = _write(state, ledger.Op(False, 500, "pool:p:2", ledger.POOLED))
    assert keep.state.grants[0].pooled == 1000


def test_credits_given_back_that_no_grant_kept_count_of_open_a_grant() -> None:
    """Credits moved into a pool before grants noted it come back as a grant of their own
    (priority 0, no expiry): nothing is lost."""
    state = ledger.State(1, 5, (ledger.Grant(1, 5, 0, None, 2),))
    w = _write(state, ledger.pool_return(7, "pool:p:9", 0))
    assert w.state.grants == (ledger.Grant(1, 7, 0, None, 0), ledger.Grant(2, 5))
    assert w.state.balance == 12 and w.entries[0].alloc == ((1, 2),)


def test_pooled_credits_survive_the_balance_record_and_older_records_still_read() -> None:
    state = ledger.State(3, 4, (ledger.Grant(1, 4, 2, 50, 9), ledger.Grant(2, 0, 0, None, 1)))
    assert ledger.decode_state(ledger.encode_state(state)) == state
    old = '{"s":1,"b":5,"g":[[1,5,0,null]]}'  # (written before grants kept pooled credits)
    assert ledger.decode_state(old) == ledger.State(1, 5, (ledger.Grant(1, 5),))


def test_a_partial_return_gives_back_first_the_pooled_credits_of_expired_grants() -> None:
    """The pool keeps its grants' expiry: a return smaller than the pool's unspent takes
    first the part in the pool of grants past their expiry, and those credits expire in the
    same write; the rest of the pool stays the other grants'."""
    # Grant 1 (expires at 100) is first in spending order, grant 2 (never) last: of 700
    # unspent in the pool, grant 2 holds 500 and grant 1 the other 200.
    state = ledger.State(3, 0, (ledger.Grant(1, 0, 0, 100, 500), ledger.Grant(2, 0, 0, None, 500)))
    assert ledger.in_pool(state.grants, 700) == {1: 200, 2: 500}
    assert ledger.expired_in_pool(state.grants, 700, 100) == (200, None)
    assert ledger.expired_in_pool(state.grants, 700, 99) == (0, 100)
    assert ledger.pooled_expiry(state.grants) == 100
    w = _write(state, ledger.pool_return(150, "pool:p:3", 550), now=100)
    assert [(e.kind, e.amount, e.alloc) for e in w.entries] == [
        ("unpooled", 150, ((1, 150),)),
        ("expire", -150, ((1, 150),)),
    ]
    # Grant 1 keeps the 50 of it still in the pool (in a node's share); grant 2 its 500.
    assert w.state.balance == 0
    assert w.state.grants == (ledger.Grant(1, 0, 0, 100, 50), ledger.Grant(2, 0, 0, None, 500))
    assert ledger.expired_in_pool(w.state.grants, 550, 100) == (50, None)
    # The same return before the expiry comes back onto grant 2 (the last in spending
    # order) and stays spendable.
    early = _write(state, ledger.pool_return(150, "pool:p:3", 550), now=99)
    assert [(e.kind, e.alloc) for e in early.entries] == [("unpooled", ((2, 150),))]
    # A return larger than the expired part: that part first, then the last grants'.
    more = _write(state, ledger.pool_return(300, "pool:p:3", 400), now=100)
    assert [(e.kind, e.amount, e.alloc) for e in more.entries] == [
        ("unpooled", 300, ((1, 200), (2, 100))),
        ("expire", -200, ((1, 200),)),
    ]
    assert more.state.grants == (ledger.Grant(2, 100, 0, None, 400),)
    entries = [ledger.Entry(1, 0, "grant", 500, 500), ledger.Entry(2, 0, "grant", 500, 1000)]
    ledger.check(more.state, [*entries, ledger.Entry(3, 0, "metered", -1000, 0), *more.entries])
