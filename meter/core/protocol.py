"""The MessagePack-RPC codec: bytes in, messages out, and back. Pure: no I/O, no asyncio.

Shapes (see ``docs/protocol.md``)::

    request       [0, msgid, method, params]
    response      [1, msgid, error, result]
    notification  [2, method, params]

A :class:`Decoder` is fed the bytes of one connection as they arrive and returns the complete
messages. It separates two kinds of trouble:

* a frame that is well-formed MessagePack but not a valid request (wrong arity, params not an
  array, method not a string, a response sent to the server) becomes an :class:`Invalid`; if its
  msgid could be read the server answers it with an ``invalid_argument`` error and the
  connection stays open;
* bytes that are not MessagePack, a frame over the size limit, strings/arrays/maps over their
  limits, nesting deeper than msgpack's stack, a top-level value that is not an array, or a
  request whose msgid cannot be read raise :class:`ProtocolError`: the stream can no longer be
  trusted and the connection must be closed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final, NamedTuple, cast

import msgpack

#: Message type tags.
REQUEST: Final = 0
RESPONSE: Final = 1
NOTIFICATION: Final = 2

#: A msgid is an unsigned 32-bit integer.
MSGID_MAX: Final = 2**32 - 1

#: Largest frame (one encoded message), in bytes. Configurable per decoder.
DEFAULT_MAX_FRAME: Final = 1 << 20
#: Longest str value (bytes once encoded).
MAX_STR_LEN: Final = 1 << 16
#: Longest bin value.
MAX_BIN_LEN: Final = 1 << 16
#: Most elements in one array.
MAX_ARRAY_LEN: Final = 1 << 16
#: Most entries in one map.
MAX_MAP_LEN: Final = 1 << 16
#: Longest ext payload; the protocol uses no ext types, this only lets a timestamp through to
#: argument validation instead of killing the connection.
MAX_EXT_LEN: Final = 16
#: Deepest nesting of arrays and maps: msgpack's built-in unpacker stack (not configurable).
MAX_DEPTH: Final = 1024

ErrorMap = dict[str, str]


class ProtocolError(Exception):
    """The byte stream is unusable (garbage, oversized, too deep); close the connection.

    ``messages`` holds the messages decoded before the bad bytes, so they can still be served.
    """

    def __init__(self, message: str, messages: list[Message] | None = None) -> None:
        super().__init__(message)
        self.messages: list[Message] = messages if messages is not None else []


class Request(NamedTuple):
    """``[0, msgid, method, params]``; ``method`` is always a str here."""

    msgid: int
    method: str
    params: list[Any]


class Response(NamedTuple):
    """``[1, msgid, error, result]``; ``error`` is None or (from this server) an error map."""

    msgid: int
    error: Any
    result: Any


class Notification(NamedTuple):
    """``[2, method, params]``: never answered."""

    method: str
    params: list[Any]


class Invalid(NamedTuple):
    """Well-formed MessagePack but not a valid message. Answer it if ``msgid`` is not None."""

    msgid: int | None
    reason: str


Message = Request | Response | Notification | Invalid
#: What :meth:`Decoder.feed_raw` returns for the common well-formed request: the decoded array
#: ``[0, msgid, method, params]`` itself, with ``msgid`` a uint32, ``method`` a str and
#: ``params`` a list (exactly the checks :class:`Request` would get).
RawRequest = list[Any]

# NamedTuple.__new__ is a Python-level function; tuple.__new__ skips it on the hot path.
_new = tuple.__new__


# Compared by identity on the decoder's fast path (see Decoder._drain).
_REQUEST_KIND: Final = REQUEST


def _cook(messages: list[Any]) -> list[Message]:
    """Turn the raw requests of a :meth:`Decoder.feed_raw` result into :class:`Request`."""
    return [_new(Request, (m[1], m[2], m[3])) if type(m) is list else m for m in messages]


def invalid_error(reason: str) -> ErrorMap:
    """The error map sent for an :class:`Invalid` message."""
    return {"code": "invalid_argument", "message": reason}


def _method_name(method: object) -> str | None:
    if type(method) is str:
        return method
    if isinstance(method, bytes | bytearray):
        # Older clients send the method as raw/bin bytes.
        return bytes(method).decode("utf-8", "surrogateescape")
    return None


def _is_msgid(value: object) -> bool:
    # type() rather than isinstance(): True/False are ints to Python but not msgids.
    return type(value) is int and 0 <= value <= MSGID_MAX


class Decoder:
    """Incremental decoder for one connection's byte stream.

    ``side="server"`` accepts requests and notifications (a response becomes :class:`Invalid`);
    ``side="client"`` accepts responses and notifications (anything else is a
    :class:`ProtocolError`).
    After a :class:`ProtocolError` the decoder stays broken; every further feed raises.
    """

    __slots__ = (
        "_broken",
        "_buffer_size",
        "_classify",
        "_fed",
        "_frame_start",
        "_max_frame",
        "_server",
        "_unpacker",
    )

    def __init__(
        self,
        *,
        side: str = "server",
        max_frame: int = DEFAULT_MAX_FRAME,
        max_str_len: int = MAX_STR_LEN,
        max_bin_len: int = MAX_BIN_LEN,
        max_array_len: int = MAX_ARRAY_LEN,
        max_map_len: int = MAX_MAP_LEN,
    ) -> None:
        if side not in ("server", "client"):
            raise ValueError(f"side must be 'server' or 'client', not {side!r}")
        if max_frame < 16:
            raise ValueError("max_frame must be at least 16 bytes")
        self._max_frame = max_frame
        # Room for one whole frame plus a large read, so a legal frame never hits BufferFull;
        # feed() slices its input so the unpacker's own limit is never reached.
        self._buffer_size = 2 * max_frame
        self._unpacker = msgpack.Unpacker(
            raw=False,
            use_list=True,
            # Bad UTF-8 in a str must not kill the connection; argument checks reject it.
            unicode_errors="surrogateescape",
            # Only str/bytes map keys: int keys have predictable hashes (hash flooding).
            strict_map_key=True,
            max_buffer_size=self._buffer_size,
            max_str_len=min(max_str_len, max_frame),
            max_bin_len=min(max_bin_len, max_frame),
            max_array_len=max_array_len,
            max_map_len=max_map_len,
            max_ext_len=MAX_EXT_LEN,
        )
        self._server = side == "server"
        self._classify = self._server_message if self._server else self._client_message
        self._fed = 0  # total bytes fed
        self._frame_start = 0  # stream offset where the current (incomplete) frame starts
        self._broken: str | None = None

    @property
    def max_frame(self) -> int:
        """The frame size limit in bytes."""
        return self._max_frame

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame received so far."""
        return self._fed - self._frame_start

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        """Add received bytes; return every message they complete, in stream order.

        Raises :class:`ProtocolError` (carrying the messages decoded before the fault).
        """
        try:
            out = self.feed_raw(data)
        except ProtocolError as exc:
            exc.messages = _cook(exc.messages)
            raise
        return _cook(out) if self._server else cast(list[Message], out)

    def feed_raw(self, data: bytes | bytearray | memoryview) -> list[RawRequest | Message]:
        """Like :meth:`feed`, but a well-formed request with a str method comes back as its
        decoded array (a :data:`RawRequest`, ``type(m) is list``) instead of a
        :class:`Request`: the server's hot path, which saves building a tuple per request.
        Every other message (a request with a raw/bin method name included) is classified
        exactly as :meth:`feed` does. A :class:`ProtocolError`'s ``messages`` are raw too.
        """
        if self._broken is not None:
            raise ProtocolError(self._broken)
        out: list[RawRequest | Message] = []
        size = len(data)
        unpacker = self._unpacker
        room = self._buffer_size - (self._fed - unpacker.tell())
        if size <= room:
            unpacker.feed(data)
            self._fed += size
            self._drain(out)
            return out
        view = memoryview(data)
        pos = 0
        while pos < size:
            room = self._buffer_size - (self._fed - unpacker.tell())
            chunk = view[pos : pos + room]
            unpacker.feed(chunk)
            self._fed += len(chunk)
            pos += len(chunk)
            self._drain(out)
        return out

    def _drain(self, out: list[Any]) -> None:
        unpacker = self._unpacker
        tell = unpacker.tell
        max_frame = self._max_frame
        start = self._frame_start
        classify = self._classify
        # Every frame completed below lies within the bytes received since `start` (the start
        # of the first incomplete frame). If those fit the limit, no frame can exceed it and
        # the per-frame comparison is skipped. tell() is still needed per frame: the next
        # call's limit counts from where the last complete frame ended.
        check = self._fed - start > max_frame
        msgid_max = MSGID_MAX
        try:
            if check or not self._server:
                for obj in unpacker:
                    end = tell()
                    if end - start > max_frame:
                        self._fail(
                            f"frame of {end - start} bytes exceeds the {max_frame}-byte limit", out
                        )
                    start = end
                    out.append(classify(obj))
            else:
                # The server's common case, specialised: no frame can exceed the limit, and
                # the common well-formed request is checked inline and passed through as is;
                # anything that fails a check gets the full classification.
                for obj in unpacker:
                    start = tell()
                    if type(obj) is list and len(obj) == 4:
                        kind, msgid, method, params = obj
                        # `is`: a decoded 0 is CPython's cached small int; a kind that is 0
                        # but not that object (or False, or 0.0) takes the full path.
                        if (
                            kind is _REQUEST_KIND
                            and type(msgid) is int
                            and 0 <= msgid <= msgid_max
                            and type(method) is str
                            and type(params) is list
                        ):
                            out.append(obj)
                            continue
                    out.append(classify(obj))
        except ProtocolError as exc:
            self._broken = str(exc)
            exc.messages = out
            raise
        except (ValueError, TypeError, msgpack.UnpackException) as bad:
            # FormatError, StackError, over-limit lengths, bad map keys, unhashable keys.
            self._fail(f"malformed MessagePack: {type(bad).__name__}: {bad}"[:200], out)
        self._frame_start = start
        if self._fed - start > max_frame:
            self._fail(
                f"frame of more than {max_frame} bytes (received {self._fed - start} so far)", out
            )

    def _fail(self, reason: str, out: list[Any]) -> None:
        self._broken = reason
        raise ProtocolError(reason, out)

    @staticmethod
    def _server_message(obj: Any) -> Message:
        if type(obj) is not list or not obj:
            raise ProtocolError(f"a message must be a non-empty array, got {type(obj).__name__}")
        kind = obj[0]
        n = len(obj)
        if type(kind) is int and kind == REQUEST:
            msgid = obj[1] if n > 1 else None
            if not _is_msgid(msgid):
                raise ProtocolError("request without a valid msgid (uint32)")
            if n != 4:
                return _new(Invalid, (msgid, f"a request has 4 elements, got {n}"))
            method = _method_name(obj[2])
            if method is None:
                return _new(Invalid, (msgid, "method must be a string"))
            params = obj[3]
            if type(params) is not list:
                return _new(Invalid, (msgid, "params must be an array"))
            return _new(Request, (msgid, method, params))
        if type(kind) is int and kind == NOTIFICATION:
            if n != 3:
                return _new(Invalid, (None, f"a notification has 3 elements, got {n}"))
            method = _method_name(obj[1])
            if method is None:
                return _new(Invalid, (None, "notification method must be a string"))
            params = obj[2]
            if type(params) is not list:
                return _new(Invalid, (None, "notification params must be an array"))
            return _new(Notification, (method, params))
        if type(kind) is int and kind == RESPONSE:
            msgid = obj[1] if n > 1 else None
            if not _is_msgid(msgid):
                raise ProtocolError("response-typed message without a valid msgid")
            return _new(Invalid, (msgid, "the server accepts requests (0) and notifications (2)"))
        raise ProtocolError(f"unknown message type {kind!r}"[:100])

    @staticmethod
    def _client_message(obj: Any) -> Message:
        if type(obj) is list and len(obj) == 3 and obj[0] == NOTIFICATION and type(obj[0]) is int:
            # A node's notification (``subscribe``): delivered, never answered.
            method = _method_name(obj[1])
            if method is None or type(obj[2]) is not list:
                raise ProtocolError("expected a notification [2, method, params]")
            return _new(Notification, (method, obj[2]))
        if type(obj) is not list or len(obj) != 4:
            raise ProtocolError("expected a response [1, msgid, error, result]")
        kind, msgid, error, result = obj
        if type(kind) is not int or kind != RESPONSE or not _is_msgid(msgid):
            raise ProtocolError("expected a response [1, msgid, error, result]")
        return _new(Response, (msgid, error, result))


