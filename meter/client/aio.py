"""The asyncio client: :class:`AsyncClient`, one Unix socket connection any number of
tasks call through at once. Its typed methods are the table's (:mod:`meter.client.calls`);
this module holds the transport (:class:`_ClientProtocol`), the retry loop that sends them,
and the subscriptions' iterators.

Why one module: the protocol object and the client share one connection's state (pending
futures, the inbox, the reconnection that makes subscriptions again); the rest is one line
per method of the table, as in the blocking client."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, ParamSpec, TypeVar, cast

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
from meter.core.protocol import (
    DEFAULT_MAX_FRAME,
    MSGID_MAX,
    Decoder,
    Encoder,
    Notification,
    ProtocolError,
    Response,
)
from meter.errors import MeterError, Unavailable
from storage.base import ExportRow

P = ParamSpec("P")
T = TypeVar("T")


class _ClientProtocol(asyncio.Protocol):
    def __init__(self, max_frame: int, inbox: Inbox | None = None) -> None:
        self.decoder = Decoder(side="client", max_frame=max_frame)
        self.inbox = Inbox() if inbox is None else inbox
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, asyncio.Future[Response]] = {}
        self.lost: Unavailable | None = None
        self._drain_waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            responses = self.decoder.feed(data)
        except ProtocolError as exc:
            responses = exc.messages
            self._fail(Unavailable(f"bad data from the node: {exc}"))
            if self.transport is not None:
                self.transport.abort()
        pending = self.pending
        noted = False
        for resp in responses:
            if type(resp) is Notification:
                self.inbox.add(resp.params, resp.method)
                noted = True
                continue
            fut = pending.pop(cast(Response, resp).msgid, None)
            if fut is not None and not fut.done():
                fut.set_result(cast(Response, resp))
        if noted:
            self.inbox.wake()

    def eof_received(self) -> bool:
        self._fail(Unavailable("the node closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        why = f": {exc}" if exc is not None else ""
        self._fail(Unavailable(f"connection to the node lost{why}"))
        self.transport = None
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, err: Unavailable) -> None:
        if self.lost is None:
            self.lost = err
            self.inbox.wake()  # an iterator waiting for notifications reconnects
        pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(Unavailable(err.message))

    def pause_writing(self) -> None:
        self._drain_waiter = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def drain(self) -> None:
        waiter = self._drain_waiter
        if waiter is not None:
            await waiter


async def _connect_async(
    path: str, max_frame: int, inbox: Inbox | None = None
) -> tuple[asyncio.Transport, _ClientProtocol]:
    loop = asyncio.get_running_loop()
    try:
        transport, protocol = await loop.create_unix_connection(
            lambda: _ClientProtocol(max_frame, inbox), path
        )
    except OSError as exc:
        raise Unavailable(f"cannot connect to {path}: {exc}") from None
    return transport, protocol


class _Ledger:
    """The credits ledger's methods of :class:`AsyncClient` (docs/ledger.md): a part of its own, so
    the client class stays a size one can read."""

    async def _run(self, method: Method[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        raise NotImplementedError  # (the client's own)

    async def grant(
        self,
        tenant: str,
        amount: int,
        *,
        ref: str | None = None,
        expires_at: int | None = None,
        priority: int | None = None,
    ) -> dict[str, Any]:
        """As :meth:`Client.grant`."""
        return await self._run(calls.GRANT, tenant, amount, ref, expires_at, priority)

    async def debit(self, tenant: str, amount: int, *, ref: str | None = None) -> dict[str, Any]:
        """As :meth:`Client.debit`."""
        return await self._run(calls.DEBIT, tenant, amount, ref)

    async def balance(self, tenant: str) -> dict[str, Any]:
        """As :meth:`Client.balance`."""
        return await self._run(calls.BALANCE, tenant)

    async def ledger_page(
        self, tenant: str, after: int | None = None, limit: int | None = None
    ) -> dict[str, Any]:
        """As :meth:`Client.ledger_page`."""
        return await self._run(calls.LEDGER_PAGE, tenant, after, limit)

    async def ledger_entries(
        self, tenant: str, page_size: int = 100
    ) -> AsyncIterator[dict[str, Any]]:
        """As :meth:`Client.ledger_entries`."""
        after: int | None = None
        while True:
            page = await self.ledger_page(tenant, after, page_size)
            for entry in page["entries"]:
                yield entry
            after = page["cursor"]
            if after is None:
                return

    async def ledger_timeline_page(
        self,
        start: float | None = None,
        end: float | None = None,
        cursor: str | None = None,
        limit: int | None = None,
    ) -> dict[str, Any]:
        """As :meth:`Client.ledger_timeline_page`."""
        return await self._run(calls.LEDGER_TIMELINE_PAGE, start, end, cursor, limit)

    async def ledger_timeline(
        self, start: float | None = None, end: float | None = None, page_size: int = 100
    ) -> AsyncIterator[dict[str, Any]]:
        """As :meth:`Client.ledger_timeline`."""
        cursor: str | None = None
        # (one range for every page; the node stamps an entry to the nearest millisecond)
        end = time.time() + 0.001 if end is None else end
        while True:
            page = await self.ledger_timeline_page(start, end, cursor, page_size)
            for entry in page["entries"]:
                yield entry
            cursor = page["cursor"]
            if cursor is None:
                return


class AsyncClient(_Ledger, Retrying):
    """An asyncio client over one connection (re-opened after a failure when the client
    knows its socket path, as one made by :meth:`connect` does); any number of calls may
    run concurrently.

    Why one class: it is the node's method list as one object a caller holds (one typed
    wrapper per wire method, each a line that calls the shared table in
    :mod:`meter.client.calls`) over one connection's transport; splitting the wrappers off
    would give callers two objects for one connection."""

    def __init__(
        self,
        transport: asyncio.Transport,
        protocol: _ClientProtocol,
        *,
        timeout: float | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        auto_ids: bool = True,
        retry_timeout: float = DEFAULT_RETRY_TIMEOUT,
        path: str | os.PathLike[str] | None = None,
    ) -> None:
        """``path`` is where to reconnect after a failure; without it a failed connection
        stays failed and nothing is retried."""
        self._transport = transport
        self._protocol = protocol
        self._encoder = Encoder()
        self._next = 0
        self._max_frame = max_frame
        self._path = os.fspath(path) if path is not None else None
        self._closed = False
        self._reconnecting = asyncio.Lock()
        #: Seconds each attempt waits for its answer (None: no bound).
        self.timeout = timeout
        self.auto_ids = auto_ids
        self.retry_timeout = retry_timeout

    @classmethod
    async def connect(
        cls,
        path: str | os.PathLike[str],
        *,
        timeout: float | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
        auto_ids: bool = True,
        retry_timeout: float = DEFAULT_RETRY_TIMEOUT,
    ) -> AsyncClient:
        """Connect to the node on ``path`` (not retried: raises Unavailable if it cannot);
        ``timeout`` bounds each attempt's wait for an answer (None: no bound);
        ``retry_timeout`` and ``auto_ids``: see :mod:`meter.client`."""
        transport, protocol = await _connect_async(os.fspath(path), max_frame)
        return cls(
            transport,
            protocol,
            timeout=timeout,
            max_frame=max_frame,
            auto_ids=auto_ids,
            retry_timeout=retry_timeout,
            path=path,
        )

    async def close(self) -> None:
        """Close the connection; calls still waiting raise Unavailable. The client cannot be
        used afterwards."""
        self._closed = True
        self._transport.close()
        self._protocol._fail(Unavailable("the client was closed"))

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def _usable(self) -> _ClientProtocol | None:
        proto = self._protocol
        if self._closed:
            raise Unavailable("the client is closed")
        if proto.lost is None and proto.transport is not None and not proto.transport.is_closing():
            return proto
        return None

    async def _ensure(self) -> _ClientProtocol:
        """The open connection, reconnecting to the socket path if it was lost (one
        reconnection for any number of concurrent calls)."""
        proto = self._usable()
        if proto is not None:
            return proto
        if self._path is None:
            lost = self._protocol.lost
            raise Unavailable(lost.message if lost is not None else "the connection is closed")
        proto_inbox = self._protocol.inbox
        async with self._reconnecting:
            proto = self._usable()
            if proto is not None:
                return proto
            transport, proto = await _connect_async(self._path, self._max_frame, proto_inbox)
            if self._closed:
                transport.close()
                raise Unavailable("the client is closed")
            self._transport.close()
            self._transport, self._protocol = transport, proto
            # Subscriptions die with a connection: make them again on the new one.
            for tenant, params in list(proto_inbox.subs.items()):
                try:
                    with proto_inbox.subscribing_to(tenant, again=True):
                        items = result(await self._exchange(proto, calls.SUBSCRIBE.wire, params))
                except BaseException:
                    transport.close()
                    raise
                proto_inbox.subscribed(tenant, params, items)
            if proto_inbox.alerts_on:
                try:
                    result(await self._exchange(proto, calls.SUBSCRIBE_ALERTS.wire, []))
                except BaseException:
                    transport.close()
                    raise
            return proto

    def _register(self, proto: _ClientProtocol) -> tuple[int, asyncio.Future[Response]]:
        if proto.lost is not None:
            raise Unavailable(proto.lost.message)
        pending = proto.pending
        msgid = self._next
        # After a wrap-around, skip ids whose (very slow) call is still waiting.
        while msgid in pending:
            msgid = (msgid + 1) & MSGID_MAX
        self._next = (msgid + 1) & MSGID_MAX
        fut: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        pending[msgid] = fut
        return msgid, fut

    async def _wait(
        self, proto: _ClientProtocol, msgid: int, fut: asyncio.Future[Response]
    ) -> Response:
        try:
            if self.timeout is None:
                return await fut
            return await asyncio.wait_for(fut, self.timeout)
        except TimeoutError:
            # The node may still apply it; the typed methods send it again with the same
            # request id, which the node counts once.
            raise Unavailable(
                f"no answer within {self.timeout}s (the request may have been applied; "
                "sent again with the same request id it is counted once)"
            ) from None
        finally:
            proto.pending.pop(msgid, None)

    async def _exchange(self, proto: _ClientProtocol, method: str, params: list[Any]) -> Response:
        msgid, fut = self._register(proto)
        transport = proto.transport
        try:
            data = self._encoder.request(msgid, method, params)
            if transport is None:
                raise Unavailable("connection to the node lost")
        except BaseException:
            proto.pending.pop(msgid, None)
            raise
        transport.write(data)
        await proto.drain()
        return await self._wait(proto, msgid, fut)

    async def call(self, method: str, *params: Any) -> Any:
        """Call ``method`` with positional ``params``; return its result or raise.

        One attempt, sent as given (no request id is added, nothing is retried)."""
        return result(await self._exchange(await self._ensure(), method, list(params)))

    async def _invoke(self, method: str, params: list[Any], retry_unanswered: bool) -> Any:
        """Call with retries; as :meth:`Client._invoke`."""
        start = time.monotonic()
        backoff: Backoff | None = None
        while True:
            try:
                proto = await self._ensure()
            except Unavailable as exc:  # not sent: always safe to try again
                err = exc
            else:
                try:
                    resp = await self._exchange(proto, method, params)
                except Unavailable as exc:  # sent, no answer
                    if not retry_unanswered:
                        raise
                    err = exc
                else:
                    if resp.error is None:
                        return resp.result
                    err = unavailable(resp.error)  # the node counted nothing
            backoff = self._again(err, backoff, start)
            await asyncio.sleep(backoff.pause(err))

    async def _run(self, method: Method[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Call a typed method of the table with these arguments, with retries."""
        call = method.prepare(self.auto_ids, *args, **kwargs)
        return call.answer(await self._invoke(call.method, call.params, call.resend))

    async def pipeline(
        self, calls: Iterable[Call], *, return_exceptions: bool = False
    ) -> list[Any]:
        """Send every ``(method, params)`` in one write and gather the answers in call order.

        An error raises the first failing call's exception once all answers are in, or with
        ``return_exceptions=True`` is returned in its place. One attempt, sent as given: no
        request ids are added and nothing is retried.
        """
        calls = list(calls)
        if not calls:
            return []
        proto = await self._ensure()
        batch: list[tuple[int, str, list[Any]]] = []
        futs: list[tuple[int, asyncio.Future[Response]]] = []
        transport = proto.transport
        try:
            for method, params in calls:
                msgid, fut = self._register(proto)
                futs.append((msgid, fut))
                batch.append((msgid, method, list(params)))
            data = self._encoder.requests(batch)
            if transport is None:
                raise Unavailable("connection to the node lost")
        except BaseException:
            for msgid, _ in futs:
                proto.pending.pop(msgid, None)
            raise
        transport.write(data)
        await proto.drain()
        answers = [await self._wait(proto, msgid, fut) for msgid, fut in futs]
        return results(answers, return_exceptions)

    # -- methods (the table's: meter/client/calls.py) --------------------------------------

    async def track(
        self, tenant: str, feature: str, qty: int = 1, *, id: str | None = None, **opts: Any
    ) -> int | None:
        """Add ``qty``; the new total, or None if counted but the total is not known yet.

        ``id``: the request id (default: a fresh one, unless ``auto_ids`` is off)."""
        return await self._run(calls.TRACK, tenant, feature, qty, id, opts)

    async def track_many(self, items: Iterable[TrackItem]) -> list[int | MeterError | None]:
        """Count many items in one call; as :meth:`Client.track_many` (an item's error is
        returned in its place as an exception object, not raised)."""
        return await self._run(calls.TRACK_MANY, items)

    async def usage(self, tenant: str, feature: str, **opts: Any) -> int:
        """The counter's value in the current period (or the one containing ``at=``)."""
        return await self._run(calls.USAGE, tenant, feature, opts)

    async def usage_by(
        self, tenant: str, feature: str, group_by: Sequence[str], **opts: Any
    ) -> dict[str, Any]:
        """As :meth:`Client.usage_by`."""
        return await self._run(calls.USAGE_BY, tenant, feature, group_by, opts)

    async def usage_all(self, tenant: str, **opts: Any) -> dict[str, int]:
        """Every feature's value for ``tenant`` in the period."""
        return await self._run(calls.USAGE_ALL, tenant, opts)

    async def usage_children_page(
        self,
        account: str,
        feature: str,
        at: float | None = None,
        cursor: str | None = None,
        limit: int | None = None,
    ) -> dict[str, Any]:
        """As :meth:`Client.usage_children_page`."""
        return await self._run(calls.USAGE_CHILDREN_PAGE, account, feature, at, cursor, limit)

    async def usage_children(
        self, account: str, feature: str, at: float | None = None, page_size: int = 100
    ) -> AsyncIterator[dict[str, Any]]:
        """As :meth:`Client.usage_children`."""
        cursor: str | None = None
        at = time.time() if at is None else at  # (every page of the same period)
        while True:
            page = await self.usage_children_page(account, feature, at, cursor, page_size)
            for child in page["children"]:
                yield child
            cursor = page["cursor"]
            if cursor is None:
                return

    async def history(
        self,
        tenant: str,
        feature: str,
        first: str | None = None,
        last: str | None = None,
        granularity: str = "day",
        *,
        where: Mapping[str, str] | None = None,
    ) -> list[tuple[str, int]]:
        """As :meth:`Client.history`."""
        return await self._run(calls.HISTORY, tenant, feature, first, last, granularity, where)

    async def reserve(
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
        return await self._run(calls.RESERVE, tenant, feature, qty, limit, ttl_ms, at, id, dims)

    async def commit(
        self, reservation_id: str, actual_qty: int | None = None, *, id: str | None = None
    ) -> int:
        """Turn a reservation into usage (optionally a different quantity); the new total."""
        return await self._run(calls.COMMIT, reservation_id, actual_qty, id)

    async def release(self, reservation_id: str, *, id: str | None = None) -> None:
        """Drop a reservation without counting it."""
        await self._run(calls.RELEASE, reservation_id, id)

    async def close_period(self, period: str, node: str) -> dict[str, Any]:
        """Close ``period`` for ``node``, a node that will never come back (an operator's
        close, docs/invoicing.md): ``{period, node, state, by, at}`` as stored."""
        return await self._run(calls.CLOSE_PERIOD, period, node)

    async def void(self, call_id: str, *, id: str | None = None) -> dict[str, Any]:
        """Take back the call counted under request id ``call_id`` (a track, a track_many
        item or a commit), on every counter it counted on: ``{"voided": units taken back
        now (0: taken back before), "value": the feature's total after}``, and
        ``"credits"`` given back if the call spent any."""
        return await self._run(calls.VOID, call_id, id)

    async def ping(self) -> str:
        """``"pong"``."""
        return await self._run(calls.PING)

    async def status(self) -> dict[str, Any]:
        """The node's status map."""
        return await self._run(calls.STATUS)

    @property
    def dropped_notifications(self) -> int:
        """Notifications dropped because they were not read (more than MAX_BUFFERED)."""
        return self._protocol.inbox.dropped

    async def subscribe(
        self, tenant: str, features: Iterable[str] | None = None
    ) -> AsyncIterator[Usage]:
        """Watch ``tenant``'s counters (``features``, default all): an async iterator of
        :class:`Usage`, first each watched counter's value now, then one item per change
        (at most one per counter per node tick, the latest value). It ends when the tenant
        is unsubscribed or the client closed; a lost connection is reopened (and the
        subscriptions made again, their values delivered again) within ``retry_timeout``,
        else :class:`~meter.errors.Unavailable` is raised."""
        call = calls.SUBSCRIBE.prepare(self.auto_ids, tenant, features)
        inbox = self._protocol.inbox  # (a reconnection keeps it)
        with inbox.subscribing_to(tenant):
            items = call.answer(await self._invoke(call.method, call.params, call.resend))
        _watched(inbox)
        inbox.subscribed(tenant, call.params, items)
        return self._drain_inbox(inbox, lambda: inbox.take(tenant), lambda: tenant in inbox.subs)

    async def _drain_inbox(
        self, inbox: Inbox, take: Callable[[], T | None], active: Callable[[], bool]
    ) -> AsyncIterator[T]:
        """Yield what ``take`` finds in the inbox as notifications arrive, while ``active``
        and the client open; a lost connection is reopened (subscriptions made again) within
        ``retry_timeout``, else :class:`~meter.errors.Unavailable` is raised."""
        event = inbox.event
        assert event is not None
        backoff: Backoff | None = None
        while True:
            item = take()
            if item is not None:
                yield item
                continue
            if not active() or self._closed:
                return
            if self._usable() is None:
                try:
                    await self._ensure()
                    backoff = None
                except Unavailable as exc:
                    backoff = self._again(exc, backoff)
                    await asyncio.sleep(backoff.pause(exc))
                continue
            event.clear()
            await event.wait()

    async def unsubscribe(self, tenant: str) -> bool:
        """Stop watching ``tenant`` (its iterators end); whether it was watched."""
        self._protocol.inbox.unsubscribed(tenant)
        return await self._run(calls.UNSUBSCRIBE, tenant)

    async def subscribe_alerts(self) -> AsyncIterator[dict[str, Any]]:
        """As :meth:`Client.subscribe_alerts`: an async iterator of alert maps; it ends when
        alerts are unsubscribed or the client closed; a lost connection is reopened (and the
        subscription made again) within ``retry_timeout``."""
        inbox = self._protocol.inbox
        with inbox.subscribing_alerts():
            await self._run(calls.SUBSCRIBE_ALERTS)
        _watched(inbox)
        return self._drain_inbox(inbox, inbox.take_alert, lambda: inbox.alerts_on)

    async def unsubscribe_alerts(self) -> bool:
        """Stop getting alerts (the iterators end); whether they were subscribed."""
        self._protocol.inbox.unsubscribed_alerts()
        return await self._run(calls.UNSUBSCRIBE_ALERTS)

    async def export_page(
        self, period: str, cursor: str | None = None, limit: int | None = None
    ) -> tuple[list[ExportRow], str | None]:
        """One page of ``period``'s stored counters (every tenant) and the cursor of the next
        (``None`` after the last). A page may be short, even empty, before the last."""
        return await self._run(calls.EXPORT_PAGE, period, cursor, limit)

    async def export_state(self, period: str) -> dict[str, Any]:
        """Whether ``period``'s export is final, and if not which nodes are still open:
        ``{final, open_nodes, closed_nodes, closed_by_operator, nodes, closes_at, read_at}``
        (docs/invoicing.md)."""
        return await self._run(calls.EXPORT_STATE, period)

    async def export(self, period: str, limit: int | None = None) -> AsyncIterator[ExportRow]:
        """Every stored counter of ``period``, a page (``limit`` rows) at a time."""
        cursor: str | None = None
        while True:
            rows, cursor = await self.export_page(period, cursor, limit)
            for row in rows:
                yield row
            if cursor is None:
                return

    # -- limits (docs/quotas.md) ------------------------------------------------------------

    async def track_detail(
        self, tenant: str, feature: str, qty: int = 1, *, id: str | None = None, **opts: Any
    ) -> dict[str, Any]:
        """As :meth:`Client.track_detail`."""
        return await self._run(calls.TRACK_DETAIL, tenant, feature, qty, id, opts)

    async def check(self, tenant: str, feature: str, qty: int = 1, **opts: Any) -> dict[str, Any]:
        """As :meth:`Client.check`."""
        return await self._run(calls.CHECK, tenant, feature, qty, opts)

    async def set_plan(self, name: str, features: Mapping[str, Mapping[str, Any]]) -> int:
        """As :meth:`Client.set_plan`."""
        return await self._run(calls.SET_PLAN, name, features)

    async def assign_plan(
        self, tenant: str, plan: str | None, opts: Mapping[str, Any] | None = None
    ) -> int:
        """As :meth:`Client.assign_plan`."""
        return await self._run(calls.ASSIGN_PLAN, tenant, plan, opts)

    async def set_limit(
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
        """As :meth:`Client.set_limit`."""
        return await self._run(
            calls.SET_LIMIT, tenant, feature, limit, kind, enforcement, alerts, where, price
        )

    async def clear_limit(
        self, tenant: str, feature: str, *, where: Mapping[str, str] | None = None
    ) -> int:
        """As :meth:`Client.clear_limit`."""
        return await self._run(calls.CLEAR_LIMIT, tenant, feature, where)

    async def set_feature(
        self,
        feature: str,
        *,
        aggregation: str | None = None,
        dimensions: Sequence[str] | None = None,
        max_combinations: int | None = None,
    ) -> dict[str, Any]:
        """As :meth:`Client.set_feature`."""
        return await self._run(
            calls.SET_FEATURE, feature, aggregation, dimensions, max_combinations
        )

    async def get_feature(self, feature: str) -> dict[str, Any]:
        """As :meth:`Client.get_feature`."""
        return await self._run(calls.GET_FEATURE, feature)

    async def limits(self, tenant: str) -> dict[str, Any]:
        """As :meth:`Client.limits`."""
        return await self._run(calls.LIMITS, tenant)


def _watched(inbox: Inbox) -> None:
    """Give ``inbox`` the event its iterators wait on (made with its first subscription)."""
    if inbox.event is None:
        inbox.event = asyncio.Event()
