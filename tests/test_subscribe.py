"""Live usage push through a real node process: ``subscribe`` / ``unsubscribe``, the
``usage`` notifications, a stalled subscriber, the clients' iterators and ``meter watch``."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from meter.client import AsyncClient, Client, TrackItem, Usage
from meter.core.keys import MAX_FEATURE_BYTES, MAX_TENANT_BYTES, period_start
from meter.core.protocol import Encoder
from meter.core.server import DEFAULT_LOW_WATER, NOTIFY_MAX_BYTES
from meter.core.watch import MAX_PENDING, MAX_SUBSCRIPTIONS
from meter.errors import InvalidArgument, Unavailable
from tests.support.cluster_harness import Fleet
from tests.support.dynamodb_proxy import DynamoDBProxy
from tests.support.nodes import ROOT, NodeProcess, short_tmpdir, wait_for
from tests.test_warm_up import until

TICK_MS = 100
#: Delivery and scheduling on a shared machine, on top of U02's two intervals (see the test).
CROSS_NODE_SLACK_S = 0.5
MONTH = period_start("month")


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = short_tmpdir("sub-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def node(workdir: Path) -> Iterator[NodeProcess]:
    with NodeProcess(workdir, METER_GOSSIP_INTERVAL_MS=str(TICK_MS)) as n:
        yield n


def test_a_change_is_pushed_once_per_tick_with_its_latest_value(node: NodeProcess) -> None:
    with Client.connect(node.socket, timeout=5) as c, Client.connect(node.socket) as w:
        c.track("acme", "api", 5)
        it = w.subscribe("acme", ["api", "seats"], timeout=2)
        # First the watched counters as they are: a named counter never used is loaded (0).
        first = sorted([next(it), next(it)])
        assert first == [Usage("acme", "api", 5, MONTH), Usage("acme", "seats", 0, MONTH)]
        # 50 tracks in one write are counted in one pass of the node's loop: one tick sees
        # them all, so one notification carries the latest value. The status in the same
        # pass says how many ticks ran before the change; the one that found it is the next
        # (counted in ticks, not seconds: a loaded machine delays both alike).
        *_, st = c.pipeline([("track", ["acme", "api", 1])] * 50 + [("status", [])])
        ticks = st["subscriptions"]["ticks"]
        assert next(it) == Usage("acme", "api", 55, MONTH)
        assert c.status()["subscriptions"]["changed_tick"] == ticks + 1
        assert w.next_usage("acme", timeout=3 * TICK_MS / 1000) is None  # nothing more
        # The value is usage's: holds included.
        rid = c.reserve("acme", "seats", 3)
        assert next(it) == Usage("acme", "seats", 3, MONTH)
        c.release(rid)
        assert next(it) == Usage("acme", "seats", 0, MONTH)
        # An unwatched feature and another tenant send nothing.
        c.track("acme", "tokens", 1)
        c.track("zeta", "api", 1)
        assert w.next_usage("acme", timeout=3 * TICK_MS / 1000) is None
        # A notification waiting on the subscriber's own connection ahead of an answer is
        # kept for the iterator, and the call still gets its answer (on the same connection).
        accepted = c.status()["server"]["accepted"]
        c.track("acme", "api", 1)
        wait_for(lambda: c.status()["subscriptions"]["sent"] == 4, what="the notification sent")
        assert w.usage("acme", "api") == 56
        assert w.pipeline([("usage", ["acme", "api"]), ("ping", [])]) == [56, "pong"]
        assert next(it) == Usage("acme", "api", 56, MONTH)
        assert c.status()["server"]["accepted"] == accepted  # no reconnection
        st = c.status()["subscriptions"]
        assert st["connections"] == 1 and st["subscriptions"] == 1 and st["dropped"] == 0


def test_without_features_every_loaded_counter_of_the_tenant_is_watched(
    node: NodeProcess,
) -> None:
    with Client.connect(node.socket, timeout=5) as c, Client.connect(node.socket) as w:
        it = w.subscribe("acme", timeout=2)
        for f in ("a", "b", "c"):
            c.track("acme", f, 2)
        got = {next(it), next(it), next(it)}
        assert got == {Usage("acme", f, 2, MONTH) for f in "abc"}


def test_unsubscribe_stops_them_and_they_die_with_the_connection(node: NodeProcess) -> None:
    with Client.connect(node.socket, timeout=5) as c:
        w = Client.connect(node.socket)
        it = w.subscribe("acme", ["api"], timeout=2)
        assert next(it).value == 0
        c.track("acme", "api")
        assert next(it).value == 1
        assert w.unsubscribe("acme") is True
        assert w.unsubscribe("acme") is False  # harmless
        c.track("acme", "api")
        assert w.call("ping") == "pong"
        assert list(it) == []  # the iterator of an unsubscribed tenant ends
        # Raw: nothing arrives for three ticks after the unsubscribe.
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(node.socket))
            s.sendall(msgpack.packb([0, 1, "subscribe", ["acme"]]))
            s.sendall(msgpack.packb([0, 2, "unsubscribe", ["acme"]]))
            c.track("acme", "api")
            s.settimeout(3 * TICK_MS / 1000)
            unpacker = msgpack.Unpacker()
            msgs: list[list[object]] = []
            try:
                while True:
                    data = s.recv(65536)
                    if not data:
                        break
                    unpacker.feed(data)
                    msgs.extend(unpacker)
            except TimeoutError:
                pass
            assert [m[0] for m in msgs] == [1, 1]  # two answers, no notification
            assert msgs[1][3] is True
        w.subscribe("acme")
        assert c.status()["subscriptions"]["connections"] == 1
        w.close()
        wait_for(
            lambda: c.status()["subscriptions"] == {**c.status()["subscriptions"],
                                                   "connections": 0, "tenants": 0},
            what="the closed connection's subscriptions to go",
        )  # fmt: skip


def test_bad_subscribe_arguments_are_invalid_and_the_connection_stays(node: NodeProcess) -> None:
    with Client.connect(node.socket, timeout=5) as c:
        bad: list[tuple[str, list[Any], str]] = [
            ("subscribe", [], "subscribe takes 1 to 2 params"),
            ("subscribe", ["acme", ["api"], 3], "subscribe takes 1 to 2 params"),
            ("subscribe", ["bad tenant"], "tenant"),
            ("subscribe", [5], "tenant"),
            ("subscribe", ["acme", "api"], "features must be an array"),
            ("subscribe", ["acme", ["bad feature"]], "feature"),
            ("subscribe", ["acme", [b"\xff"]], "feature"),
            ("subscribe", ["acme", ["f"] * 257], "at most 256 features"),
            ("unsubscribe", [], "unsubscribe takes 1 param"),
            ("unsubscribe", ["bad tenant"], "tenant"),
            ("unsubscribe", ["acme", ["api"]], "unsubscribe takes 1 param"),
        ]
        for method, params, message in bad:
            with pytest.raises(InvalidArgument, match=message):
                c.call(method, *params)
        for i in range(MAX_SUBSCRIPTIONS):
            c.call("subscribe", f"t{i}")
        with pytest.raises(InvalidArgument, match=f"at most {MAX_SUBSCRIPTIONS} tenants"):
            c.call("subscribe", "one-more")
        c.call("subscribe", "t0", ["api"])  # a repeat replaces: not one more
        with pytest.raises(InvalidArgument, match="features must be a list"):
            c.subscribe("acme", "api")
        assert c.ping() == "pong"
        assert c.status()["subscriptions"]["subscriptions"] == MAX_SUBSCRIPTIONS


def test_distinct_tenants_watched_on_a_node_are_capped(workdir: Path) -> None:
    """``max_watched_tenants`` bounds what a tick reads, whatever the connections: past it a
    subscribe of one more tenant is ``unavailable`` (and counted nowhere), a tenant watched
    already can still be subscribed to, and one unwatched makes room."""
    with (
        NodeProcess(
            workdir, METER_GOSSIP_INTERVAL_MS=str(TICK_MS), METER_MAX_WATCHED_TENANTS="3"
        ) as node,
        Client.connect(node.socket, timeout=5, retry_timeout=0) as a,
        Client.connect(node.socket, timeout=5, retry_timeout=0) as b,
    ):
        a.call("subscribe", "t1")
        a.call("subscribe", "t2")
        b.call("subscribe", "t3")
        with pytest.raises(Unavailable, match="watches 3 tenants already"):
            b.call("subscribe", "t4")
        b.call("subscribe", "t1", ["api"])  # watched already: no new tenant
        assert b.ping() == "pong"  # the connection stays
        st = a.status()["subscriptions"]
        assert st["tenants"] == 3 and st["subscriptions"] == 4
        assert a.unsubscribe("t2") is True
        b.call("subscribe", "t4")


def test_a_subscription_naming_features_keeps_only_those_loaded(workdir: Path) -> None:
    """A tick reads the tenant's loaded counters but marks used only the watched ones: the
    tenant's other counters are evicted when idle as if nobody watched."""
    with (
        NodeProcess(
            workdir,
            METER_GOSSIP_INTERVAL_MS=str(TICK_MS),
            METER_EVICT_AFTER_S="1",
            METER_FLUSH_INTERVAL_MS="100",
        ) as node,
        Client.connect(node.socket, timeout=5) as c,
        Client.connect(node.socket, timeout=5) as w,
    ):
        it = w.subscribe("acme", ["api"], timeout=5)
        assert next(it).value == 0
        c.track("acme", "other", 2)
        c.track("acme", "api", 1)
        assert next(it).value == 1
        assert c.status()["keys"]["warm"] == 2
        # Stored, then idle for 1 to 2 eviction intervals: "other" goes, "api" stays loaded.
        wait_for(lambda: c.status()["keys"]["warm"] == 1, what="the unwatched counter evicted")
        reads = c.status()["seeding"]["on_demand"]
        assert c.usage("acme", "api") == 1
        assert c.status()["seeding"]["on_demand"] == reads  # not read again: it stayed


