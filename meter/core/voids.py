"""The ``void`` method: take back a counted call by the request id it was counted under
(docs/protocol.md, ``void``; ADR 0019).

A ``track``, a ``track_many`` item or a ``commit`` made with a request id leaves, beside its
answer, what it counted (:class:`~meter.core.idempotency.Effect`: its units on each counter,
its tenant's other levels and its dimension counters included). A void counts minus those
units on exactly those counters, once: the effect is marked voided in the same step and in
the same log record, so a repeat (under its own id or another) takes back nothing more. The
units taken back are ordinary counts: logged, flushed, gossiped and exported like any.
Credits the call spent (at the prices that applied when it was counted) go back, in the same
step, to this node's shares of the pools that paid: unspent again, logged with the void (the
shares' admitted counts end the same log commit). A call that counted a unique value is taken
back at every level whose claim it won; the value stays claimed in its period (tracked again,
it counts 0), and storage marks it voided (meter.core.valuevoids; ADR 0022).

A void is answered by the node that counted the call, while it remembers the id (the
idempotency window); anything else is ``not_found``. A call in a period past its end plus
the grace is ``period_closed``; a call that took units away, and one whose credits an older
build logged without their amount, are refused.
"""

from __future__ import annotations

import time
from typing import Any

from meter.core.fence import Fence
from meter.core.gate import Gate, pool_key
from meter.core.idempotency import Effect, RequestIds, check_id, fingerprint
from meter.core.keycache import KeyCache
from meter.core.params import args as check_args
from meter.core.params import opts as check_opts
from meter.core.ports import POOL, Handler, NoBudget
from meter.core.seeder import Seeder
from meter.core.table import CounterTable
from meter.core.valuevoids import ValueVoids
from meter.errors import InvalidArgument, NotFound, Unavailable
from meter.wal import records as R
from meter.wal.records import spent_to_log
from storage.base import StorageError
from storage.periods import bounds

_OPTS = frozenset({"id"})


