"""fleet.yaml: app entries validated as apps.yaml's, the fleet's own keys, the agent's node keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.config.schema import ConfigError
from orchestrator.fleet.config import load_fleet_config, parse_fleet_config

GOOD = {"node": {"backend": "cpu"}, "apps": [{"name": "cls", "model": "mobilenet_v2", "slo_ms": 50, "rate_rps": 20},
                                             {"name": "det", "model": "resnet18", "slo_ms": 80, "standby": False}]}


def test_a_good_fleet_yaml_loads(tmp_path: Path) -> None:
    p = tmp_path / "fleet.yaml"
    p.write_text("node: {backend: cpu}\napps:\n  - {name: cls, model: mobilenet_v2, slo_ms: 50, rate_rps: 20}\n")
    cfg = load_fleet_config(p)
    assert cfg.apps[0]["rate_rps"] == 20 and cfg.node_entry(cfg.apps[0]) == {"name": "cls", "model": "mobilenet_v2",
                                                                             "slo_ms": 50}
    assert parse_fleet_config(GOOD).suspect_after_s == 1.0
    # The machines outlive a dead head by a day, not Ray's default minute.
    assert parse_fleet_config(GOOD).ray.system_config() == {"gcs_rpc_server_reconnect_timeout_s": 86400}
    assert parse_fleet_config({**GOOD, "ray": {"head_outage_s": 600}}).ray.system_config() == {
        "gcs_rpc_server_reconnect_timeout_s": 600}


@pytest.mark.parametrize(("change", "message"), [
    ({"apps": [{"name": "a", "model": "resnet18", "slo_ms": -1}]}, "apps[0].slo_ms"),
    ({"apps": [{"name": "a", "model": "resnet18", "slo_ms": 5, "rate_rps": 0}]}, "apps[0].rate_rps: must be a positive"),
    ({"apps": [{"name": "a", "model": "resnet18", "slo_ms": 5, "gpu": 1}]}, "apps[0].gpu: the fleet's planner"),
    ({"apps": [{"name": "a", "model": "resnet18", "slo_ms": 5}, {"name": "a", "model": "resnet18", "slo_ms": 5}]},
     "apps[1].name: duplicate name 'a'"),
    ({"node": {"http_port": 8000}}, "set by each machine's agent"),
    ({"suspect_after_s": 0}, "suspect_after_s"),
    ({"pings": 3}, "pings"),
    ({"ray": {"head_outage_s": 5}}, "ray.head_outage_s"),
])
def test_a_bad_fleet_yaml_names_the_key(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=r"fleet\.yaml") as e:
        parse_fleet_config({**GOOD, **change}, source="fleet.yaml")
    assert message in str(e.value)


def test_the_bundled_fleet_yaml_is_valid() -> None:
    cfg = load_fleet_config(Path(__file__).parents[3] / "examples" / "fleet.yaml")
    assert cfg.ray.address is None and [a["name"] for a in cfg.apps] == ["classify"]


def test_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="No such file"):
        load_fleet_config(tmp_path / "nope.yaml")
