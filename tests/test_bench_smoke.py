"""The bench runs end to end for about a second and produces its table and JSON (scenario 14,
``fanout``, for a few seconds); scenario 8
(``scale``), which needs DynamoDB Local and three clustered nodes, for about a minute, and
scenario 10 (``quotas``, the same) for about half a minute.

No timing assertion: only the structure of what it reports is checked.
"""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest

import meter
from bench import report
from bench.cli import run
from bench.fanout import SCENARIO as FANOUT
from bench.harness import SMOKE, Row, in_turn
from bench.http_cost import CONFIGS, HTTP
from bench.loadgen import Load, meter_frames, redis_frames
from bench.metrics_cost import METRICS
from bench.quotas import QUOTAS
from bench.scale import SCALE, read_ahead_modes
from bench.scenarios import BATCH, RPC

pytestmark = pytest.mark.redis


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_smoke_run_writes_table_and_json(tmp_path: Path) -> None:
    out = io.StringIO()
    doc = run(
        SMOKE, ["rpc", "batch", "memory", "durable", "metrics"], results_dir=tmp_path, out=out
    )
    assert doc["failures"] == {}
    assert doc["mode"] == "smoke"
    assert {"nproc", "cpu", "python"} <= set(doc["machine"])
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert latest["rows"] == doc["rows"]
    assert len(list(tmp_path.glob("*-smoke.json"))) == 1
    scenarios = {r["scenario"] for r in doc["rows"]}
    assert scenarios == {RPC, BATCH, "6 memory", "7 durable vs Redis AOF", METRICS}
    assert "memory storage" in RPC and "memory storage" in BATCH
    for r in doc["rows"]:
        assert set(r) == {
            "reference_kind",
            "scenario",
            "metric",
            "unit",
            "ours",
            "reference",
            "ratio",
            "target",
            "met",
            "detail",
            "pure",
            "pure_ratio",
            "beside",
            "beside_ratio",
            "vs_beside",
        }
        assert r["beside"] is None and r["beside_ratio"] is None and r["vs_beside"] is None
        assert r["ours"] is not None and r["ours"] > 0
        assert r["reference"] is not None and r["reference"] > 0
        assert r["met"] in (True, False, None)
        # The memory rows' reference is the 300 B target; every other row here is measured.
        want = "target" if r["scenario"] == "6 memory" else "measured"
        assert r["reference_kind"] == want, r["metric"]
        # Scenarios 1, 2 and 7 ran a pure-Python node beside the compiled one.
        if r["scenario"] in (RPC, BATCH, "7 durable vs Redis AOF"):
            assert r["pure"] > 0 and r["pure_ratio"] > 0, r["metric"]
            assert ("NOT compiled" in r["metric"]) is not meter.BUILD.compiled
            rounds = r["detail"].get("rounds_ours_ops") or r["detail"].get("rounds_ours")
            assert rounds is None or len(rounds) % 3 == 0  # each side first as often
        else:
            assert r["pure"] is None and r["pure_ratio"] is None
    memory = [r for r in doc["rows"] if r["scenario"] == "6 memory"]
    assert len(memory) == 2 and "over the wire" in memory[0]["metric"]
    assert memory[0]["met"] in (True, False) and memory[1]["met"] is None  # the table: context
    pipelined = [r for r in doc["rows"] if r["scenario"] == RPC and r["unit"] == "ops/s"][-1]
    assert "pipelined 16" in pipelined["metric"] and pipelined["target"] == ">= 0.7x Redis"
    (many,) = [r for r in doc["rows"] if r["scenario"] == BATCH]
    assert many["detail"]["distinct_keys_per_conn"] == 100
    rpc = [r for r in doc["rows"] if r["unit"] == "ops/s"]
    assert all(r["detail"]["errors"] == 0 for r in rpc)
    durable = [r for r in rpc if r["scenario"].startswith("7")]
    assert len(durable) == 2 * len(SMOKE.durable_configs)
    assert {
        (r["detail"]["node_durability"], r["detail"]["redis_appendfsync"]) for r in durable
    } == {
        ("fsync", "always"),
        ("interval", "everysec"),
    }
    assert all(r["detail"]["redis_appendonly"] for r in durable)
    metrics = [r for r in doc["rows"] if r["scenario"] == METRICS]
    assert [r["metric"].split(",")[0] for r in metrics] == [
        "cost: node CPU per track with metrics' added CPU",
        "node CPU per track end to end",
        "track",
    ]
    cost = metrics[0]
    assert cost["target"] == "<= 1.03x metrics off" and cost["detail"]["errors"] == 0
    assert cost["detail"]["node_cpu_us_per_request_off"] > 0
    assert cost["detail"]["server_path_ns_off"] > 0 and cost["detail"]["server_path_ns_on"] > 0
    assert metrics[-1]["detail"]["scrapes"] >= 1 and metrics[-1]["detail"]["scrape_bytes"] > 0
    for r in durable:  # the node really logged, in the mode asked for
        assert r["detail"]["node_reported_durability"] == r["detail"]["node_durability"]
        assert r["detail"]["node_wal"]["records"] > 0 and r["detail"]["node_wal"]["failures"] == 0
        assert "no log" not in r["metric"]
    text = out.getvalue()
    assert "300.0 (target)" in text
    assert "| scenario" in text and "track vs INCR" in text and "memory" in text
    assert "[" in text.splitlines()[0]  # progress lines come first, with elapsed time
    assert "beside" not in doc and "ours/" not in text  # no --beside: no columns for it


