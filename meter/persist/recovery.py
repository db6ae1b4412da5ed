"""Recovery after a restart: put what the write-ahead log holds back into a node's memory, then
warm up the keys the node was using.

:func:`recover` runs before the socket opens. Keys with units the store may not hold are
restored unseeded (their in-flight delta keeps its sequence), then seeded from storage in
batches, which says whether that sequence landed; the flusher re-sends it unchanged if not.
Open reservations, finished reservations and request ids come back with their original
deadlines. It returns the keys the log names as recently active (:meth:`Replay.warm_keys`).

:func:`warm_up` runs once the socket is open: it reads those keys ahead, behind every key a
request waits on (:meth:`~meter.core.seeder.Seeder.prefetch`), so the first calls after a restart
find them warm instead of paying one storage read each.
"""

from __future__ import annotations

import asyncio
import logging
import time

from meter.core.idempotency import Effect
from meter.core.keys import Key
from meter.core.leases import Lease
from meter.core.reserving import dim_keys
from meter.core.service import Service
from meter.wal.log import WriteAheadLog

log = logging.getLogger("meter.recovery")

#: How long the socket waits for the recovered keys' seeding reads (keys not seeded by then
#: stay queued, and the flusher seeds them too: a big backlog never keeps the socket shut).
SEED_BUDGET_S = 5.0
#: Keys a warm-up hands to the seeder per loop pass (choosing them takes the loop's time).
WARM_SLICE = 2000


async def recover(wal: WriteAheadLog, service: Service) -> list[Key]:
    """Replay ``wal`` into ``service`` (its table, reservations and ids), then open the log
    for writing with a checkpoint of the recovered state. Returns the keys to warm up (the
    recently active ones, most recent first), also kept in the service's journal so that
    checkpoints list them until :func:`warm_up` has read them."""
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
        mono = time.monotonic() + (lease.deadline - now)
        back = Lease(lease_id, lease.key, lease.qty, mono, lease.dims)
        for key in (lease.key, *dim_keys(back)):
            table.reserve(key, lease.qty, None, check=False)
        service.reservations.open_again(back)
        leases += 1
    for registry, entries in (
        (service.ids, replay.live_ids(now)),
        (service.done, replay.live_done(now)),
    ):
        for rid, (fp, answer, expires) in sorted(entries.items(), key=lambda kv: kv[1][2]):
            counted = replay.effects.get(rid) if registry is service.ids else None
            effect = None if counted is None else Effect(*counted)
            registry.put(rid, fp, answer, expires, now, effect)
    warm = replay.warm_keys() if service.config.warm_up_max_keys > 0 else []
    service.journal.warm_up_started(warm)
    # Gauges' readings: back as they were (unseeded: read before use; the gauge flusher
    # writes them again, which storage keeps only where they win).
    service.gauging.table.restore(
        (key, kind, reading) for key, (kind, reading) in replay.gauges.items()
    )
    # Claims of unique values the log holds no outcome of: claimed again (the node's loop).
    service.uniques.restore(replay.claims)
    service.uniques.voids.restore(replay.unmarked)
    service.journal.units.restore(replay.units, replay.inflight_takes())
    seeded = await _seed(service, [*unstored, *(ls.key for ls in replay.leases.values())])
    service.gate.shares.recovered(replay.shares)
    wal.open(service.undo, service.checkpoint, service.journal.closing)
    if replay.records:
        log.info(
            "recovered from the write-ahead log in %.3f s: %d records, %d keys (%d units) not "
            "known stored, %d open reservations, %d request ids; %d keys seeded; %d recently "
            "active keys to warm up",
            time.monotonic() - started,
            replay.records,
            len(unstored),
            units,
            leases,
            len(service.ids),
            seeded,
            len(warm),
        )
    return warm


async def _seed(service: Service, keys: list[Key]) -> int:
    """Read recovered keys ahead of need, and wait for them at most :data:`SEED_BUDGET_S`.

    Keys storage has not answered for by then stay queued (and unseeded: counted, their
    totals unknown); the flusher also seeds them, every round, so a big backlog or storage
    that is down never keeps the socket shut.
    """
    table = service.table
    wanted = list(dict.fromkeys(k for k in keys if not table.is_seeded(k)))
    if not wanted:
        return 0
    seeder = service.seeder
    failed = seeder.stats.failed_reads
    seeder.prefetch(wanted)
    late = False
    try:
        await asyncio.wait_for(seeder.settle(wanted), SEED_BUDGET_S)
    except TimeoutError:
        late = True
    seeded = sum(1 for k in wanted if table.is_seeded(k))
    if seeded < len(wanted):
        log.warning(
            "%d of %d recovered keys not seeded yet (the flusher will): %s",
            len(wanted) - seeded,
            len(wanted),
            f"storage took over {SEED_BUDGET_S} s"
            if late or seeder.stats.failed_reads == failed
            else seeder.stats.last_error,
        )
    return seeded


async def warm_up(service: Service, keys: list[Key]) -> None:
    """Read ``keys`` ahead (those of a current period, at most ``warm_up_max_keys``), behind
    every key a request waits on, and log one line when every read has landed."""
    try:
        await _warm_up(service, keys)
    except Exception:  # a hint: its failure must neither stop the node nor its drain
        log.exception("warm-up failed (keys not read yet are read when asked for)")


async def _warm_up(service: Service, keys: list[Key]) -> None:
    started = time.monotonic()
    seeder = service.seeder
    table = service.table
    failed = seeder.stats.failed_reads
    left = service.config.warm_up_max_keys
    slices: list[list[Key]] = []
    skipped = queued = 0
    for start in range(0, len(keys), WARM_SLICE):
        if left <= 0:
            break
        part, passed = service.current_keys(keys[start : start + WARM_SLICE], left)
        left -= len(part)
        skipped += passed
        queued += seeder.prefetch(part)
        slices.append(part)
        await asyncio.sleep(0)  # requests are served between slices
    for part in slices:  # in the order they were queued: mostly one wait each
        await seeder.settle(part)
    # Cancelled before this (a stop), the keys stay listed: the last checkpoint keeps them.
    service.journal.warm_up_done(keys)
    wanted = sum(len(part) for part in slices)
    warm = sum(1 for part in slices for k in part if table.is_seeded(k))
    reads_failed = seeder.stats.failed_reads - failed
    log.info(
        "warm-up done in %.3f s: %d of %d recently active keys warm (%d read ahead, the rest "
        "were warm already or asked for meanwhile), %d keys of ended periods skipped%s",
        time.monotonic() - started,
        warm,
        wanted,
        queued,
        skipped,
        f"; {reads_failed} reads failed: {seeder.stats.last_error}" if reads_failed else "",
    )
