"""``meter status``'s one-screen summary shows what an operator needs at a glance."""

from __future__ import annotations

from meter.cli.status import fmt as _fmt


def test_summary_of_a_clustered_node_with_trouble() -> None:
    status = {
        "node_id": "n1",
        "version": "0.1.0",
        "uptime_s": 12.5,
        "storage": "dynamodb",
        "socket": "./meter.sock",
        "data_dir": "./.meter",
        "keys": {"warm": 10, "dirty": 3, "unseeded": 1, "inflight": 2},
        "seeding": {"on_demand": 8, "prefetched": 5, "reads": 3, "failed_reads": 1, "queued": 2},
        "flush": {
            "last_result": "error",
            "last_age_s": 0.4,
            "interval_ms": 1000,
            "keys_written": 5,
            "failures": 7,
            "backlog_keys": 3,
            "backlog_units": 42,
            "backlog_age_s": 9.5,
            "last_error": "acme/api@2026-11: throttled",
            "poisoned": [{"key": ["acme", "big", "2026-11"], "error": "ValidationException"}],
        },
        "owner": {"state": "waiting", "last_error": "held by another process until X"},
        "ready": False,
        "not_ready": ["storage: the last flush round failed: throttled", "bus: not connected"],
        "reservations": {"open": 1, "expired_total": 0},
        "durability": {
            "mode": "fsync",
            "wal": {
                "broken": "writing wal-00000002.log failed: ENOSPC (disk full)",
                "segments": 2,
                "size_bytes": 4096,
                "oldest_segment_age_s": 3.5,
                "fsyncs": 9,
            },
        },
        "request_ids": {"remembered": 10, "max": 250000, "dropped_early": 2},
        "server": {"connections": 2, "requests": 99, "protocol_errors": 1, "internal_errors": 0},
        "cluster": {
            "cluster": "prod",
            "bus": {"connected": False, "last_error": "connection refused"},
            "live_peers": ["n2"],
            "gaps": 4,
            "rejected": {"bad_mac": 2, "malformed": 0},
            "peers": {
                "n2": {"alive": True, "last_seen_age_s": 0.1, "lag_ms": 1.5, "lag_p99_ms": 3.0},
                "n3": {"alive": False, "last_seen_age_s": 30.0, "lag_ms": None},
            },
        },
    }
    text = _fmt(status)
    assert "backlog      3 keys, 42 units, age 9.5 s" in text
    assert "last error   acme/api@2026-11: throttled" in text
    assert "PARKED       acme/big/2026-11: ValidationException" in text
    assert "bus DOWN (connection refused)" in text
    assert "rejected 2 {'bad_mac': 2}" in text
    assert "peer n3  DEAD" in text and "peer n2  alive" in text
    assert "unseeded 1" in text and "in flight 2" in text
    assert "seeding      8 on demand, 5 read ahead, 3 reads (1 failed), 2 queued" in text
    assert "log          fsync BROKEN (writing wal-00000002.log failed: ENOSPC (disk full))" in text
    assert "4096 bytes, oldest segment 3.5 s, 9 fsyncs" in text
    assert "request ids  10 remembered (max 250000), 2 dropped early" in text
    assert "node id      WAITING: held by another process until X" in text
    assert "ready        NO: storage: the last flush round failed: throttled" in text


def test_summary_shows_the_open_periods_and_an_overdue_one() -> None:
    text = _fmt({"periods": {"open": ["2026-11", "2026-12"], "oldest_open": "2026-11",
                             "overdue_s": 42.5, "closed": 3}})  # fmt: skip
    assert (
        "periods      2 open, oldest 2026-11, 3 closed here; OVERDUE by 42.5 s (its end plus "
        "the grace has passed)"
    ) in text.splitlines()
    text = _fmt({"periods": {"open": [], "oldest_open": None, "overdue_s": 0.0, "closed": 0}})
    assert "periods      none open, 0 closed here" in text.splitlines()


def test_summary_says_when_the_log_is_off() -> None:
    text = _fmt({"durability": {"mode": "off", "wal": None}})
    assert "log          off (a crash loses what is not flushed)" in text


def test_summary_shows_the_limits() -> None:
    text = _fmt(
        {"limits": {"version": 7, "limited_pairs": 3, "refused": 12, "soft_crossings": 1,
                    "last_error": "dynamodb: down"}}
    )  # fmt: skip
    assert (
        "limits       version 7, 3 limited, 12 refused, 1 soft crossings; "
        "cannot read them: dynamodb: down"
    ) in text.splitlines()
