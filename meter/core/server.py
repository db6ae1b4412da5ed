"""The socket server: MessagePack-RPC over a Unix socket, on uvloop or the default loop.

Thin by design: bytes go through :mod:`meter.core.protocol`, requests go to a dispatcher
(``dispatch(method, params)`` returning a result or an awaitable), answers go back. What else
the server may use is handed to it, each optional: ``notify(method, params)`` for notifications,
``warm_tracks(requests)`` for a batch's leading plain tracks, the write-ahead log whose commits
answers wait for, the live usage subscriptions, the request counters. Every complete request in
a read batch is dispatched, and the synchronous answers of the batch leave in one write.
Asynchronous answers are written when they are ready, so responses may arrive out of order;
clients match them by msgid. A read (``reads``) never overtakes a request sent before it on the
same connection: one that arrives while earlier writes of its connection are still at work
waits for them, and the connection's later requests wait behind it (docs/protocol.md,
"Transport").

Why one module: the connection (the hot read loop, held answers, back-pressure) and the server
(accepting, the log's commit hold, the drain) call each other on every request; mypyc
compiles them as one, and their calls stay native.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import grp
import inspect
import logging
import os
import socket
import stat
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Awaitable, Callable
from time import perf_counter
from typing import TYPE_CHECKING, Any, Protocol, cast

from meter.core.counts import OTHER
from meter.core.protocol import (
    DEFAULT_MAX_FRAME,
    RESPONSE,
    Decoder,
    Encoder,
    ErrorMap,
    Invalid,
    Message,
    Notification,
    ProtocolError,
    RawRequest,
    Request,
    invalid_error,
)
from meter.core.watch import Bind, Subscriber, Watch
from meter.errors import ConfigError, MeterError, Unavailable

if TYPE_CHECKING:
    from meter.core.counts import RequestStats
    from meter.wal.log import WriteAheadLog

log = logging.getLogger("meter.server")

#: Pause reading a connection while more than this many answer bytes wait to be sent...
DEFAULT_HIGH_WATER = 1 << 20
#: ...and resume once the backlog is below this.
DEFAULT_LOW_WATER = 256 << 10
#: An upper bound on one encoded ``usage`` notification: names at their longest (512-byte
#: tenant, 256-byte feature), a 64-bit value and a day period take 803 bytes.
NOTIFY_MAX_BYTES = 1024
#: listen() backlog.
DEFAULT_BACKLOG = 1024
#: At most this many "closing a connection after a protocol error" lines per interval...
PROTOCOL_ERROR_LOG_LINES = 10
#: ...of this many seconds; then one line says how many more were not logged.
PROTOCOL_ERROR_LOG_INTERVAL_S = 60.0

_INTERNAL: ErrorMap = {"code": "internal", "message": "internal error"}
# Results of these types are answered at once; anything else is checked for awaitability.
_PLAIN = frozenset({int, str, dict, list, type(None), bool, float, bytes})


class Dispatcher(Protocol):
    """What the server calls for every request."""

    def dispatch(self, method: str, params: list[Any]) -> Any:
        """Return the result, or an awaitable of it; raise MeterError for bad requests."""


class _LimitedLog:
    """Warnings of one kind, at most ``lines`` per ``interval`` seconds.

    The warnings past the limit are counted, not logged, and one line says how many when their
    interval is over: a flood of bad frames cannot flood the log, and the log still says it
    happened. (Every protocol error is also counted in ``status``.)
    """

    def __init__(self, logger: logging.Logger, lines: int, interval: float, what: str) -> None:
        self.log = logger
        self.lines = lines
        self.interval = interval
        self.what = what
        self._ends = 0.0  # when the current interval ends (time.monotonic())
        self._logged = 0
        self.suppressed = 0
        self._timer: asyncio.TimerHandle | None = None

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now >= self._ends:
            self.flush()
            self._ends = now + self.interval
            self._logged = 0
        if self._logged < self.lines:
            self._logged += 1
            self.log.warning(msg, *args)
            return
        self.suppressed += 1
        if self._timer is None:
            delay = max(self._ends - now, 0.0)
            self._timer = asyncio.get_running_loop().call_later(delay, self.flush)

    def flush(self) -> None:
        """Log how many warnings were left out, if any, and start a new interval."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.suppressed:
            self.log.warning(
                "%d more %s not logged in the last %g s (all are counted in status: %s)",
                self.suppressed,
                self.what,
                self.interval,
                "server.protocol_errors",
            )
            self.suppressed = 0
            self._ends = 0.0


