"""What the two Redis buses share: the channels listened to and their confirmations, the
subscriber task with backoff, the alerts' stream, and Redis errors mapped to the bus' own.

A session is one subscriber's life: subscribe (confirmed), read, and whatever else the subclass
keeps up beside the reader, until one of them fails; the bus then says it is down and starts
over with backoff. A subclass names its subscribe and unsubscribe commands (``SUBSCRIBE`` on
one Redis, ``SSUBSCRIBE`` on a Redis Cluster) and reads its messages.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import random
import re
import ssl
from collections.abc import Collection, Coroutine
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
        self._reader: asyncio.Task[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._on_message: OnMessage | None = None
        self._closing = False

    # -- what a subclass gives ---------------------------------------------------------------

    @abc.abstractmethod
    async def _subscribe(self, pubsub: Any, channels: Collection[str]) -> None:
        """Send the subscribe command of ``channels``."""

    @abc.abstractmethod
    async def _unsubscribe(self, pubsub: Any, channels: Collection[str]) -> None:
        """Send the unsubscribe command of ``channels``."""

    @abc.abstractmethod
    async def _read(self, pubsub: Any) -> None:
        """Read messages until the connection fails (raise): :meth:`_confirm` each
        subscription Redis confirms, :meth:`_deliver` each message."""

    async def _prepare(self) -> None:
        """Before a session subscribes (a cluster reads its slot map)."""

    def _keepers(self) -> list[Coroutine[Any, Any, None]]:
        """What runs beside the reader while connected (raising ends the session)."""
        return []

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
        if pubsub is not self._pubsub:  # (the connection was lost meanwhile)
            raise BusUnavailable(f"{self.kind} lost the connection; listening at the next")

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
        between failures (a fleet does not reconnect in lock-step); a session that was
        connected starts the backoff over."""
        failures = 0
        while not self._stopped():
            self._subscribed = set()
            connects = self.connects
            try:
                await self._session()
                error = "the subscriber stopped"
            except REDIS_ERRORS as exc:
                error = describe_error(exc)
            except BusUnavailable as exc:  # (a session that gave up: its own words)
                error = str(exc)
            except Exception as exc:  # a bug: the bus starts over rather than end for good
                error = f"{type(exc).__name__}: {exc}"
                log.exception("%s failed", self.name())
            self._lost()
            self.last_error = error
            if self.connects > connects:
                failures = 0
            if failures == 0:  # (the connection lost, or the first try failed)
                log.warning("%s: %s", self.name(), error)
            failures += 1
            if self._stopped():
                return
            cap = min(self.max_backoff, self.min_backoff * 2 ** min(failures, 16))
            await asyncio.sleep(random.uniform(cap / 2, cap))

    async def _session(self) -> None:
        """Subscribe ``channel`` and the channels listened to, say the bus is up once Redis
        confirmed them (nothing published after is missed), and read, with the keepers
        beside, until one of them fails."""
        await self._prepare()
        pubsub: Any = self._client.pubsub()
        tasks: list[asyncio.Task[None]] = []
        try:
            channels = {self.channel, *self._listening}
            waiters = self._expect(channels)
            # (The reader starts once the subscriber has its connection: the subscribe.)
            await self._subscribe(pubsub, channels)
            self._reader = asyncio.create_task(self._read(pubsub), name=f"{self.kind}-reader")
            tasks.append(self._reader)
            await self._wait(waiters)
            self._pubsub = pubsub
            self._set_connected(True)
            log.info("%s connected (%s)", self.name(), self.channel)
            tasks += [asyncio.create_task(keeper) for keeper in self._keepers()]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # (raises what ended it)
        finally:
            self._lost()  # (at once: publishes fail fast, peers' silence is ours)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._reader = None
            with contextlib.suppress(*REDIS_ERRORS):
                await asyncio.wait_for(pubsub.aclose(), 1.0)

    def _lost(self) -> None:
        """The subscriber is gone: the bus is down, and calls waiting for a confirmation
        fail (:meth:`_wait`)."""
        self._pubsub = None
        self._set_connected(False)
        for waiter in self._waiters.values():
            waiter.cancel()
        self._waiters.clear()

    async def _confirmed(self, pubsub: Any, channels: Collection[str]) -> None:
        """Subscribe ``channels`` and wait until the reader saw Redis confirm each (so nothing
        published after is missed)."""
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
        """Until every waiter is confirmed: :class:`BusUnavailable` if the subscriber is lost
        or its reader ends first, :class:`TimeoutError` after :data:`CONFIRM_S`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CONFIRM_S
        reader = self._reader
        while True:
            pending = [w for w in waiters.values() if not w.done()]
            if any(w.cancelled() for w in waiters.values()):
                raise BusUnavailable(f"{self.kind} lost the connection while subscribing")
            if not pending:
                return
            if reader is None or reader.done():
                raise BusUnavailable(f"{self.kind} subscriber stopped reading")
            left = deadline - loop.time()
            if left <= 0:
                for ch, waiter in waiters.items():
                    if not waiter.done():
                        waiter.cancel()
                        self._waiters.pop(ch, None)
                raise TimeoutError(f"no subscribe confirmation for {len(pending)} channels")
            await asyncio.wait(
                [*pending, reader], timeout=left, return_when=asyncio.FIRST_COMPLETED
            )

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
