"""Signed webhooks of alerts (docs/quotas.md, "Webhooks") against a real HTTP receiver: the
signature verifies; a receiver answering 500 three times then 200 gets the alert once by id,
retried 1 s then doubling; a claim lost sends nothing; a claim made by a process that died
before it marked the outcome is claimed again at the next start with the same body and sent
(or dropped when another node won it); a real node killed with a delivery pending delivers it
after its restart; bad settings are refused."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import shutil
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from meter.config import load
from meter.errors import ConfigError
from meter.quotas.alerts import Alerts, make_alert
from meter.quotas.webhooks import Webhooks, event_body, retry_after, signature
from storage.memory import MemoryStorage
from tests.support.nodes import NodeProcess, short_tmpdir, wait_for
from tests.support.webhook_receiver import Received, WebhookReceiver, free_port

SECRET = "whsec-test"
KEY = ("acme", "api", "2026-12")


def verify(r: Received, secret: str = SECRET, now: float | None = None) -> bool:
    """What docs/quotas.md tells a receiver to do: recompute the HMAC of ``t.body``, compare
    in constant time, and refuse a ``t`` older than 5 minutes."""
    parts = dict(p.split("=", 1) for p in r.headers["meter-signature"].split(","))
    t = int(parts["t"])
    mac = hmac.new(secret.encode(), f"{t}.{r.body}".encode(), hashlib.sha256).hexdigest()
    fresh = abs((now or time.time()) - t) <= 300
    return fresh and hmac.compare_digest(mac, parts["v1"])


def rows(wh: Webhooks) -> list[tuple[str, str, str]]:
    """The outbox's deliveries: ``(alert id, url, state)``."""
    return list(wh._db.execute("SELECT alert_id, url, state FROM deliveries ORDER BY url"))


def hooks(
    tmp_path: Path, url: str, kinds: frozenset[str] = frozenset({"threshold", "balance"})
) -> Webhooks:
    return Webhooks([(url, kinds)], SECRET, tmp_path, max_age_s=3600, timeout_s=5)


