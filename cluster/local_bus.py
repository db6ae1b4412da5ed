"""An in-process bus for single-process tests: several buses on one :class:`LocalHub`.

Delivery is asynchronous (``loop.call_soon``), in publish order, to every bus on the channel,
the sender included, like Redis pub/sub. Tests can drop messages (:attr:`LocalHub.drop`) and
take the hub down and up (:meth:`LocalHub.set_up`) to exercise gaps and reconnects.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Sequence

from cluster.bus import Bus, BusUnavailable, OnMessage, OnState


class LocalHub:
    """The shared "server" of local buses."""

    def __init__(self) -> None:
        self.buses: list[LocalBus] = []
        self.up = True
        #: Return True to drop a message (it is then delivered to nobody).
        self.drop: Callable[[bytes], bool] | None = None
        self.published = 0
        self.dropped = 0

    def bus(self, channel: str) -> LocalBus:
        """A new bus on ``channel``."""
        return LocalBus(self, channel)

    def set_up(self, up: bool, only: Sequence[Bus] | None = None) -> None:
        """Take the hub down (every bus disconnects) or bring it back (they reconnect).

        With ``only``, just those buses lose (or regain) their connection: the others stay
        connected to each other, as when one node's link to Redis breaks.
        """
        if only is None:
            self.up = up
        for bus in list(self.buses):
            if only is None or any(bus is b for b in only):
                bus._set_connected(up)

    def _deliver(self, channel: str, data: bytes) -> None:
        self.published += 1
        if self.drop is not None and self.drop(data):
            self.dropped += 1
            return
        for bus in list(self.buses):
            if (
                (bus.channel == channel or channel in bus.listening)
                and bus.connected
                and bus._on_message is not None
            ):
                asyncio.get_running_loop().call_soon(bus._on_message, data)


class LocalBus(Bus):
    """One subscriber/publisher on a :class:`LocalHub`."""

    kind = "local"

    def __init__(self, hub: LocalHub, channel: str) -> None:
        super().__init__()
        self.hub = hub
        self.channel = channel
        #: Channels listened to besides ``channel``.
        self.listening: frozenset[str] = frozenset()
        self._on_message: OnMessage | None = None

    async def start(self, on_message: OnMessage, on_state: OnState) -> None:
        self._on_message = on_message
        self._on_state = on_state
        self.hub.buses.append(self)
        self._set_connected(self.hub.up)

    async def publish(self, data: bytes, channel: str | None = None) -> None:
        if not self.connected:
            raise BusUnavailable("local hub is down")
        self.hub._deliver(channel or self.channel, bytes(data))

    async def listen(self, channels: Collection[str]) -> None:
        self.listening = frozenset(channels)
        if not self.connected:
            raise BusUnavailable("local hub is down")

    async def close(self) -> None:
        if self in self.hub.buses:
            self.hub.buses.remove(self)
        self.connected = False
        self._on_message = None

    def _set_connected(self, up: bool) -> None:
        if not up and self.connected:
            self.last_error = "local hub is down"
        super()._set_connected(up)
