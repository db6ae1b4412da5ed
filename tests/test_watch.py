"""The live usage push's bookkeeping (meter/watch.py): coalescing, caps, drop-to-latest."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meter.errors import InvalidArgument
from meter.watch import MAX_FEATURES, Subscriber, View, Watch, check_features

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
                          "sent": 1, "dropped": 0}  # fmt: skip


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
    sub.offer(("t", "a", P), 2)  # replaces the unsent 1: a drop
    sub.offer(("t", "b", P), 1)
    sub.offer(("t", "c", P), 1)  # two counters wait already: refused, a drop
    sub.offer(("t", "b", P), 7)
    assert sub.pending == {("t", "a", P): 2, ("t", "b", P): 7}
    assert sub.dropped == 3
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


@settings(max_examples=200, deadline=None)
@given(views=views_strategy, cap=st.integers(1, 6), reads=st.lists(st.booleans(), max_size=30))
def test_a_subscriber_ends_with_every_counters_latest_value_or_a_counted_drop(
    views: list[View], cap: int, reads: list[bool]
) -> None:
    """Whatever the changes and however rarely the subscriber reads: the outbox never holds
    more than its cap, and once everything is read, every counter changed since the
    subscription shows its latest value unless a drop was counted."""
    w = Watch()
    sub = Subscriber(max_pending=cap)
    w.subscribe(sub, "t", None, views[0])
    got: dict[tuple[str, str], list[int]] = {}

    def read() -> None:
        for _, f, v, p in sub.take(cap):
            got.setdefault((f, p), []).append(v)

    for i, view in enumerate(views[1:]):
        w.tick(lambda t, view=view: view)  # type: ignore[misc]
        assert len(sub.pending) <= cap
        if i < len(reads) and reads[i]:
            read()
    while sub.pending:
        read()
    last = views[-1]
    if sub.dropped == 0:
        # Nothing dropped: every notification was delivered, so a counter that differs from
        # its value at the subscription was sent, and its last notification is its value now.
        for fp, v in last.items():
            if v != views[0].get(fp) or fp in got:
                assert got[fp][-1] == v
    assert sub.sent == sum(len(v) for v in got.values())
