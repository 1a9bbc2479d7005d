"""bench/footprint: a tiny run of what needs no node writes a well-formed result to a private directory.

The run with a node (`python -m bench.footprint --quick`) starts a real node and loads a model; it is
the lead's to run on a quiet machine, like every bench. Figures are reported, never asserted here.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from bench import footprint

ROOT = Path(__file__).resolve().parents[2]


def test_a_quick_run_without_a_node_reports_the_cli_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["footprint.py", "--quick", "--no-node", "--out-dir", str(tmp_path)])
    footprint.main(["--quick", "--no-node", "--out-dir", str(tmp_path), "--name", "fp-test"])
    doc = json.loads((tmp_path / "fp-test.json").read_text())
    s = doc["summary"]
    assert doc["experiment"] == "footprint" and "load_avg_before" in doc["machine"]
    assert s["status_nonode_wall_s"] > 0 and s["stop_nonode_wall_s"] > 0 and s["cli_import_s"] > 0
    assert s["status_heavy_modules"] == [] and s["cli_imports_torch"] is False
    assert len(doc["samples"]["status_nonode_wall_s"]) == 1 and len(doc["samples"]["cli_import_s"]) == 1
    assert "node_rss_mb" not in s  # --no-node starts none
    assert str(tmp_path / "fp-test.json") in capsys.readouterr().out
    assert not (ROOT / "bench" / "results" / "cpu-2core" / "fp-test.json").exists()


def test_the_status_probe_names_the_heavy_modules_it_finds(tmp_path: Path) -> None:
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(xdg)}
    assert footprint.status_heavy_modules(sys.executable, env, ROOT) == []
    # An interpreter that runs no probe prints no module list: said, not taken for "none loaded".
    with pytest.raises(RuntimeError, match="printed no module list"):
        footprint.status_heavy_modules("/bin/false", env, ROOT)


def test_repeats_below_one_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        footprint.main(["--repeats", "0"])
    assert e.value.code == 2 and "--repeats must be at least 1, got 0" in capsys.readouterr().err
