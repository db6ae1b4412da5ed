"""Tracking: ``track``, ``track_many`` and the pipelined fast path of plain warm tracks.

A warm key is counted synchronously (no await on the hot path); a cold one returns a
coroutine that seeds it from storage first. Counts under a limit, a price or the tenant
hierarchy go through the :class:`~meter.core.gate.Gate`. Every count is in the write-ahead
log (one record per call) before the call is answered, and a call's request id is
remembered with its answer so a retry counts nothing. A call with dimensions counts on its
feature's dimension counters too (:meth:`~meter.core.keycache.KeyCache.spread`), as on a
tenant's levels, and a counter new to this node is first checked against its feature's bound
(:class:`~meter.core.groups.Groups`).

Why one module: ``track`` and every item of ``track_many`` take the same steps after their
params are read (seeding, the gate's levels, the bound on new dimension counters, request ids,
one log record); split, each step would be written twice and the two could drift apart.
"""

from __future__ import annotations

import time
from typing import Any, cast

from meter.core.dims import Pairs, check_dims
from meter.core.fence import Fence, log_down
from meter.core.gate import Gate, Short
from meter.core.gauging import Gauging
from meter.core.groups import Groups
from meter.core.idempotency import Effect, RequestIds, check_id, fingerprint
from meter.core.keycache import DimNode, KeyCache
from meter.core.keys import QTY_MAX, Key, check_at, check_qty, in_range
from meter.core.params import args as check_args
from meter.core.params import opts as check_opts
from meter.core.ports import POOL
from meter.core.seeder import Seeder
from meter.core.table import CounterTable, PartlyRefused
from meter.core.uniques import Uniques
from meter.errors import Conflict, InvalidArgument, MeterError, Unavailable
from meter.wal import records as R
from meter.wal.records import spent_to_log

#: Longest ``track_many`` batch.
MAX_BATCH_ITEMS = 10_000
#: Writes a call waits for when strict shares keep running out under it (other calls take
#: the room each write makes) before it answers ``unavailable``.
MAX_ROOM_TRIES = 8

_TRACK_OPTS = frozenset({"at", "id", "detail", "dims", "value"})
_ITEM_OPTS = frozenset({"id", "dims"})

#: Not decided yet (see Gate.warm_check).
_UNKNOWN = object()


