"""The gossip orchestrator a node owns: broadcaster, receiver, peer tracking, resync.

Receiving: a frame's deltas go to ``table.apply_remote_many`` (tagged with the flush sequence
they will be stored under), announcements to ``table.rebase(..., source="gossip")``. The tags
make both exact: a snapshot whose sequence for a peer has reached a tag contains that delta, so
the table drops it from ``remote`` exactly when the base takes it in (see ``docs/cluster.md``).

Pub/sub is at-most-once. A gap in a peer's message sequence, a (re)connect of our bus, a peer
restarting, going silent or being heard again after it was declared dead, and a periodic
reconciliation all ask the node's ``resync``
callback to re-read warm keys from storage and re-base on them. Requests are coalesced: one
resync runs at a time, and any that arrive meanwhile become one more.

Sharded (``shards`` K > 1, ADR 0024): a frame on a data shard is numbered within its (sender,
shard), so a gap there re-reads only the warm keys of that shard; each heartbeat on the control
channel says the sender's last number on every shard, and a number told by one heartbeat and
still unheard at the next is a lost tail: a gap too. With ``subscribe="warm"`` the node listens
only to the shards of tenants it holds warm, joining a shard (with a resync of its keys) when it
warms the first key of it, leaving it when it holds none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from cluster.api import AppliedView, GaugeSource, GossipTable, Key, Resync, ValueSource
from cluster.broadcaster import Broadcaster
from cluster.bus import Bus, BusUnavailable
from cluster.codec import (
    REASONS,
    AlertItem,
    Codec,
    DeltaItem,
    HoldItem,
    Message,
    ReadingItem,
    Rejected,
)
from cluster.peers import Peers, Seen
from cluster.shards import ShardMap

log = logging.getLogger("cluster.gossip")

S = TypeVar("S")

#: Rejection reasons beyond the codec's: a replayed/old message, and another process using
#: this node's id (a misconfiguration that would corrupt both nodes' flush sequences).
EXTRA_REASONS = ("stale", "own_id")


class Listener(Protocol):
    """What the node does with what peers send besides deltas and announcements."""

    def on_limits(self, version: int) -> None:
        """A peer changed the limits to ``version`` (``-1``: a frame may have been missed)."""
        ...

    def on_holds(self, peer: str, holds: Sequence[HoldItem]) -> None:
        """``peer``'s reservation holds (a ``holds`` frame; ``()`` when it is forgotten)."""
        ...

    def on_deltas(self, deltas: Sequence[DeltaItem]) -> None:
        """A frame's deltas changed this node's views (live usage push, threshold alerts);
        also how far an announcement or a resync moved a view (as a delta of sequence 0)."""
        ...

    def on_alert(self, sender: str, alert: AlertItem) -> None:
        """A peer's ``alert`` frame (a threshold alert it fired)."""
        ...


@dataclass(frozen=True, slots=True)
class GossipSettings:
    """Timings of the gossip layer, in seconds."""

    interval: float = 0.1
    heartbeat: float = 1.0
    #: A peer silent this long is dead: its un-flushed gossip is forgotten.
    peer_timeout: float = 5.0
    #: Re-read every warm key this often to bound drift from lost messages (0: never).
    reconcile: float = 60.0
    #: Pause after a failed resync before trying again (doubles up to 30 s).
    resync_retry: float = 1.0
    #: Gossip shards of the cluster (K; 1: one channel for everything).
    shards: int = 1
    #: ``all``: listen to every shard; ``warm``: only to the shards of tenants held warm.
    subscribe: str = "all"
    #: How often ``warm`` looks for shards to join or leave.
    warm_check: float = 0.5
    #: A sharded heartbeat heard sooner than this after the one before is not judged against
    #: it (frames on other masters may still be on their way); the next one is.
    tail_slack: float = 0.25


