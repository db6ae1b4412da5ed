"""Clients for a meter node: :class:`AsyncClient` (asyncio) and :class:`Client` (blocking).

Both speak MessagePack-RPC over the node's Unix socket, pipeline requests (responses are
matched by msgid, so order does not matter), raise the typed exceptions of
:mod:`meter.errors` for error responses, and raise :class:`~meter.errors.Unavailable` when the
connection fails.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any, cast

from meter.errors import MeterError, Unavailable, from_wire
from meter.protocol import (
    DEFAULT_MAX_FRAME,
    MSGID_MAX,
    Decoder,
    Encoder,
    ProtocolError,
    Response,
)

#: Default seconds the blocking client waits for an answer before raising Unavailable.
DEFAULT_TIMEOUT = 30.0

Call = tuple[str, Sequence[Any]]


def _opts(opts: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in opts.items() if v is not None}


def _track(tenant: str, feature: str, qty: int, opts: dict[str, Any]) -> list[Any]:
    opts = _opts(opts)
    return [tenant, feature, qty, opts] if opts else [tenant, feature, qty]


def _with_opts(params: list[Any], opts: dict[str, Any]) -> list[Any]:
    opts = _opts(opts)
    if opts:
        params.append(opts)
    return params


def _commit(reservation_id: str, actual_qty: int | None) -> list[Any]:
    return [reservation_id] if actual_qty is None else [reservation_id, actual_qty]


class Client:
    """A blocking client over one connection. Not thread-safe: one per thread."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        max_frame: int = DEFAULT_MAX_FRAME,
    ) -> None:
        self._sock: socket.socket | None = sock
        sock.settimeout(timeout)
        self._encoder = Encoder()
        self._decoder = Decoder(side="client", max_frame=max_frame)
        self._next = 0

    @classmethod
    def connect(
        cls,
        path: str | os.PathLike[str],
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        max_frame: int = DEFAULT_MAX_FRAME,
    ) -> Client:
        """Connect to the node listening on ``path``; raises Unavailable if it cannot."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(os.fspath(path))
        except OSError as exc:
            sock.close()
            raise Unavailable(f"cannot connect to {os.fspath(path)}: {exc}") from None
        return cls(sock, timeout=timeout, max_frame=max_frame)

    def close(self) -> None:
        """Close the connection (idempotent)."""
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
        self.close()
        return Unavailable(f"connection to the node failed: {why}")

    def _send(self, data: bytes) -> socket.socket:
        sock = self._sock
        if sock is None:
            raise Unavailable("the client is closed")
        try:
            sock.sendall(data)
        except OSError as exc:
            raise self._broken(str(exc)) from None
        return sock

    def _collect(self, sock: socket.socket, wanted: set[int]) -> dict[int, Response]:
        """Read until every msgid in ``wanted`` is answered. A failure (timeouts included)
        closes the connection, so a late answer can never be taken for a later call's."""
        got: dict[int, Response] = {}
        while wanted:
            try:
                data = sock.recv(1 << 18)
            except OSError as exc:
                raise self._broken(str(exc) or type(exc).__name__) from None
            if not data:
                raise self._broken("the node closed the connection")
            try:
                responses = self._decoder.feed(data)
            except ProtocolError as exc:
                raise self._broken(f"bad data from the node: {exc}") from None
            for resp in responses:
                msgid = cast(Response, resp).msgid
                if msgid in wanted:
                    got[msgid] = cast(Response, resp)
                    wanted.discard(msgid)
        return got

    def call(self, method: str, *params: Any) -> Any:
        """Call ``method`` with positional ``params``; return its result or raise."""
        msgid = self._msgid()
        sock = self._send(self._encoder.request(msgid, method, list(params)))
        resp = self._collect(sock, {msgid})[msgid]
        if resp.error is not None:
            raise from_wire(resp.error)
        return resp.result

    def pipeline(self, calls: Iterable[Call], *, return_exceptions: bool = False) -> list[Any]:
        """Send every ``(method, params)`` in one write, then collect all the answers.

        Results come back in call order. An error raises the first failing call's exception
        (after all answers are read, so the connection stays usable), or with
        ``return_exceptions=True`` is returned in its place.
        """
        batch = [(self._msgid(), method, list(params)) for method, params in calls]
        if not batch:
            return []
        sock = self._send(self._encoder.requests(batch))
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

    def track(self, tenant: str, feature: str, qty: int = 1, **opts: Any) -> int | None:
        """Add ``qty``; the new total, or None if counted but the total is not known yet."""
        return cast(int | None, self.call("track", *_track(tenant, feature, qty, opts)))

    def usage(self, tenant: str, feature: str, **opts: Any) -> int:
        """The counter's value in the current period (or the one containing ``at=``)."""
        return cast(int, self.call("usage", *_with_opts([tenant, feature], opts)))

    def usage_all(self, tenant: str, **opts: Any) -> dict[str, int]:
        """Every feature's value for ``tenant`` in the period."""
        return cast(dict[str, int], self.call("usage_all", *_with_opts([tenant], opts)))

    def reserve(
        self,
        tenant: str,
        feature: str,
        qty: int,
        limit: int | None = None,
        ttl_ms: int | None = None,
        *,
        at: float | None = None,
    ) -> str:
        """Hold ``qty`` against ``limit``; returns a reservation id (LimitExceeded if over)."""
        opts = {"limit": limit, "ttl_ms": ttl_ms, "at": at}
        params = _with_opts([tenant, feature, qty], opts)
        return cast(str, self.call("reserve", *params))

    def commit(self, reservation_id: str, actual_qty: int | None = None) -> int:
        """Turn a reservation into usage (optionally a different quantity); the new total."""
        return cast(int, self.call("commit", *_commit(reservation_id, actual_qty)))

    def release(self, reservation_id: str) -> None:
        """Drop a reservation without counting it."""
        self.call("release", reservation_id)

    def ping(self) -> str:
        """``"pong"``."""
        return cast(str, self.call("ping"))

    def status(self) -> dict[str, Any]:
        """The node's status map."""
        return cast(dict[str, Any], self.call("status"))


