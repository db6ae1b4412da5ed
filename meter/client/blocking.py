"""The blocking client: :class:`Client`, one Unix socket read and written in the caller's
thread. Its typed methods are the table's (:mod:`meter.client.calls`); this module holds the
transport, the retry loop that sends them, and the subscriptions' waits."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

from meter.client import calls
from meter.client.calls import Call, Method, TrackItem
from meter.client.inbox import Inbox, Usage
from meter.client.retry import (
    DEFAULT_RETRY_TIMEOUT,
    Backoff,
    Retrying,
    result,
    results,
    unavailable,
)
from meter.client.stream import Stream, connect
from meter.core.protocol import DEFAULT_MAX_FRAME, Encoder, Response
from meter.errors import MeterError, Unavailable, from_wire
from storage.base import ExportRow

P = ParamSpec("P")
T = TypeVar("T")

#: Default seconds the blocking client waits for an answer before raising Unavailable.
DEFAULT_TIMEOUT = 30.0


class _Ledger:
    """The credits ledger's methods of :class:`Client` (docs/ledger.md): a part of its own, so
    the client class stays a size one can read."""

    def _run(self, method: Method[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        raise NotImplementedError  # (the client's own)

    def grant(
        self,
        tenant: str,
        amount: int,
        *,
        ref: str | None = None,
        expires_at: int | None = None,
        priority: int | None = None,
    ) -> dict[str, Any]:
        """Credit ``amount`` to ``tenant``'s ledger; the entry written (or, for a ref seen
        before with the same request, its first answer). Without ``ref`` one is made up, so
        the client's own retries land once."""
        return self._run(calls.GRANT, tenant, amount, ref, expires_at, priority)

    def debit(self, tenant: str, amount: int, *, ref: str | None = None) -> dict[str, Any]:
        """Spend ``amount`` from ``tenant``'s ledger (``InsufficientBalance`` if it does not
        fit: nothing changed); the entry written."""
        return self._run(calls.DEBIT, tenant, amount, ref)

    def balance(self, tenant: str) -> dict[str, Any]:
        """``{tenant, available, ledger_available, pool, seq, grants}``: ``available`` is the
        ledger's ``ledger_available`` (what :meth:`debit` can take) plus the credit pool's
        unspent credits (docs/protocol.md)."""
        return self._run(calls.BALANCE, tenant)

    def ledger_page(
        self, tenant: str, after: int | None = None, limit: int | None = None
    ) -> dict[str, Any]:
        """One page of entries after sequence ``after``: ``{tenant, entries, cursor}``."""
        return self._run(calls.LEDGER_PAGE, tenant, after, limit)

    def ledger_entries(self, tenant: str, page_size: int = 100) -> Iterator[dict[str, Any]]:
        """Every entry of ``tenant``'s ledger, page by page."""
        after: int | None = None
        while True:
            page = self.ledger_page(tenant, after, page_size)
            yield from page["entries"]
            after = page["cursor"]
            if after is None:
                return

    def ledger_timeline_page(
        self,
        start: float | None = None,
        end: float | None = None,
        cursor: str | None = None,
        limit: int | None = None,
    ) -> dict[str, Any]:
        """One page of every tenant's ledger entries written from ``start`` until ``end``
        (epoch seconds; default 0 and now) in time order: ``{entries, cursor}``, each entry
        with its ``tenant``."""
        return self._run(calls.LEDGER_TIMELINE_PAGE, start, end, cursor, limit)

    def ledger_timeline(
        self, start: float | None = None, end: float | None = None, page_size: int = 100
    ) -> Iterator[dict[str, Any]]:
        """Every tenant's ledger entries from ``start`` until ``end``, page by page."""
        cursor: str | None = None
        # (one range for every page; the node stamps an entry to the nearest millisecond)
        end = time.time() + 0.001 if end is None else end
        while True:
            page = self.ledger_timeline_page(start, end, cursor, page_size)
            yield from page["entries"]
            cursor = page["cursor"]
            if cursor is None:
                return


