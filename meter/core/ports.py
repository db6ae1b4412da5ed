"""What the request path needs from the features, as Protocols (the features implement them).

:mod:`meter.core` imports no feature: the node's wiring (:mod:`meter.node.wiring`) hands each
core part the feature objects it needs, typed by these. Interpreted (ADR 0011): Protocols
and an exception class, nothing the compiled code calls natively.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from meter.core.keys import Key

#: A wire method: params in, the result (or an awaitable of it) out.
Handler = Callable[[list[Any]], Any]

#: The ``limit`` a credit pool's shares are kept under: a pool's limit is in its record.
POOL = -1


class NoBudget(Exception):
    """The budget cannot cover the units asked for (the strict limit is reached); ``left``:
    the units it could still give this node."""

    def __init__(self, message: str, left: int = 0) -> None:
        super().__init__(message)
        self.left = left
        #: When (monotonic) the read it was decided on began, if it was decided on one.
        self.read_at: float | None = None


class Limit(Protocol):
    """The limit that applies to one (tenant, feature) (:class:`meter.quotas.limits.Effective`)."""

    @property
    def limit(self) -> int: ...
    @property
    def kind(self) -> str:
        """``hard`` or ``soft``."""
        ...

    @property
    def enforcement(self) -> str:
        """``fast`` or ``strict``."""
        ...

    @property
    def source(self) -> str:
        """``override`` or ``plan:<name>``."""
        ...

    @property
    def alerts(self) -> tuple[int, ...]:
        """Alert thresholds in percent of ``limit``."""
        ...

    @property
    def price(self) -> int:
        """Credits one unit costs (0: not credit-metered)."""
        ...


class Limits(Protocol):
    """``(tenant, feature)`` -> its limit (:class:`meter.quotas.limits.PairLimits`); falsy
    when no pair has one."""

    def get(self, pair: tuple[str, str]) -> Limit | None: ...
    def __contains__(self, pair: object) -> bool: ...
    def __bool__(self) -> bool: ...


class PoolView(Protocol):
    """What a tenant's credit pool holds unspent (:class:`meter.quotas.shares.Shares`)."""

    async def pool(self, tenant: str) -> dict[str, Any]:
        """``{funded, unspent, held_elsewhere, in_flight}`` of ``tenant``'s pool, from storage."""
        ...


class Funder(Protocol):
    """Where a credit pool's credits come from: the tenant's ledger (docs/ledger.md)."""

    async def available(self, tenant: str) -> int:
        """Credits the tenant's ledger has now."""
        ...

    async def take(self, tenant: str, amount: int, ref: str, unspent: int) -> bool:
        """Debit ``amount`` under ``ref`` exactly once (a repeated ref answers as its first
        call did), the pool holding ``unspent`` credits before it: True if it is debited,
        False if the ledger cannot cover it."""
        ...

    async def give(self, tenant: str, amount: int, ref: str, unspent: int) -> bool:
        """Credit ``amount`` the pool gives back under ``ref`` exactly once, ``unspent``
        left in the pool: True if it is credited, False if the ledger refuses it (its
        balance would pass the maximum)."""
        ...

    def pool_expiry(self, tenant: str) -> float | None:
        """When (epoch seconds) the first grant with credits in the pool expires, as this
        node last saw the ledger (no I/O; now if it has not: look); ``None``: none does."""
        ...

    async def expired_in_pool(self, tenant: str, unspent: int) -> tuple[int, float | None]:
        """Of the pool's ``unspent`` credits, how many are of grants past their expiry now,
        and when the next grant with credits in the pool expires (``None``: none does)."""
        ...


class Budgets(Protocol):
    """This node's shares of strict budgets and credit pools (:class:`meter.quotas.shares.Shares`,
    ADR 0009): admitted from memory, refilled by writes."""

    def ready(self, key: Key, qty: int, limit: int) -> bool:
        """Whether ``qty`` units can be admitted on ``key`` from this node's share now."""
        ...

    def admit(self, key: Key, qty: int) -> None:
        """Count ``qty`` units as admitted (the caller checked :meth:`ready`)."""
        ...

    def hold(self, key: Key, qty: int) -> None:
        """Admit ``qty`` units a reservation holds."""
        ...

    def settle(self, key: Key, held: int, unused: int) -> None:
        """A reservation of ``held`` units ended with ``unused`` of them not used."""
        ...

    def free(self, key: Key, qty: int) -> None:
        """Give ``qty`` admitted units back to this node's share (never used)."""
        ...

    def admitted(self, key: Key) -> int:
        """What this node's share of ``key`` in memory counts as admitted (0: none there)."""
        ...

    def admitted_changes(self) -> list[list[Any]]:
        """The shares whose admitted count changed since the last call, for the log."""
        ...

    def admitted_all(self) -> list[list[Any]]:
        """Every share's admitted count (this process's and earlier ones'), for a checkpoint."""
        ...

    def relog(self, keys: list[Key]) -> None:
        """The log could not write these shares' counts: give them again."""
        ...

    def recovered(self, admitted: dict[tuple[Key, str], int]) -> None:
        """What earlier processes admitted under their shares, from the log."""
        ...

    def readmit(self, key: Key, qty: int, held: int) -> bool:
        """Units given back are spoken for again (a finish whose log write failed)."""
        ...

    async def ensure(
        self, key: Key, need: int, limit: int, base: int, at_least: int | None = None
    ) -> None:
        """Make room for ``need`` units on ``key``; :class:`NoBudget` if the budget cannot
        cover them, ``StorageError`` if storage cannot be asked."""
        ...

    async def ensure_pool(self, key: Key, need: int) -> None:
        """Make room for ``need`` credits in a tenant's credit pool, funded by ``funder``."""
        ...

    def release(self, key: Key, limit: int) -> None:
        """Near the limit, give back (in the background) the room this node holds unused
        on ``key``: a call it was made for was refused at another level."""
        ...

    def status(self) -> dict[str, Any]: ...


class AlertSink(Protocol):
    """Threshold alerts (:class:`meter.quotas.alerts.Alerts`): crossings detected here."""

    def detect(
        self, key: Key, limit: int, alerts: tuple[int, ...], before: int, after: int
    ) -> None:
        """The view of ``key`` went from ``before`` to ``after``."""
        ...

    def status(self) -> dict[str, Any]: ...


class PeerHeld(Protocol):
    """Units peers hold in open reservations (:class:`meter.quotas.holds.PeerHolds`)."""

    @property
    def total(self) -> Mapping[Key, int]:
        """Per counter, every live peer's held units."""
        ...


class Reporting(Protocol):
    """A part whose counters ``status`` shows."""

    def status(self) -> dict[str, Any]: ...
