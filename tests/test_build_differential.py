"""The compiled build answers what pure Python answers: one random stream, two nodes.

The same seeded sessions of the fuzzer (:mod:`tests.test_fuzz`: calls of its ten methods,
``track``, ``track_many``, ``usage``, ``usage_all``, ``reserve``, ``commit``, ``release``,
``ping``, ``status`` and ``history``, with plausible and random params, and unknown methods,
other message shapes, damaged frames) go to a node on the installed build and to one forced
to pure Python (``METER_PURE_PYTHON=1``), one session at a time, over the write-ahead log in
``fsync`` mode, and every answer must be the same: results, error codes and messages. mypyc
changes semantics in corners (a typed attribute that refuses a value, an exception that loses
an attribute, an ``int`` that overflows a native type), and the unit tests check the paths
they were written for; this checks the paths nobody wrote a test for. Limits, credits,
subscriptions and export are not sent (the fuzzer does not generate them).

What legitimately differs is normalised, and nothing else:

- each node's reservation ids carry a random prefix of its own: the pure node's is rewritten
  to the compiled node's (in its answers, and in the frames sent to it, at the same length);
- ``status`` results (timings, the build), ``history`` results (what the flusher has stored
  so far) and ``usage_all`` results (a counter it had to load shows the calls applied by the
  time the load landed: docs/protocol.md) are compared as "answered"; their errors are
  compared whole;
- answers on one connection may leave in another order (a key read from storage answers
  later), so each session's answers are compared as a sorted list.

Then the end states: the counts ``status`` keeps of what the stream did, every counter and
day bucket the drained nodes stored, and, restarted (every counter cold), ``usage_all`` of
every tenant month they stored.

A second stream covers what the fuzzer does not send: limits (overrides and plans, hard and
soft, fast and strict, alerts) changed between counting calls, ``check`` and ``limits``, and
the credits ledger (grants, debits, refs reused, ``balance``, ``ledger``), one call at a time
(a call that waits for storage lets later pipelined ones go ahead: docs/protocol.md) on
counters loaded first, a fresh set of tenants every ``EPOCH_CALLS`` calls so that counters
stay near their limits, with ledger entries' ``time`` and the refs a node makes up
normalised.
Not covered: credit-metered features (a pool's funding steps depend on the time between
them), subscriptions, export.

No reservation ends by its lease here (``ttl_ms`` is never sent, the default lease is set to a day):
each node's expiry timer would end it at its own moment.
``METER_DIFF_FRAMES`` sets the frames sent (default 5,000), ``METER_DIFF_LIMIT_CALLS`` the
calls of the second stream (default 3,000), ``METER_FUZZ_SEED`` the seed.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import sqlite3
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgpack
import pytest

from tests.support.nodes import BACKFILL, NodeProcess, short_tmpdir, wait_for
from tests.test_build import HAS_CC
from tests.test_fuzz import MAX_FRAME, SEED, TENANTS, Gen, exchange, pack

FRAMES = int(os.environ.get("METER_DIFF_FRAMES", "5000"))
#: Calls of the limits and ledger stream (the second test).
LIMIT_FRAMES = int(os.environ.get("METER_DIFF_LIMIT_CALLS", "3000"))
#: Answered results that depend on time, on the flusher's progress or on when a key's load
#: lands, not on the build.
VARYING = {"status", "history", "usage_all"}


#: Status fields that count what the stream did, the same on both builds.
SAME_STATUS: tuple[tuple[str, ...], ...] = (
    ("calls",),
    ("reservations", "open"),
    ("request_ids", "remembered"),
    ("request_ids", "finished_reservations"),
    ("server", "requests"),
    ("server", "protocol_errors"),
    ("server", "invalid_requests"),
    ("limits", "refused"),
)


class _Gen(Gen):
    """The fuzzer's generator without ``ttl_ms`` (also when it picks a random option name):
    a reservation's expiry is a race between the two nodes' expiry timers."""

    def opts(self, allowed: list[str]) -> Any:
        out = super().opts([n for n in allowed if n != "ttl_ms"])
        if isinstance(out, dict):
            out.pop("ttl_ms", None)
        return out


def _stored(node: NodeProcess) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
    """The counters and the day buckets in a stopped node's SQLite file."""
    db = sqlite3.connect(node.data_dir / "counters.sqlite3")
    try:
        counters = db.execute(
            "SELECT tenant, period, feature, total FROM counters ORDER BY 1, 2, 3"
        ).fetchall()
        days = db.execute(
            "SELECT tenant, feature, day, total FROM days ORDER BY 1, 2, 3"
        ).fetchall()
    finally:
        db.close()
    return counters, days


