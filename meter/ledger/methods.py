"""The credits ledger methods of the protocol: ``grant``, ``debit``, ``balance`` and
``ledger`` (docs/protocol.md, docs/ledger.md). Validation here, through the one parameter
checker (:mod:`meter.core.params`); storage through :class:`~meter.ledger.store.LedgerStore`.
Every answer follows a storage write or read."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Awaitable
from typing import Any

from meter.core.keys import check_tenant
from meter.core.params import args as check_args
from meter.core.params import opts as check_opts
from meter.core.ports import Handler, PoolView
from meter.errors import InvalidArgument, Unavailable
from meter.ledger import model as ledger
from meter.ledger.store import DEFAULT_PAGE, MAX_PAGE, LedgerStore
from storage.base import StorageError

_GRANT_OPTS = frozenset({"ref", "expires_at", "priority"})
_DEBIT_OPTS = frozenset({"ref"})
_PAGE_OPTS = frozenset({"after", "limit"})
_TIMELINE_OPTS = frozenset({"from", "to", "cursor", "limit"})
#: The latest ``to`` a timeline takes: epoch seconds whose milliseconds fit a 15-digit position.
MAX_TIMELINE_S = 10**11

#: Refs the node writes itself (credit pools' fundings, docs/ledger.md): refused from clients,
#: so no client call can take or jam a funding's ref.
RESERVED_REF_PREFIX = "pool:"
#: Reads of a pool and its ledger ``balance`` makes at most while a pool's record keeps
#: moving between them (a return could otherwise be counted in both).
BALANCE_READS = 4


class LedgerMethods:
    """The handlers, over one node's :class:`LedgerStore`."""

    def __init__(self, store: LedgerStore, pool: PoolView) -> None:
        self.store = store
        #: The tenant's credit pool: its unspent credits are the tenant's to spend too.
        self.pool = pool

    def handlers(self) -> dict[str, Handler]:
        return {
            "grant": self.grant,
            "debit": self.debit,
            "balance": self.balance,
            "ledger": self.ledger,
            "ledger_timeline": self.ledger_timeline,
        }

    def grant(self, params: list[Any]) -> Awaitable[dict[str, Any]]:
        tenant, amount, opts = check_args("grant", params, 2, 3)
        tenant = check_tenant(tenant)
        o = check_opts("grant", opts, _GRANT_OPTS, nil_is_absent=True)
        op = ledger.credit(
            amount,
            _client_ref(o.get("ref", new_ref())),
            priority=o.get("priority", 0),
            expires_at=o.get("expires_at"),
        )
        return self.store.apply(tenant, op)

    def debit(self, params: list[Any]) -> Awaitable[dict[str, Any]]:
        tenant, amount, opts = check_args("debit", params, 2, 3)
        tenant = check_tenant(tenant)
        o = check_opts("debit", opts, _DEBIT_OPTS, nil_is_absent=True)
        return self.store.apply(tenant, ledger.debit(amount, _client_ref(o.get("ref", new_ref()))))

    def balance(self, params: list[Any]) -> Awaitable[dict[str, Any]]:
        (tenant,) = check_args("balance", params, 1, 1)
        return self._balance(check_tenant(tenant))

    async def _balance(self, tenant: str) -> dict[str, Any]:
        """The ledger's balance, and what the credit pool holds unspent: ``available`` is
        their sum (what the tenant can spend), ``ledger_available`` the ledger's alone."""
        # The pool first: a funding that finishes between the two reads then shows in neither
        # (low, for a moment), never in both. A return landing between them would show in
        # both: the pool is read again after the ledger, and both again if it moved.
        for _ in range(BALANCE_READS):
            pool = await self._pool(tenant)
            out = await self.store.balance(tenant, pool["unspent"])
            if pool["funded"] == 0 or _moved(await self._pool(tenant)) == _moved(pool):
                break
        out["ledger_available"] = out["available"]
        out["available"] = out["available"] + pool["unspent"]
        out["pool"] = pool
        return out

    async def _pool(self, tenant: str) -> dict[str, Any]:
        try:
            return await self.pool.pool(tenant)
        except StorageError as exc:
            raise Unavailable(
                f"balance of {tenant!r}: the credit pool cannot be read: {exc}"
            ) from None

    def ledger(self, params: list[Any]) -> Awaitable[dict[str, Any]]:
        tenant, opts = check_args("ledger", params, 1, 2)
        tenant = check_tenant(tenant)
        o = check_opts("ledger", opts, _PAGE_OPTS, nil_is_absent=True)
        after, limit = check_page(o.get("after"), o.get("limit"))
        return self.store.page(tenant, after, limit)

    def ledger_timeline(self, params: list[Any]) -> Awaitable[dict[str, Any]]:
        """``ledger_timeline({from, to, cursor, limit})``: every tenant's entries written from
        ``from`` (epoch seconds, default 0) until ``to`` (default now), in time order, a page
        at a time (docs/ledger.md, "Timeline")."""
        (opts,) = check_args("ledger_timeline", params, 0, 1, ({},))
        o = check_opts("ledger_timeline", opts, _TIMELINE_OPTS, nil_is_absent=True)
        start = _seconds(o.get("from", 0), "from")
        # (default: now, and the millisecond an entry written just now may be stamped with)
        end = _seconds(o["to"], "to") if o.get("to") is not None else time.time() + 0.001
        if end < start:
            raise InvalidArgument(f"ledger_timeline: to ({end}) is before from ({start})")
        cursor = o.get("cursor")
        if cursor is not None and not isinstance(cursor, str):
            raise InvalidArgument("ledger_timeline: cursor must be a string from a page")
        _, limit = check_page(None, o.get("limit"))
        return self.store.timeline(_stamp(start), _stamp(end), cursor, limit)


def _stamp(seconds: float) -> int:
    """The first millisecond stamp at or after ``seconds``: ``from`` takes entries stamped at
    or after it, ``to`` those stamped before it, exactly (an instant inside a millisecond
    leaves that millisecond's entries out of ``from``'s side). A time read back from an entry
    is its own stamp (the float's last digits are rounded away first)."""
    return math.ceil(round(seconds * 1000, 6))


def _seconds(value: object, what: str) -> float:
    """An epoch time in seconds, checked: a number in 0 .. :data:`MAX_TIMELINE_S`."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (0 <= value <= MAX_TIMELINE_S)
    ):
        raise InvalidArgument(
            f"ledger_timeline: {what} must be epoch seconds (0..{MAX_TIMELINE_S}), got {value!r}"
        )
    return float(value)


def new_ref() -> str:
    """A ref for a change whose caller gave none (clients always send one)."""
    return "~" + uuid.uuid4().hex


def check_page(after: object, limit: object) -> tuple[int, int]:
    """``after`` (>= 0) and ``limit`` (1..MAX_PAGE) of a ``ledger`` page, checked."""
    a = 0 if after is None else ledger.check_int(after, "after", least=0)
    if limit is None:
        return a, DEFAULT_PAGE
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise InvalidArgument(f"limit must be an integer in 1..{MAX_PAGE}, got {limit!r}")
    return a, limit


def _moved(pool: dict[str, Any]) -> tuple[int, int]:
    """What a funding or return finishing changes in a pool's view."""
    return pool["funded"], pool["in_flight"]


def _client_ref(ref: object) -> object:
    if isinstance(ref, str) and ref.startswith(RESERVED_REF_PREFIX):
        raise InvalidArgument(
            f"ref must not start with {RESERVED_REF_PREFIX!r} (reserved for credit pools)"
        )
    return ref
