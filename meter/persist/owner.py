"""One process per node id: this node's claim on its id in storage (ADR 0004).

Flushes are exactly once because storage applies a ``(node, key, seq)`` once. Two processes
flushing under one node id (an explicit ``METER_NODE_ID`` on two hosts: two data dirs) number
their flushes independently, and the store drops the second one's units as retries of the
first's. So each id has an *owner* in storage: a token and a lease.

- The token belongs to the data dir: a fresh one every start, kept there with the earlier ones,
  which the claim accepts. A restart on the same data dir takes its id back at once; another
  data dir must wait until the holder's lease has ended (it was released by a clean stop, or
  ran out after a crash).
- States: ``unknown`` (storage could not be asked yet: count, do not flush), ``owned``,
  ``waiting`` (another process holds the id: refuse to count, do not flush, claim again when its
  lease ends) and ``lost`` (another process took the id while we held it: stop for good).
- While owned, the lease is renewed every third of its length; before a flush round writes,
  the token is read back (one consistent read), and nothing is written once less than a third
  of the lease is left unrenewed. Another data dir can claim only an ended lease, so with clocks
  within a third of the lease of each other two processes never write under one id at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from storage.base import Owner, Owners, StorageError

log = logging.getLogger("meter.owner")

State = Literal["unknown", "owned", "waiting", "lost"]


class Ownership:
    """This node's hold on ``node`` in ``storage`` under ``token``.

    ``accept`` are the earlier tokens of the same data dir. ``on_state`` is called with every
    new state; ``on_claimed`` once the claim succeeded (the data dir then forgets the earlier
    tokens); ``note`` makes the note each renewal leaves on the owner record (what the node
    says of its state for exports to read; None: the note stays as it is).
    """

    def __init__(
        self,
        storage: Owners,
        node: str,
        token: str,
        accept: Sequence[str] = (),
        *,
        lease_s: float = 30.0,
        clock: Callable[[], float] = time.time,
        on_state: Callable[[State], None] | None = None,
        on_claimed: Callable[[], None] | None = None,
        note: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.storage = storage
        self.node = node
        self.token = token
        self.accept = list(accept)
        self.lease_s = lease_s
        self.clock = clock
        self.on_state = on_state
        self.on_claimed = on_claimed
        self.note = note
        self.state: State = "unknown"
        #: The end of our lease as last stored (owned).
        self.expires = 0.0
        #: When reading the token back last failed (clock seconds).
        self._read_failed = float("-inf")
        #: The other process's claim (waiting, lost).
        self.holder: Owner | None = None
        self.last_error: str | None = None
        self.claims = 0
        self.renewals = 0
        #: Reads of the token back that failed (storage unreachable): the flusher reports them.
        self.read_failures = 0
        self._lock = asyncio.Lock()

    # -- what the rest of the node asks --------------------------------------------------------

    @property
    def owned(self) -> bool:
        """Whether this node holds its id."""
        return self.state == "owned"

    def refusal(self) -> str | None:
        """Why mutating calls must be refused now, or ``None``."""
        if self.state == "waiting":
            return (
                f"node id {self.node!r} is owned by another process (another data dir); "
                "this node counts nothing until that one stops"
            )
        if self.state == "lost":
            return (
                f"node id {self.node!r} is now owned by another process; this node stopped "
                "counting and flushing"
            )
        return None

    def can_never_write(self) -> bool:
        """Whether waiting for a write is pointless (another process holds the id)."""
        return self.state in ("waiting", "lost")

    async def may_write(self) -> bool:
        """Before a flush round writes: renew if due, read the token back, check the lease."""
        async with self._lock:
            if self.state == "unknown":
                await self._claim()
            if not self.owned:
                return False
            now = self.clock()
            if now >= self.expires - 2 * self.lease_s / 3:
                await self._renew()
            elif now - self._read_failed >= self.lease_s / 30:
                # After a failed read, the next is a second or so later (lease 30 s): with
                # storage down each read fails only after its timeouts, and every round waiting
                # for one would delay its writes' failure (the lease, checked below, holds).
                try:
                    owner = await self.storage.owner(self.node)
                except StorageError as exc:
                    self.last_error = f"reading the owner: {exc}"  # the lease still holds
                    self._read_failed = self.clock()
                    self.read_failures += 1
                else:
                    if owner is None or owner.token != self.token:
                        self._lose(owner)
            return self.owned and self.clock() < self.expires - self.lease_s / 3

    # -- claiming and renewing ----------------------------------------------------------------

    async def claim(self) -> State:
        """Try once to own the id (at start, and whenever not owned)."""
        async with self._lock:
            await self._claim()
            return self.state

    async def step(self) -> None:
        """One round of the background loop: claim when not owned, renew when due."""
        async with self._lock:
            if self.state in ("unknown", "waiting"):
                await self._claim()
            elif self.state == "owned" and self.clock() >= self.expires - 2 * self.lease_s / 3:
                await self._renew()

    async def run(self) -> None:
        """Claim and renew in the background, forever (until cancelled)."""
        while True:
            await asyncio.sleep(self._pause())
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop renewals (the lease would run out)
                log.exception("owner: claim or renewal failed unexpectedly")

    def _pause(self) -> float:
        third = self.lease_s / 3
        if self.state == "owned":
            return max(0.01, min(third, self.expires - 2 * third - self.clock()))
        if self.state == "waiting" and self.holder is not None:
            # A clean stop releases the lease at once: look again well before it would end.
            return max(0.05, min(third, self.holder.expires - self.clock()))
        return min(1.0, third)

    async def release(self) -> None:
        """After a clean stop: end our lease now, so another data dir need not wait for it."""
        async with self._lock:
            if self.state != "owned":
                return
            try:
                await self.storage.renew_owner(
                    self.node, self.token, lease_s=0, now=self.clock(), note=self._note()
                )
            except StorageError as exc:
                log.warning("owner: could not release node id %r: %s", self.node, exc)
            else:
                self.expires = self.clock()

    async def _claim(self) -> None:
        now = self.clock()
        try:
            owner = await self.storage.claim_owner(
                self.node, self.token, lease_s=self.lease_s, now=now, accept=self.accept
            )
        except StorageError as exc:
            self.last_error = f"claiming: {exc}"
            return
        self.claims += 1
        if owner.token == self.token:
            self.expires = owner.expires
            self.holder = None
            self.last_error = None
            if self.on_claimed is not None:
                self.on_claimed()
            self.accept = []
            self._set("owned")
            return
        self.holder = owner
        self.last_error = (
            f"held by another process until {_iso(owner.expires)} (its lease is renewed "
            "while it runs)"
        )
        if self.state != "waiting":
            log.error(
                "node id %r is owned by another process (lease until %s): this node counts "
                "nothing and flushes nothing until that process stops. Two processes must not "
                "share a node id (METER_NODE_ID).",
                self.node,
                _iso(owner.expires),
            )
        self._set("waiting")

    async def _renew(self) -> None:
        now = self.clock()
        try:
            owner = await self.storage.renew_owner(
                self.node, self.token, lease_s=self.lease_s, now=now, note=self._note()
            )
        except StorageError as exc:
            self.last_error = f"renewing: {exc}"
            return
        if owner is not None and owner.token == self.token:
            self.expires = owner.expires
            self.renewals += 1
            self.last_error = None
        else:
            self._lose(owner)

    def _note(self) -> str | None:
        """The note for this renewal; None (the stored one kept) if making it failed: a bug
        there must not cost the lease."""
        try:
            return self.note()
        except Exception:
            log.exception("owner: the renewal's note could not be made (the last one stays)")
            return None

    def _lose(self, owner: Owner | None) -> None:
        self.holder = owner
        self.last_error = (
            "taken by another process" if owner is not None else "its owner record is gone"
        )
        log.error(
            "node id %r is now owned by another process (%s): this node stops flushing and "
            "refuses to count; its unflushed units stay in its write-ahead log. Two processes "
            "must not share a node id (METER_NODE_ID) or a copy of one data dir.",
            self.node,
            self.last_error,
        )
        self._set("lost")

    def _set(self, state: State) -> None:
        if state != self.state:
            self.state = state
            if state == "owned":
                log.info("node id %r claimed (lease %.0f s)", self.node, self.lease_s)
            if self.on_state is not None:
                self.on_state(state)

    def status(self) -> dict[str, Any]:
        """The ``owner`` map of ``status``."""
        now = self.clock()
        return {
            "state": self.state,
            "lease_s": self.lease_s,
            "lease_left_s": round(self.expires - now, 3) if self.state == "owned" else None,
            "holder_lease_left_s": (
                round(self.holder.expires - now, 3) if self.holder is not None else None
            ),
            "claims": self.claims,
            "renewals": self.renewals,
            "last_error": self.last_error,
        }


def _iso(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