def _same_status(
    ours: dict[str, Any], pure: dict[str, Any], paths: tuple[tuple[str, ...], ...]
) -> None:
    """Each field at ``paths`` of two ``status`` maps is the same."""
    for path in paths:
        a, b = ours, pure
        for part in path:
            a, b = a[part], b[part]
        assert a == b, (path, a, b)


@contextlib.contextmanager
def _two_nodes(workdir: Path, **env: str) -> Iterator[tuple[NodeProcess, NodeProcess]]:
    """A node on the installed (compiled) build and one on pure Python, same settings; no
    lease ends during a run (each node's expiry timer would end it at its own time)."""
    env = {
        "METER_FLUSH_INTERVAL_MS": "200",
        "METER_DURABILITY": "fsync",
        "METER_LOG_LEVEL": "WARNING",
        "METER_RESERVATION_TTL_MS": str(86_400_000),
        **BACKFILL,  # (the streams give ``at`` anywhere in the past)
        **env,
    }
    with (
        NodeProcess(workdir, "compiled", **env) as ours,
        NodeProcess(workdir, "pure", METER_PURE_PYTHON="1", **env) as pure,
    ):
        if not HAS_CC:
            pytest.skip("no C compiler, so no compiled build to compare (test_build.py covers it)")
        assert ours.call("status")["build"]["compiled"] is True
        assert pure.call("status")["build"]["compiled"] is False
        yield ours, pure


def _month_start(period: str) -> float:
    return datetime.strptime(period, "%Y-%m").replace(tzinfo=UTC).timestamp()


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = short_tmpdir("diff-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _prefix(node: NodeProcess) -> str:
    """The node's reservation-id prefix (``r`` and 12 hex digits), from a reservation of its
    own on a tenant the sessions never use."""
    rid = node.call("reserve", "diff-setup", "api", 1)
    assert isinstance(rid, str) and rid.endswith("-1") and len(rid) == 15, rid
    node.call("release", rid)
    return rid[:13]


def _rewrite(value: Any, old: str, new: str) -> Any:
    """``value`` with ``old`` replaced by ``new`` in every string, keys included."""
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, list):
        return [_rewrite(v, old, new) for v in value]
    if isinstance(value, dict):
        return {_rewrite(k, old, new): _rewrite(v, old, new) for k, v in value.items()}
    return value


