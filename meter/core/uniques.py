"""Calls on unique features (docs/dimensions.md, "Unique counts"): a ``track`` of a value
counts 1 the first time the value is met in its (tenant, feature, period), on any node, and 0
after. The feature's counter holds the distinct count: an ordinary counter (flushed exactly
once, gossiped, limited, exported), which only the node that wins a value's **claim** adds to.

A claim is decided in storage by one conditional write (``claim_value``: the first claimant
stays). The claim is logged (``CLAIM``) and on disk before it is sent, and its outcome
(``CLAIMED``, with the unit it counted) in the same step as the count: a claim whose outcome
the log does not hold is claimed again under the same claimant after a restart or a failed
write, which answers the same, so a won claim counts once (ADR 0018).

What this node knows is claimed (it won or lost the claim) it keeps in a cache per key, so a
value met again is answered from memory. The cache is only a shortcut: a value it forgot is
claimed again and lost, counting nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from meter.core.dims import MAX_DIM_VALUE_BYTES
from meter.core.fence import Fence
from meter.core.gate import Gate, soft_crossing
from meter.core.idempotency import Effect, RequestIds, check_id, fingerprint
from meter.core.keycache import KeyCache
from meter.core.keys import Key
from meter.core.knownvalues import KnownValues
from meter.core.seeder import Seeder
from meter.core.table import CounterTable
from meter.core.valuevoids import ValueVoids
from meter.errors import InvalidArgument, LimitExceeded, Unavailable
from meter.wal import records as R
from meter.wal.errors import WalError
from storage.base import StorageError, StoragePermanentError, UniqueValues

log = logging.getLogger("meter.service")

#: Claims whose outcome is not known a node keeps at most; past it, new values are
#: ``unavailable`` until storage answers (each is a log sync and a checkpoint's item).
MAX_UNRESOLVED = 10_000

#: A claim sent but not answered: ``(key, value)`` by claimant.
Claims = dict[str, tuple[Key, str]]


def check_value(value: Any) -> str:
    """A unique feature's value: a printable string of 1..64 UTF-8 bytes."""
    if type(value) is not str:
        raise InvalidArgument(f"value must be a string, got {type(value).__name__}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:  # invalid UTF-8 from the wire, decoded with surrogateescape
        raise InvalidArgument("value is not valid UTF-8") from None
    if not 1 <= size <= MAX_DIM_VALUE_BYTES:
        raise InvalidArgument(f"value must be 1..{MAX_DIM_VALUE_BYTES} UTF-8 bytes")
    if not value.isprintable():
        raise InvalidArgument(f"value {value[:32]!r} is not printable")
    return value


class Uniques:
    """The calls on unique features over one node's table (see the module docstring)."""

    def __init__(
        self,
        table: CounterTable,
        keys: KeyCache,
        gate: Gate,
        fence: Fence,
        ids: RequestIds,
        seeder: Seeder,
        storage: UniqueValues,
        known: KnownValues | None = None,
        voids: ValueVoids | None = None,
    ) -> None:
        self.table = table
        self.keys = keys
        self.gate = gate
        self.fence = fence
        self.wal = fence.wal
        self.ids = ids
        self.seeder = seeder
        self.storage = storage
        #: Values known claimed, by key (a cache: see the module docstring).
        self.values = known if known is not None else KnownValues()
        #: Values a void took back, until storage marks them voided.
        self.voids = voids if voids is not None else ValueVoids(storage, fence.wal)
        #: Claims sent by a call waiting on their answer, and claims whose outcome is not
        #: known (a failed write, a restart): the latter are claimed again by :meth:`resolve`.
        self.flying: Claims = {}
        self.pending: Claims = {}
        #: The claimant of each pending claim, by ``(key, value)``.
        self._doubted: dict[tuple[Key, str], str] = {}
        #: Claims without a logged outcome (flying or pending), per key: a hard limit counts
        #: them as taken.
        self._open: dict[Key, int] = {}
        #: Outcomes of claims since start: won (counted here), lost (counted already), refused
        #: (storage cannot keep the value), undone (an outcome whose log write failed: decided
        #: again, and counted again here).
        self.won = 0
        self.lost = 0
        self.refused = 0
        self.undone = 0

    # -- tracking -------------------------------------------------------------------------------

    def known(self, key: Key, value: str) -> bool:
        """Whether ``value`` is known claimed in ``key``."""
        return self.values.has(key, value)

    def known_answer(self, tenant: Any, feature: Any, value: str) -> tuple[int | None] | None:
        """The answer to ``track(tenant, feature, 1, {"value": value})`` (no id, no ``at``)
        when ``value`` is known claimed in the current period (nothing to count), else
        ``None``: the hot path of a value met again."""
        keys = self.keys
        now = time.time()
        if not keys.day_start <= now < keys.day_end:
            return None
        try:
            key = keys.cache.get((tenant, feature))
        except TypeError:  # an unhashable name: checked (and refused) the long way
            return None
        if key is None or not self.known(key, value) or not self.table.is_seeded(key):
            return None  # (a value known of a counter not read yet: its total is unknown)
        fence = self.fence
        if fence.reason is not None:
            raise Unavailable(fence.reason)
        return (self.table.value(key),)

    def track_call(
        self,
        key: Key,
        qty: int,
        value: Any,
        at: Any,
        at_s: float | None,
        rid: Any,
        detail: bool,
    ) -> Any:
        """A ``track`` on a unique feature, or one giving a value (its names, ``qty`` and
        ``at`` checked): checked, then answered from what this node knows claimed, or a
        coroutine claiming it (:meth:`track`)."""
        if key[1] not in self.gate.uniques:
            raise InvalidArgument(
                f"track: {key[1]!r} does not count unique values (declare it with the unique "
                "aggregation); value is for those"
            )
        if value is None:
            raise InvalidArgument(
                f"track: {key[1]!r} counts unique values: give the value (option value)"
            )
        value = check_value(value)
        if qty != 1:
            raise InvalidArgument(
                f"track: a call on the unique feature {key[1]!r} counts one value: qty must be "
                f"1, got {qty}"
            )
        idem: tuple[str, int] | None = None
        if rid is not None:
            idem = (check_id(rid), fingerprint("track", key[0], key[1], qty, at, value))
            retried = self._retried(key, idem, detail)
            if retried is not None:  # a retry: counts nothing, answers as the first call did
                return retried[0]
        if at_s is not None:
            self.keys.check_open(key, at_s, time.time())
        self.fence.check()
        if self.known(key, value) and self.table.is_seeded(key):
            return self._answer(key, self.answer_known(key, idem), detail)
        return self.track(self.keys.levels(key), value, idem, detail, at_s)

    async def track(
        self,
        keys: list[Key],
        value: str,
        idem: tuple[str, int] | None,
        detail: bool,
        at_s: float | None = None,
    ) -> Any:
        """A ``track`` of ``value`` on the unique feature of ``keys`` (its levels, the call's
        own first): claimed at every level it is not known claimed at, each level's hard limit
        judged first, and counted where a claim is won; the first level's distinct count (or
        the ``check`` map)."""
        key = keys[0]
        for level in keys:
            if not self.table.is_seeded(level) and not await self.seeder.seed(level):
                raise Unavailable(f"{level[0]}/{level[1]}: storage is unreachable")
        retried = self._retried(key, idem, detail)  # (answered meanwhile?)
        if retried is not None:
            return retried[0]
        # A value storage holds claimed at a level at its limit is known there, not refused;
        # one whose claim is open already (a retry, a call at the same moment) takes no more
        # room.
        for level in keys:
            if (
                not self.known(level, value)
                and self.refusal(level) is not None
                and not self._claiming(level, value)
            ):
                await self._claimed(level, value)
        if at_s is not None:  # (its period may have closed while it waited: L06)
            self.keys.check_open(key, at_s, time.time())
        fresh = [level for level in keys if not self.known(level, value)]
        for level in fresh:  # judged again, with no await before the claims are opened
            refusal = self.refusal(level)
            if refusal is not None and not self._claiming(level, value):
                self.gate.limit_refusals += 1
                raise refusal
        if not fresh or fresh[0] != key:  # (known at the call's own level)
            if fresh:
                await self._claim(fresh, value, None)
            answer = self.answer_known(key, idem)
        else:
            answer = await self._claim(fresh, value, idem)
        return self._answer(key, answer, detail)

    def _retried(self, key: Key, idem: tuple[str, int] | None, detail: bool) -> tuple[Any] | None:
        """The first answer of a call made with ``idem``'s request id, if any."""
        if idem is None:
            return None
        entry = self.ids.lookup(idem[0], idem[1], time.time())
        return None if entry is None else (self._answer(key, entry[1], detail),)

    def _answer(self, key: Key, count: int | None, detail: bool) -> Any:
        """A ``track``'s answer: the count, or with ``detail`` the ``check`` map."""
        return self.gate.detail(key, count, 0) if detail else count

    def answer_known(self, key: Key, idem: tuple[str, int] | None) -> int | None:
        """The answer to a ``track`` of a value known claimed: the count, nothing counted (a
        request id remembered and logged with it)."""
        value = self.table.value(key)
        if idem is not None:
            self.fence.check()
            expires = self.ids.remember(idem[0], idem[1], value, time.time())
            if self.wal is not None:
                self.wal.append([R.TRACK_ID, *key, 0, idem[0], idem[1], value, expires])
        return value

    def _claiming(self, key: Key, value: str) -> bool:
        """Whether a claim of ``value`` in ``key`` is open (in flight, or waiting)."""
        if (key, value) in self._doubted:
            return True
        return any(held == (key, value) for held in self.flying.values())

    async def _claimed(self, key: Key, value: str) -> bool:
        """Whether storage holds ``value`` of ``key`` claimed (then known from now on)."""
        try:
            holder = await self.storage.claimant_of(key, value)
        except StorageError as exc:
            raise Unavailable(f"{key[0]}/{key[1]}: storage is unreachable: {exc}") from None
        if holder is None:
            return False
        self.values.add(key, value)
        return True

    def refusal(self, key: Key) -> LimitExceeded | None:
        """Why a new value of ``key`` may not be counted now: its hard limit reached (claims
        without an outcome count as taken; ``None``: it may). A price on it: raised."""
        eff = self.gate.effective(key)
        if eff is None:
            return None
        if eff.price:
            raise InvalidArgument(
                f"{key[0]}/{key[1]} counts unique values: they cannot have a price (credits a unit)"
            )
        value = self.table.value(key) or 0
        if eff.kind == "hard" and value + self._open.get(key, 0) + 1 > eff.limit:
            return LimitExceeded(
                f"{key[0]}/{key[1]}: {value} distinct values, the hard limit is {eff.limit} "
                f"({eff.source}); a new value is not counted"
            )
        return None

    async def _claim(
        self, levels: list[Key], value: str, idem: tuple[str, int] | None
    ) -> int | None:
        """Claim ``value`` at each of ``levels``: every claim logged and on disk first (one
        step: all of them, or none, are claimed again after a crash), then written at once;
        counted where won, in one step. The first level's count after it (``idem``: its
        request id)."""
        self.fence.check()
        if len(self.pending) + len(self.flying) >= MAX_UNRESOLVED:
            raise Unavailable(
                f"{len(self.pending) + len(self.flying)} claims of unique values wait for "
                "storage to answer; new values are refused until it does"
            )
        claims: list[tuple[Key, str]] = []
        new: list[tuple[Key, str]] = []
        for level in levels:
            # A claim of this value whose outcome is not known yet (a retry after an error)
            # is claimed again under its claimant, not under a new one.
            claimant = self._doubted.get((level, value))
            if claimant is None or self._undoubt(claimant) is None:
                claimant = f"{self.table.node}.{uuid.uuid4().hex[:16]}"
                self._opened(level)
                new.append((level, claimant))
            self.flying[claimant] = (level, value)
            claims.append((level, claimant))
        try:
            if self.wal is not None and new:
                for level, claimant in new:
                    self.wal.append([R.CLAIM, *level, value, claimant])
                try:
                    await self.wal.durable()
                except WalError as exc:
                    # Not sent, but a record may have reached the disk (an interval sync that
                    # failed is not cut back): claimed again once the node may, as any claim
                    # whose outcome is not known.
                    for _, claimant in claims:
                        self._doubt(claimant, *self.flying.pop(claimant))
                    raise Unavailable(f"the write-ahead log cannot be written: {exc}") from None
            got = await asyncio.gather(
                *(self.storage.claim_value(level, value, c) for level, c in claims),
                return_exceptions=True,
            )
        except BaseException:
            # A cancelled call (its client gone, the node stopping) leaves its claims to be
            # resolved like those storage did not answer: they may have been sent.
            for _, claimant in claims:
                sent = self.flying.pop(claimant, None)
                if sent is not None:
                    self._doubt(claimant, *sent)
            raise
        fenced = self.fence.reason
        answer: int | None = None
        error: BaseException | None = None
        won: list[tuple[Key, str]] = []  # (the other levels this call won, for a void)
        # The call's own level last: its outcome, logged with its request id, names them.
        for (level, claimant), outcome in [*zip(claims, got, strict=True)][::-1]:
            del self.flying[claimant]
            if isinstance(outcome, StoragePermanentError):  # never stored: nothing counted
                self._abandon(level, value, claimant)
                error = error or InvalidArgument(
                    f"{level[0]}/{level[1]}: the value cannot be kept: {outcome}"
                )
            elif isinstance(outcome, BaseException) or fenced is not None:
                # It may have landed: claimed again (same claimant) when storage answers and
                # the node may count.
                self._doubt(claimant, level, value)
                if isinstance(outcome, BaseException) and not isinstance(outcome, StorageError):
                    error = error or outcome  # (a bug: raised as it is, once all are settled)
                else:
                    error = error or Unavailable(
                        fenced
                        or f"{level[0]}/{level[1]}: storage is unreachable ({outcome}); whether "
                        "this value is new is decided when it answers, and counted at most once"
                    )
            elif level is levels[0]:
                answer = self._settle(level, value, claimant, outcome == claimant, idem, won)
            else:
                self._settle(level, value, claimant, outcome == claimant, None)
                if outcome == claimant:
                    won.append((level, claimant))
        if error is not None:
            raise error
        return answer

    def _settle(
        self,
        key: Key,
        value: str,
        claimant: str,
        won: bool,
        idem: tuple[str, int] | None,
        others: list[tuple[Key, str]] | None = None,
    ) -> int | None:
        """A claim's outcome: counted if won, logged with the count (one record), remembered;
        with ``idem``, won, what a void takes back: this level and ``others`` (the call's other
        levels it won, with their claimants)."""
        self._closed(key)
        gate = self.gate
        if won:
            self.won += 1
            after = self.table.incr(key, 1, check=False)
            eff = gate.effective(key)
            if soft_crossing(eff, after, 1):
                gate.crossed(key, eff, after)
            if gate.alerting and eff is not None and eff.alerts and after is not None:
                gate.alerts.detect(key, eff.limit, eff.alerts, after - 1, after)
        else:
            self.lost += 1
            after = self.table.value(key)
        self.values.add(key, value)
        rid = fp = expires = None
        effect: Effect | None = None
        if idem is not None:
            rid, fp = idem
            if won:
                others = others or []
                keys = (key, *(level for level, _ in others))
                won_by = (claimant, *(c for _, c in others))
                effect = Effect(1, keys, unique=(value, won_by))
            expires = self.ids.remember(rid, fp, after, time.time(), effect)
        if self.wal is not None:
            rec: list[Any] = [R.CLAIMED, *key, value, claimant, won, rid, fp, after, expires]
            if effect is not None:
                rec.append([[*level, c] for level, c in others or ()])
            self.wal.append(rec)
        return after

    def _abandon(self, key: Key, value: str, claimant: str) -> None:
        """Close a claim storage refused for good (nothing stored, nothing counted)."""
        self._closed(key)
        self.refused += 1
        if self.wal is not None:
            self.wal.append([R.CLAIMED, *key, value, claimant, False, None, None, None, None])

    # -- claims whose outcome is not known -----------------------------------------------------

    def restore(self, claims: Claims) -> None:
        """Claims the log holds without an outcome (a restart): claimed again by
        :meth:`resolve`."""
        for claimant, (key, value) in claims.items():
            self._opened(key)
            self._doubt(claimant, key, value)

    async def resolve(self) -> int:
        """Claim again every claim whose outcome is not known, under its own claimant (the
        answer is the one the first write got, had it landed); count those won. How many are
        left unknown (storage still unreachable, or the node may not count now)."""
        for claimant, (key, value) in list(self.pending.items()):
            if self._fenced():
                break
            try:
                holder = await self.storage.claim_value(key, value, claimant)
            except StoragePermanentError as exc:  # never stored: closed, nothing counted
                log.error("unique values: a claim of %s/%s cannot be kept: %s", key[0], key[1], exc)
                if self._undoubt(claimant) is not None:
                    self._abandon(key, value, claimant)
                continue
            except StorageError:
                # Tried again on the next pass, after the others (one claim failing, on one
                # key, does not hold up the rest for good).
                if self._undoubt(claimant) is not None:
                    self._doubt(claimant, key, value)
                break
            if self._fenced():
                break  # (still pending: the node may not count now)
            if self._undoubt(claimant) is not None:  # (not taken meanwhile by a call)
                self._settle(key, value, claimant, holder == claimant, None)
        return len(self.pending)

    def _fenced(self) -> bool:
        return self.fence.reason is not None

    def undo(self, record: list[Any]) -> None:
        """Take back a ``CLAIMED`` record whose log write failed (journal's undo): its count,
        its request id; the claim's outcome is found again by :meth:`resolve`."""
        t, f, p, value, claimant, won, rid = record[1:8]
        key = (t, f, p)
        if won:
            self.table.incr(key, -1, check=False)
        self.undone += 1
        if rid is not None:
            self.ids.forget(rid)
        self.values.forget(key, value)
        self._opened(key)
        self._doubt(claimant, key, value)

    def _opened(self, key: Key) -> None:
        """One more claim of ``key`` without a logged outcome."""
        self._open[key] = self._open.get(key, 0) + 1

    def _closed(self, key: Key) -> None:
        """A claim of ``key`` has its outcome logged (or never was sent)."""
        left = self._open[key] - 1
        if left:
            self._open[key] = left
        else:
            del self._open[key]

    def _doubt(self, claimant: str, key: Key, value: str) -> None:
        """Keep a claim whose outcome is not known, to be claimed again."""
        self.pending[claimant] = (key, value)
        self._doubted[(key, value)] = claimant

    def _undoubt(self, claimant: str) -> tuple[Key, str] | None:
        """Take a claim out of those whose outcome is not known (``None``: not one)."""
        held = self.pending.pop(claimant, None)
        if held is not None and self._doubted.get(held) == claimant:
            del self._doubted[held]
        return held

    def unresolved(self) -> list[str]:
        """The claimants of every claim without a logged outcome (what a checkpoint lists)."""
        return [*self.flying, *self.pending]

    def restated(self, claimants: list[str]) -> list[list[Any]]:
        """``CLAIMS`` items of those of ``claimants`` still without a logged outcome (read
        when the checkpoint writes them: one settled since it listed them is left out, or the
        record would open it again after its ``CLAIMED``)."""
        out: list[list[Any]] = []
        for claimant in claimants:
            held = self.flying.get(claimant) or self.pending.get(claimant)
            if held is not None:
                out.append([*held[0], held[1], claimant])
        return out

    # -- memory ----------------------------------------------------------------------------------

    def evict_idle(self) -> int:
        """Forget the cached values of keys the table no longer holds (evicted, or of a
        period past); how many values."""
        return self.values.evict_idle(self.table.is_warm)

    def status(self) -> dict[str, int]:
        """The ``uniques`` section of ``status``."""
        return {
            "cached_values": self.values.cached,
            "values_learned": self.values.learned,
            "claims_won": self.won,
            "claims_lost": self.lost,
            "claims_refused": self.refused,
            "claims_undone": self.undone,
            "claims_in_flight": len(self.flying),
            "claims_unresolved": len(self.pending),
            "voided_marked": self.voids.marked,
            "voided_unmarked": len(self.voids.unmarked),
        }
