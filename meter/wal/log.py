"""The write-ahead log on disk: segments, group commit, the fsync policy, compaction.

Thin I/O around :mod:`meter.wal.records`. Everything runs on the event loop's thread:

- :meth:`WriteAheadLog.append` adds a record to the open batch and schedules one commit
  (``loop.call_soon``), so every record appended while the loop serves one pass of ready
  connections shares one ``write`` and, in ``fsync`` mode, one ``fdatasync``;
- answers produced while a batch is open are *held* (:meth:`hold`) and sent once it is
  committed, so no answer claims what the log does not hold;
- a failed write (a full disk) is cut back to the last whole record, the batch's records are
  undone by the owner's ``undo`` callback, the held answers become ``unavailable``, and the log
  stays *broken* (mutating calls are refused before they count) until a probe write succeeds.

Compaction: when a segment grows past ``segment_bytes`` (or is a minute old and over 1 MiB)
a new one is started with a checkpoint of the node's unstored state, emitted a chunk per loop
pass; once the checkpoint is durable the older segments are deleted. So the log holds the
unstored backlog, the open reservations and the remembered request ids, plus one segment.

Why one module: appending, the group commit, the held answers, failure and probing, and
compaction all share the open segment and the one batch; the pure parts (framing, replay) are
their own modules already.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from meter.core.counts import FSYNC_BOUNDS, Buckets
from meter.wal import records as R
from meter.wal.errors import LogCorrupt, LogIdMismatch, WalError  # (interpreted: ADR 0011)
from meter.wal.replay import Replay

__all__ = ["LogCorrupt", "LogIdMismatch", "WalError", "WriteAheadLog", "read_log"]

log = logging.getLogger("meter.wal")

#: Answers held until a commit: a sender and the response arrays it sends.
Held = tuple[Callable[[list[list[Any]], str | None], None], list[list[Any]]]

_SEGMENT_RE = re.compile(r"wal-(\d{8})\.log")
#: A segment older than this is closed (and the log compacted) if it is over SMALL_SEGMENT.
SEGMENT_MAX_AGE_S = 60.0
SMALL_SEGMENT = 1 << 20
#: Checkpoint records appended per loop pass (each holds up to CHECKPOINT_ITEMS items).
CHECKPOINT_RECORDS_PER_PASS = 4
#: How often a broken log tries to write again.
PROBE_INTERVAL_S = 0.5


def segment_path(directory: Path, number: int) -> Path:
    """The file of segment ``number``."""
    return directory / f"wal-{number:08d}.log"


def list_segments(directory: Path) -> list[int]:
    """Segment numbers present in ``directory``, oldest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _SEGMENT_RE.fullmatch(n)))


def read_log(
    directory: Path,
    *,
    node_id: str | None = None,
    lenient: bool = False,
    ends: dict[int, int] | None = None,
) -> Replay:
    """Replay the log in ``directory`` from its newest complete checkpoint.

    A torn tail of the newest segment is cut off. A segment written in ``interval`` mode (as
    its ``SEGMENT`` record says), where a power loss can leave holes anywhere in what was not
    synced yet, is also cut at damage past the last offset its ``SYNCED`` records vouch for.
    Format 1 segments say neither: there ``lenient`` (the configured mode is ``interval``)
    cuts any damage in the newest segment. Raises :class:`LogCorrupt` for damage anywhere
    else, and for a log written by another node id than ``node_id``.
    """
    numbers = list_segments(directory)
    scans: list[tuple[Path, bytes, R.Scan]] = []
    start = 0
    for i, number in enumerate(numbers):
        path = segment_path(directory, number)
        data = path.read_bytes()
        found = R.scan(data)
        scans.append((path, data, found))
        if ends is not None:
            ends[number] = found.end
        first = found.records[0] if found.records else None
        if (
            node_id is not None
            and first is not None
            and first[0] == R.SEGMENT
            and first[1] != node_id
        ):
            raise LogIdMismatch(directory, str(first[1]), node_id)
        if any(r[0] == R.CHECKPOINT_END and r[1:2] == [number] for r in found.records):
            start = i  # everything before segment ``number`` is restated in it
        damage = found.damage
        if damage is None:
            continue
        newest = i == len(numbers) - 1
        if found.mode is None:
            loose = lenient  # format 1: the segment does not say how it was written
        else:
            loose = found.mode == "interval" and damage.offset >= found.synced
        if not newest or not (damage.torn or loose):
            reason = damage.reason
            if found.mode == "interval" and damage.offset < found.synced:
                reason += f"; bytes before {found.synced} were synced"
            raise LogCorrupt(path, damage.offset, reason)
        log.warning(
            "write-ahead log %s: cut a torn tail at byte %d (%d bytes: %s)",
            path,
            damage.offset,
            len(data) - damage.offset,
            damage.reason,
        )
        with open(path, "r+b") as fh:
            fh.truncate(damage.offset)
            os.fsync(fh.fileno())
    replay = Replay()
    for path, _, found in scans[start:]:
        try:
            replay.apply_all(found.records)
        except (ValueError, TypeError, IndexError) as exc:
            raise LogCorrupt(path, found.end, f"unreadable record: {exc}") from None
    return replay


