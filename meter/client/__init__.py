"""Clients for a meter node: :class:`AsyncClient` (asyncio) and :class:`Client` (blocking).

Both speak MessagePack-RPC over the node's Unix socket, pipeline requests (responses are
matched by msgid, so order does not matter), raise the typed exceptions of
:mod:`meter.errors` for error responses, and raise :class:`~meter.errors.Unavailable` when the
connection fails.

Request ids and retries (the contract is in docs/protocol.md, "Request ids and retries"):

- Every mutating call (``track``, ``track_many``, ``reserve``, ``commit``, ``release``) carries
  a request id: a fresh random one per call (:func:`new_request_id`), or the caller's own
  (``id=...``). ``auto_ids=False`` turns the automatic ones off.
- The typed methods retry a call that got no answer (connection lost, timed out, node
  restarting) or was answered ``unavailable``: they reconnect to the same socket path and
  send the call again, with the *same* id, with backoff, until ``retry_timeout`` seconds have
  passed since the call started; then they raise the last :class:`~meter.errors.Unavailable`.
  The node counts a repeated id once, so a retried call is never counted twice.
- A call without an id (``auto_ids=False`` and no ``id=``) that got no answer is not retried
  (``track`` / ``reserve`` / ``track_many`` might have been counted); one answered
  ``unavailable`` is (the node counted nothing). ``commit`` / ``release`` are idempotent by
  reservation id, and reads change nothing, so those are always retried.
- Other errors (``invalid_argument``, ``limit_exceeded``, ``conflict``, ``not_found``, ...) are
  never retried. ``call()`` and ``pipeline()`` make one attempt (reconnecting first if the
  connection was lost) and never add ids. ``connect()`` itself does not retry.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NamedTuple, cast

from meter.core.idempotency import MAX_ID_BYTES
from meter.core.protocol import (
    DEFAULT_MAX_FRAME,
    MSGID_MAX,
    Decoder,
    Encoder,
    Notification,
    ProtocolError,
    Response,
)
from meter.errors import InvalidArgument, MeterError, Unavailable, from_wire

#: Default seconds the blocking client waits for an answer before raising Unavailable.
DEFAULT_TIMEOUT = 30.0
#: Default seconds, counted from the start of a call, during which a typed method keeps
#: retrying a call that got no answer or an ``unavailable`` one (0 disables retries).
DEFAULT_RETRY_TIMEOUT = 30.0
#: First pause between two attempts of a call; it doubles (with jitter) up to the maximum.
RETRY_BACKOFF_MIN = 0.05
RETRY_BACKOFF_MAX = 1.0
#: The longest single wait of a subscription waiting with no end, so Ctrl-C is handled.
SIGNAL_CHECK_S = 0.5
#: A request id is a string of 1 .. this many UTF-8 bytes (the node's limit).
MAX_REQUEST_ID_BYTES = MAX_ID_BYTES

#: Notifications a client keeps per subscribed tenant until they are read; past that the
#: oldest are dropped (counted in ``dropped_notifications``).
MAX_BUFFERED = 10_000

Call = tuple[str, Sequence[Any]]
#: A ``track_many`` item: ``(tenant, feature, qty)`` or ``(tenant, feature, qty, id)``.
TrackItem = tuple[str, str, int] | tuple[str, str, int, str | None]


def new_request_id() -> str:
    """A fresh random request id (22 URL-safe characters, 128 random bits)."""
    return secrets.token_urlsafe(16)


def check_request_id(rid: object) -> str:
    """Return ``rid`` if it is a valid request id (a str of 1..128 UTF-8 bytes), else raise
    InvalidArgument."""
    if not isinstance(rid, str):
        raise InvalidArgument(f"request id must be a string, got {type(rid).__name__}")
    try:
        n = len(rid.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidArgument("request id must be valid UTF-8") from None
    if not 1 <= n <= MAX_REQUEST_ID_BYTES:
        raise InvalidArgument(
            f"request id must be 1 to {MAX_REQUEST_ID_BYTES} UTF-8 bytes, got {n} bytes"
        )
    return rid


def _opts(opts: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in opts.items() if v is not None}


def _with_opts(params: list[Any], opts: dict[str, Any]) -> list[Any]:
    opts = _opts(opts)
    if opts:
        params.append(opts)
    return params


def _history_params(
    tenant: str, feature: str, first: str | None, last: str | None, granularity: str
) -> list[Any]:
    return _with_opts([tenant, feature], {"from": first, "to": last, "granularity": granularity})


def _history_answer(answer: Any) -> list[tuple[str, int]]:
    return [(str(period), int(value)) for period, value in answer]


def _commit(reservation_id: str, actual_qty: int | None, rid: str | None) -> list[Any]:
    if rid is not None:
        return [reservation_id, actual_qty, {"id": rid}]
    return [reservation_id] if actual_qty is None else [reservation_id, actual_qty]


def _release(reservation_id: str, rid: str | None) -> list[Any]:
    return [reservation_id] if rid is None else [reservation_id, {"id": rid}]


def _export_params(period: str, cursor: str | None, limit: int | None) -> list[Any]:
    opts = {k: v for k, v in (("cursor", cursor), ("limit", limit)) if v is not None}
    return [period, opts] if opts else [period]


@dataclass(frozen=True, slots=True, eq=False)
class ExportRow:
    """One stored counter as ``export`` answers it: whose, what, when, and its stored total.

    The client's copy of :class:`storage.base.ExportRow`, which it returned before it stopped
    importing the storage layer: the same fields, and equal to (and hashed as) a storage row
    with the same values, so rows read through a node and rows read from storage compare."""

    tenant: str
    feature: str
    period: str
    total: int

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ExportRow) or _is_storage_row(other):
            return _row_values(self) == _row_values(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(_row_values(self))  # as a frozen dataclass's: its fields' tuple


def _is_storage_row(value: object) -> bool:
    """Whether ``value`` is a :class:`storage.base.ExportRow` (named: not imported here)."""
    cls = type(value)
    return cls.__module__ == "storage.base" and cls.__qualname__ == "ExportRow"


def _row_values(row: Any) -> tuple[str, str, str, int]:
    return (row.tenant, row.feature, row.period, row.total)


def row_from_wire(value: Any) -> ExportRow:
    """An ``export`` answer's row as an :class:`ExportRow` (a str total back to an int)."""
    tenant, feature, period, total = value
    return ExportRow(str(tenant), str(feature), str(period), int(total))


