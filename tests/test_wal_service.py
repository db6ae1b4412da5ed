"""The write-ahead log in process, under the real service and server: answers leave only after
their record is written, one commit serves many connections, a failed write undoes every kind
of call it held, and request ids count once however the call is repeated."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import shutil
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meter.config import CounterConfig
from meter.core.idempotency import RequestIds
from meter.core.keys import period_start
from meter.core.server import RpcServer
from meter.core.service import Service
from meter.core.table import CounterTable
from meter.errors import Conflict, NotFound, Unavailable
from meter.node.wiring import build_service, serve
from meter.persist.flusher import Flusher
from meter.persist.recovery import recover
from meter.quotas.escrow import Local
from meter.quotas.shares import Shares
from meter.wal import records as R
from meter.wal.log import WriteAheadLog, list_segments, segment_path
from meter.wal.replay import Replay
from storage.memory import MemoryStorage
from tests.support.nodes import BACKFILL_GRACE_S, short_tmpdir

KEY = ("acme", "api")


class SlowStorage(MemoryStorage):
    """Seeding reads wait until released, so two calls can wait on one cold key together."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def load(self, keys: Any) -> Any:
        await self.gate.wait()
        return await super().load(keys)


@pytest.fixture
def tmp() -> Iterator[Path]:
    d = short_tmpdir("ws-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def make(
    tmp: Path, storage: MemoryStorage | None = None, gossip: bool = True
) -> tuple[Service, WriteAheadLog]:
    wal = WriteAheadLog(tmp / "wal", node_id="n1", mode="fsync")
    table = CounterTable("n1", gossip=gossip)
    store = storage or MemoryStorage()
    svc = build_service(table, store, CounterConfig(), wal=wal, ids=RequestIds(3600, 1000))
    wal.recover()
    wal.open(svc.undo, svc.checkpoint, svc.journal.closing)
    return svc, wal


def broken(wal: WriteAheadLog) -> str | None:
    return wal.broken


def dirty(wal: WriteAheadLog) -> bool:
    return wal.dirty


async def call(svc: Service, method: str, *params: Any) -> Any:
    result = svc.dispatch(method, list(params))
    if inspect.isawaitable(result):
        return await result
    return result


async def settle() -> None:
    """Let the pending commit (one loop pass) run."""
    for _ in range(3):
        await asyncio.sleep(0)


def logged(wal: WriteAheadLog) -> list[list[Any]]:
    numbers = list_segments(wal.directory)
    out: list[list[Any]] = []
    for n in numbers:
        out.extend(R.scan(segment_path(wal.directory, n).read_bytes()).records)
    return out


@contextlib.contextmanager
def disk_full(wal: WriteAheadLog) -> Iterator[None]:
    """Point the log's file descriptor at /dev/full (every write: ENOSPC), then back."""
    saved = os.dup(wal._fd)
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, wal._fd)
    os.close(full)
    try:
        yield
    finally:
        os.dup2(saved, wal._fd)
        os.close(saved)


async def test_every_call_kind_is_logged_and_a_failed_write_undoes_it(tmp: Path) -> None:
    svc, wal = await make(tmp)
    t = svc.table
    assert await call(svc, "track", *KEY, 10) == 10
    rid = await call(svc, "reserve", *KEY, 5)
    done = await call(svc, "reserve", *KEY, 3)
    await settle()
    (key,) = list(t.keys())
    before = t.columns(key)
    assert before is not None and before["value"] == 18
    with disk_full(wal):
        assert await call(svc, "track", *KEY, 7, {"id": "t1"}) == 25
        assert await call(svc, "track_many", [[*KEY, 1, {"id": "m1"}], [*KEY, 2]]) == [26, 28]
        assert await call(svc, "commit", rid, 4, {"id": "c1"}) == 27
        assert await call(svc, "release", done) is None
        other = await call(svc, "reserve", *KEY, 9, {"id": "r1"})
        await settle()  # the commit fails: every effect above is taken back
        assert wal.broken is not None and "disk full" in wal.broken
        assert t.columns(key) == before
        assert len(svc.ids) == 0
        assert svc.reservations.get(other) is None
        assert svc.reservations.get(rid) is not None and svc.reservations.get(done) is not None
        # While broken, nothing is counted; reads still answer.
        with pytest.raises(Unavailable):
            await call(svc, "track", *KEY, 1)
        with pytest.raises(Unavailable):
            await call(svc, "commit", rid)
        assert await call(svc, "usage", *KEY) == 18
    # The probe finds the disk writable again and the log resumes.
    for _ in range(100):
        if broken(wal) is None:
            break
        await asyncio.sleep(0.05)
    assert broken(wal) is None
    assert await call(svc, "commit", rid, 4) == 17
    await settle()
    kinds = [r[0] for r in logged(wal)]
    assert kinds.count(R.TRACK) == 1 and kinds.count(R.RESERVE) == 2 and R.COMMIT in kinds
    await wal.close()