class Client(_Ledger, Retrying):
    """A blocking client over one connection (re-opened after a failure when the client
    knows its socket path, as one made by :meth:`connect` does). Not thread-safe: one per
    thread.

    Why one class: it is the node's method list as one object a caller holds (one typed
    wrapper per wire method, each a line that calls the shared table in
    :mod:`meter.client.calls`) over one connection's transport; splitting the wrappers off
    would give callers two objects for one connection."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        max_frame: int = DEFAULT_MAX_FRAME,
        auto_ids: bool = True,
        retry_timeout: float = DEFAULT_RETRY_TIMEOUT,
        path: str | os.PathLike[str] | None = None,
    ) -> None:
        """``path`` is where to reconnect after a failure; without it (a bare socket) a
        failed connection stays failed and nothing is retried."""
        self._timeout = timeout
        self._max_frame = max_frame
        self._path = os.fspath(path) if path is not None else None
        self._closed = False
        self._encoder = Encoder()
        self._msgids = [0]
        self._inbox = Inbox()
        self._stream: Stream | None = self._open(sock)
        self.auto_ids = auto_ids
        self.retry_timeout = retry_timeout

    @property
    def dropped_notifications(self) -> int:
        """Notifications dropped because they were not read (more than MAX_BUFFERED)."""
        return self._inbox.dropped

    @classmethod
    def connect(
        cls,
        path: str | os.PathLike[str],
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        max_frame: int = DEFAULT_MAX_FRAME,
        auto_ids: bool = True,
        retry_timeout: float = DEFAULT_RETRY_TIMEOUT,
    ) -> Client:
        """Connect to the node listening on ``path``; raises Unavailable if it cannot (this
        first connection is not retried). ``timeout`` bounds each attempt's wait for an
        answer; ``retry_timeout`` and ``auto_ids``: see :mod:`meter.client`."""
        sock = connect(os.fspath(path), timeout)
        return cls(
            sock,
            timeout=timeout,
            max_frame=max_frame,
            auto_ids=auto_ids,
            retry_timeout=retry_timeout,
            path=path,
        )

    def close(self) -> None:
        """Close the connection (idempotent); the client cannot be used afterwards."""
        self._closed = True
        if self._stream is not None:
            self._stream.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _open(self, sock: socket.socket) -> Stream:
        return Stream(
            sock,
            timeout=self._timeout,
            max_frame=self._max_frame,
            encoder=self._encoder,
            inbox=self._inbox,
            msgids=self._msgids,
        )

    def _ensure(self) -> Stream:
        """The open connection, reconnecting to the socket path if the last one failed."""
        stream = self._stream
        if stream is not None and not stream.closed:
            return stream
        if self._closed:
            raise Unavailable("the client is closed")
        if self._path is None:
            raise Unavailable("the connection to the node was lost (no socket path to reconnect)")
        # A fresh stream: bytes of a half-read answer on the old one are not kept.
        stream = self._stream = self._open(connect(self._path, self._timeout))
        # Subscriptions die with a connection: make them again on the new one.
        inbox = self._inbox
        for tenant, params in list(inbox.subs.items()):
            with inbox.subscribing_to(tenant, again=True):
                resp = self._exchange(stream, calls.SUBSCRIBE.wire, params)
                if resp.error is not None:
                    stream.close()
                    raise from_wire(resp.error)
            inbox.subscribed(tenant, params, resp.result)
        if inbox.alerts_on:
            resp = self._exchange(stream, calls.SUBSCRIBE_ALERTS.wire, [])
            if resp.error is not None:
                stream.close()
                raise from_wire(resp.error)
        return stream

    def _exchange(self, stream: Stream, method: str, params: list[Any]) -> Response:
        return stream.exchange(method, params)

    def call(self, method: str, *params: Any) -> Any:
        """Call ``method`` with positional ``params``; return its result or raise.

        One attempt, sent as given (no request id is added, nothing is retried)."""
        return result(self._exchange(self._ensure(), method, list(params)))

    def _invoke(self, method: str, params: list[Any], retry_unanswered: bool) -> Any:
        """Call with retries. ``retry_unanswered``: the call may be sent again after it got
        no answer (it is a read, idempotent, or carries request ids)."""
        start = time.monotonic()
        backoff: Backoff | None = None
        while True:
            try:
                stream = self._ensure()
            except Unavailable as exc:  # not sent: always safe to try again
                err = exc
            else:
                try:
                    resp = self._exchange(stream, method, params)
                except Unavailable as exc:  # sent, no answer
                    if not retry_unanswered:
                        raise
                    err = exc
                else:
                    if resp.error is None:
                        return resp.result
                    err = unavailable(resp.error)  # the node counted nothing
            backoff = self._again(err, backoff, start)
            time.sleep(backoff.pause(err))

    def _run(self, method: Method[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Call a typed method of the table with these arguments, with retries."""
        call = method.prepare(self.auto_ids, *args, **kwargs)
        return call.answer(self._invoke(call.method, call.params, call.resend))

    def pipeline(self, calls: Iterable[Call], *, return_exceptions: bool = False) -> list[Any]:
        """Send every ``(method, params)`` in one write, then collect all the answers.

        Results come back in call order. An error raises the first failing call's exception
        (after all answers are read, so the connection stays usable), or with
        ``return_exceptions=True`` is returned in its place. One attempt, sent as given: no
        request ids are added and nothing is retried.
        """
        stream = self._ensure()
        batch = [(stream.next_msgid(), method, list(params)) for method, params in calls]
        if not batch:
            return []
        stream.send(self._encoder.requests(batch))
        got = stream.collect({msgid for msgid, _, _ in batch})
        return results((got[msgid] for msgid, _, _ in batch), return_exceptions)

    # -- methods (the table's: meter/client/calls.py) --------------------------------------

    def track(
        self, tenant: str, feature: str, qty: int = 1, *, id: str | None = None, **opts: Any
    ) -> int | None:
        """Add ``qty``; the new total, or None if counted but the total is not known yet.

        ``id``: the request id (default: a fresh one, unless ``auto_ids`` is off)."""
        return self._run(calls.TRACK, tenant, feature, qty, id, opts)

    def track_many(self, items: Iterable[TrackItem]) -> list[int | MeterError | None]:
        """Count every ``(tenant, feature, qty)`` or ``(tenant, feature, qty, id)`` item in
        one call (current period; at most 10 000 items).

        Returns one entry per item, in order: the new total, None (counted, total not known
        yet), or the item's error as an exception object (e.g. InvalidArgument, Conflict),
        which is returned, not raised; the other items are still counted. An error of the
        whole call (e.g. a malformed item) is raised. Items without an id get a fresh one
        unless ``auto_ids`` is off."""
        return self._run(calls.TRACK_MANY, items)

    def usage(self, tenant: str, feature: str, **opts: Any) -> int:
        """The counter's value in the current period (or the one containing ``at=``)."""
        return self._run(calls.USAGE, tenant, feature, opts)

    def usage_by(
        self, tenant: str, feature: str, group_by: Sequence[str], **opts: Any
    ) -> dict[str, Any]:
        """The counter's value summed by the values of the dimensions ``group_by``:
        ``{"total": n, "groups": [{"dims": {name: value or None}, "value": n}, ...]}``, the
        groups adding up to the total (docs/dimensions.md)."""
        return self._run(calls.USAGE_BY, tenant, feature, group_by, opts)

    def usage_all(self, tenant: str, **opts: Any) -> dict[str, int]:
        """Every feature's value for ``tenant`` in the period."""
        return self._run(calls.USAGE_ALL, tenant, opts)

    def usage_children_page(
        self,
        account: str,
        feature: str,
        at: float | None = None,
        cursor: str | None = None,
        limit: int | None = None,
    ) -> dict[str, Any]:
        """One page of ``account``'s users' counters of ``feature`` in the period holding
        ``at`` (default now): ``{total, children: [{tenant, value}], cursor}``; ``total`` is
        the account's own counter (tenant_hierarchy)."""
        return self._run(calls.USAGE_CHILDREN_PAGE, account, feature, at, cursor, limit)

    def usage_children(
        self, account: str, feature: str, at: float | None = None, page_size: int = 100
    ) -> Iterator[dict[str, Any]]:
        """Every user of ``account`` with its value (``{tenant, value}``), page by page."""
        cursor: str | None = None
        at = time.time() if at is None else at  # (every page of the same period)
        while True:
            page = self.usage_children_page(account, feature, at, cursor, page_size)
            yield from page["children"]
            cursor = page["cursor"]
            if cursor is None:
                return

    def history(
        self,
        tenant: str,
        feature: str,
        first: str | None = None,
        last: str | None = None,
        granularity: str = "day",
        *,
        where: Mapping[str, str] | None = None,
    ) -> list[tuple[str, int]]:
        """The counter's units per UTC day (``YYYY-MM-DD``) or month (``YYYY-MM``) from
        ``first`` to ``last``, oldest first, zero-filled; the current period's bucket agrees
        with :meth:`usage` (docs/history.md). Defaults: the last 30 days / 12 months."""
        return self._run(calls.HISTORY, tenant, feature, first, last, granularity, where)

    def reserve(
        self,
        tenant: str,
        feature: str,
        qty: int,
        limit: int | None = None,
        ttl_ms: int | None = None,
        *,
        at: float | None = None,
        id: str | None = None,
        dims: dict[str, str] | None = None,
    ) -> str:
        """Hold ``qty`` against ``limit``; returns a reservation id (LimitExceeded if over).

        ``id``: the request id (default: a fresh one, unless ``auto_ids`` is off); ``dims``:
        the dimensions its commit counts on too (docs/dimensions.md)."""
        return self._run(calls.RESERVE, tenant, feature, qty, limit, ttl_ms, at, id, dims)

    def commit(
        self, reservation_id: str, actual_qty: int | None = None, *, id: str | None = None
    ) -> int:
        """Turn a reservation into usage (optionally a different quantity); the new total."""
        return self._run(calls.COMMIT, reservation_id, actual_qty, id)

    def release(self, reservation_id: str, *, id: str | None = None) -> None:
        """Drop a reservation without counting it."""
        self._run(calls.RELEASE, reservation_id, id)

    def close_period(self, period: str, node: str) -> dict[str, Any]:
        """Close ``period`` for ``node``, a node that will never come back (an operator's
        close, docs/invoicing.md): ``{period, node, state, by, at}`` as stored."""
        return self._run(calls.CLOSE_PERIOD, period, node)

    def void(self, call_id: str, *, id: str | None = None) -> dict[str, Any]:
        """Take back the call counted under request id ``call_id`` (a track, a track_many
        item or a commit), on every counter it counted on: ``{"voided": units taken back
        now (0: taken back before), "value": the feature's total after}``, and
        ``"credits"`` given back if the call spent any."""
        return self._run(calls.VOID, call_id, id)

    def ping(self) -> str:
        """``"pong"``."""
        return self._run(calls.PING)

    def status(self) -> dict[str, Any]:
        """The node's status map."""
        return self._run(calls.STATUS)

    def subscribe(
        self, tenant: str, features: Iterable[str] | None = None, *, timeout: float | None = None
    ) -> Iterator[Usage]:
        """Watch ``tenant``'s counters (``features``, default all): an iterator of
        :class:`Usage`, first each watched counter's value now, then one item per change
        (at most one per counter per node tick, the latest value). Each step waits up to
        ``timeout`` seconds (None: for ever); the iteration ends when one waited in vain.
        The client re-subscribes after a reconnect (the values then are delivered again)."""
        call = calls.SUBSCRIBE.prepare(self.auto_ids, tenant, features)
        with self._inbox.subscribing_to(tenant):
            items = call.answer(self._invoke(call.method, call.params, call.resend))
        self._inbox.subscribed(tenant, call.params, items)
        return _until_none(lambda: self.next_usage(tenant, timeout))

    def next_usage(self, tenant: str, timeout: float | None = None) -> Usage | None:
        """The next notification of a subscribed ``tenant``, waiting up to ``timeout`` seconds
        (None: for ever); None if none came in time or the tenant is not subscribed. A lost
        connection is reopened (and the subscriptions made again) within ``retry_timeout``."""
        inbox = self._inbox
        return self._wait_for(
            lambda: inbox.take(tenant),
            lambda: tenant in inbox.subs,
            # (a reconnection delivers the values then: take them)
            lambda: tenant in inbox.subs and bool(inbox.notes.get(tenant)),
            timeout,
        )

    def unsubscribe(self, tenant: str) -> bool:
        """Stop watching ``tenant``; whether it was watched (by this connection)."""
        self._inbox.unsubscribed(tenant)
        return self._run(calls.UNSUBSCRIBE, tenant)

    def subscribe_alerts(self, *, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """Get every threshold alert the node delivers from now on (docs/quotas.md): an
        iterator of alert maps ``{id, tenant, feature, period, threshold, threshold_units,
        limit, value, node, at}``. Each step waits up to ``timeout`` seconds (None: for
        ever); the iteration ends when one waited in vain. Made again after a reconnect
        (alerts delivered while the client was away are not sent)."""
        with self._inbox.subscribing_alerts():
            self._run(calls.SUBSCRIBE_ALERTS)
        return _until_none(lambda: self.next_alert(timeout))

    def next_alert(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next alert (after :meth:`subscribe_alerts`), waiting up to ``timeout``
        seconds (None: for ever); None if none came in time or alerts are not subscribed."""
        inbox = self._inbox
        return self._wait_for(
            inbox.take_alert, lambda: inbox.alerts_on, lambda: bool(inbox.alerts), timeout
        )

    def _wait_for(
        self,
        take: Callable[[], T | None],
        active: Callable[[], bool],
        ready: Callable[[], bool],
        timeout: float | None,
    ) -> T | None:
        """What ``take`` finds in the inbox, reading what the node sends for up to
        ``timeout`` seconds while ``active``; ``ready``: something to take came with a
        reconnection. A lost connection is reopened within ``retry_timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        backoff: Backoff | None = None
        while True:
            item = take()
            if item is not None or not active():
                return item
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            try:
                stream = self._ensure()
                if ready():
                    continue
                if not stream.read_notes(left):
                    return None
                backoff = None
            except Unavailable as exc:
                backoff = self._again(exc, backoff)
                pause = backoff.pause(exc)
                time.sleep(pause if left is None else min(pause, left))

    def unsubscribe_alerts(self) -> bool:
        """Stop getting alerts (those unread are dropped); whether they were subscribed."""
        self._inbox.unsubscribed_alerts()
        return self._run(calls.UNSUBSCRIBE_ALERTS)

    def export_page(
        self, period: str, cursor: str | None = None, limit: int | None = None
    ) -> tuple[list[ExportRow], str | None]:
        """One page of ``period``'s stored counters (every tenant) and the cursor of the next
        (``None`` after the last). A page may be short, even empty, before the last."""
        return self._run(calls.EXPORT_PAGE, period, cursor, limit)

    def export_state(self, period: str) -> dict[str, Any]:
        """Whether ``period``'s export is final, and if not which nodes are still open:
        ``{final, open_nodes, closed_nodes, closed_by_operator, nodes, closes_at, read_at}``
        (docs/invoicing.md)."""
        return self._run(calls.EXPORT_STATE, period)

    def export(self, period: str, limit: int | None = None) -> Iterator[ExportRow]:
        """Every stored counter of ``period``, a page (``limit`` rows) at a time."""
        cursor: str | None = None
        while True:
            rows, cursor = self.export_page(period, cursor, limit)
            yield from rows
            if cursor is None:
                return

    # -- limits (docs/quotas.md) ------------------------------------------------------------

    def track_detail(
        self, tenant: str, feature: str, qty: int = 1, *, id: str | None = None, **opts: Any
    ) -> dict[str, Any]:
        """Add ``qty`` as :meth:`track` does and answer the :meth:`check` map after counting
        (``{allowed, value, limit, remaining, kind, source, over}``)."""
        return self._run(calls.TRACK_DETAIL, tenant, feature, qty, id, opts)

    def check(self, tenant: str, feature: str, qty: int = 1, **opts: Any) -> dict[str, Any]:
        """Whether ``qty`` more units would be counted, without counting them:
        ``{allowed, value, limit, remaining, kind, source, over}``."""
        return self._run(calls.CHECK, tenant, feature, qty, opts)

    def set_plan(self, name: str, features: Mapping[str, Mapping[str, Any]]) -> int:
        """Create or replace plan ``name``: ``{feature: {limit, kind, enforcement}}``;
        returns the limits' new version."""
        return self._run(calls.SET_PLAN, name, features)

    def assign_plan(
        self, tenant: str, plan: str | None, opts: Mapping[str, Any] | None = None
    ) -> int:
        """Put ``tenant`` on ``plan`` (``None``: on none); the limits' new version. ``opts``
        ``{anchor_day, anchor_time, tz, effective}`` sets its billing cycle (docs/periods.md)."""
        return self._run(calls.ASSIGN_PLAN, tenant, plan, opts)

    def set_limit(
        self,
        tenant: str,
        feature: str,
        limit: int | None,
        kind: str = "hard",
        enforcement: str = "fast",
        alerts: Sequence[int] | None = None,
        *,
        where: Mapping[str, str] | None = None,
        price: int | None = None,
    ) -> int:
        """Override ``tenant``'s limit on ``feature`` (``alerts``: threshold percentages;
        ``price``: credits a unit, ``limit`` then optional, docs/ledger.md); the limits' new
        version."""
        return self._run(
            calls.SET_LIMIT, tenant, feature, limit, kind, enforcement, alerts, where, price
        )

    def clear_limit(
        self, tenant: str, feature: str, *, where: Mapping[str, str] | None = None
    ) -> int:
        """Remove ``tenant``'s override on ``feature``; the limits' new version."""
        return self._run(calls.CLEAR_LIMIT, tenant, feature, where)

    def set_feature(
        self,
        feature: str,
        *,
        aggregation: str | None = None,
        dimensions: Sequence[str] | None = None,
        max_combinations: int | None = None,
    ) -> dict[str, Any]:
        """Declare ``feature`` fleet-wide (docs/dimensions.md): its aggregation, the dimension
        names a call may give, the bound on its dimension counters; the declaration stored."""
        return self._run(calls.SET_FEATURE, feature, aggregation, dimensions, max_combinations)

    def get_feature(self, feature: str) -> dict[str, Any]:
        """How ``feature`` is declared (``declared`` false: a sum without dimensions)."""
        return self._run(calls.GET_FEATURE, feature)

    def limits(self, tenant: str) -> dict[str, Any]:
        """``{tenant, plan, version, limits: {feature: {limit, kind, enforcement, source}}}``."""
        return self._run(calls.LIMITS, tenant)


def _until_none(step: Callable[[], T | None]) -> Iterator[T]:
    """What ``step`` gives, until it gives ``None``."""
    while True:
        item = step()
        if item is None:
            return
        yield item