class Voids:
    """The ``void`` handler, over the node's counters and remembered ids."""

    def __init__(
        self,
        table: CounterTable,
        keys: KeyCache,
        gate: Gate,
        fence: Fence,
        ids: RequestIds,
        seeder: Seeder,
        values: ValueVoids,
    ) -> None:
        self.table = table
        self.keys = keys
        self.gate = gate
        self.fence = fence
        self.ids = ids
        self.seeder = seeder
        self.values = values

    def handlers(self) -> dict[str, Handler]:
        """The methods by name, for the node's dispatch table."""
        return {"void": self.void}

    def void(self, params: list[Any]) -> Any:
        """The ``void`` method: ``void(id, {"id": void_id}?)`` answers ``{"voided": units
        taken back now (0: voided before), "value": the feature's total after}``."""
        rid, opts = check_args("void", params, 1, 2, ({},))
        rid = check_id(rid)
        vid = check_opts("void", opts, _OPTS).get("id")
        idem: tuple[str, int] | None = None
        if vid is not None:
            idem = (check_id(vid), fingerprint("void", rid))
            entry = self.ids.lookup(idem[0], idem[1], time.time())
            if entry is not None:
                return entry[1]  # a retry: answers as the first void did
        effect = self._effect(rid)
        self._check(effect)
        self.fence.check()
        if all(self.table.is_seeded(k) for k in effect.keys) and self._unrefundable(effect) is None:
            return self._take_back(rid, effect, idem)
        return self._take_back_cold(rid, effect, idem)

    def _effect(self, rid: str) -> Effect:
        """What the call under ``rid`` counted; :class:`NotFound` if no such call is known."""
        found = self.ids.get(rid)
        if found is None or found[2] <= time.time():
            raise NotFound(
                f"void: no call with id {rid[:64]!r} is remembered by this node (ids are kept "
                "for idempotency_window_s on the node that counted the call)"
            )
        effect = self.ids.effect(rid)
        if effect is None:
            raise NotFound(
                f"void: the call with id {rid[:64]!r} counted nothing a void takes back (a "
                "reserve, a release, a gauge observation, a unique value counted before it, or "
                "a call logged by an older build)"
            )
        return effect

    def _check(self, effect: Effect) -> None:
        """Refuse (changing nothing) a void of ``effect`` in a closed period, of a call that
        took units away, or of one whose credits are not known."""
        keys = self.keys
        now = time.time()
        first = effect.keys[0]  # (a call's keys are all of one period)
        if not (keys.valid_now(now) and first[2] in keys.day_periods.values()):
            keys.check_open(first, bounds(first[2])[0], now)  # (not a current period)
        if effect.credits is None:
            raise InvalidArgument(
                f"void: {first[0]}/{first[1]} was priced when the call was counted, by an "
                "older build that logged that it spent credits but not how many, so they "
                "cannot be given back; nothing changed"
            )
        if effect.qty < 0:
            raise InvalidArgument(
                f"void: the call took {-effect.qty} units away; track them again instead "
                "(a void never adds units); nothing changed"
            )

    def _unrefundable(self, effect: Effect) -> str | None:
        """Why the credits ``effect`` spent cannot go back now (None: they can, or there are
        none to give: none spent, or voided already)."""
        if effect.voided or not effect.credits:
            return None
        return self.gate.refundable(effect.credits)

    async def _take_back_cold(self, rid: str, effect: Effect, idem: tuple[str, int] | None) -> Any:
        await self.seeder.seed_many(list(effect.keys))
        if self._unrefundable(effect) is not None:  # a pool share that paid: taken first
            try:
                for tenant, _ in effect.credits or ():
                    await self.gate.shares.ensure(pool_key(tenant), 0, POOL, 0)
            except NoBudget as exc:  # (no pool record: nothing was ever spent from it)
                raise Unavailable(f"void: a credit pool that paid is not there: {exc}") from None
            except StorageError as exc:
                raise Unavailable(f"void: the credit pool cannot be read: {exc}") from None
        if idem is not None:  # (another void may have answered meanwhile)
            entry = self.ids.lookup(idem[0], idem[1], time.time())
            if entry is not None:
                return entry[1]
        # Meanwhile the call may have been undone (its log write failed), its id may have
        # expired, or its period closed: judged again.
        if self._effect(rid) is not effect:
            raise NotFound(f"void: the call with id {rid[:64]!r} is no longer remembered")
        self._check(effect)
        self.fence.check()
        why = self._unrefundable(effect)
        if why is not None:
            raise Unavailable(f"void: the credits it spent cannot be given back now ({why}); retry")
        return self._take_back(rid, effect, idem)

    def _take_back(self, rid: str, effect: Effect, idem: tuple[str, int] | None) -> Any:
        """Count ``-qty`` on every key of ``effect`` (all or none), give back the credits it
        spent, mark it voided, log it."""
        qty = 0 if effect.voided else effect.qty
        keys = list(effect.keys)
        credits = effect.credits or ()
        unique = effect.unique if qty else None
        if qty:
            values, _ = self.gate.count_levels(keys, -qty)
            value = values[0]
            self.gate.refund(credits)
            self.ids.take_back(effect)
            if unique is not None:
                for key, claimant in zip(keys, unique[1], strict=True):
                    self.values.voided(key, unique[0], claimant)
        else:
            value = self.table.value(keys[0])
        answer: dict[str, Any] = {"voided": qty, "value": value}
        if credits:  # (given back now, or by the void that took the units back)
            answer["credits"] = sum(n for _, n in credits) if qty else 0
        vid: str | None = None
        fp: int | None = None
        expires: float | None = None
        if idem is not None:
            vid, fp = idem
            expires = self.ids.remember(vid, fp, answer, time.time())
        wal = self.fence.wal
        if wal is not None and (qty or vid is not None):
            rec = [R.VOID, rid, qty, [[*k] for k in keys], vid, fp, answer, expires]
            if qty and (credits or unique):  # (what an undo takes from the pools again)
                rec.append(spent_to_log(credits))
            if unique is not None:  # (marked voided in storage, after a restart too)
                rec.append([unique[0], list(unique[1])])
            wal.append(rec)
        return answer