async def test_a_usage_all_answers_only_what_the_log_committed(tmp: Path) -> None:
    """usage_all reads the loaded counters as it arrives (P06), maybe before the log committed
    the calls just before it: it answers once they are committed, unavailable if they fail."""
    svc, wal = await make(tmp)
    assert await call(svc, "track", *KEY, 1) == 1
    await settle()
    assert svc.dispatch("track", [*KEY, 2]) == 3  # in the open batch
    listing = svc.dispatch("usage_all", ["acme"])
    assert await listing == {"api": 3}
    assert not dirty(wal), "answered after the commit"
    with disk_full(wal):
        assert svc.dispatch("track", [*KEY, 4]) == 7
        listing = svc.dispatch("usage_all", ["acme"])  # sees 7: not true if the write fails
        with pytest.raises(Unavailable):
            await listing
        assert broken(wal) is not None
        assert await call(svc, "usage_all", "acme") == {"api": 3}, "reads still answer"
    await wal.close()


async def test_a_retried_id_counts_once_and_another_payload_conflicts(tmp: Path) -> None:
    svc, wal = await make(tmp)
    assert await call(svc, "track", *KEY, 5, {"id": "a"}) == 5
    assert await call(svc, "track", *KEY, 5, {"id": "a"}) == 5
    with pytest.raises(Conflict):
        await call(svc, "track", *KEY, 6, {"id": "a"})
    with pytest.raises(Conflict):
        await call(svc, "reserve", *KEY, 5, {"id": "a"})
    # Within one batch: the repeat answers as the first item; another payload conflicts.
    out = await call(
        svc, "track_many", [[*KEY, 2, {"id": "b"}], [*KEY, 2, {"id": "b"}], [*KEY, 3, {"id": "b"}]]
    )
    assert out[:2] == [7, 7]
    assert out[2]["code"] == "conflict"
    assert await call(svc, "track_many", [[*KEY, 2, {"id": "b"}], [*KEY, 1, {"id": "a"}]]) == [
        7,
        {"code": "conflict", "message": out[2]["message"].replace("'b'", "'a'")},
    ]
    assert await call(svc, "usage", *KEY) == 7
    rid = await call(svc, "reserve", *KEY, 4, {"id": "r"})
    assert await call(svc, "reserve", *KEY, 4, {"id": "r"}) == rid
    assert len(svc.reservations) == 1
    await wal.close()


async def test_two_calls_with_one_id_waiting_on_a_cold_key_count_once(tmp: Path) -> None:
    store = SlowStorage()
    svc, wal = await make(tmp, store)
    first = asyncio.ensure_future(call(svc, "track", *KEY, 5, {"id": "x"}))
    second = asyncio.ensure_future(call(svc, "track", *KEY, 5, {"id": "x"}))
    many = asyncio.ensure_future(call(svc, "track_many", [[*KEY, 5, {"id": "x"}]]))
    await asyncio.sleep(0.01)
    assert not first.done()
    store.gate.set()
    assert await first == 5
    assert await second == 5
    assert await many == [5]
    assert await call(svc, "usage", *KEY) == 5
    await wal.close()


# -- through the socket server ---------------------------------------------------------------