class _Connection:
    __slots__ = (
        "_answers",
        "_decoder",
        "_eof",
        "_paused",
        "_queue",
        "_server",
        "_shut",
        "_tally",
        "_working",
        "pending",
        "sub",
        "transport",
    )

    def __init__(self, server: RpcServer) -> None:
        self._server = server
        self._decoder = Decoder(max_frame=server.max_frame)
        #: The synchronous answers of the batch being served, as response arrays.
        self._answers: list[list[Any]] = []
        self._paused = False
        self._eof = False
        #: Closing after a protocol error: read no more, close once no answer is pending.
        self._shut = False
        #: Asynchronous answers not sent yet (requests waiting in ``_queue`` included).
        self.pending = 0
        #: The tasks of this connection's asynchronous requests not finished yet, reads
        #: left out (what a read waits for).
        self._working: set[asyncio.Task[None]] = set()
        #: While a read waits for the writes before it: it and every request received after
        #: it, in order, as ``(request, when received)``; ``None`` otherwise.
        self._queue: deque[tuple[RawRequest | Request, float]] | None = None
        #: Metrics on: the answers of the pass being served that are not counted in its own
        #: ``tracks`` and ``answered`` (errors, and whatever ``_other`` answers), by
        #: ``(method label, code or None for ok)``; counted when the pass's answers leave.
        self._tally: dict[tuple[str, str | None], int] | None = None
        #: This connection's subscriptions and unsent notifications (``subscribe``), if any.
        self.sub: Subscriber | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, hence a cast, not a check.
        self.transport = cast(asyncio.Transport, transport)
        srv = self._server
        self.transport.set_write_buffer_limits(high=srv.high_water, low=srv.low_water)
        srv._conns.add(self)
        srv.accepted += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self._server._conns.discard(self)
        self.transport = None
        if self.sub is not None and self._server.watch is not None:
            self._server.watch.remove(self.sub)  # subscriptions die with the connection

    def subscriber(self) -> Subscriber:
        """This connection's :class:`Subscriber`, made on first need."""
        if self.sub is None:
            self.sub = Subscriber()
        return self.sub

    def push(self) -> None:
        """Write pending notifications while the peer keeps up: not while writing is paused or
        the low-water mark of bytes wait unsent. Those left wait in the outbox, which keeps
        one (the latest) value per counter.

        Each write takes only as many notifications as fit, at :data:`NOTIFY_MAX_BYTES`
        each, in the room left under the mark (one if less room is left), so the unsent
        bytes never exceed the mark by a notification or more (docs/protocol.md)."""
        sub = self.sub
        transport = self.transport
        if sub is None or transport is None or self._paused or transport.is_closing():
            return
        srv = self._server
        low = srv.low_water
        buffered = transport.get_write_buffer_size()
        while sub.alerts and buffered < low:  # (few, and urgent: first)
            room = (low - buffered) // (2 * NOTIFY_MAX_BYTES)  # (an alert: under 2 KiB)
            # MessagePack-RPC params are an array: ``[2, "alert", [{...}]]``.
            alerts = [[a] for a in sub.take_alerts(room or 1)]
            transport.write(srv._encoder.notifications("alert", alerts))
            buffered = transport.get_write_buffer_size()
        while sub.pending and buffered < low:
            room = (low - buffered) // NOTIFY_MAX_BYTES
            transport.write(srv._encoder.notifications("usage", sub.take(room or 1)))
            buffered = transport.get_write_buffer_size()
            if buffered > srv.notify_buffer_max:
                srv.notify_buffer_max = buffered

    def pause_writing(self) -> None:
        # The peer is not reading its answers: stop reading its requests until it catches up.
        self._paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
            if self.sub is not None and self.sub.has_pending:
                self.push()

    def data_received(self, data: bytes) -> None:
        srv = self._server
        stats = srv.request_stats
        # Metrics on: when the pass started (every request of it is timed from here) and the
        # ok answers of the pass by method. Off: nothing of this runs per request.
        t0 = perf_counter() if stats is not None else 0.0
        tracks = 0  # of them answered by the fast path
        answered: dict[str, int] | None = None  # the others
        bad: ProtocolError | None = None
        try:
            messages = self._decoder.feed_raw(data)
        except ProtocolError as exc:
            bad = exc
            # Raised by feed_raw, so its messages are raw too.
            messages = cast(list[RawRequest | Message], exc.messages)
        answers = self._answers
        if srv._draining:
            for msg in messages:
                self._other(msg, True)
        else:
            # The hot loop: a well-formed request is the decoded list [0, msgid, method, params]
            # (see Decoder.feed_raw); everything else goes to _other. An answer is appended
            # already shaped as the response array, so the encoder packs it as is.
            dispatch = srv._dispatch
            plain = _PLAIN
            isawaitable = inspect.isawaitable
            # Counted once per batch (every message is a request but for the rare ones _other
            # takes back out): a status request in the batch sees the whole batch as received.
            srv.requests += len(messages)
            start = 0
            fast = srv._warm_tracks
            reads = srv.reads
            if fast is not None and self._queue is None:
                # The dispatcher answers a leading run of plain warm tracks in one go; each
                # request list becomes its response array in place.
                for value in fast(messages):
                    req = cast(RawRequest, messages[start])
                    req[0] = RESPONSE
                    req[2] = None
                    req[3] = value
                    answers.append(req)
                    start += 1
            if stats is not None:
                tracks = start
                if start < len(messages):
                    answered = {}
            for msg in messages[start:] if start else messages:
                if type(msg) is not list:
                    self._other(msg, False)
                    continue
                _, msgid, method, params = msg
                if self._queue is not None or (self._working and method in reads):
                    self._wait_turn(msg)  # (read-your-writes: behind the requests before it)
                    continue
                try:
                    result = dispatch(method, params)
                except MeterError as err:
                    answers.append([RESPONSE, msgid, err.to_wire(), None])
                    if stats is not None:
                        self._count(stats.label(method), err.code)
                    continue
                except Exception:
                    log.exception("internal error in %.64r", method)
                    srv.internal_errors += 1
                    answers.append([RESPONSE, msgid, _INTERNAL, None])
                    if stats is not None:
                        self._count(stats.label(method), "internal")
                    continue
                # int first: what track answers, one compare instead of a set lookup.
                if (
                    type(result) is int
                    or type(result) in plain
                    or (type(result) is not Bind and not isawaitable(result))
                ):
                    answers.append([RESPONSE, msgid, None, result])
                    if answered is not None:
                        answered[method] = answered.get(method, 0) + 1
                else:
                    self._answer_later(msgid, method, result)
        transport = self.transport
        bad_after_hold: ProtocolError | None = None
        tally = self._tally  # (always None with metrics off)
        if tally is not None:
            self._tally = None
        if answers:
            wal = srv.wal
            if wal is not None and wal.dirty:
                # Some state change of this pass is not in the log yet: answer after it is.
                self._hold(wal, answers[:], tracks, answered, tally, t0)
                tracks = 0
                answered = None
                tally = None
                bad_after_hold = bad
                bad = None
            elif transport is not None and not transport.is_closing():
                encoder = srv._encoder
                before = encoder.encode_errors
                transport.write(encoder.response_arrays(answers))
                if encoder.encode_errors != before:
                    srv.internal_errors += encoder.encode_errors - before
                    log.error(
                        "unencodable result answered as internal: %s", encoder.last_encode_error
                    )
            answers.clear()
        if tracks or answered or tally:
            assert stats is not None
            seconds = perf_counter() - t0
            if tracks and not answered and not tally:
                # The common pass, fast-path tracks only: RequestStats.batch inlined (a method
                # call is a fifth of what metrics cost a lone track; docs/performance.md).
                stats.tracks += tracks
                hist = stats.track_latency
                hist.counts[bisect_left(hist.bounds, seconds)] += tracks
                hist.sum += seconds * tracks
            else:
                stats.batch(tracks, answered, seconds)
                if tally:
                    stats.tally(tally, seconds)
        bad = bad if bad is not None else bad_after_hold
        if bad is not None and transport is not None:
            srv.protocol_errors += 1
            srv.protocol_error_log.warning("closing a connection after a protocol error: %s", bad)
            # Answers to the good requests before the fault still leave, those waiting for
            # the log or for a storage read too: read no more, close once none is pending.
            # (close(), not abort(): what is written is flushed first.)
            self._shut = True
            if self.pending == 0:
                transport.close()
            else:
                transport.pause_reading()

    def _other(self, msg: RawRequest | Message, draining: bool) -> None:
        """Everything but a well-formed request while serving: a request with a bin method
        name, a notification, an invalid message; and every request while draining."""
        srv = self._server
        answers = self._answers
        stats = srv.request_stats
        if type(msg) is list or isinstance(msg, Request):
            if draining:
                srv.requests += 1
                msgid, method = (msg[1], msg[2]) if type(msg) is list else (msg[0], msg[1])
                answers.append([RESPONSE, msgid, _DRAINING, None])
                if stats is not None:
                    self._count(stats.label(method), "unavailable")
                return
            # Only a Request with a method name sent as raw/bin gets here.
            req = cast(Request, msg)
            if self._queue is not None or (self._working and req.method in srv.reads):
                self._wait_turn(req)
                return
            code: str | None = None
            try:
                result = srv._dispatch(req.method, req.params)
            except MeterError as exc:
                answers.append([RESPONSE, req.msgid, exc.to_wire(), None])
                code = exc.code
                result = None
            except Exception:
                log.exception("internal error in %.64r", req.method)
                srv.internal_errors += 1
                answers.append([RESPONSE, req.msgid, _INTERNAL, None])
                code = "internal"
                result = None
            if code is not None:
                if stats is not None:
                    self._count(stats.label(req.method), code)
            elif type(result) in _PLAIN:
                answers.append([RESPONSE, req.msgid, None, result])
                if stats is not None:
                    self._count(stats.label(req.method), None)
            else:
                self._answer_later(req.msgid, req.method, result)
            return
        if not draining:
            srv.requests -= 1  # counted as a request by data_received; it is not one
        if isinstance(msg, Notification):
            srv._notify_one(msg)
        elif isinstance(msg, Invalid):
            srv.invalid_requests += 1
            if msg.msgid is not None:
                answers.append([RESPONSE, msg.msgid, invalid_error(msg.reason), None])
                if stats is not None:
                    self._count(OTHER, "invalid_argument")
            else:
                log.debug("ignored a malformed notification: %s", msg.reason)

    def _answer_later(self, msgid: int, method: str, result: Any) -> None:
        """Answer a result that is not a plain value: an awaitable (answered when done), or a
        :class:`~meter.core.watch.Bind` (run with this connection's subscriber)."""
        srv = self._server
        if type(result) is Bind:
            code: str | None = None
            try:
                result = result.run(self.subscriber())
            except MeterError as exc:
                self._answers.append([RESPONSE, msgid, exc.to_wire(), None])
                code = exc.code
            except Exception:
                log.exception("internal error in %.64r", method)
                srv.internal_errors += 1
                self._answers.append([RESPONSE, msgid, _INTERNAL, None])
                code = "internal"
            if code is not None:
                stats = srv.request_stats
                if stats is not None:
                    self._count(stats.label(method), code)
                return
            # Run: its answer is a value, or an awaitable (features read from storage first).
        if type(result) in _PLAIN or not inspect.isawaitable(result):
            self._answers.append([RESPONSE, msgid, None, result])
            stats = srv.request_stats
            if stats is not None:
                self._count(stats.label(method), None)
        else:
            srv._spawn(self, msgid, method, result)

    def _wait_turn(self, req: RawRequest | Request) -> None:
        """Queue ``req`` behind the requests before it; start serving the queue if it is new."""
        srv = self._server
        self.pending += 1
        if self._queue is not None:
            self._queue.append((req, perf_counter()))
            return
        self._queue = deque([(req, perf_counter())])
        task = asyncio.get_running_loop().create_task(self._serve_queue())
        srv._inflight.add(task)
        task.add_done_callback(srv._inflight.discard)

    async def _serve_queue(self) -> None:
        """Dispatch the queued requests in order, each read once every write before it has
        finished; then serve as usual again."""
        queue = self._queue
        assert queue is not None
        srv = self._server
        try:
            while queue:
                req, received = queue[0]
                msgid, method, params = (
                    (req[1], req[2], req[3]) if type(req) is list else (req[0], req[1], req[2])
                )
                while self._working and method in srv.reads:
                    await asyncio.wait(set(self._working))
                queue.popleft()
                self._dispatch_one(msgid, method, params, received)
                self.finished_one()
        except asyncio.CancelledError:  # the server's drain gave up: those left are not run
            stats = srv.request_stats
            for req, received in queue:
                msgid, method = (req[1], req[2]) if type(req) is list else (req[0], req[1])
                count = None if stats is None else (stats.label(method), "unavailable", received)
                self.send(msgid, _DRAINING, None, count)
                self.finished_one()
            queue.clear()
            raise
        finally:
            self._queue = None

    def _dispatch_one(self, msgid: int, method: str, params: Any, received: float) -> None:
        """Run one request outside a read pass and answer it (now, or when it is done)."""
        srv = self._server
        stats = srv.request_stats

        def count(code: str | None) -> tuple[str, str | None, float] | None:
            return None if stats is None else (stats.label(method), code, received)

        if srv._draining:
            self.send(msgid, _DRAINING, None, count("unavailable"))
            return
        try:
            result = srv._dispatch(method, params)
            if type(result) is Bind:
                result = result.run(self.subscriber())
        except MeterError as exc:
            self.send(msgid, exc.to_wire(), None, count(exc.code))
            return
        except Exception:
            log.exception("internal error in %.64r", method)
            srv.internal_errors += 1
            self.send(msgid, _INTERNAL, None, count("internal"))
            return
        if type(result) in _PLAIN or not inspect.isawaitable(result):
            self.send(msgid, None, result, count(None))
        else:
            srv._spawn(self, msgid, method, result, received)

    def eof_received(self) -> bool:
        # A peer that half-closes after writing still gets its pending async answers.
        self._eof = True
        return self.pending > 0

    def finished_task(self, task: asyncio.Task[None]) -> None:
        """A task of :meth:`RpcServer._spawn` of this connection is done."""
        self._server._inflight.discard(task)
        self._working.discard(task)

    def finished_one(self) -> None:
        self.pending -= 1
        if (self._eof or self._shut) and self.pending == 0 and self.transport is not None:
            self.transport.close()

    def _send_arrays(self, answers: list[list[Any]]) -> None:
        """Send response arrays held until the write-ahead log committed them."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        encoder = self._server._encoder
        before = encoder.encode_errors
        transport.write(encoder.response_arrays(answers))
        if encoder.encode_errors != before:
            self._server.internal_errors += encoder.encode_errors - before
            log.error("unencodable result answered as internal: %s", encoder.last_encode_error)

    def _count(self, method: str, code: str | None) -> None:
        """Count one answer of this pass (metrics on): ``code`` ``None`` for ``ok``."""
        tally = self._tally
        if tally is None:
            tally = self._tally = {}
        key = (method, code)
        tally[key] = tally.get(key, 0) + 1

    def _hold(
        self,
        wal: WriteAheadLog,
        answers: list[list[Any]],
        tracks: int = 0,
        answered: dict[str, int] | None = None,
        tally: dict[tuple[str, str | None], int] | None = None,
        t0: float = 0.0,
    ) -> None:
        """Send ``answers`` after the log's commit; until then they count as pending, so a
        peer that half-closes (or a connection closing after a protocol error) still gets
        them. ``tracks`` (fast-path tracks), ``answered`` (the other ok answers by method) and
        ``tally`` (the rest, by method and code) are counted at the send, timed from ``t0``
        (metrics on); all as ``unavailable`` if the log's write failed (so were they answered)."""
        self.pending += 1
        stats = self._server.request_stats

        def send(arrays: list[list[Any]], error: str | None) -> None:
            self._send_arrays(arrays)
            self.finished_one()
            if stats is not None and (tracks or answered or tally):
                seconds = perf_counter() - t0
                if error is not None:
                    stats.failed("unavailable", tracks, answered, tally, seconds)
                    return
                stats.batch(tracks, answered, seconds)
                if tally:
                    stats.tally(tally, seconds)

        wal.hold(send, answers)

    def send(
        self,
        msgid: int,
        error: ErrorMap | None,
        result: Any,
        count: tuple[str, str | None, float] | None = None,
    ) -> None:
        """Send one asynchronous answer, after the log's commit if it has something to commit.
        ``count`` (metrics on): ``(method label, code or None, start)``, counted when it
        leaves (as ``unavailable`` if the log's write failed)."""
        wal = self._server.wal
        if wal is not None and wal.dirty:
            tally = None if count is None else {(count[0], count[1]): 1}
            self._hold(wal, [[RESPONSE, msgid, error, result]], tally=tally,
                       t0=0.0 if count is None else count[2])  # fmt: skip
            return
        if count is not None:
            stats = self._server.request_stats
            assert stats is not None
            stats.one(count[0], count[1], perf_counter() - count[2])
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        encoder = self._server._encoder
        before = encoder.encode_errors
        transport.write(encoder.response(msgid, error, result))
        if encoder.encode_errors != before:
            self._server.internal_errors += encoder.encode_errors - before
            log.error("unencodable result answered as internal: %s", encoder.last_encode_error)


