"""The Redis Cluster bus (ADR 0024): sharded pub/sub (``SSUBSCRIBE`` / ``SPUBLISH``) through
redis-py's asyncio cluster client. Each channel lives on the master owning its slot, so the
shards' channels spread over the masters.

``nodes`` are ``host:port`` startup nodes; one of them may be a URL (``redis://`` or
``rediss://``, as ``redis_url`` takes them: AUTH, TLS options as query parameters), whose
credentials and TLS then serve every node. One :class:`~redis.asyncio.cluster.ClusterPubSub`
holds a connection to each master owning a channel listened to; publishes go through the
client's pools.

A master's failover, a slot's migration or a lost connection to one master lose what was
published on its channels meanwhile: the client moves the subscriptions to the new owner on
its own (a watchdog refreshes the slot map every ``refresh_s``, so a hung master is left too),
and peers see the loss as a gap in each sender's numbers on those shards, and resync them. The
bus is *down* until its subscriptions are confirmed, and when the slot map cannot be read from
any node for :data:`DOWN_AFTER_S` (the cluster is unreachable): it then starts over with
backoff, and says so (``on_state``: peers' frames of the outage are re-read from storage), like
the single-Redis bus. Redis errors never leave this module: they become :class:`BusError`\\ s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Coroutine, Sequence
from typing import Any

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from cluster.bus import BusUnavailable
from cluster.redis_pubsub import REDIS_ERRORS, PubSubBus, describe_error, redact, text

log = logging.getLogger("cluster.redis")

#: Seconds between two warnings about failing reads.
WARN_EVERY_S = 5.0
#: Seconds without a slot map from any node before the bus says it is down.
DOWN_AFTER_S = 2.0


def startup_nodes(nodes: Sequence[str]) -> tuple[list[ClusterNode], dict[str, Any]]:
    """``host:port`` (or URL) items: the startup nodes, and the connection options of the one
    URL among them (none: plain TCP without AUTH). ValueError on a bad item."""
    found: list[ClusterNode] = []
    options: dict[str, Any] = {}
    urls = 0
    for item in nodes:
        if "://" in item:
            urls += 1
            if urls > 1:
                raise ValueError("only one of the cluster's nodes may be given as a URL")
            if not item.startswith(("redis://", "rediss://")):
                raise ValueError(f"{redact(item)}: a cluster node's URL is redis:// or rediss://")
            parsed = dict(parse_url(item))
            host, port = parsed.pop("host", None), parsed.pop("port", None)
            parsed.pop("db", None)  # (a cluster has one database)
            if parsed.pop("connection_class", None) is not None:
                parsed["ssl"] = True
            options = parsed
            if not host or port is None:
                raise ValueError(f"{redact(item)}: no host:port")
            found.append(ClusterNode(str(host), int(str(port))))
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{item!r} is not host:port")
        found.append(ClusterNode(host, int(port)))
    if not found:
        raise ValueError("no node given")
    return found, options


class RedisClusterBus(PubSubBus):
    """A :class:`~cluster.bus.Bus` on sharded channels of a Redis Cluster."""

    kind = "redis-cluster"

    def __init__(
        self,
        nodes: Sequence[str],
        channel: str,
        *,
        connect_timeout: float = 0.5,
        op_timeout: float = 1.0,
        poll_s: float = 0.01,
        refresh_s: float = 0.5,
        min_backoff: float = 0.05,
        max_backoff: float = 5.0,
    ) -> None:
        startup, options = startup_nodes(nodes)
        # No client-side retries: a failed publish is reported at once (the frame is lost;
        # peers see the gap), and the subscriber is this class' to keep up.
        client = RedisCluster(
            startup_nodes=startup,
            socket_connect_timeout=connect_timeout,
            socket_timeout=op_timeout,
            retry=Retry(NoBackoff(), 0),
            **options,
        )
        super().__init__(channel, client, min_backoff=min_backoff, max_backoff=max_backoff)
        self.nodes = list(nodes)
        self.poll_s = poll_s
        self.refresh_s = refresh_s
        #: Subscriptions the client made again on its own (a slot's owner changed, or a
        #: connection to a master was made again).
        self.moves = 0
        self.read_errors = 0
        self._warned_at = 0.0

    async def publish(self, data: bytes, channel: str | None = None) -> None:
        if not self.connected:
            raise BusUnavailable(f"redis cluster is not connected: {self.last_error}")
        try:
            await self._client.spublish(channel or self.channel, data)
        except REDIS_ERRORS as exc:
            raise BusUnavailable(f"publish failed: {describe_error(exc)}") from None

    def name(self) -> str:
        return "redis cluster bus"

    def describe(self) -> dict[str, object]:
        out = super().describe()
        out["nodes"] = [redact(n) for n in self.nodes]
        out["moves"] = self.moves
        out["read_errors"] = self.read_errors
        return out

    async def _subscribe(self, pubsub: Any, channels: Collection[str]) -> None:
        await pubsub.ssubscribe(*channels)

    async def _unsubscribe(self, pubsub: Any, channels: Collection[str]) -> None:
        await pubsub.sunsubscribe(*channels)

    async def _prepare(self) -> None:
        await self._client.initialize()

    def _keepers(self) -> list[Coroutine[Any, Any, None]]:
        return [self._refresh()]

    async def _read(self, pubsub: Any) -> None:
        while True:
            try:
                # A bounded poll: with no timeout it would wait on one master only.
                msg = await pubsub.get_sharded_message(timeout=self.poll_s)
            except REDIS_ERRORS as exc:
                # Every master polled failed this pass (one is down): the client moves the
                # subscriptions once the cluster promotes a replica; lost frames are gaps.
                self.read_errors += 1
                self._warn(describe_error(exc))
                await asyncio.sleep(self.poll_s)
                continue
            if msg is None:
                continue
            kind = msg.get("type")
            if kind == "ssubscribe":
                channel = text(msg.get("channel"))
                known = channel in self._subscribed
                if not self._confirm(channel) and known:
                    self.moves += 1
                    log.info("redis cluster bus: %s subscribed again by the client", channel)
            elif kind == "smessage":
                self._deliver(msg.get("data"))

    async def _refresh(self) -> None:
        """Re-read the slot map every ``refresh_s``: the client then moves every subscription
        whose slot has another owner (a hung master is never noticed otherwise). Ends the
        session, with :class:`BusUnavailable`, once no node answered for
        :data:`DOWN_AFTER_S`."""
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self._client.nodes_manager.initialize()
                last_ok = time.monotonic()
            except REDIS_ERRORS as exc:
                self._warn(describe_error(exc))
                if time.monotonic() - last_ok >= DOWN_AFTER_S:
                    raise BusUnavailable(f"no node answers: {self.last_error}") from None

    def _warn(self, error: str) -> None:
        self.last_error = error
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning("redis cluster bus: %s", error)
