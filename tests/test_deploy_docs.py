"""The deployment examples under ``docs/deploy/`` stay true to the code.

Each file is parsed as what it is (a systemd unit, Kubernetes YAML, Grafana JSON, Prometheus
rules), and every setting, command, HTTP path and metric name it uses must exist: settings
are loaded by the node's own configuration loader, commands are parsed by ``meter``'s own
argument parser, metric names are looked up in a scrape of a real node.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from meter.cli.main import _parser
from meter.config import NodeConfig, env_name, load
from meter.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "docs" / "deploy"

#: Seconds a node needs after its drain budget to close connections and exit.
CLOSE_S = 2
#: Seconds the pod's grace period leaves the app to stop before meter (a native sidecar) gets
#: SIGTERM: the example says the grace period covers both.
APP_STOP_S = 15


def drain_budget(cfg: NodeConfig) -> float:
    """The longest SIGTERM can take (docs/operations.md, "Stopping")."""
    return cfg.server.request_drain_timeout_s + cfg.flush.drain_timeout_s + CLOSE_S


def load_env(env: dict[str, str]) -> NodeConfig:
    """The node's configuration from ``env`` alone; a ConfigError fails the test."""
    try:
        return load(file=None, env=env, flags={})
    except ConfigError as exc:
        pytest.fail(f"a deployment example sets a bad setting: {exc.message}")


def check_serve(argv: list[str]) -> None:
    assert argv[0].rsplit("/", 1)[-1] == "meter", argv
    args = _parser().parse_args(argv[1:])  # exits (SystemExit) on an unknown flag
    assert args.command == "serve"


# -- systemd --------------------------------------------------------------------------------


def unit(path: Path) -> dict[str, list[str]]:
    """``Key=value`` lines of a unit file (keys may repeat), comments skipped."""
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key, []).append(value)
    return out


def test_the_systemd_unit_runs_a_node_that_starts_and_drains_in_time() -> None:
    u = unit(DEPLOY / "meter.service")
    env = dict(v.split("=", 1) for v in u["Environment"])
    cfg = load_env(env)
    check_serve(shlex.split(u["ExecStart"][0]))
    assert float(u["TimeoutStopSec"][0]) >= drain_budget(cfg)
    # The socket and the data dir live in the directories systemd makes for the service.
    assert str(cfg.server.socket).startswith("/run/" + u["RuntimeDirectory"][0] + "/")
    assert str(cfg.data_dir) == "/var/lib/" + u["StateDirectory"][0]
    # The node can give the socket to the clients' group only if it is in that group.
    assert cfg.server.socket_group in u["SupplementaryGroups"][0].split()
    # Bad configuration exits 2 (docs/operations.md): restarting it would only loop.
    assert u["RestartPreventExitStatus"] == ["2"]
    assert u["KillSignal"] == ["SIGTERM"]


# -- Kubernetes -----------------------------------------------------------------------------


def pod_spec() -> dict[str, Any]:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text()))
    (deployment,) = (d for d in docs if d and d.get("kind") == "Deployment")
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


def container_env(c: dict[str, Any]) -> dict[str, str]:
    # A value from a Secret is not in the file: any valid string stands for it.
    return {e["name"]: e.get("value", "from-a-secret") for e in c.get("env", [])}


def mounted_at(c: dict[str, Any], path: str) -> str:
    """The volume that holds ``path`` in container ``c``."""
    for m in c["volumeMounts"]:
        if path.startswith(m["mountPath"].rstrip("/") + "/") or path == m["mountPath"]:
            return str(m["name"])
    pytest.fail(f"{path} is on no volume of container {c['name']}")


def test_the_kubernetes_sidecar_shares_its_socket_and_drains_in_time() -> None:
    spec = pod_spec()
    (meter,) = (c for c in spec["initContainers"] if c["name"] == "meter")
    # A native sidecar: started before the app, stopped after it has exited.
    assert meter["restartPolicy"] == "Always"
    check_serve(meter["command"])
    cfg = load_env(container_env(meter))
    assert spec["terminationGracePeriodSeconds"] >= APP_STOP_S + drain_budget(cfg)
    socket = str(cfg.server.socket)
    volume = mounted_at(meter, socket)
    assert "emptyDir" in next(v for v in spec["volumes"] if v["name"] == volume)
    mounted_at(meter, str(cfg.data_dir))
    for app in spec["containers"]:
        assert container_env(app)["METER_SOCKET"] == socket
        assert mounted_at(app, socket) == volume
    # The probes reach the node's HTTP listener, on all interfaces (the kubelet probes the pod IP).
    assert cfg.metrics.address is not None
    host, port = cfg.metrics.address
    assert host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in meter["ports"]}
    for probe in probes(meter).values():
        assert ports[probe["httpGet"]["port"]] == int(port)


def probes(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in c.items() if k.endswith("Probe")}