_DRAINING: ErrorMap = Unavailable("the node is shutting down").to_wire()


class RpcServer:
    """A running server; build it with :func:`start_server`."""

    def __init__(
        self,
        path: str,
        dispatcher: Dispatcher,
        *,
        max_frame: int,
        high_water: int,
        low_water: int,
        protocol_error_log_lines: int = PROTOCOL_ERROR_LOG_LINES,
        protocol_error_log_interval: float = PROTOCOL_ERROR_LOG_INTERVAL_S,
        notify: Callable[[str, list[Any]], Any] | None = None,
        warm_tracks: Callable[[list[Any]], list[int]] | None = None,
        wal: WriteAheadLog | None = None,
        watch: Watch | None = None,
        request_stats: RequestStats | None = None,
        reads: frozenset[str] = frozenset(),
    ) -> None:
        self.path = path
        self.dispatcher = dispatcher
        self.max_frame = max_frame
        self.high_water = high_water
        self.low_water = low_water
        self._dispatch = dispatcher.dispatch
        #: Answers a leading run of plain warm tracks of a batch at once (see Service).
        self._warm_tracks = warm_tracks
        self._notify = notify
        #: The write-ahead log, if any: answers wait for its commits.
        self.wal = wal
        #: The live usage subscriptions, if any (``subscribe``).
        self.watch = watch
        #: The methods that read what the requests before them did (read-your-writes).
        self.reads = reads
        self._encoder = Encoder()
        self._conns: set[_Connection] = set()
        self._inflight: set[asyncio.Task[None]] = set()
        self._server: asyncio.AbstractServer | None = None
        self._inode: tuple[int, int, int] | None = None
        self._draining = False
        self._closed = False
        #: Requests received (answered or in flight), across all connections.
        self.requests = 0
        #: Connections closed for garbage, oversized frames and the like.
        self.protocol_errors = 0
        #: Their log lines, rate-limited.
        self.protocol_error_log = _LimitedLog(
            log, protocol_error_log_lines, protocol_error_log_interval, "protocol errors"
        )
        #: Well-formed messages that were not valid requests (answered invalid_argument).
        self.invalid_requests = 0
        #: Requests whose handler raised something other than a MeterError.
        self.internal_errors = 0
        #: Connections accepted since start.
        self.accepted = 0
        #: The most unsent bytes a connection had right after notifications were written.
        self.notify_buffer_max = 0
        #: Requests by method and result, and their latency (``None``: metrics off).
        self.request_stats = request_stats

    @property
    def connections(self) -> int:
        """Open connections."""
        return len(self._conns)

    @property
    def in_flight(self) -> int:
        """Requests whose (asynchronous) answer is not sent yet."""
        return len(self._inflight)

    def stats(self) -> dict[str, int]:
        """Counters for ``status``."""
        return {
            "connections": len(self._conns),
            "accepted": self.accepted,
            "requests": self.requests,
            "in_flight": len(self._inflight),
            "protocol_errors": self.protocol_errors,
            "invalid_requests": self.invalid_requests,
            "internal_errors": self.internal_errors,
            "notify_buffer_max": self.notify_buffer_max,
        }

    def push_notifications(self) -> None:
        """Write every connection's pending notifications it can take now (see
        :meth:`_Connection.push`)."""
        for conn in self._conns:
            sub = conn.sub
            if sub is not None and sub.has_pending:
                conn.push()

    def _spawn(
        self,
        conn: _Connection,
        msgid: int,
        method: str,
        aw: Awaitable[Any],
        received: float | None = None,
    ) -> None:
        """Answer ``aw`` when it is done; timed from ``received`` (a queued request's arrival)
        or now."""
        start = 0.0
        if self.request_stats is not None:
            start = perf_counter() if received is None else received
        task = asyncio.get_running_loop().create_task(self._finish(conn, msgid, method, aw, start))
        conn.pending += 1
        self._inflight.add(task)
        if method not in self.reads:  # (a read need not wait for an earlier read)
            conn._working.add(task)
        task.add_done_callback(conn.finished_task)

    async def _finish(
        self, conn: _Connection, msgid: int, method: str, aw: Awaitable[Any], start: float
    ) -> None:
        stats = self.request_stats
        label = "" if stats is None else stats.label(method)

        def count(code: str | None) -> tuple[str, str | None, float] | None:
            return None if stats is None else (label, code, start)

        try:
            result = await aw
        except MeterError as exc:
            conn.send(msgid, exc.to_wire(), None, count(exc.code))
        except asyncio.CancelledError:
            conn.send(msgid, _DRAINING, None, count("unavailable"))
            raise
        except Exception:
            log.exception("internal error in %.64r", method)
            self.internal_errors += 1
            conn.send(msgid, _INTERNAL, None, count("internal"))
        else:
            conn.send(msgid, None, result, count(None))
        finally:
            conn.finished_one()

    def _notify_one(self, msg: Notification) -> None:
        if self._notify is None:
            return
        try:
            result = self._notify(msg.method, msg.params)
            if result is not None and inspect.isawaitable(result):
                task = asyncio.ensure_future(result)
                self._inflight.add(task)
                task.add_done_callback(self._notification_done)
        except Exception:
            log.exception("notification %.64r failed", msg.method)

    def _notification_done(self, task: asyncio.Future[Any]) -> None:
        self._inflight.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("notification failed", exc_info=task.exception())

    def stop_accepting(self) -> None:
        """Stop accepting connections; open ones keep being served."""
        if self._server is not None:
            self._server.close()

    async def close(self, drain_timeout: float = 5.0) -> None:
        """Stop accepting, let in-flight requests finish (up to ``drain_timeout`` seconds),
        close every connection and remove the socket file. New requests arriving meanwhile
        are answered ``unavailable``."""
        if self._closed:
            return
        self._closed = True
        self.stop_accepting()
        self._draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout
        if self._inflight:
            _, pending = await asyncio.wait(set(self._inflight), timeout=drain_timeout)
            if pending:
                log.warning(
                    "%d requests still running after %.1fs; cancelling", len(pending), drain_timeout
                )
                for task in pending:
                    task.cancel()
                await asyncio.wait(pending, timeout=1.0)
        for _ in range(100):  # answers held for the log go out with its next commit
            if self.wal is None or not self.wal.dirty:
                break
            await asyncio.sleep(0)
        for conn in list(self._conns):
            if conn.transport is not None:
                conn.transport.close()  # flushes what is buffered, then closes
        while self._conns and loop.time() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(self._conns):
            if conn.transport is not None:
                conn.transport.abort()  # a peer that never reads must not hold us up
        self._conns.clear()
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), timeout=1.0)
        self.protocol_error_log.flush()
        self._unlink()

    def _unlink(self) -> None:
        unlink_own(self.path, self._inode)

    async def __aenter__(self) -> RpcServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def clear_stale(path: str) -> None:
    """Remove a socket file nobody listens on; refuse a live one or a non-socket file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(errno.EEXIST, "not a socket; refusing to replace it", path)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(probe, path), 2.0)
    except (ConnectionRefusedError, FileNotFoundError):
        pass  # a dead server's leftover
    except TimeoutError:
        # A listener with a full backlog is still a listener.
        raise OSError(errno.EADDRINUSE, "a server is listening on this socket", path) from None
    else:
        raise OSError(errno.EADDRINUSE, "a server is listening on this socket", path)
    finally:
        probe.close()
    log.info("replacing stale socket file %s", path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


#: A socket file's identity: ``(device, inode, ctime ns)`` (a new file may reuse an inode).
Inode = tuple[int, int, int]


def bind_unix(path: str, mode: int, gid: int | None = None) -> tuple[socket.socket, Inode]:
    """A non-blocking Unix socket bound to ``path`` (not listening yet) with file ``mode``
    (and group ``gid``), and the socket file's identity for :func:`unlink_own`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound = False
    try:
        sock.bind(path)
        bound = True
        # Nobody can connect before listen(), so fixing the mode here leaves no window.
        if gid is not None:
            os.chown(path, -1, gid)
        os.chmod(path, mode)
        st = os.lstat(path)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        if bound:
            os.unlink(path)
        raise
    return sock, (st.st_dev, st.st_ino, st.st_ctime_ns)