class _ClientProtocol(asyncio.Protocol):
    def __init__(self, max_frame: int) -> None:
        self.decoder = Decoder(side="client", max_frame=max_frame)
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
        for resp in responses:
            fut = pending.pop(cast(Response, resp).msgid, None)
            if fut is not None and not fut.done():
                fut.set_result(cast(Response, resp))

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


class AsyncClient:
    """An asyncio client over one connection; any number of calls may run concurrently."""

    def __init__(
        self,
        transport: asyncio.Transport,
        protocol: _ClientProtocol,
        *,
        timeout: float | None = None,
    ) -> None:
        self._transport = transport
        self._protocol = protocol
        self._encoder = Encoder()
        self._next = 0
        self.timeout = timeout

    @classmethod
    async def connect(
        cls,
        path: str | os.PathLike[str],
        *,
        timeout: float | None = None,
        max_frame: int = DEFAULT_MAX_FRAME,
    ) -> AsyncClient:
        """Connect to the node on ``path``; ``timeout`` bounds each call (None: no bound)."""
        loop = asyncio.get_running_loop()
        try:
            transport, protocol = await loop.create_unix_connection(
                lambda: _ClientProtocol(max_frame), os.fspath(path)
            )
        except OSError as exc:
            raise Unavailable(f"cannot connect to {os.fspath(path)}: {exc}") from None
        return cls(transport, protocol, timeout=timeout)

    async def close(self) -> None:
        """Close the connection; calls still waiting raise Unavailable."""
        self._transport.close()
        self._protocol._fail(Unavailable("the client was closed"))

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def _register(self) -> tuple[int, asyncio.Future[Response]]:
        proto = self._protocol
        if proto.lost is not None:
            raise Unavailable(proto.lost.message)
        if self._transport.is_closing():
            raise Unavailable("the client is closed")
        pending = proto.pending
        msgid = self._next
        # After a wrap-around, skip ids whose (very slow) call is still waiting.
        while msgid in pending:
            msgid = (msgid + 1) & MSGID_MAX
        self._next = (msgid + 1) & MSGID_MAX
        fut: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        pending[msgid] = fut
        return msgid, fut

    async def _wait(self, msgid: int, fut: asyncio.Future[Response]) -> Response:
        try:
            if self.timeout is None:
                return await fut
            return await asyncio.wait_for(fut, self.timeout)
        except TimeoutError:
            raise Unavailable(
                f"no answer within {self.timeout}s (the request may have been applied)"
            ) from None
        finally:
            self._protocol.pending.pop(msgid, None)

    async def call(self, method: str, *params: Any) -> Any:
        """Call ``method`` with positional ``params``; return its result or raise."""
        msgid, fut = self._register()
        try:
            data = self._encoder.request(msgid, method, list(params))
        except BaseException:
            self._protocol.pending.pop(msgid, None)
            raise
        self._transport.write(data)
        await self._protocol.drain()
        resp = await self._wait(msgid, fut)
        if resp.error is not None:
            raise from_wire(resp.error)
        return resp.result

    async def pipeline(
        self, calls: Iterable[Call], *, return_exceptions: bool = False
    ) -> list[Any]:
        """Send every ``(method, params)`` in one write and gather the answers in call order.

        An error raises the first failing call's exception once all answers are in, or with
        ``return_exceptions=True`` is returned in its place.
        """
        batch: list[tuple[int, str, list[Any]]] = []
        futs: list[tuple[int, asyncio.Future[Response]]] = []
        try:
            for method, params in calls:
                msgid, fut = self._register()
                futs.append((msgid, fut))
                batch.append((msgid, method, list(params)))
            data = self._encoder.requests(batch)
        except BaseException:
            for msgid, _ in futs:
                self._protocol.pending.pop(msgid, None)
            raise
        if not batch:
            return []
        self._transport.write(data)
        await self._protocol.drain()
        out: list[Any] = []
        first: MeterError | None = None
        for msgid, fut in futs:
            resp = await self._wait(msgid, fut)
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

    async def track(self, tenant: str, feature: str, qty: int = 1, **opts: Any) -> int | None:
        """Add ``qty``; the new total, or None if counted but the total is not known yet."""
        return cast(int | None, await self.call("track", *_track(tenant, feature, qty, opts)))

    async def usage(self, tenant: str, feature: str, **opts: Any) -> int:
        """The counter's value in the current period (or the one containing ``at=``)."""
        return cast(int, await self.call("usage", *_with_opts([tenant, feature], opts)))

    async def usage_all(self, tenant: str, **opts: Any) -> dict[str, int]:
        """Every feature's value for ``tenant`` in the period."""
        return cast(dict[str, int], await self.call("usage_all", *_with_opts([tenant], opts)))

    async def reserve(
        self,
        tenant: str,
        feature: str,
        qty: int,
        limit: int | None = None,
        ttl_ms: int | None = None,
        *,
        at: float | None = None,
    ) -> str:
        """Hold ``qty`` against ``limit``; returns a reservation id (LimitExceeded if over)."""
        opts = {"limit": limit, "ttl_ms": ttl_ms, "at": at}
        params = _with_opts([tenant, feature, qty], opts)
        return cast(str, await self.call("reserve", *params))

    async def commit(self, reservation_id: str, actual_qty: int | None = None) -> int:
        """Turn a reservation into usage (optionally a different quantity); the new total."""
        return cast(int, await self.call("commit", *_commit(reservation_id, actual_qty)))

    async def release(self, reservation_id: str) -> None:
        """Drop a reservation without counting it."""
        await self.call("release", reservation_id)

    async def ping(self) -> str:
        """``"pong"``."""
        return cast(str, await self.call("ping"))

    async def status(self) -> dict[str, Any]:
        """The node's status map."""
        return cast(dict[str, Any], await self.call("status"))
