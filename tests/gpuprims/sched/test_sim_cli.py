from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuprims.sched.scenarios import many_apps, paper_table3
from gpuprims.sched.sim_cli import load_config, main

CONFIG = """
num_gpus: 1
round_ms: 30
profiles: [paper]
apps:
  - name: recog
    deadline_ms: 30
    stages:
      - {name: router, model: recog_router, gpu_pct: 25, routes: {person: face, vehicle: car}}
      - {name: face, model: vgg_face, gpu_pct: 40}
      - {name: car, model: resnet_car, gpu_pct: 50}
    route_probs: {router: {person: 0.5, vehicle: 0.4}}
    arrival: {kind: poisson, rate_rps: 200}
  - name: yolo
    deadline_ms: 30
    stages: [{name: yolo, model: yolov3, gpu_pct: 60}]
    arrival: {kind: constant, rate_rps: 66.7, burst: 2}
"""


def test_config_run_is_labelled_simulated(tmp_path: Path) -> None:
    cfg = tmp_path / "sim.yaml"
    cfg.write_text(CONFIG)
    out = tmp_path / "r.json"
    res = CliRunner().invoke(main, ["--config", str(cfg), "--duration-s", "0.5", "--out", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["simulated"] is True and set(doc["runs"]) == {"spatiotemporal", "temporal"}
    for run in doc["runs"].values():
        assert run["simulated"] and run["total"]["simulated"]
        assert all(a["simulated"] for a in run["apps"].values())
        assert set(run["apps"]) == {"recog", "yolo"}
    assert doc["throughput_ratio"] is not None


def test_builtin_scenarios() -> None:
    res = CliRunner().invoke(main, ["--scenario", "paper-table3", "--duration-s", "0.3", "--scheduler", "temporal"])
    assert res.exit_code == 0, res.output
    assert set(json.loads(res.stdout)["runs"]) == {"temporal"}
    assert res.stderr.startswith("SIMULATED (not measured): 0.3 s, 1 GPU(s)") and "\ntemporal " in res.stderr
    res = CliRunner().invoke(main, ["--scenario", "many", "--gpus", "2", "--apps", "4", "--duration-s", "0.2"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["runs"]["spatiotemporal"]["num_gpus"] == 2
    assert "throughput spatio-temporal / temporal: " in res.stderr


@pytest.mark.parametrize(("text", "needle"), [
    ("apps: []", "apps"),
    ("apps: [{name: a, deadline_ms: 0, stages: [{name: s, model: yolov3, gpu_pct: 50}], "
     "arrival: {kind: poisson, rate_rps: 1}}]", "apps.0.deadline_ms"),
    ("apps: [{name: a, deadline_ms: 10, stages: [{name: s, model: yolov3, gpu_pct: 500}], "
     "arrival: {kind: poisson, rate_rps: 1}}]", "apps.0.stages.0.gpu_pct"),
    ("apps: [{name: a, deadline_ms: 10, stages: [{name: s, model: yolov3, gpu_pct: 50, routes: {x: q}}], "
     "arrival: {kind: poisson, rate_rps: 1}}]", "apps.0 (a): app 'a': stage 's' routes 'x' to unknown stage 'q'"),
    ("apps: [{name: a, deadline_ms: 10, stages: [{name: s, model: yolov3, gpu_pct: 50}], "
     "arrival: {kind: sometimes, rate_rps: 1}}]", "apps.0.arrival.kind"),
    ("bogus: 1\napps: []", "bogus"),
    ("profiles: [nowhere]\napps: [{name: a, deadline_ms: 10, stages: [{name: s, model: yolov3, gpu_pct: 50}], "
     "arrival: {kind: poisson, rate_rps: 1}}]", "profiles"),
    ("apps: [unclosed", "not valid YAML"),
])
def test_bad_config_names_file_and_key(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ValueError) as e:
        load_config(f)
    assert str(f) in str(e.value) and needle in str(e.value)
    res = CliRunner().invoke(main, ["--config", str(f), "--duration-s", "0.1"])
    assert res.exit_code == 2 and "gpuprims-sim:" in res.output


def test_cli_bad_combinations(tmp_path: Path) -> None:
    cfg = tmp_path / "sim.yaml"
    cfg.write_text(CONFIG)
    res = CliRunner().invoke(main, ["--config", str(cfg), "--scenario", "many"])
    assert res.exit_code == 2 and "not both" in res.output
    res = CliRunner().invoke(main, ["--duration-s", "1", "--warmup-s", "1"])
    assert res.exit_code == 2 and "--warmup-s" in res.output
    res = CliRunner().invoke(main, ["--config", str(cfg), "--duration-s", "1", "--gpus", "0"])
    assert res.exit_code == 2
    with pytest.raises(ValueError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_scenario_bad_input() -> None:
    with pytest.raises(ValueError, match="load"):
        paper_table3(load=0)
    with pytest.raises(ValueError, match="kind"):
        paper_table3(kind="bursty")
    with pytest.raises(ValueError, match="num_gpus"):
        many_apps(num_gpus=0, num_apps=1, rate_rps=1.0)


@pytest.mark.slow
def test_processes_option_splits_gpus() -> None:
    res = CliRunner().invoke(main, ["--scenario", "many", "--gpus", "2", "--apps", "4", "--duration-s", "0.2",
                                    "--scheduler", "temporal", "--processes", "2"])
    assert res.exit_code == 0, res.output
    run = json.loads(res.stdout)["runs"]["temporal"]
    assert run["processes"] == 2 and run["simulated"] is True