def _methods(stream: bytes) -> dict[int, set[str]]:
    """msgid -> methods of the requests in ``stream`` as the node reads them (up to the first
    frame that does not parse; generated or not, a bin method name included). A damaged
    frame can repeat an earlier request's msgid."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, unicode_errors="surrogateescape")
    unpacker.feed(stream)
    out: dict[int, set[str]] = {}
    try:
        for value in unpacker:
            if isinstance(value, list) and len(value) >= 3 and value[0] == 0:
                msgid, method = value[1], value[2]
                if isinstance(method, bytes):
                    method = method.decode(errors="replace")
                if isinstance(msgid, int) and isinstance(method, str):
                    out.setdefault(msgid, set()).add(method)
    except Exception:
        pass  # a damaged frame: the node closes the connection there
    return out


def _normal(answers: list[Any], methods: dict[int, set[str]]) -> list[bytes]:
    out: list[bytes] = []
    for a in answers:
        if (
            isinstance(a, list)
            and len(a) == 4
            and a[2] is None
            and isinstance(a[1], int)
            and methods.get(a[1], set()) & VARYING
        ):
            a = [a[0], a[1], None, "<answered>"]
        out.append(msgpack.packb(a, use_bin_type=True))
    return sorted(out)


def test_compiled_and_pure_nodes_answer_a_random_stream_alike(workdir: Path) -> None:
    with _two_nodes(workdir, METER_MAX_FRAME_BYTES=str(MAX_FRAME)) as (ours, pure):
        ours_prefix, pure_prefix = _prefix(ours), _prefix(pure)
        gen = _Gen(random.Random(SEED + 7))
        frames = sessions = compared = 0
        while frames < FRAMES:
            session = gen.session()
            stream = b"".join(session)
            frames += len(session)
            sessions += 1
            got = exchange(ours.socket, stream)
            other = exchange(
                pure.socket, stream.replace(ours_prefix.encode(), pure_prefix.encode())
            )
            other = _rewrite(other, pure_prefix, ours_prefix)
            for a in got:  # later sessions commit and release what this one reserved
                if (
                    isinstance(a, list)
                    and len(a) == 4
                    and a[2] is None
                    and isinstance(a[1], int)
                    and gen.methods.get(a[1]) == "reserve"
                    and isinstance(a[3], str)
                ):
                    gen.reservations.append(a[3])
            methods = _methods(stream)
            left, right = _normal(got, methods), _normal(other, methods)
            assert left == right, (
                f"session {sessions} answered differently\nstream {stream[:400]!r}\n"
                f"compiled {[msgpack.unpackb(x) for x in left if x not in right]}\n"
                f"pure     {[msgpack.unpackb(x) for x in right if x not in left]}"
            )
            compared += len(left)
        # Both counted the same calls the same way.
        for tenant in TENANTS:
            a, b = ours.call("usage_all", tenant), pure.call("usage_all", tenant)
            assert a == b, ("before the stop", tenant)
        assert ours.call("ping") == pure.call("ping") == "pong"
        st_ours, st_pure = ours.call("status"), pure.call("status")
        _same_status(st_ours, st_pure, SAME_STATUS)
        assert st_ours["server"]["internal_errors"] == st_pure["server"]["internal_errors"] == 0
        # Drained, both stored the same counters and day buckets, every tenant and period.
        assert ours.stop() == 0 and pure.stop() == 0
        counters, days = _stored(ours)
        assert (counters, days) == _stored(pure)
        assert len(counters) > 50 and days, (len(counters), len(days))
        # Restarted, every counter is cold: usage_all lists each month of each tenant from
        # storage, the path a counter not loaded yet takes.
        ours.start()
        pure.start()
        months = sorted({(t, p) for t, p, _, _ in counters if len(p) == 7})
        for tenant, period in months:
            opts = {"at": _month_start(period)}
            # (A counter at 0 that was never stored is listed only if the warm-up after the
            # restart has read it back yet: a race, not the build. Stored ones are listed.)
            a, b = ({f: v for f, v in node.call("usage_all", tenant, opts).items() if v}
                    for node in (ours, pure))  # fmt: skip
            assert a == b, (tenant, period)
        print(
            f"\n{frames} frames in {sessions} sessions, {compared} answers compared, all "
            f"alike; {len(counters)} counters and {len(days)} day buckets stored alike, "
            f"{len(months)} tenant months listed alike after a restart"
        )
        assert compared > FRAMES // 3


# -- limits and the credits ledger --------------------------------------------------------------

LIMIT_FEATURES = ["api", "gpu", "seats"]
#: Status fields of the limit checks that the second stream compares at its end.
LIMIT_STATUS: tuple[tuple[str, ...], ...] = (
    ("limits", "version"),
    ("limits", "soft_crossings"),
    ("limits", "strict", "refused"),
    ("alerts", "fired"),
)
#: Calls per set of tenants: then a fresh set (loaded first), so counters stay near limits.
EPOCH_CALLS = 250


def epoch_tenants(epoch: int) -> list[str]:
    """The tenants of one epoch: two accounts, two users of the first."""
    return [f"acme{epoch}", f"acme{epoch}/u1", f"acme{epoch}/u2", f"zeta{epoch}"]


PLANS = ["free", "pro"]
#: The calls of the stream, weighted.
LIMIT_METHODS = [
    *["track"] * 6, "track_many", "check", "check", "usage", "reserve", "commit", "release",
    "set_limit", "set_limit", "clear_limit", "set_plan", "assign_plan", "limits", "grant",
    "grant", "debit", "debit", "balance", "ledger",
]  # fmt: skip
#: Answer fields that hold the clock's time when the answer was made.
CLOCK_FIELDS = {"time"}


class _LimitsGen(_Gen):
    """Calls on a few counters under limits that change as they go: overrides
    and plans (hard and soft, fast and strict, with alerts), counting calls against them,
    ``check``, ``limits``, and the credits ledger (grants with and without expiry, debits,
    refs reused, ``balance``, ``ledger`` pages). Mostly plausible; a param now and then is
    anything. No ``price``: a credit pool's funding steps depend on the time between them
    (docs/ledger.md), so what it answers is not the build's alone."""

    def __init__(self, rng: random.Random, now: float) -> None:
        super().__init__(rng)
        self.now = now
        self.refs = ["ref-0"]
        self.epoch = 0
        #: Reservations open on the compiled node (its answers), so most commits and
        #: releases find theirs.
        self.open: list[str] = []
        self.last: tuple[str, list[Any]] = ("", [])

    @property
    def tenants(self) -> list[str]:
        return epoch_tenants(self.epoch)

    def small(self) -> Any:
        """A quantity near the limits' scale; now and then one that is refused."""
        r = self.r
        if r.random() < 0.05:
            return r.choice([-1, self.not_a_name()])
        return r.choice([1, 1, 2, r.randint(0, 10), r.randint(0, 60)])

    def seen(self, answer: Any) -> None:
        """Follow the compiled node's answer to the last call."""
        method, params = self.last
        if answer[2] is not None:
            return
        if method == "reserve":
            self.reservations.append(answer[3])
            self.open.append(answer[3])
        elif method in ("commit", "release") and params and params[0] in self.open:
            self.open.remove(params[0])

    def spec(self) -> Any:
        r = self.r
        kind = r.choice(["hard", "hard", "soft"])
        out: dict[str, Any] = {"limit": r.choice([0, 1, 5, r.randint(0, 300), r.randint(0, 300)])}
        if r.random() < 0.7:
            out["kind"] = kind
        if kind == "hard" and r.random() < 0.4:
            out["enforcement"] = "strict"
        elif r.random() < 0.2:
            out["enforcement"] = r.choice(["fast", "strict", "odd"])
        if r.random() < 0.3:
            out["alerts"] = r.choice([[50, 100], [80], [100, 80], [0], [1001], "80"])
        if r.random() < 0.05:
            out[r.choice(["colour", "limit", "kind"])] = self.value()
        return self.maybe(out)

    def ref(self) -> Any:
        r = self.r
        if r.random() < 0.3:
            return r.choice(self.refs)
        ref = f"ref-{r.randint(1, 10**9)}"
        self.refs.append(ref)
        return self.maybe(ref)

    def params(self, method: str) -> list[Any]:
        r = self.r
        tenant, feature = self.name(self.tenants), self.name(LIMIT_FEATURES)
        p: list[Any]
        if method in ("track", "check"):
            p = [tenant, feature, self.small()]
            if method == "track" and r.random() < 0.3:
                p.append({"detail": True} if r.random() < 0.7 else self.opts(["detail", "id"]))
        elif method == "reserve":
            # Mostly an account: a reservation below one is refused (docs/quotas.md).
            account = r.choice(self.tenants[::3]) if r.random() < 0.85 else tenant
            p = [account, feature, self.small()]
            if r.random() < 0.3:
                p.append({"limit": r.randint(0, 100)})
        elif method == "usage":
            p = [tenant, feature]
        elif method == "track_many":
            p = [[[self.name(self.tenants), self.name(LIMIT_FEATURES), r.randint(0, 40)]
                  for _ in range(r.randint(1, 6))]]  # fmt: skip
        elif method in ("commit", "release"):
            pool = self.open if self.open and r.random() < 0.8 else self.reservations
            p = [self.maybe(r.choice(pool))]
            if method == "commit" and r.random() < 0.5:
                p.append(r.randint(0, 80))
        elif method == "set_limit":
            p = [tenant, feature, self.spec()]
        elif method == "clear_limit":
            p = [tenant, feature]
        elif method == "set_plan":
            features = {r.choice(LIMIT_FEATURES): self.spec() for _ in range(r.randint(0, 3))}
            p = [self.name(PLANS), self.maybe(features)]
        elif method == "assign_plan":
            p = [tenant, r.choice([*PLANS, None, "nope"])]
        elif method in ("limits", "balance"):
            p = [tenant]
        elif method == "grant":
            opts: dict[str, Any] = {}
            if r.random() < 0.5:
                opts["ref"] = self.ref()
            if r.random() < 0.3:
                # A day from now or a day ago: never near enough to expire during the run.
                opts["expires_at"] = int(self.now) + r.choice([86_400, -86_400, 7 * 86_400])
            if r.random() < 0.3:
                opts["priority"] = self.maybe(r.randint(0, 9))
            p = [tenant, self.maybe(r.choice([1, r.randint(1, 500), r.randint(1, 500), 0])), opts]
        elif method == "debit":
            p = [tenant, self.maybe(r.choice([1, r.randint(1, 300)]))]
            if r.random() < 0.6:
                p.append({"ref": self.ref()})
        elif method == "ledger":
            p = [tenant]
            if r.random() < 0.5:
                p.append({"after": r.randint(0, 20), "limit": r.choice([1, 5, 100])})
        else:
            p = []
        if r.random() < 0.05 and p:
            p[r.randrange(len(p))] = self.not_a_name()
        return p

    def name(self, pool: list[str]) -> Any:
        """A name of ``pool`` (sometimes as bin), or a value that is no name: the counters
        stay few, loaded, and near their limits."""
        r = self.r
        roll = r.random()
        if roll < 0.8:
            return r.choice(pool)
        if roll < 0.9:
            return r.choice(pool).encode()
        return self.not_a_name()

    def not_a_name(self) -> Any:
        while True:
            value = self.value()
            if not isinstance(value, (str, bytes)):
                return value

    def call(self) -> bytes:
        """One request frame."""
        method = self.r.choice(LIMIT_METHODS)
        msgid = self.next_msgid()
        self.methods[msgid] = method
        params = self.params(method)
        self.last = (method, params)
        return pack([0, msgid, method, params])


