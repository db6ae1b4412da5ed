"""Strict limits by escrow: the budget record of a counter and one node's share of it. Pure.

A strict limit ``L`` on a counter (one ``(tenant, feature, period)``) is split between the
nodes that admit on it (ADR 0009). Storage keeps one **budget record** per counter: ``base``
(units counted before the budget existed) and, per node, a **share**:

- ``g``: units granted to the node and not given back (what it used is in here too);
- ``c``: the node's **cap**: it promised never to admit more than ``c`` on this counter
  (``c <= g``), so a share can be taken back up to ``g - c`` without knowing what was used;
- ``e``: the share's epoch, bumped when a share is closed without its node (taken back after
  its lease ended, or closed by the node's next process);
- ``t``: the end of the share's lease (ms), renewed by its node while ``g > c``;
- ``op``: the id of the node's last write, so a write whose answer was lost is recognised.

Invariants (docs/correctness.md Q12-Q16, tests/test_escrow_properties.py):

1. ``base + sum(g) <= L`` after every grant (a grant is only written if it fits);
2. every node's admitted units on the counter stay ``<= c <= g`` of its share;
3. so the units admitted by all nodes, plus ``base``, never pass ``L``, whatever the
   interleaving of grants, cap raises, give-backs, take-backs, crashes and lost answers.

Storage only compares and swaps whole records by version; every decision is made here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from meter.core.ports import NoBudget


@dataclass(frozen=True, slots=True)
class Share:
    """One node's share of a budget (see the module doc)."""

    g: int = 0
    c: int = 0
    e: int = 0
    t: int = 0
    op: str = ""


@dataclass(frozen=True, slots=True)
class Budget:
    """The budget record of one counter, or of one tenant's credit pool.

    A pool (``funded`` not ``None``) is its own limit: ``funded`` credits moved into it from
    the tenant's ledger, one funding at a time (``fund``: ``[n, amount, started ms]`` while
    one is in flight, written to the ledger under ref ``pool:<pool>:<n>``; docs/ledger.md).
    A negative ``amount`` is a return: credits the pool gives back to the ledger, taken off
    ``funded`` when it begins (so no node is granted them) and credited under the same kind
    of ref."""

    base: int = 0
    shares: dict[str, Share] = field(default_factory=dict)
    funded: int | None = None
    fund_n: int = 0
    fund: tuple[int, int, int] | None = None
    pool: str = ""
    #: Of the shares' units, those admitted straight onto the record since its body was
    #: written (:func:`direct_units`), and that body as stored (None: the record takes no
    #: such write until it is written whole again). Neither is in the body.
    direct: int = 0
    stored: str | None = None

    def admitted(self, admitted: tuple[tuple[str, int, str], ...], stored: str | None) -> Budget:
        """This body with the units admitted straight onto it folded into their nodes'
        shares (grant and cap both: they were granted and promised in one write). Each is
        named ``<node>.<process>`` (:func:`admit_name`); a share stays its process's, named by
        its last such write, unless another process admitted onto it too: then it is no
        process's (its op is blank), and any process taking it closes it at its cap."""
        shares = dict(self.shares)
        for name, units, op in admitted:
            node, _, run = name.rpartition(".")
            s = shares.get(node)
            if s is None:
                shares[node] = Share(units, units, 0, 0, op)
            else:
                shares[node] = Share(s.g + units, s.c + units, s.e, s.t, op if ours(s, run) else "")
        total = sum(units for _, units, _ in admitted)
        return replace(self, shares=shares, direct=total, stored=stored)

    @property
    def granted(self) -> int:
        """Units spoken for: ``base`` plus every share's grant."""
        return self.base + sum(s.g for s in self.shares.values())

    def to_json(self) -> str:
        out: dict[str, Any] = {
            "base": self.base,
            "shares": {n: [s.g, s.c, s.e, s.t, s.op] for n, s in sorted(self.shares.items())},
        }
        if self.funded is not None:
            out["pool"] = [self.pool, self.funded, self.fund_n, self.fund]
        return json.dumps(out, separators=(",", ":"))

    @classmethod
    def from_json(cls, body: str) -> Budget:
        """A stored record; ``ValueError`` if it is not one."""
        raw: Any = json.loads(body)
        if not isinstance(raw, dict):
            raise ValueError("budget record is not a map")
        base = raw.get("base")
        shares = raw.get("shares")
        if not isinstance(base, int) or not _count(base) or not isinstance(shares, dict):
            raise ValueError("budget record has no base or shares")
        out: dict[str, Share] = {}
        for node, s in shares.items():
            if not (
                isinstance(s, list)
                and len(s) == 5
                and all(_count(x) for x in s[:4])
                and isinstance(s[4], str)
                and s[1] <= s[0]
            ):
                raise ValueError(f"budget record: bad share of {str(node)[:64]!r}")
            out[str(node)] = Share(*s)
        pool = raw.get("pool")
        if pool is None:
            return cls(base, out)
        if not (
            isinstance(pool, list)
            and len(pool) == 4
            and isinstance(pool[0], str)
            and _count(pool[1])
            and _count(pool[2])
            and (
                pool[3] is None
                or (
                    isinstance(pool[3], list)
                    and len(pool[3]) == 3
                    and _count(pool[3][0])
                    and _count(abs(pool[3][1]) if type(pool[3][1]) is int else -1)
                    and _count(pool[3][2])
                )
            )
        ):
            raise ValueError("budget record: bad pool")
        fund = None if pool[3] is None else (pool[3][0], pool[3][1], pool[3][2])
        return cls(base, out, pool[1], pool[2], fund, pool[0])


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


