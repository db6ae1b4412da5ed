"""Live usage push: who watches which tenant, and what each connection still has to be sent.

Pure bookkeeping (no I/O, no asyncio); the server writes, the node's watch loop ticks.

Changes are found by comparing, once per tick, each watched tenant's counters with the values
seen at the tick before, not by recording every change as it happens. The counting paths
(``track``, ``track_many``, reservations, gossip frames, re-bases on stored totals) then pay
nothing, subscribers or not; a tick costs one read of each watched tenant's loaded counters.
A counter that changed many times in a tick is seen once, with its latest value.

A connection's unsent notifications wait in its :class:`Subscriber`: at most one per counter
(a newer value replaces an unsent one) and at most ``max_pending`` counters, so a subscriber
that does not read costs a bounded amount of memory whatever changes; what is replaced
(``replaced``) or refused (``refused``) is counted, together ``dropped``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from itertools import islice
from typing import Any

from meter.config import MAX_WATCHED_TENANTS
from meter.core.dims import decode, is_dimension
from meter.core.keys import Key, check_feature
from meter.errors import InvalidArgument, Unavailable

#: Tenants one connection may subscribe to.
MAX_SUBSCRIPTIONS = 64
#: Features one subscription may name.
MAX_FEATURES = 256
#: Counters whose notification may wait unsent on one connection.
MAX_PENDING = 10_000
#: Threshold alerts that may wait unsent on one connection (``subscribe_alerts``); past this
#: the oldest unsent one is dropped (counted).
MAX_PENDING_ALERTS = 1000

#: A tenant's counters as ``(feature, period) -> value``.
View = dict[tuple[str, str], int]


class Subscriber:
    """One connection's subscriptions (tenant -> features, ``None`` for all) and its outbox."""

    __slots__ = (
        "alerts",
        "alerts_dropped",
        "alerts_on",
        "alerts_sent",
        "closed",
        "max_pending",
        "pending",
        "refused",
        "replaced",
        "sent",
        "tenants",
    )

    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self.tenants: dict[str, frozenset[str] | None] = {}
        #: Unsent notifications, one per counter, the latest value wins.
        self.pending: dict[Key, int] = {}
        self.max_pending = max_pending
        #: Notifications handed to the connection.
        self.sent = 0
        #: Unsent values replaced by a newer one of the same counter (the newer one waits).
        self.replaced = 0
        #: Values refused because ``max_pending`` other counters were waiting.
        self.refused = 0
        #: Its connection is gone (:meth:`Watch.remove`): it may not subscribe again.
        self.closed = False
        #: ``subscribe_alerts``: whether it gets threshold alerts, and those unsent (oldest
        #: first, at most MAX_PENDING_ALERTS), sent, and dropped unsent.
        self.alerts_on = False
        self.alerts: deque[dict[str, Any]] = deque()
        self.alerts_sent = 0
        self.alerts_dropped = 0

    @property
    def has_pending(self) -> bool:
        """Whether notifications of any kind wait unsent."""
        return bool(self.pending) or bool(self.alerts)

    def offer_alert(self, alert: dict[str, Any]) -> None:
        """Queue an ``alert`` notification; the oldest unsent one is dropped (counted) if
        MAX_PENDING_ALERTS wait."""
        if len(self.alerts) >= MAX_PENDING_ALERTS:
            self.alerts.popleft()
            self.alerts_dropped += 1
        self.alerts.append(alert)

    def take_alerts(self, most: int) -> list[dict[str, Any]]:
        """The ``most`` oldest unsent alerts, taken out of the outbox."""
        alerts = self.alerts
        out = [alerts.popleft() for _ in range(min(most, len(alerts)))]
        self.alerts_sent += len(out)
        return out

    @property
    def dropped(self) -> int:
        """Notifications never sent: replaced by a newer value, or refused while full."""
        return self.replaced + self.refused

    def offer(self, key: Key, value: int) -> None:
        """Queue ``value`` for ``key``, replacing an unsent one (counted in ``replaced``);
        refused (counted in ``refused``) if ``max_pending`` other counters are waiting."""
        pending = self.pending
        if key in pending:
            pending[key] = value
            self.replaced += 1
        elif len(pending) >= self.max_pending:
            self.refused += 1
        else:
            pending[key] = value

    def take(self, most: int) -> list[list[Any]]:
        """The params (:func:`notification`) of the ``most`` oldest pending notifications,
        taken out of the outbox."""
        pending = self.pending
        if len(pending) <= most:
            self.pending = {}
            out = [notification(t, f, v, p) for (t, f, p), v in pending.items()]
        else:
            keys = list(islice(pending, most))
            out = [notification(t, f, pending.pop((t, f, p)), p) for t, f, p in keys]
        self.sent += len(out)
        return out


class Bind:
    """A method's answer that needs the calling connection's :class:`Subscriber`: the server
    answers ``run(subscriber)`` instead (a result, or an awaitable of it)."""

    __slots__ = ("run",)

    def __init__(self, run: Callable[[Subscriber], Any]) -> None:
        self.run = run


