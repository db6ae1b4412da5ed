"""Credit pools are funded by metered debits of the tenant's ledger (docs/ledger.md, ADR 0010).

:class:`LedgerFunder` is the :class:`~meter.core.ports.Funder` the gate hands to the strict
shares when a tenant's credit pool needs more credits.
"""

from __future__ import annotations

from meter.errors import InsufficientBalance, InvalidArgument
from meter.ledger import model as ledger
from meter.ledger.store import LedgerStore


class LedgerFunder:
    """Moves credits from a tenant's ledger into its credit pool."""

    def __init__(self, store: LedgerStore) -> None:
        self.store = store

    async def available(self, tenant: str) -> int:
        """Credits the tenant's ledger has now."""
        return int((await self.store.balance(tenant))["available"])

    async def take(self, tenant: str, amount: int, ref: str, unspent: int) -> bool:
        """Debit ``amount`` under ``ref`` (a ``metered`` entry) exactly once, the pool
        holding ``unspent`` before it; False if the ledger cannot cover it."""
        try:
            await self.store.apply(tenant, ledger.pool_funding(amount, ref, unspent))
        except InsufficientBalance:
            return False
        return True

    async def give(self, tenant: str, amount: int, ref: str, unspent: int) -> bool:
        """Credit ``amount`` under ``ref`` (an ``unpooled`` entry, onto the grants the credits
        came from) exactly once, ``unspent`` left in the pool; False if the ledger refuses
        it."""
        try:
            await self.store.apply(tenant, ledger.pool_return(amount, ref, unspent))
        except InvalidArgument:
            return False
        return True

    def pool_expiry(self, tenant: str) -> float | None:
        """When the first grant with credits in the pool expires, as this node last read or
        wrote the ledger (no I/O; now if it has not: look); ``None``: none expires."""
        state = self.store.known(tenant)
        if state is None:
            return self.store.clock()
        due = ledger.pooled_expiry(state.grants)
        return None if due is None else float(due)

    async def expired_in_pool(self, tenant: str, unspent: int) -> tuple[int, float | None]:
        """Of the pool's ``unspent`` credits, how many are of grants past their expiry now
        (the ledger read from storage), and when the next grant with credits in the pool
        expires (``None``: none does)."""
        _, state = await self.store.state(tenant)
        gone, due = ledger.expired_in_pool(state.grants, unspent, self.store.clock())
        return gone, None if due is None else float(due)