@pytest.fixture
async def served(tmp: Path) -> AsyncIterator[tuple[Service, WriteAheadLog, RpcServer, str]]:
    svc, wal = await make(tmp)
    path = str(tmp / "s.sock")
    server = await serve(path, svc)
    yield svc, wal, server, path
    await server.close()
    await wal.close()


async def rpc(path: str, *requests: list[Any]) -> list[list[Any]]:
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(b"".join(msgpack.packb([0, i, m, p]) for i, (m, p) in enumerate(requests)))
    unpacker = msgpack.Unpacker(raw=False)
    out: list[list[Any]] = []
    while len(out) < len(requests):
        data = await reader.read(65536)
        assert data, "the node closed the connection"
        unpacker.feed(data)
        out.extend(unpacker)
    writer.close()
    return sorted(out, key=lambda r: r[1])


async def test_an_answer_leaves_only_once_its_record_is_on_disk(
    served: tuple[Service, WriteAheadLog, RpcServer, str],
) -> None:
    _, wal, _, path = served
    for i in range(20):
        (resp,) = await rpc(path, ["track", ["acme", "api", 1, {"id": f"d{i}"}]])
        assert resp[2] is None and resp[3] == i + 1
        # Read from the file, not memory: the record is there as soon as the answer is.
        ids = [r[5] for r in logged(wal) if r[0] == R.TRACK_ID]
        assert f"d{i}" in ids


class Transport:
    """Just enough of a transport for ``data_received``: keeps what is written."""

    def __init__(self) -> None:
        self.written = b""

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return False

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


async def test_answers_wait_for_the_commit_of_their_pass(
    served: tuple[Service, WriteAheadLog, RpcServer, str],
) -> None:
    from meter.core.server import _Connection

    svc, wal, server, _ = served
    reader, writer = _Connection(server), _Connection(server)
    t1, t2 = Transport(), Transport()
    reader.connection_made(t1)  # type: ignore[arg-type]
    writer.connection_made(t2)  # type: ignore[arg-type]
    await call(svc, "track", "acme", "api", 1)  # warm the key
    await settle()
    writer.data_received(msgpack.packb([0, 1, "track", ["acme", "api", 1]]))
    reader.data_received(msgpack.packb([0, 2, "usage", ["acme", "api"]]))
    # Nothing leaves before the record of this pass is written: not the track's answer, and
    # not a read that would show the unit.
    assert dirty(wal) and t1.written == b"" and t2.written == b""
    for _ in range(200):  # two callers: synced in the sync thread
        if not dirty(wal):
            break
        await asyncio.sleep(0.005)
    assert not dirty(wal)
    assert msgpack.unpackb(t2.written) == [1, 1, None, 2]
    assert msgpack.unpackb(t1.written) == [1, 2, None, 2]
    # A pass that changes nothing answers at once.
    reader.data_received(msgpack.packb([0, 3, "usage", ["acme", "api"]]))
    assert msgpack.unpackb(t1.written[len(msgpack.packb([1, 2, None, 2])) :]) == [1, 3, None, 2]
    reader.connection_lost(None)
    writer.connection_lost(None)


async def test_one_commit_serves_many_connections(
    served: tuple[Service, WriteAheadLog, RpcServer, str],
) -> None:
    svc, wal, _, path = served
    conns = [socket.socket(socket.AF_UNIX) for _ in range(16)]
    for s in conns:
        s.connect(path)
        s.setblocking(False)
    before = wal.commits
    await asyncio.sleep(0)
    for i, s in enumerate(conns):  # every request is in the kernel before the node reads
        s.send(msgpack.packb([0, i, "track", ["acme", "api", 1]]))
    loop = asyncio.get_running_loop()
    for s in conns:
        unpacker = msgpack.Unpacker(raw=False)
        while True:
            unpacker.feed(await loop.sock_recv(s, 1024))
            got = list(unpacker)
            if got:
                assert got[0][2] is None
                break
        s.close()
    assert await call(svc, "usage", "acme", "api") == 16
    assert wal.commits - before < 16, "each commit (one write, one fsync) served many calls"


