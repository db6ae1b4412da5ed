"""The ``void`` method: take back a counted call by the request id it was counted under
(docs/protocol.md, ``void``; ADR 0019).

A ``track``, a ``track_many`` item or a ``commit`` made with a request id leaves, beside its
answer, what it counted (:class:`~meter.core.idempotency.Effect`: its units on each counter,
its tenant's other levels and its dimension counters included). A void counts minus those
units on exactly those counters, once: the effect is marked voided in the same step and in
the same log record, so a repeat (under its own id or another) takes back nothing more. The
units taken back are ordinary counts: logged, flushed, gossiped and exported like any.

A void is answered by the node that counted the call, while it remembers the id (the
idempotency window); anything else is ``not_found``. A call in a period past its end plus
the grace is ``period_closed``; a call on a feature priced when it was counted (it spent
credits: a void does not give them back) and a call that took units away are refused.
"""

from __future__ import annotations

import time
from typing import Any

from meter.core.fence import Fence
from meter.core.gate import Gate
from meter.core.idempotency import Effect, RequestIds, check_id, fingerprint
from meter.core.keycache import KeyCache
from meter.core.params import args as check_args
from meter.core.params import opts as check_opts
from meter.core.ports import Handler
from meter.core.seeder import Seeder
from meter.core.table import CounterTable
from meter.errors import InvalidArgument, NotFound
from meter.wal import records as R
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
    ) -> None:
        self.table = table
        self.keys = keys
        self.gate = gate
        self.fence = fence
        self.ids = ids
        self.seeder = seeder

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
        if all(self.table.is_seeded(k) for k in effect.keys):
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
                "reserve, a release, a gauge observation, a unique value, or a call logged by "
                "an older build)"
            )
        return effect

    def _check(self, effect: Effect) -> None:
        """Refuse (changing nothing) a void of ``effect`` in a closed period, of a call that
        spent credits, or of one that took units away."""
        keys = self.keys
        now = time.time()
        first = effect.keys[0]  # (a call's keys are all of one period)
        if not (keys.valid_now(now) and first[2] in keys.day_periods.values()):
            keys.check_open(first, bounds(first[2])[0], now)  # (not a current period)
        if effect.priced:
            raise InvalidArgument(
                f"void: {first[0]}/{first[1]} was priced when the call was counted (it spent "
                "credits), and a void does not give credits back; nothing changed"
            )
        if effect.qty < 0:
            raise InvalidArgument(
                f"void: the call took {-effect.qty} units away; track them again instead "
                "(a void never adds units); nothing changed"
            )

    async def _take_back_cold(self, rid: str, effect: Effect, idem: tuple[str, int] | None) -> Any:
        await self.seeder.seed_many(list(effect.keys))
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
        return self._take_back(rid, effect, idem)

    def _take_back(self, rid: str, effect: Effect, idem: tuple[str, int] | None) -> Any:
        """Count ``-qty`` on every key of ``effect`` (all or none), mark it voided, log it."""
        qty = 0 if effect.voided else effect.qty
        keys = list(effect.keys)
        if qty:
            values, _ = self.gate.count_levels(keys, -qty)
            value = values[0]
            self.ids.take_back(effect)
        else:
            value = self.table.value(keys[0])
        answer = {"voided": qty, "value": value}
        vid: str | None = None
        fp: int | None = None
        expires: float | None = None
        if idem is not None:
            vid, fp = idem
            expires = self.ids.remember(vid, fp, answer, time.time())
        wal = self.fence.wal
        if wal is not None and (qty or vid is not None):
            wal.append([R.VOID, rid, qty, [[*k] for k in keys], vid, fp, answer, expires])
        return answer
