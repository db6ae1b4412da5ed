"""Configuration: defaults, TOML, environment and flags, and one clear error per bad setting."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from meter.config import SETTING_NAMES, load
from meter.errors import ConfigError


def test_defaults() -> None:
    cfg = load(env={})
    assert cfg.server.socket == Path("./meter.sock")
    assert cfg.data_dir == Path("./.meter")
    assert cfg.storage.kind == "sqlite"
    assert cfg.node_id is None
    assert cfg.flush.interval_ms == 1000
    assert cfg.cluster.gossip_interval_ms == 100
    assert cfg.cluster.redis_url is None
    assert cfg.owner.lease_s == 30


def test_fixed_environment_names() -> None:
    env = {
        "METER_SOCKET": "/tmp/x.sock",
        "METER_DATA_DIR": "/tmp/d",
        "METER_STORAGE": "dynamodb",
        "METER_NODE_ID": "node-1",
        "METER_FLUSH_INTERVAL_MS": "250",
        "METER_GOSSIP_INTERVAL_MS": "50",
        "METER_REDIS_URL": "redis://127.0.0.1:7000/0",
        "METER_DYNAMODB_TABLE": "table1",
        "METER_DYNAMODB_ENDPOINT": "http://127.0.0.1:8000",
    }
    cfg = load(env=env)
    assert cfg.server.socket == Path("/tmp/x.sock")
    assert cfg.data_dir == Path("/tmp/d")
    assert cfg.storage.kind == "dynamodb"
    assert cfg.node_id == "node-1"
    assert cfg.flush.interval_ms == 250
    assert cfg.cluster.gossip_interval_ms == 50
    assert cfg.cluster.redis_url == "redis://127.0.0.1:7000/0"
    assert cfg.storage.dynamodb_table == "table1"
    assert cfg.storage.dynamodb_endpoint == "http://127.0.0.1:8000"


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    file = tmp_path / "meter.toml"
    file.write_text(
        'flush_interval_ms = 10\nstorage = "memory"\nnode_id = "from-file"\n'
        "[feature_periods]\napi = 'day'\n"
    )
    cfg = load(file=file, env={"METER_FLUSH_INTERVAL_MS": "20"}, flags={"node_id": "flag"})
    assert cfg.flush.interval_ms == 20
    assert cfg.storage.kind == "memory"
    assert cfg.node_id == "flag"
    assert cfg.counters.feature_periods == {"api": "day"}


def test_request_drain_timeout_is_a_setting(tmp_path: Path) -> None:
    assert load(env={}).server.request_drain_timeout_s == 5.0
    env = {"METER_REQUEST_DRAIN_TIMEOUT_S": "0.25"}
    assert load(env=env).server.request_drain_timeout_s == 0.25
    file = tmp_path / "m.toml"
    file.write_text("request_drain_timeout_s = 12\n")
    assert load(file=file, env={}).server.request_drain_timeout_s == 12.0


def test_gc_young_threshold_is_a_setting() -> None:
    assert load(env={}).server.gc_young_threshold == 20_000
    assert load(env={"METER_GC_YOUNG_THRESHOLD": "0"}).server.gc_young_threshold == 0
    for bad in ("-1", "abc", "1000001"):
        with pytest.raises(ConfigError) as err:
            load(env={"METER_GC_YOUNG_THRESHOLD": bad})
        assert "gc_young_threshold" in str(err.value)


def test_dynamodb_table_names_dynamodb_accepts_are_taken(tmp_path: Path) -> None:
    for name in ("abc", "meter_counters", "Meter-Counters.prod_2", "t" * 255):
        assert load(env={"METER_DYNAMODB_TABLE": name}).storage.dynamodb_table == name
    file = tmp_path / "m.toml"
    file.write_text('dynamodb_table = "x"\n')
    with pytest.raises(ConfigError, match="DynamoDB's rule") as info:
        load(file=file, env={})
    assert info.value.setting == "dynamodb_table"


def test_config_file_from_environment(tmp_path: Path) -> None:
    file = tmp_path / "m.toml"
    file.write_text("flush_interval_ms = 7\n")
    assert load(env={"METER_CONFIG": str(file)}).flush.interval_ms == 7


@pytest.mark.parametrize(
    ("env", "setting"),
    [
        ({"METER_FLUSH_INTERVAL_MS": "soon"}, "flush_interval_ms"),
        ({"METER_FLUSH_INTERVAL_MS": "0"}, "flush_interval_ms"),
        ({"METER_GOSSIP_INTERVAL_MS": "-5"}, "gossip_interval_ms"),
        ({"METER_STORAGE": "postgres"}, "storage"),
        ({"METER_NODE_ID": "has space"}, "node_id"),
        ({"METER_REDIS_URL": "http://x"}, "redis_url"),
        ({"METER_DYNAMODB_ENDPOINT": "localhost:8000"}, "dynamodb_endpoint"),
        ({"METER_LOG_LEVEL": "LOUD"}, "log_level"),
        ({"METER_FEATURE_PERIODS": "api=week"}, "feature_periods"),
        ({"METER_FEATURE_PERIODS": "api"}, "feature_periods"),
        ({"METER_SOCKET": "/tmp/" + "s" * 120}, "socket"),
        ({"METER_FLUSH_INTERVALMS": "5"}, "METER_FLUSH_INTERVALMS"),
        ({"METER_REQUEST_DRAIN_TIMEOUT_S": "-1"}, "request_drain_timeout_s"),
        ({"METER_REQUEST_DRAIN_TIMEOUT_S": "soon"}, "request_drain_timeout_s"),
        ({"METER_OWNER_LEASE_S": "0.5"}, "owner_lease_s"),
        ({"METER_DYNAMODB_TABLE": "ab"}, "dynamodb_table"),
        ({"METER_DYNAMODB_TABLE": "my table"}, "dynamodb_table"),
        ({"METER_DYNAMODB_TABLE": "counters/prod"}, "dynamodb_table"),
        ({"METER_DYNAMODB_TABLE": "t" * 256}, "dynamodb_table"),
        ({"METER_PERIOD_GRACE_S": "-1"}, "period_grace_s"),
        ({"METER_PERIOD_GRACE_S": "an hour"}, "period_grace_s"),
        ({"METER_PERIOD_GRACE_S": "315360001"}, "period_grace_s"),
        ({"METER_GOSSIP_SHARDS": "0"}, "gossip_shards"),
        ({"METER_GOSSIP_SHARDS": "257"}, "gossip_shards"),
        ({"METER_GOSSIP_SUBSCRIBE": "some"}, "gossip_subscribe"),
        ({"METER_GOSSIP_SUBSCRIBE": "warm"}, "gossip_subscribe"),  # (needs shards)
        (
            {"METER_REDIS_URL": "redis://h:1", "METER_REDIS_CLUSTER_NODES": "h:2"},
            "redis_cluster_nodes",
        ),
    ],
)
def test_bad_settings_name_the_setting(env: dict[str, str], setting: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(env=env)
    assert info.value.setting == setting
    assert setting in info.value.message


@pytest.mark.parametrize(
    ("heartbeat", "timeout"), [("3000", None), ("2500", "5000"), ("1000", "1999")]
)
def test_peer_timeout_must_exceed_two_heartbeats(heartbeat: str, timeout: str | None) -> None:
    """A peer must not be declared dead between two of its heartbeats (one of them lost)."""
    env = {"METER_CLUSTER_HEARTBEAT_MS": heartbeat}
    if timeout is not None:
        env["METER_CLUSTER_PEER_TIMEOUT_MS"] = timeout
    with pytest.raises(ConfigError) as info:
        load(env=env)
    assert info.value.setting == "cluster_peer_timeout_ms"
    assert "cluster_heartbeat_ms" in info.value.message
    ok = load(
        env={"METER_CLUSTER_HEARTBEAT_MS": heartbeat, "METER_CLUSTER_PEER_TIMEOUT_MS": "9000"}
    )
    assert ok.cluster.peer_timeout_ms == 9000


def test_bad_toml(tmp_path: Path) -> None:
    file = tmp_path / "bad.toml"
    file.write_text("flush_interval_ms = [\n")
    with pytest.raises(ConfigError, match="cannot read"):
        load(file=file, env={})
    file.write_text("no_such_setting = 1\n")
    with pytest.raises(ConfigError, match="no_such_setting"):
        load(file=file, env={})
    with pytest.raises(ConfigError, match="does not exist"):
        load(file=tmp_path / "missing.toml", env={})


def _documented_environment() -> dict[str, str]:
    """setting -> environment variable, as the table of docs/configuration.md lists them."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    return dict(re.findall(r"^\| `(\w+)` \| `(METER_\w+)` \|", text, flags=re.M))


