"""The write-ahead log through real node processes: kill -9 keeps every acknowledged call,
request ids count once across restarts, a damaged log is cut or refused, a full disk refuses
writes without counting them and recovers by itself."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from meter.wal import records as R
from meter.wal.log import list_segments, segment_path
from tests.support.nodes import NodeProcess, raw_call, short_tmpdir, wait_for
from tests.test_metrics_http import metrics_address, scrape, value

pytestmark = pytest.mark.slow


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = short_tmpdir("wal-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def call(node: NodeProcess, method: str, *params: Any) -> tuple[Any, Any]:
    return raw_call(node.socket, method, *params)  # type: ignore[no-any-return]


# A flush interval far longer than any test: only the log can bring the units back.
NO_FLUSH = {"METER_FLUSH_INTERVAL_MS": "3600000"}


@pytest.mark.parametrize("mode", ["fsync", "interval"])
def test_kill_9_keeps_every_acknowledged_unit(workdir: Path, mode: str) -> None:
    node = NodeProcess(workdir, METER_DURABILITY=mode, **NO_FLUSH).start()
    for i in range(200):
        node.call("track", "acme", f"f{i % 5}", i)
    node.call("track_many", [["acme", "f0", 1000], ["beta", "x", 7]])
    assert node.kill() == -9
    again = NodeProcess(workdir, METER_DURABILITY=mode, **NO_FLUSH).start()
    try:
        expected = {f"f{j}": sum(i for i in range(200) if i % 5 == j) for j in range(5)}
        expected["f0"] += 1000
        assert again.call("usage_all", "acme") == expected
        assert again.call("usage", "beta", "x") == 7
        assert "recovered from the write-ahead log" in again.log()
        # And the units reach storage: a drain stores them, a plain restart reads them back.
        assert again.stop() == 0
        third = NodeProcess(workdir, METER_DURABILITY="off").start()
        assert third.call("usage_all", "acme") == expected
        assert third.stop() == 0
    finally:
        again.stop()


def test_a_delta_logged_before_a_crash_is_resent_under_its_sequence(workdir: Path) -> None:
    # Flushes every 50 ms: many kills land between logging a take and its acknowledgement.
    env = {"METER_FLUSH_INTERVAL_MS": "50"}
    total = 0
    for _ in range(5):
        node = NodeProcess(workdir, **env).start()
        for i in range(300):
            node.call("track", "acme", "api", 1 + i % 3)
            total += 1 + i % 3
        node.kill()
    check = NodeProcess(workdir, **env).start()
    try:
        assert check.call("usage", "acme", "api") == total
    finally:
        assert check.stop() == 0
    fresh = NodeProcess(workdir, METER_DURABILITY="off").start()
    try:
        assert fresh.call("usage", "acme", "api") == total  # stored exactly once
    finally:
        fresh.stop()


def test_request_ids_count_once_across_a_kill_and_conflict_on_another_payload(
    workdir: Path,
) -> None:
    node = NodeProcess(workdir, **NO_FLUSH).start()
    assert node.call("track", "acme", "api", 5, {"id": "req-1"}) == 5
    assert node.call("track", "acme", "api", 5, {"id": "req-1"}) == 5  # a retry
    assert node.call("track_many", [["acme", "api", 2, {"id": "m-1"}], ["acme", "api", 3]]) == [
        7,
        10,
    ]
    node.kill()
    node = NodeProcess(workdir, **NO_FLUSH).start()
    try:
        assert node.call("track", "acme", "api", 5, {"id": "req-1"}) == 5  # first answer
        assert node.call("track_many", [["acme", "api", 2, {"id": "m-1"}]]) == [7]
        assert node.call("usage", "acme", "api") == 10
        error, _ = call(node, "track", "acme", "api", 6, {"id": "req-1"})
        assert error["code"] == "conflict"
        error, _ = call(node, "track", "acme", "other", 5, {"id": "req-1"})
        assert error["code"] == "conflict"
        error, _ = call(node, "reserve", "acme", "api", 5, {"id": "req-1"})
        assert error["code"] == "conflict"
        assert node.call("usage", "acme", "api") == 10
    finally:
        assert node.stop() == 0


def test_a_window_that_ends_lets_the_id_count_again(workdir: Path) -> None:
    with NodeProcess(workdir, METER_IDEMPOTENCY_WINDOW_S="1") as node:
        assert node.call("track", "acme", "api", 1, {"id": "w"}) == 1
        assert node.call("track", "acme", "api", 1, {"id": "w"}) == 1
        wait_for(
            lambda: node.call("status")["request_ids"]["remembered"] == 0,
            timeout=5,
            what="the id's window to end",
        )
        assert node.call("track", "acme", "api", 1, {"id": "w"}) == 2


def test_ids_past_the_bound_are_dropped_and_reported(workdir: Path) -> None:
    with NodeProcess(workdir, METER_IDEMPOTENCY_MAX_IDS="10") as node:
        for i in range(15):
            node.call("track", "acme", "api", 1, {"id": f"b{i}"})
        ids = node.call("status")["request_ids"]
        assert ids["remembered"] == 10
        assert ids["dropped_early"] == 5
        assert node.call("track", "acme", "api", 1, {"id": "b0"}) == 16  # forgotten: counts
        assert node.call("track", "acme", "api", 1, {"id": "b14"}) == 15  # remembered


def test_a_reservation_survives_a_kill_and_its_commit_is_idempotent(workdir: Path) -> None:
    node = NodeProcess(workdir, **NO_FLUSH).start()
    node.call("track", "acme", "gpu", 10)
    rid = node.call("reserve", "acme", "gpu", 50, {"limit": 100, "ttl_ms": 600_000})
    done = node.call("reserve", "acme", "gpu", 5, {"ttl_ms": 600_000})
    assert node.call("commit", done, 4) == 64
    node.kill()
    node = NodeProcess(workdir, **NO_FLUSH).start()
    try:
        assert node.call("usage", "acme", "gpu") == 64  # 10 + 4 used + 50 held
        error, _ = call(node, "reserve", "acme", "gpu", 40, {"limit": 100})
        assert error["code"] == "limit_exceeded"  # the hold still counts against the limit
        assert node.call("commit", rid, 30) == 44
        assert node.call("commit", rid, 30) == 44  # repeated: the first answer
        assert node.call("commit", rid) == 44  # no quantity: the same commit
        assert node.call("commit", done, 4) == 64  # finished before the crash
        error, _ = call(node, "commit", rid, 31)
        assert error["code"] == "conflict"
        error, _ = call(node, "release", rid)
        assert error["code"] == "conflict"
        error, _ = call(node, "commit", "r-never-issued")
        assert error["code"] == "not_found"
        assert node.call("usage", "acme", "gpu") == 44
    finally:
        assert node.stop() == 0


def test_an_expired_reservation_is_not_found(workdir: Path) -> None:
    with NodeProcess(workdir) as node:
        rid = node.call("reserve", "acme", "gpu", 5, {"ttl_ms": 50})
        wait_for(lambda: node.call("usage", "acme", "gpu") == 0, what="the lease to expire")
        error, _ = call(node, "commit", rid)
        assert error["code"] == "not_found"


def _last_segment(node: NodeProcess) -> Path:
    wal = node.data_dir / "wal"
    return segment_path(wal, list_segments(wal)[-1])


def test_a_torn_tail_is_cut_and_the_node_starts(workdir: Path) -> None:
    node = NodeProcess(workdir, **NO_FLUSH).start()
    for _ in range(10):
        node.call("track", "acme", "api", 1)
    node.kill()
    seg = _last_segment(node)
    whole = R.scan(seg.read_bytes()).end  # where the records end (the rest is preallocated)
    torn = R.frame([R.TRACK, "acme", "api", "2026-11", 1000])
    with seg.open("r+b") as fh:
        fh.seek(whole)
        fh.write(torn[: len(torn) // 2])  # a record half written when the power went
    again = NodeProcess(workdir, **NO_FLUSH).start()
    try:
        assert again.call("usage", "acme", "api") == 10
        assert "cut a torn tail" in again.log()
        assert f"at byte {whole}" in again.log()
    finally:
        assert again.stop() == 0


def test_corruption_before_the_tail_stops_the_node_naming_file_and_offset(
    workdir: Path,
) -> None:
    node = NodeProcess(workdir, **NO_FLUSH).start()
    for _ in range(10):
        node.call("track", "acme", "api", 1)
    node.kill()
    seg = _last_segment(node)
    data = bytearray(seg.read_bytes())
    first = len(R.frame(R.scan(bytes(data)).records[0]))
    data[first + R.HEADER.size + 2] ^= 0xFF  # inside the second record
    seg.write_bytes(bytes(data))
    with pytest.raises(RuntimeError) as info:
        NodeProcess(workdir, **NO_FLUSH).start(timeout=60)
    assert f"{seg} is damaged at byte {first}" in str(info.value)
    assert f"truncate -s {first} {seg}" in str(info.value)
    # The documented way out: cut the log there and start (losing what followed).
    subprocess.run(["truncate", "-s", str(first), str(seg)], check=True)
    again = NodeProcess(workdir, **NO_FLUSH).start()
    try:
        assert again.call("usage", "acme", "api") == 0
    finally:
        again.stop()


@pytest.fixture
def small_fs() -> Iterator[Path]:
    """A 2 MiB tmpfs, so the disk really fills."""
    mnt = short_tmpdir("fs-")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        shutil.rmtree(mnt, ignore_errors=True)
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        shutil.rmtree(mnt, ignore_errors=True)


def test_a_full_disk_refuses_writes_counts_nothing_and_recovers(
    workdir: Path, small_fs: Path
) -> None:
    node = NodeProcess(
        workdir,
        METER_DATA_DIR=str(small_fs / "data"),
        METER_SQLITE_FILE=str(workdir / "counters.sqlite3"),  # storage stays on the real disk
        METER_WAL_SEGMENT_BYTES="65536",
        METER_METRICS_ADDRESS="127.0.0.1:0",
        **NO_FLUSH,
    ).start()
    try:
        assert node.call("track", "acme", "api", 1) == 1
        address = metrics_address(node)
        before = scrape(address)
        filler = small_fs / "filler"
        with filler.open("wb", buffering=0) as fh, contextlib.suppress(OSError):
            while True:
                fh.write(b"\0" * 512)
        counted = 1
        refused = 0
        # The log's last page (tmpfs allocates 4 KiB at a time) takes a few records more.
        for i in range(3000):
            if refused >= 20:
                break
            error, _ = call(node, "track", "acme", "api", 1, {"id": f"full-{i}"})
            if error is None:
                counted += 1
            else:
                assert error["code"] == "unavailable", error
                assert "write-ahead log" in error["message"]
                refused += 1
        assert refused > 0, "the disk never filled"
        # The metrics count each answer as it was answered: the calls the failed log write
        # turned into "unavailable" too (not "ok").
        after = scrape(address)

        def moved(name: str, **labels: str) -> float:
            return value(after, name, **labels) - value(before, name, **labels)

        assert moved("meter_requests_total", method="track", result="ok") == counted - 1
        assert moved("meter_requests_total", method="track", result="unavailable") == refused
        assert moved("meter_refusals_total", reason="unavailable") == refused
        assert (
            moved("meter_request_duration_seconds_count", method="track") == counted - 1 + refused
        )
        assert value(after, "meter_wal_writable") == 0
        # Reads keep working, and say what was counted, nothing more.
        assert node.call("usage", "acme", "api") == counted
        status = node.call("status")
        assert status["durability"]["wal"]["broken"]
        assert "disk full" in status["durability"]["wal"]["broken"]
        assert status["ready"] is False  # meter status --check fails while the log cannot write
        assert [r for r in status["not_ready"] if r.startswith("log: cannot write")]
        filler.unlink()
        wait_for(
            lambda: call(node, "track", "acme", "api", 1)[0] is None,
            timeout=10,
            what="the log to recover once space returned",
        )
        counted += 1
        assert node.call("status")["durability"]["wal"]["broken"] is None
        assert not [r for r in node.call("status")["not_ready"] if r.startswith("log:")]
        assert node.call("usage", "acme", "api") == counted
    finally:
        node.kill()
    again = NodeProcess(
        workdir,
        METER_DATA_DIR=str(small_fs / "data"),
        METER_SQLITE_FILE=str(workdir / "counters.sqlite3"),
        **NO_FLUSH,
    ).start()
    try:
        assert again.call("usage", "acme", "api") == counted  # the refused calls never count
    finally:
        again.stop()


def test_the_log_stays_bounded_by_the_unstored_backlog(workdir: Path) -> None:
    env = {"METER_WAL_SEGMENT_BYTES": "65536", "METER_FLUSH_INTERVAL_MS": "50"}
    with NodeProcess(workdir, **env) as node:
        for i in range(40):
            node.call("track_many", [["acme", f"f{j}", 1] for j in range(200)])
            del i
        wait_for(
            lambda: node.call("status")["durability"]["wal"]["checkpoints"] >= 2,
            what="checkpoints",
        )
        wait_for(
            lambda: node.call("status")["flush"]["backlog_keys"] == 0, what="everything stored"
        )
        wal = node.call("status")["durability"]["wal"]
        written = wal["records"]
        assert written > 40
        # Older segments were dropped: at most the open one and one being compacted.
        assert wal["segments"] <= 2, wal
        assert wal["size_bytes"] <= 2 * 65536 + 32768, wal
        assert wal["oldest_segment_age_s"] is not None
        files = list((node.data_dir / "wal").iterdir())
        assert len(files) == wal["segments"], files


def test_interval_mode_answers_before_the_fsync_and_keeps_units_on_a_process_crash(
    workdir: Path,
) -> None:
    node = NodeProcess(
        workdir, METER_DURABILITY="interval", METER_WAL_FSYNC_INTERVAL_MS="60000", **NO_FLUSH
    ).start()
    for _ in range(20):
        node.call("track", "acme", "api", 1)
    status = node.call("status")["durability"]["wal"]
    assert status["mode"] == "interval"
    node.kill()
    again = NodeProcess(workdir, METER_DURABILITY="interval", **NO_FLUSH).start()
    try:
        assert again.call("usage", "acme", "api") == 20
    finally:
        again.stop()


def test_durability_off_writes_no_log(workdir: Path) -> None:
    node = NodeProcess(workdir, METER_DURABILITY="off", **NO_FLUSH).start()
    node.call("track", "acme", "api", 1)
    assert node.call("status")["durability"] == {"mode": "off", "wal": None}
    node.kill()
    assert not (node.data_dir / "wal").exists()


def _fill(disk: Path) -> Path:
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as fh, contextlib.suppress(OSError):
        while True:
            fh.write(b"\0" * 512)
    return filler


def _long_id(prefix: str, i: int) -> str:
    """A request id padded to the longest one may be (fewer records fit in the last page)."""
    return f"{prefix}-{i}-".ljust(128, "x")


def _spend_until_refused(
    node: NodeProcess, feature: str, prefix: str, ids: bool = True
) -> tuple[int, str]:
    """Track 1 unit at a time until refused: (units counted, code). With ``ids`` each call
    has its own request id; without, the calls are plain (the node's pipelined fast path)."""
    for i in range(100_000):
        params: list[Any] = ["acme", feature, 1]
        if ids:
            params.append({"id": _long_id(prefix, i)})
        error, _ = call(node, "track", *params)
        if error is not None:
            return i, error["code"]
    raise AssertionError("never refused")


def _until_written(node: NodeProcess) -> None:
    wait_for(
        lambda: call(node, "track", "acme", "free", 1)[0] is None,
        what="the log to write again",
    )


def test_a_failed_log_write_gives_back_the_credits_and_strict_room_it_took(
    workdir: Path, small_fs: Path
) -> None:
    """1,000 credits at price 1 and strict limits of 1,000: a call the log cannot write (a
    plain priced track, a strict track under a request id, a strict reservation, a commit
    above its reservation) gives back what it took, so once the disk has room again exactly
    1,000 units of each are counted, the retried calls included (docs/correctness.md, D05)."""
    gpu = "gpu-".ljust(200, "x")  # (a long name: fewer plain records fit in the last page)
    node = NodeProcess(
        workdir,
        METER_DATA_DIR=str(small_fs / "data"),
        METER_SQLITE_FILE=str(workdir / "counters.sqlite3"),  # storage stays on the real disk
        METER_WAL_SEGMENT_BYTES="65536",
        **NO_FLUSH,
    ).start()
    try:
        node.call("set_plan", "pro", {gpu: {"price": 1}})
        node.call("assign_plan", "acme", "pro")
        node.call("grant", "acme", 1000)
        for feature in ("api", "job"):
            node.call("set_limit", "acme", feature, {"limit": 1000, "enforcement": "strict"})
        wait_for(
            lambda: {gpu, "api", "job"} <= set(node.call("limits", "acme")["limits"]),
            what="the plan and the limits",
        )
        counted = {gpu: 0, "api": 0, "job": 0}
        # Tracks: the first refusal is the call whose write failed (the log's last page
        # takes a few records more): it took its credit or its room, then was undone.
        for feature, ids in ((gpu, False), ("api", True)):
            assert call(node, "track", "acme", feature, 1)[0] is None
            counted[feature] += 1
            filler = _fill(small_fs)
            n, code = _spend_until_refused(node, feature, f"{feature[:3]}-full", ids)
            assert code == "unavailable"
            counted[feature] += n
            filler.unlink()
            _until_written(node)
            if ids:  # the client's retry of the failed call, under its id: counted once
                for _ in range(2):
                    again = call(
                        node,
                        "track",
                        "acme",
                        feature,
                        1,
                        {"id": _long_id(f"{feature[:3]}-full", n)},
                    )
                    assert again[0] is None
                counted[feature] += 1
        # A reservation the log cannot write gives back the room it held.
        filler = _fill(small_fs)
        leases = []
        for i in range(100_000):
            error, lease = call(node, "reserve", "acme", "job", 1, {"id": _long_id("r", i)})
            if error is not None:
                assert error["code"] == "unavailable"
                break
            leases.append(lease)
        else:
            raise AssertionError("the disk never filled")
        filler.unlink()
        _until_written(node)
        for lease in leases:
            node.call("commit", lease, 1)
        counted["job"] += len(leases)
        # A commit above its reservation the log cannot write gives back the extra unit and
        # keeps the reservation (committed again once the disk has room).
        leases = [node.call("reserve", "acme", "job", 1) for _ in range(200)]
        filler = _fill(small_fs)
        failed = None
        for i, lease in enumerate(leases):
            error, _ = call(node, "commit", lease, 2, {"id": _long_id("c", i)})
            if error is not None:
                assert error["code"] == "unavailable"
                failed = i
                break
        assert failed is not None, "the disk never filled"
        filler.unlink()
        _until_written(node)
        for i, lease in enumerate(leases[failed:], failed):
            assert call(node, "commit", lease, 2, {"id": _long_id("c", i)})[0] is None
        counted["job"] += 2 * len(leases)
        refusals = {gpu: "insufficient_balance", "api": "limit_exceeded", "job": "limit_exceeded"}
        for feature, refusal in refusals.items():
            n, code = _spend_until_refused(node, feature, f"{feature[:3]}-after")
            assert code == refusal, (feature, code)
            assert counted[feature] + n == 1000, (feature, counted[feature], n)
            assert node.call("usage", "acme", feature) == 1000
    finally:
        node.kill()


@pytest.mark.parametrize("mode", ["fsync", "interval"])
def test_an_expired_lease_never_comes_back_after_a_kill_and_a_wall_clock_step_back(
    workdir: Path, mode: str
) -> None:
    """The node expires a lease by its monotonic clock and logs it: after a kill -9 and a
    restart whose wall clock reads 30 s earlier (the lease's deadline in its future again),
    the lease stays expired, its late commit is not_found, and the strict limit holds."""
    node = NodeProcess(workdir, METER_DURABILITY=mode, **NO_FLUSH).start()
    try:
        node.call("set_limit", "acme", "job", {"limit": 60, "enforcement": "strict"})
        wait_for(lambda: "job" in node.call("limits", "acme")["limits"], what="the limit")
        lease = node.call("reserve", "acme", "job", 50, {"ttl_ms": 300})
        wait_for(lambda: node.call("usage", "acme", "job") == 0, what="the lease to expire")
        assert node.call("track", "acme", "job", 60) == 60  # its units were admitted again
        error, _ = call(node, "commit", lease)
        assert error["code"] == "not_found"
    finally:
        node.kill()
    again = NodeProcess(workdir, METER_DURABILITY=mode, **NO_FLUSH)
    again.clock_shift = -30.0
    again.start()
    try:
        error, _ = call(again, "commit", lease)
        assert error is not None and error["code"] == "not_found", error
        assert again.call("usage", "acme", "job") == 60
        assert again.call("status")["reservations"]["open"] == 0
        error, _ = call(again, "track", "acme", "job", 1)
        assert error is not None and error["code"] == "limit_exceeded"
    finally:
        again.kill()


def _forged_frame() -> bytes:
    """A whole, valid frame as format 1 framed it (CRCs unsalted: the length, the CRCs and a
    payload of 10 ASCII bytes) whose every byte is ASCII, so a client can send it as a request
    id: found by trying payloads (about 1 in 256 has ASCII CRCs)."""
    for n in range(100_000):
        payload = f"{n:010d}".encode()
        head = R.HEADER.pack(len(payload), zlib.crc32(payload), 0)[:8]
        data = head + zlib.crc32(head).to_bytes(4, "little") + payload
        if data.isascii():
            return data
    raise AssertionError("no ASCII frame found")


def _frame_starts(data: bytes, end: int) -> list[int]:
    """The offsets of the frames before ``end`` (walking the headers' lengths)."""
    starts, pos = [], 0
    while pos < end:
        starts.append(pos)
        pos += R.HEADER.size + R.HEADER.unpack_from(data, pos)[0]
    return starts


def test_a_request_id_that_holds_a_whole_frame_cannot_turn_a_torn_write_into_an_outage(
    workdir: Path,
) -> None:
    """A client's id carries the bytes of a whole (format 1) frame; the commit holding it is
    torn (its first page never written). The salted CRCs of the segment tell the forged frame
    from a real one: the tail is cut as torn and the node starts."""
    forged = _forged_frame()
    assert len(forged) <= 128
    node = NodeProcess(workdir, **NO_FLUSH).start()
    for _ in range(5):
        node.call("track", "acme", "api", 1)
    error, _ = call(node, "track", "acme", "api", 1, {"id": forged.decode()})
    assert error is None
    node.kill()
    seg = _last_segment(node)
    data = bytearray(seg.read_bytes())
    found = R.scan(bytes(data))
    assert found.damage is None
    last = _frame_starts(bytes(data), found.end)[-1]
    assert bytes(forged) in bytes(data[last : found.end])  # the client's bytes, verbatim
    data[last : last + R.HEADER.size] = bytes(R.HEADER.size)  # the commit's head never landed
    seg.write_bytes(bytes(data))
    again = NodeProcess(workdir, **NO_FLUSH).start()
    try:
        assert again.call("usage", "acme", "api") == 5  # the torn call (never answered) is cut
        assert "cut a torn tail" in again.log()
    finally:
        again.stop()


def test_a_log_written_in_fsync_mode_is_read_as_such_after_a_switch_to_interval(
    workdir: Path,
) -> None:
    """The mode a segment was written in is in its first record: damage in the middle of a
    segment written in fsync mode stops a restart in interval mode too (it is not cut)."""
    node = NodeProcess(workdir, METER_DURABILITY="fsync", **NO_FLUSH).start()
    for _ in range(10):
        node.call("track", "acme", "api", 1)
    node.kill()
    seg = _last_segment(node)
    data = bytearray(seg.read_bytes())
    second = _frame_starts(bytes(data), R.scan(bytes(data)).end)[1]
    data[second + R.HEADER.size + 2] ^= 0xFF
    seg.write_bytes(bytes(data))
    with pytest.raises(RuntimeError) as info:
        NodeProcess(workdir, METER_DURABILITY="interval", **NO_FLUSH).start(timeout=60)
    assert f"{seg} is damaged at byte {second}" in str(info.value)


def test_interval_mode_cuts_only_past_what_the_log_says_was_synced(workdir: Path) -> None:
    """In interval mode damage past the last synced offset is cut (a power loss can leave
    holes there); damage before an offset a SYNCED record vouches for is corruption."""
    env = {"METER_DURABILITY": "interval", "METER_WAL_FSYNC_INTERVAL_MS": "50", **NO_FLUSH}
    node = NodeProcess(workdir, **env).start()
    for _ in range(5):
        node.call("track", "acme", "api", 1)

    def fsyncs() -> int:
        return int(node.call("status")["durability"]["wal"]["fsyncs"])

    synced_before = fsyncs()
    wait_for(lambda: fsyncs() > synced_before, what="an interval sync")
    node.call("track", "acme", "api", 1)  # its commit carries the SYNCED record
    node.kill()
    seg = _last_segment(node)
    data = bytearray(seg.read_bytes())
    found = R.scan(bytes(data))
    starts = _frame_starts(bytes(data), found.end)
    assert found.synced > starts[2], "the first records are vouched for"
    before = starts[2]
    damaged = bytearray(data)
    damaged[before + R.HEADER.size + 1] ^= 0xFF
    seg.write_bytes(bytes(damaged))
    with pytest.raises(RuntimeError) as info:
        NodeProcess(workdir, **env).start(timeout=60)
    assert f"{seg} is damaged at byte {before}" in str(info.value)
    assert "were synced" in str(info.value)


def _spend_all(node: NodeProcess, feature: str) -> tuple[int, str]:
    """Track 100 units at a time until refused, then 1 at a time: (units counted, the code
    that refused the last 1)."""
    counted = 0
    for qty in (100, 1):
        while True:
            error, _ = call(node, "track", "acme", feature, qty)
            if error is not None:
                code = error["code"]
                break
            counted += qty
    return counted, code


@pytest.mark.parametrize("kind", ["priced", "strict"])
def test_a_kill_9_strands_no_credits_and_no_strict_room(workdir: Path, kind: str) -> None:
    """10,000 credits at price 1 (or a strict limit of 10,000), 100 units spent, kill -9: the
    restarted process (same data dir, fsync) closes its predecessor's share at what the log
    shows admitted, so exactly 9,900 more units are counted and the next is refused."""
    feature = "gpu" if kind == "priced" else "api"
    env = {"METER_DURABILITY": "fsync", **NO_FLUSH}
    node = NodeProcess(workdir, **env).start()
    try:
        if kind == "priced":
            node.call("set_plan", "pro", {"gpu": {"price": 1}})
            node.call("assign_plan", "acme", "pro")
            node.call("grant", "acme", 10_000)
        else:
            node.call("set_limit", "acme", "api", {"limit": 10_000, "enforcement": "strict"})
        wait_for(lambda: feature in node.call("limits", "acme")["limits"], what="the limit")
        for _ in range(100):
            node.call("track", "acme", feature, 1)
    finally:
        node.kill()
    again = NodeProcess(workdir, **env).start()
    try:
        counted, code = _spend_all(again, feature)
        assert code == ("insufficient_balance" if kind == "priced" else "limit_exceeded")
        assert counted == 9_900
        assert again.call("usage", "acme", feature) == 10_000
    finally:
        again.kill()