class Tracking:
    """The counting methods over one table (see the module docstring)."""

    def __init__(
        self,
        table: CounterTable,
        keys: KeyCache,
        gate: Gate,
        fence: Fence,
        ids: RequestIds,
        seeder: Seeder,
        groups: Groups,
        gauging: Gauging,
        uniques: Uniques,
    ) -> None:
        self.table = table
        self.keys = keys
        self.gate = gate
        #: Calls on gauges (``max``, ``latest``): observations, not counts.
        self.gauging = gauging
        #: Calls on unique features: values counted once.
        self.uniques = uniques
        #: Dimension counters: listed, bounded (docs/dimensions.md).
        self.groups = groups
        self.fence = fence
        #: The write-ahead log (``fence.wal``, kept here for the hot path).
        self.wal = fence.wal
        self.ids = ids
        self.seeder = seeder
        #: ``track_many`` items refused (the call itself answered), by error code.
        self.item_refusals: dict[str, int] = {}

    def _refused_item(self, code: str) -> None:
        self.item_refusals[code] = self.item_refusals.get(code, 0) + 1

    def warm_tracks(self, requests: list[Any]) -> list[int]:
        """Count the leading run of plain warm ``track`` requests of a pipelined batch.

        ``requests`` are MessagePack-RPC requests ``[0, msgid, method, params]``. From the
        first, every request that is ``track(tenant, feature, qty)`` on a seeded key whose
        names this node has already validated today is counted, under one hold of the table's
        lock; the run stops at the first other request. Returns the new values of the
        requests counted (answers to the first ``len(result)`` requests, in order); the caller
        dispatches the rest one by one, in order, so pipelined requests keep their order.
        """
        now = time.time()
        keys = self.keys
        if not keys.day_start <= now < keys.day_end or self.fence.reason is not None:
            return []  # (fenced: dispatch answers each one unavailable)
        wal = self.wal
        if wal is not None and wal.broken is not None:
            return []  # dispatch answers each one unavailable
        cache = keys.cache
        gate = self.gate
        gated = gate.gated
        items: list[tuple[Key, int]] = []
        # Credit-metered items with no other check ride along when their pool's share has
        # room for them all: (item index, pool, credits), admitted once counted.
        priced: list[tuple[int, Key, int]] = []
        needs: dict[Key, int] = {}
        checks = gate.warm_checks
        shares = gate.shares
        for req in requests:
            if type(req) is not list or req[2] != "track":
                break
            params = req[3]
            if len(params) != 3:
                break
            tenant, feature, qty = params
            if type(tenant) is not str or type(feature) is not str or type(qty) is not int:
                break
            key = cache.get((tenant, feature))
            if key is None or not in_range(qty):
                break
            if gated:
                how = checks.get((tenant, feature), _UNKNOWN)
                if how is _UNKNOWN:
                    how = gate.warm_check(key)
                if how is not None:
                    if how is False or qty <= 0:
                        break  # checked (limits, levels) by dispatch
                    pool, price = how
                    credits = price * qty
                    if credits > QTY_MAX:
                        break  # dispatch refuses it, clearly
                    need = needs.get(pool, 0) + credits
                    if not shares.ready(pool, need, POOL):
                        break  # the pool needs a write first (or a clear refusal): dispatch
                    needs[pool] = need
                    priced.append((len(items), pool, credits))
            items.append((key, qty))
        if not items:
            return []
        values = self.table.incr_prefix(items)
        if priced:
            if len(values) < len(items):  # a prefix was counted: only its credits are spent
                needs = {}
                for n, pool, credits in priced:
                    if n < len(values):
                        needs[pool] = needs.get(pool, 0) + credits
            for pool, need in needs.items():
                gate.take(pool, need)
        if wal is not None and values:
            counted = items if len(values) == len(items) else items[: len(values)]
            wal.append([R.TRACK_MANY, [[*k, q] for k, q in counted]])
        return values

    # -- track --------------------------------------------------------------------------------

    def track(self, params: list[Any]) -> Any:
        """The ``track`` method."""
        if len(params) == 3:  # the common shape: no opts, so no period choice to check
            tenant, feature, qty = params
            key = None
            keys = self.keys
            if type(tenant) is str and type(feature) is str:
                # key_for's cache, inlined: this is the node's hottest path.
                now = time.time()
                if keys.day_start <= now < keys.day_end:
                    key = keys.cache.get((tenant, feature))
            if key is None:
                key = keys.key_for(tenant, feature)
            if type(qty) is not int or not in_range(qty):
                qty = check_qty(qty)  # raises the usual error
            fence = self.fence
            if fence.reason is not None:
                raise Unavailable(fence.reason)
            gate = self.gate
            if gate.gated and gate.needs_check(key):
                fence.check()
                return self._track_checked(key, qty, None, False, None)
            wal = self.wal
            if wal is None:
                value = self.table.try_incr(key, qty)
                if value is not None:
                    return value
                return self._track_cold(key, qty, None)
            if wal.broken is not None:
                raise log_down(wal)
            value = self.table.try_incr(key, qty)
            if value is not None:
                wal.append([R.TRACK, key[0], key[1], key[2], qty])
                return value
            return self._track_cold(key, qty, None)
        if len(params) == 4:
            opts = params[3]
            if type(opts) is dict and len(opts) == 1:
                dims = opts.get("dims")
                if type(dims) is dict:
                    spread = self._known_spread(params[0], params[1], dims)
                    if spread is not None:
                        return self._track_known(spread, params[2])
                given = opts.get("value")
                if type(given) is str and type(params[2]) is int and params[2] == 1:
                    known = self.uniques.known_answer(params[0], params[1], given)
                    if known is not None:
                        return known[0]
        tenant, feature, qty, opts = check_args("track", params, 2, 4, (1, {}))
        o = check_opts("track", opts, _TRACK_OPTS)
        at = o.get("at")
        rid = o.get("id")
        detail = o.get("detail", False)
        if type(detail) is not bool:
            raise InvalidArgument(f"track: detail must be true or false, got {detail!r:.32}")
        at_s = None if at is None else check_at(at)
        key = self.keys.key_for(tenant, feature, at_s)
        qty = check_qty(qty)
        dims = o.get("dims")
        pairs: Pairs = () if dims is None else check_dims(key[1], self.keys.spec(key[1]), dims)
        if "value" in o or key[1] in self.gate.uniques:
            return self.uniques.track_call(key, qty, o.get("value"), at, at_s, rid, detail)
        idem: tuple[str, int] | None = None
        if rid is not None:
            # The period is named by ``at`` only: a retry that crosses midnight or a month end
            # is still the same call (it answers as the first did).
            parts: tuple[Any, ...] = (key[0], key[1], qty, at, pairs) if pairs else (
                key[0], key[1], qty, at)  # fmt: skip
            idem = (check_id(rid), fingerprint("track", *parts))
            entry = self.ids.lookup(idem[0], idem[1], time.time())
            if entry is not None:
                # A retry: counts nothing, answers as the first call did.
                return self.gate.detail(key, entry[1], 0) if detail else entry[1]
        if at_s is not None:  # (after a retry's answer: a counted call stays answered)
            self.keys.check_open(key, at_s, time.time())
        self.fence.check()
        if pairs:
            assert dims is not None
            return self._track_dims(self.keys.spread(key, pairs, dims), qty, idem, detail, at_s)
        if detail or (self.gate.gated and self.gate.needs_check(key)):
            return self._track_checked(key, qty, idem, detail, at_s)
        if self.table.is_seeded(key):
            return self._count(key, qty, idem)
        return self._track_cold(key, qty, idem, at_s)

    async def _track_cold(
        self, key: Key, qty: int, idem: tuple[str, int] | None, at: float | None = None
    ) -> int | None:
        if not self.table.is_seeded(key):
            await self.seeder.seed(key)
        if idem is not None:
            # A call with the same id may have counted while this one waited.
            entry = self.ids.lookup(idem[0], idem[1], time.time())
            if entry is not None:
                return cast(int | None, entry[1])
        if at is not None:  # (its period may have closed while it waited)
            self.keys.check_open(key, at, time.time())
        if self.gate.gated and self.gate.needs_check(key):  # a limit was set meanwhile
            value = await self._track_checked_cold(self.keys.levels(key), qty, idem, False, at)
            return cast(int | None, value)
        self.fence.check()
        # Counted whether or not seeding worked: usage is never dropped. An unseeded key
        # answers None, because its total is not known.
        return self._count(key, qty, idem)

    def _track_checked(
        self, key: Key, qty: int, idem: tuple[str, int] | None, detail: bool, at: float | None
    ) -> Any:
        kind = self.gate.gauges.get(key[1])
        if kind is not None:  # a gauge: an observation of the value ``qty``
            return self.gauging.track(key, kind, qty, at, idem, detail)
        if key[1] in self.gate.uniques:
            raise InvalidArgument(
                f"track: {key[1]!r} counts unique values: give the value (option value)"
            )
        keys = self.keys.levels(key)
        if all(self.table.is_seeded(k) for k in keys):
            try:
                return self._count_checked(keys, qty, idem, detail)
            except Short:
                pass  # a strict share needs more room: one storage write, below
        return self._track_checked_cold(keys, qty, idem, detail, at)

    def _known_spread(self, tenant: Any, feature: Any, dims: dict[Any, Any]) -> list[Key] | None:
        """The keys of a call with ``dims`` of the current period checked before (the
        :attr:`KeyCache.dim_names`), or ``None``."""
        keys = self.keys
        now = time.time()
        if not keys.day_start <= now < keys.day_end:
            return None
        node = keys.known_dims(feature, dims)
        if node is None or node.names is None or type(tenant) is not str:
            return None
        key = keys.cache.get((tenant, feature))
        return None if key is None else keys.spread_names(key, node.names)

    def _track_known(self, keys: list[Key], qty: Any) -> Any:
        """A ``track`` with dimensions the cache knows (no id, no ``at``): counted on every
        key under one hold of the table's lock when none is under a limit."""
        if type(qty) is not int or not in_range(qty):
            qty = check_qty(qty)  # raises the usual error
        fence = self.fence
        if fence.reason is not None:
            raise Unavailable(fence.reason)
        gate = self.gate
        wal = self.wal
        if (not gate.gated or not any(gate.needs_check(k) for k in keys)) and (
            wal is None or wal.broken is None
        ):
            items = [(k, qty) for k in keys]
            try:
                values = self.table.incr_seeded(items)
            except PartlyRefused as refused:  # past the 64-bit range somewhere: none counted
                raise self._undo_refused(items, refused.answers) from None
            if values is not None:
                if wal is not None:
                    wal.append([R.TRACK_MANY, [[*k, qty] for k in keys]])
                return values[0]
        fence.check()
        return self._track_dims(keys, qty, None, False, None)

    def _undo_refused(
        self, items: list[tuple[Key, int]], answers: list[int | InvalidArgument]
    ) -> InvalidArgument:
        """Take back the counted part of a call's keys some of which the range check refused
        (a call counts on all of them or none); the refusal."""
        refusal: InvalidArgument | None = None
        for (key, qty), answer in zip(items, answers, strict=True):
            if isinstance(answer, InvalidArgument):
                refusal = refusal or answer
            else:
                self.table.incr(key, -qty, check=False)
        assert refusal is not None
        return refusal

    def _track_dims(
        self,
        keys: list[Key],
        qty: int,
        idem: tuple[str, int] | None,
        detail: bool,
        at: float | None,
    ) -> Any:
        """A track with dimensions: counted on every key of :meth:`KeyCache.spread` at once,
        as the levels of a tenant are; a key new to this node is checked against its
        feature's bound first (:class:`Groups`)."""
        table = self.table
        if all(table.is_seeded(k) for k in keys):
            try:
                return self._count_checked(keys, qty, idem, detail)
            except Short:
                pass  # a strict share needs more room: one storage write, below
        return self._track_dims_cold(keys, qty, idem, detail, at)

    async def _track_dims_cold(
        self,
        keys: list[Key],
        qty: int,
        idem: tuple[str, int] | None,
        detail: bool,
        at: float | None,
    ) -> Any:
        entered = await self.groups.enter_new(self.keys.spec(keys[0][1]), keys)
        try:
            return await self._track_checked_cold(keys, qty, idem, detail, at)
        finally:
            self.groups.leave(entered)

    async def _track_checked_cold(
        self,
        keys: list[Key],
        qty: int,
        idem: tuple[str, int] | None,
        detail: bool,
        at: float | None = None,
    ) -> Any:
        # Every level is seeded before any is checked: a level's limit is checked against
        # its stored total, not against what this node happens to hold.
        await self.seeder.seed_many(keys)
        for _ in range(MAX_ROOM_TRIES):
            if idem is not None:
                entry = self.ids.lookup(idem[0], idem[1], time.time())
                if entry is not None:
                    return self.gate.detail(keys[0], entry[1], 0) if detail else entry[1]
            if at is not None:  # (after each wait: its period may have closed meanwhile)
                self.keys.check_open(keys[0], at, time.time())
            self.fence.check()
            try:
                return self._count_checked(keys, qty, idem, detail)
            except Short as exc:
                short = exc
            # Not awaited inside the except block: compiled, the caught exception would stay
            # the thread's current one, and every later exception would chain onto it.
            await self.gate.make_rooms(keys, qty, short)
        raise Unavailable(f"{keys[0][0]}/{keys[0][1]}: the strict share kept running out; retry")

    def _count_checked(
        self, keys: list[Key], qty: int, idem: tuple[str, int] | None, detail: bool
    ) -> Any:
        """Check every level, then count on every level (no await between: on one node
        they are one step); refused at any level means counted at none."""
        values, log_items = self.gate.count_levels(keys, qty)
        value = values[0]
        if len(keys) == 1:
            self._log_track(keys[0], qty, idem, value)
        else:
            leaf = [*keys[0], qty]
            if idem is not None:
                spent = self.gate.spent(keys, qty)
                effect = Effect(qty, tuple(keys), credits=spent)
                expires = self.ids.remember(idem[0], idem[1], value, time.time(), effect)
                # (the other keys it counted on: a void takes them back too)
                leaf += [idem[0], idem[1], value, expires, [[*k] for k in keys[1:]],
                         spent_to_log(spent)]  # fmt: skip
            if self.wal is not None:  # one record: a torn log keeps all levels or none
                self.wal.append([R.TRACK_MANY, [leaf, *log_items]])
        return self.gate.detail(keys[0], value, 0) if detail else value

    def _count(self, key: Key, qty: int, idem: tuple[str, int] | None) -> int | None:
        """Count one track, remember its id, and log it."""
        return self._log_track(key, qty, idem, self.table.incr(key, qty))

    def _log_track(
        self, key: Key, qty: int, idem: tuple[str, int] | None, value: int | None
    ) -> int | None:
        """Remember the id of a track just counted and log it."""
        if idem is None:
            if self.wal is not None:
                self.wal.append([R.TRACK, key[0], key[1], key[2], qty])
            return value
        spent = self.gate.spent((key,), qty)
        effect = Effect(qty, (key,), credits=spent)
        expires = self.ids.remember(idem[0], idem[1], value, time.time(), effect)
        if self.wal is not None:
            # (with the credits it spent, none or some: what a void gives back)
            rec = [R.TRACK_ID, *key, qty, idem[0], idem[1], value, expires, spent_to_log(spent)]
            self.wal.append(rec)
        return value

    # -- track_many ---------------------------------------------------------------------------

    def track_many(self, params: list[Any]) -> Any:
        """The ``track_many`` method."""
        (items,) = check_args("track_many", params, 1, 1)
        if not isinstance(items, list):
            raise InvalidArgument("track_many: items must be an array of [tenant, feature, qty]")
        if len(items) > MAX_BATCH_ITEMS:
            raise InvalidArgument(f"track_many: at most {MAX_BATCH_ITEMS} items per call")
        now = time.time()
        keys = self.keys
        # The key cache answers for the whole batch if it is valid now (see key_for).
        cache = keys.cache if keys.day_start <= now < keys.day_end else {}
        gate = self.gate
        gated = gate.gated
        if cache:
            # The common batch: every item a plain [str, str, int] on a known name pair and a
            # seeded key. One pass builds it; anything else takes the general path below.
            done = self._fast_batch(items, cache)
            if done is not None:
                return done
        batch = Batch()
        out = batch.out
        for i, item in enumerate(items):
            try:
                if (type(item) is list or isinstance(item, list | tuple)) and 3 <= len(item) <= 4:
                    tenant, feature, qty = item[0], item[1], item[2]
                else:
                    raise InvalidArgument(
                        "item must be [tenant, feature, qty] or [tenant, feature, qty, {id}]"
                    )
                key = (
                    cache.get((tenant, feature))
                    if type(tenant) is str and type(feature) is str
                    else None
                )
                if key is None:
                    key = keys.key_for(tenant, feature)
                if type(qty) is not int or not in_range(qty):
                    qty = check_qty(qty)
                if key[1] in gate.uniques:
                    raise InvalidArgument(
                        f"{key[1]!r} counts unique values: track each value with track"
                    )
                idem: tuple[str, int] | None = None
                spread: list[Key] | None = None
                if len(item) == 4:
                    o = check_opts("track_many item", item[3], _ITEM_OPTS)
                    dims = o.get("dims")
                    pairs: Pairs = () if dims is None else check_dims(
                        key[1], keys.spec(key[1]), dims)  # fmt: skip
                    if pairs:
                        assert dims is not None
                        spread = keys.spread(key, pairs, dims)
                    rid = o.get("id")
                    if rid is not None:
                        parts: tuple[Any, ...] = (key[0], key[1], qty, None, pairs) if pairs else (
                            key[0], key[1], qty, None)  # fmt: skip
                        idem = (check_id(rid), fingerprint("track", *parts))
                        if batch.repeat(i, idem):
                            continue
                        entry = self.ids.lookup(idem[0], idem[1], now)
                        if entry is not None:
                            out.append(entry[1])  # a retry: counts nothing
                            continue
            except MeterError as exc:
                out.append(exc.to_wire())
                self._refused_item(exc.code)
                continue
            batch.add(i, key, qty, idem, spread)
        if batch.good:
            self.fence.check()
        if batch.spreads or (gated and any(gate.needs_check(k) for k, _ in batch.good)):
            return self._track_many_limited(batch)
        # All warm: every item is counted under one hold of the table's lock. Otherwise nothing
        # is counted until the cold keys are seeded, so a batch cut short (a draining node
        # cancels it, a read fails unexpectedly) has counted nothing and its error answer is
        # true: a client retrying it counts nothing twice.
        done = self._count_seeded(batch)
        return self._track_many_cold(batch) if done is None else done

    def _fast_batch(self, items: list[Any], cache: dict[tuple[str, str], Key]) -> Any | None:
        """The common batch, or ``None`` (nothing counted): every item a plain ``[tenant,
        feature, qty]`` on a known name pair, or one with only ``{"dims": ...}`` checked before
        (:meth:`KeyCache.known_dims`), every key seeded and none under a limit. Counted under
        one hold of the table's lock; with dimensions, each counter's units summed over the
        batch first (a hundred items of one tenant count its total once)."""
        keys = self.keys
        gate = self.gate
        gated = gate.gated
        fast: list[tuple[Key, int]] = []
        # With an item with dimensions: units by (tenant, period), then by the dimension map
        # (its trie node: hashed by identity) or, for a plain item, by the feature's name;
        # and each item's total key.
        summed: dict[tuple[str, str], dict[DimNode | str, int]] | None = None
        totals: list[Key] = []
        last: Key | None = None
        by_map: dict[DimNode | str, int] = {}
        for item in items:
            if type(item) is not list:
                return None
            node: DimNode | None = None
            if len(item) == 3:
                tenant, feature, qty = item
            elif len(item) == 4 and type(item[3]) is dict and len(item[3]) == 1:
                tenant, feature, qty, opts = item
                dims = opts.get("dims")
                if type(dims) is not dict:
                    return None
                node = keys.known_dims(feature, dims)
                if node is None:
                    return None
            else:
                return None
            if type(tenant) is not str or type(feature) is not str or type(qty) is not int:
                return None
            key = cache.get((tenant, feature))
            if key is None or not in_range(qty):
                return None
            if gated and gate.needs_check(key):
                return None  # checked item by item
            if node is None and summed is None:
                fast.append((key, qty))
                continue
            if qty < 0:
                # Summed, a batch's units must only grow as items are counted: then the range
                # check of each counter's sum is that of every item's value.
                return None
            if summed is None:
                if any(q < 0 for _, q in fast):
                    return None
                summed = {}
                for k, q in fast:
                    inner = summed.setdefault((k[0], k[2]), {})
                    inner[k[1]] = inner.get(k[1], 0) + q
                    totals.append(k)
            if key is not last:
                last = key
                by_map = summed.setdefault((key[0], key[2]), {})
            totals.append(key)
            if node is None:
                by_map[key[1]] = by_map.get(key[1], 0) + qty
                continue
            by_map[node] = by_map.get(node, 0) + qty
            if (
                gated
                and node.names is not None
                and any(gate.needs_check((key[0], n, key[2])) for n in node.names)
            ):
                return None
        self.fence.check()
        if summed is None:
            try:
                values = self.table.incr_seeded(fast)
            except PartlyRefused as refused:  # items past the 64-bit range: not counted
                return self._finish_refused(fast, refused.answers)
            if values is not None and self.wal is not None and fast:
                self.wal.append([R.TRACK_MANY, [[*k, q] for k, q in fast]])
            return values
        entries = _summed_entries(summed)
        try:
            values = self.table.incr_seeded(entries)
        except PartlyRefused as refused:  # past the 64-bit range: taken back, item by item
            self._undo_refused(entries, refused.answers)
            return None
        if values is None:
            return None
        if self.wal is not None:
            self.wal.append([R.TRACK_MANY, [[*k, q] for k, q in entries]])
        # Each item answers its total after it: the total after the batch less the items after.
        after = {k: v for (k, _), v in zip(entries, values, strict=True)}
        out: list[Any] = [None] * len(totals)
        for i in range(len(totals) - 1, -1, -1):
            k = totals[i]
            value = after[k]
            out[i] = value
            after[k] = value - items[i][2]
        return out

    def _count_seeded(self, batch: Batch) -> Any | None:
        """Count the whole batch under one hold of the table's lock and answer it, or ``None``
        (nothing counted) if a key is cold or unseeded."""
        try:
            values = self.table.incr_seeded(batch.good)
        except PartlyRefused as refused:
            return self._finish_many(batch, refused.answers)
        return None if values is None else self._finish_many(batch, values)

    def _answer_repeated_ids(self, batch: Batch) -> None:
        """After a wait: items whose ids calls counted meanwhile are answered as those were
        (a conflicting id answers its error alone, uncounted)."""
        now = time.time()
        for n, idem in enumerate(batch.idems):
            if idem is not None:
                try:
                    entry = self.ids.lookup(idem[0], idem[1], now)
                except Conflict as exc:
                    entry = (0, exc.to_wire(), 0.0)
                    self._refused_item(exc.code)
                if entry is not None:
                    batch.answered[n] = entry
        self.fence.check()

    async def _track_many_cold(self, batch: Batch) -> Any:
        await self.seeder.seed_many(k for k, _ in batch.good)
        # Calls with the same ids may have counted while this one waited: answer those items
        # as they were answered, and count the rest.
        self._answer_repeated_ids(batch)
        gate = self.gate
        if gate.gated and any(gate.needs_check(k) for k, _ in batch.good):
            # A limit was set while the read waited: check item by item (an unseeded key
            # under a hard limit is refused, as it would have been had the limit come first).
            return self._count_gated(batch)
        if not batch.answered:
            # Every key seeded (the usual case): the whole batch under one hold of the lock.
            done = self._count_seeded(batch)
            if done is not None:
                return done
        # Counted whether or not seeding worked, as track does: unseeded keys answer nil. An
        # item past the 64-bit range is refused alone; the others are counted.
        values: list[Any] = []
        for n, (key, qty) in enumerate(batch.good):
            entry = batch.answered.get(n)
            if entry is not None:
                values.append(entry[1])
                continue
            try:
                values.append(self.table.incr(key, qty))
            except InvalidArgument as exc:
                values.append(exc)
        return self._finish_many(batch, values)

    def _item_keys(self, batch: Batch, n: int) -> list[Key]:
        """Every counter item ``n`` of ``batch`` counts on (levels, dimension counters), to
        seed and to find room for (a name with bad levels: its leaf; it is refused when
        counted); none for a gauge's observation."""
        spread = batch.spreads.get(n)
        if spread is not None:
            return spread
        key = batch.good[n][0]
        if key[1] in self.gate.gauges:
            return []
        return self.keys.levels_or_leaf(key)

    def _gauge_items(self, batch: Batch) -> list[tuple[Key, str]]:
        """The batch's observations of gauges: their keys and kinds."""
        gauges = self.gate.gauges
        return [(k, gauges[k[1]]) for k, _ in batch.good if k[1] in gauges]

    def _spread_items(self, batch: Batch) -> list[tuple[list[Key], int]]:
        return [(self._item_keys(batch, n), qty) for n, (_, qty) in enumerate(batch.good)]

    def _track_many_limited(self, batch: Batch) -> Any:
        """A batch with items under a limit or with dimensions: each item checked and counted
        in turn (an item over a hard limit fails alone, counting nothing), once every key is
        seeded."""
        keys = [k for n in range(len(batch.good)) for k in self._item_keys(batch, n)]
        gauges = self.gauging.table
        if (
            all(self.table.is_seeded(k) for k in keys)
            and all(gauges.is_seeded(k) for k, _ in self._gauge_items(batch))
            and not self.gate.batch_short(self._spread_items(batch))
        ):
            return self._count_gated(batch)
        return self._track_many_limited_cold(batch, keys)

    async def _track_many_limited_cold(self, batch: Batch, keys: list[Key]) -> Any:
        entered: list[Key] = []
        try:
            if batch.spreads:
                entered = await self._enter_items(batch)
                keys = [k for n in range(len(batch.good)) if n not in batch.refused
                        for k in self._item_keys(batch, n)]  # fmt: skip
            await self.seeder.seed_many(keys)
            observed = self._gauge_items(batch)
            if observed:
                try:
                    await self.gauging.load(observed)
                except MeterError as exc:  # (their items are refused alone, below)
                    for n, (key, _) in enumerate(batch.good):
                        if key[1] in self.gate.gauges and not self.gauging.table.is_seeded(key):
                            batch.refused.setdefault(n, exc)
            for _ in range(3):  # strict shares, credit pools: room for every item first
                shorts = self.gate.batch_short(self._spread_items(batch))
                if not shorts:
                    break
                for short, smallest in shorts:
                    try:  # room for every item, or for as many as are left (the smallest)
                        await self.gate.make_room(short, smallest)
                    except MeterError:
                        break  # none left, or storage: the items that find no room are refused
            self._answer_repeated_ids(batch)
            return self._count_gated(batch)
        finally:
            self.groups.leave(entered)

    async def _enter_items(self, batch: Batch) -> list[Key]:
        """Enter the new dimension counters of the batch's items within their features'
        bounds, item by item (:meth:`Groups.enter_new`): an item past a bound, or whose
        feature's listing cannot be read, is refused alone."""
        entered: list[Key] = []
        for n, spread in batch.spreads.items():
            try:
                entered += await self.groups.enter_new(self.keys.spec(spread[0][1]), spread)
            except MeterError as exc:
                batch.refused[n] = exc
        return entered

    def _count_gated(self, batch: Batch) -> list[Any]:
        values: list[Any] = []
        above: list[list[Any]] = []  # log items of the levels above the items counted
        gate = self.gate
        for n, (key, qty) in enumerate(batch.good):
            entry = batch.answered.get(n)
            if entry is not None:
                values.append(entry[1])
                continue
            refused = batch.refused.get(n)
            if refused is not None:
                values.append(refused)
                continue
            kind = gate.gauges.get(key[1])
            if kind is not None:  # a gauge: observed, logged and remembered on its own
                try:
                    self.gauging.refuse(key, qty)
                    observed = self.gauging.observe(key, kind, qty, None, batch.idems[n])
                except MeterError as exc:
                    values.append(exc)
                    continue
                batch.answered[n] = (0, observed, 0.0)
                values.append(observed)
                continue
            try:
                spread = batch.spreads.get(n)
                levels = spread if spread is not None else self.keys.levels(key)
                counted, items = gate.count_levels(levels, qty)
                if len(levels) > 1:
                    batch.levels[n] = levels
            except MeterError as exc:  # over a hard limit, past the 64-bit range, too deep
                values.append(exc)
                continue
            except Short as short:  # its strict share (or credit pool) had no room left for it
                values.append(gate.refusal(short, qty))
                continue
            values.append(counted[0])
            above += items
        return self._finish_many(batch, values, above)

    def _finish_refused(self, items: list[tuple[Key, int]], answers: list[Any]) -> list[Any]:
        """The answers of a fast-path batch some of whose items were refused (not counted)."""
        counted = [[*k, q] for (k, q), a in zip(items, answers, strict=True) if type(a) is int]
        if self.wal is not None and counted:
            self.wal.append([R.TRACK_MANY, counted])
        for a in answers:
            if isinstance(a, MeterError):
                self._refused_item(a.code)
        return [a.to_wire() if isinstance(a, MeterError) else a for a in answers]

    def _finish_many(
        self, batch: Batch, values: list[Any], above: list[list[Any]] | None = None
    ) -> list[Any]:
        """Fill a batch's answers, remember its ids and log what it counted (items refused
        by the range check carry their error instead of a value: not remembered, not logged),
        with ``above`` (the upper levels' counts) in the same record."""
        out = batch.out
        now = time.time()
        logged: list[list[Any]] = [] if above is None else above
        for n, ((key, qty), idem, value) in enumerate(
            zip(batch.good, batch.idems, values, strict=True)
        ):
            if isinstance(value, MeterError):
                out[batch.where[n]] = values[n] = value.to_wire()
                self._refused_item(value.code)
                continue
            out[batch.where[n]] = value
            if n in batch.answered:
                continue
            if idem is None:
                logged.append([*key, qty])
            else:
                keys = batch.levels.get(n)
                counted = (key,) if keys is None else tuple(keys)
                spent = self.gate.spent(counted, qty)
                effect = Effect(qty, counted, credits=spent)
                expires = self.ids.remember(idem[0], idem[1], value, now, effect)
                others = [] if keys is None else [[*k] for k in keys[1:]]
                logged.append(
                    [*key, qty, idem[0], idem[1], value, expires, others, spent_to_log(spent)]
                )
        for i, n in batch.dups:
            out[i] = values[n]
        if self.wal is not None and logged:
            self.wal.append([R.TRACK_MANY, logged])
        return out


