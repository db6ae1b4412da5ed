"""A node's background loops beside the flusher, gossip and the limits: each a thin loop over
the parts it keeps up (reservation expiry, eviction, retention purge, strict shares, holds,
unique values' claims, the check of the cluster's gossip shards).

Each loop runs until cancelled (the node's stop); one that must not end on a bug logs it and
goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from cluster.gossip import Gossip
from meter.config import ClusterConfig
from meter.core.leases import Reservations
from meter.core.service import Service
from meter.core.uniques import Uniques
from meter.errors import ConfigError
from meter.quotas.holds import MAX_HOLD_BYTES, MAX_HOLD_KEYS, PeerHolds, local_holds
from meter.quotas.shares import Shares
from storage.base import Snapshot, Storage, StorageError

log = logging.getLogger("meter.node")
#: (the holds' warning has always been the service's)
holds_log = logging.getLogger("meter.service")

#: How often open reservations are checked for their deadline.
EXPIRY_TICK_S = 0.05
#: Request ids are expired every this many expiry ticks.
IDS_EVERY_TICKS = 20
#: At most one warning per this many seconds while holds are left out of the frame.
WARN_HOLDS_EVERY_S = 60.0


async def shards_match(storage: Storage, c: ClusterConfig) -> bool:
    """Whether the cluster's ``gossip_shards``, stored when it was created (now, if this node
    is the first), is this node's (ADR 0024); :class:`ConfigError` if not; False if storage
    cannot tell yet."""
    try:
        stored = await storage.cluster_setting(
            f"gossip_shards:{c.cluster_name}", str(c.gossip_shards)
        )
    except StorageError as exc:
        log.warning("cannot read the cluster's gossip_shards yet (%s); checked again later", exc)
        return False
    if stored != str(c.gossip_shards):
        raise ConfigError(
            "gossip_shards",
            f"cluster {c.cluster_name!r} was created with gossip_shards = {stored}, this node "
            f"has {c.gossip_shards}: K is fixed for the cluster's life, start the node with "
            f'METER_GOSSIP_SHARDS={stored} (docs/cluster.md, "Shards")',
        )
    return True


async def check_shards(
    storage: Storage, c: ClusterConfig, *, refuse: Callable[[], None], pause: float = 1.0
) -> None:
    """:func:`shards_match` until storage tells, backing off from ``pause`` seconds;
    ``refuse`` (stop the node) if the cluster's K is another. (Meanwhile the node gossips;
    with another K it and its peers do not hear each other.)"""
    try:
        while not await shards_match(storage, c):
            await asyncio.sleep(pause)
            pause = min(30.0, pause * 2)
    except ConfigError as exc:
        log.error("refusing to run: %s", exc.message)
        refuse()


async def expire_reservations(service: Service) -> None:
    """Release reservations past their deadline; forget request ids past their window."""
    ticks = 0
    while True:
        await asyncio.sleep(EXPIRY_TICK_S)
        service.expire_reservations()
        ticks += 1
        if ticks % IDS_EVERY_TICKS == 0:
            now = time.time()
            service.ids.expire(now)
            service.done.expire(now)


class Evicts(Protocol):
    """A table that drops rows idle since its previous call (counters, gauges; unique values
    of keys the counters dropped)."""

    def evict_idle(self) -> int: ...


async def evict_idle(every_s: float, *tables: Evicts) -> None:
    """Drop idle keys of ``tables`` from memory every ``every_s`` seconds."""
    while True:
        await asyncio.sleep(every_s)
        dropped = sum(table.evict_idle() for table in tables)
        if dropped:
            log.debug("evicted %d idle keys", dropped)


async def purge_expired(storage: Storage, every_s: float) -> None:
    """Delete stored counters past their retention (SQLite; DynamoDB's TTL does it)."""
    while True:
        await asyncio.sleep(every_s)
        try:
            n = await storage.purge_expired()
        except StorageError as exc:
            log.warning("retention purge failed (retried next interval): %s", exc)
            continue
        if n:
            log.info("retention purge: deleted %d expired counters", n)


#: How often claims of unique values whose outcome is not known are claimed again.
RESOLVE_EVERY_S = 0.5


async def resolve_claims(uniques: Uniques) -> None:
    """Claim again, until storage answers, every claim of a unique value whose outcome is not
    known (a failed write, a restart): each is counted once it is known won. And mark voided
    in storage the values voids took back."""
    while True:
        if uniques.pending:
            try:
                left = await uniques.resolve()
            except Exception:  # a bug must not end the resolving for good
                log.exception("unique values: resolving claims failed")
            else:
                if left:
                    log.debug("unique values: %d claims still unresolved", left)
        if uniques.voids.unmarked:
            try:
                left = await uniques.voids.mark()
            except Exception:  # (as above)
                log.exception("unique values: marking voided values failed")
            else:
                if left:
                    log.debug("unique values: %d voided values not marked yet", left)
        await asyncio.sleep(RESOLVE_EVERY_S)


async def keep_shares(shares: Shares) -> None:
    """Renew this node's strict shares and give back idle ones (ADR 0009)."""
    while True:
        await asyncio.sleep(shares.lease_ms / 3000)
        try:
            await shares.step()
        except Exception:  # a bug must not end renewals (and then the drain) for good
            log.exception("strict shares: upkeep failed")


class HoldsAnnouncer:
    """This node's ``holds`` frame: the units its open reservations hold, per counter,
    bounded in counters and bytes; what is left out is logged (once a minute at most)."""

    def __init__(
        self,
        reservations: Reservations,
        peer_holds: PeerHolds,
        gossip: Gossip[Snapshot],
        tick_s: float,
        heartbeat_s: float,
    ) -> None:
        self.reservations = reservations
        self.peer_holds = peer_holds
        self.gossip = gossip
        self.tick_s = tick_s
        self.heartbeat_s = heartbeat_s
        #: Counters this node holds units on that its last frame left out.
        self.left_out = 0
        self._warned_at = -WARN_HOLDS_EVERY_S

    def items(self) -> list[Any]:
        """The frame's items now (the most held first)."""
        items, left_out = local_holds(self.reservations.held())
        self.left_out = left_out
        if left_out:
            now = time.monotonic()
            if now - self._warned_at >= WARN_HOLDS_EVERY_S:
                self._warned_at = now
                holds_log.warning(
                    "holds: %d counters held on are not announced to peers (one frame carries "
                    "at most %d counters, %d bytes; the most held go first)",
                    left_out,
                    MAX_HOLD_KEYS,
                    MAX_HOLD_BYTES,
                )
        return items

    async def run(self) -> None:
        """Gossip this node's reservation holds each tick they changed, and every heartbeat
        while it holds any (or held any lately: a lost frame must not leave peers with holds
        that are gone); peers count them against hard limits (docs/quotas.md)."""
        tick, beat = self.tick_s, self.heartbeat_s
        peer_holds = self.peer_holds
        sent: list[Any] = []
        sent_at = last_held = 0.0
        while True:
            await asyncio.sleep(tick)
            for peer in peer_holds.expire():  # holders resend every beat: this one is silent
                log.warning("holds of peer %s not refreshed for %.1f s: no longer counted",
                            peer, peer_holds.max_age)  # fmt: skip
            items = self.items()
            now = time.monotonic()
            if items:
                last_held = now
            due = now - sent_at >= beat and now - last_held <= 10 * beat
            if (items != sent or due) and self.gossip.holds_changed(items):
                sent, sent_at = items, now