def unlink_own(path: str, inode: Inode | None) -> None:
    """Remove the socket file at ``path`` if it is still the one bound as ``inode``: a newer
    server may already have taken the path."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if (st.st_dev, st.st_ino, st.st_ctime_ns) == inode and stat.S_ISSOCK(st.st_mode):
        os.unlink(path)


def group_id(group: str | int) -> int:
    """The id of group ``group`` (a name, or a number); ConfigError naming ``socket_group``."""
    if isinstance(group, int):
        return group
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        if group.isdigit():
            return int(group)
        raise ConfigError("socket_group", f"no such group {group!r}") from None


async def start_server(
    path: str | os.PathLike[str],
    dispatcher: Dispatcher,
    *,
    mode: int | None = None,
    group: str | int | None = None,
    max_frame: int = DEFAULT_MAX_FRAME,
    high_water: int = DEFAULT_HIGH_WATER,
    low_water: int = DEFAULT_LOW_WATER,
    backlog: int = DEFAULT_BACKLOG,
    protocol_error_log_lines: int = PROTOCOL_ERROR_LOG_LINES,
    protocol_error_log_interval: float = PROTOCOL_ERROR_LOG_INTERVAL_S,
    notify: Callable[[str, list[Any]], Any] | None = None,
    warm_tracks: Callable[[list[Any]], list[int]] | None = None,
    wal: WriteAheadLog | None = None,
    watch: Watch | None = None,
    request_stats: RequestStats | None = None,
    reads: frozenset[str] = frozenset(),
) -> RpcServer:
    """Listen on the Unix socket ``path`` and serve ``dispatcher`` until closed.

    The socket file gets ``mode`` (default 0600, or 0660 when ``group`` is given; the file is
    then chown'd to that group). A stale socket file is replaced; a live one raises
    ``OSError(EADDRINUSE)``, any other file raises ``FileExistsError``. Connections closed
    for a protocol error are logged at most ``protocol_error_log_lines`` times per
    ``protocol_error_log_interval`` seconds (then one line says how many more).
    ``notify``, ``warm_tracks``, ``wal``, ``watch``, ``request_stats`` (metrics on: counts
    requests by method and result, and times them) and ``reads`` (the methods that must see
    the requests before them on their connection) are what :class:`RpcServer` takes.
    """
    spath = os.fspath(path)
    if mode is None:
        mode = 0o660 if group is not None else 0o600
    gid = group_id(group) if group is not None else None
    await clear_stale(spath)
    server = RpcServer(
        spath,
        dispatcher,
        max_frame=max_frame,
        high_water=high_water,
        low_water=low_water,
        protocol_error_log_lines=protocol_error_log_lines,
        protocol_error_log_interval=protocol_error_log_interval,
        notify=notify,
        warm_tracks=warm_tracks,
        wal=wal,
        watch=watch,
        request_stats=request_stats,
        reads=reads,
    )
    sock, server._inode = bind_unix(spath, mode, gid)
    try:
        server._server = await asyncio.get_running_loop().create_unix_server(
            # (a native class under mypyc: the loop takes any object with the protocol's methods)
            lambda: cast(asyncio.Protocol, _Connection(server)),
            sock=sock,
            backlog=backlog,
        )
    except BaseException:
        sock.close()
        unlink_own(spath, server._inode)
        raise
    log.info("listening on %s (mode %o)", spath, mode)
    return server
