"""Model files as apps: apps.yaml ``model: <file>`` and ``node.model_repository`` read into app entries
(orchestrator/config/model_files.py, orchestrator/config/schema.py), and the CLI's ``--model-repository``."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuprims.tensors import DataType
from orchestrator.cli.main import main as cli_main
from orchestrator.config.model_files import app_keys, is_model_file
from orchestrator.config.schema import ConfigError, load_config, parse_config

from ...modelfiles import DETECTOR_CONFIG, detector_onnx, multi_io_onnx, repository

NODE = "node: {listen: {host: 127.0.0.1, port: 0}, backend: cpu}\n"


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return repository(tmp_path_factory.mktemp("repo"))


def _yaml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "apps.yaml"
    p.write_text(text)
    return p


def test_model_refs_that_are_files() -> None:
    assert is_model_file("models/yolo.onnx") and is_model_file("m.pt2") and is_model_file("a/b")
    assert not is_model_file("mobilenet_v2") and not is_model_file("pkg.mod:factory")


def test_an_apps_yaml_model_file_is_read_relative_to_the_yaml(tmp_path: Path) -> None:
    multi_io_onnx(tmp_path / "models" / "m.onnx")
    cfg = load_config(_yaml(tmp_path, NODE + "apps:\n  - {name: m, model: models/m.onnx, slo_ms: 50}\n"))
    a = cfg.apps[0]
    assert a.file is not None and Path(a.model) == tmp_path / "models" / "m.onnx"
    sig = a.file.config.signature
    assert [t.name for t in sig.inputs] == ["image in", "scale.k", "flag"]
    assert sig.input("flag").datatype is DataType.BOOL and sig.input("image in").dims == (3, -1)
    # Completed from the file: every tensor's first dimension is dynamic, so it batches (Triton's 4).
    assert sig.max_batch_size == 4 and a.max_batch == 4 and a.max_wait_ms == 0.0
    assert a.engine.kind == "onnxruntime" and a.slo_ms == 50 and a.file.fingerprint


def test_config_overrides_use_config_pbtxt_keys(tmp_path: Path) -> None:
    multi_io_onnx(tmp_path / "m.onnx")
    cfg = load_config(_yaml(tmp_path, NODE + """apps:
  - name: m
    model: m.onnx
    slo_ms: 50
    config:
      max_batch_size: 2
      dynamic_batching: {max_queue_delay_microseconds: 1500}
      parameters: {gpu_pct: {string_value: "40"}}
