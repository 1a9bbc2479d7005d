"""gpuprims-fleet: a bad fleet.yaml is refused before Ray starts; the commands are there."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("ray", reason="the fleet extra is not installed (pip install -e '.[fleet]')")

from orchestrator.fleet import cli


def test_a_bad_fleet_yaml_is_refused_with_the_key(tmp_path: Path) -> None:
    p = tmp_path / "fleet.yaml"
    p.write_text("apps:\n  - {name: a, model: resnet18, slo_ms: 0}\n")
    r = CliRunner().invoke(cli.main, ["start", str(p)])
    assert r.exit_code == 1 and "apps[0].slo_ms" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(cli.main, ["start", str(tmp_path / "nope.yaml")])
    assert r.exit_code == 1 and "No such file" in r.output


def test_a_local_fleet_starts_ray_so_its_machines_outlive_a_dead_head(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "fleet.yaml"
    p.write_text("ray: {head_outage_s: 3600}\napps: []\n")
    seen: dict = {}

    def init(**kw: object) -> None:
        seen.update(kw)
        raise RuntimeError("stopped before Ray starts")

    monkeypatch.setattr(cli, "secure_ray_env", lambda token_file: None)
    monkeypatch.setattr(cli.ray, "init", init)
    r = CliRunner().invoke(cli.main, ["start", str(p)])
    assert isinstance(r.exception, RuntimeError)
    assert seen["_system_config"] == {"gcs_rpc_server_reconnect_timeout_s": 3600}
    assert seen["include_dashboard"] is False


def test_the_commands_are_there() -> None:
    r = CliRunner().invoke(cli.main, ["--help"])
    assert r.exit_code == 0
    for cmd in ("start", "status", "stop", "drain"):
        assert cmd in r.output


def test_the_ray_token_is_kept_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "TOKEN_FILE", tmp_path / "sub" / "fleet.token")
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.setenv(var, "x")  # records the variable's state before the test, restored after it
        monkeypatch.delenv(var)
    cli.secure_ray_env(None)
    token = os.environ["RAY_AUTH_TOKEN"]
    assert os.environ["RAY_AUTH_MODE"] == "token" and len(token) == 64
    assert (tmp_path / "sub" / "fleet.token").stat().st_mode & 0o777 == 0o600
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    cli.secure_ray_env(None)
    assert os.environ["RAY_AUTH_TOKEN"] == token  # the other commands present the same token
    cli.secure_ray_env(str(tmp_path / "given.token"))
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(tmp_path / "given.token")


def test_status_shows_nodes_apps_routes_and_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    st = {"routes": {"version": 4, "apps": {}},
          "nodes": {"a" * 40: {"host": "10.0.0.1", "udp_port": 9000, "http_port": 8000, "gpus": 2, "alive": True,
                               "suspected": True, "draining": False}},
          "apps": {"cls": {"primary": {"node": "a" * 40, "gpu": 1, "gpu_pct": 50, "instances": 1}, "standby": None}},
          "pending": ["big"],
          "node_events": [{"action": "suspect", "node": "a" * 40, "reason": "did not answer pings for 1.20 s"}],
          "decisions": [{"action": "place", "app": "cls", "reason": "gpu_pct from its entry"}]}
    monkeypatch.setattr(cli, "_call", lambda *a: st)
    r = CliRunner().invoke(cli.main, ["status"])
    assert r.exit_code == 0, r.output
    for text in ("routing table version 4", "10.0.0.1:udp 9000", "suspected", "cls: primary aaaaaaaaaaaa/gpu1 1x50%",
                 "no standby", "big: not placed", "did not answer pings", "gpu_pct from its entry"):
        assert text in r.output
