"""Near a strict limit, calls admitted straight onto the budget record (ADR 0014, Q18).

``Shares`` on memory storage whose budget calls yield to the loop (so calls interleave at
every await, as on a real backend) and are counted: the calls waiting on a node are served by
one conditional write, a refusal read answers every call that arrived before it, a write
whose answer was lost counts once, room a node holds unused is given back, and nodes
admitting onto one record never pass the limit together.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from meter.core.ports import NoBudget
from meter.quotas import escrow
from meter.quotas.escrow import Budget, Share
from meter.quotas.shares import Shares, decode
from storage.base import BudgetItem, Key
from storage.memory import MemoryStorage

KEY = ("acme", "api", "2026-12")


class CountingStorage(MemoryStorage):
    """Memory storage whose budget calls are counted and yield to the loop first."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        #: Records read as written before admits existed (a DynamoDB item with no ``gv``).
        self.old_format = False

    async def budget_read(self, key: Key) -> BudgetItem:
        self.calls["read"] += 1
        await asyncio.sleep(0)
        item = await super().budget_read(key)
        if self.old_format:
            return BudgetItem(item.version, item.body, item.admitted, admits=False)
        return item

    async def budget_swap(self, key: Key, version: int, body: str) -> bool:
        self.calls["swap"] += 1
        await asyncio.sleep(0)
        return await super().budget_swap(key, version, body)

    async def budget_admit(
        self, key: Key, body: str, name: str, units: int, most: int, op: str
    ) -> BudgetItem | None:
        self.calls["admit"] += 1
        await asyncio.sleep(0)
        if self.old_format:
            return None
        return await super().budget_admit(key, body, name, units, most, op)


def _stored(st: MemoryStorage) -> Budget:
    budget = decode(st._budget_item(KEY))
    assert budget is not None
    return budget


async def _take(s: Shares, need: int, limit: int) -> bool:
    """One call: room made and admitted (True), or refused."""
    try:
        if not s.ready(KEY, need, limit):
            await s.ensure(KEY, need, limit, 0)
    except NoBudget:
        return False
    if not s.ready(KEY, need, limit):
        return False  # (another call used the room first: a caller would ask again)
    s.admit(KEY, need)
    return True


async def test_calls_waiting_on_a_node_near_the_limit_are_admitted_by_one_write() -> None:
    st = CountingStorage()
    s = Shares(st, "a", nodes=lambda: 3, share_max=1)  # (no sliver: room for the calls alone)
    got = await asyncio.gather(*(_take(s, 1, 40) for _ in range(6)))
    assert got == [True] * 6
    # The first call's write made the record (no read, no compare-and-swap: near the limit
    # from the start); the five that queued behind it were served by one more.
    assert st.calls == Counter({"admit": 2}), st.calls
    assert s.direct_writes == 2
    loc = s.local[KEY]
    assert loc.a == loc.c == 6 and loc.g == loc.c  # admitted onto the record: all promised
    stored = _stored(st)
    assert stored.shares["a"].g == stored.shares["a"].c == loc.c
    assert stored.granted == loc.c <= 40


async def test_three_nodes_admitting_onto_one_record_admit_exactly_the_limit() -> None:
    st = CountingStorage()
    nodes = [Shares(st, f"n{i}", nodes=lambda: 3) for i in range(3)]
    admitted = [0, 0, 0]

    async def burst(i: int) -> None:
        while await _take(nodes[i], 1, 100):
            admitted[i] += 1

    await asyncio.gather(*(burst(i) for i in range(3) for _ in range(4)))
    # Refused only once nothing was left: every node's room is used (its calls kept coming).
    assert sum(admitted) == 100, admitted
    assert _stored(st).granted == 100
    assert sum(n.direct_writes for n in nodes) > 0
    assert all(n.local[KEY].a == n.local[KEY].c for n in nodes)


async def test_a_refusal_read_answers_every_call_that_arrived_before_it() -> None:
    st = CountingStorage()
    a, b = Shares(st, "a", nodes=lambda: 2), Shares(st, "b", nodes=lambda: 2)
    await a.ensure(KEY, 10, 10, 0)  # a holds the whole budget
    a.admit(KEY, 10)
    st.calls.clear()
    refused = await asyncio.gather(*(_take(b, 1, 10) for _ in range(8)))
    assert refused == [False] * 8
    # Eight calls queued on b: the reads refusing them overlap their arrival, not one each.
    assert st.calls["read"] <= 2, st.calls
    assert b.refused == 8


async def test_a_direct_write_whose_answer_was_lost_counts_once() -> None:
    st = CountingStorage()
    s = Shares(st, "a", nodes=lambda: 3)
    st.budget_lose_next = 1  # the admit lands, its answer does not
    await s.ensure(KEY, 3, 30, 0)
    loc = s.local[KEY]
    stored = _stored(st)
    assert stored.shares["a"].c == loc.c  # recognised by its op on the read, granted once
    assert st.calls["admit"] == 1 and st.calls["read"] == 1


async def test_a_direct_write_that_failed_before_landing_grants_nothing() -> None:
    st = CountingStorage()
    s = Shares(st, "a", nodes=lambda: 3)
    await s.ensure(KEY, 1, 30, 0)
    before = s.local[KEY].c
    s.admit(KEY, s.local[KEY].c)  # no room left
    st.budget_fail_next = 1  # the next admit never reaches storage
    await s.ensure(KEY, 1, 30, 0)  # the read finds it did not land; the next write does
    assert s.local[KEY].c > before
    assert _stored(st).shares["a"].c == s.local[KEY].c