async def test_a_failed_write_answers_every_held_call_unavailable(
    served: tuple[Service, WriteAheadLog, RpcServer, str],
) -> None:
    svc, wal, _, path = served
    await rpc(path, ["track", ["acme", "api", 3]])
    with disk_full(wal):
        out = await rpc(
            path,
            ["track", ["acme", "api", 1]],
            ["usage", ["acme", "api"]],
            ["track", ["acme", "api", 1]],
        )
    assert [r[2]["code"] if r[2] else None for r in out] == ["unavailable"] * 3
    assert "write-ahead log" in out[0][2]["message"]
    assert await call(svc, "usage", "acme", "api") == 3


async def test_interval_mode_syncs_on_its_interval_or_when_asked_not_per_write(tmp: Path) -> None:
    wal = WriteAheadLog(tmp / "wal", node_id="n1", mode="interval", fsync_interval=60)
    svc = build_service(CounterTable("n1"), MemoryStorage(), CounterConfig(), wal=wal)
    wal.recover()
    wal.open(svc.undo, svc.checkpoint, svc.journal.closing)
    for _ in range(100):  # the opening checkpoint is synced once
        if wal.checkpoints:
            break
        await asyncio.sleep(0.01)
    before = wal.fsyncs
    asked: asyncio.Future[None] | None = None
    for i in range(300):
        await call(svc, "track", "acme", "api", 1)
        await settle()  # writes go on, a pass each, while that sync runs in its thread
        if i == 5:
            asked = asyncio.ensure_future(wal.durable())  # as the flusher does: one sync
    for _ in range(100):
        if asked is not None and asked.done():
            break
        await asyncio.sleep(0.01)
    assert wal.fsyncs - before == 1, "written every pass, synced once on request, not per write"
    assert wal.commits >= 50
    await wal.close()


async def _life(d: Path, store: MemoryStorage) -> tuple[Service, WriteAheadLog, Flusher]:
    wal = WriteAheadLog(d / "wal", node_id="n1")
    table = CounterTable("n1", gossip=False)
    svc = build_service(table, store, CounterConfig(), wal=wal, ids=RequestIds(3600, 1000))
    await recover(wal, svc)
    return svc, wal, Flusher(table, store, wal=wal)


def _kill(wal: WriteAheadLog) -> None:
    """kill -9: nothing closed cleanly, nothing more written."""
    assert wal._timer is not None
    wal._timer.cancel()
    os.close(wal._fd)
    wal._fd = -1
    wal._closed = True


async def test_a_call_logged_right_after_a_rotation_is_restated_by_its_checkpoint(
    tmp: Path,
) -> None:
    store = MemoryStorage()
    svc, wal, flusher = await _life(tmp, store)
    await call(svc, "track", "acme", "api", 100)
    await flusher.flush_once()
    await call(svc, "track", "acme", "api", 5)
    await settle()
    wal._rotate()  # the segment is full: a new one, whose checkpoint lists the key now
    await call(svc, "track", "acme", "api", -5)  # a refund, logged in the new segment first
    for _ in range(50):
        if wal.checkpoints and len(list_segments(wal.directory)) == 1:
            break
        await asyncio.sleep(0.01)
    assert len(list_segments(wal.directory)) == 1, "the old segment is gone"
    _kill(wal)
    svc, wal, flusher = await _life(tmp, store)
    await flusher.flush_once()
    key = ("acme", "api", period_start("month"))
    assert (await store.load([key]))[key].total == 100  # not 95
    await wal.close()