@pytest.mark.dynamodb
async def test_a_connection_reset_while_its_subscribe_reads_storage_leaves_nothing_watched(
    workdir: Path, dynamodb_local: str, dynamodb_table: str
) -> None:
    """A client sends ``ping`` and a ``subscribe`` of a counter never loaded, then resets the
    connection while the node reads the counter (the read held at a proxy in front of
    DynamoDB Local): once the read ends, nothing is watched, nothing waits to be sent."""
    async with DynamoDBProxy(int(dynamodb_local.rsplit(":", 1)[1])) as proxy:
        node = NodeProcess(
            workdir,
            METER_STORAGE="dynamodb",
            METER_DYNAMODB_ENDPOINT=proxy.endpoint,
            METER_DYNAMODB_TABLE=dynamodb_table,
            METER_GOSSIP_INTERVAL_MS=str(TICK_MS),
        )
        await asyncio.to_thread(node.start)
        try:
            proxy.hold()
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(node.socket))
            s.sendall(msgpack.packb([0, 1, "ping", []]) + msgpack.packb(
                [0, 2, "subscribe", ["acme", ["api"]]]))  # fmt: skip
            await until(lambda: proxy.held == 1, "the counter's read held")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()  # a reset, the pong unread
            await until(
                lambda: node.call("status")["server"]["connections"] == 1,  # the status call's
                "the reset connection gone",
            )
            proxy.stop_holding()
            st = await until(
                lambda: (st := node.call("status"))["server"]["in_flight"] == 0 and st,
                "the subscribe to end",
            )
            assert st["seeding"]["in_flight"] == 0
            sub = st["subscriptions"]
            assert (sub["connections"], sub["tenants"], sub["subscriptions"], sub["pending"]) == (
                0, 0, 0, 0), sub  # fmt: skip
        finally:
            assert await asyncio.to_thread(node.stop) == 0