@dataclass(slots=True)
class Local:
    """What one node knows of its own share of one counter.

    ``a`` is what it has admitted under the share, counted from the same origin as ``g`` and
    ``c`` (units it admitted under earlier epochs are in ``g``/``c`` as spent), so the node may
    admit ``q`` more units while ``a + q <= c``."""

    e: int
    g: int
    c: int
    a: int
    limit: int
    #: Monotonic time of the last admission (idle shares are given back).
    used_at: float = 0.0
    #: Room below which the node asks for more in the background.
    low: int = 0
    #: The op of this process's last write of the share it saw land ("": none known).
    op: str = ""

    @property
    def room(self) -> int:
        return self.c - self.a


@dataclass(frozen=True, slots=True)
class Swap:
    """A write to make: the new record, and the node's share as it will be once written."""

    budget: Budget
    local: Local
    #: What the node's admitted count must be at least once written: the cap of a share of
    #: another process it closed (0: none closed).
    floor: int = 0
    #: Of ``owed``, the units this write took off the admitted count.
    owed: int = 0


def adopt(node: str, budget: Budget | None, local: Local | None, limit: int) -> Local:
    """This node's :class:`Local` as of ``budget`` (stored).

    Without a local share (a new process, or a share forgotten after it was given back),
    everything up to the stored cap counts as spent: the earlier process may have admitted
    that much. With one whose epoch was moved on (its share was taken back), the node keeps
    its admitted count, which never passed its cap."""
    s = None if budget is None else budget.shares.get(node)
    if s is None:
        return Local(0, 0, 0, 0 if local is None else local.a, limit)
    if local is None:
        return Local(s.e, s.g, s.c, s.c, limit)
    # The stored cap may be above what this node knows (a raise whose answer was lost); the
    # admitted count stays what it is, never above either.
    return Local(s.e, s.g, s.c, local.a, limit, local.used_at, local.low)


def admit_name(node: str, run: str) -> str:
    """What units admitted straight onto a record by process ``run`` of ``node`` are stored
    under (node ids hold no dot)."""
    return f"{node}.{run}"


def ours(share: Share, run: str) -> bool:
    """Whether ``share`` was last written by the process ``run`` (ops are ``<run>.<n>``; a
    take-back keeps the op, so a share taken back is still its process's)."""
    return share.op.startswith(run + ".")


