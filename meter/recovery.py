"""Recovery after a restart: put what the write-ahead log holds back into a node's memory.

Runs before the socket opens. Keys with units the store may not hold are restored unseeded
(their in-flight delta keeps its sequence), then seeded from storage in batches, which says
whether that sequence landed; the flusher re-sends it unchanged if not. Open reservations,
finished reservations and request ids come back with their original deadlines.
"""

from __future__ import annotations

import asyncio
import logging
import time

from meter.keys import Key
from meter.reservations import Lease
from meter.service import Service
from meter.wal.log import WriteAheadLog

log = logging.getLogger("meter.recovery")

#: Keys per storage read while seeding recovered keys, reads in flight, and how long the
#: socket waits for them (keys not seeded by then are seeded by the flusher, serving meanwhile).
SEED_CHUNK = 100
SEED_CONCURRENCY = 8
SEED_BUDGET_S = 5.0


async def recover(wal: WriteAheadLog, service: Service) -> None:
    """Replay ``wal`` into ``service`` (its table, reservations and ids), then open the log
    for writing with a checkpoint of the recovered state."""
    started = time.monotonic()
    replay = wal.recover()
    table = service.table
    now = time.time()
    unstored = replay.unstored()
    units = 0
    for key, row in unstored.items():
        table.restore(key, row.seq, row.inflight, row.pending)
        units += row.inflight + row.pending
    leases = 0
    for lease_id, lease in replay.leases.items():
        if lease.deadline <= now:
            continue  # expired while the node was down: released
        table.reserve(lease.key, lease.qty, None, check=False)
        mono = time.monotonic() + (lease.deadline - now)
        service.reservations.open_again(Lease(lease_id, lease.key, lease.qty, mono))
        leases += 1
    for registry, entries in (
        (service.ids, replay.live_ids(now)),
        (service.done, replay.live_done(now)),
    ):
        for rid, (fp, answer, expires) in sorted(entries.items(), key=lambda kv: kv[1][2]):
            registry.put(rid, fp, answer, expires, now)
    seeded = await _seed(service, [*unstored, *(ls.key for ls in replay.leases.values())])
    wal.open(service.undo, service.checkpoint)
    if replay.records:
        log.info(
            "recovered from the write-ahead log in %.3f s: %d records, %d keys (%d units) not "
            "known stored, %d open reservations, %d request ids; %d keys seeded",
            time.monotonic() - started,
            replay.records,
            len(unstored),
            units,
            leases,
            len(service.ids),
            seeded,
        )


async def _seed(service: Service, keys: list[Key]) -> int:
    """Seed recovered keys in concurrent batches, for at most :data:`SEED_BUDGET_S`.

    Keys storage cannot answer by then stay unseeded: counted, their totals unknown until the
    flusher seeds them (it does so every round), so a big backlog never keeps the socket shut.
    """
    table = service.table
    wanted = list(dict.fromkeys(k for k in keys if not table.is_seeded(k)))
    chunks = [wanted[i : i + SEED_CHUNK] for i in range(0, len(wanted), SEED_CHUNK)]
    if not chunks:
        return 0
    seeded = 0
    gate = asyncio.Semaphore(SEED_CONCURRENCY)

    async def one(chunk: list[Key]) -> None:
        nonlocal seeded
        async with gate:
            snaps = await service.storage.load(chunk)
        for key, snap in snaps.items():
            seeded += table.seed(key, snap)

    tasks = [asyncio.ensure_future(one(c)) for c in chunks]
    done, pending = await asyncio.wait(tasks, timeout=SEED_BUDGET_S)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)
    errors = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
    if errors or pending:
        log.warning(
            "%d of %d recovered keys not seeded yet (the flusher will): %s",
            len(wanted) - seeded,
            len(wanted),
            errors[0] if errors else f"storage took over {SEED_BUDGET_S} s",
        )
    return seeded
