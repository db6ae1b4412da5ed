"""Gossip shards (ADR 0024): which channel a key's gossip travels on. Pure.

With ``K = 1`` (the default) every frame goes on the one cluster channel, as it always did.
With ``K > 1`` a key's deltas, announcements, readings and values go on the channel of its
tenant's shard, ``crc32(tenant) mod K``, and heartbeats, limit changes, holds and alerts on one
control channel. ``K`` is fixed when the cluster is created and stored with it, so ``mod K``
never remaps (a node started with another ``K`` refuses).
"""

from __future__ import annotations

import zlib
from typing import Any, Final, TypeVar

from cluster.bus import channel_name

_T = TypeVar("_T", bound=tuple[Any, ...])

#: Most shards a cluster may have (each is a channel every node may subscribe to).
MAX_SHARDS: Final = 256
#: Tenants whose shard is remembered before the memo starts over.
_MEMO_MAX: Final = 100_000


def shard_of(tenant: str, shards: int) -> int:
    """The shard of ``tenant``'s keys among ``shards``: stable across processes, builds and
    restarts (CRC-32 of the UTF-8 name)."""
    return zlib.crc32(tenant.encode()) % shards if shards > 1 else 0


class ShardMap:
    """:func:`shard_of` for one cluster's ``K``, with the channel names, memoised per tenant
    (a node looks up the same few tenants every tick)."""

    def __init__(self, cluster: str, shards: int) -> None:
        if not 1 <= shards <= MAX_SHARDS:
            raise ValueError(f"gossip shards must be 1..{MAX_SHARDS}, got {shards}")
        self.shards = shards
        if shards == 1:
            self.control = channel_name(cluster)
            self.channels: tuple[str, ...] = (self.control,)
        else:
            self.control = f"meter:{cluster}:control"
            self.channels = tuple(f"meter:{cluster}:gossip:{i}" for i in range(shards))
        self._memo: dict[str, int] = {}

    @property
    def sharded(self) -> bool:
        """Whether gossip is split over shards (``K > 1``)."""
        return self.shards > 1

    def of(self, tenant: str) -> int:
        """The shard of ``tenant``."""
        memo = self._memo
        shard = memo.get(tenant)
        if shard is None:
            if len(memo) >= _MEMO_MAX:
                memo.clear()
            shard = memo[tenant] = shard_of(tenant, self.shards)
        return shard

    def channel(self, shard: int | None) -> str:
        """The channel of ``shard`` (``None``: the control channel)."""
        return self.control if shard is None or self.shards == 1 else self.channels[shard]

    def split(self, items: list[_T]) -> dict[int | None, list[_T]]:
        """``items`` (tuples whose first field is a tenant) grouped by shard, in order;
        unsharded, all of them under ``None`` (the bus' own channel)."""
        if self.shards == 1:
            return {None: items}
        out: dict[int | None, list[_T]] = {}
        of = self.of
        for item in items:
            shard = of(item[0])
            group = out.get(shard)
            if group is None:
                out[shard] = [item]
            else:
                group.append(item)
        return out
