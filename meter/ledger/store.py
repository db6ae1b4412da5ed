"""Credits ledgers in storage: the writes that :mod:`meter.ledger.model` decides.

Every change is one :meth:`~storage.base.Storage.ledger_write`: the next balance record (on
the condition of the version it was planned from), its entries and the change's ref record
(on the condition that the ref is new), all or nothing. Nothing is answered before that write
is acknowledged, so every answer is durable in the shared store.

Exactly once: a change always carries a ref (the caller's, or one made up here). After a
refused write (another writer moved the version, or the ref exists) or a lost answer, the
ledger is read again: if the ref record exists, the change landed - its first answer is given,
or :class:`~meter.errors.Conflict` if the ref was used for another request - else the change
is planned again on the fresh state. A write is never sent twice under two refs, so it can
never land twice.

Other modules write their own kinds of entry through :meth:`LedgerStore.apply` with an
:class:`~meter.ledger.model.Op` of their own (``meter.ledger.model.credit(..., kind=...)``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from meter.errors import Internal, InvalidArgument, MeterError, Unavailable
from meter.ledger import model as ledger
from meter.ledger.model import Op, State
from storage.base import BadCursor, LedgerRecords, StorageError, StorageUnavailable

log = logging.getLogger("meter.ledger")

#: Write attempts per change before answering ``unavailable`` (contention or storage down).
MAX_ATTEMPTS = 32
#: Most entries one ``ledger`` page may be asked for.
MAX_PAGE = 1000
DEFAULT_PAGE = 100
#: Tenants whose last known balance record is kept (the next write's compare-and-swap base).
CACHE_SIZE = 10_000


class LedgerStore:
    """The ledgers of every tenant, over one storage (the storage half of
    :mod:`meter.ledger.model`). ``clock`` gives epoch seconds; ``on_entries(tenant, entries)``
    is called with the entries of each write of a ledger this node made and saw land (balance
    alerts watch them)."""

    def __init__(
        self,
        storage: LedgerRecords,
        *,
        clock: Callable[[], float] = time.time,
        attempts: int = MAX_ATTEMPTS,
        backoff_base: float = 0.005,
        backoff_cap: float = 0.25,
        on_entries: Callable[[str, Sequence[ledger.Entry]], None] | None = None,
    ) -> None:
        self.storage = storage
        self.clock = clock
        self.attempts = attempts
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self.on_entries = on_entries
        # Expiries per write: a write alone of them (at most what storage takes in one write),
        # and beside an op (its entry, and the expiries it may cause after it, fit too).
        most = storage.ledger_max_entries
        if most < 3:  # (an op's entry, with an expiry before it and one after)
            raise ValueError(f"a ledger needs writes of 3 entries at least; storage takes {most}")
        self.expiries_alone = min(ledger.MAX_EXPIRE_PER_WRITE, most)
        self.expiries_with_op = min(ledger.MAX_EXPIRE_PER_WRITE, (most - 1) // 2)
        # Tenant -> (version, state) last read or written here: the compare-and-swap base of
        # the next write (a stale one only costs a refused write and a read).
        self._known: dict[str, tuple[int, State]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._waiting: dict[str, int] = {}
        #: Writes refused (version moved or ref present) and lost answers, since start.
        self.refused = 0
        self.lost = 0

    # -- public ------------------------------------------------------------------------------

    async def apply(self, tenant: str, op: Op) -> dict[str, Any]:
        """Apply ``op`` to ``tenant``'s ledger exactly once; its answer (the entry written, or
        the first answer of an earlier call with the same ref and request). Raises
        :class:`~meter.ledger.model.InsufficientBalance`, ``Conflict``, ``InvalidArgument`` or
        ``Unavailable`` (storage unreachable: nothing changed, or a retry with the same ref
        lands once)."""
        async with self._lock(tenant):
            return await self._apply(tenant, op)

    async def state(self, tenant: str) -> tuple[int, State]:
        """The ledger read from storage now, with every expiry due written first."""
        async with self._lock(tenant):
            version, state = await self._read(tenant)
            failed = 0  # (writes that landed are progress: only the others count)
            while failed < self.attempts:
                step = ledger.expiry_write(state, self.clock(), self.expiries_alone)
                if step is None:
                    return version, state
                if await self._write(tenant, version, step) == "ok":
                    version, state = version + 1, step.state
                else:
                    await self._pause(failed)
                    failed += 1
                    version, state = await self._read(tenant)
            raise Unavailable(f"ledger of {tenant!r}: the balance kept changing; retry")

    def known(self, tenant: str) -> State | None:
        """The ledger as this node last read or wrote it (no I/O; ``None``: not known)."""
        known = self._known.get(tenant)
        return None if known is None else known[1]

    async def balance(self, tenant: str, in_pool: int = 0) -> dict[str, Any]:
        """``{tenant, available, seq, grants}`` read from storage (expiries written first);
        ``in_pool``: credits unspent in the tenant's credit pool, shown against the grants
        they came from (each grant's ``in_pool``, :func:`meter.ledger.model.in_pool`)."""
        _, state = await self.state(tenant)
        mine = ledger.in_pool(state.grants, in_pool)
        return {
            "tenant": tenant,
            "available": state.balance,
            "seq": state.seq,
            "grants": [
                {**g.to_wire(), "in_pool": mine.get(g.seq, 0)}
                for g in ledger.spending_order(state.grants)
            ],
        }

    async def page(self, tenant: str, after: int, limit: int) -> dict[str, Any]:
        """Entries after sequence ``after`` (up to ``limit``) and the cursor of the next page
        (``None`` after the last). Expiries due are written first."""
        await self.state(tenant)
        try:
            rows = await self.storage.ledger_entries(tenant, after, limit + 1)
        except StorageError as exc:
            raise _unavailable(tenant, exc) from None
        more = len(rows) > limit
        entries = [ledger.decode_entry(body).to_wire() for _, body in rows[:limit]]
        cursor = entries[-1]["seq"] if more and entries else None
        return {"tenant": tenant, "entries": entries, "cursor": cursor}

    async def timeline(
        self, start_ms: int, end_ms: int, after: str | None, limit: int
    ) -> dict[str, Any]:
        """Every tenant's entries written in ``[start_ms, end_ms)``, in time order (then
        tenant, then sequence), up to ``limit`` past the cursor ``after``, and the next
        page's cursor (``None`` after the last). Expiries are in it once written (at the
        tenant's next ledger read or write after the grant expired)."""
        try:
            rows, cursor = await self.storage.ledger_timeline(start_ms, end_ms, after, limit)
        except BadCursor as exc:
            raise InvalidArgument(f"ledger_timeline: cursor: {exc}") from None
        except StorageError as exc:
            raise _timeline_unavailable(exc) from None
        entries = [{"tenant": t, **ledger.decode_entry(body).to_wire()} for t, _, body in rows]
        return {"entries": entries, "cursor": cursor}

    # -- the write loop ----------------------------------------------------------------------

    async def _apply(self, tenant: str, op: Op) -> dict[str, Any]:
        known = self._known.get(tenant)
        fresh = known is None
        version, state = known if known is not None else await self._read(tenant)
        attempt = 0  # (writes that landed are progress: only the others count)
        while attempt < self.attempts:
            try:
                step = ledger.next_write(
                    state, op, self.clock(), self.expiries_with_op, self.expiries_alone
                )
            except MeterError:
                if not fresh:  # refused on a cached state: decide on the stored one
                    version, state = await self._read(tenant)
                    fresh = True
                    attempt += 1
                    continue
                # A retry of a change that already landed is answered from its ref record
                # (the balance may have moved since); else the refusal stands, nothing written.
                first = await self._ref(tenant, op)
                if first is not None:
                    return first
                raise
            outcome = await self._write(tenant, version, step)
            if outcome == "ok":
                if step.done:
                    assert step.answer is not None
                    return step.answer
                version, state, fresh = version + 1, step.state, True  # expiries first
                continue
            # Refused, or the answer lost: the ref record tells whether the change is in.
            if step.done:
                first = await self._ref(tenant, op)
                if first is not None:
                    return first
            await self._pause(attempt)
            attempt += 1
            version, state = await self._read(tenant)
            fresh = True
        raise Unavailable(f"ledger of {tenant!r}: the balance kept changing; retry")

    async def _write(self, tenant: str, version: int, step: ledger.Write) -> str:
        """Write ``step`` on ``version``: ``ok``, ``refused`` (nothing written) or ``lost``
        (it may have landed: read again to tell)."""
        entries = [(e.seq, ledger.encode_entry(e), round(e.time * 1000)) for e in step.entries]
        refs = [] if step.ref is None or step.ref_body is None else [(step.ref, step.ref_body)]
        body = ledger.encode_state(step.state)
        try:
            ok = await self.storage.ledger_write(tenant, version, body, entries, refs)
        except StorageUnavailable as exc:
            self.lost += 1
            self._known.pop(tenant, None)
            log.info("ledger of %r: a write's answer was lost (%s); reading again", tenant, exc)
            return "lost"
        except StorageError as exc:
            self._known.pop(tenant, None)
            raise Internal(f"ledger of {tenant!r}: storage refused the write: {exc}") from None
        if ok:
            self._remember(tenant, version + 1, step.state)
            if self.on_entries is not None and step.entries:
                self.on_entries(tenant, step.entries)
            return "ok"
        self.refused += 1
        self._known.pop(tenant, None)
        return "refused"

    async def _ref(self, tenant: str, op: Op) -> dict[str, Any] | None:
        """``op``'s first answer if its ref was written (``Conflict`` if for another
        request), else ``None``."""
        try:
            body = await self.storage.ledger_ref(tenant, op.ref)
        except StorageError as exc:
            raise _unavailable(tenant, exc) from None
        return None if body is None else ledger.repeated(op, body)

    async def _read(self, tenant: str) -> tuple[int, State]:
        try:
            version, body = await self.storage.ledger_read(tenant)
        except StorageError as exc:
            self._known.pop(tenant, None)
            raise _unavailable(tenant, exc) from None
        state = ledger.decode_state(body)
        self._remember(tenant, version, state)
        return version, state

    def _remember(self, tenant: str, version: int, state: State) -> None:
        if tenant not in self._known and len(self._known) >= CACHE_SIZE:
            self._known.clear()
        self._known[tenant] = (version, state)

    async def _pause(self, attempt: int) -> None:
        cap = min(self.backoff_cap, self.backoff_base * 2**attempt)
        await asyncio.sleep(random.uniform(0, cap))

    def _lock(self, tenant: str) -> _TenantLock:
        return _TenantLock(self, tenant)


class _TenantLock:
    """One writer per tenant in this process (others are serialised by the version)."""

    def __init__(self, book: LedgerStore, tenant: str) -> None:
        self.book = book
        self.tenant = tenant

    async def __aenter__(self) -> None:
        book, tenant = self.book, self.tenant
        lock = book._locks.get(tenant)
        if lock is None:
            lock = book._locks[tenant] = asyncio.Lock()
        book._waiting[tenant] = book._waiting.get(tenant, 0) + 1
        try:
            await lock.acquire()
        except BaseException:
            self._leave()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self.book._locks[self.tenant].release()
        self._leave()

    def _leave(self) -> None:
        book, tenant = self.book, self.tenant
        left = book._waiting[tenant] - 1
        if left:
            book._waiting[tenant] = left
        else:
            del book._waiting[tenant]
            del book._locks[tenant]


def _timeline_unavailable(exc: StorageError) -> MeterError:
    if not exc.retryable:
        return Internal(f"ledger timeline: {exc}")
    return Unavailable(f"ledger timeline: storage unreachable: {exc}")


def _unavailable(tenant: str, exc: StorageError) -> MeterError:
    if not exc.retryable:
        return Internal(f"ledger of {tenant!r}: {exc}")
    return Unavailable(f"ledger of {tenant!r}: storage unreachable, nothing changed: {exc}")