async def test_room_held_unused_near_the_limit_is_given_back_to_the_others() -> None:
    st = CountingStorage()
    a, b = Shares(st, "a", nodes=lambda: 2), Shares(st, "b", nodes=lambda: 2)
    await a.ensure(KEY, 5, 40, 0)
    a.admit(KEY, 5)
    loc = a.local[KEY]
    assert loc.c - loc.a > 0  # a sliver more than asked
    st.calls.clear()
    a.release(KEY, 40)
    await asyncio.gather(*a._refills)
    assert st.calls["swap"] == 1 and st.calls["admit"] == 0  # a whole-record give-back
    assert loc.c == loc.a == 5  # lowered here first, then written
    assert _stored(st).shares["a"].c == _stored(st).shares["a"].g == 5
    got = 0
    while await _take(b, 1, 40):
        got += 1
    assert got == 35  # everything a did not admit


async def test_far_from_the_limit_shares_are_taken_as_before() -> None:
    st = CountingStorage()
    s = Shares(st, "a", nodes=lambda: 3, share_max=1000)
    await s.ensure(KEY, 1, 10**12, 0)
    assert st.calls["admit"] == 0 and st.calls["swap"] == 1
    loc = s.local[KEY]
    assert loc.g > loc.c  # a grant with a cap below it, renewed by its lease


async def test_a_record_written_before_admits_existed_is_taken_from_by_compare_and_swap() -> None:
    st = CountingStorage()
    await st.budget_swap(KEY, 0, Budget(0, {}).to_json())
    st.old_format = True  # (as a DynamoDB item with no ``gv`` reads)
    st.calls.clear()
    s = Shares(st, "a", nodes=lambda: 3)
    await s.ensure(KEY, 1, 40, 0)
    # The blind first admit fails; the read shows a record that takes none: one swap.
    assert st.calls == Counter({"admit": 1, "read": 1, "swap": 1}), st.calls
    assert s.direct_writes == 0 and s.ready(KEY, 1, 40)


def test_two_processes_of_one_node_id_admitting_onto_a_record_share_none_of_each_other() -> None:
    """Units two processes under one node id admitted onto one record fold into one share
    that is no process's: either one's next take closes it at its cap (all spent), so neither
    admits the other's units."""
    body = Budget(0, {})
    folded = body.admitted(
        (("n0.r1", 7, "r1.1"), ("n0.r2", 5, "r2.1")), body.to_json()
    )  # (each process admitted onto it, deciding when n0 had no share yet)
    share = folded.shares["n0"]
    assert (share.g, share.c) == (12, 12)
    assert not escrow.ours(share, "r1") and not escrow.ours(share, "r2")
    local = escrow.Local(0, 7, 7, 7, 20)  # r1 admitted its 7
    swap = escrow.take(folded, "n0", local, run="r1", need=1, want=1, step=1, limit=20, base=0,
                       now_ms=0, lease_ms=1000, grace_ms=500, op="r1.2")  # fmt: skip
    assert swap.floor == 12  # closed at its cap: r2's 5 count as r1's admitted too
    assert swap.local.a >= 12
    # One process's own units stay its own share when it alone admits onto a record.
    alone = body.admitted((("n0.r1", 7, "r1.1"),), body.to_json())
    assert alone.shares["n0"] == Share(7, 7, 0, 0, "r1.1")
    assert escrow.ours(alone.shares["n0"], "r1")


@pytest.mark.parametrize("nodes", [1, 3, 10])
def test_direct_units_stay_within_what_is_left(nodes: int) -> None:
    body = Budget(90, {})
    budget = body.admitted((), body.to_json())
    units = escrow.direct_units(budget, "a", None, run="r", want=30, least=1, limit=100,
                                nodes=nodes, share_max=1000)  # fmt: skip
    assert units == 10  # all that is left, not the 30 asked
    assert escrow.direct_units(budget, "a", None, run="r", want=30, least=11, limit=100,
                               nodes=nodes, share_max=1000) == 0  # fmt: skip
    far = Budget(0, {}).admitted((), Budget(0, {}).to_json())
    assert escrow.direct_units(far, "a", None, run="r", want=1, least=1, limit=10**9,
                               nodes=nodes, share_max=1000) == 0  # fmt: skip


async def test_a_give_back_whose_answer_was_lost_gives_back_once() -> None:
    """A release is a compare-and-swap, so storage or its client sending it twice lands it
    once, and a lost answer is recognised by its op: the other node gets exactly the rest."""
    st = CountingStorage()
    a, b = Shares(st, "a", nodes=lambda: 2), Shares(st, "b", nodes=lambda: 2)
    await a.ensure(KEY, 5, 40, 0)
    a.admit(KEY, 5)
    st.budget_lose_next = 1  # the give-back lands, its answer does not
    a.release(KEY, 40)
    await asyncio.gather(*a._refills)
    assert _stored(st).shares["a"].c == 5
    assert not await st.budget_swap(KEY, st._budget_item(KEY).version - 1, "{}")  # (stale)
    got = 0
    while await _take(b, 1, 40):
        got += 1
    assert 5 + got == 40, got
    assert _stored(st).granted == 40


async def test_a_share_kept_for_held_units_takes_room_under_a_changed_limit() -> None:
    st = CountingStorage()
    s = Shares(st, "a", nodes=lambda: 3)
    await s.ensure(KEY, 3, 40, 0)
    s.hold(KEY, 3)  # a reservation holds 3: the share stays through a give-back
    await s.ensure(KEY, 2, 30, 0)  # the limit moved to 30: given back, then room under 30
    assert s.ready(KEY, 2, 30), s.local[KEY]
    assert _stored(st).granted <= 30
