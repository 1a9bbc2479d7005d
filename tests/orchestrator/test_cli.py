from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from orchestrator import cli


def _node_dir(base: Path, name: str) -> Path:
    d = base / name
    d.mkdir(mode=0o700)
    (d / "command.sock").touch()
    return d


def test_finds_the_one_live_node_through_the_current_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("orchestrator.control.runtime_base", lambda: tmp_path)
    d = _node_dir(tmp_path, "run-a")
    (tmp_path / "current").symlink_to(d)
    assert cli._find_run_dir(None) == d.resolve()
    assert cli._find_run_dir(str(tmp_path / "x")) == tmp_path / "x"


def test_refuses_to_guess_between_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("orchestrator.control.runtime_base", lambda: tmp_path)
    with pytest.raises(click.ClickException, match="no running node"):
        cli._find_run_dir(None)
    _node_dir(tmp_path, "run-a")
    _node_dir(tmp_path, "run-b")
    with pytest.raises(click.ClickException, match="several nodes are running"):
        cli._find_run_dir(None)


def test_validate_and_start_refuse_a_bad_config_with_file_and_key(tmp_path: Path) -> None:
    bad = tmp_path / "apps.yaml"
    bad.write_text("node: {backend: cpu}\napps:\n  - {name: a, model: resnet18, slo_ms: -5}\n")
    for command in ("validate", "start"):
        r = CliRunner().invoke(cli.main, [command, str(bad)])
        assert r.exit_code == 1
        assert "apps.yaml" in r.output and "apps[0].slo_ms" in r.output


def test_validate_rejects_unknown_zoo_model(tmp_path: Path) -> None:
    p = tmp_path / "apps.yaml"
    p.write_text("apps:\n  - {name: a, model: resnet51, slo_ms: 50}\n")
    r = CliRunner().invoke(cli.main, ["validate", str(p)])
    assert r.exit_code == 1 and "resnet51" in r.output and "resnet50" in r.output


def test_validate_accepts_the_bundled_examples() -> None:
    root = Path(__file__).resolve().parents[2]
    for name in ("apps.yaml", "apps-paper.yaml", "apps-table3.yaml"):
        r = CliRunner().invoke(cli.main, ["validate", str(root / "examples" / name)])
        assert r.exit_code == 0, r.output