# -- prose ----------------------------------------------------------------------------------

#: Environment variables the docs may name that are not settings (the tests' own knobs).
NOT_SETTINGS = {
    "METER_CONFIG",
    "METER_PURE_PYTHON",
    "METER_FUZZ_FRAMES",
    "METER_FUZZ_SEED",
    "METER_EXPORT_COUNTERS",
    "METER_DIFF_FRAMES",
    "METER_DIFF_LIMIT_CALLS",
}


def test_every_environment_variable_the_docs_name_is_a_setting() -> None:
    from meter.config import SETTING_NAMES

    known = {env_name(s) for s in SETTING_NAMES} | NOT_SETTINGS
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *DEPLOY.iterdir()]
    named = {
        (f.relative_to(ROOT).as_posix(), v)
        for f in files
        for v in re.findall(r"\bMETER_[A-Z0-9_]*[A-Z0-9]\b", f.read_text())
    }
    assert {(f, v) for f, v in named if v not in known} == set()


# -- metrics: the dashboard and the alerts --------------------------------------------------

#: Series a histogram family adds to its name.
HISTOGRAM_SERIES = ("_bucket", "_count", "_sum")


#: Grafana's variables, replaced by what they stand for so the expressions parse as PromQL.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$instance": ".*"}


def promql(expr: str) -> Any:
    """The parsed expression (Prometheus' grammar: a syntax error fails the test)."""
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    try:
        return promql_parser.parse(expr)
    except ValueError as exc:
        pytest.fail(f"not PromQL: {expr!r}: {exc}")


def selectors(node: Any) -> Iterator[tuple[str | None, set[str]]]:
    """Every series an expression selects: its name and the labels it matches on."""
    kind = type(node).__name__
    if kind == "VectorSelector":
        yield node.name, {m.name for m in node.matchers.matchers}
    elif kind == "MatrixSelector":
        yield from selectors(node.vector_selector)
    elif kind == "Call":
        for arg in node.args:
            yield from selectors(arg)
    elif kind == "BinaryExpr":
        yield from selectors(node.lhs)
        yield from selectors(node.rhs)
    elif kind in ("AggregateExpr", "ParenExpr", "UnaryExpr", "SubqueryExpr"):
        yield from selectors(node.expr)


def grouping(node: Any) -> set[str]:
    """Every label an expression groups by (``by``/``without``) or matches on (``on``)."""
    kind = type(node).__name__
    out: set[str] = set()
    if kind == "AggregateExpr":
        if node.modifier is not None:
            out |= set(node.modifier.labels)
        out |= grouping(node.expr)
    elif kind == "BinaryExpr":
        if node.modifier is not None and node.modifier.matching is not None:
            out |= set(node.modifier.matching.labels)
        out |= grouping(node.lhs) | grouping(node.rhs)
    elif kind == "Call":
        for arg in node.args:
            out |= grouping(arg)
    elif kind in ("ParenExpr", "UnaryExpr", "SubqueryExpr"):
        out |= grouping(node.expr)
    return out


def metric_names(expr: str) -> set[str]:
    """The meter series an expression reads (Prometheus' own, such as ``up``, left out)."""
    return {n for n, _ in selectors(promql(expr)) if n and n.startswith("meter_")}


def family(series: str) -> str:
    from meter.ops.metrics import METRIC_NAMES

    if series in METRIC_NAMES:
        return series
    for suffix in HISTOGRAM_SERIES:
        if series.endswith(suffix) and series[: -len(suffix)] in METRIC_NAMES:
            return series[: -len(suffix)]
    pytest.fail(f"{series} is no metric of meter.ops.metrics.METRIC_NAMES")


def dashboard_exprs() -> list[str]:
    import json

    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            # Grafana's label_values(SERIES, LABEL): the series part is PromQL.
            series = re.fullmatch(r"label_values\((.+),\s*[a-z_]+\)", var["query"])
            assert series is not None, var["query"]
            exprs.append(series.group(1))
    return exprs


def alert_rules() -> list[dict[str, Any]]:
    rules = yaml.safe_load((DEPLOY / "alerts.yaml").read_text())
    return [r for g in rules["groups"] for r in g["rules"]]


def test_the_dashboard_and_the_alerts_use_only_metrics_the_node_exports() -> None:
    exprs = dashboard_exprs() + [r["expr"] for r in alert_rules()]
    used = {family(s) for e in exprs for s in metric_names(e)}
    assert len(used) >= 15, used  # the parsing found them


def aggregated(node: Any) -> bool:
    """Whether a side of a binary operation keeps fewer labels than its series (an
    aggregation, under any comparisons and parentheses)."""
    kind = type(node).__name__
    if kind == "AggregateExpr":
        return True
    if kind == "BinaryExpr":
        return aggregated(node.lhs) or aggregated(node.rhs)
    if kind == "ParenExpr":
        return aggregated(node.expr)
    if kind == "Call":
        return any(aggregated(a) for a in node.args)
    return False


