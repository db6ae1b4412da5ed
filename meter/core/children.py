"""The ``usage_children`` method (docs/protocol.md): an account's users' counters of one feature
in one period, a page at a time (seed 000's "this month's usage across all the account's
users"). A page is one storage read of the stored counters (:meth:`Storage.children_page`)
merged with the counters this node holds warm, whose values are this node's view: what
``usage`` answers, units not stored yet and peers' gossip included."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from meter.core.fence import Fence, log_down
from meter.core.gate import Gate
from meter.core.keycache import KeyCache
from meter.core.keys import Key, check_at
from meter.core.params import args as check_args
from meter.core.params import opts as check_opts
from meter.core.ports import Handler
from meter.core.seeder import Seeder
from meter.core.table import CounterTable
from meter.errors import InvalidArgument, Unavailable
from meter.wal.log import WalError
from storage.base import Counters, StorageError, StoragePermanentError
from storage.base import check_children as check_storage_args

_OPTS = frozenset({"at", "cursor", "limit"})
#: Children a page holds when the call names no ``limit``.
DEFAULT_LIMIT = 100


class ChildrenMethod:
    """The handler, over one node's table, key cache, seeder and storage."""

    def __init__(
        self,
        table: CounterTable,
        keys: KeyCache,
        seeder: Seeder,
        storage: Counters,
        gate: Gate,
        fence: Fence,
        *,
        hierarchy: bool,
    ) -> None:
        self.table = table
        self.keys = keys
        self.seeder = seeder
        self.storage = storage
        #: Which features are gauges (not summed over users: refused).
        self.gate = gate
        self.fence = fence
        self.hierarchy = hierarchy

    def handlers(self) -> dict[str, Handler]:
        return {"usage_children": self.usage_children}

    def usage_children(self, params: list[Any]) -> Awaitable[dict[str, Any]]:
        """``usage_children(account, feature, {at, cursor, limit})``: ``{"total", "children":
        [{"tenant", "value"}], "cursor"}``."""
        account, feature, opts = check_args("usage_children", params, 2, 3, ({},))
        o = check_opts("usage_children", opts, _OPTS, nil_is_absent=True)
        if not self.hierarchy:
            raise InvalidArgument(
                "usage_children needs tenant_hierarchy on (docs/quotas.md): without it a "
                "tenant has no users"
            )
        at = o.get("at")
        key = self.keys.key_for(account, feature, None if at is None else check_at(at))
        if key[1] in self.gate.gauges:
            raise InvalidArgument(
                f"usage_children: feature {key[1]!r} is a gauge; its users' readings are not "
                "summed (read each with usage)"
            )
        limit = o.get("limit", DEFAULT_LIMIT)
        cursor = o.get("cursor")
        try:  # (the cursor and the limit: what storage would refuse)
            check_storage_args(key[0], key[1], key[2], cursor, limit)
        except StoragePermanentError as exc:
            why = str(exc).removeprefix("children: ")
            raise InvalidArgument(f"usage_children: {why}") from None
        return self._page(key, cursor, limit)

    async def _page(self, key: Key, cursor: str | None, limit: int) -> dict[str, Any]:
        account, feature, period = key
        wal = self.fence.wal
        if wal is not None and wal.dirty:  # (a value shown may be in a batch not committed)
            try:
                await wal.durable()
            except WalError:
                raise log_down(wal) from None
        try:
            stored, more = await self.storage.children_page(account, feature, period, cursor, limit)
        except StorageError as exc:
            raise Unavailable(f"storage is unreachable: {exc}") from None
        # Up to the last stored child of a page that has more, the merge is complete; and
        # up to the last warm one examined, when ``limit`` of them were (more may follow).
        frontier = stored[-1][0] if more else None
        values = dict(stored)
        warm = self.table.children_of(account, feature, period, cursor, frontier, limit)
        if sum(1 for _, value in warm if value != 0) == limit:
            frontier = warm[-1][0] if frontier is None else min(frontier, warm[-1][0])
            more = True
        cold: list[Key] = []
        for child, value in warm:
            if frontier is not None and child > frontier:
                continue
            if value is None:
                cold.append((child, feature, period))
            elif value or child in values:  # (a row that counted nothing is not a user's)
                values[child] = value
        if cold or not self.table.is_seeded(key):
            await self.seeder.seed_many([*cold, key])
            for k in cold:
                value = self.table.value(k)
                if value is None:
                    raise Unavailable("storage is unreachable and a user's total is not known")
                if value or k[0] in values:
                    values[k[0]] = value
        total = self.table.value(key)
        if total is None:
            raise Unavailable("storage is unreachable and this account's total is not known")
        names = sorted(t for t in values if frontier is None or t <= frontier)
        page = names[:limit]
        if len(names) > limit:
            more, frontier = True, page[-1]
        return {
            "total": total,
            "children": [{"tenant": t, "value": values[t]} for t in page],
            # (a page cut short by a warm user whose total was 0 still names where it ended)
            "cursor": frontier if more else None,
        }