"""))
    a = cfg.apps[0]
    assert a.max_batch == 2 and a.max_wait_ms == 1.5 and a.gpu_pct == 40
    assert a.file is not None and a.file.config.max_batch_size == 2


@pytest.mark.parametrize(("entry", "key", "match"), [
    ("{name: m, model: nothere.onnx, slo_ms: 50}", "apps[0].model", "no such model file"),
    ("{name: m, model: m.onnx, slo_ms: 50, input_shape: [3, 4, 4]}", "apps[0].input_shape",
     "come from the file"),
    ("{name: m, model: m.onnx, slo_ms: 50, config: {max_batch_size: -1}}", "apps[0]", "max_batch_size"),
    ("{name: m, model: m.onnx, slo_ms: 50, config: {no_such_key: 1}}", "apps[0].config", "no_such_key"),
    ("{name: m, model: mobilenet_v2, slo_ms: 50, config: {max_batch_size: 1}}", "apps[0].config",
     "applies only to a model file"),
    ("{name: m, model: m.onnx, slo_ms: 50, overflow: cpu}", "apps[0].overflow", "model files"),
    # The config checked against the file as Triton checks it at load (no max_batch_size: no batch dimension).
    ("{name: m, model: m.onnx, slo_ms: 50, config: {input: [{name: flag, data_type: TYPE_BOOL, dims: [1]}]}}",
     "apps[0].model", r"input 'flag' has shape \[-1, 1\] in the model file; the config gives \[1\]"),
])
def test_a_bad_model_file_entry_is_refused_naming_the_key(tmp_path: Path, entry: str, key: str, match: str) -> None:
    multi_io_onnx(tmp_path / "m.onnx")
    with pytest.raises(ConfigError, match=match) as e:
        load_config(_yaml(tmp_path, NODE + f"apps:\n  - {entry}\n"))
    assert any(k.startswith(key) for k, _ in e.value.problems), e.value.problems


def test_a_repository_becomes_apps_and_a_broken_model_is_unavailable_alone(repo: Path) -> None:
    cfg = parse_config({"node": {"model_repository": str(repo), "backend": "cpu"}, "apps": []})
    assert [a.name for a in cfg.apps] == ["detector", "multi", "noconfig"]
    assert [u.name for u in cfg.unavailable] == ["broken"]
    det = cfg.app_by_name("detector")
    assert det.max_batch == 1 and det.file is not None and not det.file.config.signature.batched
    multi = cfg.app_by_name("multi")
    assert multi.slo_ms == 5000 and multi.max_batch == 8 and multi.max_wait_ms == 2.0
    assert cfg.app_by_name("noconfig").slo_ms == 100.0  # node.repository_slo_ms
    assert len({a.app_id for a in cfg.apps}) == 3


def _versions_repo(root: Path, policy: str, versions: tuple[int, ...] = (1, 2, 3)) -> Path:
    for v in versions:
        detector_onnx(root / "det" / str(v) / "model.onnx", 0.1 * v)
    (root / "det" / "config.pbtxt").write_text(DETECTOR_CONFIG.format(name="det") + policy)
    return root


@pytest.mark.parametrize(("policy", "apps"), [
    ("", ["det"]),  # latest 1: one app named as the model
    ("version_policy { latest { num_versions: 2 } }", ["det-v2", "det-v3"]),
    ("version_policy { all { } }", ["det-v1", "det-v2", "det-v3"]),
    ("version_policy { specific { versions: [1, 3] } }", ["det-v1", "det-v3"]),
    ("version_policy { specific { versions: [2] } }", ["det"]),
])
def test_a_policy_of_several_versions_serves_each_as_an_app(tmp_path: Path, policy: str, apps: list[str]) -> None:
    cfg = parse_config({"node": {"model_repository": str(_versions_repo(tmp_path, policy)), "backend": "cpu"},
                        "apps": []})
    assert [a.name for a in cfg.apps] == apps and not cfg.unavailable
    for a in cfg.apps:
        assert a.file is not None and a.file.config.name == "det"
        assert a.file.path.endswith(f"/det/{a.file.version}/model.onnx")
        assert a.name in ("det", f"det-v{a.file.version}")
    assert len({a.app_id for a in cfg.apps}) == len(apps)


def test_a_version_app_named_like_another_app_makes_the_model_unavailable(tmp_path: Path) -> None:
    repo = _versions_repo(tmp_path / "repo", "version_policy { all { } }", (1, 2))
    cfg = parse_config({"node": {"model_repository": str(repo)},
                        "apps": [{"name": "det-v2", "model": "mobilenet_v2", "slo_ms": 100}]})
    assert [a.name for a in cfg.apps] == ["det-v2"] and cfg.apps[0].file is None
    assert [(u.name, "det-v2" in u.reason) for u in cfg.unavailable] == [("det", True)]


def test_explicit_mode_loads_only_the_named_models(repo: Path) -> None:
    cfg = parse_config({"node": {"model_repository": str(repo), "model_control_mode": "explicit",
                                 "load_models": ["multi", "nothere"]}, "apps": []})
    assert [a.name for a in cfg.apps] == ["multi"]
    assert [u.name for u in cfg.unavailable] == ["nothere"]


def test_a_repository_model_named_like_an_app_is_unavailable(repo: Path, tmp_path: Path) -> None:
    detector_onnx(tmp_path / "d.onnx")
    cfg = parse_config({"node": {"model_repository": str(repo)},
                        "apps": [{"name": "multi", "model": "mobilenet_v2", "slo_ms": 100}]})
    assert cfg.app_by_name("multi").file is None
    assert any(u.name == "multi" and "named" in u.reason for u in cfg.unavailable)


def test_repository_keys_need_a_repository() -> None:
    with pytest.raises(ConfigError, match=r"applies only with node\.model_repository"):
        parse_config({"node": {"model_control_mode": "poll"}, "apps": [{"name": "a", "model": "mobilenet_v2",
                                                                        "slo_ms": 10}]})
    with pytest.raises(ConfigError, match="model_repository"):
        parse_config({"node": {"model_repository": "/no/such/dir"}, "apps": []})


def test_app_keys_follow_the_config(repo: Path) -> None:
    from gpuprims.modelrepo import load_config as load_model_config

    keys = app_keys(load_model_config(repo / "multi"))
    assert keys["max_batch"] == 8 and keys["max_wait_ms"] == 2.0 and keys["slo_ms"] == 5000.0
    assert keys["instances"] == 1 and keys["engine"] == {"kind": "onnxruntime", "provider": "cpu"}


@pytest.mark.slow
def test_validate_and_start_take_a_repository_without_a_config(repo: Path) -> None:
    r = CliRunner().invoke(cli_main, ["validate", "--model-repository", str(repo)])
    assert r.exit_code == 0, r.output
    assert "broken: UNAVAILABLE" in r.output and "multi: app_id" in r.output and "1 model(s) unavailable" in r.output
    r = CliRunner().invoke(cli_main, ["validate"])
    assert r.exit_code != 0 and "--model-repository" in r.output
