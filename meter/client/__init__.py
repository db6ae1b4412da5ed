"""Clients for a meter node: :class:`AsyncClient` (asyncio) and :class:`Client` (blocking).

Both speak MessagePack-RPC over the node's Unix socket, pipeline requests (responses are
matched by msgid, so order does not matter), raise the typed exceptions of
:mod:`meter.errors` for error responses, and raise :class:`~meter.errors.Unavailable` when the
connection fails.

Request ids and retries (the contract is in docs/protocol.md, "Request ids and retries"):

- Every mutating call (``track``, ``track_many``, ``reserve``, ``commit``, ``release``,
  ``void``) carries a request id: a fresh random one per call (:func:`new_request_id`), or
  the caller's own (``id=...``). ``auto_ids=False`` turns the automatic ones off.
- The typed methods retry a call that got no answer (connection lost, timed out, node
  restarting) or was answered ``unavailable``: they reconnect to the same socket path and
  send the call again, with the *same* id, with backoff, until ``retry_timeout`` seconds have
  passed since the call started; then they raise the last :class:`~meter.errors.Unavailable`.
  The node counts a repeated id once, so a retried call is never counted twice.
- A call without an id (``auto_ids=False`` and no ``id=``) that got no answer is not retried
  (``track`` / ``reserve`` / ``track_many`` might have been counted); one answered
  ``unavailable`` is (the node counted nothing). ``commit`` / ``release`` are idempotent by
  reservation id, a ``void`` takes a call back once, and reads change nothing, so those are
  always retried.
- Other errors (``invalid_argument``, ``limit_exceeded``, ``conflict``, ``not_found``, ...) are
  never retried. ``call()`` and ``pipeline()`` make one attempt (reconnecting first if the
  connection was lost) and never add ids. ``connect()`` itself does not retry.

The package, by what it holds: :mod:`~meter.client.calls` (the typed methods, defined once
for both clients: params, request ids, retry kind, answers), :mod:`~meter.client.blocking`
and :mod:`~meter.client.aio` (each client's transport and its wrappers of the table),
:mod:`~meter.client.stream` (the blocking client's connection),
:mod:`~meter.client.retry` (backoff and the reading of answers) and
:mod:`~meter.client.inbox` (what subscriptions receive). This module only names the public
ones.
"""

from __future__ import annotations

from meter.client.aio import AsyncClient, _ClientProtocol
from meter.client.blocking import DEFAULT_TIMEOUT, Client
from meter.client.calls import (
    MAX_REQUEST_ID_BYTES,
    Call,
    TrackItem,
    check_request_id,
    new_request_id,
)
from meter.client.inbox import MAX_BUFFERED, Usage
from meter.client.retry import DEFAULT_RETRY_TIMEOUT, RETRY_BACKOFF_MAX, RETRY_BACKOFF_MIN
from meter.client.stream import SIGNAL_CHECK_S
from storage.base import ExportRow

__all__ = [
    "DEFAULT_RETRY_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "MAX_BUFFERED",
    "MAX_REQUEST_ID_BYTES",
    "RETRY_BACKOFF_MAX",
    "RETRY_BACKOFF_MIN",
    "SIGNAL_CHECK_S",
    "AsyncClient",
    "Call",
    "Client",
    "ExportRow",
    "TrackItem",
    "Usage",
    "_ClientProtocol",
    "check_request_id",
    "new_request_id",
]