def notification(tenant: str, name: str, value: int, period: str) -> list[Any]:
    """A usage notification's params: ``[tenant, feature, value, period]``, and for a
    dimension counter (docs/dimensions.md) its feature and a fifth, its dimensions
    ``{name: value}``."""
    if not is_dimension(name):
        return [tenant, name, value, period]
    feature, pairs, _ = decode(name)
    return [tenant, feature, value, period, dict(pairs)]


def watched(name: str, features: frozenset[str] | None) -> bool:
    """Whether a subscription to ``features`` (``None``: all) watches the counter ``name``:
    one of a feature, or a dimension counter of it."""
    if features is None or name in features:
        return True
    return is_dimension(name) and decode(name)[0] in features


def check_features(features: Any) -> frozenset[str] | None:
    """A subscription's feature list (``None`` or empty: every feature), validated."""
    if features is None:
        return None
    if not isinstance(features, list):
        raise InvalidArgument(
            f"subscribe: features must be an array of feature names, got {type(features).__name__}"
        )
    if len(features) > MAX_FEATURES:
        raise InvalidArgument(f"subscribe: at most {MAX_FEATURES} features per subscription")
    if not features:
        return None
    return frozenset(check_feature(f) for f in features)


class Watch:
    """Every subscription of a node, by tenant, and the values each watched tenant's counters
    had at the last tick."""

    def __init__(
        self, max_subscriptions: int = MAX_SUBSCRIPTIONS, max_tenants: int = MAX_WATCHED_TENANTS
    ) -> None:
        self.max_subscriptions = max_subscriptions
        self.max_tenants = max_tenants
        self._tenants: dict[str, dict[Subscriber, frozenset[str] | None]] = {}
        self._seen: dict[str, View] = {}
        #: When each watched counter was last offered (monotonic seconds), by tenant.
        self._offered: dict[str, dict[tuple[str, str], float]] = {}
        self._subscribers: set[Subscriber] = set()
        #: Connections that get threshold alerts, and counts of those gone.
        self._alert_subs: set[Subscriber] = set()
        self._alerts_sent_gone = 0
        self._alerts_dropped_gone = 0
        #: ``sent`` and ``dropped`` of subscribers gone (their connections closed).
        self._sent_gone = 0
        self._dropped_gone = 0
        #: Ticks run, and the number of the last one that found a change.
        self.ticks = 0
        self.changed_tick = 0
        #: After a tick, when the first counter it held back (offered too lately) may be
        #: offered (monotonic seconds), or ``None``: the caller ticks again then.
        self.next_due: float | None = None

    def __bool__(self) -> bool:
        return bool(self._tenants)

    def tenants(self) -> list[str]:
        """The tenants someone watches."""
        return list(self._tenants)

    def subscribe(
        self, sub: Subscriber, tenant: str, features: frozenset[str] | None, now: View
    ) -> None:
        """Watch ``tenant`` (its ``features``, ``None``: all) for ``sub``; a repeat replaces
        the features. ``now`` is the tenant's view now: a tenant nobody watched yet starts
        from it (what changes after is sent, not what is). :class:`InvalidArgument` past
        ``max_subscriptions`` tenants on one connection, :class:`Unavailable` past
        ``max_tenants`` tenants watched on the node, or if ``sub``'s connection is gone (a
        subscribe that waited on storage must not bring back a subscriber removed meanwhile)."""
        if sub.closed:
            raise Unavailable("subscribe: the connection closed")
        if tenant not in sub.tenants and len(sub.tenants) >= self.max_subscriptions:
            raise InvalidArgument(
                f"subscribe: at most {self.max_subscriptions} tenants per connection"
            )
        if tenant not in self._tenants and len(self._tenants) >= self.max_tenants:
            raise Unavailable(
                f"subscribe: this node watches {self.max_tenants} tenants already "
                "(max_watched_tenants); try later or another node"
            )
        sub.tenants[tenant] = features
        self._subscribers.add(sub)
        watchers = self._tenants.get(tenant)
        if watchers is None:
            watchers = self._tenants[tenant] = {}
            self._seen[tenant] = dict(now)
            self._offered[tenant] = {}
        watchers[sub] = features

    def unsubscribe(self, sub: Subscriber, tenant: str) -> bool:
        """Stop watching ``tenant`` for ``sub`` (its unsent notifications of that tenant go
        too); ``False`` if it was not watching it."""
        if sub.tenants.pop(tenant, 0) == 0:
            return False
        sub.pending = {k: v for k, v in sub.pending.items() if k[0] != tenant}
        watchers = self._tenants[tenant]
        del watchers[sub]
        if not watchers:
            del self._tenants[tenant]
            del self._seen[tenant]
            del self._offered[tenant]
        return True

    def named(self, tenant: str) -> frozenset[str] | None:
        """The features of ``tenant`` its watchers name together; ``None``: one watches all."""
        out: set[str] = set()
        for features in self._tenants.get(tenant, {}).values():
            if features is None:
                return None
            out |= features
        return frozenset(out)

    def subscribe_alerts(self, sub: Subscriber) -> bool:
        """Send ``sub`` every threshold alert delivered here from now on; True."""
        if sub.closed:
            raise Unavailable("subscribe_alerts: the connection closed")
        sub.alerts_on = True
        self._alert_subs.add(sub)
        return True

    def unsubscribe_alerts(self, sub: Subscriber) -> bool:
        """Stop sending ``sub`` alerts (those unsent go too); whether it was subscribed."""
        was = sub.alerts_on
        sub.alerts_on = False
        if sub in self._alert_subs:
            self._alert_subs.discard(sub)
            self._alerts_sent_gone += sub.alerts_sent
            self._alerts_dropped_gone += sub.alerts_dropped
            sub.alerts_sent = sub.alerts_dropped = 0
        sub.alerts.clear()
        return was

    def offer_alert(self, alert: dict[str, Any]) -> bool:
        """Queue ``alert`` for every alert subscriber; whether any was."""
        for sub in self._alert_subs:
            sub.offer_alert(alert)
        return bool(self._alert_subs)

    def alert_status(self) -> dict[str, int]:
        subs = self._alert_subs
        return {
            "subscribers": len(subs),
            "notifications_sent": self._alerts_sent_gone + sum(s.alerts_sent for s in subs),
            "notifications_dropped": self._alerts_dropped_gone
            + sum(s.alerts_dropped for s in subs),
        }

    def remove(self, sub: Subscriber) -> None:
        """Forget ``sub`` and its subscriptions (its connection closed); it may not subscribe
        again."""
        self.unsubscribe_alerts(sub)
        sub.closed = True
        for tenant in list(sub.tenants):
            self.unsubscribe(sub, tenant)
        if sub in self._subscribers:
            self._subscribers.discard(sub)
            self._sent_gone += sub.sent
            self._dropped_gone += sub.dropped
        sub.pending = {}

    def tick(
        self, read: Callable[[str], View], now: float = 0.0, spacing: float = 0.0
    ) -> list[Subscriber]:
        """Compare each watched tenant's view (``read(tenant)``) with what was last offered,
        offer every changed counter to the subscribers watching it, and return the subscribers
        with notifications to send. A counter offered less than ``spacing`` seconds before
        ``now`` waits for a later tick (its change is kept): a tick may run early, when peers'
        gossip arrives, and no counter is offered more than once per ``spacing``."""
        self.ticks += 1
        self.next_due = None
        found = False
        for tenant, watchers in self._tenants.items():
            changed = self._diff(tenant, read(tenant), now, spacing)
            if not changed:
                continue
            found = True
            for sub, features in watchers.items():
                offer = sub.offer
                for (feature, period), value in changed:
                    if watched(feature, features):
                        offer((tenant, feature, period), value)
        if found:
            self.changed_tick = self.ticks
        return [s for s in self._subscribers if s.pending]

    def _diff(
        self, tenant: str, view: View, now: float, spacing: float
    ) -> list[tuple[tuple[str, str], int]]:
        seen = self._seen[tenant]
        offered = self._offered[tenant]
        changed: list[tuple[tuple[str, str], int]] = []
        held: list[tuple[str, str]] = []
        for fp, v in view.items():
            old = seen.get(fp)
            if old == v:
                continue
            last = offered.get(fp)
            # (a millisecond's grace: the timer set for ``next_due`` may fire a hair early)
            if spacing and last is not None and now - last < spacing - 0.001:
                held.append(fp)  # offered too lately: the next tick finds it still changed
                due = last + spacing
                if self.next_due is None or due < self.next_due:
                    self.next_due = due
                continue
            changed.append((fp, v))
            offered[fp] = now
        # Replaced, not merged: counters no longer loaded (or of a period that ended) are
        # forgotten, so this holds no more than the table does.
        for fp in held:
            if fp in seen:
                view[fp] = seen[fp]
            else:
                del view[fp]
        self._seen[tenant] = view
        if len(offered) > 2 * len(view) + 64:
            self._offered[tenant] = {fp: t for fp, t in offered.items() if fp in view}
        return changed

    def status(self) -> dict[str, int]:
        """Counts for ``status`` (``ticks`` run, ``changed_tick``: the last that found a
        change)."""
        subs = self._subscribers
        return {
            "connections": sum(1 for s in subs if s.tenants),
            "tenants": len(self._tenants),
            "subscriptions": sum(len(s.tenants) for s in subs),
            "pending": sum(len(s.pending) for s in subs),
            "sent": self._sent_gone + sum(s.sent for s in subs),
            "dropped": self._dropped_gone + sum(s.dropped for s in subs),
            "ticks": self.ticks,
            "changed_tick": self.changed_tick,
        }


def views(
    tenant: str,
    periods: Iterable[tuple[str, str]],
    read: Callable[[str, str], dict[str, int]],
    kind_of: Callable[[str], str],
) -> View:
    """A tenant's view over ``periods`` (``(kind, period)`` pairs), from ``read(tenant,
    period) -> {feature: value}``, keeping each feature in its own kind's period only."""
    out: View = {}
    for kind, period in periods:
        for feature, value in read(tenant, period).items():
            if kind_of(feature) == kind:
                out[(feature, period)] = value
    return out
