"""What a node pushes: live usage to subscribed connections, and threshold alerts to the fleet,
to this node's subscribers and to a Redis Stream.

:class:`UsagePush` decides when the watch ticks (docs/protocol.md, ``subscribe``);
:class:`AlertFanout` takes an alert this node fired, or a peer's, to everyone who should have it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from cluster.bus import BusUnavailable
from cluster.codec import AlertItem
from cluster.gossip import Gossip
from meter.config import ClusterConfig
from meter.core.service import Service
from meter.quotas.alerts import Alert, Alerts, from_peer_ok
from meter.wal.log import WriteAheadLog
from storage.base import Snapshot

log = logging.getLogger("meter.node")


class UsagePush:
    """Live usage push (``subscribe``): once per gossip interval (alone too), and soon after a
    peer's frame changed a watched counter, send each subscriber the watched counters that
    changed since they were last sent, once each, with their latest value. A tick reads the
    table once the write-ahead log holds every change made so far, so no value is pushed
    that a crash could take back. ``push()`` writes what the tick queued to the connections;
    ``stopped()`` says the node is stopping (no more timers then)."""

    def __init__(
        self,
        service: Service,
        wal: WriteAheadLog | None,
        interval_s: float,
        push: Callable[[], None],
        stopped: Callable[[], bool],
    ) -> None:
        self.service = service
        self.wal = wal
        self.interval_s = interval_s
        self.push = push
        self.stopped = stopped
        self._pending = False
        self._stopping = False
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0

    async def run(self) -> None:
        """Tick once per interval while anybody watches."""
        watch = self.service.watch
        while True:
            await asyncio.sleep(self.interval_s)
            if watch:
                self.schedule()

    def stop(self) -> None:
        """No more ticks or timers (the node is draining)."""
        self._stopping = True
        if self._timer is not None:
            self._timer.cancel()

    def peer_changed(self) -> None:
        """A peer's frame changed this node's views: push them now, not a tick later, so a
        unit tracked on a peer reaches a subscriber here within the peer's tick and delivery.
        Ticks run at least a quarter of an interval apart (a frame sooner after one sets a
        timer for then), and no counter is sent more than once per interval whatever the
        ticks (:meth:`Watch.tick`)."""
        if self._stopping or not self.service.watch or self._pending:
            return
        next_ok = self._last + self.interval_s / 4
        if time.monotonic() >= next_ok:
            self.schedule()
        else:
            self._at(next_ok)

    def schedule(self) -> None:
        """Tick once the log holds every change made so far."""
        if self._pending or self._stopping:
            return
        self._pending = True
        if self.wal is None:
            self._tick()
        else:
            self.wal.at_commit(self._tick)

    def _at(self, due: float) -> None:
        """Tick at ``due`` (monotonic seconds), unless a timer is set for earlier: one timer."""
        timer = self._timer
        if timer is not None and not timer.cancelled() and self._due <= due:
            return
        if timer is not None:
            timer.cancel()
        self._due = due
        # (+2 ms: the loop's clock is not time.monotonic(), and uvloop's is cached to the ms;
        # a timer firing early would find the counter still held and wait a whole tick)
        delay = max(0.0, due - time.monotonic()) + 0.002
        self._timer = asyncio.get_running_loop().call_later(delay, self._due_now)

    def _due_now(self) -> None:
        self._timer = None
        if not self.stopped():
            self.schedule()

    def _tick(self) -> None:
        self._pending = False
        if self._stopping:
            return
        now = self._last = time.monotonic()
        try:
            if self.service.watch_tick(now, self.interval_s):
                self.push()
            due = self.service.watch.next_due
            if due is not None and due > now:
                # A counter held back (sent less than an interval ago) goes as soon as it may.
                self._at(due)
        except Exception:  # a bug must not end the push for good
            log.exception("usage push tick failed (tried again next tick)")


class AlertStream(Protocol):
    """Where fired alerts are appended for consumers outside the fleet (a Redis Stream)."""

    def xadd(self, stream: str, fields: dict[str, str], maxlen: int) -> Awaitable[str]:
        """Append ``fields``; ``BusUnavailable`` if it could not be sent."""
        ...


class AlertFanout:
    """Threshold alerts out of this node: to the fleet over gossip, to this node's
    subscribers, and to the configured Redis Stream."""

    def __init__(
        self,
        alerts: Alerts,
        gossip: Gossip[Snapshot] | None,
        stream: AlertStream | None,
        cluster: ClusterConfig,
        *,
        offer: Callable[[Alert], None],
    ) -> None:
        self.alerts = alerts
        self.gossip = gossip
        self.stream = stream
        self.cluster = cluster
        #: Gives an alert to this node's subscribers.
        self.offer = offer
        #: Alerts being added to the Redis Stream.
        self._stream_tasks: set[asyncio.Task[None]] = set()

    def fired(self, alert: Alert) -> None:
        """This node won ``alert``'s claim: announce it to the fleet (every peer delivers it
        to its subscribers), deliver it here, and add it to the Redis Stream."""
        if self.gossip is not None:
            item: AlertItem = (
                alert.id, alert.tenant, alert.feature, alert.period, alert.threshold,
                alert.threshold_units, alert.limit, alert.value, alert.node, alert.at,
            )  # fmt: skip
            if not self.gossip.alert_fired(item):
                log.warning("alert %s: the bus is down, peers' subscribers will not get it",
                            alert.id)  # fmt: skip
            task = asyncio.create_task(self._stream_alert(alert), name="alert-stream")
            self._stream_tasks.add(task)
            task.add_done_callback(self._stream_tasks.discard)
        self.alerts.deliver(alert)

    async def _stream_alert(self, alert: Alert, attempts: int = 5) -> None:
        """``XADD`` ``alert`` to ``alerts_stream``; tried again (up to ``attempts`` times in
        all, backing off) while Redis does not answer."""
        if self.stream is None:
            return
        c = self.cluster
        fields = {k: str(v) for k, v in alert.to_wire().items()}
        pause = 0.2
        for attempt in range(attempts):
            try:
                await self.stream.xadd(c.alerts_stream, fields, c.alerts_stream_maxlen)
                return
            except BusUnavailable as exc:
                if attempt == attempts - 1:
                    log.error("alert %s not added to the stream %s: %s",
                              alert.id, c.alerts_stream, exc)  # fmt: skip
                    self.alerts.stream_failures += 1
                    return
            await asyncio.sleep(pause)
            pause = min(5.0, pause * 2)

    def from_peer(self, sender: str, item: AlertItem) -> None:
        """A peer's ``alert`` frame: delivered here only if it is what that peer could have
        fired (its own claim, under the id of its fields, of a current period): a signed
        frame replayed from another node, or from a past period, is dropped (logged)."""
        alert = Alert(*item)
        if not from_peer_ok(alert, sender, time.time()):
            log.warning("alert frame from %s dropped: not one it could fire now (%s)",
                        sender, alert.id)  # fmt: skip
            return
        self.alerts.deliver(alert)

    def delivered(self, alert: Alert) -> None:
        """``alert`` goes to this node's subscribers (once per id: :meth:`Alerts.deliver`)."""
        log.info("alert %s delivered: %s/%s %d%% (fired by %s)",
                 alert.id, alert.tenant, alert.feature, alert.threshold, alert.node)  # fmt: skip
        self.offer(alert)

    async def close(self) -> None:
        """A moment for alerts being added to the Redis Stream to finish."""
        if self._stream_tasks:
            await asyncio.wait(self._stream_tasks, timeout=2.0)