def test_a_stalled_subscriber_stays_bounded_and_the_node_keeps_answering(
    node: NodeProcess,
) -> None:
    """A raw connection subscribes to a tenant and never reads while 15,000 of its counters
    change, round after round: what waits for it stays at the cap (one value per counter),
    the rest is counted as dropped, and the node answers other clients all along."""
    n = 15_000
    features = [f"f{i}" for i in range(n)]
    with Client.connect(node.socket, timeout=10) as c:
        for start in range(0, n, 5_000):
            c.track_many([("acme", f, 1) for f in features[start : start + 5_000]])
        s = socket.socket(socket.AF_UNIX)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(str(node.socket))
            s.sendall(msgpack.packb([0, 1, "subscribe", ["acme"]]))
            for rnd in range(2, 5):
                for start in range(0, n, 5_000):
                    c.track_many([("acme", f, 1) for f in features[start : start + 5_000]])
                # Every offer is sent, dropped or waiting: once a tick has seen the round,
                # each counter was offered once per round since the subscription.
                st = wait_for(
                    lambda rnd=rnd: _offered(c, n * (rnd - 1)),  # type: ignore[misc]
                    what=f"round {rnd}'s changes to be offered",
                    timeout=30,
                )
                assert st["sent"] + st["dropped"] + st["pending"] == n * (rnd - 1)
                assert st["pending"] <= MAX_PENDING
                assert c.usage("acme", "f0") == rnd  # the node answers all along
            server = c.status()["server"]
            print("\nstalled subscriber:", st, "unsent bytes at most", server["notify_buffer_max"])
            assert st["pending"] == MAX_PENDING  # full: one value per counter, no more
            assert st["connections"] == 1 and st["dropped"] > n
            assert st["sent"] < n  # far fewer than the changes left the node
            # Writing stopped at the low-water mark, and never passed it by a notification.
            low = DEFAULT_LOW_WATER
            assert low <= server["notify_buffer_max"] < low + NOTIFY_MAX_BYTES
        finally:
            s.close()
        wait_for(
            lambda: c.status()["subscriptions"]["pending"] == 0,
            what="the closed subscriber's outbox to go",
        )


