"""Calls on gauges (``max`` and ``latest`` features, docs/dimensions.md): a ``track`` is an
observation of a value, merged into the gauge (:mod:`meter.core.gauges`), checked against
the feature's hard limit first, logged, and remembered under its request id.

A gauge is read from storage before its first use on this node (its view then holds every
stored reading), as a counter is; the reads of one key at once share one read. Observations
are written to storage by the node's gauge flusher (:mod:`meter.persist.gauges`) and sent to
peers by gossip; both merge, so neither needs sequences.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from meter.core.dims import check_dims
from meter.core.fence import Fence
from meter.core.gate import Gate, soft_crossing
from meter.core.gauges import GaugeTable, Reading
from meter.core.idempotency import RequestIds
from meter.core.keycache import KeyCache
from meter.core.keys import Key, check_at, check_qty
from meter.core.params import args as check_args
from meter.core.params import opts as check_opts
from meter.errors import InvalidArgument, LimitExceeded, Unavailable
from meter.wal import records as R
from storage.base import GaugeRecords, StorageError

_CHECK_OPTS = frozenset({"at", "dims"})


class Gauging:
    """The gauge calls over one node's gauge table (see the module docstring)."""

    def __init__(
        self,
        table: GaugeTable,
        keys: KeyCache,
        gate: Gate,
        fence: Fence,
        ids: RequestIds,
        storage: GaugeRecords,
    ) -> None:
        self.table = table
        self.keys = keys
        self.gate = gate
        self.fence = fence
        self.wal = fence.wal
        self.ids = ids
        self.storage = storage
        # Reads in flight, by key: callers of one key share one.
        self._loading: dict[Key, asyncio.Future[None]] = {}

    def kind(self, feature: str) -> str | None:
        """``max`` or ``latest`` for a gauge feature, else ``None``."""
        return self.gate.gauges.get(feature)

    # -- observing ----------------------------------------------------------------------------

    def track(
        self,
        key: Key,
        kind: str,
        value: Any,
        at: float | None,
        idem: tuple[str, int] | None,
        detail: bool,
    ) -> Any:
        """A ``track`` on a gauge: the observation of ``value`` at ``at`` (default now); the
        gauge's value after it (or the ``check`` map), or a coroutine reading the gauge first."""
        value = check_qty(value, what="value")
        self.refuse(key, value)
        if self.table.is_seeded(key):
            self.fence.check()
            return self.observe(key, kind, value, at, idem, detail)
        return self._track_cold(key, kind, value, at, idem, detail)

    async def _track_cold(
        self,
        key: Key,
        kind: str,
        value: int,
        at: float | None,
        idem: tuple[str, int] | None,
        detail: bool,
    ) -> Any:
        await self.load([(key, kind)])
        if idem is not None:  # a call with the same id may have been made meanwhile
            entry = self.ids.lookup(idem[0], idem[1], time.time())
            if entry is not None:
                return self.gate.detail(key, entry[1], 0) if detail else entry[1]
        if at is not None:
            self.keys.check_open(key, at, time.time())
        self.fence.check()
        self.refuse(key, value)
        return self.observe(key, kind, value, at, idem, detail)

    def refuse(self, key: Key, value: int) -> None:
        """Raise if an observation of ``value`` may not be made: past the feature's hard
        limit (``limit_exceeded``; strict or fast alike: each observation is judged alone),
        or under a price (a gauge's values are not units to pay for)."""
        eff = self.gate.effective(key)
        if eff is None:
            return
        if eff.price:
            raise InvalidArgument(
                f"{key[0]}/{key[1]} is a gauge: its values cannot have a price (credits a unit)"
            )
        if eff.kind == "hard" and value > eff.limit:
            self.gate.limit_refusals += 1
            raise LimitExceeded(
                f"{key[0]}/{key[1]}: {value} is above the hard limit {eff.limit} "
                f"({eff.source}); not observed"
            )

    def observe(
        self,
        key: Key,
        kind: str,
        value: int,
        at: float | None,
        idem: tuple[str, int] | None,
        detail: bool = False,
    ) -> Any:
        """Merge and log one observation (the limits checked, the key seeded); its answer."""
        at_ms = int((time.time() if at is None else at) * 1000)
        after, before, observed, before_mine = self.table.observe(
            key, kind, value, at_ms, now=at is None
        )
        gate = self.gate
        eff = gate.effective(key)
        if eff is not None:
            old = 0 if before is None else before[0]
            if after > old and soft_crossing(eff, after, after - old):
                gate.crossed(key, eff, after)
            if gate.alerting and eff.alerts and after > old:
                gate.alerts.detect(key, eff.limit, eff.alerts, old, after)
        rid = fp = expires = None
        if idem is not None:
            rid, fp = idem
            expires = self.ids.remember(rid, fp, after, time.time())
        if self.wal is not None:
            self.wal.append(
                [R.GAUGE, *key, kind, *observed, _listed(before), rid, fp, after, expires,
                 _listed(before_mine)]
            )  # fmt: skip
        return gate.detail(key, after, 0) if detail else after

    def undo(self, record: list[Any]) -> None:
        """Take back a ``GAUGE`` record whose log write failed (journal's undo)."""
        t, f, p, _, value, at_ms, node, before, rid = record[1:10]
        observed: Reading = (value, at_ms, node)
        self.table.undo((t, f, p), _reading(before), observed, _reading(record[13]))
        if rid is not None:
            self.ids.forget(rid)

    def or_counters(self, counters: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
        """The ``check`` method: :meth:`check` for a gauge, else ``counters``."""
        gate = self.gate

        def check(params: list[Any]) -> Any:  # (gate.gauges: the declarations of now)
            if len(params) >= 2 and type(params[1]) is str and params[1] in gate.gauges:
                return self.check(params)
            return counters(params)

        return check

    def check(self, params: list[Any]) -> Any:
        """The ``check`` method on a gauge: would an observation of ``value`` be made now
        (its map, as :meth:`Gate.detail`'s, of the gauge as it is), changing nothing."""
        tenant, feature, value, opts = check_args("check", params, 2, 4, (1, {}))
        o = check_opts("check", opts, _CHECK_OPTS)
        at = o.get("at")
        at_s = None if at is None else check_at(at)
        key = self.keys.key_for(tenant, feature, at_s)
        value = check_qty(value, what="value")
        if o.get("dims"):
            check_dims(key[1], self.keys.spec(key[1]), o["dims"])  # (a gauge declares none)
        if at_s is not None:
            self.keys.check_open(key, at_s, time.time())
        kind = self.kind(key[1]) or "max"
        current = self.table.value(key)
        if current is not None:
            return self._check_map(key, value, current)
        return self._check_cold(key, kind, value)

    async def _check_cold(self, key: Key, kind: str, value: int) -> dict[str, Any]:
        await self.load([(key, kind)])
        current = self.table.value(key)
        if current is None:
            raise Unavailable("storage is unreachable and this gauge's reading is not known")
        return self._check_map(key, value, current)

    def _check_map(self, key: Key, value: int, current: int) -> dict[str, Any]:
        out = self.gate.detail(key, current, 0)
        eff = self.gate.effective(key)
        if eff is not None:
            over = value > eff.limit
            out["over"] = over
            out["allowed"] = (not over or eff.kind == "soft") and not eff.price
        return out

    # -- reading -------------------------------------------------------------------------------

    def value(self, key: Key, kind: str) -> Any:
        """``usage`` of a gauge: its value (0 if never observed), or a coroutine reading it."""
        value = self.table.value(key)
        if value is not None:
            return value
        return self._value_cold(key, kind)

    async def _value_cold(self, key: Key, kind: str) -> int:
        await self.load([(key, kind)])
        value = self.table.value(key)
        if value is None:
            raise Unavailable("storage is unreachable and this gauge's reading is not known")
        return value

    async def load(self, keys: list[tuple[Key, str]]) -> None:
        """Read the stored readings of the unseeded ``keys`` (``(key, kind)``) into the
        table; calls waiting on one key share one read (a task of its own: a caller cancelled
        leaves it to the others). :class:`Unavailable` if storage cannot be read."""
        waits: list[asyncio.Future[None]] = []
        wanted: list[tuple[Key, str]] = []
        for key, kind in keys:
            if self.table.is_seeded(key):
                continue
            pending = self._loading.get(key)
            if pending is not None:
                waits.append(pending)
            else:
                wanted.append((key, kind))
        if wanted:
            task = asyncio.ensure_future(self._read(wanted))
            task.add_done_callback(_retrieved)
            for key, _ in wanted:
                self._loading[key] = task
            waits.append(task)
        for wait in waits:
            await asyncio.shield(wait)

    async def _read(self, wanted: list[tuple[Key, str]]) -> None:
        try:
            read = await self.storage.load_gauges([key for key, _ in wanted])
            for key, kind in wanted:
                self.table.seed(key, kind, read.get(key))
        except StorageError as exc:
            raise Unavailable(f"storage is unreachable: {exc}") from None
        finally:
            for key, _ in wanted:
                self._loading.pop(key, None)


def _retrieved(task: asyncio.Future[None]) -> None:
    """(Every waiter may be gone: the read's outcome is taken, never reported unread.)"""
    if not task.cancelled():
        task.exception()


def _listed(reading: Reading | None) -> list[Any] | None:
    return None if reading is None else list(reading)


def _reading(listed: list[Any] | None) -> Reading | None:
    return None if listed is None else (listed[0], listed[1], listed[2])