def take(
    budget: Budget | None,
    node: str,
    local: Local | None,
    *,
    run: str,
    need: int,
    want: int,
    step: int,
    limit: int,
    base: int,
    now_ms: int,
    lease_ms: int,
    grace_ms: int,
    op: str,
    at_least: int | None = None,
    owed: int = 0,
    spent: int | None = None,
) -> Swap:
    """The write that gives ``node`` room for ``need`` more units: its cap raised to
    ``need + step`` past what it admitted, and its grant to ``want`` past it if that fits
    (at least to the cap, or to ``need`` near the limit). Its share of an earlier process is
    closed first, and if the budget is short, the unused part of shares whose lease ended
    more than ``grace_ms`` ago is taken back. ``base`` seeds a new record (the counter's
    value before it had one). Raises :class:`NoBudget` if less than ``need`` is left (or than
    ``at_least``, if given: then as much as is left, up to ``need``). ``run`` names this
    process: a share under ``node`` that another process wrote is closed first. ``owed``: units
    this process gave back (never used) while it had no local share, which its closed share
    counted as admitted. ``spent``: what the earlier process is known to have admitted under
    that share (its write-ahead log says), closed at that instead of its cap."""
    if budget is None:
        budget = Budget(base, {})
    shares = dict(budget.shares)
    mine = shares.get(node)
    if mine is not None and (local is None or not ours(mine, run)):
        # A share this process did not write (an earlier process's, one forgotten when it was
        # given back, or another process's under the same node id): what was admitted under
        # it is at most its cap (or what its log says, if known), all spent; the rest goes back.
        used = mine.c if spent is None or local is not None else min(mine.c, max(0, spent))
        closed = Share(used, used, mine.e + 1, mine.t, op)
        shares[node] = closed
        a = max(0, used - owed) if local is None else max(local.a, used)
        used_owed = min(owed, used) if local is None else 0
        used_at, low = (0.0, 0) if local is None else (local.used_at, local.low)
        cur = Local(closed.e, closed.g, closed.c, a, limit, used_at, low)
        floor = used
    else:
        cur = adopt(node, replace(budget, shares=shares), local, limit)
        floor = used_owed = 0
    # The grant must add at least this much (less than need: what is left will do).
    least = max(0, cur.a + (need if at_least is None else min(need, at_least)) - cur.g)
    wanted = max(least, cur.a + max(need + step, want) - cur.g)
    free = limit - (budget.base + sum(s.g for s in shares.values()))
    if free < wanted:
        for other, s in list(shares.items()):
            if other != node and s.g > s.c and s.t + grace_ms < now_ms:
                shares[other] = Share(s.c, s.c, s.e + 1, s.t, s.op)
        free = limit - (budget.base + sum(s.g for s in shares.values()))
    if free < least:
        left = max(0, free + cur.g - cur.a)
        raise NoBudget(f"{left} units left, {need} asked", left)
    g = cur.g + max(least, min(free, wanted))
    c = max(cur.c, min(g, cur.a + need + step))
    shares[node] = Share(g, c, cur.e, now_ms + lease_ms, op)
    b = replace(budget, shares=shares)
    return Swap(b, adopt(node, b, cur, limit), floor, used_owed)


#: A node admits calls straight onto the budget record (:func:`direct_units`) once a share would
#: cover fewer than this many passes of its waiting calls, each counted at least
#: ``DIRECT_PASS`` units (a pass of one call now may be a pass of many the next moment).
DIRECT_PASSES = 32
DIRECT_PASS = 4
#: ...and admits more than its waiting calls ask for while there is room to spare: what is
#: left over this many times the nodes, as a grant would be (the next calls find it in
#: memory). Everything admitted onto a record is promised (cap = grant), so a node that dies
#: and never comes back strands up to that much, where a share strands a quarter of it.
DIRECT_SLIVER = 2


def near_limit(free: int, nodes: int, want: int = 0) -> bool:
    """Whether ``free`` units left of a budget are near its limit for ``nodes`` nodes whose
    waiting calls ask ``want``: a grant (``free`` over twice the nodes) would last fewer than
    ``DIRECT_PASSES`` passes of at least ``DIRECT_PASS`` units."""
    return free // (2 * max(1, nodes)) < DIRECT_PASSES * max(want, DIRECT_PASS)