class Batch:
    """A ``track_many`` call being answered: the items to count and where answers go."""

    __slots__ = ("answered", "dups", "firsts", "good", "idems", "levels", "out", "refused",
                 "spreads", "where")  # fmt: skip

    def __init__(self) -> None:
        self.out: list[Any] = []
        self.good: list[tuple[Key, int]] = []
        self.where: list[int] = []  # out index of each good item
        self.idems: list[tuple[str, int] | None] = []
        self.firsts: dict[str, int] = {}  # request id -> its first good item
        self.dups: list[tuple[int, int]] = []  # (out index, good item it repeats)
        self.answered: dict[int, tuple[int, Any, float]] = {}  # good item -> remembered entry
        #: good item -> every key it counts on, for items with dimensions (KeyCache.spread)
        self.spreads: dict[int, list[Key]] = {}
        #: good item -> why it is refused uncounted (a bound on new dimension counters)
        self.refused: dict[int, MeterError] = {}
        #: good item -> every key it counted on, when more than its own (levels, dimensions)
        self.levels: dict[int, list[Key]] = {}

    def add(
        self,
        i: int,
        key: Key,
        qty: int,
        idem: tuple[str, int] | None,
        spread: list[Key] | None = None,
    ) -> None:
        self.out.append(None)
        if idem is not None:
            self.firsts[idem[0]] = len(self.good)
        if spread is not None:
            self.spreads[len(self.good)] = spread
        self.good.append((key, qty))
        self.where.append(i)
        self.idems.append(idem)

    def repeat(self, i: int, idem: tuple[str, int]) -> bool:
        """Whether an earlier item of this batch has the same id (then this one repeats it);
        :class:`Conflict` if that item's payload differs."""
        n = self.firsts.get(idem[0])
        if n is None:
            return False
        first = self.idems[n]
        if first is None or first[1] != idem[1]:
            raise Conflict(f"request id {idem[0][:64]!r} was already used by a different call")
        self.out.append(None)
        self.dups.append((i, n))
        return True


def _summed_entries(
    summed: dict[tuple[str, str], dict[DimNode | str, int]],
) -> list[tuple[Key, int]]:
    """A batch's units summed by (tenant, period) then by dimension map or feature name, as
    one ``(key, units)`` per counter: a map's units spread over its counters' names."""
    entries: list[tuple[Key, int]] = []
    for (tenant, period), inner in summed.items():
        by_name: dict[str, int] = {}
        for what, q in inner.items():
            if isinstance(what, str):
                by_name[what] = by_name.get(what, 0) + q
            elif what.names is not None:
                for name in what.names:  # (the feature's own name first: its total)
                    by_name[name] = by_name.get(name, 0) + q
        entries.extend(((tenant, name, period), q) for name, q in by_name.items())
    return entries