class Encoder:
    """Encodes messages with reusable packers (one per encoder; not thread-safe).

    A result that cannot be encoded (a set, an int beyond 64 bits) is answered with an
    ``internal`` error instead, and counted in :attr:`encode_errors`.
    """

    __slots__ = ("_batch", "_one", "encode_errors", "last_encode_error")

    def __init__(self) -> None:
        opts: dict[str, Any] = {"use_bin_type": True, "unicode_errors": "surrogateescape"}
        self._one = msgpack.Packer(autoreset=True, **opts)
        self._batch = msgpack.Packer(autoreset=False, **opts)
        self.encode_errors = 0
        self.last_encode_error = ""

    def request(self, msgid: int, method: str, params: list[Any] | tuple[Any, ...]) -> bytes:
        """``[0, msgid, method, params]``. Raises TypeError/ValueError for unencodable params."""
        data: bytes = self._one.pack([REQUEST, msgid, method, params])
        return data

    def requests(self, calls: Iterable[tuple[int, str, list[Any] | tuple[Any, ...]]]) -> bytes:
        """Several requests ``(msgid, method, params)`` in one buffer."""
        packer = self._batch
        try:
            for msgid, method, params in calls:
                packer.pack([REQUEST, msgid, method, params])
            data: bytes = packer.bytes()
            return data
        finally:
            packer.reset()

    def notification(self, method: str, params: list[Any] | tuple[Any, ...]) -> bytes:
        """``[2, method, params]``."""
        data: bytes = self._one.pack([NOTIFICATION, method, params])
        return data

    def notifications(self, method: str, params: list[list[Any]]) -> bytes:
        """``[2, method, p]`` for each ``p`` of ``params``, in one buffer; one that cannot be
        encoded (an int beyond 64 bits) is left out and counted in :attr:`encode_errors`."""
        arrays = [[NOTIFICATION, method, p] for p in params]
        try:
            data: bytes = self._one.pack(arrays)
        except (TypeError, ValueError, OverflowError):
            parts: list[bytes] = []
            for array in arrays:
                try:
                    parts.append(self._one.pack(array))
                except (TypeError, ValueError, OverflowError) as exc:
                    self._unencodable(exc)
            return b"".join(parts)
        n = len(arrays)
        return data[1 if n < 16 else 3 if n < 0x10000 else 5 :]  # as response_arrays

    def response(self, msgid: int, error: ErrorMap | None, result: Any) -> bytes:
        """``[1, msgid, error, result]``; never raises for an unencodable result."""
        try:
            data: bytes = self._one.pack([RESPONSE, msgid, error, result])
        except (TypeError, ValueError, OverflowError) as exc:
            data = self._one.pack([RESPONSE, msgid, self._unencodable(exc), None])
        return data

    def responses(self, answers: list[tuple[int, ErrorMap | None, Any]]) -> bytes:
        """Several responses ``(msgid, error, result)`` in one buffer."""
        return self.response_arrays([[RESPONSE, m, e, r] for m, e, r in answers])

    def response_arrays(self, responses: list[list[Any]]) -> bytes:
        """Several responses already shaped ``[1, msgid, error, result]``, in one buffer;
        never raises for an unencodable result (that one is answered ``internal``)."""
        try:
            if len(responses) == 1:  # the unpipelined call: no header to cut off (no copy)
                one: bytes = self._one.pack(responses[0])
                return one
            # One pack call for the batch: pack the list of responses as one array and drop
            # its header; what follows the header is exactly the responses back to back.
            data: bytes = self._one.pack(responses)
        except (TypeError, ValueError, OverflowError):
            return b"".join([self.response(m, e, r) for _, m, e, r in responses])
        n = len(responses)
        # fixarray header (1 byte) up to 15 elements, array 16 (3 bytes), array 32 (5 bytes).
        return data[1 if n < 16 else 3 if n < 0x10000 else 5 :]

    def _unencodable(self, exc: Exception) -> ErrorMap:
        self.encode_errors += 1
        self.last_encode_error = f"{type(exc).__name__}: {exc}"[:200]
        return {"code": "internal", "message": "the result could not be encoded"}


def packb(obj: Any) -> bytes:
    """Encode one value the way the protocol does (str as str, bytes as bin)."""
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data