class Gossip(Generic[S]):
    """Cluster membership of one node over one :class:`~cluster.bus.Bus`."""

    def __init__(
        self,
        table: GossipTable[S],
        bus: Bus,
        *,
        node_id: str,
        cluster: str,
        make_snapshot: Callable[[int, dict[str, int]], S],
        resync: Resync,
        secret: str | None = None,
        settings: GossipSettings | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        after_commit: Callable[[Callable[[], object]], None] | None = None,
        incarnation: int | None = None,
        listener: Listener | None = None,
        gauges: GaugeSource | None = None,
        values: ValueSource | None = None,
    ) -> None:
        self.table = table
        #: The node's gauges: their readings are sent each tick and merged when heard.
        self.gauges = gauges
        #: Unique values known claimed: sent each tick, learned when heard.
        self.values = values
        #: Told of limit changes, holds, applied deltas and alerts from peers (if given).
        self.listener = listener
        self.bus = bus
        self.node_id = node_id
        self.settings = settings or GossipSettings()
        self.make_snapshot = make_snapshot
        self.resync = resync
        self.clock = clock
        #: When heartbeats are heard (the lost-tail check's slack).
        self.monotonic = monotonic
        # Increasing across restarts of this node: peers tell a restart from a replay of an old
        # message by it. The node keeps it in its data dir (max(now, last + 1)), so a restart on
        # a clock that went back is still newer; without one, the wall clock in ns.
        self.incarnation = time.time_ns() if incarnation is None else incarnation
        self.shards = ShardMap(cluster, self.settings.shards)
        self.codec = Codec(cluster, secret, self.shards.shards)
        #: Peers as heard on the bus' own channel (the control channel when sharded): who is
        #: alive, restarts, and (unsharded) every frame's number.
        self.peers = Peers(self.settings.peer_timeout)
        #: Sharded: each (sender, shard)'s frame numbers, one table per shard (never expired:
        #: liveness is the control channel's).
        self.shard_peers = [Peers(float("inf")) for _ in range(self.shards.shards)]
        #: Sharded: the shards listened to (``all``: every one, from the start).
        self.listening: frozenset[int] = frozenset(
            range(self.shards.shards)
            if self.shards.sharded and self.settings.subscribe != "warm"
            else ()
        )
        #: The newest incarnation heard of each sender, on any channel (a restart is acted on
        #: once, wherever it is heard first).
        self._incarnations: dict[str, int] = {}
        #: Each sender's last heartbeat judged: its incarnation, shard numbers, when heard.
        self._told: dict[str, tuple[int, tuple[int, ...], float]] = {}
        #: ``warm``: whether the bus confirmed :attr:`listening`, and shards joined whose
        #: keys are re-read once it has.
        self._listen_confirmed = True
        self._joining: set[int] = set()
        self.broadcaster = Broadcaster(
            table,
            bus,
            self.codec,
            node_id=node_id,
            incarnation=self.incarnation,
            interval=self.settings.interval,
            heartbeat=self.settings.heartbeat,
            clock=clock,
            after_commit=after_commit,
            gauges=gauges,
            values=values,
            shards=self.shards,
        )
        self.received: dict[str, int] = {
            "messages": 0,
            "deltas_applied": 0,
            "deltas_skipped": 0,
            "announcements_applied": 0,
            "announcements_skipped": 0,
            "readings_applied": 0,
            "readings_skipped": 0,
            "values_learned": 0,
            "values_skipped": 0,
            "echoes": 0,
            "unheard_shard": 0,
        }
        #: CPU seconds (this thread) spent decoding and applying received frames.
        self.apply_s = 0.0
        self.rejected: dict[str, int] = dict.fromkeys((*REASONS, *EXTRA_REASONS), 0)
        self.resyncs: dict[str, int] = {
            "gap": 0,
            "join": 0,
            "connect": 0,
            "peer": 0,
            "revive": 0,
            "reconcile": 0,
        }
        self.resync_failures = 0
        self.resync_last_error: str | None = None
        self.forgotten_units = 0
        self.shard_joins = 0
        self.shard_leaves = 0
        self._want_resync: set[str] = set()
        #: Shards whose keys a coming resync re-reads (``None``: every key).
        self._want_shards: set[int] | None = set()
        self._resync_event = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._warned_own_id = False

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the bus (it connects in the background) and the loops."""
        if self.listening:
            # (Subscribed at the first connect; a bus that is not up yet says so: fine.)
            with contextlib.suppress(BusUnavailable):
                await self.bus.listen(self._channels(self.listening))
        await self.bus.start(self.on_bytes, self.on_state)
        self._tasks = [
            asyncio.create_task(self.broadcaster.run_sender(), name="gossip-sender"),
            asyncio.create_task(self.broadcaster.run_ticks(), name="gossip-ticks"),
            asyncio.create_task(self._resync_loop(), name="gossip-resync"),
            asyncio.create_task(self._maintenance_loop(), name="gossip-maintenance"),
        ]

    async def stop(self, timeout: float = 2.0) -> None:
        """Publish what is left (last gossip; announcements already queued), then close."""
        sender = self._tasks[0] if self._tasks else None
        for task in self._tasks[1:]:
            task.cancel()
        for task in self._tasks[1:]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if sender is not None:
            self.broadcaster.gossip_committed()
            await asyncio.sleep(0)  # the log's commit (and so the take) runs this pass
            if not await self.broadcaster.drained(timeout):
                left = self.broadcaster.status()["queued"]
                log.warning("gossip: %s frames not sent at stop", left)
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender
        self._tasks = []
        await self.bus.close()

    def set_muted(self, muted: bool) -> None:
        """Stop (or resume) sending: a node that does not own its id must say nothing, or its
        peers would take its messages for a restart of the process that does (and refuse that
        one's as an older incarnation). Receiving goes on."""
        if muted == self.broadcaster.muted:
            return
        self.broadcaster.muted = muted
        if not muted:
            self.broadcaster.heartbeat_now()

    def holds_changed(self, items: Sequence[HoldItem]) -> bool:
        """Tell peers every counter this node holds reserved units on; False if not sent."""
        return self.broadcaster.holds_now(items)

    def alert_fired(self, item: AlertItem) -> bool:
        """Tell peers this node fired a threshold alert; False if not sent (bus down)."""
        return self.broadcaster.alert_now(item)

    def limits_changed(self, version: int) -> None:
        """Tell peers this node changed the stored limits to ``version``."""
        self.broadcaster.limits_changed(version)

    async def on_flushed(self, written: Sequence[tuple[Key, AppliedView]]) -> None:
        """The flusher hook: announce the snapshots just written."""
        self.broadcaster.announce(written)

    def readings_stored(self, items: Sequence[ReadingItem]) -> None:
        """The gauge flusher's hook: tell peers the readings storage answered (a reading
        of a peer's that wins over ours reaches every node that way too)."""
        self.broadcaster.readings(items)

    # -- receiving ----------------------------------------------------------------------------

    def on_bytes(self, data: bytes) -> None:
        """Handle one frame from the bus. Never raises."""
        t0 = time.thread_time()
        try:
            self._on_bytes(data)
        finally:
            self.apply_s += time.thread_time() - t0

    def _on_bytes(self, data: bytes) -> None:
        decoded = self.codec.decode(data)
        if isinstance(decoded, Rejected):
            self.rejected[decoded.reason] += 1
            log.debug("gossip frame rejected: %s %s", decoded.reason, decoded.detail)
            return
        try:
            self._receive(decoded)
        except Exception:  # a bug here must not stop gossip; resync repairs the view
            log.exception("applying a gossip message failed")
            self.request_resync("gap")

    def _receive(self, msg: Message) -> None:
        h = msg.header
        if h.sender == self.node_id:
            if h.incarnation == self.incarnation:
                self.received["echoes"] += 1  # our own message back from the channel
                return
            self.rejected["own_id"] += 1
            if not self._warned_own_id:
                self._warned_own_id = True
                log.error("another process publishes as node id %r (must be unique)", h.sender)
            return
        if h.shard is not None:
            self._receive_shard(msg)
            return
        sharded = self.shards.sharded
        verdict, missed = self.peers.observe(
            h.sender, h.incarnation, h.seq, h.sent_at, self.clock(), time.monotonic()
        )
        if verdict is Seen.STALE or self._incarnation(h.sender, h.incarnation) < 0:
            self.rejected["stale"] += 1
            return
        self.received["messages"] += 1
        if verdict is Seen.GAP:
            log.info("gossip gap from %s: %d messages lost; resyncing", h.sender, missed)
            if not sharded:  # (sharded, this channel carries no counter's units)
                self.request_resync("gap")
            self._maybe_missed_limits()
        elif verdict is Seen.FIRST and h.seq > 1 and not sharded:
            # A peer that was running before we heard it: its earlier messages may hold
            # deltas for keys we have warm. Cheap (once per peer), and closes that window.
            self.request_resync("join")
        elif verdict is Seen.RESTART:
            if self._restarted(h.sender, h.incarnation):
                self._restart(h.sender)
        elif verdict is Seen.REVIVED:
            # Declared dead while it was alive: its gossip was forgotten at its "death", and
            # what it flushed meanwhile may never be announced to us again. Storage has it.
            log.info("peer %s is heard again after being declared dead; resyncing", h.sender)
            self.request_resync("revive")
        if msg.kind == "heartbeat":
            if msg.shard_seqs:
                self._tails(h.sender, h.incarnation, msg.shard_seqs)
        elif msg.kind in ("limits", "holds", "alert"):
            self._control(msg)
        else:
            self._apply(msg)

    def _receive_shard(self, msg: Message) -> None:
        """A frame on data shard ``msg.header.shard``: numbered within (sender, shard)."""
        h = msg.header
        shard = h.shard
        assert shard is not None
        if shard not in self.listening:  # (a frame sent before we left the shard)
            self.received["unheard_shard"] += 1
            return
        age = self._incarnation(h.sender, h.incarnation)
        if age < 0:
            self.rejected["stale"] += 1
            return
        if age > 0 and self._restarted(h.sender, h.incarnation):
            self._restart(h.sender)  # heard here before its control channel said so
        verdict, missed = self.shard_peers[shard].observe(
            h.sender, h.incarnation, h.seq, h.sent_at, self.clock(), time.monotonic()
        )
        if verdict is Seen.STALE:
            self.rejected["stale"] += 1
            return
        self.received["messages"] += 1
        if verdict is Seen.GAP:
            log.info(
                "gossip gap from %s on shard %d: %d messages lost; resyncing",
                h.sender, shard, missed,
            )  # fmt: skip
            self.request_resync("gap", shard)
        elif verdict in (Seen.FIRST, Seen.RESTART) and h.seq > 1:
            self.request_resync("join", shard)
        self._apply(msg)

    def _incarnation(self, sender: str, incarnation: int) -> int:
        """-1 if ``incarnation`` is older than one heard of ``sender``, 1 if newer, else 0."""
        known = self._incarnations.setdefault(sender, incarnation)
        if incarnation == known:
            return 0
        return -1 if incarnation < known else 1

    def _restarted(self, sender: str, incarnation: int) -> bool:
        """Note ``sender``'s newer ``incarnation``; True if no channel had told it yet."""
        known = self._incarnations.get(sender)
        self._incarnations[sender] = incarnation
        return known is None or incarnation > known

    def _restart(self, sender: str) -> None:
        # Its earlier incarnation's un-flushed gossip will never be written as such.
        self._forget(sender)
        self.request_resync("peer")

    def _tails(self, sender: str, incarnation: int, told: tuple[int, ...]) -> None:
        """A sharded heartbeat: ``sender``'s last number on each shard. A number the previous
        heartbeat told that is still unheard is a lost tail (frames on another channel may
        come a little after a heartbeat, never a whole heartbeat later)."""
        mono = self.monotonic()
        before = self._told.get(sender)
        if before is not None and before[0] == incarnation:
            if mono - before[2] < self.settings.tail_slack:
                return  # (one sent out of turn, at a connect: judged by the next in turn)
            earlier: tuple[int, ...] | None = before[1]
        else:
            earlier = None
        self._told[sender] = (incarnation, told, mono)
        for shard in self.listening:
            peers = self.shard_peers[shard]
            peer = peers.by_node.get(sender)
            if peer is None or peer.incarnation != incarnation:
                if told[shard] == 0:  # it sent nothing there yet: its first frame is 1
                    peers.baseline(sender, incarnation, 0, mono)
                elif earlier is not None and earlier[shard] > 0:
                    # Frames of it there, none heard in a heartbeat: sent before we listened
                    # or lost since; storage has what they held, once flushed.
                    peers.baseline(sender, incarnation, earlier[shard], mono)
                    self.request_resync("join", shard)
            elif earlier is not None and earlier[shard] > peer.last_seq:
                lost = earlier[shard] - peer.last_seq
                peer.gaps += 1
                peer.missed += lost
                peer.last_seq = earlier[shard]
                log.info(
                    "gossip from %s on shard %d: its last %d messages lost; resyncing",
                    sender, shard, lost,
                )  # fmt: skip
                self.request_resync("gap", shard)

    def _apply(self, msg: Message) -> None:
        """A frame's counters, gauges or values."""
        h = msg.header
        table = self.table
        if msg.kind == "deltas":
            applied = table.apply_remote_many(h.sender, msg.deltas)
            self.received["deltas_applied"] += applied
            self.received["deltas_skipped"] += len(msg.deltas) - applied
            if applied and self.listener is not None:
                self.listener.on_deltas(msg.deltas)
        elif msg.kind == "announce":
            applied = 0
            # A flush announced before the deltas it holds moves the view here, and those
            # deltas are then skipped as already in: the listener hears the move instead.
            moved: list[DeltaItem] = []
            for t, f, p, total, seqs in msg.announcements:
                by = table.rebase_moved((t, f, p), self.make_snapshot(total, dict(seqs)), "gossip")
                if by is not None:
                    applied += 1
                    if by:
                        moved.append((t, f, p, 0, by))
            self.received["announcements_applied"] += applied
            self.received["announcements_skipped"] += len(msg.announcements) - applied
            if moved and self.listener is not None:
                self.listener.on_deltas(moved)
        elif msg.kind == "readings":
            merged = 0 if self.gauges is None else self.gauges.merge_readings(msg.readings)
            self.received["readings_applied"] += merged
            self.received["readings_skipped"] += len(msg.readings) - merged
        elif msg.kind == "values":
            learned = 0 if self.values is None else self.values.learn_values(msg.values)
            self.received["values_learned"] += learned
            self.received["values_skipped"] += len(msg.values) - learned

    def _control(self, msg: Message) -> None:
        """A frame for the node: limits changed, holds, an alert."""
        if self.listener is None:
            return
        h = msg.header
        if msg.kind == "limits":
            self.listener.on_limits(msg.limits_version)
        elif msg.kind == "holds":
            self.listener.on_holds(h.sender, msg.holds)
        elif msg.kind == "alert" and msg.alert is not None:
            self.listener.on_alert(h.sender, msg.alert)

    def on_state(self, up: bool) -> None:
        """The bus connected or lost its connection."""
        if up:
            # Whatever was published while we were away is lost to us: re-read storage. Peers'
            # silence during our outage was ours, not theirs.
            self.peers.touch_all(time.monotonic())
            self.request_resync("connect")
            self._maybe_missed_limits()
            # Tell peers at once that we are here (and where our sequence stands).
            self.broadcaster.heartbeat_now()

    def _maybe_missed_limits(self) -> None:
        """A lost frame may have been a ``limits`` one: have the node check the version."""
        if self.listener is not None:
            self.listener.on_limits(-1)

    def _forget(self, peer: str) -> None:
        # A dead (or restarted) peer will never flush what it gossiped under those sequences:
        # drop it, or views would stay above the stored truth for good.
        self.forgotten_units += self.table.forget_peer(peer)
        if self.listener is not None:  # its reservations died with it
            self.listener.on_holds(peer, ())

    # -- resync and housekeeping ---------------------------------------------------------------

    def request_resync(self, reason: str, shard: int | None = None) -> None:
        """Ask for the warm keys of ``shard`` (``None``: every warm key) to be re-read from
        storage (coalesced)."""
        self._want_resync.add(reason)
        if shard is None or not self.shards.sharded:
            self._want_shards = None
        elif self._want_shards is not None:
            self._want_shards.add(shard)
        self._resync_event.set()

    async def _resync_loop(self) -> None:
        backoff = self.settings.resync_retry
        while True:
            await self._resync_event.wait()
            self._resync_event.clear()
            reasons, self._want_resync = self._want_resync, set()
            shards, self._want_shards = self._want_shards, set()
            try:
                await self.resync(self._of_shards(shards))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.resync_failures += 1
                self.resync_last_error = f"{type(exc).__name__}: {exc}"
                log.warning("gossip resync failed: %s", self.resync_last_error)
                self._want_resync |= reasons
                if shards is None or self._want_shards is None:
                    self._want_shards = None
                else:
                    self._want_shards |= shards
                await asyncio.sleep(backoff)
                backoff = min(30.0, backoff * 2)
                self._resync_event.set()
                continue
            backoff = self.settings.resync_retry
            for reason in reasons:
                self.resyncs[reason] = self.resyncs.get(reason, 0) + 1

    def _of_shards(self, shards: set[int] | None) -> Callable[[Key], bool] | None:
        """The resync filter of the keys of ``shards`` (``None``: every key)."""
        if shards is None:
            return None
        of = self.shards.of
        return lambda key: of(key[0]) in shards

    def _channels(self, shards: frozenset[int]) -> list[str]:
        return [self.shards.channel(s) for s in sorted(shards)]

    async def _maintenance_loop(self) -> None:
        step = min(0.5, self.settings.peer_timeout / 4)
        if self.shards.sharded and self.settings.subscribe == "warm":
            step = min(step, self.settings.warm_check)
        last_reconcile = time.monotonic()
        while True:
            await asyncio.sleep(step)
            mono = time.monotonic()
            if self.bus.connected:
                for peer in self.peers.expire(mono):
                    log.warning("peer %s is silent: forgetting its un-flushed gossip", peer)
                    self._forget(peer)
                    self.request_resync("peer")
            if self.shards.sharded and self.settings.subscribe == "warm":
                try:
                    await self.follow_warm()
                except Exception:  # a bug here must not end peers' expiry and reconciles
                    log.exception("following the warm tenants' shards failed")
            reconcile = self.settings.reconcile
            if reconcile > 0 and mono - last_reconcile >= reconcile:
                last_reconcile = mono
                self.request_resync("reconcile")

    async def follow_warm(self) -> None:
        """``warm``: listen to the shards of the tenants held warm (counters and gauges), and
        to no other. A shard joined takes frames at once (the bus may deliver before it
        confirms) and has its keys re-read once the bus confirmed it listens, so nothing
        sent after is missed; a listen that failed is asked again until it succeeds."""
        of = self.shards.of
        keys, gauges = self.table.keys(), [] if self.gauges is None else self.gauges.warm()
        wanted = frozenset({of(key[0]) for key in keys} | {of(key[0]) for key, _ in gauges})
        if wanted == self.listening and self._listen_confirmed:
            return
        joined, left = wanted - self.listening, self.listening - wanted
        for shard in joined | left:  # numbers heard there before are stale
            self.shard_peers[shard] = Peers(float("inf"))
        self.listening = wanted
        self._joining = (self._joining | joined) - left
        self.shard_joins += len(joined)
        self.shard_leaves += len(left)
        self._listen_confirmed = False  # (until the bus says so: asked again next time)
        try:
            await self.bus.listen(self._channels(wanted))
        except BusUnavailable:
            return  # (a reconnect listens to them, and resyncs everything)
        self._listen_confirmed = True
        for shard in self._joining:
            self.request_resync("join", shard)
        self._joining = set()

    # -- status -------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Peers, counts of messages sent/received/rejected, gaps and resyncs."""
        mono = time.monotonic()
        peers = self.peers.status(mono)
        return {
            "node_id": self.node_id,
            "incarnation": self.incarnation,
            "cluster": self.codec.cluster,
            "authenticated": self.codec.authenticated,
            "interval_ms": round(self.settings.interval * 1000, 3),
            "muted": self.broadcaster.muted,
            "bus": self.bus.describe(),
            "live_peers": self.peers.live(),
            "peers": peers,
            "sent": self.broadcaster.status(),
            "received": {**self.received, "apply_s": round(self.apply_s, 6)},
            "rejected": dict(self.rejected),
            "gaps": sum(int(_num(p["gaps"])) for p in peers.values()),
            "missed": sum(int(_num(p["missed"])) for p in peers.values()),
            "resyncs": dict(self.resyncs),
            "resync_failures": self.resync_failures,
            "resync_last_error": self.resync_last_error,
            "forgotten_units": self.forgotten_units,
            **(self._shard_status() if self.shards.sharded else {}),
        }

    def _shard_status(self) -> dict[str, Any]:
        return {
            "shards": self.shards.shards,
            "subscribe": self.settings.subscribe,
            "listening": len(self.listening),
            "shard_joins": self.shard_joins,
            "shard_leaves": self.shard_leaves,
            "shard_gaps": sum(p.gaps for peers in self.shard_peers for p in peers.by_node.values()),
            "shard_missed": sum(
                p.missed for peers in self.shard_peers for p in peers.by_node.values()
            ),
        }


def _num(v: object) -> float:
    return float(v) if isinstance(v, int | float) else 0.0
