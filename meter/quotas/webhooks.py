"""Signed webhooks: every threshold and balance alert this node fires, POSTed as JSON to the
configured URLs from a durable outbox (docs/quotas.md, "Webhooks").

Exactly one node of the fleet sends an alert: the one whose claim of it stored its body
(:mod:`meter.quotas.alerts`). So a crash cannot lose one, this node writes the deliveries to its
outbox (``webhooks.sqlite`` in the data dir, synced) *before* it claims the alert, with the
claim's body: a claim won but not yet marked in the outbox is claimed again at the next start
with that same body, which storage recognises as this node's (:meth:`Alerts.resume`). A claim
lost removes the deliveries. Each delivery is tried until the receiver answers 2xx: again after
1 s, doubling up to :data:`MAX_RETRY_S`, for ``max_age_s`` (then counted failed and dropped).

Every body carries the alert's stable ``id``; a receiver that dedupes by it sees each alert once
(a delivery answered 2xx whose answer was lost is sent again). Each request is signed:
``Meter-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>" under the secret>``
(:func:`signature`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import json
import logging
import sqlite3
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from meter.quotas.alerts import BALANCE, Alert

log = logging.getLogger("meter.webhooks")

#: The first retry after this many seconds, then twice as long each time, at most...
FIRST_RETRY_S = 1.0
#: ...this long between tries.
MAX_RETRY_S = 300.0
#: Tries in flight at once, and to one URL.
CONCURRENCY = 32
PER_URL = 4
#: The signature's header.
HEADER = "Meter-Signature"


def kind_of(alert: Alert) -> str:
    """``balance`` for a balance alert, else ``threshold``."""
    return "balance" if alert.feature == BALANCE else "threshold"


def event_body(alert: Alert) -> str:
    """The JSON body of ``alert``'s webhook: ``{"id", "type", "created_at", "data"}``."""
    event = {
        "id": alert.id,
        "type": f"alert.{kind_of(alert)}",
        "created_at": alert.at,
        "data": alert.to_wire(),
    }
    return json.dumps(event, sort_keys=True, separators=(",", ":"))


