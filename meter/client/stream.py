"""One Unix socket connection of the blocking client: requests out, answers in, notifications
to the inbox. The client (:class:`~meter.client.blocking.Client`) opens one, and a new one
after a failure; a failure closes the stream, so a late answer can never be taken for a later
call's."""

from __future__ import annotations

import socket
from typing import Any, cast

from meter.client.inbox import Inbox
from meter.core.protocol import MSGID_MAX, Decoder, Encoder, Notification, ProtocolError, Response
from meter.errors import Unavailable

#: The longest single wait of a subscription waiting with no end, so Ctrl-C is handled.
SIGNAL_CHECK_S = 0.5


def connect(path: str, timeout: float | None) -> socket.socket:
    """A socket connected to the node at ``path``; Unavailable if it cannot be."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
    except OSError as exc:
        sock.close()
        raise Unavailable(f"cannot connect to {path}: {exc}") from None
    return sock


class Stream:
    """One connection's bytes, read and written in the caller's thread."""

    __slots__ = ("closed", "decoder", "encoder", "inbox", "msgids", "sock", "timeout")

    def __init__(
        self,
        sock: socket.socket,
        *,
        timeout: float | None,
        max_frame: int,
        encoder: Encoder,
        inbox: Inbox,
        msgids: list[int],
    ) -> None:
        """``msgids`` is the client's one-cell counter of message ids, shared by its streams."""
        self.sock = sock
        sock.settimeout(timeout)
        self.timeout = timeout
        self.encoder = encoder
        self.decoder = Decoder(side="client", max_frame=max_frame)
        self.inbox = inbox
        self.msgids = msgids
        self.closed = False

    def next_msgid(self) -> int:
        msgid = self.msgids[0]
        self.msgids[0] = (msgid + 1) & MSGID_MAX
        return msgid

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()

    def broken(self, why: str) -> Unavailable:
        """Close the stream; the error to raise."""
        self.close()
        return Unavailable(f"connection to the node failed: {why}")

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError as exc:
            raise self.broken(str(exc)) from None

    def collect(self, wanted: set[int]) -> dict[int, Response]:
        """Read until every msgid in ``wanted`` is answered. A failure (timeouts included)
        closes the stream."""
        got: dict[int, Response] = {}
        while wanted:
            try:
                data = self.sock.recv(1 << 18)
            except OSError as exc:
                raise self.broken(str(exc) or type(exc).__name__) from None
            for resp in self._responses(data):
                if resp.msgid in wanted:
                    got[resp.msgid] = resp
                    wanted.discard(resp.msgid)
        return got

    def exchange(self, method: str, params: list[Any]) -> Response:
        """Send one request and read its answer."""
        msgid = self.next_msgid()
        self.send(self.encoder.request(msgid, method, params))
        return self.collect({msgid})[msgid]

    def _responses(self, data: bytes) -> list[Response]:
        """Decode what the node sent: notifications go to the inbox, responses are returned."""
        if not data:
            raise self.broken("the node closed the connection")
        try:
            messages = self.decoder.feed(data)
        except ProtocolError as exc:
            raise self.broken(f"bad data from the node: {exc}") from None
        out: list[Response] = []
        for msg in messages:
            if type(msg) is Notification:
                self.inbox.add(msg.params, msg.method)
            else:
                out.append(cast(Response, msg))
        return out

    def read_notes(self, timeout: float | None) -> bool:
        """Read what the node sends for up to ``timeout`` seconds (None: until something
        comes); False if nothing came in time.

        A wait with no end is made of waits of at most :data:`SIGNAL_CHECK_S`: a signal
        (Ctrl-C) that arrives just before a blocking ``recv`` is only handled once Python code
        runs again, and compiled code in between never checks for one (``meter watch``)."""
        sock = self.sock
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
            raise self.broken(str(exc) or type(exc).__name__) from None
        finally:
            if not self.closed:
                sock.settimeout(self.timeout)
        # (A response now answers a call that timed out: its connection was dropped.)
        self._responses(data)
        return True
