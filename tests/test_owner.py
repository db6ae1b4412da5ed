"""The node's hold on its id (meter/persist/owner.py) on a real in-memory store, with a clock
the test moves: renewals, the write margin, a lease that runs out while storage is unreachable."""

from __future__ import annotations

from collections.abc import Sequence

from meter.persist.owner import Ownership, State
from storage.base import Owner, StorageUnavailable
from storage.memory import MemoryStorage


class Unreachable(MemoryStorage):
    """A memory store whose owner calls fail while ``down``."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise StorageUnavailable("injected: storage unreachable")

    async def claim_owner(
        self, node: str, token: str, *, lease_s: float, now: float, accept: Sequence[str] = ()
    ) -> Owner:
        self._check()
        return await super().claim_owner(node, token, lease_s=lease_s, now=now, accept=accept)

    async def renew_owner(
        self, node: str, token: str, *, lease_s: float, now: float, note: str | None = None
    ) -> Owner | None:
        self._check()
        return await super().renew_owner(node, token, lease_s=lease_s, now=now, note=note)

    async def owner(self, node: str) -> Owner | None:
        self._check()
        return await super().owner(node)


def state(o: Ownership) -> str:
    return o.state


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def test_the_lease_is_renewed_and_writes_stop_before_it_can_end() -> None:
    store, clock = Unreachable(), Clock(1000.0)
    states: list[State] = []
    me = Ownership(store, "n", "mine", lease_s=30, clock=clock, on_state=states.append)
    store.down = True
    assert await me.claim() == "unknown"
    assert me.refusal() is None  # counts meanwhile (C10), but does not write
    assert not await me.may_write()
    store.down = False
    assert await me.may_write()  # claims first
    assert states == ["owned"] and me.expires == 1030.0
    clock.now = 1009.0
    assert await me.may_write() and me.renewals == 0  # not due yet: the token is read back
    clock.now = 1011.0
    assert await me.may_write() and me.renewals == 1 and me.expires == 1041.0
    # Storage unreachable: the lease is not renewed, and writes stop a third before its end.
    store.down = True
    clock.now = 1030.5
    assert await me.may_write() and state(me) == "owned"
    clock.now = 1031.5
    assert not await me.may_write() and state(me) == "owned"
    # Another data dir waits for the lease to end...
    other = Ownership(store, "n", "theirs", lease_s=30, clock=clock)
    store.down = False
    assert await other.claim() == "waiting" and other.refusal() is not None
    clock.now = 1041.0
    assert await other.claim() == "owned"
    # ...and then this node finds its id taken: it stops for good.
    assert not await me.may_write()
    assert state(me) == "lost" and states == ["owned", "lost"]
    assert me.refusal() is not None and me.can_never_write()
    assert me.status()["holder_lease_left_s"] == 30.0


async def test_a_release_frees_the_id_at_once_and_a_restart_accepts_earlier_tokens() -> None:
    store, clock = MemoryStorage(), Clock(1000.0)
    first = Ownership(store, "n", "t1", lease_s=30, clock=clock)
    assert await first.claim() == "owned"
    # A restart on the same data dir (the earlier token accepted) does not wait.
    claimed: list[bool] = []
    again = Ownership(
        store, "n", "t2", ["t1"], lease_s=30, clock=clock, on_claimed=lambda: claimed.append(True)
    )
    assert await again.claim() == "owned" and claimed == [True] and again.accept == []
    other = Ownership(store, "n", "x", lease_s=30, clock=clock)
    assert await other.claim() == "waiting"
    await again.release()
    assert await other.claim() == "owned"