def unmatched_set_operations(node: Any) -> list[str]:
    """``and``/``or``/``unless`` between an aggregated side and a side that is not, without
    ``on``/``ignoring``: they match on every label, so (the job and instance labels missing on
    one side) such a rule never fires."""
    kind = type(node).__name__
    out: list[str] = []
    if kind == "BinaryExpr":
        matching = node.modifier.matching if node.modifier is not None else None
        if (
            str(node.op) in ("and", "or", "unless")
            and matching is None
            and aggregated(node.lhs) != aggregated(node.rhs)
        ):
            out.append(str(node))
        out += unmatched_set_operations(node.lhs) + unmatched_set_operations(node.rhs)
    elif kind in ("AggregateExpr", "ParenExpr", "UnaryExpr", "SubqueryExpr"):
        out += unmatched_set_operations(node.expr)
    elif kind == "Call":
        for arg in node.args:
            out += unmatched_set_operations(arg)
    return out


@pytest.mark.parametrize(
    ("expr", "bad"),
    [
        ("sum by (instance) (rate(a_total[5m])) > 0 and b > 0", True),
        ("rate(a_total[5m]) > 0 and on (instance) b > 0", False),
        ("sum by (instance) (a) > 0 and on (instance) b > 0", False),
        ("a > 0 and b > 0", False),
    ],
)
def test_the_set_operation_check_catches_rules_that_cannot_fire(expr: str, bad: bool) -> None:
    assert bool(unmatched_set_operations(promql(expr))) is bad


def test_no_rule_or_chart_matches_an_aggregate_on_every_label() -> None:
    exprs = dashboard_exprs() + [r["expr"] for r in alert_rules()]
    assert [bad for e in exprs for bad in unmatched_set_operations(promql(e))] == []


def test_every_alert_is_explained_in_the_deployment_guide() -> None:
    guide = (ROOT / "docs" / "deployment.md").read_text()
    headings = set(re.findall(r"^### (\w+)$", guide, re.M))
    rules = alert_rules()
    assert {r["alert"] for r in rules} == headings
    for r in rules:
        assert r["labels"]["severity"] in ("page", "ticket")
        assert r["annotations"]["runbook"] == f"docs/deployment.md#{r['alert'].lower()}"
        assert r["annotations"]["summary"]


def labels_used(expr: str, legend: str = "") -> set[str]:
    """Label names an expression groups by, matches on, or its legend prints."""
    tree = promql(expr)
    names = grouping(tree)
    for _, matched in selectors(tree):
        names |= matched
    names |= set(re.findall(r"\{\{\s*(?:\$labels\.)?([a-z_]+)\s*\}\}", legend))
    return names


#: Labels Prometheus adds to every series it scrapes, and a histogram's own.
SCRAPE_LABELS = {"instance", "job", "le"}


@pytest.mark.redis
def test_the_labels_the_dashboard_and_alerts_use_are_on_a_real_nodes_metrics(
    redis_factory: Any, cluster_name: str, tmp_path: Path
) -> None:
    """Scrape a clustered node that counted and refused something: every label an expression
    groups or filters by is on the family it names (a typo would chart nothing)."""
    import json

    from prometheus_client.parser import text_string_to_metric_families

    from tests.support.nodes import NodeProcess, raw_call, short_tmpdir
    from tests.test_metrics_http import http

    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    uses = [(t["expr"], t.get("legendFormat", "")) for p in dash["panels"] for t in p["targets"]]
    uses += [(r["expr"], r["annotations"]["summary"]) for r in alert_rules()]
    workdir = short_tmpdir()
    redis = redis_factory()
    with NodeProcess(
        workdir,
        METER_REDIS_URL=redis.url,
        METER_CLUSTER_NAME=cluster_name,
        METER_METRICS_ADDRESS="127.0.0.1:0",
    ) as node:
        address = node.call("status")["metrics"]["address"]
        # Every probe of the Kubernetes example passes on a node that is up and counting.
        (meter,) = (c for c in pod_spec()["initContainers"] if c["name"] == "meter")
        for kind, probe in probes(meter).items():
            assert http(address, probe["httpGet"]["path"])[0] == 200, kind
        raw_call(node.socket, "track", "acme", "api", 1)
        raw_call(node.socket, "reserve", "acme", "api", 5, {"limit": 1})  # limit_exceeded
        status, text = http(address, "/metrics")
        assert status == 200
    labels: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels.setdefault(family(s.name), set()).update(s.labels)
    for expr, legend in uses:
        fams = {family(s) for s in metric_names(expr)}
        have = set.union(SCRAPE_LABELS, *(labels.get(f, set()) for f in fams))
        assert labels_used(expr, legend) <= have, (expr, legend, fams)
