"""Threshold alerts: a counter's view crossing a percentage of its limit (docs/quotas.md,
"Threshold alerts").

A limit may list ``alerts``, percentages of its ``limit``; the threshold of ``pct`` is
``ceil(limit * pct / 100)`` units. A node detects a crossing when its view of a counter goes
from below a threshold to at or above it (``before < threshold <= after``): on its own counts
and when a peer's gossip raises the view. Every node may detect the same crossing; it fires
once across the fleet per ``(tenant, feature, period, pct)``: the crossing's id is a digest of
those four, and only the node whose conditional "put if absent" of the id in storage
(:meth:`storage.base.Storage.claim_alert`) stored its body delivers it.

The pure parts (:func:`threshold_units`, :func:`crossed`, :func:`alert_id`, :class:`Alert`)
come first; :class:`Alerts` is a node's bookkeeping: crossings detected and not claimed yet
(bounded, retried while storage is unreachable), ids already claimed or seen claimed
(bounded), ids already delivered (bounded), and counts for ``status``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from meter.core.dims import decode, name_of
from storage.base import StorageError
from storage.periods import bounds

log = logging.getLogger("meter.alerts")

#: The ``feature`` of a balance alert (a tenant's credits went below an amount).
BALANCE = "#balance"
#: Crossings detected and not claimed yet that a node keeps (storage unreachable); past this
#: the oldest is dropped (counted in ``dropped``).
MAX_PENDING = 10_000
#: Crossing ids a node remembers as claimed (by it or another node) or queued, so it does not
#: claim again on every unit; the oldest are forgotten past this (a later crossing of a
#: forgotten one asks storage again, which answers "already claimed").
MAX_KNOWN = 100_000
#: Crossing ids a node remembers as delivered (a repeated frame is not delivered twice).
MAX_DELIVERED = 10_000
#: Pause between claim attempts while storage does not answer.
RETRY_S = 1.0

Key = tuple[str, ...]


class ClaimJournal(Protocol):
    """Told around each claim (the webhooks' outbox: :mod:`meter.quotas.webhooks`)."""

    def claiming(self, alerts: list[tuple[Alert, str]]) -> None:
        """Before any of ``alerts`` is claimed, each with its claim's body: every crossing
        pending is journaled at once (a crash while storage is down loses none); raising
        keeps them pending."""

    def claimed(self, alert: Alert, won: bool) -> None:
        """The claim was answered: won by this node, or by another."""


def threshold_units(limit: int, pct: int) -> int:
    """The threshold of ``pct`` percent of ``limit``, in units: ``ceil(limit * pct / 100)``."""
    return -(-limit * pct // 100)


def crossed(alerts: tuple[int, ...], limit: int, before: int, after: int) -> list[tuple[int, int]]:
    """``(pct, units)`` of every threshold of ``alerts`` that a view going from ``before`` to
    ``after`` crossed upwards (``before < units <= after``), lowest first; several when one
    change jumps over more than one."""
    if after <= before:
        return []
    out: list[tuple[int, int]] = []
    for pct in alerts:
        units = -(-limit * pct // 100)
        if before < units <= after:
            out.append((pct, units))
    return out


def alert_id(tenant: str, feature: str, period: str, pct: int) -> str:
    """The crossing's id: the same on every node for one ``(tenant, feature, period, pct)``
    (32 hex digits of a SHA-256 of the four)."""
    raw = "\x1f".join((tenant, feature, period, str(pct))).encode("utf-8", "surrogatepass")
    return hashlib.sha256(raw).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Alert:
    """One crossing as a node detected it (``node``: which, ``at``: when, epoch seconds)."""

    id: str
    tenant: str
    feature: str
    period: str
    threshold: int
    threshold_units: int
    limit: int
    value: int
    node: str
    at: float

    def to_wire(self) -> dict[str, Any]:
        """The map of an ``alert`` notification (docs/protocol.md); a dimension counter's
        (docs/dimensions.md) names its feature and, in ``dims``, its dimension values."""
        feature, pairs, _ = decode(self.feature)
        out = self._wire(feature)
        if pairs:
            out["dims"] = dict(pairs)
        return out

    def _wire(self, feature: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "tenant": self.tenant,
            "feature": feature,
            "period": self.period,
            "threshold": self.threshold,
            "threshold_units": self.threshold_units,
            "limit": self.limit,
            "value": self.value,
            "node": self.node,
            "at": self.at,
        }

    def body(self) -> str:
        """What the claim stores: the whole record (the node id tells the claimant)."""
        return json.dumps(self.to_wire(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_wire(cls, wire: object) -> Alert | None:
        """An alert from its map (a gossip frame's body); ``None`` if it is not one."""
        if not isinstance(wire, dict):
            return None
        try:
            feature = wire["feature"]
            dims = wire.get("dims")
            if dims is not None:
                if (
                    type(feature) is not str
                    or not isinstance(dims, dict)
                    or not all(type(k) is str and type(v) is str for k, v in dims.items())
                ):
                    return None
                feature = name_of(feature, tuple(dims.items()))
            out = cls(
                id=wire["id"],
                tenant=wire["tenant"],
                feature=feature,
                period=wire["period"],
                threshold=wire["threshold"],
                threshold_units=wire["threshold_units"],
                limit=wire["limit"],
                value=wire["value"],
                node=wire["node"],
                at=float(wire["at"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        strs = (out.id, out.tenant, out.feature, out.period, out.node)
        ints = (out.threshold, out.threshold_units, out.limit, out.value)
        if not all(type(s) is str and 0 < len(s) <= 1024 for s in strs):
            return None
        if not all(type(n) is int for n in ints):
            return None
        return out


def from_peer_ok(alert: Alert, sender: str, now: float) -> bool:
    """Whether a peer's ``alert`` frame is one ``sender`` could have fired now: its own claim,
    under the id of its fields, of a period (of any calendar, docs/periods.md) holding now
    (or a minute ago: a frame sent just before a boundary). A signed frame replayed later, or
    from another node, is not."""
    if alert.node != sender:
        return False
    if alert.id != alert_id(alert.tenant, alert.feature, alert.period, alert.threshold):
        return False
    if alert.feature == BALANCE:  # (named by a ledger entry, not a period)
        return True
    try:
        start, end = bounds(alert.period)
    except (ValueError, TypeError):
        return False
    return start <= now < end or start <= now - 60 < end


def make_alert(key: Key, pct: int, units: int, limit: int, value: int, node: str) -> Alert:
    """The record of ``key``'s view crossing ``pct`` percent (``units``) of ``limit``."""
    t, f, p = key
    return Alert(alert_id(t, f, p, pct), t, f, p, pct, units, limit, value, node, time.time())


def _bounded_add(ids: OrderedDict[str, None], aid: str, most: int) -> None:
    ids[aid] = None
    ids.move_to_end(aid)
    while len(ids) > most:
        ids.popitem(last=False)


class Alerts:
    """One node's alerts: detect, claim (the run loop), deliver.

    ``claim(id, body)`` is the storage's conditional put; ``on_fired(alert)`` is called for
    each claim this node won (the node announces it to the fleet and delivers it here),
    ``on_deliver(alert)`` for each alert to give to this node's subscribers (once per id).
    """

    def __init__(
        self,
        node: str,
        claim: Callable[[str, str], Awaitable[bool]],
        *,
        max_pending: int = MAX_PENDING,
        max_known: int = MAX_KNOWN,
        retry_s: float = RETRY_S,
        on_fired: Callable[[Alert], None] | None = None,
        on_deliver: Callable[[Alert], None] | None = None,
        journal: ClaimJournal | None = None,
    ) -> None:
        self.node = node
        #: This process (claims name it: see _claim_body).
        self.process = os.urandom(6).hex()
        self.claim = claim
        self.max_pending = max_pending
        self.max_known = max_known
        self.retry_s = retry_s
        self.on_fired = on_fired
        self.on_deliver = on_deliver
        self.journal = journal
        #: The claim bodies of pending crossings, as journaled (a resumed one's: an earlier
        #: process's).
        self._bodies: dict[str, str] = {}
        #: Crossings detected, not claimed yet (oldest first).
        self.pending: OrderedDict[str, Alert] = OrderedDict()
        self._known: OrderedDict[str, None] = OrderedDict()
        self._delivered: OrderedDict[str, None] = OrderedDict()
        #: Claims this node won (it delivered those alerts to the fleet).
        self.fired = 0
        #: Claims another node (or an earlier start of this one) had won already.
        self.claimed_elsewhere = 0
        #: Alerts given to this node's subscribers (once per id, whoever fired it).
        self.delivered = 0
        #: Crossings dropped unclaimed (``max_pending`` others waited).
        self.dropped = 0
        #: Claim attempts storage did not answer, and the last such error.
        self.failures = 0
        self.last_error: str | None = None
        #: Alerts this node fired that could not be added to the Redis Stream.
        self.stream_failures = 0
        self._wake: asyncio.Event | None = None

    def detect(
        self, key: Key, limit: int, alerts: tuple[int, ...], before: int, after: int
    ) -> None:
        """The view of ``key`` went from ``before`` to ``after``: queue a claim for every
        threshold crossed that this node does not know as claimed or queued already."""
        for pct, units in crossed(alerts, limit, before, after):
            self.queue(make_alert(key, pct, units, limit, after, self.node))

    def balance_entry(
        self, tenant: str, seq: int, before: int, after: int, amounts: tuple[int, ...]
    ) -> None:
        """Ledger entry ``seq`` took ``tenant``'s balance from ``before`` to ``after``: queue
        an alert for every amount it went below (``after < amount <= before``). The entry's
        sequence names the crossing, so each crossing fires once and a later one (after a
        grant) fires again (docs/ledger.md, "Balance alerts")."""
        for amount in amounts:
            if after < amount <= before:
                period = f"seq-{seq}"
                aid = alert_id(tenant, BALANCE, period, amount)
                now = time.time()
                alert = Alert(
                    aid, tenant, BALANCE, period, amount, amount, 0, after, self.node, now
                )
                self.queue(alert)

    def queue(self, alert: Alert) -> None:
        """Queue a claim of ``alert`` unless this node knows it as claimed or queued."""
        if alert.id in self._known or alert.id in self.pending:
            return
        _bounded_add(self._known, alert.id, self.max_known)
        pending = self.pending
        if len(pending) >= self.max_pending:
            old, _ = pending.popitem(last=False)
            self._known.pop(old, None)
            self._bodies.pop(old, None)
            self.dropped += 1
        pending[alert.id] = alert
        if self._wake is not None:
            self._wake.set()

    async def run(self) -> None:
        """Claim what is pending whenever something is detected; while storage does not
        answer, try again every ``retry_s``."""
        self._wake = wake = asyncio.Event()
        while True:
            if not self.pending:
                await wake.wait()
            wake.clear()
            if not await self.claim_pending():
                await asyncio.sleep(self.retry_s)

    async def claim_pending(self) -> bool:
        """Claim every pending crossing, oldest first; False if storage did not answer (what
        is left stays pending)."""
        fresh = [a for aid, a in self.pending.items() if aid not in self._bodies]
        for alert in fresh:  # (the body an alert is journaled with is the one it is claimed with)
            self._bodies[alert.id] = self._claim_body(alert)
        if self.journal is not None and fresh:
            try:
                self.journal.claiming([(a, self._bodies[a.id]) for a in fresh])
            except (OSError, sqlite3.Error) as exc:
                for alert in fresh:
                    self._bodies.pop(alert.id, None)
                self.failures += 1
                self.last_error = f"journal: {exc}"
                log.error("alerts: the webhooks' outbox failed (claims wait): %s", exc)
                return False
        while self.pending:
            aid, alert = next(iter(self.pending.items()))
            body = self._bodies[aid]
            try:
                won = await self.claim(aid, body)
            except StorageError as exc:
                self.failures += 1
                if self.last_error is None:
                    log.warning("alerts: storage did not answer a claim (kept, retried): %s", exc)
                self.last_error = str(exc)
                return False
            self.last_error = None
            self.pending.pop(aid, None)
            self._bodies.pop(aid, None)
            if self.journal is not None:
                try:
                    self.journal.claimed(alert, won)
                except (OSError, sqlite3.Error):  # (the next start claims it again: kept)
                    log.exception("alerts: the outcome of %s's claim not journaled", aid)
            if not won:
                self.claimed_elsewhere += 1
                continue
            self.fired += 1
            if alert.feature == BALANCE:
                log.warning("alert %s: the balance of %s fell below %d: %d",
                            aid, alert.tenant, alert.threshold, alert.value)  # fmt: skip
            else:
                log.warning(
                    "alert %s: %s/%s (%s) reached %d%% of its limit %d: %d >= %d",
                    aid, alert.tenant, alert.feature, alert.period, alert.threshold,
                    alert.limit, alert.value, alert.threshold_units,
                )  # fmt: skip
            if self.on_fired is not None:
                try:
                    self.on_fired(alert)
                except Exception:  # a delivery bug must not stop the claims
                    log.exception("alerts: delivering %s failed", aid)
        return True

    def resume(self, alert: Alert, claim: str) -> None:
        """Queue ``alert``'s claim again with the body ``claim`` an earlier process tried it
        with (the journal holds no outcome): storage answers won if that process won it."""
        self._bodies[alert.id] = claim
        self.queue(alert)

    def _claim_body(self, alert: Alert) -> str:
        """What a claim stores: the crossing and its claimant (this node and process), not
        what changes between detections (value, time), so a claim tried again after a lost
        answer, even for a crossing detected anew, is recognised as this process's."""
        return json.dumps(
            {"id": alert.id, "tenant": alert.tenant, "feature": alert.feature,
             "period": alert.period, "threshold": alert.threshold, "node": self.node,
             "process": self.process},
            sort_keys=True, separators=(",", ":"),
        )  # fmt: skip

    def deliver(self, alert: Alert) -> bool:
        """Give ``alert`` to this node's subscribers unless it was already; whether it was."""
        if alert.id in self._delivered:
            return False
        _bounded_add(self._delivered, alert.id, MAX_DELIVERED)
        _bounded_add(self._known, alert.id, self.max_known)  # claimed: never claim it here
        self.pending.pop(alert.id, None)
        self._bodies.pop(alert.id, None)
        self.delivered += 1
        if self.on_deliver is not None:
            self.on_deliver(alert)
        return True

    def status(self) -> dict[str, Any]:
        return {
            "fired": self.fired,
            "pending": len(self.pending),
            "delivered": self.delivered,
            "dropped": self.dropped,
            "claimed_elsewhere": self.claimed_elsewhere,
            "claim_failures": self.failures,
            "stream_failures": self.stream_failures,
            "last_error": self.last_error,
        }