def _export_answer(result: Any) -> tuple[list[ExportRow], str | None]:
    return [row_from_wire(r) for r in result["rows"]], result["cursor"]


def _many_results(result: Any) -> list[int | MeterError | None]:
    """A ``track_many`` answer with each item's error map turned into its exception."""
    return [from_wire(r) if isinstance(r, dict) else r for r in cast(list[Any], result)]


class Usage(NamedTuple):
    """A counter's value as a subscription delivers it (docs/protocol.md, "Live usage")."""

    tenant: str
    feature: str
    value: int
    period: str


class _Inbox:
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
        self.subs.pop(tenant, None)
        self.notes.pop(tenant, None)
        self.held.pop(tenant, None)
        self.wake()

    def add(self, params: Any, method: str = "usage") -> None:
        if method == "alert":  # params: [{id, tenant, ...}]
            ok = type(params) is list and len(params) == 1 and type(params[0]) is dict
            if ok and self.alerts_on:
                if len(self.alerts) >= MAX_BUFFERED:
                    self.alerts.popleft()
                    self.dropped += 1
                self.alerts.append(params[0])
            return
        if type(params) is not list or len(params) != 4:
            return
        queue = self.notes.get(params[0])
        if queue is None:
            held = self.held.get(params[0])
            if held is not None:
                held[1].append(Usage(*params))
            return  # else: not subscribed (any more)
        self._append(queue, params)

    def _append(self, queue: collections.deque[Usage], params: Any) -> None:
        if len(queue) >= MAX_BUFFERED:
            queue.popleft()
            self.dropped += 1
        queue.append(params if type(params) is Usage else Usage(*params))

    def take(self, tenant: str) -> Usage | None:
        queue = self.notes.get(tenant)
        return queue.popleft() if queue else None

    def wake(self) -> None:
        if self.event is not None:
            self.event.set()


def _subscribe_params(tenant: str, features: Iterable[str] | None) -> list[Any]:
    if isinstance(features, str):
        raise InvalidArgument("subscribe: features must be a list of names, not a string")
    named = list(features or ())
    return [tenant, named] if named else [tenant]


class _Backoff:
    """The pauses between the attempts of one call, until ``retry_timeout`` after its start."""

    def __init__(self, start: float, budget: float) -> None:
        self.start = start
        self.deadline = start + budget
        self.attempts = 1
        self._delay = RETRY_BACKOFF_MIN

    def pause(self, err: Unavailable) -> float:
        """Seconds to wait before the next attempt; raises Unavailable once out of time."""
        now = time.monotonic()
        remaining = self.deadline - now
        if remaining <= 0:
            tries = f"{self.attempts} attempt{'s' if self.attempts != 1 else ''}"
            raise Unavailable(
                f"{err.message} (gave up after {tries} in {now - self.start:.1f}s)"
            ) from err
        delay = min(random.uniform(self._delay / 2, self._delay), remaining)
        self._delay = min(self._delay * 2, RETRY_BACKOFF_MAX)
        self.attempts += 1
        return delay


class _Ids:
    """What both clients share: request ids and how mutating calls are built."""

    auto_ids: bool

    def _rid(self, rid: str | None) -> str | None:
        if rid is not None:
            return check_request_id(rid)
        return new_request_id() if self.auto_ids else None

    def _track(
        self, tenant: str, feature: str, qty: int, rid: str | None, opts: dict[str, Any]
    ) -> tuple[list[Any], bool]:
        rid = self._rid(rid)
        opts = _opts(opts)
        if rid is not None:
            opts["id"] = rid
        params = [tenant, feature, qty, opts] if opts else [tenant, feature, qty]
        return params, rid is not None

    def _reserve(
        self, tenant: str, feature: str, qty: int, rid: str | None, opts: dict[str, Any]
    ) -> tuple[list[Any], bool]:
        rid = self._rid(rid)
        return _with_opts([tenant, feature, qty], {**opts, "id": rid}), rid is not None

    def _many(self, items: Iterable[TrackItem]) -> tuple[list[list[Any]], bool]:
        """The wire items, and whether every one of them carries an id."""
        out: list[list[Any]] = []
        all_ids = True
        for item in items:
            seq = cast(Sequence[Any], item)
            if len(seq) not in (3, 4):
                raise InvalidArgument(
                    "track_many: an item is (tenant, feature, qty) or (tenant, feature, qty, "
                    f"id), got {len(seq)} elements"
                )
            rid = self._rid(seq[3] if len(seq) == 4 else None)
            if rid is None:
                all_ids = False
                out.append([seq[0], seq[1], seq[2]])
            else:
                out.append([seq[0], seq[1], seq[2], {"id": rid}])
        return out, all_ids