def test_cluster_nodes_and_shards_are_settings() -> None:
    c = load(
        env={
            "METER_REDIS_CLUSTER_NODES": "a:7000, b:7001,",
            "METER_GOSSIP_SHARDS": "16",
            "METER_GOSSIP_SUBSCRIBE": "WARM",
        }
    ).cluster
    assert c.redis_cluster_nodes == ("a:7000", "b:7001") and c.gossip
    assert c.gossip_shards == 16 and c.gossip_subscribe == "warm"
    assert not load(env={}).cluster.gossip and load(env={}).cluster.gossip_shards == 1


def test_the_documented_settings_are_the_settings() -> None:
    assert sorted(_documented_environment()) == sorted(SETTING_NAMES)


@pytest.mark.parametrize(("setting", "variable"), sorted(_documented_environment().items()))
def test_every_documented_environment_variable_sets_its_setting(
    setting: str, variable: str
) -> None:
    """The variable the docs name (not one recomputed here) reaches its setting exactly as
    the setting given by name does: the same configuration, or the same error naming it."""
    outcomes: list[object] = []
    for source in ({"env": {variable: "7"}}, {"flags": {setting: "7"}}):
        try:
            outcomes.append(load(**source))  # type: ignore[arg-type]
        except ConfigError as exc:
            assert exc.setting == setting, (variable, exc.setting, exc.message)
            outcomes.append(exc.message)
    assert outcomes[0] == outcomes[1], (variable, outcomes)
    assert outcomes[0] != load(env={}), f"{variable}=7 changed nothing"


def test_log_format_is_text_or_json() -> None:
    assert load(env={}).log_format == "text"
    assert load(env={"METER_LOG_FORMAT": "JSON"}).log_format == "json"
    with pytest.raises(ConfigError) as err:
        load(env={"METER_LOG_FORMAT": "xml"})
    assert err.value.setting == "log_format" and "text or json" in str(err.value)
