"""The limits methods of the protocol: ``set_plan``, ``assign_plan``, ``set_limit``,
``clear_limit`` and ``limits`` (docs/protocol.md). Validation here, through the one parameter
checker (:mod:`meter.core.params`); storage through :class:`~meter.quotas.store.LimitStore`."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Any

from meter.core.cycles import Effective, changed, check_cycle_opts, entries
from meter.core.dims import shown
from meter.core.keys import check_feature, check_tenant
from meter.core.params import args as check_args
from meter.core.params import opts as check_opts
from meter.core.ports import Handler
from meter.errors import InvalidArgument, NotFound, Unavailable
from meter.quotas.limits import (
    assign_record,
    check_plan_name,
    cycle_record,
    limit_feature,
    override_record,
    parse_features,
    parse_limit,
    plan_record,
)
from meter.quotas.store import LimitStore
from storage.base import StorageError, VersionMoved
from storage.periods import Cycle

_CLEAR_OPTS = frozenset({"where"})
_ASSIGN_OPTS = frozenset({"anchor_day", "anchor_time", "tz", "effective"})


class LimitMethods:
    """The handlers, over one node's :class:`LimitStore`."""

    def __init__(self, store: LimitStore, *, hierarchy: bool = False) -> None:
        self.store = store
        #: The tenant hierarchy is on: a billing cycle is its root account's, for every level.
        self.hierarchy = hierarchy

    def handlers(self) -> dict[str, Handler]:
        return {
            "set_plan": self.set_plan,
            "assign_plan": self.assign_plan,
            "set_limit": self.set_limit,
            "clear_limit": self.clear_limit,
            "limits": self.limits,
        }

    def set_plan(self, params: list[Any]) -> Awaitable[dict[str, Any]]:
        name, features = check_args("set_plan", params, 2, 2)
        name = check_plan_name(name)
        limits = parse_features(features)
        return self._changed(plan_record(name, limits))

    def assign_plan(self, params: list[Any]) -> Awaitable[dict[str, Any]]:
        tenant, plan, opts = check_args("assign_plan", params, 2, 3, ({},))
        tenant = check_tenant(tenant)
        plan = None if plan is None else check_plan_name(plan)
        opts = check_opts("assign_plan", opts, _ASSIGN_OPTS, nil_is_absent=True)
        try:
            cycle = check_cycle_opts(opts)
        except ValueError as exc:
            raise InvalidArgument(f"assign_plan: {exc}") from None
        if cycle is not None and self.hierarchy and "/" in tenant:
            raise InvalidArgument(
                f"assign_plan: with the tenant hierarchy on, a billing cycle is its account's: "
                f"set it on {tenant.split('/')[0]!r} (every level follows it); nothing changed"
            )
        return self._assign(tenant, plan, cycle)

    async def _assign(
        self, tenant: str, plan: str | None, cycle: tuple[Cycle | None, Effective] | None
    ) -> dict[str, Any]:
        if plan is not None and plan not in self.store.book.plans:
            await self._fresh()  # the plan may be newer than this node's book
            if plan not in self.store.book.plans:
                raise NotFound(f"plan {plan!r} does not exist (set_plan it first)")
        answer: dict[str, Any] = {}
        if cycle is not None:
            answer["cycle"] = await self._new_cycle(tenant, *cycle)
        answer.update(await self._changed(assign_record(tenant, plan)))
        return answer

    async def _new_cycle(self, tenant: str, cycle: Cycle | None, effective: Effective) -> Any:
        """Write ``tenant``'s schedule with ``cycle`` taking effect as ``effective`` asks, on
        the version it was computed from (another change meanwhile: computed again)."""
        for _ in range(8):
            await self._fresh()
            book = self.store.book
            now = time.time()
            before = book.cycles.get(tenant, ())
            try:
                after = changed(before, cycle, now, effective)
            except ValueError as exc:
                raise InvalidArgument(f"assign_plan: {exc}; nothing changed") from None
            if after != before:
                try:
                    await self.store.change(cycle_record(tenant, after), expect=book.version)
                except VersionMoved:
                    continue
            return entries(after)
        raise Unavailable("assign_plan: the limits kept changing meanwhile; nothing changed")

    def set_limit(self, params: list[Any]) -> Awaitable[dict[str, Any]]:
        tenant, feature, spec = check_args("set_limit", params, 3, 3)
        tenant = check_tenant(tenant)
        where = None
        if isinstance(spec, dict) and "where" in spec:  # a limit on one dimension value
            where = spec["where"]
            spec = {k: v for k, v in spec.items() if k != "where"}
        feature = limit_feature(check_feature(feature), where)
        return self._changed(override_record(tenant, feature, parse_limit(spec)))

    def clear_limit(self, params: list[Any]) -> Awaitable[dict[str, Any]]:
        tenant, feature, opts = check_args("clear_limit", params, 2, 3, ({},))
        tenant = check_tenant(tenant)
        where = check_opts("clear_limit", opts, _CLEAR_OPTS, nil_is_absent=True).get("where")
        feature = limit_feature(check_feature(feature), where)
        return self._changed(override_record(tenant, feature, None))

    def limits(self, params: list[Any]) -> dict[str, Any]:
        (tenant,) = check_args("limits", params, 1, 1)
        tenant = check_tenant(tenant)
        book = self.store.book
        return {
            "tenant": tenant,
            "plan": book.assigned.get(tenant),
            "cycle": entries(book.cycles.get(tenant, ())),
            "version": book.version,
            "limits": {
                shown(f): eff.to_wire() for f, eff in sorted(book.for_tenant(tenant).items())
            },
        }

    async def _changed(self, record: tuple[str, str, str, str | None]) -> dict[str, Any]:
        return {"version": await self.store.change(record)}

    async def _fresh(self) -> None:
        try:
            await self.store.refresh()
        except StorageError as exc:
            raise Unavailable(f"limits could not be read: {exc}") from None