def test_a_notification_takes_at_most_notify_max_bytes() -> None:
    """The bound on unsent bytes (docs/protocol.md) counts on it."""
    longest = ["t" * MAX_TENANT_BYTES, "f" * MAX_FEATURE_BYTES, -(2**63), "2024-05-31"]
    for value in (-(2**63), 2**64 - 1):
        data = Encoder().notifications("usage", [[*longest[:2], value, longest[3]]])
        assert len(data) <= NOTIFY_MAX_BYTES
    assert len(Encoder().notifications("usage", [longest] * 2)) > NOTIFY_MAX_BYTES


def _offered(c: Client, n: int) -> dict[str, int] | None:
    st: dict[str, int] = c.status()["subscriptions"]
    return st if st["sent"] + st["dropped"] + st["pending"] >= n else None


def test_a_subscriber_that_catches_up_gets_each_counters_latest_value(node: NodeProcess) -> None:
    """A subscriber that stops reading while its counters change many times, then reads
    again, ends with every counter's latest value (fewer counters than the cap)."""
    features = [f"f{i}" for i in range(8_000)]
    items: list[TrackItem] = [("acme", f, 1) for f in features]
    with Client.connect(node.socket, timeout=10) as c, Client.connect(node.socket) as w:
        c.track_many(items)
        w._ensure().sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        w.subscribe("acme", timeout=2)
        # Not read meanwhile: rounds of changes, each seen by a tick of its own, until a
        # newer value replaced one waiting (the socket's buffers full), however fast the
        # machine; a handful of rounds fill them.
        rounds = 0
        while c.status()["subscriptions"]["dropped"] == 0:
            assert rounds < 30, "no drop: the subscriber's socket never filled"
            _, st = c.pipeline([("track_many", [items]), ("status", [])])
            rounds += 1
            ticks = st["subscriptions"]["ticks"]
            wait_for(
                lambda ticks=ticks: c.status()["subscriptions"]["ticks"] > ticks,  # type: ignore[misc]
                what="a tick after the round",
            )
        # Read until every counter shows its value now: the latest arrives last, each once.
        latest: dict[str, int] = {}
        done = 0
        deadline = time.monotonic() + 30
        while done < len(features):
            u = w.next_usage("acme", timeout=max(0.0, deadline - time.monotonic()))
            assert u is not None, f"{done} of {len(features)} counters caught up in 30 s"
            assert latest.get(u.feature, 0) < u.value <= rounds + 1, u
            latest[u.feature] = u.value
            done += u.value == rounds + 1
        assert latest == dict.fromkeys(features, rounds + 1)