def direct_units(
    budget: Budget | None,
    node: str,
    local: Local | None,
    *,
    run: str,
    want: int,
    least: int,
    limit: int,
    nodes: int,
    share_max: int,
) -> int:
    """How many units ``node`` should admit straight onto the record, in one conditional
    write that no other node's such write can make fail (0: take a share instead).

    Near the limit a share holds little, so every few calls would be a compare-and-swap
    that the fleet's other nodes race; there, the calls waiting on a node (``want`` units, at
    least ``least``) are admitted together onto the record itself: grant and cap up by the
    same units, so every invariant of a share holds as if it were one. Only for a share this
    process holds and knows (``local``'s epoch), on a record that takes such writes, with
    ``least`` left; ``want`` is cut to what is left, and raised to a sliver of it (at most
    ``share_max``) while there is room to spare. A node with no share on the record yet (and
    none known) starts one this way."""
    if budget is None or budget.stored is None or budget.funded is not None:
        return 0
    s = budget.shares.get(node)
    if s is None:
        if local is not None:
            return 0
    elif local is None or s.e != local.e or not ours(s, run):
        return 0
    free = limit - budget.granted
    if not near_limit(free, nodes, want):
        return 0  # far from the limit: a share serves many passes from memory
    units = min(free, max(want, min(share_max, free // (DIRECT_SLIVER * max(1, nodes)))))
    return units if units >= max(1, least) else 0


def give_back(budget: Budget, node: str, local: Local, op: str, run: str) -> Swap | None:
    """The write that returns every unit of ``node``'s share it has not admitted (``g`` and
    ``c`` down to ``a``); ``None`` if there is nothing to return or another process wrote
    the share. A share taken back meanwhile (its epoch moved, its op still the last write this
    process saw land, ``local.op``) is still this process's: what it promised and did not
    admit (``c - a``, kept as spent by the take-back) goes back too, since this process
    knows it never will admit it."""
    s = budget.shares.get(node)
    taken_back = s is not None and s.g == s.c and bool(local.op) and s.op == local.op
    if s is None or (s.e != local.e and not taken_back) or not ours(s, run) or s.g <= local.a:
        return None
    shares = dict(budget.shares)
    shares[node] = Share(local.a, local.a, s.e, s.t, op)
    b = replace(budget, shares=shares)
    return Swap(b, Local(s.e, local.a, local.a, local.a, local.limit, local.used_at, local.low))


def renew(
    budget: Budget, node: str, local: Local, now_ms: int, lease_ms: int, op: str, run: str
) -> Swap | None:
    """The write that extends ``node``'s lease (``None``: its share is gone or not its own)."""
    s = budget.shares.get(node)
    if s is None or s.e != local.e or not ours(s, run):
        return None
    shares = dict(budget.shares)
    shares[node] = replace(s, t=now_ms + lease_ms, op=op)
    b = replace(budget, shares=shares)
    return Swap(b, adopt(node, b, local, local.limit))


def applied(budget: Budget | None, node: str, op: str) -> bool:
    """Whether the stored ``budget`` holds the write ``op`` of ``node`` (or a later one of it,
    which cannot exist while the node waits for this one)."""
    s = None if budget is None else budget.shares.get(node)
    return s is not None and s.op == op


# -- credit pools (docs/ledger.md) -------------------------------------------------------------


def begin_fund(budget: Budget | None, amount: int, now_ms: int, pool: str) -> Budget:
    """The pool with a funding of ``amount`` credits begun (a new pool named ``pool`` if
    there is none); ``ValueError`` if one is already in flight (finish it first)."""
    if budget is None:
        budget = Budget(0, {}, 0, 0, None, pool)
    if budget.funded is None:
        raise ValueError("not a credit pool")
    if budget.fund is not None:
        raise ValueError("a funding is in flight")
    return replace(budget, fund=(budget.fund_n + 1, amount, now_ms))


def begin_return(budget: Budget, amount: int, now_ms: int) -> Budget:
    """The pool with a return of ``amount`` unshared credits to the ledger begun: off
    ``funded`` at once (no share can be granted them any more); ``ValueError`` if a funding
    or a return is in flight, or the pool has not that many unshared."""
    if budget.funded is None:
        raise ValueError("not a credit pool")
    if budget.fund is not None:
        raise ValueError("a funding is in flight")
    if not 0 < amount <= budget.funded - budget.granted:
        raise ValueError(f"{amount} credits to return, {budget.funded - budget.granted} unshared")
    return replace(budget, funded=budget.funded - amount, fund=(budget.fund_n + 1, -amount, now_ms))


def idle_return(budget: Budget, now_ms: int, grace_ms: int) -> Budget | None:
    """The write that begins an idle pool's return (:func:`begin_return`) of every credit
    no share holds, once no share has credits promised to nobody (``g > c``) under a live
    lease: the unpromised part of a share whose lease ended more than ``grace_ms`` ago is
    taken back in the same write, as :func:`take` does. ``None``: a share is in use, a
    funding or return is in flight, or nothing is unshared."""
    if budget.funded is None or budget.fund is not None:
        return None
    shares = dict(budget.shares)
    for node, s in budget.shares.items():
        if s.g > s.c:
            if s.t + grace_ms >= now_ms:
                return None  # (in use: its node may want more soon, and returns it when idle)
            shares[node] = Share(s.c, s.c, s.e + 1, s.t, s.op)
    taken = replace(budget, shares=shares)
    free = taken.funded - taken.granted if taken.funded is not None else 0
    return begin_return(taken, free, now_ms) if free > 0 else None


def end_fund(budget: Budget, n: int, landed: bool) -> Budget | None:
    """The pool with funding or return ``n`` finished (a funding's credits in if
    ``landed``; a return's back in if not); ``None`` if that one is not in flight (finished
    already)."""
    if budget.funded is None or budget.fund is None or budget.fund[0] != n:
        return None
    amount = budget.fund[1]
    funded = budget.funded + (max(amount, 0) if landed else max(-amount, 0))
    return replace(budget, funded=funded, fund_n=n, fund=None)


def fund_ref(budget: Budget, n: int) -> str:
    """The ledger ref of the pool's funding ``n``."""
    return f"pool:{budget.pool}:{n}"
