"""The credits ledger methods of the protocol: ``grant``, ``debit``, ``balance`` and
``ledger`` (docs/protocol.md, docs/ledger.md). Validation here; storage through
:class:`~meter.ledger.store.LedgerBook`. Every answer follows a storage write or read."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from meter.core.keys import check_tenant
from meter.errors import InvalidArgument
from meter.ledger import model as ledger
from meter.ledger.store import LedgerBook, check_page, new_ref

Handler = Callable[[list[Any]], Any]


def _arity(method: str, params: list[Any], least: int, most: int) -> list[Any]:
    n = len(params)
    if not least <= n <= most:
        want = str(least) if least == most else f"{least} to {most}"
        raise InvalidArgument(f"{method} takes {want} params, got {n}")
    return [*params, *([None] * (most - n))]


def _opts(method: str, opts: object, allowed: frozenset[str]) -> dict[str, Any]:
    if opts is None:
        return {}
    if not isinstance(opts, dict):
        raise InvalidArgument(f"{method}: options must be a map, got {type(opts).__name__}")
    unknown = sorted(str(k)[:32] for k in opts if k not in allowed)
    if unknown:
        raise InvalidArgument(f"{method}: unknown option {unknown[0]!r} (known: {sorted(allowed)})")
    return {k: v for k, v in opts.items() if v is not None}


_GRANT_OPTS = frozenset({"ref", "expires_at", "priority"})
_DEBIT_OPTS = frozenset({"ref"})
_PAGE_OPTS = frozenset({"after", "limit"})


class LedgerMethods:
    """The handlers, over one node's :class:`LedgerBook`."""

    def __init__(self, book: LedgerBook) -> None:
        self.book = book

    def handlers(self) -> dict[str, Handler]:
        return {
            "grant": self.grant,
            "debit": self.debit,
            "balance": self.balance,
            "ledger": self.ledger,
        }

    def grant(self, params: list[Any]) -> Awaitable[dict[str, Any]]:
        tenant, amount, opts = _arity("grant", params, 2, 3)
        tenant = check_tenant(tenant)
        o = _opts("grant", opts, _GRANT_OPTS)
        op = ledger.credit(
            amount,
            _client_ref(o.get("ref", new_ref())),
            priority=o.get("priority", 0),
            expires_at=o.get("expires_at"),
        )
        return self.book.apply(tenant, op)

    def debit(self, params: list[Any]) -> Awaitable[dict[str, Any]]:
        tenant, amount, opts = _arity("debit", params, 2, 3)
        tenant = check_tenant(tenant)
        o = _opts("debit", opts, _DEBIT_OPTS)
        return self.book.apply(tenant, ledger.debit(amount, _client_ref(o.get("ref", new_ref()))))

    def balance(self, params: list[Any]) -> Awaitable[dict[str, Any]]:
        (tenant,) = _arity("balance", params, 1, 1)
        return self.book.balance(check_tenant(tenant))

    def ledger(self, params: list[Any]) -> Awaitable[dict[str, Any]]:
        tenant, opts = _arity("ledger", params, 1, 2)
        tenant = check_tenant(tenant)
        o = _opts("ledger", opts, _PAGE_OPTS)
        after, limit = check_page(o.get("after"), o.get("limit"))
        return self.book.page(tenant, after, limit)


#: Refs the node writes itself (credit pools' fundings, docs/ledger.md): refused from clients,
#: so no client call can take or jam a funding's ref.
RESERVED_REF_PREFIX = "pool:"


def _client_ref(ref: object) -> object:
    if isinstance(ref, str) and ref.startswith(RESERVED_REF_PREFIX):
        raise InvalidArgument(
            f"ref must not start with {RESERVED_REF_PREFIX!r} (reserved for credit pools)"
        )
    return ref
