"""The Redis pub/sub bus against a real redis-server: delivery, AUTH, TLS, outage and reconnect."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cluster.bus import BusUnavailable, channel_name
from cluster.redis_bus import RedisBus, redact
from tests.support.redis_server import RedisServer, make_tls_files

pytestmark = pytest.mark.redis


class Probe:
    def __init__(self) -> None:
        self.got: list[bytes] = []
        self.states: list[bool] = []

    async def wait(self, cond: Callable[[], bool], timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "condition not met in time"
            await asyncio.sleep(0.01)


async def _bus(url: str, channel: str) -> tuple[RedisBus, Probe]:
    p = Probe()
    bus = RedisBus(url, channel, min_backoff=0.02, max_backoff=0.2)
    await bus.start(p.got.append, p.states.append)
    await p.wait(lambda: bus.connected)
    return bus, p


async def test_publish_reaches_every_subscriber(
    redis_server: RedisServer, cluster_name: str
) -> None:
    ch = channel_name(cluster_name)
    a, pa = await _bus(redis_server.url, ch)
    b, pb = await _bus(redis_server.url, ch)
    other, po = await _bus(redis_server.url, channel_name(cluster_name + "-x"))
    try:
        for i in range(50):
            await a.publish(b"m%d" % i)
        await pb.wait(lambda: len(pb.got) == 50)
        assert pb.got == [b"m%d" % i for i in range(50)]  # in order
        await pa.wait(lambda: len(pa.got) == 50)  # the sender hears itself too
        assert po.got == []  # another cluster's channel
        assert a.describe()["connected"] is True
    finally:
        for bus in (a, b, other):
            await bus.close()


async def test_a_quiet_subscriber_pings_and_keeps_reading(
    redis_server: RedisServer, cluster_name: str
) -> None:
    """The subscriber reads its replies itself: the health check's PING still goes out once
    the connection has been quiet, and its reply does not stop the reading."""
    import redis.asyncio as aioredis

    ch = channel_name(cluster_name)
    p = Probe()
    bus = RedisBus(redis_server.url, ch, min_backoff=0.02, health_check_s=1)
    await bus.start(p.got.append, p.states.append)
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        await p.wait(lambda: bus.connected)
        before = (await admin.info("commandstats")).get("cmdstat_ping", {}).get("calls", 0)
        deadline = time.monotonic() + 10
        while (await admin.info("commandstats")).get("cmdstat_ping", {}).get("calls", 0) <= before:
            assert time.monotonic() < deadline, "no health check PING from a quiet subscriber"
            await asyncio.sleep(0.1)
        await bus.publish(b"after the ping")
        await p.wait(lambda: p.got == [b"after the ping"])
        assert p.states == [True]  # (never down)
    finally:
        await bus.close()
        await admin.aclose()


async def test_a_redis_that_stops_answering_is_seen_and_rejoined(
    redis_factory: Callable[..., RedisServer], cluster_name: str
) -> None:
    """A Redis that keeps the connection but answers nothing (stopped: a host gone without a
    reset looks the same) ends the session once the health check's PING is unanswered for
    two intervals; the bus says it is down, and is back once Redis answers again."""
    import os
    import signal

    server = redis_factory()
    assert server.proc is not None
    p = Probe()
    bus = RedisBus(server.url, channel_name(cluster_name), min_backoff=0.02, health_check_s=1)
    await bus.start(p.got.append, p.states.append)
    try:
        await p.wait(lambda: bus.connected)
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            await p.wait(lambda: "PING unanswered" in (bus.last_error or ""), timeout=15)
            assert not bus.connected
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        await p.wait(lambda: bus.connected, timeout=15)
        await bus.publish(b"back")
        await p.wait(lambda: p.got == [b"back"])
    finally:
        await bus.close()


async def test_auth_in_the_url(
    redis_factory: Callable[..., RedisServer], cluster_name: str
) -> None:
    server = redis_factory(password="pa55word")
    ch = channel_name(cluster_name)
    a, pa = await _bus(server.url, ch)
    try:
        await a.publish(b"hello")
        await pa.wait(lambda: pa.got == [b"hello"])
    finally:
        await a.close()
    wrong = RedisBus(f"redis://:nope@127.0.0.1:{server.port}/0", ch, min_backoff=0.02)
    p = Probe()
    await wrong.start(p.got.append, p.states.append)
    try:
        await p.wait(lambda: wrong.last_error is not None)
        assert not wrong.connected
        assert "authentication" in (wrong.last_error or "").lower()
        with pytest.raises(BusUnavailable):
            await wrong.publish(b"x")
        assert "nope" not in str(wrong.describe())
    finally:
        await wrong.close()


async def test_tls_with_auth_trusting_the_ca_from_the_url(
    redis_factory: Callable[..., RedisServer], cluster_name: str
) -> None:
    server = redis_factory(password="pa55word", tls=True)
    assert server.tls is not None
    url = server.url
    assert url.startswith("rediss://:pa55word@127.0.0.1:")
    assert f"ssl_ca_certs={server.tls.ca_cert}" in url
    ch = channel_name(cluster_name)
    a, pa = await _bus(url, ch)
    b, pb = await _bus(url, ch)
    try:
        for i in range(20):
            await a.publish(b"t%d" % i)
        await pb.wait(lambda: len(pb.got) == 20)
        assert pb.got == [b"t%d" % i for i in range(20)]
        await pa.wait(lambda: len(pa.got) == 20)
        assert "pa55word" not in str(a.describe())
    finally:
        for bus in (a, b):
            await bus.close()
    # Over TLS, AUTH is still checked.
    wrong = RedisBus(server.tls_url(server.tls.ca_cert, password="nope"), ch, min_backoff=0.02)
    p = Probe()
    await wrong.start(p.got.append, p.states.append)
    try:
        await p.wait(lambda: wrong.last_error is not None)
        assert not wrong.connected
        assert "authentication" in (wrong.last_error or "").lower()
    finally:
        await wrong.close()


async def _refused_over_tls(url: str, channel: str) -> None:
    """The bus does not connect, says why, and publish fails at once with that reason."""
    bus = RedisBus(url, channel, min_backoff=0.02, max_backoff=0.2)
    p = Probe()
    await bus.start(p.got.append, p.states.append)
    try:
        await p.wait(lambda: bus.last_error is not None)
        assert not bus.connected
        assert p.states == []
        assert "TLS certificate verification failed" in (bus.last_error or "")
        with pytest.raises(BusUnavailable, match="TLS certificate verification failed"):
            await bus.publish(b"x")
    finally:
        await bus.close()


async def test_tls_certificate_of_an_untrusted_ca_is_refused(
    redis_factory: Callable[..., RedisServer], cluster_name: str, tmp_path: Path
) -> None:
    server = redis_factory(password="pa55word", tls=True)
    ch = channel_name(cluster_name)
    other_ca = make_tls_files(tmp_path / "other").ca_cert  # did not sign the server's certificate
    await _refused_over_tls(server.tls_url(other_ca), ch)
    # No CA in the URL: the system's trust store, which does not know the test CA either.
    await _refused_over_tls(f"rediss://:pa55word@127.0.0.1:{server.port}/0", ch)


def test_redact_hides_passwords() -> None:
    assert redact("redis://u:secret@h:1/0") == "redis://u:***@h:1/0"
    assert redact("rediss://:secret@h:1") == "rediss://:***@h:1"
    assert redact("redis://h:1/0") == "redis://h:1/0"
    assert (
        redact("rediss://:s@h:1/0?ssl_ca_certs=/ca.pem&ssl_password=kp&ssl_cert_reqs=required")
        == "rediss://:***@h:1/0?ssl_ca_certs=/ca.pem&ssl_password=***&ssl_cert_reqs=required"
    )


@pytest.mark.quiet
async def test_outage_fails_fast_and_reconnects(
    redis_factory: Callable[..., RedisServer], cluster_name: str
) -> None:
    server = redis_factory()
    ch = channel_name(cluster_name)
    a, pa = await _bus(server.url, ch)
    try:
        server.stop()
        await pa.wait(lambda: not a.connected)
        t0 = time.monotonic()
        for _ in range(100):
            with pytest.raises(BusUnavailable):
                await a.publish(b"lost")
        assert time.monotonic() - t0 < 1.0  # fails fast, no waiting on a dead Redis
        server.start()
        await pa.wait(lambda: a.connected)
        assert pa.states == [True, False, True]
        await a.publish(b"back")
        await pa.wait(lambda: pa.got == [b"back"])
        assert a.connects == 2
    finally:
        await a.close()


async def test_listened_channels_are_confirmed_heard_left_and_kept_across_a_reconnect(
    redis_factory: Callable[..., RedisServer], cluster_name: str
) -> None:
    """The shards' channels (ADR 0024): ``listen`` returns once Redis confirmed them, so what
    is published next is heard; a channel left is not heard; a reconnect listens again."""
    server = redis_factory()
    control, shard = f"meter:{cluster_name}:control", f"meter:{cluster_name}:gossip:{{}}"
    a, pa = await _bus(server.url, control)
    b, pb = await _bus(server.url, control)
    try:
        await a.listen([shard.format(0), shard.format(1)])
        await b.publish(b"s0", shard.format(0))  # at once: the subscription is confirmed
        await b.publish(b"s2", shard.format(2))  # not listened to
        await b.publish(b"s1", shard.format(1))
        await b.publish(b"c")  # the bus' own channel
        await pa.wait(lambda: len(pa.got) == 3)
        assert pa.got == [b"s0", b"s1", b"c"]
        await a.listen([shard.format(1)])  # leaves shard 0
        await b.publish(b"gone", shard.format(0))
        await b.publish(b"kept", shard.format(1))
        await pa.wait(lambda: len(pa.got) == 4)
        assert pa.got[3:] == [b"kept"]
        assert a.describe()["listening"] == 1
        server.restart()
        await pa.wait(lambda: pa.states[-2:] == [False, True] and a.connected)
        await pb.wait(lambda: b.connected)
        await b.publish(b"again", shard.format(1))
        await pa.wait(lambda: pa.got[-1:] == [b"again"])
    finally:
        await a.close()
        await b.close()
    with pytest.raises(BusUnavailable):  # closed: nothing to subscribe on
        await a.listen([shard.format(3)])