class _Conn:
    """One connection, one call at a time: each answered before the next is sent."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(str(path))
        self.unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)

    def ask(self, frame: bytes) -> Any:
        self.sock.sendall(frame)
        for answer in self.unpacker:
            return answer
        while True:
            data = self.sock.recv(65536)
            assert data, "the node closed the connection"
            self.unpacker.feed(data)
            for answer in self.unpacker:
                return answer

    def close(self) -> None:
        self.sock.close()


def _unclocked(value: Any) -> Any:
    """``value`` with every clock field (:data:`CLOCK_FIELDS`) of a map set to ``None``, and
    every ref the node made up (``~`` and a random uuid, for a grant sent without one) set to
    ``"~"``."""
    if isinstance(value, list):
        return [_unclocked(v) for v in value]
    if isinstance(value, dict):
        return {k: _unclocked_field(k, v) for k, v in value.items()}
    return value


def _unclocked_field(name: Any, value: Any) -> Any:
    if name in CLOCK_FIELDS:
        return None
    if name == "ref" and isinstance(value, str) and value.startswith("~"):
        return "~"
    return _unclocked(value)


def test_compiled_and_pure_nodes_enforce_limits_and_keep_the_ledger_alike(
    workdir: Path,
) -> None:
    with _two_nodes(workdir, METER_TENANT_HIERARCHY="true") as (ours, pure):
        ours_prefix, pure_prefix = _prefix(ours), _prefix(pure)
        gen = _LimitsGen(random.Random(SEED + 11), time.time())

        def load(epoch: int) -> None:
            """Every counter an epoch's calls can name loaded first, on both nodes."""
            for node in (ours, pure):
                for tenant in epoch_tenants(epoch):
                    for feature in LIMIT_FEATURES:
                        assert node.call("usage", tenant, feature) == 0

        codes: dict[str, int] = {}
        by_method: dict[tuple[str, str], int] = {}
        conn_ours, conn_pure = _Conn(ours.socket), _Conn(pure.socket)
        try:
            for n in range(LIMIT_FRAMES):
                if n % EPOCH_CALLS == 0:
                    gen.epoch = n // EPOCH_CALLS
                    gen.open.clear()
                    load(gen.epoch)
                frame = gen.call()
                got = _unclocked(conn_ours.ask(frame))
                raw = conn_pure.ask(frame.replace(ours_prefix.encode(), pure_prefix.encode()))
                other = _unclocked(_rewrite(raw, pure_prefix, ours_prefix))
                assert got == other, f"call {n} answered differently\n{frame!r}\n{got}\n{other}"
                gen.seen(got)
                code = "ok" if got[2] is None else str(got[2].get("code"))
                codes[code] = codes.get(code, 0) + 1
                by_method[(gen.last[0], code)] = by_method.get((gen.last[0], code), 0) + 1
        finally:
            conn_ours.close()
            conn_pure.close()
        for tenant in [t for e in range(gen.epoch + 1) for t in epoch_tenants(e)]:
            for method in ("limits", "balance", "usage_all"):
                assert _unclocked(ours.call(method, tenant)) == _unclocked(
                    pure.call(method, tenant)
                ), (method, tenant)
        # An alert counts as fired once its claim is stored: wait for both nodes' claims.
        wait_for(
            lambda: all(n.call("status")["alerts"]["pending"] == 0 for n in (ours, pure)),
            30,
            "every alert claim stored",
        )
        st_ours, st_pure = ours.call("status"), pure.call("status")
        assert st_ours["server"]["internal_errors"] == st_pure["server"]["internal_errors"] == 0
        _same_status(st_ours, st_pure, SAME_STATUS)
        # Strict limits were enforced from shares written to storage, and refused.
        # What the limit checks decided beyond the answers (not the share writes: when a
        # share is given back idle and taken again is each node's own timing).
        _same_status(st_ours, st_pure, LIMIT_STATUS)
        strict = st_ours["limits"]["strict"]
        print(
            f"\n{LIMIT_FRAMES} limit and ledger calls answered alike; by code {codes}; "
            f"by method {sorted(by_method.items())}; limits {st_ours['limits']}"
        )
        # The paths were reached: strict shares written and refusing, soft crossings,
        # reservations admitted and closed, refusals by limit and for credit.
        assert strict["writes"] > 0 and strict["refused"] > 0, strict
        assert st_ours["limits"]["soft_crossings"] >= LIMIT_FRAMES // 1000, st_ours["limits"]
        for key, least in {
            ("track", "limit_exceeded"): LIMIT_FRAMES // 100,
            ("track", "ok"): LIMIT_FRAMES // 10,
            ("reserve", "ok"): LIMIT_FRAMES // 200,
            ("reserve", "limit_exceeded"): LIMIT_FRAMES // 1000,
            ("commit", "ok"): LIMIT_FRAMES // 300,
            ("release", "ok"): LIMIT_FRAMES // 300,
            ("debit", "insufficient_balance"): 1,
            ("grant", "ok"): LIMIT_FRAMES // 100,
        }.items():
            assert by_method.get(key, 0) >= least, (key, by_method)
