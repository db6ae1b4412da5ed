"""What the two Redis buses share: the channels listened to and their confirmations, the
subscriber task with backoff, the alerts' stream, and Redis errors mapped to the bus' own.

A subclass connects and reads in :meth:`PubSubBus._session` (one connection's life: it returns
or raises when the subscriber must start over), and names its subscribe and unsubscribe
commands (``SUBSCRIBE`` on one Redis, ``SSUBSCRIBE`` on a Redis Cluster).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import random
import re
import ssl
from collections.abc import Collection
from typing import Any

from redis.exceptions import AuthenticationError, RedisClusterException, RedisError, ResponseError

from cluster.bus import Bus, BusUnavailable, OnMessage, OnState

log = logging.getLogger("cluster.redis")

#: Every error a Redis client may raise (a cluster client's own are not ``RedisError``s).
REDIS_ERRORS: tuple[type[BaseException], ...] = (
    RedisError,
    RedisClusterException,
    OSError,
    TimeoutError,
)
#: Seconds a subscription is waited for before the call gives up.
CONFIRM_S = 5.0


class PubSubBus(Bus):
    """A :class:`Bus` on a Redis client's pub/sub: ``channel`` always, and the channels
    :meth:`listen` names."""

    def __init__(
        self, channel: str, client: Any, *, min_backoff: float, max_backoff: float
    ) -> None:
        super().__init__()
        self.channel = channel
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff
        self._client = client
        #: Channels to listen to besides ``channel`` (subscribed at every connect).
        self._listening: frozenset[str] = frozenset()
        #: The connected subscriber, the channels Redis confirmed on it, and the calls
        #: waiting for a confirmation.
        self._pubsub: Any = None
        self._subscribed: set[str] = set()
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self._on_message: OnMessage | None = None
        self._closing = False

    # -- what a subclass gives ---------------------------------------------------------------

    @abc.abstractmethod
    async def _session(self) -> None:
        """Connect, subscribe (:meth:`_confirmed`), say so (``_set_connected(True)``) and read
        until the connection fails (raise) or is closed."""

    @abc.abstractmethod
    async def _subscribe(self, pubsub: Any, channels: Collection[str]) -> None:
        """Send the subscribe command of ``channels``."""

    @abc.abstractmethod
    async def _unsubscribe(self, pubsub: Any, channels: Collection[str]) -> None:
        """Send the unsubscribe command of ``channels``."""

    # -- the bus -----------------------------------------------------------------------------

    async def start(self, on_message: OnMessage, on_state: OnState) -> None:
        self._on_message = on_message
        self._on_state = on_state
        self._task = asyncio.create_task(self._run(), name=f"{self.kind}-bus")

    async def listen(self, channels: Collection[str]) -> None:
        self._listening = frozenset(channels) - {self.channel}
        pubsub = self._pubsub
        if not self.connected or pubsub is None:
            raise BusUnavailable(f"{self.kind} is not connected: {self.last_error}")
        gone = self._subscribed - self._listening - {self.channel}
        new = self._listening - self._subscribed
        try:
            if gone:
                await self._unsubscribe(pubsub, gone)
                self._subscribed -= gone
            if new:
                await self._confirmed(pubsub, new)
        except REDIS_ERRORS as exc:
            raise BusUnavailable(f"subscribe failed: {describe_error(exc)}") from None

    async def xadd(self, stream: str, fields: dict[str, str], maxlen: int) -> str:
        """``XADD stream MAXLEN ~ maxlen * fields``; the entry's id. :class:`BusUnavailable`
        if Redis does not answer (it may have added it anyway)."""
        try:
            entry = await self._client.xadd(stream, fields, maxlen=maxlen, approximate=True)
        except REDIS_ERRORS as exc:
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
        with contextlib.suppress(*REDIS_ERRORS):
            await self._client.aclose()

    def describe(self) -> dict[str, object]:
        out = super().describe()
        out["channel"] = self.channel
        if self._listening:
            out["listening"] = len(self._listening)
        return out

    # -- the subscriber ----------------------------------------------------------------------

    async def _run(self) -> None:
        """Sessions, one after another until :meth:`close`, with backoff and full jitter
        between failures (a fleet does not reconnect in lock-step)."""
        failures = 0
        while not self._stopped():
            self._subscribed = set()
            try:
                await self._session()
                failures = 0
            except REDIS_ERRORS as exc:
                self.last_error = describe_error(exc)
                if self.connected or failures == 0:
                    log.warning("%s: %s", self.name(), self.last_error)
                failures += 1
            except BusUnavailable as exc:  # (a session that gave up: its own words)
                self.last_error = str(exc)
                if self.connected or failures == 0:
                    log.warning("%s: %s", self.name(), self.last_error)
                failures += 1
            except Exception as exc:  # a bug: the bus starts over rather than end for good
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("%s failed", self.name())
                failures += 1
            finally:
                self._set_connected(False)
                self._pubsub = None
                for waiter in self._waiters.values():
                    if not waiter.done():
                        waiter.set_exception(BusUnavailable("the subscriber lost redis"))
                self._waiters.clear()
            if self._stopped():
                return
            cap = min(self.max_backoff, self.min_backoff * 2 ** min(failures, 16))
            await asyncio.sleep(random.uniform(cap / 2, cap))

    async def _confirmed(self, pubsub: Any, channels: Collection[str]) -> None:
        """Subscribe ``channels`` and wait until the reader saw Redis confirm each (so nothing
        published after is missed); :class:`TimeoutError` after :data:`CONFIRM_S`."""
        waiters = self._expect(channels)
        await self._subscribe(pubsub, channels)
        await self._wait(waiters)

    def _expect(self, channels: Collection[str]) -> dict[str, asyncio.Future[None]]:
        """Futures the reader completes when Redis confirms each of ``channels``."""
        loop = asyncio.get_running_loop()
        waiters = {}
        for ch in channels:
            waiter = self._waiters.get(ch)
            if waiter is None or waiter.done():
                waiter = self._waiters[ch] = loop.create_future()
            waiters[ch] = waiter
        return waiters

    async def _wait(self, waiters: dict[str, asyncio.Future[None]]) -> None:
        _, pending = await asyncio.wait(waiters.values(), timeout=CONFIRM_S)
        for waiter in waiters.values():
            if waiter.done() and not waiter.cancelled() and waiter.exception() is not None:
                raise BusUnavailable(str(waiter.exception()))
        if pending:
            for ch, waiter in waiters.items():
                if not waiter.done():
                    waiter.cancel()
                    self._waiters.pop(ch, None)
            raise TimeoutError(f"no subscribe confirmation from redis for {len(pending)} channels")

    def _confirm(self, channel: str) -> bool:
        """Redis confirmed ``channel``; whether a call was waiting for it."""
        self._subscribed.add(channel)
        waiter = self._waiters.pop(channel, None)
        if waiter is None:
            return False
        if not waiter.done():
            waiter.set_result(None)
        return True

    def name(self) -> str:
        """How logs name this bus."""
        return f"{self.kind} bus"

    def _deliver(self, data: object) -> None:
        if isinstance(data, bytes) and self._on_message is not None:
            try:
                self._on_message(data)
            except Exception:  # a receiver bug must not kill the subscription
                log.exception("gossip receiver failed")

    def _stopped(self) -> bool:
        return self._closing


def redact(url: str) -> str:
    """``url`` without its password (nor a TLS key's ``ssl_password``), for logs and ``status``."""
    url = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)
    return re.sub(r"([?&]ssl_password=)[^&#]*", r"\1***", url)


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
