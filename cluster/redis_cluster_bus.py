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
bus is *down* only until its first subscription is confirmed, and after a failure of the whole
subscriber: it then starts over with backoff, and says so (``on_state``), like the single-Redis
bus. Redis errors never leave this module: they become :class:`BusError`\\ s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Collection, Sequence
from typing import Any

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from cluster.bus import Bus, BusUnavailable, OnMessage, OnState
from cluster.redis_bus import describe_error, redact, text

log = logging.getLogger("cluster.redis")

#: Seconds between two warnings about a failing read of one subscriber.
WARN_EVERY_S = 5.0


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


class RedisClusterBus(Bus):
    """A :class:`Bus` on sharded channels of a Redis Cluster."""

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
        super().__init__()
        self.nodes = list(nodes)
        self.channel = channel
        self.poll_s = poll_s
        self.refresh_s = refresh_s
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff
        startup, options = startup_nodes(nodes)
        # No client-side retries: a failed publish is reported at once (the frame is lost;
        # peers see the gap), and the subscriber is this class' to keep up.
        self._client = RedisCluster(
            startup_nodes=startup,
            socket_connect_timeout=connect_timeout,
            socket_timeout=op_timeout,
            retry=Retry(NoBackoff(), 0),
            **options,
        )
        self._listening: frozenset[str] = frozenset()
        self._pubsub: Any = None
        self._subscribed: set[str] = set()
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self._on_message: OnMessage | None = None
        self._on_state: OnState | None = None
        self._closing = False
        #: Subscriptions the client moved to a new owner (a failover, a migration).
        self.moves = 0
        self.read_errors = 0
        self._warned_at = 0.0

    async def start(self, on_message: OnMessage, on_state: OnState) -> None:
        self._on_message = on_message
        self._on_state = on_state
        self._task = asyncio.create_task(self._run(), name="redis-cluster-bus")

    async def publish(self, data: bytes, channel: str | None = None) -> None:
        if not self.connected:
            raise BusUnavailable(f"redis cluster is not connected: {self.last_error}")
        try:
            await self._client.spublish(channel or self.channel, data)
        except (RedisError, OSError) as exc:
            raise BusUnavailable(f"publish failed: {describe_error(exc)}") from None

    async def listen(self, channels: Collection[str]) -> None:
        self._listening = frozenset(channels) - {self.channel}
        pubsub = self._pubsub
        if not self.connected or pubsub is None:
            raise BusUnavailable(f"redis cluster is not connected: {self.last_error}")
        gone = self._subscribed - self._listening - {self.channel}
        new = self._listening - self._subscribed
        try:
            if gone:
                await pubsub.sunsubscribe(*gone)
                self._subscribed -= gone
            if new:
                await self._confirmed(pubsub, new)
        except (RedisError, OSError, TimeoutError) as exc:
            raise BusUnavailable(f"subscribe failed: {describe_error(exc)}") from None

    async def xadd(self, stream: str, fields: dict[str, str], maxlen: int) -> str:
        """``XADD stream MAXLEN ~ maxlen * fields`` on the master of ``stream``'s slot; the
        entry's id. :class:`BusUnavailable` if it does not answer (it may have added it)."""
        try:
            entry = await self._client.xadd(stream, fields, maxlen=maxlen, approximate=True)  # type: ignore[arg-type]
        except (RedisError, OSError) as exc:
            raise BusUnavailable(f"XADD {stream[:64]!r} failed: {describe_error(exc)}") from None
        return entry.decode() if isinstance(entry, bytes) else str(entry)

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._set_connected(False)
        with contextlib.suppress(RedisError, OSError):
            await self._client.aclose()

    def describe(self) -> dict[str, object]:
        out = super().describe()
        out["nodes"] = [redact(n) for n in self.nodes]
        out["channel"] = self.channel
        out["moves"] = self.moves
        out["read_errors"] = self.read_errors
        if self._listening:
            out["listening"] = len(self._listening)
        return out

    # -- the subscriber --------------------------------------------------------------------

    async def _run(self) -> None:
        failures = 0
        while not self._closing:
            self._subscribed = set()
            pubsub: Any = None
            try:
                await self._client.initialize()
                pubsub = self._pubsub = self._client.pubsub()
                reader = asyncio.create_task(self._read(pubsub), name="redis-cluster-reader")
                try:
                    await self._confirmed(pubsub, {self.channel, *self._listening})
                    failures = 0
                    self._set_connected(True)
                    await asyncio.gather(reader, self._refresh())
                finally:
                    reader.cancel()
                    with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
                        await reader
            except (RedisError, OSError, TimeoutError) as exc:
                self.last_error = describe_error(exc)
                if self.connected or failures == 0:
                    log.warning("redis cluster bus: %s", self.last_error)
                self._set_connected(False)
                failures += 1
            finally:
                self._pubsub = None
                for waiter in self._waiters.values():
                    if not waiter.done():
                        waiter.set_exception(BusUnavailable("the subscriber lost the cluster"))
                self._waiters.clear()
                if pubsub is not None:
                    with contextlib.suppress(RedisError, OSError, TimeoutError):
                        await asyncio.wait_for(pubsub.aclose(), 1.0)
            if self._stopped():
                return
            cap = min(self.max_backoff, self.min_backoff * 2 ** min(failures, 16))
            await asyncio.sleep(random.uniform(cap / 2, cap))

    async def _confirmed(self, pubsub: Any, channels: Collection[str]) -> None:
        """``SSUBSCRIBE`` ``channels`` and wait until the reader sees each confirmed."""
        loop = asyncio.get_running_loop()
        waiters = {ch: self._waiters.get(ch) or loop.create_future() for ch in channels}
        self._waiters.update(waiters)
        await pubsub.ssubscribe(*channels)
        await asyncio.wait_for(asyncio.gather(*waiters.values()), 5.0)

    async def _read(self, pubsub: Any) -> None:
        while True:
            try:
                # A bounded poll: with no timeout it would wait on one master only.
                msg = await pubsub.get_sharded_message(timeout=self.poll_s)
            except (RedisError, OSError) as exc:
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
                waiter = self._waiters.pop(channel, None)
                if waiter is not None:
                    if not waiter.done():
                        waiter.set_result(None)
                elif channel in self._subscribed:
                    self.moves += 1  # moved to another master by the client
                    log.info("redis cluster bus: %s moved to a new master", channel)
                self._subscribed.add(channel)
            elif kind == "smessage":
                data = msg.get("data")
                if isinstance(data, bytes) and self._on_message is not None:
                    try:
                        self._on_message(data)
                    except Exception:  # a receiver bug must not kill the subscription
                        log.exception("gossip receiver failed")

    async def _refresh(self) -> None:
        """Re-read the slot map now and then: the client then moves every subscription whose
        slot has another owner (a hung master is never noticed otherwise)."""
        while True:
            await asyncio.sleep(self.refresh_s)
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                await self._client.nodes_manager.initialize()

    def _stopped(self) -> bool:
        return self._closing

    def _warn(self, error: str) -> None:
        self.last_error = error
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning("redis cluster bus: reading failed: %s", error)

    def _set_connected(self, up: bool) -> None:
        if up == self.connected:
            return
        self.connected = up
        if up:
            self.connects += 1
            self.last_error = None
            log.info("redis cluster bus connected (%s)", self.channel)
        if self._on_state is not None:
            try:
                self._on_state(up)
            except Exception:
                log.exception("bus state callback failed")