def _half_closing_client(path: str, requests: list[list[Any]]) -> list[Any]:
    """Send the requests, half-close, read every answer until the node closes."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.sendall(b"".join(msgpack.packb([0, i, m, p]) for i, (m, p) in enumerate(requests)))
    s.shutdown(socket.SHUT_WR)
    s.settimeout(5)
    unpacker = msgpack.Unpacker(raw=False)
    while chunk := s.recv(65536):
        unpacker.feed(chunk)
    s.close()
    return list(unpacker)


async def test_a_client_that_half_closes_gets_its_held_answers(
    served: tuple[Service, WriteAheadLog, RpcServer, str],
) -> None:
    svc, _, _, path = served
    loop = asyncio.get_running_loop()
    for params in (["acme", "api", 1], ["acme", "api", 1]):  # cold (async answer), then warm
        (answer,) = await loop.run_in_executor(
            None, _half_closing_client, path, [["track", params]]
        )
        assert answer[2] is None and answer[3] == svc.table.value(svc.key_for("acme", "api"))


async def test_a_conflicting_item_of_a_cold_batch_fails_alone(tmp: Path) -> None:
    store = SlowStorage()
    svc, wal = await make(tmp, store)
    store.gate.set()
    await call(svc, "track", "acme", "warm", 1)
    store.gate.clear()
    batch = asyncio.ensure_future(
        call(svc, "track_many", [["acme", "x", 5, {"id": "x"}], ["acme", "other", 7]])
    )
    await asyncio.sleep(0.01)  # waiting on its cold keys; meanwhile another call takes the id
    assert await call(svc, "track", "acme", "warm", 1, {"id": "x"}) == 2
    store.gate.set()
    out = await batch
    assert out[0]["code"] == "conflict"
    assert out[1] == 7  # the other item is counted
    assert await call(svc, "usage", "acme", "x") == 0
    await wal.close()


async def test_a_retry_that_crosses_midnight_answers_as_the_first_call(tmp: Path) -> None:
    from unittest import mock

    svc, wal = await make(tmp)
    svc.keys.periods = {"api": "day"}
    before, after = 1764547199.9, 1764547200.1  # 23:59:59.9 and 00:00:00.1 UTC
    with mock.patch("time.time", return_value=before):
        assert await call(svc, "track", "acme", "api", 1, {"id": "late"}) == 1
    with mock.patch("time.time", return_value=after):
        assert await call(svc, "track", "acme", "api", 1, {"id": "late"}) == 1
        assert await call(svc, "track_many", [["acme", "api", 1, {"id": "late"}]]) == [1]
        assert await call(svc, "usage", "acme", "api") == 0  # the new day counted nothing
    await wal.close()


async def test_while_the_log_is_broken_the_flusher_takes_nothing(tmp: Path) -> None:
    svc, wal = await make(tmp)
    await call(svc, "track", "acme", "api", 3)
    await settle()
    flusher = Flusher(svc.table, svc.storage, wal=wal)
    with disk_full(wal):
        await call(svc, "track", "acme", "api", 1)
        await settle()  # that write fails: the log is broken
        assert broken(wal) is not None
        failures = wal.failures
        assert await flusher.flush_once() is False
        await settle()
        # Nothing was taken or appended, so no commit failed with (and spoiled) other answers.
        assert wal.failures == failures and not dirty(wal)
        assert "cannot be written" in (flusher.stats.last_error or "")
        assert svc.table.columns(svc.key_for("acme", "api"))["inflight"] == 0  # type: ignore[index]
    await wal.close()


async def test_recovery_does_not_wait_for_slow_storage_past_its_budget(
    tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import meter.persist.recovery

    svc, wal = await make(tmp)
    await call(svc, "track", "acme", "api", 3)
    await settle()
    _kill(wal)
    store = SlowStorage()  # never answers until the gate opens
    monkeypatch.setattr(meter.persist.recovery, "SEED_BUDGET_S", 0.2)
    t0 = asyncio.get_running_loop().time()
    svc, wal, flusher = await _life(tmp, store)
    assert asyncio.get_running_loop().time() - t0 < 2
    key = svc.key_for("acme", "api")
    assert not svc.table.is_seeded(key) and svc.table.pending(key) == 3  # counted, total unknown
    store.gate.set()
    await flusher.flush_once()  # the flusher seeds and stores it
    assert (await store.load([key]))[key].total == 3
    await wal.close()


async def test_checkpoints_list_the_warm_keys_of_current_periods_used_first_within_the_bound(
    tmp: Path,
) -> None:
    wal = WriteAheadLog(tmp / "wal", node_id="n1")
    table = CounterTable("n1", gossip=False)
    config = CounterConfig(warm_up_max_keys=4, period_grace_s=BACKFILL_GRACE_S)
    svc = build_service(table, MemoryStorage(), config, wal=wal)
    await recover(wal, svc)
    for tenant in "abcd":
        await call(svc, "usage", tenant, "api")
    ended = time.time() - 40 * 86400  # (a month that has ended, within the grace)
    await call(svc, "track", "old", "api", 1, {"at": ended})
    table.evict_idle()  # a pass: nothing is idle long enough to go, nothing counts as used
    await call(svc, "usage", "c", "api")  # used since
    month = period_start("month")
    svc.journal.warm_up_started([("z", "api", month)])  # a warm-up still reading it
    warm = [tuple(item) for rec in svc.checkpoint() if rec[0] == R.WARM for item in rec[1]]
    # The warm-up's keys, the used ones, then the others, in the table's order; at most 4.
    assert warm == [(t, "api", month) for t in "zcab"]
    # The last checkpoint, written on a clean close, lists them for the next start.
    await wal.close()
    wal = WriteAheadLog(tmp / "wal", node_id="n1")
    svc = build_service(CounterTable("n1", gossip=False), MemoryStorage(), CounterConfig(), wal=wal)
    # (With the key its STATE restates first: the warm-up passes over its ended period.)
    expected = [("old", "api", period_start("month", ended)), *((t, "api", month) for t in "zcab")]
    assert await recover(wal, svc) == expected
    await wal.close()


# -- a failed write gives back what its calls took (D05) -------------------------------------

_OP = st.one_of(
    st.tuples(st.just("track"), st.sampled_from(["gpu", "api"]), st.integers(1, 5), st.booleans()),
    st.tuples(st.just("warm"), st.lists(st.integers(1, 5), min_size=1, max_size=4)),
    st.tuples(st.just("many"), st.integers(1, 5), st.integers(1, 5)),
    st.tuples(st.just("reserve"), st.integers(1, 5)),
    st.tuples(st.just("commit"), st.integers(0, 2), st.integers(0, 3)),
    st.tuples(st.just("release"), st.integers(0, 2)),
    st.tuples(st.just("expire")),
    st.tuples(st.just("void"), st.integers(0, 2)),
)


async def _failed_batch_leaves_the_node_as_it_was(ops: list[tuple[Any, ...]]) -> None:
    d = short_tmpdir("wu-")
    try:
        svc, wal = await make(d)
        await call(svc, "set_plan", "pro", {"gpu": {"price": 2}})
        await call(svc, "assign_plan", "acme", "pro")
        await call(svc, "grant", "acme", 10**6)
        await call(svc, "set_limit", "acme", "api", {"limit": 10**6, "enforcement": "strict"})
        await call(svc, "track", "acme", "gpu", 1)
        await call(svc, "track", "acme", "api", 1)
        leases = [await call(svc, "reserve", "acme", "api", 5) for _ in range(3)]
        for n in range(3):  # priced calls a void gives credits back for
            await call(svc, "track", "acme", "gpu", n + 1, {"id": f"p{n}"})
        await settle()
        shares = svc.gate.shares
        assert isinstance(shares, Shares)
        keys = list(svc.table.keys())

        def state() -> Any:
            return (
                [svc.table.columns(k) for k in keys],
                {k: loc.a for k, loc in shares.local.items()},
                dict(shares.held),
                sorted(lease.id for lease in svc.reservations.held()),
                len(svc.ids),
                [effect.voided for n in range(3) if (effect := svc.ids.effect(f"p{n}"))],
            )

        before = state()
        waiting = []
        with disk_full(wal):
            for n, op in enumerate(ops):  # one loop pass: one batch, which the log cannot write
                kind = op[0]
                if kind == "expire":  # every lease past its deadline, logged
                    svc.expire_reservations(time.monotonic() + 10**6)
                    continue
                if kind == "warm":
                    svc.warm_tracks(
                        [[0, i, "track", ["acme", "gpu", q]] for i, q in enumerate(op[1])]
                    )
                    continue
                if kind == "track":
                    params: list[Any] = ["acme", op[1], op[2]] + (
                        [{"id": f"t{n}"}] if op[3] else []
                    )
                elif kind == "many":
                    params = [[["acme", "gpu", op[1], {"id": f"m{n}"}], ["acme", "api", op[2]]]]
                    kind = "track_many"
                elif kind == "reserve":
                    params = ["acme", "api", op[1], {"id": f"r{n}"}]
                elif kind == "void":
                    params = [f"p{op[1]}"]
                elif kind == "commit":
                    params = [leases[op[1]], 5 + op[2], {"id": f"c{n}"}]
                else:
                    params = [leases[op[1]]]
                with contextlib.suppress(Conflict, NotFound, Unavailable):
                    result = svc.dispatch(kind, params)
                    if inspect.isawaitable(result):
                        waiting.append(result)
            await settle()
        assert wal.broken is not None
        for result in waiting:  # (ran after the failure: refused, taking nothing)
            with contextlib.suppress(Unavailable):
                await result
        assert state() == before
        await wal.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_OP, min_size=1, max_size=8))
def test_a_batch_the_log_cannot_write_leaves_units_shares_leases_and_ids_as_they_were(
    ops: list[tuple[Any, ...]],
) -> None:
    """Whatever mix of priced and strict tracks (plain, under ids, the pipelined fast path,
    batches), strict reservations, commits above their reservation, releases, expiries and
    voids of priced calls a failed write undoes: the table, the strict shares' and credit
    pool's admitted units, the held units, the open leases, the ids and the voided calls are
    exactly as before it."""
    asyncio.run(_failed_batch_leaves_the_node_as_it_was(ops))


async def test_while_the_log_is_broken_leases_wait_to_expire(tmp: Path) -> None:
    svc, wal = await make(tmp)
    lease = await call(svc, "reserve", *KEY, 5, {"ttl_ms": 1})
    await settle()
    with disk_full(wal):
        await call(svc, "track", *KEY, 1)
        await settle()
    assert broken(wal) is not None
    assert svc.expire_reservations(time.monotonic() + 60) == 0  # not logged: not expired
    assert svc.reservations.get(lease) is not None
    for _ in range(100):
        if broken(wal) is None:
            break
        await asyncio.sleep(0.05)
    assert broken(wal) is None
    assert svc.expire_reservations(time.monotonic() + 60) == 1
    await settle()
    assert svc.reservations.get(lease) is None
    assert [r[:2] for r in logged(wal) if r[0] == R.EXPIRE] == [[R.EXPIRE, lease]]
    await wal.close()


async def test_a_checkpoints_shares_read_earlier_are_followed_by_the_counts_now(tmp: Path) -> None:
    """A checkpoint reads every share's admitted count when it reaches them and writes them a
    chunk at a time; a count that changes meanwhile is written after its chunk (each commit
    ends with the counts changed: Journal.closing), so replay takes the count as it is now."""
    svc, wal = await make(tmp)
    shares = svc.gate.shares
    assert isinstance(shares, Shares)
    keys = [("acme", f"f{i}", "2026-12") for i in range(2500)]  # three chunks
    for k in keys:
        shares.local[k] = Local(0, 100, 100, 1, 100)
    replay = Replay()
    replay.apply([R.SEGMENT, "n1", R.FORMAT, 1, 0.0, 0, "fsync"])  # (as a segment's head)
    admitted = 0
    for rec in svc.checkpoint():
        replay.apply(rec)
        if rec[0] == R.SHARES:
            # Calls admit between the chunks, on keys of every chunk; the chunk's commit
            # ends with what changed (as WriteAheadLog._commit_batch does).
            for k in (keys[admitted], keys[1200 + admitted], keys[2400 + admitted]):
                shares.admit(k, 1)
            admitted += 1
            for closing in svc.journal.closing():
                replay.apply(closing)
    got = {k: a for (k, run), a in replay.shares.items() if run == shares.run}
    assert got == {k: shares.local[k].a for k in keys}
    await wal.close()
