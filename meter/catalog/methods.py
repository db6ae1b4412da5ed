"""The declaration methods of the protocol: ``set_feature`` and ``get_feature``
(docs/protocol.md, docs/dimensions.md). Declarations are records of the limits' storage
(:mod:`meter.quotas.limits`, scope ``feature``), so they are versioned, announced and re-read
like plans: every node holds them within a second of a change."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable
from typing import Any

from meter.core.dims import UNDECLARED, FeatureSpec, parse_spec
from meter.core.keys import check_feature
from meter.core.params import args as check_args
from meter.core.ports import Handler
from meter.errors import Conflict, Unavailable
from meter.quotas.limits import declare_record
from meter.quotas.store import LimitStore
from storage.base import StorageError, VersionMoved

#: Declarations judged and written again after other limit changes landed meanwhile.
MAX_TRIES = 8


class FeatureMethods:
    """The handlers, over one node's :class:`LimitStore`."""

    def __init__(self, store: LimitStore) -> None:
        self.store = store

    def handlers(self) -> dict[str, Handler]:
        """The methods by name, for the node's dispatch table."""
        return {"set_feature": self.set_feature, "get_feature": self.get_feature}

    def set_feature(self, params: list[Any]) -> Awaitable[dict[str, Any]]:
        """The ``set_feature`` method: store a declaration, replacing the feature's."""
        feature, options = check_args("set_feature", params, 1, 2, ({},))
        feature = check_feature(feature)
        return self._set(feature, parse_spec(feature, options))

    async def _set(self, feature: str, spec: FeatureSpec) -> dict[str, Any]:
        """Store ``spec``, judged against the declaration storage holds now: written only on
        the version it was judged on (two declarations at once: the second is judged again,
        against the first)."""
        for attempt in range(MAX_TRIES):
            if attempt:  # (another change landed meanwhile: let it settle)
                await asyncio.sleep(random.uniform(0, 0.01 * 2**attempt))
            try:
                await self.store.refresh()  # judged against the stored declaration
            except StorageError as exc:
                raise Unavailable(f"declarations could not be read: {exc}") from None
            book = self.store.book
            before = book.features.get(feature)
            if before is not None and before.aggregation != spec.aggregation:
                raise Conflict(
                    f"feature {feature!r} is a {before.aggregation}; its aggregation cannot "
                    "change mid-period (its counters hold that kind): declare a new feature name"
                )
            try:
                version = await self.store.change(declare_record(feature, spec), book.version)
            except VersionMoved:
                continue  # (another change was written meanwhile: judged again on it)
            return {"feature": feature, "version": version, **spec.to_wire()}
        raise Unavailable("the limits kept changing while this declaration was written; retry")

    def get_feature(self, params: list[Any]) -> dict[str, Any]:
        """The ``get_feature`` method: the declaration this node holds."""
        (feature,) = check_args("get_feature", params, 1, 1)
        feature = check_feature(feature)
        book = self.store.book
        spec = book.features.get(feature)
        return {
            "feature": feature,
            "declared": spec is not None,
            "version": book.version,
            **(spec or UNDECLARED).to_wire(),
        }
