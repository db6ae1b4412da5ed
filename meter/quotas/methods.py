"""The limits methods of the protocol: ``set_plan``, ``assign_plan``, ``set_limit``,
``clear_limit`` and ``limits`` (docs/protocol.md). Validation here, through the one parameter
checker (:mod:`meter.core.params`); storage through :class:`~meter.quotas.store.LimitStore`."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from meter.core.dims import shown
from meter.core.keys import check_feature, check_tenant
from meter.core.params import args as check_args
from meter.core.params import opts as check_opts
from meter.core.ports import Handler
from meter.errors import NotFound, Unavailable
from meter.quotas.limits import (
    assign_record,
    check_plan_name,
    limit_feature,
    override_record,
    parse_features,
    parse_limit,
    plan_record,
)
from meter.quotas.store import LimitStore
from storage.base import StorageError

_CLEAR_OPTS = frozenset({"where"})


class LimitMethods:
    """The handlers, over one node's :class:`LimitStore`."""

    def __init__(self, store: LimitStore) -> None:
        self.store = store

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
        tenant, plan = check_args("assign_plan", params, 2, 2)
        tenant = check_tenant(tenant)
        plan = None if plan is None else check_plan_name(plan)
        return self._assign(tenant, plan)

    async def _assign(self, tenant: str, plan: str | None) -> dict[str, Any]:
        if plan is not None and plan not in self.store.book.plans:
            await self._fresh()  # the plan may be newer than this node's book
            if plan not in self.store.book.plans:
                raise NotFound(f"plan {plan!r} does not exist (set_plan it first)")
        return await self._changed(assign_record(tenant, plan))

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
