"""Coalesced seeding: cold keys are read from storage together, not one request per key.

Every key asked for while a read is being prepared joins the same batch, across connections
and across the items of ``track_many``: a batch is dispatched on the next event-loop pass
after its first key arrives, or at once when it is full (``chunk`` keys: one ``BatchGetItem``
on DynamoDB, one ``IN`` query on SQLite). At most ``concurrency`` batches are read at a time;
keys asked for meanwhile wait in the next batch, which fills while the reads are out. Each
batch has one future: the callers waiting on a key wake when its batch lands, not when every
batch does.

Two queues: keys a caller waits on (``seed``) go before keys read ahead for nobody yet
(``prefetch``: a period about to begin, the keys a restarted node was using), so a read-ahead
of a hundred thousand keys never delays a request.

Only a fresh read seeds (C06): the table refuses a snapshot read before an eviction pass or a
claim of the node id (:meth:`~meter.core.table.CounterTable.seed`, the table's ``epoch``), and such
keys are read again, up to :data:`MAX_TRIES` times.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass

from meter.core.keys import Key
from meter.core.table import CounterTable
from storage.base import BadItems, Counters, Snapshot, StorageError

log = logging.getLogger("meter.seeder")

#: Reads of one key refused because an eviction pass overtook them, before giving up.
MAX_TRIES = 3
#: Seconds between two warnings about failed seeding reads.
WARN_EVERY_S = 5.0


@dataclass
class SeedStats:
    """Counts for ``status``."""

    #: Keys seeded by a read a caller waited for.
    on_demand: int = 0
    #: Keys seeded by a read made ahead of need.
    prefetched: int = 0
    #: Storage reads issued (batches).
    reads: int = 0
    #: Batches that failed (their keys stay unseeded; the flusher seeds them later).
    failed_reads: int = 0
    #: Keys in batches now being read.
    in_flight: int = 0
    last_error: str | None = None
    #: Keys whose stored item could not be decoded (left unseeded, the flusher reports them).
    bad_items: int = 0


class _Batch:
    """Keys read by one storage request; one future wakes everyone waiting on any of them."""

    __slots__ = ("ahead", "done", "keys", "sent")

    def __init__(self, ahead: bool) -> None:
        self.keys: list[Key] = []
        self.ahead = ahead
        self.sent = False
        self.done: asyncio.Future[None] | None = None


class Seeder:
    """Seeds cold keys of ``table`` from ``storage`` in batches of ``chunk`` keys, with at most
    ``concurrency`` reads out at once."""

    def __init__(
        self, table: CounterTable, storage: Counters, *, chunk: int, concurrency: int
    ) -> None:
        if chunk < 1 or concurrency < 1:
            raise ValueError("chunk and concurrency must be >= 1")
        self.table = table
        self.storage = storage
        self.chunk = chunk
        self.concurrency = concurrency
        self.stats = SeedStats()
        #: Key -> the batch it is queued in or being read by.
        self._where: dict[Key, _Batch] = {}
        self._tries: dict[Key, int] = {}
        self._now: deque[_Batch] = deque()  # waited on, oldest first
        self._ahead: deque[_Batch] = deque()  # read ahead, oldest first
        self._reading = 0
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._warned_at = 0.0
        #: Key -> callers of :meth:`_wait` waiting on it (a refused key they wait on is read
        #: again before the read-ahead).
        self._waiting: Counter[Key] = Counter()
        #: Set by :meth:`close`: nothing is queued or read any more.
        self._closed = False

    # -- callers ----------------------------------------------------------------------------

    async def seed(self, key: Key) -> bool:
        """Seed ``key`` (cold or unseeded) and wait for its batch; ``False`` if it is still
        unseeded after that (storage could not be read, or the item is undecodable)."""
        if self.table.is_seeded(key):
            return True
        await self._wait([key])
        return self.table.is_seeded(key)

    async def seed_many(self, keys: Iterable[Key]) -> None:
        """Seed every key of ``keys`` that is not seeded, and wait until each batch holding
        one has landed (whether or not its read worked)."""
        seeded = self.table.is_seeded
        wanted = [k for k in keys if not seeded(k)]
        if wanted:
            await self._wait(wanted)

    def prefetch(self, keys: Iterable[Key]) -> int:
        """Queue ``keys`` to be read ahead of need, behind every key a caller waits on; return
        how many were queued (keys seeded or queued already are skipped)."""
        if self._closed:
            return 0
        seeded = self.table.is_seeded
        n = 0
        for key in keys:
            if key not in self._where and not seeded(key):
                self._enqueue(key, ahead=True)
                n += 1
        return n

    async def settle(self, keys: list[Key]) -> None:
        """Wait until no key of ``keys`` is queued or being read, without moving any forward
        (the end of a read-ahead: each key then is seeded, or its read failed)."""
        where = self._where
        while True:
            futures: set[asyncio.Future[None]] = set()
            for key in keys:
                batch = where.get(key)
                if batch is not None:
                    if batch.done is None:
                        batch.done = asyncio.get_running_loop().create_future()
                    futures.add(batch.done)
            if not futures:
                return
            # A key a caller waits on meanwhile moves to another batch, and one an eviction
            # made the table refuse is queued again before its batch wakes us: look again.
            await asyncio.wait(futures)

    def status(self) -> dict[str, object]:
        """The ``seeding`` section of ``status``."""
        st = self.stats
        return {
            "on_demand": st.on_demand,
            "prefetched": st.prefetched,
            "reads": st.reads,
            "failed_reads": st.failed_reads,
            "bad_items": st.bad_items,
            "in_flight": st.in_flight,
            "queued": len(self._where) - st.in_flight,
            "chunk": self.chunk,
            "concurrency": self.concurrency,
            "last_error": st.last_error,
        }

    def closed(self) -> bool:
        """Whether :meth:`close` was called (nothing is queued or read any more)."""
        return self._closed

    def busy(self) -> bool:
        """Whether any key is queued or being read."""
        return bool(self._where)

    async def close(self) -> None:
        """Cancel queued and running reads (at shutdown); waiters wake, keys stay unseeded.
        Nothing is queued or read after it (callers asking later get their keys unseeded)."""
        self._closed = True  # a cancelled read's cleanup dispatches and re-queues nothing
        queued = [*self._now, *self._ahead]
        self._now.clear()
        self._ahead.clear()
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        # Every batch, queued or sent: a read task cancelled before it ran never got to its
        # finally (the counts are reset below), so its callers would wait for ever.
        for batch in {*queued, *self._where.values()}:
            _wake(batch)
        self._where.clear()
        self._tries.clear()
        self._reading = 0
        self.stats.in_flight = 0

    # -- batching ---------------------------------------------------------------------------

    async def _wait(self, keys: list[Key]) -> None:
        """Queue each of ``keys`` (none seeded: the caller checked) unless it is queued
        already, and wait until the batches holding them have landed."""
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        futures: set[asyncio.Future[None]] = set()
        last: _Batch | None = None
        waiting = self._waiting
        mine = list(dict.fromkeys(keys))
        waiting.update(mine)
        try:
            for key in keys:
                batch = self._join(key)
                if batch is not last:
                    if batch.done is None:
                        batch.done = loop.create_future()
                    futures.add(batch.done)
                    last = batch
            while futures:
                # asyncio.wait does not cancel the futures when this caller is cancelled:
                # other callers share them.
                await asyncio.wait(futures)
                if self.closed():
                    return  # (close wakes every batch: keys not read stay unseeded)
                # A key an eviction pass or a claim made the table refuse was queued again
                # (before the read-ahead) before its batch woke us: wait for that batch too.
                # (Keys whose read failed stay unseeded.)
                futures = set()
                for key in keys:
                    if key in self._where:
                        batch = self._join(key)
                        if batch.done is None:
                            batch.done = loop.create_future()
                        futures.add(batch.done)
        finally:
            waiting.subtract(mine)
            for key in mine:
                if waiting[key] <= 0:
                    del waiting[key]

    def _join(self, key: Key) -> _Batch:
        """The batch a caller waiting on ``key`` waits for: the one it is queued in or being
        read by, else a new one; a key queued to be read ahead moves to the front queue (a
        caller waits on it now)."""
        batch = self._where.get(key)
        if batch is None:
            return self._enqueue(key, ahead=False)
        if batch.ahead and not batch.sent:
            batch.keys.remove(key)
            return self._enqueue(key, ahead=False)
        return batch

    def _enqueue(self, key: Key, *, ahead: bool) -> _Batch:
        queue = self._ahead if ahead else self._now
        if queue and len(queue[-1].keys) < self.chunk:
            batch = queue[-1]
        else:
            batch = _Batch(ahead)
            queue.append(batch)
        batch.keys.append(key)
        self._where[key] = batch
        self._schedule()
        return batch

    def _schedule(self) -> None:
        if not self._scheduled and not self._closed:
            self._scheduled = True
            # The next pass: every key asked for in this one joins the batch first.
            asyncio.get_running_loop().call_soon(self._dispatch)

    def _dispatch(self) -> None:
        self._scheduled = False
        while self._reading < self.concurrency and not self._closed:
            if self._now:
                batch = self._now.popleft()
            elif self._ahead:
                batch = self._ahead.popleft()
            else:
                break
            if not batch.keys:
                _wake(batch)
                continue
            batch.sent = True
            self._reading += 1
            task = asyncio.get_running_loop().create_task(self._read(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _read(self, batch: _Batch) -> None:
        st = self.stats
        keys = batch.keys
        st.in_flight += len(keys)
        st.reads += 1
        epoch = self.table.epoch
        snaps: dict[Key, Snapshot] | None = None
        try:
            try:
                snaps = await self.storage.load(keys)
            except BadItems as exc:
                snaps = exc.good
                st.bad_items += len(exc.bad)
                self._warn(f"{len(exc.bad)} undecodable items: {exc}")
            except StorageError as exc:
                st.failed_reads += 1
                st.last_error = str(exc)[:300]
                self._warn(f"cannot seed {len(keys)} keys: {exc}")
            except Exception as exc:  # a backend bug must not strand the waiters
                st.failed_reads += 1
                st.last_error = repr(exc)[:300]
                log.exception("unexpected error seeding %d keys", len(keys))
        finally:
            st.in_flight -= len(keys)
            self._reading -= 1
            try:
                again = self._land(batch, snaps or {}, epoch)
                if not self._closed:
                    waiting = self._waiting
                    for key in again:
                        # A key a caller waits on is read again before the read-ahead.
                        self._enqueue(key, ahead=batch.ahead and key not in waiting)
            except Exception:  # a bug must not strand the waiters: they wake below
                st.last_error = f"landing {len(keys)} keys failed unexpectedly"
                log.exception("unexpected error landing %d seeded keys", len(keys))
            finally:
                _wake(batch)
                if self._now or self._ahead:
                    self._schedule()

    def _land(self, batch: _Batch, snaps: dict[Key, Snapshot], epoch: int) -> list[Key]:
        """Seed the keys of a landed batch; return those to read again (refused after an
        eviction pass or a claim of the node id overtook the read)."""
        where = self._where
        for key in batch.keys:
            if where.get(key) is batch:
                del where[key]
        seeded, refused = self.table.seed_many(snaps.items(), epoch)
        again: list[Key] = []
        tries = self._tries
        if refused or tries:
            refused_set = set(refused)
            for key in batch.keys:
                if key not in refused_set:
                    tries.pop(key, None)
                    continue
                n = tries.get(key, 1)
                if n < MAX_TRIES:
                    tries[key] = n + 1
                    again.append(key)
                else:
                    tries.pop(key, None)
        if batch.ahead:
            self.stats.prefetched += seeded
        else:
            self.stats.on_demand += seeded
        return again

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning(
                "%s (the flusher seeds them later; warnings held for %.0f s)", message, WARN_EVERY_S
            )


def _wake(batch: _Batch) -> None:
    if batch.done is not None and not batch.done.done():
        batch.done.set_result(None)