def _connect(path: str, timeout: float | None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
    except OSError as exc:
        sock.close()
        raise Unavailable(f"cannot connect to {path}: {exc}") from None
    return sock


class Client(_Ids):
    """A blocking client over one connection (re-opened after a failure when the client
    knows its socket path, as one made by :meth:`connect` does). Not thread-safe: one per
    thread."""

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
        self._sock: socket.socket | None = sock
        sock.settimeout(timeout)
        self._timeout = timeout
        self._max_frame = max_frame
        self._path = os.fspath(path) if path is not None else None
        self._closed = False
        self._encoder = Encoder()
        self._decoder = Decoder(side="client", max_frame=max_frame)
        self._next = 0
        self._inbox = _Inbox()
        #: Send a fresh random request id with every mutating call that has none.
        self.auto_ids = auto_ids
        #: Seconds (from a call's start) a typed method keeps retrying; 0 disables retries.
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
        answer; ``retry_timeout`` and ``auto_ids``: see the module docstring."""
        sock = _connect(os.fspath(path), timeout)
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
        self._drop()

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _msgid(self) -> int:
        msgid = self._next
        self._next = (msgid + 1) & MSGID_MAX
        return msgid

    def _broken(self, why: str) -> Unavailable:
        self._drop()
        return Unavailable(f"connection to the node failed: {why}")

    def _ensure(self) -> socket.socket:
        """The open connection, reconnecting to the socket path if the last one failed."""
        if self._sock is not None:
            return self._sock
        if self._closed:
            raise Unavailable("the client is closed")
        if self._path is None:
            raise Unavailable("the connection to the node was lost (no socket path to reconnect)")
        sock = self._sock = _connect(self._path, self._timeout)
        # A fresh stream: bytes of a half-read answer on the old one must not be kept.
        self._decoder = Decoder(side="client", max_frame=self._max_frame)
        # Subscriptions die with a connection: make them again on the new one.
        inbox = self._inbox
        for tenant, params in list(inbox.subs.items()):
            inbox.subscribing(tenant)
            try:
                resp = self._exchange(sock, "subscribe", params)
            except BaseException:
                inbox.not_subscribed(tenant)
                raise
            if resp.error is not None:
                inbox.not_subscribed(tenant)
                self._drop()
                raise from_wire(resp.error)
            inbox.subscribed(tenant, params, resp.result)
        if inbox.alerts_on:
            resp = self._exchange(sock, "subscribe_alerts", [])
            if resp.error is not None:
                self._drop()
                raise from_wire(resp.error)
        return sock

    def _send(self, sock: socket.socket, data: bytes) -> None:
        try:
            sock.sendall(data)
        except OSError as exc:
            raise self._broken(str(exc)) from None

    def _collect(self, sock: socket.socket, wanted: set[int]) -> dict[int, Response]:
        """Read until every msgid in ``wanted`` is answered. A failure (timeouts included)
        closes the connection, so a late answer can never be taken for a later call's."""
        got: dict[int, Response] = {}
        while wanted:
            try:
                data = sock.recv(1 << 18)
            except OSError as exc:
                raise self._broken(str(exc) or type(exc).__name__) from None
            for resp in self._responses(data):
                if resp.msgid in wanted:
                    got[resp.msgid] = resp
                    wanted.discard(resp.msgid)
        return got

    def _responses(self, data: bytes) -> list[Response]:
        """Decode what the node sent: notifications go to the inbox, responses are returned."""
        if not data:
            raise self._broken("the node closed the connection")
        try:
            messages = self._decoder.feed(data)
        except ProtocolError as exc:
            raise self._broken(f"bad data from the node: {exc}") from None
        out: list[Response] = []
        for msg in messages:
            if type(msg) is Notification:
                self._inbox.add(msg.params, msg.method)
            else:
                out.append(cast(Response, msg))
        return out

    def _read_notes(self, sock: socket.socket, timeout: float | None) -> bool:
        """Read what the node sends for up to ``timeout`` seconds (None: until something
        comes); False if nothing came in time.

        A wait with no end is made of waits of at most :data:`SIGNAL_CHECK_S`: a signal
        (Ctrl-C) that arrives just before a blocking ``recv`` is only handled once Python code
        runs again, and compiled code in between never checks for one (``meter watch``)."""
        try:
            while True:
                sock.settimeout(SIGNAL_CHECK_S if timeout is None else timeout)
                try:
                    data = sock.recv(1 << 18)
                    break
                except TimeoutError:
                    if timeout is not None:
                        return False
        except OSError as exc:
            raise self._broken(str(exc) or type(exc).__name__) from None
        finally:
            if self._sock is sock:
                sock.settimeout(self._timeout)
        # (A response now answers a call that timed out: its connection was dropped.)
        self._responses(data)
        return True

    def _exchange(self, sock: socket.socket, method: str, params: list[Any]) -> Response:
        msgid = self._msgid()
        self._send(sock, self._encoder.request(msgid, method, params))
        return self._collect(sock, {msgid})[msgid]

    def call(self, method: str, *params: Any) -> Any:
        """Call ``method`` with positional ``params``; return its result or raise.

        One attempt, sent as given (no request id is added, nothing is retried)."""
        resp = self._exchange(self._ensure(), method, list(params))
        if resp.error is not None:
            raise from_wire(resp.error)
        return resp.result

    def _invoke(self, method: str, params: list[Any], retry_unanswered: bool) -> Any:
        """Call with retries. ``retry_unanswered``: the call may be sent again after it got
        no answer (it is a read, idempotent, or carries request ids)."""
        start = time.monotonic()
        backoff: _Backoff | None = None
        while True:
            try:
                sock = self._ensure()
            except Unavailable as exc:  # not sent: always safe to try again
                err = exc
            else:
                try:
                    resp = self._exchange(sock, method, params)
                except Unavailable as exc:  # sent, no answer
                    if not retry_unanswered:
                        raise
                    err = exc
                else:
                    if resp.error is None:
                        return resp.result
                    answered = from_wire(resp.error)
                    if not isinstance(answered, Unavailable):
                        raise answered
                    err = answered  # the node counted nothing
            if self.retry_timeout <= 0 or self._path is None or self._closed:
                raise err
            if backoff is None:
                backoff = _Backoff(start, self.retry_timeout)
            time.sleep(backoff.pause(err))

    def pipeline(self, calls: Iterable[Call], *, return_exceptions: bool = False) -> list[Any]:
        """Send every ``(method, params)`` in one write, then collect all the answers.

        Results come back in call order. An error raises the first failing call's exception
        (after all answers are read, so the connection stays usable), or with
        ``return_exceptions=True`` is returned in its place. One attempt, sent as given: no
        request ids are added and nothing is retried.
        """
        batch = [(self._msgid(), method, list(params)) for method, params in calls]
        if not batch:
            return []
        sock = self._ensure()
        self._send(sock, self._encoder.requests(batch))
        got = self._collect(sock, {msgid for msgid, _, _ in batch})
        out: list[Any] = []
        first: MeterError | None = None
        for msgid, _, _ in batch:
            resp = got[msgid]
            if resp.error is not None:
                err = from_wire(resp.error)
                first = first or err
                out.append(err)
            else:
                out.append(resp.result)
        if first is not None and not return_exceptions:
            raise first
        return out

    # -- methods --------------------------------------------------------------------------

    def track(
        self, tenant: str, feature: str, qty: int = 1, *, id: str | None = None, **opts: Any
    ) -> int | None:
        """Add ``qty``; the new total, or None if counted but the total is not known yet.

        ``id``: the request id (default: a fresh one, unless ``auto_ids`` is off)."""
        params, has_id = self._track(tenant, feature, qty, id, opts)
        return cast(int | None, self._invoke("track", params, has_id))

    def track_many(self, items: Iterable[TrackItem]) -> list[int | MeterError | None]:
        """Count every ``(tenant, feature, qty)`` or ``(tenant, feature, qty, id)`` item in
        one call (current period; at most 10 000 items).

        Returns one entry per item, in order: the new total, None (counted, total not known
        yet), or the item's error as an exception object (e.g. InvalidArgument, Conflict),
        which is returned, not raised; the other items are still counted. An error of the
        whole call (e.g. a malformed item) is raised. Items without an id get a fresh one
        unless ``auto_ids`` is off."""
        wire, all_ids = self._many(items)
        return _many_results(self._invoke("track_many", [wire], all_ids))

    def usage(self, tenant: str, feature: str, **opts: Any) -> int:
        """The counter's value in the current period (or the one containing ``at=``)."""
        return cast(int, self._invoke("usage", _with_opts([tenant, feature], opts), True))

    def usage_all(self, tenant: str, **opts: Any) -> dict[str, int]:
        """Every feature's value for ``tenant`` in the period."""
        return cast(dict[str, int], self._invoke("usage_all", _with_opts([tenant], opts), True))

    def history(
        self,
        tenant: str,
        feature: str,
        first: str | None = None,
        last: str | None = None,
        granularity: str = "day",
    ) -> list[tuple[str, int]]:
        """The counter's units per UTC day (``YYYY-MM-DD``) or month (``YYYY-MM``) from
        ``first`` to ``last``, oldest first, zero-filled; the current period's bucket agrees
        with :meth:`usage` (docs/history.md). Defaults: the last 30 days / 12 months."""
        params = _history_params(tenant, feature, first, last, granularity)
        return _history_answer(self._invoke("history", params, True))

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
    ) -> str:
        """Hold ``qty`` against ``limit``; returns a reservation id (LimitExceeded if over).

        ``id``: the request id (default: a fresh one, unless ``auto_ids`` is off)."""
        opts = {"limit": limit, "ttl_ms": ttl_ms, "at": at}
        params, has_id = self._reserve(tenant, feature, qty, id, opts)
        return cast(str, self._invoke("reserve", params, has_id))

    def commit(
        self, reservation_id: str, actual_qty: int | None = None, *, id: str | None = None
    ) -> int:
        """Turn a reservation into usage (optionally a different quantity); the new total."""
        params = _commit(reservation_id, actual_qty, self._rid(id))
        return cast(int, self._invoke("commit", params, True))

    def release(self, reservation_id: str, *, id: str | None = None) -> None:
        """Drop a reservation without counting it."""
        self._invoke("release", _release(reservation_id, self._rid(id)), True)

    def ping(self) -> str:
        """``"pong"``."""
        return cast(str, self._invoke("ping", [], True))

    def status(self) -> dict[str, Any]:
        """The node's status map."""
        return cast(dict[str, Any], self._invoke("status", [], True))

    def subscribe(
        self, tenant: str, features: Iterable[str] | None = None, *, timeout: float | None = None
    ) -> Iterator[Usage]:
        """Watch ``tenant``'s counters (``features``, default all): an iterator of
        :class:`Usage`, first each watched counter's value now, then one item per change
        (at most one per counter per node tick, the latest value). Each step waits up to
        ``timeout`` seconds (None: for ever); the iteration ends when one waited in vain.
        The client re-subscribes after a reconnect (the values then are delivered again)."""
        params = _subscribe_params(tenant, features)
        inbox = self._inbox
        fresh = tenant not in inbox.subs
        if fresh:  # before sending: a notification may come in the answer's read
            inbox.subscribing(tenant)
        try:
            items = self._invoke("subscribe", params, True)
        except BaseException:
            if fresh:
                inbox.not_subscribed(tenant)
            raise
        inbox.subscribed(tenant, params, items)
        return self._follow(tenant, timeout)

    def _follow(self, tenant: str, timeout: float | None) -> Iterator[Usage]:
        while True:
            usage = self.next_usage(tenant, timeout)
            if usage is None:
                return
            yield usage

    def next_usage(self, tenant: str, timeout: float | None = None) -> Usage | None:
        """The next notification of a subscribed ``tenant``, waiting up to ``timeout`` seconds
        (None: for ever); None if none came in time or the tenant is not subscribed. A lost
        connection is reopened (and the subscriptions made again) within ``retry_timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        backoff: _Backoff | None = None
        while True:
            usage = self._inbox.take(tenant)
            if usage is not None or tenant not in self._inbox.subs:
                return usage
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            try:
                sock = self._ensure()  # (a reconnection delivers the values then: take them)
                if tenant in self._inbox.subs and self._inbox.notes.get(tenant):
                    continue
                if not self._read_notes(sock, left):
                    return None
                backoff = None
            except Unavailable as exc:
                if self.retry_timeout <= 0 or self._path is None or self._closed:
                    raise
                if backoff is None:
                    backoff = _Backoff(time.monotonic(), self.retry_timeout)
                pause = backoff.pause(exc)
                time.sleep(pause if left is None else min(pause, left))

    def unsubscribe(self, tenant: str) -> bool:
        """Stop watching ``tenant``; whether it was watched (by this connection)."""
        self._inbox.unsubscribed(tenant)
        return cast(bool, self._invoke("unsubscribe", [tenant], True))

    def subscribe_alerts(self, *, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """Get every threshold alert the node delivers from now on (docs/quotas.md): an
        iterator of alert maps ``{id, tenant, feature, period, threshold, threshold_units,
        limit, value, node, at}``. Each step waits up to ``timeout`` seconds (None: for
        ever); the iteration ends when one waited in vain. Made again after a reconnect
        (alerts delivered while the client was away are not sent)."""
        self._inbox.alerts_on = True
        try:
            self._invoke("subscribe_alerts", [], True)
        except BaseException:
            self._inbox.alerts_on = False
            raise
        return self._follow_alerts(timeout)

    def _follow_alerts(self, timeout: float | None) -> Iterator[dict[str, Any]]:
        while True:
            alert = self.next_alert(timeout)
            if alert is None:
                return
            yield alert

    def next_alert(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next alert (after :meth:`subscribe_alerts`), waiting up to ``timeout``
        seconds (None: for ever); None if none came in time or alerts are not subscribed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        backoff: _Backoff | None = None
        inbox = self._inbox
        while True:
            if inbox.alerts:
                return inbox.alerts.popleft()
            if not inbox.alerts_on:
                return None
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            try:
                sock = self._ensure()
                if inbox.alerts:
                    continue
                if not self._read_notes(sock, left):
                    return None
                backoff = None
            except Unavailable as exc:
                if self.retry_timeout <= 0 or self._path is None or self._closed:
                    raise
                if backoff is None:
                    backoff = _Backoff(time.monotonic(), self.retry_timeout)
                pause = backoff.pause(exc)
                time.sleep(pause if left is None else min(pause, left))

    def unsubscribe_alerts(self) -> bool:
        """Stop getting alerts (those unread are dropped); whether they were subscribed."""
        self._inbox.alerts_on = False
        self._inbox.alerts.clear()
        return cast(bool, self._invoke("unsubscribe_alerts", [], True))

    def export_page(
        self, period: str, cursor: str | None = None, limit: int | None = None
    ) -> tuple[list[ExportRow], str | None]:
        """One page of ``period``'s stored counters (every tenant) and the cursor of the next
        (``None`` after the last). A page may be short, even empty, before the last."""
        return _export_answer(self._invoke("export", _export_params(period, cursor, limit), True))

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
        params, has_id = self._track(tenant, feature, qty, id, {**opts, "detail": True})
        return cast(dict[str, Any], self._invoke("track", params, has_id))

    def check(self, tenant: str, feature: str, qty: int = 1, **opts: Any) -> dict[str, Any]:
        """Whether ``qty`` more units would be counted, without counting them:
        ``{allowed, value, limit, remaining, kind, source, over}``."""
        params = _with_opts([tenant, feature, qty], opts)
        return cast(dict[str, Any], self._invoke("check", params, True))

    def set_plan(self, name: str, features: Mapping[str, Mapping[str, Any]]) -> int:
        """Create or replace plan ``name``: ``{feature: {limit, kind, enforcement}}``;
        returns the limits' new version."""
        return _version(self._invoke("set_plan", [name, _features(features)], True))

    def assign_plan(self, tenant: str, plan: str | None) -> int:
        """Put ``tenant`` on ``plan`` (``None``: on none); the limits' new version."""
        return _version(self._invoke("assign_plan", [tenant, plan], True))

    def set_limit(
        self,
        tenant: str,
        feature: str,
        limit: int,
        kind: str = "hard",
        enforcement: str = "fast",
        alerts: Sequence[int] | None = None,
    ) -> int:
        """Override ``tenant``'s limit on ``feature`` (``alerts``: threshold percentages);
        the limits' new version."""
        spec = _limit_spec(limit, kind, enforcement, alerts)
        return _version(self._invoke("set_limit", [tenant, feature, spec], True))

    def clear_limit(self, tenant: str, feature: str) -> int:
        """Remove ``tenant``'s override on ``feature``; the limits' new version."""
        return _version(self._invoke("clear_limit", [tenant, feature], True))

    def limits(self, tenant: str) -> dict[str, Any]:
        """``{tenant, plan, version, limits: {feature: {limit, kind, enforcement, source}}}``."""
        return cast(dict[str, Any], self._invoke("limits", [tenant], True))

    # -- credits ledgers (docs/ledger.md) ---------------------------------------------------

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
        params = _grant_params(tenant, amount, ref, expires_at, priority)
        return cast(dict[str, Any], self._invoke("grant", params, True))

    def debit(self, tenant: str, amount: int, *, ref: str | None = None) -> dict[str, Any]:
        """Spend ``amount`` from ``tenant``'s ledger (``InsufficientBalance`` if it does not
        fit: nothing changed); the entry written."""
        params = [tenant, amount, {"ref": ref if ref is not None else _new_ref()}]
        return cast(dict[str, Any], self._invoke("debit", params, True))

    def balance(self, tenant: str) -> dict[str, Any]:
        """``{tenant, available, seq, grants: [{seq, remaining, priority, expires_at}]}``."""
        return cast(dict[str, Any], self._invoke("balance", [tenant], True))

    def ledger_page(
        self, tenant: str, after: int | None = None, limit: int | None = None
    ) -> dict[str, Any]:
        """One page of entries after sequence ``after``: ``{tenant, entries, cursor}``."""
        return cast(
            dict[str, Any], self._invoke("ledger", _page_params(tenant, after, limit), True)
        )

    def ledger_entries(self, tenant: str, page_size: int = 100) -> Iterator[dict[str, Any]]:
        """Every entry of ``tenant``'s ledger, page by page."""
        after: int | None = None
        while True:
            page = self.ledger_page(tenant, after, page_size)
            yield from page["entries"]
            after = page["cursor"]
            if after is None:
                return


