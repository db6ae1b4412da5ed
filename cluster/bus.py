"""The bus interface: publish bytes to the cluster's channels, deliver received bytes to a callback.

A bus always listens to its own channel (the control channel of a sharded cluster, the only
channel of an unsharded one) and to the other channels :meth:`Bus.listen` names (a sharded
cluster's data shards, ADR 0024).

A bus is at-most-once and may be down. While it is down :meth:`Bus.publish` fails fast with
:class:`BusUnavailable` (callers drop the message and carry on: peers detect the gap) and the
bus reconnects on its own; every change of state is reported to the ``on_state`` callback, so
the gossip layer can resync after a reconnect.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Collection

log = logging.getLogger("cluster.bus")

#: Called with each message received on the channel (the bus' own messages included).
OnMessage = Callable[[bytes], None]
#: Called with ``True`` when the bus (re)connects and ``False`` when it loses the connection.
OnState = Callable[[bool], None]


class BusError(Exception):
    """Base of the bus errors (Redis errors are mapped to these at the boundary)."""


class BusUnavailable(BusError):
    """The bus is not connected (or the publish failed); the message was not sent."""


class Bus(abc.ABC):
    """One channel of a publish/subscribe bus."""

    #: Short name shown in ``status`` (``redis``, ``local``).
    kind: str = "abstract"

    def __init__(self) -> None:
        self.connected = False
        #: How many times the bus connected (1 on the first connect).
        self.connects = 0
        #: The last connection error, for ``status``.
        self.last_error: str | None = None
        self._on_state: OnState | None = None

    @abc.abstractmethod
    async def start(self, on_message: OnMessage, on_state: OnState) -> None:
        """Begin connecting and delivering; returns at once (connecting goes on in the
        background, with backoff, until :meth:`close`)."""

    @abc.abstractmethod
    async def publish(self, data: bytes, channel: str | None = None) -> None:
        """Send one message on ``channel`` (``None``: the bus' own); :class:`BusUnavailable`
        if it could not be sent."""

    @abc.abstractmethod
    async def listen(self, channels: Collection[str]) -> None:
        """Listen to ``channels`` besides the bus' own (and to no other). Returns once every
        new one is subscribed, so nothing published on it afterwards is missed;
        :class:`BusUnavailable` if that could not be confirmed (the bus subscribes them
        whenever it next connects)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop delivering and release connections."""

    def _set_connected(self, up: bool) -> None:
        """Record a change of state and tell ``on_state`` (a callback's bug is logged)."""
        if up == self.connected:
            return
        self.connected = up
        if up:
            self.connects += 1
            self.last_error = None
        if self._on_state is not None:
            try:
                self._on_state(up)
            except Exception:
                log.exception("bus state callback failed")

    def describe(self) -> dict[str, object]:
        """State for ``status``."""
        return {
            "kind": self.kind,
            "connected": self.connected,
            "connects": self.connects,
            "last_error": self.last_error,
        }


def channel_name(cluster: str) -> str:
    """The pub/sub channel of an unsharded cluster: two clusters can share one Redis."""
    return f"meter:{cluster}:gossip"
