"""What a client's subscriptions hold: the tenants watched and the notifications and alerts
the node sent that the caller has not read yet (both clients keep one :class:`Inbox`)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

#: Notifications a client keeps per subscribed tenant until they are read; past that the
#: oldest are dropped (counted in ``dropped_notifications``).
MAX_BUFFERED = 10_000


class Usage(NamedTuple):
    """A counter's value as a subscription delivers it (docs/protocol.md, "Live usage");
    ``dims``: a dimension counter's dimension values, ``((name, value), ...)``, empty for a
    feature's total (docs/dimensions.md)."""

    tenant: str
    feature: str
    value: int
    period: str
    dims: tuple[tuple[str, str], ...] = ()


def _usage(params: Any) -> Usage | None:
    """A usage notification's params as a :class:`Usage`, ``None`` if they are not one."""
    if type(params) is Usage:
        return params
    if type(params) is not list or len(params) not in (4, 5):
        return None
    if len(params) == 4:
        return Usage(*params)
    dims = params[4]
    if type(dims) is not dict:
        return None
    return Usage(params[0], params[1], params[2], params[3], tuple(sorted(dims.items())))


class Inbox:
    """A client's subscriptions (tenant -> the subscribe params) and the notifications
    received and not read yet, per tenant."""

    def __init__(self) -> None:
        self.subs: dict[str, list[Any]] = {}
        self.notes: dict[str, collections.deque[Usage]] = {}
        #: Tenants whose ``subscribe`` is on its way on a connection that does not watch them
        #: yet: their unread notifications set aside, and those received since, which can
        #: only follow the answer (the node sends none before it).
        self.held: dict[str, tuple[collections.deque[Usage], list[Usage]]] = {}
        #: Notifications dropped because the caller did not read them (MAX_BUFFERED).
        self.dropped = 0
        #: Set when something arrives or the connection is lost (the asyncio client's).
        self.event: asyncio.Event | None = None
        #: ``subscribe_alerts``: whether this client gets threshold alerts (made again on a
        #: new connection), and those received and not read yet (oldest dropped past
        #: MAX_BUFFERED, counted in ``dropped``).
        self.alerts_on = False
        self.alerts: collections.deque[dict[str, Any]] = collections.deque()

    def subscribing(self, tenant: str) -> None:
        """Call before sending a ``subscribe`` of ``tenant`` that the connection does not
        watch yet (a new tenant, or every tenant again on a new connection): a notification
        decoded with the answer, before :meth:`subscribed` runs, is kept, after the answer's
        values. (A repeat on the same connection needs nothing: the queue exists.)"""
        self.held[tenant] = (self.notes.pop(tenant, collections.deque()), [])

    def subscribed(self, tenant: str, params: list[Any], items: Any) -> None:
        """``tenant`` is watched (``params``: how to subscribe again); ``items`` are the
        subscribe call's answer, the values now, delivered first."""
        self.subs[tenant] = params
        aside, later = self.held.pop(tenant, (None, []))
        queue = self.notes.get(tenant)
        if queue is None:
            queue = self.notes[tenant] = collections.deque() if aside is None else aside
        for item in items if isinstance(items, list) else ():
            self._append(queue, item)
        for usage in later:
            self._append(queue, usage)

    def not_subscribed(self, tenant: str) -> None:
        """The ``subscribe`` announced by :meth:`subscribing` failed: put things back."""
        held = self.held.pop(tenant, None)
        if held is not None and tenant in self.subs:
            self.notes[tenant] = held[0]

    def unsubscribed(self, tenant: str) -> None:
        """``tenant`` is no longer watched: its unread notifications are dropped."""
        self.subs.pop(tenant, None)
        self.notes.pop(tenant, None)
        self.held.pop(tenant, None)
        self.wake()

    def add(self, params: Any, method: str = "usage") -> None:
        """Keep a notification (``usage`` or ``alert``) the node sent."""
        if method == "alert":  # params: [{id, tenant, ...}]
            ok = type(params) is list and len(params) == 1 and type(params[0]) is dict
            if ok and self.alerts_on:
                if len(self.alerts) >= MAX_BUFFERED:
                    self.alerts.popleft()
                    self.dropped += 1
                self.alerts.append(params[0])
            return
        usage = _usage(params)
        if usage is None:
            return
        queue = self.notes.get(usage.tenant)
        if queue is None:
            held = self.held.get(usage.tenant)
            if held is not None:
                held[1].append(usage)
            return  # else: not subscribed (any more)
        self._append(queue, usage)

    def _append(self, queue: collections.deque[Usage], params: Any) -> None:
        usage = _usage(params)
        if usage is None:
            return
        if len(queue) >= MAX_BUFFERED:
            queue.popleft()
            self.dropped += 1
        queue.append(usage)

    @contextlib.contextmanager
    def subscribing_to(self, tenant: str, again: bool = False) -> Iterator[None]:
        """Around sending a ``subscribe`` of ``tenant`` (``again``: made again on a new
        connection): :meth:`subscribing` first if the connection does not watch it yet,
        :meth:`not_subscribed` if the block fails (its answer goes to :meth:`subscribed`)."""
        fresh = again or tenant not in self.subs
        if fresh:  # before sending: a notification may come in the answer's read
            self.subscribing(tenant)
        try:
            yield
        except BaseException:
            if fresh:
                self.not_subscribed(tenant)
            raise

    @contextlib.contextmanager
    def subscribing_alerts(self) -> Iterator[None]:
        """Around sending ``subscribe_alerts``: alerts are kept from now on, unless it fails."""
        self.alerts_on = True
        try:
            yield
        except BaseException:
            self.alerts_on = False
            raise

    def unsubscribed_alerts(self) -> None:
        """Alerts are no longer kept (those unread are dropped); their iterators end."""
        self.alerts_on = False
        self.alerts.clear()
        self.wake()

    def take(self, tenant: str) -> Usage | None:
        """The oldest unread notification of ``tenant``, if any."""
        queue = self.notes.get(tenant)
        return queue.popleft() if queue else None

    def take_alert(self) -> dict[str, Any] | None:
        """The oldest unread alert, if any."""
        return self.alerts.popleft() if self.alerts else None

    def wake(self) -> None:
        """Wake the asyncio client's iterators (something arrived, or the connection is lost)."""
        if self.event is not None:
            self.event.set()