class WriteAheadLog:
    """The log of one node, in ``directory``. See the module docstring.

    Why one class: appending, committing, syncing, the SYNCED marks, rotation and checkpoints
    all move the same offsets and batch numbers of the open segment; apart, each would need
    every field of the others."""

    def __init__(
        self,
        directory: Path,
        *,
        node_id: str,
        mode: str = "fsync",
        fsync_interval: float = 1.0,
        segment_bytes: int = 64 << 20,
    ) -> None:
        if mode not in ("fsync", "interval"):
            raise ValueError(f"mode must be fsync or interval, got {mode!r}")
        self.directory = directory
        self.node_id = node_id
        self.mode = mode
        self.fsync_interval = fsync_interval
        self.segment_bytes = segment_bytes
        #: Why the log cannot be written now (``None``: it can).
        self.broken: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._undo: Callable[[list[list[Any]]], None] = lambda records: None
        self._closing_records: Callable[[], list[list[Any]]] = list
        self._checkpoint: Callable[[], Iterator[list[Any]]] = lambda: iter(())
        self._batch: list[list[Any]] = []
        self._held: list[Held] = []
        self._after: list[Callable[[], object]] = []
        self._scheduled = False
        self._fd = -1
        self._number = 0
        self._opened_at = 0.0
        self._end = 0  # bytes of the open segment known whole and written
        self._sizes: dict[int, int] = {}  # closed segments still on disk -> bytes
        self._created: dict[int, float] = {}
        # Batches are numbered; a batch is committed (written) and then synced (on disk).
        self._gen = 1
        #: The number of the batch being committed, or of the last one (an ``undo`` callback
        #: runs for this one).
        self.committing = 0
        self._written = 0
        self._synced = 0
        #: This segment's CRC salt (format 2, records.py), in its SEGMENT record.
        self._salt = 0
        #: ``interval`` mode: the offset the last sync made durable, and the furthest one a
        #: SYNCED record in the segment vouches for (written with the next commit, or at once
        #: when a sync woke someone waiting on it: the flusher, before it sends).
        self._synced_end = 0
        self._marked = 0
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._sync_task: asyncio.Task[None] | None = None
        self._timer: asyncio.Task[None] | None = None
        self._ckpt: Iterator[list[Any]] | None = None
        self._ckpt_number = 0
        self._ckpt_start = 0
        self._last_ckpt_bytes = 0
        self._ckpt_wanted = False
        self._closed = False
        self._closing = False
        self._preallocated: bool | None = None
        # Counters for status.
        self.commits = 0
        self.fsyncs = 0
        self.records = 0
        self.failures = 0
        self.checkpoints = 0
        self.last_error: str | None = None
        #: How long the log's syncs took (``fdatasync`` of commits and interval syncs).
        self.fsync_seconds = Buckets(FSYNC_BOUNDS)

    # -- lifecycle ------------------------------------------------------------------------------

    def recover(self) -> Replay:
        """Read what the log holds (before :meth:`open`)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        ends: dict[int, int] = {}
        replay = read_log(
            self.directory, node_id=self.node_id, lenient=self.mode == "interval", ends=ends
        )
        for number in list_segments(self.directory):
            path = segment_path(self.directory, number)
            self._sizes[number] = ends.get(number, 0)
            self._created[number] = path.stat().st_mtime
            self._number = max(self._number, number)
        for number in self._sizes:
            first = _first_record(segment_path(self.directory, number))
            if first is not None and first[0] == R.SEGMENT and len(first) > 4:
                self._created[number] = float(first[4])
        return replay

    def open(
        self,
        undo: Callable[[list[list[Any]]], None],
        checkpoint: Callable[[], Iterator[list[Any]]],
        closing: Callable[[], list[list[Any]]] | None = None,
    ) -> None:
        """Start writing: a new segment, opened with a checkpoint of the recovered state.

        ``undo(records)`` must reverse the effects of records whose write failed (newest
        first); ``checkpoint()`` yields records restating everything unstored, read when
        yielded; ``closing()``, if given, records that end each commit (appended to its batch
        when it is written, and undone with it). Needs a running event loop.
        """
        self._loop = asyncio.get_running_loop()
        self._undo = undo
        self._checkpoint = checkpoint
        if closing is not None:
            self._closing_records = closing
        self._new_segment()
        self._start_checkpoint()
        self._timer = self._loop.create_task(self._timer_loop(), name="wal-timer")

    async def close(self, final_checkpoint: bool = True) -> None:
        """Commit what is open, optionally compact once more, sync and close the file."""
        if self._closed or self._loop is None:
            return
        self._closing = True
        if self._batch:
            self._commit()
        if final_checkpoint and self.broken is None:
            # Unstored state is small after a drain: restate it in a fresh segment, so a
            # restart replays that instead of the history.
            self._ckpt = None
            try:
                self._new_segment()
            except OSError as exc:
                log.warning("no final checkpoint (the log stays as it is): %s", exc)
            else:
                # A commit per few records, as a running checkpoint writes them: one frame
                # stays far below MAX_RECORD whatever the checkpoint holds (warm keys).
                for rec in self._checkpoint():
                    self._batch.append(rec)
                    if len(self._batch) >= CHECKPOINT_RECORDS_PER_PASS:
                        self._commit()
                self._batch.append([R.CHECKPOINT_END, self._number])
                self._commit()
                if self.broken is None:
                    with contextlib.suppress(OSError):
                        self._sync_now()
                        self._drop_older(self._number)
        if self._timer is not None:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
        if self._sync_task is not None:
            with contextlib.suppress(Exception):
                await self._sync_task
        if self.broken is None and self._unsynced():
            with contextlib.suppress(OSError):
                self._sync_now()
        for _, fut in self._waiters:
            if not fut.done():
                fut.set_exception(WalError("the log was closed"))
        self._waiters.clear()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._closed = True

    # -- the hot path -------------------------------------------------------------------------

    @property
    def batch(self) -> int:
        """The open batch's number: what is appended now is committed, or undone, with it."""
        return self._gen

    @property
    def dirty(self) -> bool:
        """Whether records are appended and not committed yet."""
        return bool(self._batch)

    def append(self, record: list[Any]) -> None:
        """Add ``record`` to the open batch (committed at the end of this loop pass)."""
        self._batch.append(record)
        if not self._scheduled:
            self._scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._commit)

    def hold(
        self, send: Callable[[list[list[Any]], str | None], None], answers: list[list[Any]]
    ) -> None:
        """Call ``send(answers, None)`` (response arrays) once the open batch is committed; if
        its write fails, each answer becomes an ``unavailable`` error first, and ``send`` gets
        the failure's text instead of ``None``."""
        self._held.append((send, answers))

    def at_commit(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` now if nothing is waiting to be committed, else right after the open
        batch's commit (or, if it fails, right after its records are undone): ``fn`` then sees
        only state the log holds."""
        if not self._batch:
            fn()
        else:
            self._after.append(fn)

    async def durable(self) -> None:
        """Wait until every record appended so far is on disk (synced); :class:`WalError` if
        that cannot be."""
        if self.broken is not None:
            raise WalError(self.broken)
        target = self._gen if self._batch else self._gen - 1
        if self._synced >= target:
            return
        assert self._loop is not None
        fut: asyncio.Future[None] = self._loop.create_future()
        self._waiters.append((target, fut))
        if self.mode == "interval" and self._written >= target:
            self._sync_soon()
        await fut

    # -- commit -------------------------------------------------------------------------------

    def _commit(self) -> None:
        self._scheduled = False
        batch, self._batch = self._batch, []
        held, self._held = self._held, []
        gen = self.committing = self._gen
        self._gen += 1
        try:
            self._commit_batch(batch, held, gen)
        finally:
            after, self._after = self._after, []
            for fn in after:
                try:
                    fn()
                except Exception:
                    log.exception("a task run after a log commit failed")

    def _commit_batch(self, batch: list[list[Any]], held: list[Held], gen: int) -> None:
        if not batch:
            for send, answers in held:
                send(answers, None)
            return
        batch.extend(self._closing_records())
        error: str | None = self.broken
        if error is None and self._closed:
            error = "the log is closed"
        if error is None:
            marker = (
                self._synced_end
                if self.mode == "interval" and self._synced_end > self._marked
                else 0
            )
            data = R.frames([*batch, [R.SYNCED, marker]] if marker else batch, self._salt)
            try:
                self._write(data)
                if self.mode == "fsync":
                    began = time.perf_counter()
                    os.fdatasync(self._fd)
                    self.fsync_seconds.add(time.perf_counter() - began)
                    self.fsyncs += 1
            except OSError as exc:
                error = self._failed(exc, "writing")
            else:
                self._end += len(data)
                if marker:
                    self._marked = marker
                self._written = gen
                if self.mode == "fsync":
                    self._synced = gen
                self.commits += 1
                self.records += len(batch)
        if error is None:
            for send, answers in held:
                send(answers, None)
            self._wake_waiters()
            if self.mode == "interval" and any(t <= gen for t, _ in self._waiters):
                self._sync_soon()
            self._maybe_rotate()
            return
        # Nothing of this batch is in the log: take its effects back, answer its calls
        # unavailable, and tell whoever waits on it.
        try:
            self._undo(batch)
        except Exception:
            log.exception("undoing %d records after a failed log write", len(batch))
        unavailable = {"code": "unavailable", "message": f"write-ahead log: {error}"}
        for send, answers in held:
            for answer in answers:
                answer[2] = unavailable
                answer[3] = None
            send(answers, error)
        self._fail_waiters(gen, error)
        if self._ckpt is not None:
            self._ckpt = None
            self._ckpt_wanted = True

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        at = self._end
        while view:
            n = os.pwrite(self._fd, view, at)
            view = view[n:]
            at += n

    def _failed(self, exc: OSError, doing: str) -> str:
        """Cut the segment back to its last whole record and mark the log broken."""
        what = errno.errorcode.get(exc.errno or 0, "error") if exc.errno else type(exc).__name__
        message = f"{doing} {segment_path(self.directory, self._number).name} failed: {what}"
        if exc.errno == errno.ENOSPC:
            message += " (disk full)"
        try:
            os.ftruncate(self._fd, self._end)
        except OSError as exc2:
            log.critical("cannot cut the log back after a failed write: %s", exc2)
        self.failures += 1
        self.last_error = message
        if self.broken is None:
            log.error("write-ahead log broken, refusing writes until it recovers: %s", message)
        self.broken = message
        return message

    def _wake_waiters(self) -> None:
        if not self._waiters:
            return
        keep: list[tuple[int, asyncio.Future[None]]] = []
        for target, fut in self._waiters:
            if target <= self._synced:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((target, fut))
        self._waiters = keep

    def _fail_waiters(self, gen: int, error: str) -> None:
        keep: list[tuple[int, asyncio.Future[None]]] = []
        for target, fut in self._waiters:
            if target >= gen or self.broken is not None:
                if not fut.done():
                    fut.set_exception(WalError(error))
            else:
                keep.append((target, fut))
        self._waiters = keep

    # -- syncing (interval mode) ----------------------------------------------------------------

    def _sync_soon(self) -> None:
        if self._sync_task is None or self._sync_task.done():
            assert self._loop is not None
            self._sync_task = self._loop.create_task(self._sync_async())

    async def _sync_async(self) -> None:
        """One fsync of what is written now; again only while someone waits for more (the
        interval timer asks once per interval, the flusher per round: not once per write)."""
        assert self._loop is not None
        first = True
        while self._written > self._synced and self.broken is None:
            if not first and not any(t > self._synced for t, _ in self._waiters):
                return
            first = False
            target = self._written
            fd = self._fd
            number = self._number
            end_at = self._end
            began = time.perf_counter()
            try:
                await self._loop.run_in_executor(None, os.fdatasync, fd)
            except OSError as exc:
                if number != self._number:
                    continue  # rotated meanwhile: the old segment was synced when closed
                # Written records may have been answered already (interval mode): do not cut
                # them; stop accepting until the disk works again.
                self.failures += 1
                self.last_error = f"fsync failed: {exc}"
                self.broken = self.last_error
                # The kernel may have dropped written pages: once writable again, restate
                # everything from memory in a new segment.
                self._ckpt_wanted = True
                log.error("write-ahead log broken: %s", self.last_error)
                self._fail_waiters(0, self.last_error)
                return
            self.fsync_seconds.add(time.perf_counter() - began)
            self.fsyncs += 1
            if number == self._number:  # (not the fd: its number can be reused)
                self._synced = max(self._synced, target)
                self._synced_end = max(self._synced_end, end_at)
            waiting = len(self._waiters)
            self._wake_waiters()
            if len(self._waiters) < waiting:
                self._write_marker()  # before whoever waited acts on it (the flusher sends)

    def _write_marker(self) -> None:
        """Write a :data:`~meter.wal.records.SYNCED` record now, without a sync of its own
        (best effort: else the next commit carries it)."""
        if self.broken is not None or self._synced_end <= self._marked:
            return
        data = R.frame([R.SYNCED, self._synced_end], self._salt)
        try:
            self._write(data)
        except OSError:
            return
        self._end += len(data)
        self._marked = self._synced_end

    def _unsynced(self) -> bool:
        """Whether bytes are written and not synced: commits, or a SYNCED record (which has
        no commit of its own)."""
        return self._written > self._synced or (
            self.mode == "interval" and self._end > self._synced_end
        )

    def _sync_now(self) -> None:
        began = time.perf_counter()
        end = self._end
        os.fdatasync(self._fd)
        self.fsync_seconds.add(time.perf_counter() - began)
        self.fsyncs += 1
        self._synced = self._written
        self._synced_end = max(self._synced_end, end)
        self._wake_waiters()

    async def _timer_loop(self) -> None:
        while True:
            if self.broken is not None:
                await asyncio.sleep(PROBE_INTERVAL_S)
                self._probe()
                continue
            await asyncio.sleep(self.fsync_interval if self.mode == "interval" else 1.0)
            if self.mode == "interval" and self._written > self._synced:
                self._sync_soon()
            if self._ckpt_wanted and self._ckpt is None and not self._batch:
                self._ckpt_wanted = False
                self._rotate()
            self._maybe_rotate()

    def _probe(self) -> None:
        """While broken: try a small write and sync; success makes the log usable again."""
        if self._batch:
            return  # a commit is due anyway
        data = R.frame([R.NOOP], self._salt)
        try:
            os.ftruncate(self._fd, self._end)
            self._write(data)
            os.fdatasync(self._fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._end)
            return
        self._end += len(data)
        self._synced = self._written
        log.warning("write-ahead log writable again (was: %s)", self.broken)
        self.broken = None
        if self._ckpt_wanted and self._ckpt is None:
            self._ckpt_wanted = False
            self._rotate()

    # -- segments and compaction ------------------------------------------------------------

    def _new_segment(self) -> None:
        """Start the next segment; the open one is synced and closed once the new one exists.

        Raises ``OSError`` (the open segment stays in use) if the new one cannot be made.
        """
        if self._fd >= 0 and self._unsynced():
            # The old segment is whole on disk before a newer one exists: only the newest
            # segment can ever end torn.
            self._sync_now()
        number = self._number + 1
        now = time.time()
        path = segment_path(self.directory, number)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        salt = int.from_bytes(os.urandom(4), "little")
        # (the SEGMENT record itself is framed unsalted: a reader learns the salt from it)
        head = R.frame([R.SEGMENT, self.node_id, R.FORMAT, number, now, salt, self.mode])
        try:
            os.ftruncate(fd, 0)
            self._preallocate(fd)
            os.pwrite(fd, head, 0)
            os.fdatasync(fd)
            _sync_dir(self.directory)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        if self._fd >= 0:
            os.close(self._fd)
            self._sizes[self._number] = self._end
        self._number = number
        self._fd = fd
        self._end = len(head)
        self._salt = salt
        self._synced_end = self._marked = len(head)  # (synced above)
        self._opened_at = time.monotonic()
        self._created[number] = now

    def _preallocate(self, fd: int) -> None:
        """Reserve the segment's blocks up front: a sync then need not record a growing file
        size (about a quarter cheaper here), and a full disk shows when a segment is made.
        Best effort: a filesystem that cannot, or a disk too full, just grows the file."""
        if self._preallocated is False:
            return
        try:
            os.posix_fallocate(fd, 0, self.segment_bytes)
        except OSError as exc:
            os.ftruncate(fd, 0)
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                log.info("write-ahead log segments are not preallocated here: %s", exc)
                self._preallocated = False  # this filesystem cannot; do not ask again
        else:
            self._preallocated = True

    def _maybe_rotate(self) -> None:
        """Rotate (and compact) if the open segment is big or old enough. Only between
        batches: every record appended so far must be in the old segment."""
        if self._ckpt is not None or self.broken is not None or self._closing or self._batch:
            return
        age = time.monotonic() - self._opened_at
        # A checkpoint itself must not fill a segment, or the log would compact for ever.
        limit = max(self.segment_bytes, 4 * self._last_ckpt_bytes)
        if self._end >= limit or (
            age >= SEGMENT_MAX_AGE_S
            and self._end >= max(min(SMALL_SEGMENT, self.segment_bytes), 4 * self._last_ckpt_bytes)
        ):
            self._rotate()

    def _rotate(self) -> None:
        if self._batch:
            self._ckpt_wanted = True  # retried between batches
            return
        try:
            self._new_segment()
        except OSError as exc:
            self._ckpt_wanted = True
            self.last_error = f"starting a new segment failed: {exc}"
            log.error("write-ahead log: %s", self.last_error)
            return
        self._start_checkpoint()

    def _start_checkpoint(self) -> None:
        # The checkpoint lists what it restates now, in the step that opened the segment,
        # before any record can land in it: a key listed later could have records in the
        # new segment that depend on records in the old one (deleted once this completes).
        self._ckpt = self._checkpoint()
        self._ckpt_number = self._number
        self._ckpt_start = self._end
        assert self._loop is not None
        self._loop.call_soon(self._checkpoint_step)

    def _checkpoint_step(self) -> None:
        it = self._ckpt
        if it is None or self._closed:
            return
        if self.broken is not None:
            self._ckpt = None  # abandoned; started again once the log is writable
            self._ckpt_wanted = True
            return
        for _ in range(CHECKPOINT_RECORDS_PER_PASS):
            rec = next(it, None)
            if rec is None:
                self._ckpt = None
                self.append([R.CHECKPOINT_END, self._ckpt_number])
                self._last_ckpt_bytes = max(0, self._end - self._ckpt_start)
                assert self._loop is not None
                self._loop.create_task(self._finish_checkpoint(self._ckpt_number))
                return
            self.append(rec)
        assert self._loop is not None
        self._loop.call_soon(self._checkpoint_step)

    async def _finish_checkpoint(self, number: int) -> None:
        try:
            await self.durable()
        except WalError:
            self._ckpt_wanted = True
            return
        self.checkpoints += 1
        self._drop_older(number)

    def _drop_older(self, number: int) -> None:
        """Delete every segment before ``number`` (its checkpoint is durable)."""
        dropped = False
        for old in [n for n in self._sizes if n < number]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment_path(self.directory, old))
            del self._sizes[old]
            self._created.pop(old, None)
            dropped = True
        if dropped:
            with contextlib.suppress(OSError):
                _sync_dir(self.directory)

    # -- status -------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """What ``status`` shows about the log."""
        oldest = min(self._created.values(), default=None)
        return {
            "mode": self.mode,
            "segments": len(self._sizes) + (1 if self._fd >= 0 else 0),
            "size_bytes": sum(self._sizes.values()) + self._end,
            "oldest_segment_age_s": None if oldest is None else round(time.time() - oldest, 3),
            "broken": self.broken,
            "last_error": self.last_error,
            "commits": self.commits,
            "fsyncs": self.fsyncs,
            "records": self.records,
            "failures": self.failures,
            "checkpoints": self.checkpoints,
        }


def _first_record(path: Path) -> list[Any] | None:
    try:
        with path.open("rb") as fh:
            data = fh.read(4096)
    except OSError:
        return None
    found = R.scan(data)
    return found.records[0] if found.records else None


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
