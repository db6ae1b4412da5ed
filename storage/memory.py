"""An in-memory backend for unit tests: exact semantics, no persistence.

It can be told to fail: ``fail_next`` raises before applying (the write did not land) and
``lose_next_ack`` applies and then raises (the write landed, the caller never heard), which is
the case exactly-once flushing exists for.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from storage.base import (
    DAYS_END,
    EMPTY,
    MARK_CLOSED,
    MARK_DRAINED,
    MARK_OPEN,
    Applied,
    BadCursor,
    BudgetItem,
    Delta,
    ExportPage,
    ExportRow,
    GaugeReading,
    Key,
    LedgerRow,
    Owner,
    PeriodMark,
    Snapshot,
    Storage,
    StorageError,
    StorageUnavailable,
    VersionMoved,
    check_children,
    check_day_of,
    check_export_limit,
    check_owner_note,
    check_period,
    check_period_mark,
    check_range,
    check_unique,
    check_value_of,
    check_values_key,
    check_values_limit,
    decode_cursor,
    encode_cursor,
    gauge_key,
    lease_end_ms,
    next_values_cursor,
    reading_wins,
    timeline_position,
    timeline_range,
    values_cursor,
)


class MemoryStorage(Storage):
    """Counters in a dict. Every operation is atomic (there is no await inside one)."""

    kind = "memory"

    def __init__(self) -> None:
        self.items: dict[Key, Snapshot] = {}
        #: Gauges' readings, by the gauge's key (their values are also in :attr:`items`, as
        #: totals, under :func:`~storage.base.gauge_key`).
        self.readings: dict[Key, GaugeReading] = {}
        #: Node id -> (owner token, end of its lease in ms).
        self.owners: dict[str, tuple[str, int]] = {}
        #: Node id -> the note its owner's last renewal left.
        self.owner_notes: dict[str, str] = {}
        self.fail_next = 0
        self.lose_next_ack = 0
        self.writes = 0
        #: Limits records (scope, name, feature) -> body, and their version.
        self._limits: dict[tuple[str, str, str], str] = {}
        self._limits_version = 0
        #: Budget records (escrow) by counter: (version, body).
        #: key -> (version, body, {name: (units, op)} admitted onto that body).
        self.budgets: dict[Key, tuple[int, str, dict[str, tuple[int, str]]]] = {}
        #: Budget swaps to fail before writing, and to write and then fail (answer lost).
        self.budget_fail_next = 0
        self.budget_lose_next = 0
        #: Claimed alerts: id -> body.
        self.alerts: dict[str, str] = {}
        self.settings: dict[str, str] = {}
        #: Ledgers (docs/ledger.md) by tenant: (version, balance body), entries by seq, refs.
        self.ledgers: dict[str, tuple[int, str]] = {}
        self.ledger_entries_: dict[str, dict[int, str]] = {}
        #: Every tenant's entries by timeline position: ``(position, tenant, seq)``, sorted.
        self.ledger_timeline_: list[tuple[str, str, int]] = []
        self.ledger_refs: dict[str, dict[str, str]] = {}
        #: Ledger writes to fail before writing, and to write and then fail (answer lost);
        #: ledger reads to fail (storage down while it is non-zero).
        self.ledger_fail_next = 0
        self.ledger_lose_next = 0
        self.ledger_down = False
        #: Ledger calls refused because ``ledger_down`` was set.
        self.ledger_down_hits = 0
        #: Day buckets (docs/history.md) by (tenant, feature, day).
        self.days: dict[Key, Snapshot] = {}
        #: Day-bucket writes to fail after their month write landed (the two are separate
        #: writes on DynamoDB): the key's outcome is then an error, and a retry completes it.
        self.day_fail_next = 0
        #: Unique values (docs/storage.md) by key: value -> its claimant. Never purged (nor
        #: are the counters here).
        self.values: dict[Key, dict[str, str]] = {}
        #: Values marked voided (:meth:`void_value`), by key.
        self.voided_values: dict[Key, set[str]] = {}
        #: Period marks (docs/storage.md) by period: node -> its mark. Never purged.
        self.marks: dict[str, dict[str, PeriodMark]] = {}

    async def apply(self, node: str, deltas: Sequence[Delta]) -> dict[Key, Applied | StorageError]:
        if self.fail_next > 0:
            self.fail_next -= 1
            raise StorageUnavailable("injected failure before the write")
        out: dict[Key, Applied | StorageError] = {}
        for d in deltas:
            try:  # (as the other backends: a key of no period is not stored)
                check_period(d.key[2])
                if d.day is not None:
                    check_day_of(d.day, d.key[2])
            except StorageError as exc:
                out[d.key] = exc
                continue
            current = self.items.get(d.key, EMPTY)
            if current.seq_of(node) >= d.seq:
                out[d.key] = Applied(current, duplicate=True)
            else:
                seqs = dict(current.seqs)
                seqs[node] = d.seq
                current = Snapshot(current.total + d.delta, seqs)
                self.items[d.key] = current
                self.writes += 1
                out[d.key] = Applied(current)
            if d.day is not None:
                failed = self._apply_day(node, d)
                if failed is not None:
                    out[d.key] = failed
        if self.lose_next_ack > 0:
            self.lose_next_ack -= 1
            raise StorageUnavailable("injected loss of the response after the write")
        return out

    def _apply_day(self, node: str, d: Delta) -> StorageError | None:
        if self.day_fail_next > 0:
            self.day_fail_next -= 1
            return StorageUnavailable("injected failure of a day-bucket write")
        assert d.day is not None
        day_key = (d.key[0], d.key[1], d.day)
        bucket = self.days.get(day_key, EMPTY)
        if bucket.seq_of(node) < d.seq:
            seqs = dict(bucket.seqs)
            seqs[node] = d.seq
            self.days[day_key] = Snapshot(bucket.total + d.delta, seqs)
            self.writes += 1
        return None

    async def apply_days(self, node: str, deltas: Sequence[Delta]) -> list[StorageError | None]:
        if self.fail_next > 0:
            self.fail_next -= 1
            raise StorageUnavailable("injected failure before the write")
        out: list[StorageError | None] = []
        for d in deltas:
            try:
                check_day_of(d.day or "", d.key[2])
            except StorageError as exc:
                out.append(exc)
                continue
            out.append(self._apply_day(node, d))
        return out

    async def load(self, keys: Sequence[Key]) -> dict[Key, Snapshot]:
        return {k: self.items.get(k, EMPTY) for k in keys}

    async def day_buckets(self, tenant: str, feature: str, first: str, last: str) -> dict[str, int]:
        first, last = check_range(first, last)
        return {
            day: snap.total
            for (t, f, day), snap in sorted(self.days.items())
            if t == tenant and f == feature and first <= day <= last + DAYS_END
        }

    async def counters_between(
        self, tenant: str, feature: str, first: str, last: str
    ) -> dict[str, int]:
        first, last = check_range(first, last)
        return {
            p: snap.total
            for (t, f, p), snap in sorted(self.items.items())
            if t == tenant and f == feature and len(p) == len(first) and first <= p <= last
        }

    async def put_gauges(
        self, items: Sequence[tuple[Key, str, GaugeReading]]
    ) -> dict[Key, GaugeReading | StorageError]:
        out: dict[Key, GaugeReading | StorageError] = {}
        for key, kind, reading in items:
            try:
                check_period(key[2])
            except StorageError as exc:
                out[key] = exc
                continue
            stored = self.readings.get(key)
            if reading_wins(kind, reading, stored):
                self.readings[key] = stored = reading
                self.items[gauge_key(key)] = Snapshot(reading[0], {})
                self.writes += 1
            assert stored is not None
            out[key] = stored
        return out

    async def load_gauges(self, keys: Sequence[Key]) -> dict[Key, GaugeReading | None]:
        return {key: self.readings.get(key) for key in keys}

    async def list_period(self, tenant: str, period: str) -> dict[str, Snapshot]:
        return {f: s for (t, f, p), s in self.items.items() if t == tenant and p == period}

    async def list_between(
        self, tenant: str, period: str, first: str, last: str
    ) -> dict[str, Snapshot]:
        return {
            f: s
            for (t, f, p), s in self.items.items()
            if t == tenant and p == period and first <= f <= last
        }

    async def export_page(self, period: str, cursor: str | None, limit: int) -> ExportPage:
        check_period(period)
        check_export_limit(limit)
        after = ("", "")
        if cursor is not None:
            state = decode_cursor(cursor)
            if not (
                isinstance(state, list)
                and len(state) == 4
                and state[:2] == ["m", period]
                and all(isinstance(x, str) for x in state[2:])
            ):
                raise BadCursor(f"cursor is not one handed out for period {period}")
            after = (state[2], state[3])
        # Sorted by (tenant, feature) so the cursor is the last pair handed out.
        names = sorted((t, f) for (t, f, p) in self.items if p == period and (t, f) > after)
        rows = [ExportRow(t, f, period, self.items[(t, f, period)].total) for t, f in names[:limit]]
        more = len(names) > limit
        next_cursor = encode_cursor(["m", period, *names[limit - 1]]) if more else None
        return ExportPage(rows, next_cursor, 1, 0 if more else 1)

    async def children_page(
        self, parent: str, feature: str, period: str, after: str | None, limit: int
    ) -> tuple[list[tuple[str, int]], bool]:
        check_children(parent, feature, period, after, limit)
        start = parent + "/"
        names = sorted(
            t
            for (t, f, p) in self.items
            if f == feature
            and p == period
            and t.startswith(start)
            and "/" not in t[len(start) :]
            and (after is None or t > after)
        )
        return [(t, self.items[(t, feature, period)].total) for t in names[:limit]], (
            len(names) > limit
        )

    async def claim_owner(
        self, node: str, token: str, *, lease_s: float, now: float, accept: Sequence[str] = ()
    ) -> Owner:
        held = self.owners.get(node)
        if held is None or held[0] == token or held[0] in accept or held[1] <= now * 1000:
            held = self.owners[node] = (token, lease_end_ms(now, lease_s))
        owner = self._owner(node)
        assert owner is not None
        return owner

    async def renew_owner(
        self, node: str, token: str, *, lease_s: float, now: float, note: str | None = None
    ) -> Owner | None:
        check_owner_note(note)
        held = self.owners.get(node)
        if held is not None and held[0] == token:
            self.owners[node] = (token, lease_end_ms(now, lease_s))
            if note is not None:
                self.owner_notes[node] = note
        return self._owner(node)

    async def owner(self, node: str) -> Owner | None:
        return self._owner(node)

    def _owner(self, node: str) -> Owner | None:
        held = self.owners.get(node)
        if held is None:
            return None
        return Owner(held[0], held[1] / 1000, self.owner_notes.get(node, ""))

    # -- limits ------------------------------------------------------------------------------

    async def limits_version(self) -> int:
        return self._limits_version

    async def read_limits(self) -> tuple[int, list[tuple[str, str, str, str]]]:
        return self._limits_version, [(*k, b) for k, b in self._limits.items()]

    async def write_limit(
        self, scope: str, name: str, feature: str, body: str | None, expect: int | None = None
    ) -> int:
        if expect is not None and expect != self._limits_version:
            raise VersionMoved(f"limits are at version {self._limits_version}, not {expect}")
        if body is None:
            self._limits.pop((scope, name, feature), None)
        else:
            self._limits[(scope, name, feature)] = body
        self._limits_version += 1
        return self._limits_version

    # -- strict budgets ------------------------------------------------------------------------

    async def budget_read(self, key: Key) -> BudgetItem:
        return self._budget_item(key)

    def _budget_item(self, key: Key) -> BudgetItem:
        held = self.budgets.get(key)
        if held is None:
            return BudgetItem(0, None)
        version, body, admitted = held
        return BudgetItem(
            version, body, tuple((n, u, op) for n, (u, op) in sorted(admitted.items()))
        )

    async def budget_admit(
        self, key: Key, body: str, name: str, units: int, most: int, op: str
    ) -> BudgetItem | None:
        if self.budget_fail_next > 0:
            self.budget_fail_next -= 1
            raise StorageUnavailable("injected failure before the budget write")
        version, stored, admitted = self.budgets.get(key, (0, body, {}))
        mine = admitted.get(name, (0, ""))
        if (
            stored != body
            or units <= 0
            or sum(u for u, _ in admitted.values()) + units > most
            or mine[1] == op
        ):
            return None
        self.budgets[key] = (version + 1, body, {**admitted, name: (mine[0] + units, op)})
        if self.budget_lose_next > 0:
            self.budget_lose_next -= 1
            raise StorageUnavailable("injected loss of the answer after the budget write")
        return self._budget_item(key)

    async def budget_swap(self, key: Key, version: int, body: str) -> bool:
        if self.budget_fail_next > 0:
            self.budget_fail_next -= 1
            raise StorageUnavailable("injected failure before the budget write")
        held = self.budgets.get(key)
        if (0 if held is None else held[0]) != version:
            return False
        self.budgets[key] = (version + 1, body, {})
        if self.budget_lose_next > 0:
            self.budget_lose_next -= 1
            raise StorageUnavailable("injected loss of the answer after the budget write")
        return True

    # -- alerts ------------------------------------------------------------------------------

    async def claim_alert(self, alert_id: str, body: str) -> bool:
        if self.fail_next > 0:
            self.fail_next -= 1
            raise StorageUnavailable("injected failure before the write")
        stored = self.alerts.setdefault(alert_id, body)
        if self.lose_next_ack > 0:
            self.lose_next_ack -= 1
            raise StorageUnavailable("injected loss of the response after the write")
        return stored == body

    async def cluster_setting(self, name: str, value: str) -> str:
        if self.fail_next > 0:
            self.fail_next -= 1
            raise StorageUnavailable("injected failure before the write")
        return self.settings.setdefault(name, value)

    # -- credits ledgers -----------------------------------------------------------------------

    def _ledger_up(self) -> None:
        if self.ledger_down:
            self.ledger_down_hits += 1
            raise StorageUnavailable("injected: the ledger storage is down")

    async def ledger_read(self, tenant: str) -> tuple[int, str | None]:
        self._ledger_up()
        held = self.ledgers.get(tenant)
        return (0, None) if held is None else held

    async def ledger_write(
        self,
        tenant: str,
        version: int,
        body: str,
        entries: Sequence[LedgerRow],
        refs: Sequence[tuple[str, str]] = (),
    ) -> bool:
        self._ledger_up()
        if self.ledger_fail_next > 0:
            self.ledger_fail_next -= 1
            raise StorageUnavailable("injected failure before the ledger write")
        held = self.ledgers.get(tenant)
        stored = self.ledger_entries_.setdefault(tenant, {})
        known = self.ledger_refs.setdefault(tenant, {})
        if (0 if held is None else held[0]) != version:
            return False
        if any(r in known for r, _ in refs) or any(s in stored for s, _, _ in entries):
            return False
        self.ledgers[tenant] = (version + 1, body)
        stored.update((s, b) for s, b, _ in entries)
        known.update(refs)
        for seq, _, at_ms in entries:
            bisect.insort(
                self.ledger_timeline_, (timeline_position(at_ms, tenant, seq), tenant, seq)
            )
        if self.ledger_lose_next > 0:
            self.ledger_lose_next -= 1
            raise StorageUnavailable("injected loss of the answer after the ledger write")
        return True

    async def ledger_ref(self, tenant: str, ref: str) -> str | None:
        self._ledger_up()
        return self.ledger_refs.get(tenant, {}).get(ref)

    async def ledger_entries(self, tenant: str, after: int, limit: int) -> list[tuple[int, str]]:
        self._ledger_up()
        stored = self.ledger_entries_.get(tenant, {})
        return [(s, stored[s]) for s in sorted(s for s in stored if s > after)[:limit]]

    async def ledger_timeline(
        self, start_ms: int, end_ms: int, after: str | None, limit: int
    ) -> tuple[list[tuple[str, int, str]], str | None]:
        self._ledger_up()
        lo, hi = timeline_range(start_ms, end_ms, after)
        line = self.ledger_timeline_
        i = bisect.bisect_left(line, (lo,))
        page = [(t, s) for pos, t, s in line[i : i + limit + 1] if pos < hi]
        more = len(page) > limit
        page = page[:limit]
        rows = [(t, s, self.ledger_entries_[t][s]) for t, s in page]
        cursor = line[i + limit - 1][0] if more else None
        return rows, cursor

    # -- unique values -------------------------------------------------------------------------

    async def claim_value(self, key: Key, value: str, claimant: str) -> str:
        check_unique(key, value, claimant)
        if self.fail_next > 0:
            self.fail_next -= 1
            raise StorageUnavailable("injected failure before the write")
        held = self.values.setdefault(key, {}).setdefault(value, claimant)
        if self.lose_next_ack > 0:
            self.lose_next_ack -= 1
            raise StorageUnavailable("injected loss of the response after the write")
        return held

    async def claimant_of(self, key: Key, value: str) -> str | None:
        check_value_of(key, value)
        return self.values.get(key, {}).get(value)

    async def void_value(self, key: Key, value: str, claimant: str) -> str | None:
        check_unique(key, value, claimant)
        if self.fail_next > 0:
            self.fail_next -= 1
            raise StorageUnavailable("injected failure before the write")
        held = self.values.get(key, {}).get(value)
        if held == claimant:
            self.voided_values.setdefault(key, set()).add(value)
        return held

    async def values_page(
        self, key: Key, cursor: str | None, limit: int
    ) -> tuple[list[str], str | None]:
        check_values_key(key)
        check_values_limit(limit)
        after = values_cursor(cursor)
        voided = self.voided_values.get(key, ())
        # One more than asked for: whether a next page has any.
        got = sorted(v for v in self.values.get(key, ()) if v > after and v not in voided)[
            : limit + 1
        ]
        return got[:limit], next_values_cursor(got[:limit], len(got) > limit)

    # -- period marks --------------------------------------------------------------------------

    async def mark_period_open(
        self, period: str, node: str, at: float, by: str | None = None
    ) -> PeriodMark:
        mark = check_period_mark(period, node, at, by or node, MARK_OPEN)
        marks = self.marks.setdefault(period, {})
        held = marks.get(node)
        if held is None or held.state == MARK_DRAINED:
            held = marks[node] = mark
        return held

    async def mark_period_closed(
        self, period: str, node: str, at: float, by: str, units: dict[str, int] | None = None
    ) -> PeriodMark:
        mark = check_period_mark(period, node, at, by, MARK_CLOSED, units)
        marks = self.marks.setdefault(period, {})
        held = marks.get(node)
        if held is None or held.state != MARK_CLOSED:
            held = marks[node] = mark
        return held

    async def mark_period_drained(
        self, period: str, node: str, at: float, units: dict[str, int] | None = None
    ) -> PeriodMark | None:
        mark = check_period_mark(period, node, at, node, MARK_DRAINED, units)
        marks = self.marks.get(period, {})
        held = marks.get(node)
        if held is not None and held.state == MARK_OPEN:
            held = marks[node] = mark
        return held

    async def period_marks(self, period: str) -> list[PeriodMark]:
        check_period(period)
        return [m for _, m in sorted(self.marks.get(period, {}).items())]