async def wait_async(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def test_the_signature_and_the_retry_schedule() -> None:
    body = '{"id":"x"}'
    mac = hmac.new(SECRET.encode(), f"1700000000.{body}".encode(), hashlib.sha256).hexdigest()
    assert signature(SECRET, 1700000000, body) == f"t=1700000000,v1={mac}"
    assert [retry_after(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert retry_after(20) == retry_after(1000) == 300.0
    alert = make_alert(KEY, 80, 8, 10, 9, "n1")
    event = json.loads(event_body(alert))
    assert event["id"] == alert.id and event["type"] == "alert.threshold"
    assert event["data"]["tenant"] == "acme" and event["data"]["threshold"] == 80


async def test_500_three_times_then_200_delivers_once_by_id(tmp_path: Path) -> None:
    with WebhookReceiver() as receiver:
        receiver.fail(500, 500, 500)
        wh = hooks(tmp_path, receiver.url)
        alerts = Alerts("n1", MemoryStorage().claim_alert, journal=wh)
        sender = asyncio.create_task(wh.run())
        try:
            alert = make_alert(KEY, 80, 8, 10, 9, "n1")
            alerts.queue(alert)
            t0 = time.monotonic()
            assert await alerts.claim_pending()
            assert wh.status()["pending"] == 1
            await wait_async(lambda: wh.status()["delivered"] == 1, "the delivery")
            took = time.monotonic() - t0
            got = receiver.received
            assert len(got) == 4 and {r.event["id"] for r in got} == {alert.id}
            assert all(verify(r) for r in got)
            assert 1 + 2 + 4 - 0.5 <= took < 7 + 5  # retried after 1 s, 2 s, 4 s
            assert wh.status() == {**wh.status(), "pending": 0, "delivered": 1, "failed": 0}
            assert not verify(got[0], "wrong secret")
            assert not verify(got[0], now=time.time() + 301)  # a replay past the window
        finally:
            sender.cancel()
            wh.close()


async def test_a_claim_lost_sends_nothing_and_kinds_are_picked(tmp_path: Path) -> None:
    store = MemoryStorage()
    alert = make_alert(KEY, 80, 8, 10, 9, "n1")
    assert await store.claim_alert(alert.id, "another node's claim")
    wh = hooks(tmp_path, "http://127.0.0.1:9/never")
    alerts = Alerts("n1", store.claim_alert, journal=wh)
    alerts.queue(alert)
    assert await alerts.claim_pending()
    assert alerts.claimed_elsewhere == 1
    assert rows(wh) == []  # nothing left to send, nothing waiting for a claim
    (tmp_path / "b").mkdir()
    balance_only = hooks(tmp_path / "b", "http://127.0.0.1:9/b", frozenset({"balance"}))
    balance = Alerts("n1", store.claim_alert, journal=balance_only)
    balance.queue(alert)
    balance.balance_entry("acme", 7, 150, 90, (100,))  # below 100: a balance alert
    assert await balance.claim_pending()
    ((aid, url, state),) = rows(balance_only)  # only the balance alert, to its URL
    assert url == "http://127.0.0.1:9/b" and state == "due" and aid != alert.id
    wh.close()
    balance_only.close()


@pytest.mark.parametrize("won_by_the_dead_process", [True, False])
async def test_a_claim_without_its_outcome_is_claimed_again_at_the_next_start(
    tmp_path: Path, won_by_the_dead_process: bool
) -> None:
    """A process wrote its deliveries, claimed, and died before it marked the outcome: the
    next one claims again with the journaled body and sends the alert only if the dead
    process had won it."""
    store = MemoryStorage()
    alert = make_alert(KEY, 80, 8, 10, 9, "n1")
    with WebhookReceiver() as receiver:
        dead = hooks(tmp_path, receiver.url)
        dead_alerts = Alerts("n1", store.claim_alert, journal=dead)
        claim = dead_alerts._claim_body(alert)
        dead.claiming([(alert, claim)])  # ...and the process died (before or after its claim)
        if won_by_the_dead_process:
            assert await store.claim_alert(alert.id, claim)
        else:
            assert await store.claim_alert(alert.id, "n2's claim")
        dead.close()
        wh = hooks(tmp_path, receiver.url)
        alerts = Alerts("n1", store.claim_alert, journal=wh)  # a new process: a new claim body
        assert alerts._claim_body(alert) != claim
        assert wh.resume(alerts) == 1
        sender = asyncio.create_task(wh.run())
        try:
            assert await alerts.claim_pending()
            if won_by_the_dead_process:
                await wait_async(lambda: wh.status()["delivered"] == 1, "the delivery")
                assert [r.event["id"] for r in receiver.received] == [alert.id]
            else:
                assert alerts.claimed_elsewhere == 1 and wh.status()["pending"] == 0
                assert receiver.received == []
        finally:
            sender.cancel()
            wh.close()


def test_a_node_killed_with_a_delivery_pending_delivers_it_after_restart() -> None:
    workdir = short_tmpdir()
    port = free_port()
    env = {
        "METER_WEBHOOK_URLS": f"http://127.0.0.1:{port}/hooks",
        "METER_WEBHOOK_SECRET": SECRET,
    }
    try:
        node = NodeProcess(workdir, **env).start()
        node.call("set_limit", "acme", "api", {"limit": 10, "kind": "soft", "alerts": [50]})
        node.call("track", "acme", "api", 6)  # past 50 %: fired; the receiver is not up
        wait_for(
            lambda: (
                node.call("status")["webhooks"]["pending"] == 1
                and node.call("status")["webhooks"]["last_error"] is not None
            ),
            what="a delivery tried and pending",
        )
        node.kill()
        metrics = {"METER_METRICS_ADDRESS": "127.0.0.1:0"}
        with WebhookReceiver(port) as receiver, NodeProcess(workdir, **env, **metrics) as again:
            wait_for(lambda: len(receiver.received) >= 1, what="the delivery after restart")
            (r,) = receiver.received
            assert verify(r) and r.event["type"] == "alert.threshold"
            assert r.event["data"]["tenant"] == "acme" and r.event["data"]["threshold"] == 50
            wait_for(lambda: again.call("status")["webhooks"]["pending"] == 0, what="cleared")
            assert again.call("status")["webhooks"]["delivered"] == 1
            address = again.call("status")["metrics"]["address"]
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
                text = resp.read().decode()
            assert 'meter_webhooks_total{result="delivered"} 1.0' in text
            assert "meter_webhooks_pending 0.0" in text
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_webhook_settings_are_checked() -> None:
    cfg = load(
        env={
            "METER_WEBHOOK_URLS": "https://a.example/x, http://b.example/y#balance",
            "METER_WEBHOOK_SECRET": "s",
            "METER_WEBHOOK_MAX_AGE_S": "60",
        }
    ).webhooks
    assert cfg.urls == (
        ("https://a.example/x", frozenset({"threshold", "balance"})),
        ("http://b.example/y", frozenset({"balance"})),
    )
    assert cfg.max_age_s == 60
    for env, what in [
        ({"METER_WEBHOOK_URLS": "https://a.example/x"}, "webhook_secret"),
        ({"METER_WEBHOOK_URLS": "ftp://a/x", "METER_WEBHOOK_SECRET": "s"}, "not an http"),
        ({"METER_WEBHOOK_URLS": "https://a/x#usage", "METER_WEBHOOK_SECRET": "s"}, "kinds"),
        ({"METER_WEBHOOK_MAX_AGE_S": "0"}, "webhook_max_age_s"),
    ]:
        with pytest.raises(ConfigError, match=what):
            load(env=env)


async def test_an_alert_detected_again_after_a_restart_keeps_the_earlier_win(
    tmp_path: Path,
) -> None:
    """A process won an alert whose delivery is still due; the next one detects the crossing
    again (a gauge's first reading, a limit raised): its own claim is lost to the earlier
    one, and the earlier win's delivery stays and is sent."""
    store = MemoryStorage()
    alert = make_alert(KEY, 80, 8, 10, 9, "n1")
    with WebhookReceiver() as receiver:
        first = hooks(tmp_path, receiver.url)
        won = Alerts("n1", store.claim_alert, journal=first)
        won.queue(alert)
        assert await won.claim_pending() and won.fired == 1
        first.close()  # (stopped before sending it)
        wh = hooks(tmp_path, receiver.url)
        again = Alerts("n1", store.claim_alert, journal=wh)
        assert wh.resume(again) == 0
        again.queue(make_alert(KEY, 80, 8, 10, 9, "n1"))
        assert await again.claim_pending() and again.claimed_elsewhere == 1
        assert [state for _, _, state in rows(wh)] == ["due"]
        sender = asyncio.create_task(wh.run())
        try:
            await wait_async(lambda: wh.status()["delivered"] == 1, "the earlier win's delivery")
            assert [r.event["id"] for r in receiver.received] == [alert.id]
        finally:
            sender.cancel()
            wh.close()


async def test_a_redirect_is_not_followed_and_an_old_delivery_is_given_up(tmp_path: Path) -> None:
    """A 301 is a failed try (never re-sent as a bodiless GET elsewhere); a delivery still
    failing ``webhook_max_age_s`` after its alert is given up, counted ``failed``."""
    with WebhookReceiver() as receiver:
        receiver.fail(301, 500)
        wh = Webhooks(
            [(receiver.url, frozenset({"threshold"}))], SECRET, tmp_path, max_age_s=0.5, timeout_s=5
        )
        alerts = Alerts("n1", MemoryStorage().claim_alert, journal=wh)
        alerts.queue(make_alert(KEY, 80, 8, 10, 9, "n1"))
        assert await alerts.claim_pending()
        sender = asyncio.create_task(wh.run())
        try:
            await wait_async(lambda: wh.status()["failed"] == 1, "the delivery given up")
            assert wh.status()["delivered"] == 0 and rows(wh) == []
            # Two POSTs with the body (the 301 not followed as a GET), the second past the age.
            assert [(r.method, r.body != "") for r in receiver.received] == [("POST", True)] * 2
            assert "HTTP 500" in (wh.status()["last_error"] or "")
        finally:
            sender.cancel()
            wh.close()


async def test_a_url_that_never_answers_holds_up_no_other(tmp_path: Path) -> None:
    """Ten alerts to a URL whose server never answers and to one that does: the second gets
    all ten while the first's tries still wait for their time limit (5 s here)."""
    with socket.create_server(("127.0.0.1", 0)) as silent, WebhookReceiver() as receiver:
        dead = f"http://127.0.0.1:{silent.getsockname()[1]}/hooks"
        both = frozenset({"threshold"})
        wh = Webhooks(
            [(dead, both), (receiver.url, both)], SECRET, tmp_path, max_age_s=60, timeout_s=5
        )
        alerts = Alerts("n1", MemoryStorage().claim_alert, journal=wh)
        for pct in range(10, 110, 10):
            alerts.queue(make_alert(KEY, pct, pct, 100, 100, "n1"))
        assert await alerts.claim_pending() and alerts.fired == 10
        sender = asyncio.create_task(wh.run())
        try:
            t0 = time.monotonic()
            await wait_async(lambda: len(receiver.received) == 10, "the answering URL's ten", 4.5)
            assert time.monotonic() - t0 < 5  # (before any try to the silent URL has ended)
            assert wh.status()["delivered"] == 10 and wh.status()["pending"] == 10
        finally:
            sender.cancel()
            wh.close()
