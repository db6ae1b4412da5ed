"""The Redis pub/sub bus (``redis.asyncio``): ``redis://``, ``rediss://`` and ``unix://`` URLs,
with AUTH (``redis://user:password@host:port/db``) taken from the URL. TLS (``rediss://``)
options are redis-py's ``ssl_*`` connection arguments as URL query parameters, for instance
``rediss://:pw@host:6380/0?ssl_ca_certs=/etc/meter/redis-ca.pem`` (see docs/cluster.md).

One subscriber connection reads the channel (and the shards' channels the gossip layer listens
to, :meth:`RedisBus.listen`); publishes go through the client's pool. When the
subscriber loses Redis the bus is *down*: :meth:`RedisBus.publish` fails fast without trying,
and the subscriber reconnects with exponential backoff and full jitter (so a fleet does not
reconnect in lock-step). Redis errors never leave this module: they become :class:`BusError`s.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Collection, Coroutine
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from cluster.bus import BusUnavailable
from cluster.redis_pubsub import REDIS_ERRORS, PubSubBus, describe_error, redact, text

__all__ = ["RedisBus", "redact"]

#: How often the subscriber connection is checked for a due health check PING, seconds.
HEALTH_POLL_S = 1.0
#: A subscriber that has read nothing (not even a PING's reply) for this many health check
#: intervals has lost Redis without a reset (a host gone, a connection dropped on the way).
SILENT_CHECKS = 2


class RedisBus(PubSubBus):
    """A :class:`~cluster.bus.Bus` on one Redis' pub/sub."""

    kind = "redis"

    def __init__(
        self,
        url: str,
        channel: str,
        *,
        connect_timeout: float = 1.0,
        op_timeout: float = 2.0,
        min_backoff: float = 0.05,
        max_backoff: float = 5.0,
        health_check_s: int = 5,
    ) -> None:
        # No client-side retries: a failed publish is reported at once (the caller drops the
        # message; peers see the gap), and reconnecting is this class' job, with backoff.
        client = aioredis.Redis.from_url(
            url,
            socket_connect_timeout=connect_timeout,
            socket_timeout=op_timeout,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=health_check_s,
        )
        super().__init__(channel, client, min_backoff=min_backoff, max_backoff=max_backoff)
        self.url = url
        self.health_check_s = health_check_s
        #: When the subscriber last read a reply (the event loop's clock).
        self._last_read = 0.0

    async def publish(self, data: bytes, channel: str | None = None) -> None:
        if not self.connected:
            raise BusUnavailable(f"redis is not connected: {self.last_error}")
        try:
            await self._client.publish(channel or self.channel, data)
        except REDIS_ERRORS as exc:
            raise BusUnavailable(f"publish failed: {describe_error(exc)}") from None

    def name(self) -> str:
        return f"redis bus {redact(self.url)}"

    def describe(self) -> dict[str, object]:
        out = super().describe()
        out["url"] = redact(self.url)
        return out

    async def _subscribe(self, pubsub: Any, channels: Collection[str]) -> None:
        await pubsub.subscribe(*channels)

    async def _unsubscribe(self, pubsub: Any, channels: Collection[str]) -> None:
        await pubsub.unsubscribe(*channels)

    async def _read(self, pubsub: Any) -> None:
        # The subscriber connection's replies are read here, not through
        # ``PubSub.get_message``: that wraps every message in a health check, a retry, a
        # timeout and a dict, 10-20 us a frame (measured), at 1,000 frames a second with 100
        # peers. Nothing else reads this connection; the session ends on any error, so
        # PubSub's own reconnect and channel bookkeeping are not needed. The health check's
        # PING is sent by :meth:`_health`.
        conn = pubsub.connection
        loop = asyncio.get_running_loop()
        self._last_read = loop.time()
        while True:
            # (a push notification is a list)
            reply = await conn.read_response(timeout=math.inf, push_request=True)
            self._last_read = loop.time()
            if not isinstance(reply, list) or len(reply) != 3:
                continue  # (a PING's reply: ``[b"pong", ...]`` is 2 long)
            kind = reply[0]
            if kind == b"message":
                self._deliver(reply[2])
            elif kind == b"subscribe":
                self._confirm(text(reply[1]))

    def _keepers(self) -> list[Coroutine[Any, Any, None]]:
        pubsub = self._pubsub
        assert pubsub is not None  # (the session sets it before it starts the keepers)
        return [self._health(pubsub)] if self.health_check_s > 0 else []

    async def _health(self, pubsub: Any) -> None:
        """PING the subscriber connection once it has been quiet for ``health_check_s``
        (redis-py's health check, which reads no longer make), and end the session when it
        has read nothing, not even the PING's reply, for :data:`SILENT_CHECKS` intervals: a
        Redis lost without a reset would otherwise be seen only when the kernel gives up on
        the connection, many minutes on."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            silent = loop.time() - self._last_read
            if silent > SILENT_CHECKS * self.health_check_s + HEALTH_POLL_S:
                raise BusUnavailable(f"no reply from redis for {silent:.1f} s (PING unanswered)")
            await pubsub.check_health()
