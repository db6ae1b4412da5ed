"""The two Python clients offer the same typed methods and send the same calls for them."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any, cast

import pytest

from meter.client import AsyncClient, Client, ExportRow, _ClientProtocol
from storage.base import ExportRow as StoredRow

#: What a recording client answers every call with.
ANSWER = {"allowed": True, "value": 13}


class _RecordingClient(Client):
    """A blocking client whose calls are recorded and answered here (no node, no retries)."""

    def __init__(self, sock: socket.socket, **kwargs: Any) -> None:
        super().__init__(sock, **kwargs)
        self.sent: list[tuple[str, list[Any], bool]] = []

    def _invoke(self, method: str, params: list[Any], retry_unanswered: bool) -> Any:
        self.sent.append((method, params, retry_unanswered))
        return ANSWER


class _RecordingAsyncClient(AsyncClient):
    """The asyncio client, recorded the same way."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cast(asyncio.Transport, None), _ClientProtocol(1 << 20), **kwargs)
        self.sent: list[tuple[str, list[Any], bool]] = []

    async def _invoke(self, method: str, params: list[Any], retry_unanswered: bool) -> Any:
        self.sent.append((method, params, retry_unanswered))
        return ANSWER


@pytest.fixture
def clients() -> Iterator[tuple[_RecordingClient, _RecordingAsyncClient]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        yield _RecordingClient(sock, auto_ids=False), _RecordingAsyncClient(auto_ids=False)
    finally:
        sock.close()


async def test_track_detail_is_on_both_clients_and_sends_the_same(
    clients: tuple[_RecordingClient, _RecordingAsyncClient],
) -> None:
    blocking, aio = clients
    assert blocking.track_detail("acme", "api", 5, id="r-1", at=7) == ANSWER
    assert await aio.track_detail("acme", "api", 5, id="r-1", at=7) == ANSWER
    sent = ("track", ["acme", "api", 5, {"at": 7, "detail": True, "id": "r-1"}], True)
    assert blocking.sent == aio.sent == [sent]
    assert blocking.track_detail("acme", "api") == ANSWER  # no id: not sent again unanswered
    assert blocking.sent[-1] == ("track", ["acme", "api", 1, {"detail": True}], False)


def test_export_rows_are_equal_to_the_storage_rows_they_were_before() -> None:
    """The client decodes ``export`` rows into its own :class:`ExportRow` (it imports no
    storage code); they compare and hash as the storage rows it used to return."""
    row, stored = ExportRow("t0", "old", "2020-01", 9), StoredRow("t0", "old", "2020-01", 9)
    assert row == stored and stored == row
    assert [row] == [stored]  # as tests/test_export.py compares a page
    assert hash(row) == hash(stored) and len({row, stored}) == 1
    assert repr(row) == repr(stored)
    assert row != StoredRow("t0", "old", "2020-01", 8)
    assert row != ("t0", "old", "2020-01", 9)  # no more a tuple than a storage row is