def test_table_and_chart_render(tmp_path: Path) -> None:
    rows = [
        Row(
            "1 track vs Redis",
            "track vs INCR, 1 conn",
            "ops/s",
            10.0,
            20.0,
            0.5,
            ">= 0.8x",
            False,
            {
                "connections": 1,
                "depth": 1,
                "ours_p50_us": 1.0,
                "ours_p99_us": 2.0,
                "redis_p50_us": 1.0,
                "redis_p99_us": 1.5,
            },
        ),
        Row(
            "5 convergence",
            "3 nodes",
            "ms",
            None,
            None,
            None,
            "p99 <= tick + 20 ms",
            None,
            {"status": "not measured yet"},
        ),
        # Scenario 10's throughput rows have no Redis latencies: not in scenario 1's panel.
        Row(QUOTAS, "track, strict vs fast", "ops/s", 9.0, 10.0, 0.9, ">= 0.8x", True, {}),
    ]
    text = report.table(rows)
    assert text.count("\n") == 4 and "not measured yet" in text and "NO" in text
    png = report.chart(rows, tmp_path / "c.png", "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sides_take_turns_going_first() -> None:
    ran: list[str] = []

    def side(name: str) -> Callable[[], str]:
        def run() -> str:
            ran.append(name)
            return name.upper()

        return run

    for r in range(3):
        assert in_turn(r, side("a"), side("b")) == ["A", "B"]
    assert ran == ["a", "b", "b", "a", "a", "b"]
    ran.clear()
    for r in range(3):
        assert in_turn(r, side("a"), side("b"), side("c")) == ["A", "B", "C"]
    assert ran == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


def test_batch_sides_count_on_the_same_keys() -> None:
    """Scenario 2: per connection, the node's track_many items and Redis' pipelined INCRs
    cover the same 100 names (``bench-<i>`` / ``f<j>``, joined by ``:`` for Redis)."""
    many = Load("meter", "x", "track_many", 2, 2, items=100)
    incr = Load("redis", "x", "incr", 2, 200, keys=100)
    node_keys: list[str] = []
    for _, _, _, params in msgpack.Unpacker(io.BytesIO(meter_frames(many, 1))):
        node_keys += [f"{t}:{f}" for t, f, _ in params[0]]
    redis_keys = [
        line.decode() for line in redis_frames(incr, 1).split(b"\r\n") if b"bench" in line
    ]
    assert len(node_keys) == len(redis_keys) == 200
    assert sorted(node_keys) == sorted(redis_keys)
    assert len(set(node_keys)) == 100


@pytest.mark.dynamodb
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_smoke_scale_counts_exactly(tmp_path: Path) -> None:
    """Scenario 8 at smoke size: every row measured, every answer the expected total, every
    key seeded on demand, and the totals stored exactly the units acknowledged."""
    sz = SMOKE.scale
    out = io.StringIO()
    doc = run(SMOKE, ["scale"], results_dir=tmp_path, out=out)
    assert doc["failures"] == {}
    rows = doc["rows"]
    assert {r["scenario"] for r in rows} == {SCALE}
    conv = [r for r in rows if r["metric"].startswith(("convergence under load", "gossip "))]
    rows = [r for r in rows if r not in conv]
    for r in rows:
        assert "status" not in r["detail"], (r["metric"], r["detail"])
        assert r["ours"] is not None and r["ours"] > 0, r["metric"]
        assert r["reference"] is not None and r["reference"] > 0, r["metric"]
        assert r["ratio"] is not None and r["ratio"] > 0, r["metric"]
    ddb = [r for r in rows if r["metric"].startswith("DynamoDB")]
    sqlite = [r for r in rows if r["metric"].startswith("SQLite")]
    fom = [r for r in rows if r["metric"].startswith("first of the month")]
    assert len(ddb) == 1 and len(sqlite) == 3 and len(fom) == 2 * len(read_ahead_modes(SMOKE))
    assert len(rows) == len(ddb) + len(sqlite) + len(fom)

    # 1: the node side against a measured bare loop, every key read on demand and stored once.
    (d,) = ddb
    assert d["reference_kind"] == "measured" and d["met"] in (True, False)
    dd = d["detail"]
    assert len(dd["rounds_ours"]) == len(dd["rounds_bare"]) == sz.ddb_rounds
    assert all(x > 0 for x in dd["rounds_ours"] + dd["rounds_bare"])
    assert [s["on_demand"] for s in dd["seeding_per_round"]] == [sz.ddb_keys] * sz.ddb_rounds
    assert all(s["failed_reads"] == 0 and s["reads"] > 0 for s in dd["seeding_per_round"])
    assert dd["errors"] == dd["nil_answers"] == dd["wrong_answers"] == 0
    assert dd["tracked_items"] == sz.ddb_keys * sz.ddb_rounds
    assert dd["stored_total"] == dd["tracked_items"] and dd["stored_exact"]

    # 2: against the 50,000 keys/s target, and warm beside it; every key read from the file.
    cold, *context = sqlite
    assert cold["reference_kind"] == "target" and cold["reference"] == 50_000
    assert all(r["reference_kind"] == "measured" and r["met"] is None for r in context)
    sd = cold["detail"]
    sides = 2 * sz.sqlite_rounds  # a default node and a deferred-flush node per round
    assert [s["on_demand"] for s in sd["seeding_per_side"]] == [sz.sqlite_keys] * sides
    assert len(sd["rounds_warm_items_per_s"]) == sz.sqlite_rounds
    assert len(sd["rounds_deferred_flush_cold_keys_per_s"]) == sz.sqlite_rounds
    assert sd["errors"] == sd["nil_answers"] == sd["wrong_answers"] == 0  # answers: stored + 1
    assert sd["stored_each_want"] == 7 + 3 * sz.sqlite_rounds  # cold + warm, and cold
    assert sd["stored_total"] == sz.sqlite_keys * sd["stored_each_want"] and sd["stored_exact"]

    # 3: the month really ended under load on every node, and nothing was lost across it.
    for r in fom:
        assert r["reference_kind"] == "target" and r["reference"] == 100.0
    for r in fom[::2]:
        assert "after the boundary" in r["metric"]
        for g in r["detail"]["runs"]:
            assert g["window"]["calls"] > 0 and g["before"]["calls"] > 0
            assert g["unanswered"] == g["errors"] == g["nil_answers"] == 0
            assert g["calls_not_fully_counted"] == 0
            assert g["acked_items"] > 3 * sz.rollover_keys  # the warm-up, then the load
            assert g["stored_total"] == g["acked_items"] and g["stored_exact"]
            assert 0 < g["stored_total_new_period"] < g["stored_total"]
            assert g["boundary"].split(" -> ")[0] != g["boundary"].split(" -> ")[1]
            ahead = sum(x["prefetched"] for x in g["seeding"]["whole_load"])
            waited = sum(x["on_demand"] for x in g["seeding"]["window"])
            if "read-ahead on" in r["metric"]:
                assert ahead > 0  # next month's keys were read ahead
            elif "read-ahead off" in r["metric"]:
                assert ahead == 0 and waited > 0  # and read when asked for, after the end
    # 4: convergence under load: for each size a visibility row, gossip KB/s and CPU share;
    # the probe saw every unit, nothing was skipped or lost, and the views agreed after.
    assert len(conv) == 6, [r["metric"] for r in conv]
    judged, kb, share, report, kb2, share2 = conv
    assert judged["reference_kind"] == "target" and judged["reference"] == 130.0
    assert f"{sz.conv_keys:,} keys" in judged["metric"]
    assert f"{sz.conv_keys_report:,} keys" in report["metric"] and report["reference"] is None
    for r in (judged, report):
        assert r["ours"] is not None and r["ours"] > 0
        for g in r["detail"]["runs"]:
            assert g["samples"] > 0 and g["anomalies"] == g["unseen_within_30s"] == 0
            assert g["load_unanswered"] == g["load_errors"] == g["warmup_wrong_answers"] == 0
            assert g["views_agree_after_load"]
            for n in g["per_node"]:
                assert n["deltas_received_per_s"] > 0 and n["deltas_skipped"] == 0
                assert n["dropped"] == n["failed"] == n["gaps"] == n["rejected"] == 0
                assert n["encode_cpu_share"] is not None and n["apply_cpu_share"] is not None
    for r in (kb, kb2, share, share2):
        assert r["ours"] is not None and r["ours"] > 0 and r["met"] is None
    text = out.getvalue()
    assert "8 scale" in text and "50,000 (target)" in text


@pytest.mark.dynamodb
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_smoke_quotas_admits_exactly(tmp_path: Path) -> None:
    """Scenario 10 at smoke size (about half a minute: DynamoDB Local and four clusters):
    both sides of every throughput row measured without errors, the strict burst admitted
    exactly its limit, the fast overshoot judged against its bound, the strict one 0."""
    q = SMOKE.quotas
    doc = run(SMOKE, ["quotas"], results_dir=tmp_path, out=io.StringIO())
    assert doc["failures"] == {}
    rows = doc["rows"]
    assert {r["scenario"] for r in rows} == {QUOTAS}
    thr = [r for r in rows if r["unit"] == "ops/s" and "strict vs fast" in r["metric"]]
    far = [r for r in rows if "far from the limit" in r["metric"]]
    assert len(thr) == len(far) == len(q.one_node) + len(q.three_nodes)
    assert [r["detail"]["nodes"] for r in thr] == [1] * len(q.one_node) + [3] * len(q.three_nodes)
    for r in thr:
        assert r["target"] == ">= 0.8x fast" and r["met"] in (True, False)
        assert r["ours"] > 0 and r["reference"] > 0 and r["detail"]["errors"] == 0
    # Credit-metered against plain, on the same clusters.
    credit = [r for r in rows if r["unit"] == "ops/s" and "credit-metered" in r["metric"]]
    assert [r["detail"]["nodes"] for r in credit] == [r["detail"]["nodes"] for r in thr]
    for r in credit:
        assert r["target"] == ">= 0.8x plain" and r["met"] in (True, False)
        assert r["ours"] > 0 and r["reference"] > 0 and r["detail"]["errors"] == 0
    for r in far:
        assert r["detail"]["admitted_units"] > 0 and r["detail"]["strict_errors"] == 0
        assert r["ours"] == 1000 * r["detail"]["strict_writes"] / r["detail"]["admitted_units"]
    admitted, writes = [r for r in rows if r["metric"].startswith("strict burst")]
    assert admitted["ours"] == admitted["reference"] == q.burst_limit and admitted["met"]
    assert writes["ours"] > 0 and writes["detail"]["strict_writes"] > 0
    assert writes["detail"]["enforcement"] == "strict"
    fast = [r for r in rows if r["metric"].startswith("fast overshoot")]
    assert [r["detail"]["tick_ms"] for r in fast] == list(q.overshoot_ticks)
    for r in fast:
        assert r["detail"]["enforcement"] == "fast" and r["reference_kind"] == "target"
        assert r["ours"] == r["detail"]["admitted"] - q.overshoot_limit
    (strict,) = [r for r in rows if r["metric"].startswith("strict overshoot")]
    assert strict["ours"] == 0 and strict["met"] and strict["detail"]["enforcement"] == "strict"
    assert strict["detail"]["admitted"] == q.overshoot_limit
    # Part 4: near a strict limit, against the seeds' design (each round of both sides
    # admitted exactly the limit, or the part fails).
    near = [r for r in rows if "near the limit" in r["metric"]]
    assert [("hierarchical" in r["metric"], r["metric"].split(",")[1].strip()) for r in near] == [
        (False, "p99"), (False, "max"), (True, "p99"), (True, "max")
    ]  # fmt: skip
    for r in near:
        assert r["ours"] > 0 and r["reference"] > 0 and r["target"] == "<= 1.0x"
        assert (
            r["detail"]["ours"]["admitted"] == [r["detail"]["ours"]["admitted"][0]] * q.near_rounds
        )
        assert r["detail"]["ours"]["calls"] > r["detail"]["ours"]["admitted"][0]  # refusals timed


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_smoke_fanout_receives_every_simulated_peers_frames(tmp_path: Path) -> None:
    """Scenario 14 at smoke size: the node received the simulated peers' frames signed and in
    sequence (no gap, none refused), applied every delta to its warm keys, showed every probe
    unit, and the three rows of each peer count are there; then, sharded and tenant-affine,
    the node listened to its group's shards only and received fewer deltas, none lost."""
    fs = SMOKE.fanout
    doc = run(SMOKE, ["fanout"], results_dir=tmp_path, out=io.StringIO())
    assert doc["failures"] == {}
    rows, affine, transport = doc["rows"][:-3], doc["rows"][-3:-1], doc["rows"][-1]
    assert {r["scenario"] for r in doc["rows"]} == {FANOUT} and len(rows) == 3 * len(fs.peers)
    d = affine[0]["detail"]
    assert d["gaps"] == 0 and not any(d["rejected"].values()), d
    assert d["shards_listened"] == 2 and 0 < d["deltas_per_s"] < d["unsharded_deltas_per_s"], d
    assert d["probes"][0] == d["probes"][1] > 0, d
    t = transport["detail"]  # (3 nodes on a Redis Cluster, 3 on one redis-server)
    assert t["samples"] == {"server": fs.cluster_samples, "cluster": fs.cluster_samples}, t
    assert t["anomalies"] == {"server": [], "cluster": []} and transport["ratio"] > 0, t
    for r in rows[::3]:
        d = r["detail"]
        assert d["peers"] in fs.peers and d["gaps"] == 0 and not any(d["rejected"].values()), d
        assert d["deltas_skipped"] == 0 and d["deltas_per_s"] > 0 and d["simulator_kept_up"], d
        seen, sent = d["probes"]
        assert sent > 0 and seen == sent, d
    assert all(r["ours"] is not None and r["reference"] > 0 for r in rows)


@pytest.mark.slow
def test_smoke_http_measures_the_api_beside_a_bare_aiohttp_server(tmp_path: Path) -> None:
    """Scenario 15 at smoke size: every shape's rows (HTTP vs bare, CPU per request, HTTP vs
    RPC) and the probes' rows, no request answered with an error on any side, each side's
    CPU per request measured."""
    doc = run(SMOKE, ["http"], results_dir=tmp_path, out=io.StringIO())
    assert doc["failures"] == {}
    rows = doc["rows"]
    assert {r["scenario"] for r in rows} == {HTTP}
    shapes = CONFIGS["smoke"]
    assert len(rows) == 3 * len(shapes) + 2
    for r in rows[: 3 * len(shapes)]:
        d = r["detail"]
        assert d["errors"] == 0, d
        assert all(x > 0 for x in d["rounds_http_cpu_us"] + d["rounds_bare_cpu_us"]), d
        assert r["ours"] > 0 and r["reference"] > 0
    assert rows[-2]["detail"]["errors"] == 0 and rows[-1]["detail"]["errors"] == 0
    assert rows[-1]["ours"] > 0  # /metrics scrapes
