"""bench.engines_gpu end to end on the fake CUDA runtime (with the recording TensorRT stand-in): every
engine row present, the GPU engines built, equal to eager at batch 1 and max, timed, and the JSON
written; an engine this build lacks is listed with the reason; bad arguments are refused by name."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from bench import engines_gpu
from tests.gpuprims.engines import trt_standin

TINY = "tests.gpuprims.engines.nets:tiny"


def test_a_fake_run_writes_every_engine_row(fake_cuda: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", trt_standin.make())
    path = engines_gpu.main(["--fake", "--quick", "--models", TINY, "--max-batch", "2", "--iters", "2",
                             "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "out")])
    assert path == tmp_path / "out" / "engines_gpu-fake.json"
    doc = json.loads(path.read_text())
    assert doc["experiment"] == "engines_gpu" and doc["machine"]["fake_runtime"] is True and "FAKE" in doc["notes"]
    rows = doc["summary"][TINY]
    assert set(engines_gpu.ENGINES) <= set(rows)
    for name in ("eager", "cudagraph", "tensorrt-fp32", "tensorrt-fp16"):
        row = rows[name]
        assert "error" not in row and "skipped" not in row, row
        assert row["equal"] is True and row["equal_b1"] and row["equal_b2"]
        assert row["device_p50_ms_b1"] >= 0 and row["wall_p50_ms_b2"] > 0
        assert len(doc["samples"][f"{TINY}/{name}"]["b2"]["wall_ms"]) == 2
    assert rows["eager"]["speedup_vs_eager_b1"] == 1.0
    assert rows["best_b1"] in engines_gpu.ENGINES
    ort_row = rows["onnxruntime-cuda"]
    assert ("skipped" in ort_row) or ("error" in ort_row) or ort_row.get("equal") is not None
    out = capsys.readouterr().out
    assert "cudagraph" in out and "wrote" in out


def test_without_tensorrt_its_rows_say_why(fake_cuda: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.delitem(sys.modules, "tensorrt", raising=False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    path = engines_gpu.main(["--fake", "--quick", "--models", TINY, "--max-batch", "2", "--iters", "1",
                             "--engines", "eager,tensorrt-fp32", "--cache", str(tmp_path / "c"),
                             "--out", str(tmp_path)])
    rows = json.loads(path.read_text())["summary"][TINY]
    assert "needs the tensorrt package" in rows["tensorrt-fp32"]["skipped"]
    assert rows["eager"]["equal"] is True


def test_bad_arguments_are_refused(fake_cuda: Any, tmp_path: Any) -> None:
    with pytest.raises(SystemExit):
        engines_gpu.main(["--fake", "--engines", "warp-drive", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        engines_gpu.main(["--fake", "--max-batch", "-1", "--out", str(tmp_path)])
