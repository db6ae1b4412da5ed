"""The broadcaster: turns this node's table into gossip frames and sends them, in order.

Every tick it takes every touched key's gossip (``take_gossip_all``) and publishes one message
holding all the deltas (split only if it would pass the frame budget). After each flush the
flusher hook hands it the snapshots written, which it announces. When nothing was sent for a
heartbeat interval it sends a heartbeat, so peers see it alive and notice a lost last message.

Frames are numbered when encoded and sent by one task in that order, so a peer's gap detection
sees sequences in order, and a slow or dead Redis never blocks the flusher or the tick.

In a sharded cluster (ADR 0024) each key's items go on its tenant's shard, numbered per shard,
and the control frames on the control channel with their own numbers; a heartbeat goes there
every ``heartbeat`` seconds whatever else was sent, carrying each shard's last number.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.api import AppliedView, GaugeSource, GossipSource, Key, ValueSource
from cluster.bus import Bus, BusUnavailable
from cluster.codec import (
    AlertItem,
    AnnounceItem,
    Codec,
    DeltaItem,
    Header,
    HoldItem,
    Kind,
    ReadingItem,
    ValueItem,
    chunks,
)
from cluster.shards import ShardMap

log = logging.getLogger("cluster.broadcaster")


@dataclass
class SendStats:
    """What was sent (or not), for ``status``."""

    messages: int = 0
    deltas: int = 0
    announcements: int = 0
    heartbeats: int = 0
    limits: int = 0
    holds: int = 0
    alerts: int = 0
    readings: int = 0
    values: int = 0
    items: int = 0
    bytes: int = 0
    failed: int = 0  # publish failed (bus down): the frame is lost, peers see a gap
    dropped: int = 0  # outbox full: the frame is lost, peers see a gap
    last_error: str | None = None
    encode_s: float = 0.0  # CPU seconds spent taking and encoding deltas (this thread)


class Broadcaster:
    """Encodes and sends this node's messages through ``bus``."""

    def __init__(
        self,
        table: GossipSource,
        bus: Bus,
        codec: Codec,
        *,
        node_id: str,
        incarnation: int,
        interval: float,
        heartbeat: float,
        frame_budget: int = 256 * 1024,
        max_outbox: int = 1024,
        clock: Callable[[], float] = time.time,
        after_commit: Callable[[Callable[[], object]], None] | None = None,
        gauges: GaugeSource | None = None,
        values: ValueSource | None = None,
        shards: ShardMap | None = None,
    ) -> None:
        self.table = table
        #: The cluster's shards (one: every frame on the bus' own channel).
        self.shards = shards or ShardMap(codec.cluster, 1)
        #: Gauges' readings go out with each tick's deltas (``None``: none kept).
        self.gauges = gauges
        #: Unique values learned claimed go out with each tick too (``None``: none kept).
        self.values = values
        #: Runs a take once every state change made so far is committed to the node's log
        #: (``None``: at once). Units of a call whose log write fails are then never gossiped.
        self.after_commit = after_commit
        self.bus = bus
        self.codec = codec
        self.node_id = node_id
        self.incarnation = incarnation
        self.interval = interval
        self.heartbeat = heartbeat
        self.frame_budget = frame_budget
        self.clock = clock
        self.stats = SendStats()
        #: The last number of a frame on the bus' own channel (the control channel).
        self.seq = 0
        #: The last number of a frame on each data shard (sharded clusters).
        self.shard_seqs = [0] * self.shards.shards
        #: Something peers should have heard was never sent (an announcement while the bus
        #: was down; the table then drops the gossip of what was stored): the next frame
        #: skips a number, so every peer sees a gap and re-reads storage. (Sharded, the
        #: shard's number is skipped at once: the next heartbeat tells it, a lost tail.)
        self._owe_gap = False
        #: Send nothing (the node does not own its id: another process speaks for it).
        self.muted = False
        self._outbox: asyncio.Queue[tuple[Kind, int, bytes, int | None]] = asyncio.Queue(max_outbox)
        self._last_sent = time.monotonic()
        self._idle = asyncio.Event()
        self._idle.set()

    # -- producing frames (synchronous: callable from any hook) -------------------------------

    def gossip_now(self) -> int:
        """Take every touched key's gossip and queue it; return the number of deltas queued.

        While the bus is down nothing is taken: the units stay in the table and go out in the
        first tick after the bus returns, unless they were stored meanwhile (the table drops
        those; peers re-read storage, see :meth:`announce`).
        """
        if not self.bus.connected or self.muted:
            return 0
        t0 = time.thread_time()
        items: list[DeltaItem] = self.table.take_gossip_all()
        self._queue_keyed("deltas", items)
        if self.gauges is not None:
            self.readings(self.gauges.take_readings())
        if self.values is not None:
            self._queue_keyed("values", self.values.take_values())
        self.stats.encode_s += time.thread_time() - t0
        return len(items)

    def _queue_keyed(
        self,
        kind: Kind,
        items: list[DeltaItem] | list[AnnounceItem] | list[ReadingItem] | list[ValueItem],
    ) -> None:
        """Queue items of keys in frames under the budget, each on its key's shard."""
        if not items:
            return
        groups: dict[int | None, list[Any]] = self.shards.split(items)
        for shard, group in groups.items():
            for part in chunks(group, self.frame_budget):
                self._queue(kind, part, shard=shard)

    def readings(self, items: Sequence[ReadingItem]) -> None:
        """Queue gauges' readings (observed here, or stored by the gauge flusher); nothing
        while the bus is down: peers re-read storage when it returns."""
        if not items or not self.bus.connected or self.muted:
            return
        self._queue_keyed("readings", list(items))

    def gossip_committed(self) -> None:
        """:meth:`gossip_now`, at the node's next commit boundary (see ``after_commit``)."""
        if self.after_commit is None:
            self.gossip_now()
        else:
            self.after_commit(self.gossip_now)

    def announce(self, written: Sequence[tuple[Key, AppliedView]]) -> None:
        """Queue the snapshots just written by the flusher."""
        if not written:
            return
        if not self.bus.connected or self.muted:
            # Peers learn these totals from storage: they re-read it when they reconnect
            # themselves, or when they see the gap our next frame leaves.
            if self.shards.sharded:
                for shard in {self.shards.of(k[0]) for k, _ in written}:
                    self.shard_seqs[shard] += 1
            else:
                self._owe_gap = True
            return
        items: list[AnnounceItem] = [
            (k[0], k[1], k[2], a.snapshot.total, dict(a.snapshot.seqs)) for k, a in written
        ]
        self._queue_keyed("announce", items)

    def heartbeat_now(self) -> None:
        """Queue a heartbeat."""
        if self.bus.connected and not self.muted:
            self._queue("heartbeat", (), shard_seqs=self.shard_seqs)

    def limits_changed(self, version: int) -> None:
        """Queue a ``limits`` frame: this node changed the stored limits to ``version``.
        With the bus down it is not sent; peers poll the version meanwhile."""
        if self.bus.connected and not self.muted:
            self._queue("limits", (), version)

    def holds_now(self, items: Sequence[HoldItem]) -> bool:
        """Queue a ``holds`` frame: every counter this node holds reserved units on (one
        frame: the receiver replaces what it knew). False if not sent (bus down, muted)."""
        if not self.bus.connected or self.muted:
            return False
        self._queue("holds", items)
        return True

    def alert_now(self, item: AlertItem) -> bool:
        """Queue an ``alert`` frame (a threshold alert this node fired); False if not sent
        (bus down, muted)."""
        if not self.bus.connected or self.muted:
            return False
        self._queue("alert", (item,))
        return True

    def _queue(
        self,
        kind: Kind,
        items: Sequence[DeltaItem]
        | Sequence[AnnounceItem]
        | Sequence[HoldItem]
        | Sequence[AlertItem]
        | Sequence[ReadingItem]
        | Sequence[ValueItem],
        limits_version: int = 0,
        *,
        shard: int | None = None,
        shard_seqs: Sequence[int] = (),
    ) -> None:
        if shard is None:
            if self._owe_gap:
                self._owe_gap = False
                self.seq += 1  # a number never sent: a gap for every peer
            self.seq += 1
            seq = self.seq
        else:
            seq = self.shard_seqs[shard] = self.shard_seqs[shard] + 1
        header = Header(
            self.codec.cluster, self.node_id, self.incarnation, seq, self.clock(), shard
        )
        frame = self.codec.encode(header, kind, items, limits_version, shard_seqs)
        try:
            self._outbox.put_nowait((kind, len(items), frame, shard))
            self._idle.clear()
        except asyncio.QueueFull:
            self.stats.dropped += 1

    # -- loops --------------------------------------------------------------------------------

    async def run_ticks(self) -> None:
        """Gossip every ``interval`` on a fixed schedule (a slow tick does not shift the next),
        and heartbeat whenever nothing was sent for ``heartbeat`` seconds (its own schedule:
        the tick may be longer than the heartbeat)."""
        next_at = time.monotonic() + self.interval
        while True:
            wake = min(next_at, self._last_sent + self.heartbeat)
            await asyncio.sleep(max(0.0, wake - time.monotonic()))
            now = time.monotonic()
            try:
                if now >= next_at:
                    next_at += self.interval
                    if next_at < now:  # fell behind (a stalled loop): skip the missed ticks
                        next_at = now + self.interval
                    self.gossip_committed()
                if now - self._last_sent >= self.heartbeat:
                    if self._outbox.empty() or self.shards.sharded:
                        self.heartbeat_now()
                    self._last_sent = now  # queued (or bus down): next look in a heartbeat
            except Exception:
                log.exception("gossip tick failed")

    async def run_sender(self) -> None:
        """Send queued frames in order, forever."""
        channel = self.shards.channel
        while True:
            kind, n, frame, shard = await self._outbox.get()
            try:
                await self.bus.publish(frame, None if shard is None else channel(shard))
            except BusUnavailable as exc:
                self.stats.failed += 1
                self.stats.last_error = str(exc)
            else:
                self._count(kind, n, len(frame))
            finally:
                if shard is None:  # (sharded: heartbeats keep their schedule)
                    self._last_sent = time.monotonic()
                if self._outbox.empty():
                    self._idle.set()

    async def drained(self, timeout: float) -> bool:
        """Wait until every queued frame was sent (or failed); False on timeout."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return self._outbox.empty()

    def _count(self, kind: Kind, n: int, size: int) -> None:
        s = self.stats
        s.messages += 1
        s.bytes += size
        s.items += n
        if kind == "deltas":
            s.deltas += 1
        elif kind == "announce":
            s.announcements += 1
        elif kind == "limits":
            s.limits += 1
        elif kind == "holds":
            s.holds += 1
        elif kind == "alert":
            s.alerts += 1
        elif kind == "readings":
            s.readings += 1
        elif kind == "values":
            s.values += 1
        else:
            s.heartbeats += 1

    def status(self) -> dict[str, object]:
        """Counts for ``status``."""
        s = self.stats
        return {
            "messages": s.messages,
            "delta_messages": s.deltas,
            "announce_messages": s.announcements,
            "heartbeats": s.heartbeats,
            "limits_messages": s.limits,
            "holds_messages": s.holds,
            "alert_messages": s.alerts,
            "readings_messages": s.readings,
            "values_messages": s.values,
            "items": s.items,
            "bytes": s.bytes,
            "failed": s.failed,
            "dropped": s.dropped,
            "queued": self._outbox.qsize(),
            "last_error": s.last_error,
            "seq": self.seq,
            **({"shard_seqs": list(self.shard_seqs)} if self.shards.sharded else {}),
            "encode_s": round(s.encode_s, 6),
        }