def signature(secret: str, t: int, body: str) -> str:
    """The ``Meter-Signature`` header of ``body`` sent at ``t`` (unix seconds)."""
    mac = hmac.new(secret.encode(), f"{t}.{body}".encode(), hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"


def retry_after(attempts: int) -> float:
    """Seconds before the next try after ``attempts`` failed ones (1, 2, 4, ... capped)."""
    return float(min(MAX_RETRY_S, FIRST_RETRY_S * 2 ** min(attempts - 1, 30)))


class Resumable(Protocol):
    """What the outbox gives its unclaimed alerts back to at start (:class:`Alerts`)."""

    def resume(self, alert: Alert, claim: str) -> None: ...


class Webhooks:
    """The outbox and its sender: :meth:`claiming` and :meth:`claimed` are called by
    :class:`~meter.quotas.alerts.Alerts` around each claim; :meth:`run` delivers."""

    def __init__(
        self,
        targets: Iterable[tuple[str, frozenset[str]]],
        secret: str,
        data_dir: Path,
        *,
        max_age_s: float,
        timeout_s: float,
    ) -> None:
        self.targets = tuple(targets)
        self.secret = secret
        self.max_age_s = max_age_s
        self.timeout_s = timeout_s
        self.path = data_dir / "webhooks.sqlite"
        # (on the event loop: a write is a claim's or a delivery's, rare; a short busy
        # timeout bounds a stall behind another process holding the file's lock)
        self._db = sqlite3.connect(self.path, isolation_level=None, timeout=1.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS deliveries (alert_id TEXT NOT NULL, url TEXT NOT NULL,"
            " alert TEXT NOT NULL, claim TEXT NOT NULL, body TEXT NOT NULL,"
            " state TEXT NOT NULL, attempts INTEGER NOT NULL, next_at REAL NOT NULL,"
            " created_at REAL NOT NULL, last_error TEXT, PRIMARY KEY (alert_id, url))"
        )
        self._wake = asyncio.Event()
        #: Deliveries answered 2xx, and those given up after ``max_age_s``.
        self.delivered = 0
        self.failed = 0
        self.last_error: str | None = None

    @contextlib.contextmanager
    def _tx(self) -> Iterator[None]:
        """One transaction (the connection is in autocommit mode: each write its own); a
        failed one, its COMMIT included, is rolled back, so the next can begin."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise

    # -- around a claim (Alerts' journal) ---------------------------------------------------

    def claiming(self, alerts: list[tuple[Alert, str]]) -> None:
        """Before ``alerts`` are claimed, each with its claim's body: their deliveries, written
        and synced in one transaction (``sqlite3.Error`` if they cannot be: the claims wait).
        Rows already there (an earlier detection, an earlier process) are kept."""
        now = time.time()
        rows = []
        for alert, claim in alerts:
            kind = kind_of(alert)
            wire, body = json.dumps(alert.to_wire()), event_body(alert)
            rows += [
                (alert.id, url, wire, claim, body, now, now)
                for url, kinds in self.targets
                if kind in kinds
            ]
        if not rows:
            return
        with self._tx():
            self._db.executemany(
                "INSERT OR IGNORE INTO deliveries VALUES (?, ?, ?, ?, ?, 'claiming', 0, ?, ?,"
                " NULL)",
                rows,
            )

    def claimed(self, alert: Alert, won: bool) -> None:
        """``alert``'s claim was answered: this node sends it (``won``), or another does. A
        claim lost drops only deliveries still waiting for their claim: those an earlier
        process of this node won (the alert detected again since) stay due."""
        with self._tx():
            if won:
                self._db.execute(
                    "UPDATE deliveries SET state = 'due' WHERE alert_id = ? AND state = 'claiming'",
                    (alert.id,),
                )
            else:
                self._db.execute(
                    "DELETE FROM deliveries WHERE alert_id = ? AND state = 'claiming'",
                    (alert.id,),
                )
        if won:
            self._wake.set()

    def resume(self, alerts: Resumable) -> int:
        """Give every alert whose claim has no outcome here yet back to ``alerts`` (claimed
        again with its body); how many."""
        rows = self._db.execute(
            "SELECT DISTINCT alert, claim FROM deliveries WHERE state = 'claiming'"
        ).fetchall()
        for wire, claim in rows:
            alert = Alert.from_wire(json.loads(wire))
            if alert is not None:
                alerts.resume(alert, claim)
        return len(rows)

    # -- delivery ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Deliver what is due, whenever something is; until cancelled (tries in flight are
        cancelled with it: their deliveries stay due)."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        flying: dict[tuple[str, str], asyncio.Task[None]] = {}
        async with aiohttp.ClientSession(timeout=timeout) as session:
            try:
                while True:
                    try:
                        await self._round(session, flying)
                    except Exception as exc:  # the outbox, or a bug: kept, tried again
                        self.last_error = f"outbox: {exc}"
                        log.exception("webhooks: a round failed (tried again in 1 s)")
                        await asyncio.sleep(1.0)
            finally:
                for task in flying.values():
                    task.cancel()

    async def _round(
        self, session: aiohttp.ClientSession, flying: dict[tuple[str, str], asyncio.Task[None]]
    ) -> None:
        """Start the tries that are due (at most :data:`CONCURRENCY` in flight, at most
        :data:`PER_URL` to one URL, so a URL that does not answer holds up no other), then
        wait until one ends, another is due, or one is woken."""
        self._wake.clear()
        now = time.time()
        per_url: dict[str, int] = {}
        for _, url in flying:
            per_url[url] = per_url.get(url, 0) + 1
        nxt: float | None = None
        rows = self._db.execute(
            "SELECT alert_id, url, body, attempts, created_at, next_at FROM deliveries"
            " WHERE state = 'due' ORDER BY next_at LIMIT 1000"
        )
        for alert_id, url, body, attempts, created_at, next_at in rows:
            key = (alert_id, url)
            if key in flying or per_url.get(url, 0) >= PER_URL:
                continue
            if next_at > now or len(flying) >= CONCURRENCY:
                nxt = next_at if nxt is None else min(nxt, next_at)
                continue
            task = asyncio.create_task(
                self._send(session, alert_id, url, body, attempts, created_at)
            )
            flying[key] = task
            per_url[url] = per_url.get(url, 0) + 1
            task.add_done_callback(functools.partial(self._landed, flying, key))
        wait = 60.0 if nxt is None else max(0.0, min(60.0, nxt - now))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), wait)

    def _landed(
        self,
        flying: dict[tuple[str, str], asyncio.Task[None]],
        key: tuple[str, str],
        task: asyncio.Task[None],
    ) -> None:
        flying.pop(key, None)
        self._wake.set()  # (a slot is free: start the next)
        if not task.cancelled() and task.exception() is not None:  # (the outbox's write)
            self.last_error = f"outbox: {task.exception()}"
            log.error("webhooks: noting a try of %s failed (tried again)", key[0],
                      exc_info=task.exception())  # fmt: skip

    async def _send(
        self,
        session: aiohttp.ClientSession,
        alert_id: str,
        url: str,
        body: str,
        attempts: int,
        created_at: float,
    ) -> None:
        t = int(time.time())
        headers = {"Content-Type": "application/json", HEADER: signature(self.secret, t, body)}
        try:
            # (a redirect is not followed: aiohttp would send a POST's 301 on as a GET
            # without its body, and the signature to wherever it points)
            post = session.post(url, data=body.encode(), headers=headers, allow_redirects=False)
            async with post as resp:
                await resp.read()
                error = None if 200 <= resp.status < 300 else f"HTTP {resp.status}"
                if 300 <= resp.status < 400:
                    where = resp.headers.get("Location", "?")[:200]
                    error = f"HTTP {resp.status} to {where} (not followed)"
        except Exception as exc:  # every failure of a try is a failed try
            error = f"{type(exc).__name__}: {exc}"
        key = (alert_id, url)
        gone = error is None or time.time() - created_at >= self.max_age_s
        with self._tx():
            if gone:
                self._db.execute("DELETE FROM deliveries WHERE alert_id = ? AND url = ?", key)
            else:
                self._db.execute(
                    "UPDATE deliveries SET attempts = ?, next_at = ?, last_error = ?"
                    " WHERE alert_id = ? AND url = ?",
                    (attempts + 1, time.time() + retry_after(attempts + 1), error, *key),
                )
        # (counted once the outbox says so)
        if error is None:
            self.delivered += 1
            log.info("webhook %s delivered to %s", alert_id, url)
            return
        self.last_error = f"{url}: {error}"
        if gone:
            self.failed += 1
            log.error("webhook %s to %s given up after %d tries: %s",
                      alert_id, url, attempts + 1, error)  # fmt: skip
        elif attempts == 0:
            log.warning("webhook %s to %s failed (retried): %s", alert_id, url, error)

    def status(self) -> dict[str, Any]:
        """Counts for ``status`` and the metrics: ``pending`` deliveries this node sends,
        ``unclaimed`` ones waiting for their alert's claim (storage, or the next start)."""
        rows = dict(
            self._db.execute("SELECT state, COUNT(*) FROM deliveries GROUP BY state").fetchall()
        )
        (oldest,) = self._db.execute("SELECT MIN(created_at) FROM deliveries").fetchone()
        return {
            "pending": rows.get("due", 0),
            "unclaimed": rows.get("claiming", 0),
            "delivered": self.delivered,
            "failed": self.failed,
            "oldest_pending_s": 0.0 if oldest is None else max(0.0, time.time() - oldest),
            "last_error": self.last_error,
        }

    def close(self) -> None:
        """Close the outbox; what it holds is sent at the next start (logged)."""
        left = sum(self._db.execute("SELECT COUNT(*) FROM deliveries").fetchone())
        if left:
            log.error("webhooks: %d deliveries not made yet stay in %s for the next start",
                      left, self.path)  # fmt: skip
        self._db.close()