async def test_the_async_client_iterates_and_resubscribes_after_a_restart(workdir: Path) -> None:
    node = NodeProcess(workdir, METER_GOSSIP_INTERVAL_MS=str(TICK_MS)).start()
    try:
        async with await AsyncClient.connect(node.socket, timeout=5) as m:
            it = await m.subscribe("acme", ["api"])
            assert await anext(it) == Usage("acme", "api", 0, MONTH)
            accepted = (await m.status())["server"]["accepted"]
            await asyncio.gather(*(m.track("acme", "api") for _ in range(3)))
            # Three tracks answered before the next tick, or two ticks apart: the last is 3.
            u = await asyncio.wait_for(anext(it), 2)
            while u.value != 3:
                u = await asyncio.wait_for(anext(it), 2)
            # Calls answered while notifications arrive on the same connection.
            for _ in range(3):
                await asyncio.gather(m.track("acme", "api", 0), m.usage("acme", "api"))
            assert (await m.status())["server"]["accepted"] == accepted  # no reconnection
            assert node.stop() == 0
            node.start()  # same data dir: the 3 units are stored
            # The client reconnects, subscribes again and delivers the value then.
            assert await asyncio.wait_for(anext(it), 10) == Usage("acme", "api", 3, MONTH)
            await m.track("acme", "api", 4)
            assert await asyncio.wait_for(anext(it), 2) == Usage("acme", "api", 7, MONTH)
            assert await m.unsubscribe("acme") is True
            with pytest.raises(StopAsyncIteration):
                await asyncio.wait_for(anext(it), 2)
    finally:
        node.stop()


def test_the_blocking_client_resubscribes_after_a_restart(workdir: Path) -> None:
    node = NodeProcess(workdir, METER_GOSSIP_INTERVAL_MS=str(TICK_MS)).start()
    try:
        with Client.connect(node.socket, timeout=5) as w:
            it = w.subscribe("acme", ["api"], timeout=10)
            assert next(it).value == 0
            node.call("track", "acme", "api", 2)
            assert next(it).value == 2
            assert node.stop() == 0
            node.start()
            assert next(it) == Usage("acme", "api", 2, MONTH)
            node.call("track", "acme", "api", 1)
            assert next(it) == Usage("acme", "api", 3, MONTH)
    finally:
        node.stop()


def test_meter_watch_prints_a_line_per_notification(node: NodeProcess) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("METER_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "meter", "watch", "--socket", str(node.socket), "--json",
         "acme", "api"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # Ctrl-C as at a terminal: a suite started in the background by a shell (`&`) has
        # SIGINT ignored, and the child would inherit that and never stop.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.strip() == (
            f'{{"feature": "api", "period": "{MONTH}", "tenant": "acme", "value": 0}}'
        )
        node.call("track", "acme", "api", 4)
        assert '"value": 4' in proc.stdout.readline()
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 130


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.dynamodb
@pytest.mark.quiet
def test_a_subscriber_on_one_node_sees_a_unit_tracked_on_another_within_a_tick(
    fleet: Fleet,
) -> None:
    """Two real nodes on one Redis and one DynamoDB table. A unit tracked on B is gossiped at
    B's next tick (at most one interval) and pushed by A when the frame arrives:
    docs/protocol.md claims one interval plus delivery; measured from before the track is sent
    to the notification's arrival, every sample, with the slack of this shared machine."""
    a, b = fleet(2, METER_GOSSIP_INTERVAL_MS=str(TICK_MS))
    try:
        with Client.connect(a.socket) as w, Client.connect(b.socket, timeout=5) as c:
            it = w.subscribe("acme", ["api"], timeout=5)  # loads the counter on A
            assert next(it).value == 0
            lat: list[float] = []
            for s in range(20):
                c.usage("acme", "ping")  # a round trip between samples, not a sleep
                t0 = time.monotonic()
                c.track("acme", "api")
                u = next(it)
                lat.append(time.monotonic() - t0)
                assert u == Usage("acme", "api", s + 1, MONTH)
            lat.sort()
            print(
                f"\nB -> A's subscriber: median {lat[len(lat) // 2] * 1000:.0f} ms, "
                f"max {lat[-1] * 1000:.0f} ms"
            )
            # Delivery is B's answer, B's frame through Redis and A's notification through
            # its socket: milliseconds on an idle machine. The slack is for this shared
            # 2-core box running two nodes, Redis, DynamoDB Local and the test at once, where
            # a tick's timer or a process is scheduled late by a few hundred ms. (So this
            # catches a unit that waits several ticks too many, or is never pushed; the
            # single-node push is checked in ticks, test_a_change_is_pushed_once_per_tick...)
            assert lat[-1] <= TICK_MS / 1000 + CROSS_NODE_SLACK_S
            assert w.next_usage("acme", timeout=3 * TICK_MS / 1000) is None  # once each
    finally:
        for p in (a, b):
            p.stop()
