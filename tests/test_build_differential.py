"""The compiled build answers what pure Python answers: one random stream, two nodes.

The same seeded sessions of the fuzzer (:mod:`tests.test_fuzz`: valid calls of every method
with plausible and random params, other message shapes, damaged frames) go to a node on the
installed build and to one forced to pure Python (``METER_PURE_PYTHON=1``), one session at a
time, and every answer must be the same: results, error codes and messages. mypyc changes
semantics in corners (a typed attribute that refuses a value, an exception that loses an
attribute, an ``int`` that overflows a native type), and the unit tests check the paths they
were written for; this checks the paths nobody wrote a test for.

What legitimately differs is normalised, and nothing else:

- each node's reservation ids carry a random prefix of its own: the pure node's is rewritten
  to the compiled node's (in its answers, and in the frames sent to it, at the same length);
- ``status`` results (timings, the build), ``history`` results (what the flusher has stored
  so far) and ``usage_all`` results (a counter it had to load shows the calls applied by the
  time the load landed: docs/protocol.md) are compared as "answered"; their errors are
  compared whole, and every tenant's ``usage_all`` once the stream is done;
- answers on one connection may leave in another order (a key read from storage answers
  later), so each session's answers are compared as a sorted list.

Reservations get no ``ttl_ms`` here: an expiry racing a ``commit`` would differ by timing.
``METER_DIFF_FRAMES`` sets the frames sent (default 5,000; ``METER_FUZZ_SEED`` the seed).
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from tests.nodes import NodeProcess, short_tmpdir
from tests.test_build import HAS_CC
from tests.test_fuzz import MAX_FRAME, SEED, TENANTS, Gen, exchange

FRAMES = int(os.environ.get("METER_DIFF_FRAMES", "5000"))
#: Answered results that depend on time, on the flusher's progress or on when a key's load
#: lands, not on the build.
VARYING = {"status", "history", "usage_all"}


class _Gen(Gen):
    """The fuzzer's generator without ``ttl_ms``: a reservation's expiry is a race."""

    def opts(self, allowed: list[str]) -> Any:
        return super().opts([n for n in allowed if n != "ttl_ms"])


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
    env = {
        "METER_MAX_FRAME_BYTES": str(MAX_FRAME),
        "METER_FLUSH_INTERVAL_MS": "200",
        "METER_DURABILITY": "fsync",
        "METER_LOG_LEVEL": "WARNING",
    }
    with (
        NodeProcess(workdir, "compiled", **env) as ours,
        NodeProcess(workdir, "pure", METER_PURE_PYTHON="1", **env) as pure,
    ):
        build = ours.call("status")["build"]
        # (Where a C compiler is present the install must be compiled: test_build.py.)
        assert build["compiled"] is HAS_CC, build
        assert pure.call("status")["build"]["compiled"] is False
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
        # Both counted the same, and both still serve.
        for tenant in TENANTS:
            assert ours.call("usage_all", tenant) == pure.call("usage_all", tenant)
        assert ours.call("ping") == pure.call("ping") == "pong"
        print(f"\n{frames} frames in {sessions} sessions, {compared} answers compared, all alike")
        assert compared > FRAMES // 3
