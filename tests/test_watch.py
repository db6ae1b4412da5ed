"""The live usage push's bookkeeping (meter/core/watch.py): coalescing, caps, drop-to-latest."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meter.core.watch import MAX_FEATURES, Subscriber, View, Watch, check_features
from meter.errors import InvalidArgument, Unavailable

P = "2024-05"


def test_a_tick_sends_each_changed_counter_once_with_its_latest_value() -> None:
    w = Watch()
    sub = Subscriber()
    w.subscribe(sub, "acme", None, {("api", P): 1, ("seats", P): 4})
    assert w.tick(lambda t: {("api", P): 1, ("seats", P): 4}) == []  # nothing changed
    # api changed many times since the last tick: one notification, the latest value.
    assert w.tick(lambda t: {("api", P): 9, ("seats", P): 4}) == [sub]
    assert sub.take(100) == [["acme", "api", 9, P]]
    assert sub.pending == {} and sub.sent == 1 and sub.dropped == 0
    # A counter loaded since the last tick is sent; one no longer loaded is forgotten.
    w.tick(lambda t: {("api", P): 9, ("tokens", P): 2})
    assert sub.take(100) == [["acme", "tokens", 2, P]]


def test_a_counter_is_offered_at_most_once_per_spacing_and_a_held_change_is_kept() -> None:
    """Ticks may run early (peers' gossip arrived): a counter offered less than ``spacing``
    ago waits, its change kept, and ``next_due`` says when it may go; others go at once."""
    w = Watch()
    sub = Subscriber()
    w.subscribe(sub, "acme", None, {("api", P): 0, ("seats", P): 0})
    assert w.tick(lambda t: {("api", P): 1, ("seats", P): 0}, now=10.0, spacing=0.1) == [sub]
    assert sub.take(100) == [["acme", "api", 1, P]] and w.next_due is None
    # 40 ms later api changed again (held: sent 40 ms ago), seats for the first time (sent).
    w.tick(lambda t: {("api", P): 2, ("seats", P): 5}, now=10.04, spacing=0.1)
    assert sub.take(100) == [["acme", "seats", 5, P]]
    assert w.next_due == pytest.approx(10.1)
    # Still held at 90 ms, with a newer value; at 100 ms it goes, the latest value, once.
    w.tick(lambda t: {("api", P): 3, ("seats", P): 5}, now=10.09, spacing=0.1)
    assert sub.take(100) == [] and w.next_due == pytest.approx(10.1)
    w.tick(lambda t: {("api", P): 3, ("seats", P): 5}, now=10.1, spacing=0.1)
    assert sub.take(100) == [["acme", "api", 3, P]] and w.next_due is None
    w.tick(lambda t: {("api", P): 3, ("seats", P): 5}, now=10.5, spacing=0.1)
    assert sub.take(100) == []  # nothing changed since: nothing sent


def test_features_filter_and_tenants_are_apart() -> None:
    w = Watch()
    a, b = Subscriber(), Subscriber()
    w.subscribe(a, "acme", frozenset({"api"}), {})
    w.subscribe(b, "acme", None, {})
    w.subscribe(b, "zeta", None, {})
    views: dict[str, View] = {"acme": {("api", P): 1, ("seats", P): 2}, "zeta": {("x", P): 3}}
    assert set(w.tick(views.__getitem__)) == {a, b}
    assert a.take(100) == [["acme", "api", 1, P]]
    assert sorted(b.take(100)) == [["acme", "api", 1, P], ["acme", "seats", 2, P],
                                   ["zeta", "x", 3, P]]  # fmt: skip
    # A repeat replaces the features.
    w.subscribe(a, "acme", frozenset({"seats"}), {})
    views["acme"] = {("api", P): 5, ("seats", P): 6}
    w.tick(views.__getitem__)
    assert a.take(100) == [["acme", "seats", 6, P]]


def test_unsubscribe_stops_and_forgets() -> None:
    w = Watch()
    sub = Subscriber()
    w.subscribe(sub, "acme", None, {})
    w.tick(lambda t: {("api", P): 1})
    assert sub.pending
    assert w.unsubscribe(sub, "acme") is True
    assert sub.pending == {}  # its unsent notifications go too
    assert w.unsubscribe(sub, "acme") is False  # harmless
    assert not w and w.tenants() == []
    assert w.tick(lambda t: pytest.fail("no tenant is watched")) == []


def test_a_connection_gone_leaves_nothing_but_its_counts() -> None:
    w = Watch()
    sub = Subscriber()
    w.subscribe(sub, "acme", None, {})
    w.tick(lambda t: {("api", P): 1})
    sub.take(100)
    w.tick(lambda t: {("api", P): 2})
    w.remove(sub)
    assert not w
    assert w.status() == {"connections": 0, "tenants": 0, "subscriptions": 0, "pending": 0,
                          "sent": 1, "dropped": 0, "ticks": 2, "changed_tick": 2}  # fmt: skip


def test_a_removed_subscriber_cannot_subscribe_again() -> None:
    """A subscribe that waited on storage while its connection went must not bring the
    subscriber back: it would be watched for ever with nobody to send to."""
    w = Watch()
    sub = Subscriber()
    w.subscribe(sub, "acme", None, {})
    w.remove(sub)
    with pytest.raises(Unavailable, match="connection closed"):
        w.subscribe(sub, "zeta", None, {})
    assert not w and sub.tenants == {}
    assert w.status()["subscriptions"] == 0 and w.status()["connections"] == 0
    w.remove(Subscriber())  # one that never subscribed: harmless


def test_distinct_tenants_watched_on_the_node_are_capped() -> None:
    w = Watch(max_tenants=2)
    a, b = Subscriber(), Subscriber()
    w.subscribe(a, "t1", None, {})
    w.subscribe(b, "t2", None, {})
    w.subscribe(b, "t1", frozenset({"api"}), {})  # a tenant watched already is no new one
    with pytest.raises(Unavailable, match="watches 2 tenants already"):
        w.subscribe(a, "t3", None, {})
    assert w.tenants() == ["t1", "t2"] and list(a.tenants) == ["t1"]
    w.unsubscribe(b, "t2")
    w.subscribe(a, "t3", None, {})  # room again


def test_the_features_watched_of_a_tenant_are_its_watchers_together() -> None:
    w = Watch()
    a, b = Subscriber(), Subscriber()
    assert w.named("acme") == frozenset()
    w.subscribe(a, "acme", frozenset({"api"}), {})
    w.subscribe(b, "acme", frozenset({"seats"}), {})
    assert w.named("acme") == frozenset({"api", "seats"})
    w.subscribe(b, "acme", None, {})
    assert w.named("acme") is None  # one watches every feature


def test_subscriptions_per_connection_are_capped() -> None:
    w = Watch(max_subscriptions=2)
    sub = Subscriber()
    w.subscribe(sub, "a", None, {})
    w.subscribe(sub, "b", None, {})
    w.subscribe(sub, "b", frozenset({"x"}), {})  # a repeat is not a new one
    with pytest.raises(InvalidArgument, match="at most 2 tenants per connection"):
        w.subscribe(sub, "c", None, {})
    assert list(sub.tenants) == ["a", "b"]
    w.subscribe(Subscriber(), "c", None, {})  # the cap is per connection


def test_feature_lists_are_validated() -> None:
    assert check_features(None) is None
    assert check_features([]) is None
    assert check_features(["api", "api"]) == frozenset({"api"})
    for bad, message in [
        ("api", "features must be an array"),
        ({"api": 1}, "features must be an array"),
        ([""], "feature"),
        (["no spaces"], "feature"),
        ([5], "feature"),
        (["f"] * (MAX_FEATURES + 1), f"at most {MAX_FEATURES} features"),
    ]:
        with pytest.raises(InvalidArgument, match=message):
            check_features(bad)


def test_a_full_outbox_keeps_the_latest_value_per_counter_and_counts_drops() -> None:
    sub = Subscriber(max_pending=2)
    sub.offer(("t", "a", P), 1)
    sub.offer(("t", "a", P), 2)  # replaces the unsent 1
    sub.offer(("t", "b", P), 1)
    sub.offer(("t", "c", P), 1)  # two counters wait already: refused
    sub.offer(("t", "b", P), 7)
    assert sub.pending == {("t", "a", P): 2, ("t", "b", P): 7}
    assert (sub.replaced, sub.refused, sub.dropped) == (2, 1, 3)
    assert sub.take(1) == [["t", "a", 2, P]]
    assert sub.take(5) == [["t", "b", 7, P]]
    assert sub.sent == 2 and sub.pending == {}


views_strategy = st.lists(
    st.dictionaries(
        st.tuples(st.sampled_from("abcdefgh"), st.sampled_from([P, "2024-06"])),
        st.integers(-3, 3),
        max_size=8,
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(views=views_strategy, cap=st.integers(1, 6), reads=st.lists(st.booleans(), max_size=30))
def test_a_subscriber_ends_with_every_counters_latest_value_unless_it_was_refused(
    views: list[View], cap: int, reads: list[bool]
) -> None:
    """Whatever the changes and however rarely the subscriber reads: the outbox never holds
    more than its cap, a value is refused only while the outbox is full, and once everything
    is read, every counter whose last change was not refused has been sent that change's
    value last. Replaced values are not lost: a newer one of the same counter took their
    place."""
    w = Watch()
    sub = Subscriber(max_pending=cap)
    w.subscribe(sub, "t", None, views[0])
    got: dict[tuple[str, str], list[int]] = {}
    last_offered: dict[tuple[str, str], int] = {}
    refused_last: dict[tuple[str, str], bool] = {}
    refusals = 0

    def read() -> None:
        for _, f, v, p in sub.take(cap):
            got.setdefault((f, p), []).append(v)

    before = views[0]
    for i, view in enumerate(views[1:]):
        changed = {fp: v for fp, v in view.items() if before.get(fp) != v}
        w.tick(lambda t, view=view: view)  # type: ignore[misc]
        before = view
        assert len(sub.pending) <= cap
        for (f, p), v in changed.items():
            # Nothing is taken during a tick: a changed counter not waiting now was refused.
            refused = sub.pending.get(("t", f, p)) != v
            if refused:
                assert len(sub.pending) == cap  # refused only while full
                refusals += 1
            last_offered[(f, p)] = v
            refused_last[(f, p)] = refused
        if i < len(reads) and reads[i]:
            read()
    while sub.pending:
        read()
    assert sub.refused == refusals
    for fp, v in last_offered.items():
        if not refused_last[fp]:
            assert got[fp][-1] == v
    assert sub.sent == sum(len(v) for v in got.values())
    # Every offer was sent, replaced by a newer one, or refused.
    assert sub.sent + sub.replaced + sub.refused == sum(
        1 for a, b in itertools.pairwise(views) for fp, v in b.items() if a.get(fp) != v
    )


def test_a_node_nobody_watches_has_nothing_held() -> None:
    """The last subscriber gone while a change was held back: the service's tick must not
    report a due time any more (the node would set a timer for it again and again)."""
    from meter.core.table import CounterTable
    from meter.node.wiring import build_service
    from storage.memory import MemoryStorage

    svc = build_service(CounterTable("n"), MemoryStorage())
    sub = Subscriber()
    svc.watch.subscribe(sub, "acme", None, {("api", P): 1})
    svc.watch.tick(lambda t: {("api", P): 2}, now=1.0, spacing=0.1)
    svc.watch.tick(lambda t: {("api", P): 3}, now=1.05, spacing=0.1)
    assert svc.watch.next_due == pytest.approx(1.1)
    svc.watch.remove(sub)
    assert svc.watch_tick(1.06, 0.1) == [] and svc.watch.next_due is None