class _ClientProtocol(asyncio.Protocol):
    def __init__(self, max_frame: int, inbox: _Inbox | None = None) -> None:
        self.decoder = Decoder(side="client", max_frame=max_frame)
        self.inbox = _Inbox() if inbox is None else inbox
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
    path: str, max_frame: int, inbox: _Inbox | None = None
) -> tuple[asyncio.Transport, _ClientProtocol]:
    loop = asyncio.get_running_loop()
    try:
        transport, protocol = await loop.create_unix_connection(
            lambda: _ClientProtocol(max_frame, inbox), path
        )
    except OSError as exc:
        raise Unavailable(f"cannot connect to {path}: {exc}") from None
    return transport, protocol


class AsyncClient(_Ids):
    """An asyncio client over one connection (re-opened after a failure when the client
    knows its socket path, as one made by :meth:`connect` does); any number of calls may
    run concurrently."""

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
        #: Send a fresh random request id with every mutating call that has none.
        self.auto_ids = auto_ids
        #: Seconds (from a call's start) a typed method keeps retrying; 0 disables retries.
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
        ``retry_timeout`` and ``auto_ids``: see the module docstring."""
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
                proto_inbox.subscribing(tenant)
                try:
                    resp = await self._exchange(proto, "subscribe", params)
                except BaseException:
                    proto_inbox.not_subscribed(tenant)
                    transport.close()
                    raise
                if resp.error is not None:
                    proto_inbox.not_subscribed(tenant)
                    transport.close()
                    raise from_wire(resp.error)
                proto_inbox.subscribed(tenant, params, resp.result)
            if proto_inbox.alerts_on:
                try:
                    resp = await self._exchange(proto, "subscribe_alerts", [])
                except BaseException:
                    transport.close()
                    raise
                if resp.error is not None:
                    transport.close()
                    raise from_wire(resp.error)
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
        resp = await self._exchange(await self._ensure(), method, list(params))
        if resp.error is not None:
            raise from_wire(resp.error)
        return resp.result

    async def _invoke(self, method: str, params: list[Any], retry_unanswered: bool) -> Any:
        """Call with retries; as :meth:`Client._invoke`."""
        start = time.monotonic()
        backoff: _Backoff | None = None
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
                    answered = from_wire(resp.error)
                    if not isinstance(answered, Unavailable):
                        raise answered
                    err = answered  # the node counted nothing
            if self.retry_timeout <= 0 or self._path is None or self._closed:
                raise err
            if backoff is None:
                backoff = _Backoff(start, self.retry_timeout)
            await asyncio.sleep(backoff.pause(err))

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
        out: list[Any] = []
        first: MeterError | None = None
        for msgid, fut in futs:
            resp = await self._wait(proto, msgid, fut)
            if resp.error is not None:
                err = from_wire(resp.error)
                first = first or err
                out.append(err)
            else:
                out.append(resp.result)
        if first is not None and not return_exceptions:
            raise first
        return out

    # -- methods --------------------------------------------------------------------------

    async def track(
        self, tenant: str, feature: str, qty: int = 1, *, id: str | None = None, **opts: Any
    ) -> int | None:
        """Add ``qty``; the new total, or None if counted but the total is not known yet.

        ``id``: the request id (default: a fresh one, unless ``auto_ids`` is off)."""
        params, has_id = self._track(tenant, feature, qty, id, opts)
        return cast(int | None, await self._invoke("track", params, has_id))

    async def track_many(self, items: Iterable[TrackItem]) -> list[int | MeterError | None]:
        """Count many items in one call; as :meth:`Client.track_many` (an item's error is
        returned in its place as an exception object, not raised)."""
        wire, all_ids = self._many(items)
        return _many_results(await self._invoke("track_many", [wire], all_ids))

    async def usage(self, tenant: str, feature: str, **opts: Any) -> int:
        """The counter's value in the current period (or the one containing ``at=``)."""
        return cast(int, await self._invoke("usage", _with_opts([tenant, feature], opts), True))

    async def usage_all(self, tenant: str, **opts: Any) -> dict[str, int]:
        """Every feature's value for ``tenant`` in the period."""
        params = _with_opts([tenant], opts)
        return cast(dict[str, int], await self._invoke("usage_all", params, True))

    async def history(
        self,
        tenant: str,
        feature: str,
        first: str | None = None,
        last: str | None = None,
        granularity: str = "day",
    ) -> list[tuple[str, int]]:
        """As :meth:`Client.history`."""
        params = _history_params(tenant, feature, first, last, granularity)
        return _history_answer(await self._invoke("history", params, True))

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
    ) -> str:
        """Hold ``qty`` against ``limit``; returns a reservation id (LimitExceeded if over).

        ``id``: the request id (default: a fresh one, unless ``auto_ids`` is off)."""
        opts = {"limit": limit, "ttl_ms": ttl_ms, "at": at}
        params, has_id = self._reserve(tenant, feature, qty, id, opts)
        return cast(str, await self._invoke("reserve", params, has_id))

    async def commit(
        self, reservation_id: str, actual_qty: int | None = None, *, id: str | None = None
    ) -> int:
        """Turn a reservation into usage (optionally a different quantity); the new total."""
        params = _commit(reservation_id, actual_qty, self._rid(id))
        return cast(int, await self._invoke("commit", params, True))

    async def release(self, reservation_id: str, *, id: str | None = None) -> None:
        """Drop a reservation without counting it."""
        await self._invoke("release", _release(reservation_id, self._rid(id)), True)

    async def ping(self) -> str:
        """``"pong"``."""
        return cast(str, await self._invoke("ping", [], True))

    async def status(self) -> dict[str, Any]:
        """The node's status map."""
        return cast(dict[str, Any], await self._invoke("status", [], True))

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
        params = _subscribe_params(tenant, features)
        inbox = self._protocol.inbox  # (a reconnection keeps it)
        fresh = tenant not in inbox.subs
        if fresh:  # before sending: a notification may be handled before this resumes
            inbox.subscribing(tenant)
        try:
            items = await self._invoke("subscribe", params, True)
        except BaseException:
            if fresh:
                inbox.not_subscribed(tenant)
            raise
        if inbox.event is None:
            inbox.event = asyncio.Event()
        inbox.subscribed(tenant, params, items)
        return self._follow(tenant, inbox)

    def _follow(self, tenant: str, inbox: _Inbox) -> AsyncIterator[Usage]:
        return self._drain_inbox(inbox, lambda: inbox.take(tenant), lambda: tenant in inbox.subs)

    async def _drain_inbox(
        self, inbox: _Inbox, take: Callable[[], Any], active: Callable[[], bool]
    ) -> AsyncIterator[Any]:
        """Yield what ``take`` finds in the inbox as notifications arrive, while ``active``
        and the client open; a lost connection is reopened (subscriptions made again) within
        ``retry_timeout``, else :class:`~meter.errors.Unavailable` is raised."""
        event = inbox.event
        assert event is not None
        backoff: _Backoff | None = None
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
                    if self.retry_timeout <= 0 or self._path is None or self._closed:
                        raise
                    if backoff is None:
                        backoff = _Backoff(time.monotonic(), self.retry_timeout)
                    await asyncio.sleep(backoff.pause(exc))
                continue
            event.clear()
            await event.wait()

    async def unsubscribe(self, tenant: str) -> bool:
        """Stop watching ``tenant`` (its iterators end); whether it was watched."""
        self._protocol.inbox.unsubscribed(tenant)
        return cast(bool, await self._invoke("unsubscribe", [tenant], True))

    async def subscribe_alerts(self) -> AsyncIterator[dict[str, Any]]:
        """As :meth:`Client.subscribe_alerts`: an async iterator of alert maps; it ends when
        alerts are unsubscribed or the client closed; a lost connection is reopened (and the
        subscription made again) within ``retry_timeout``."""
        inbox = self._protocol.inbox
        inbox.alerts_on = True
        try:
            await self._invoke("subscribe_alerts", [], True)
        except BaseException:
            inbox.alerts_on = False
            raise
        if inbox.event is None:
            inbox.event = asyncio.Event()
        return self._follow_alerts(inbox)

    def _follow_alerts(self, inbox: _Inbox) -> AsyncIterator[dict[str, Any]]:
        alerts = inbox.alerts
        return self._drain_inbox(
            inbox, lambda: alerts.popleft() if alerts else None, lambda: inbox.alerts_on
        )

    async def unsubscribe_alerts(self) -> bool:
        """Stop getting alerts (the iterators end); whether they were subscribed."""
        inbox = self._protocol.inbox
        inbox.alerts_on = False
        inbox.alerts.clear()
        inbox.wake()
        return cast(bool, await self._invoke("unsubscribe_alerts", [], True))

    async def export_page(
        self, period: str, cursor: str | None = None, limit: int | None = None
    ) -> tuple[list[ExportRow], str | None]:
        """One page of ``period``'s stored counters (every tenant) and the cursor of the next
        (``None`` after the last). A page may be short, even empty, before the last."""
        params = _export_params(period, cursor, limit)
        return _export_answer(await self._invoke("export", params, True))

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
        params, has_id = self._track(tenant, feature, qty, id, {**opts, "detail": True})
        return cast(dict[str, Any], await self._invoke("track", params, has_id))

    async def check(self, tenant: str, feature: str, qty: int = 1, **opts: Any) -> dict[str, Any]:
        """As :meth:`Client.check`."""
        params = _with_opts([tenant, feature, qty], opts)
        return cast(dict[str, Any], await self._invoke("check", params, True))

    async def set_plan(self, name: str, features: Mapping[str, Mapping[str, Any]]) -> int:
        """As :meth:`Client.set_plan`."""
        return _version(await self._invoke("set_plan", [name, _features(features)], True))

    async def assign_plan(self, tenant: str, plan: str | None) -> int:
        """As :meth:`Client.assign_plan`."""
        return _version(await self._invoke("assign_plan", [tenant, plan], True))

    async def set_limit(
        self,
        tenant: str,
        feature: str,
        limit: int,
        kind: str = "hard",
        enforcement: str = "fast",
        alerts: Sequence[int] | None = None,
    ) -> int:
        """As :meth:`Client.set_limit`."""
        spec = _limit_spec(limit, kind, enforcement, alerts)
        return _version(await self._invoke("set_limit", [tenant, feature, spec], True))

    async def clear_limit(self, tenant: str, feature: str) -> int:
        """As :meth:`Client.clear_limit`."""
        return _version(await self._invoke("clear_limit", [tenant, feature], True))

    async def limits(self, tenant: str) -> dict[str, Any]:
        """As :meth:`Client.limits`."""
        return cast(dict[str, Any], await self._invoke("limits", [tenant], True))

    # -- credits ledgers (docs/ledger.md) ---------------------------------------------------

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
        params = _grant_params(tenant, amount, ref, expires_at, priority)
        return cast(dict[str, Any], await self._invoke("grant", params, True))

    async def debit(self, tenant: str, amount: int, *, ref: str | None = None) -> dict[str, Any]:
        """As :meth:`Client.debit`."""
        params = [tenant, amount, {"ref": ref if ref is not None else _new_ref()}]
        return cast(dict[str, Any], await self._invoke("debit", params, True))

    async def balance(self, tenant: str) -> dict[str, Any]:
        """As :meth:`Client.balance`."""
        return cast(dict[str, Any], await self._invoke("balance", [tenant], True))

    async def ledger_page(
        self, tenant: str, after: int | None = None, limit: int | None = None
    ) -> dict[str, Any]:
        """As :meth:`Client.ledger_page`."""
        params = _page_params(tenant, after, limit)
        return cast(dict[str, Any], await self._invoke("ledger", params, True))

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


def _new_ref() -> str:
    """A ref for a ledger change whose caller gave none: the client's retries reuse it."""
    return "c-" + secrets.token_hex(16)


def _grant_params(
    tenant: str, amount: int, ref: str | None, expires_at: int | None, priority: int | None
) -> list[Any]:
    opts: dict[str, Any] = {"ref": ref if ref is not None else _new_ref()}
    if expires_at is not None:
        opts["expires_at"] = expires_at
    if priority is not None:
        opts["priority"] = priority
    return [tenant, amount, opts]


def _page_params(tenant: str, after: int | None, limit: int | None) -> list[Any]:
    opts = {k: v for k, v in (("after", after), ("limit", limit)) if v is not None}
    return [tenant, opts] if opts else [tenant]


def _limit_spec(
    limit: int, kind: str, enforcement: str, alerts: Sequence[int] | None
) -> dict[str, Any]:
    spec: dict[str, Any] = {"limit": limit, "kind": kind, "enforcement": enforcement}
    if alerts:
        spec["alerts"] = list(alerts)
    return spec


def _features(features: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f: dict(spec) for f, spec in features.items()}


def _version(result: Any) -> int:
    """The ``version`` of a limits change's answer."""
    return int(result["version"])
