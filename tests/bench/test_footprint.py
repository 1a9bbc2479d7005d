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


@pytest.mark.slow
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


@pytest.mark.parametrize("engine", ["eager", "onnxruntime"])
@pytest.mark.parametrize("shadow", ["warm", "cold"])
def test_the_sweeps_configs_are_valid(tmp_path: Path, engine: str, shadow: str) -> None:
    from orchestrator.config.schema import load_config

    p = tmp_path / "apps.yaml"
    p.write_text(footprint.sweep_config(8, engine, shadow, tmp_path / "cache"))
    cfg = load_config(p)
    assert [a.app_id for a in cfg.apps] == list(range(1, 9))
    assert {a.engine.kind for a in cfg.apps} == {engine} and {a.shadow for a in cfg.apps} == {shadow}
    assert sum(a.gpu_pct for a in cfg.apps) <= 100


def test_settled_waits_for_actives_and_warm_shadows() -> None:
    active = {"role": "active", "ready": True}
    st = {"apps": {"a": {"instances": [active, {"role": "shadow", "ready": True, "prewarm": "warming"}]}}}
    assert footprint._settled(st, "cold") and not footprint._settled(st, "warm")
    st["apps"]["a"]["instances"][1]["prewarm"] = "warm"
    assert footprint._settled(st, "warm")
    assert not footprint._settled({"apps": {"a": {"instances": [{"role": "active", "ready": False}]}}}, "cold")


def test_sweep_figures_goals_and_what_holds_a_miss(tmp_path: Path) -> None:
    def run(n: int, per_app_mb: float) -> footprint.SweepRun:
        lib = [{"path": "/x/libtorch_cpu.so", "pss_mb": 50.0}, {"path": "[anon]", "pss_mb": 20.0}]
        procs = [footprint.ProcessFootprint("node", 1, 150.0, top=lib),
                 footprint.ProcessFootprint("fork_server", 2, 100.0, top=lib)]
        procs += [footprint.ProcessFootprint(role, 10 + i, per_app_mb / 2, f"cls{i}", lib)
                  for i in range(n) for role in ("active", "shadow")]
        return footprint.SweepRun("onnxruntime", "warm", n, 3.0, 9.0, procs, None)

    r1, r8 = run(1, 80.0), run(8, 80.0)
    assert r8.figures() == {"node_pss_mb": 150.0, "fork_servers_pss_mb": 100.0, "actives_pss_mb": 320.0,
                            "shadows_pss_mb": 320.0, "holders_pss_mb": 0, "total_pss_mb": 890.0, "start_s": 3.0,
                            "settled_s": 9.0}
    (tmp_path / "m.onnx").write_bytes(b"\0" * (14 << 20))
    summary: dict[str, object] = {}
    footprint._goals(summary, "k", [r1, r8], 80.0, tmp_path)
    assert summary["k_model_file_mb"] == 14.0
    assert summary["k_goal_node_le_100mb"] is False and summary["k_node_held_by"][0] == "/x/libtorch_cpu.so 50 MB"
    assert summary["k_goal_added_app_le_file_plus_60mb"] is False and "k_added_app_held_by" in summary
    assert summary["k_goal_8_apps_le_900mb"] is True and "k_8_apps_held_by" not in summary


@pytest.mark.parametrize(("args", "words"), [(["--sweep-apps", "0"], "1..64"), (["--sweep-apps", "a"], "app counts"),
                                             (["--sweep-engines", "tensorrt"], "eager, onnxruntime"),
                                             (["--sweep-shadows", ""], "warm, cold")])
def test_bad_sweep_arguments_are_refused(args: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        footprint.main(args)
    assert e.value.code == 2 and words in capsys.readouterr().err
