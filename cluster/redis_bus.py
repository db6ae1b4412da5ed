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
import contextlib
import logging
import random
import re
import ssl
from collections.abc import Collection
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, RedisError, ResponseError

from cluster.bus import Bus, BusUnavailable, OnMessage, OnState

log = logging.getLogger("cluster.redis")


def redact(url: str) -> str:
    """``url`` without its password (nor a TLS key's ``ssl_password``), for logs and ``status``."""
    url = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)
    return re.sub(r"([?&]ssl_password=)[^&#]*", r"\1***", url)


class RedisBus(Bus):
    """A :class:`Bus` on one Redis pub/sub channel."""

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
        super().__init__()
        self.url = url
        self.channel = channel
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff
        # No client-side retries: a failed publish is reported at once (the caller drops the
        # message; peers see the gap), and reconnecting is this class' job, with backoff.
        self._client: aioredis.Redis = aioredis.Redis.from_url(
            url,
            socket_connect_timeout=connect_timeout,
            socket_timeout=op_timeout,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=health_check_s,
        )
        self._task: asyncio.Task[None] | None = None
        #: Channels to listen to besides ``channel`` (subscribed at every connect).
        self._listening: frozenset[str] = frozenset()
        #: The connected subscriber and the channels Redis confirmed on it.
        self._pubsub: Any = None
        self._subscribed: set[str] = set()
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self._on_message: OnMessage | None = None
        self._on_state: OnState | None = None
        self._closing = False

    async def start(self, on_message: OnMessage, on_state: OnState) -> None:
        self._on_message = on_message
        self._on_state = on_state
        self._task = asyncio.create_task(self._run(), name="redis-bus")

    async def publish(self, data: bytes, channel: str | None = None) -> None:
        if not self.connected:
            raise BusUnavailable(f"redis is not connected: {self.last_error}")
        try:
            await self._client.publish(channel or self.channel, data)
        except (RedisError, OSError) as exc:
            raise BusUnavailable(f"publish failed: {describe_error(exc)}") from None

    async def listen(self, channels: Collection[str]) -> None:
        self._listening = frozenset(channels) - {self.channel}
        pubsub = self._pubsub
        if not self.connected or pubsub is None:
            raise BusUnavailable(f"redis is not connected: {self.last_error}")
        gone = self._subscribed - self._listening - {self.channel}
        new = self._listening - self._subscribed
        try:
            if gone:
                await pubsub.unsubscribe(*gone)
                self._subscribed -= gone
            if new:
                await self._confirmed(pubsub, new)
        except (RedisError, OSError, TimeoutError) as exc:
            raise BusUnavailable(f"subscribe failed: {describe_error(exc)}") from None

    async def xadd(self, stream: str, fields: dict[str, str], maxlen: int) -> str:
        """``XADD stream MAXLEN ~ maxlen * fields`` on the client's pool; the entry's id.
        :class:`BusUnavailable` if Redis does not answer (it may have added it anyway)."""
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
        out["url"] = redact(self.url)
        out["channel"] = self.channel
        if self._listening:
            out["listening"] = len(self._listening)
        return out

    # -- the subscriber loop -----------------------------------------------------------------

    async def _run(self) -> None:
        failures = 0
        while not self._closing:
            pubsub: Any = self._client.pubsub()
            self._subscribed = set()
            try:
                await self._subscribe(pubsub)
                failures = 0
                self._pubsub = pubsub
                self._set_connected(True)
                await self._read(pubsub)
            except (RedisError, OSError, TimeoutError) as exc:
                self.last_error = describe_error(exc)
                if self.connected or failures == 0:
                    log.warning("redis bus %s: %s", redact(self.url), self.last_error)
                self._set_connected(False)
                failures += 1
            finally:
                self._pubsub = None
                for waiter in self._waiters.values():
                    if not waiter.done():
                        waiter.set_exception(BusUnavailable("the subscriber lost redis"))
                self._waiters.clear()
                with contextlib.suppress(RedisError, OSError, TimeoutError):
                    await asyncio.wait_for(pubsub.aclose(), 1.0)
            if self._stopped():
                return
            cap = min(self.max_backoff, self.min_backoff * 2 ** min(failures, 16))
            await asyncio.sleep(random.uniform(cap / 2, cap))

    async def _subscribe(self, pubsub: Any) -> None:
        channels = {self.channel, *self._listening}
        await pubsub.subscribe(*channels)
        # Connected means subscribed: wait for Redis to confirm, so nothing published after
        # this point is missed.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        while loop.time() < deadline:
            msg = await pubsub.get_message(timeout=1.0)
            if msg is not None and msg.get("type") == "subscribe":
                self._subscribed.add(text(msg.get("channel")))
                if channels <= self._subscribed:
                    return
        raise TimeoutError("no subscribe confirmation from redis")

    async def _confirmed(self, pubsub: Any, channels: Collection[str]) -> None:
        """Subscribe ``channels`` on the live subscriber and wait until the reader sees Redis
        confirm each."""
        loop = asyncio.get_running_loop()
        waiters = {ch: self._waiters.get(ch) or loop.create_future() for ch in channels}
        self._waiters.update(waiters)
        await pubsub.subscribe(*channels)
        await asyncio.wait_for(asyncio.gather(*waiters.values()), 5.0)

    async def _read(self, pubsub: Any) -> None:
        while True:
            msg = await pubsub.get_message(timeout=1.0)
            if msg is None:
                continue
            kind = msg.get("type")
            if kind == "subscribe":
                channel = text(msg.get("channel"))
                self._subscribed.add(channel)
                waiter = self._waiters.pop(channel, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
                continue
            if kind != "message":
                continue
            data = msg.get("data")
            if isinstance(data, bytes) and self._on_message is not None:
                try:
                    self._on_message(data)
                except Exception:  # a receiver bug must not kill the subscription
                    log.exception("gossip receiver failed")

    def _stopped(self) -> bool:
        return self._closing

    def _set_connected(self, up: bool) -> None:
        if up == self.connected:
            return
        self.connected = up
        if up:
            self.connects += 1
            self.last_error = None
            log.info("redis bus connected to %s (%s)", redact(self.url), self.channel)
        if self._on_state is not None:
            try:
                self._on_state(up)
            except Exception:
                log.exception("bus state callback failed")


def text(v: object) -> str:
    """A channel name as Redis answered it."""
    return v.decode() if isinstance(v, bytes) else str(v)


def describe_error(exc: BaseException) -> str:
    """A Redis error for logs and ``status`` (authentication and TLS failures named)."""
    if isinstance(exc, AuthenticationError) or (
        isinstance(exc, ResponseError) and ("NOAUTH" in str(exc) or "WRONGPASS" in str(exc))
    ):
        return f"authentication failed: {exc}"
    if isinstance(exc, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return f"TLS certificate verification failed: {exc}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
