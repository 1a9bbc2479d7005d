"""``gpuprims-engine build apps.yaml``: every app's engine built ahead of time into the cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from gpuprims.engines import EngineCache
from orchestrator.cli.engine import jobs_of, main
from orchestrator.config.schema import load_config


def _write(tmp_path: Path, apps: list[dict[str, Any]], **node: Any) -> Path:
    p = tmp_path / "apps.yaml"
    p.write_text(yaml.safe_dump({"node": {"backend": "cpu", "engine_cache": str(tmp_path / "cache"), **node},
                                 "apps": apps}))
    return p


def _app(name: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "model": "mobilenet_v2", "slo_ms": 100, "input_shape": [3, 32, 32], "num_classes": 10,
            "max_batch": 2, **kw}


def test_jobs_cover_stages_and_the_overflow_instance(tmp_path: Path) -> None:
    stages = [{"name": "r", "model": "recog_router", "routes": ["f"], "engine": "onnxruntime"},
              {"name": "f", "model": "vgg_face"}]
    cfg = load_config(_write(tmp_path, [_app("a", engine="onnxruntime"),
                                        {"name": "d", "slo_ms": 100, "stages": stages}]))
    assert [(j.app, j.where, j.engine.kind, j.backend) for j in jobs_of(cfg, "cpu")] == [
        ("a", "", "onnxruntime", "cpu"), ("d", "stage r", "onnxruntime", "cpu"), ("d", "stage f", "eager", "cpu")]


@pytest.mark.slow
def test_build_fills_the_cache_and_a_second_build_hits_it(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
    cfg = _write(tmp_path, [_app("a", engine="onnxruntime"), _app("b")])
    first = CliRunner().invoke(main, ["build", str(cfg), "--json", "--no-progress"])
    assert first.exit_code == 0, first.output
    lines = [json.loads(x) for x in first.output.splitlines() if x.startswith("{")]
    assert [(x["app"], x["kind"]) for x in lines] == [("a", "onnxruntime"), ("b", "eager")]
    assert lines[0]["cache_hit"] is False and lines[0]["build_ms"] > 0 and lines[1]["built"] is False
    assert EngineCache(tmp_path / "cache").entries() == [lines[0]["fingerprint"]]
    assert "2 of 2 engine(s) ready" in first.output
    again = CliRunner().invoke(main, ["build", str(cfg), "--no-progress"])
    assert again.exit_code == 0, again.output
    assert f"a: onnxruntime: cache hit ({lines[0]['fingerprint']})" in again.output
    assert "b: eager: nothing to build" in again.output


def test_a_model_that_will_not_build_is_one_line_and_exit_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
    (tmp_path / "spectral_cli_model.py").write_text(
        "import torch\n\n\nclass S(torch.nn.Module):\n"
        "    def forward(self, x):\n        return torch.fft.fft(x.flatten(1)).real\n\n\n"
        "def build(num_classes=10, input_shape=(3, 8, 8)):\n    return S().eval()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _write(tmp_path, [_app("bad", model="spectral_cli_model:build", engine="onnxruntime", input_shape=[3, 8, 8])])
    res = CliRunner().invoke(main, ["build", str(cfg), "--no-progress"])
    assert res.exit_code == 1
    failed = [x for x in res.output.splitlines() if "FAILED" in x]
    assert len(failed) == 1 and failed[0].startswith("bad: onnxruntime: FAILED: ") and "ONNX" in failed[0]
    assert "0 of 1 engine(s) ready" in res.output


def test_an_engine_the_backend_cannot_run_is_refused_before_building(tmp_path: Path) -> None:
    cfg = _write(tmp_path, [_app("g", engine={"kind": "onnxruntime", "provider": "cuda"})])
    res = CliRunner().invoke(main, ["build", str(cfg), "--no-progress"])
    assert res.exit_code != 0
    assert "apps[0].engine: app 'g': engine 'onnxruntime' with provider 'cuda' needs the cuda backend" in res.output
    assert not (tmp_path / "cache").exists()
