"""``engine: openvino``: cpu only, threads from the target, the exported ONNX cached, equal to eager."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpuprims.engines import EngineCache, EngineError, EngineUnavailable, ModelSource, Target, make_engine
from gpuprims.engines import openvino as ov_engine
from gpuprims.engines.openvino import OpenVinoEngine
from tests.gpuprims.engines.tinynet import SPEC

SRC = ModelSource(SPEC, (3, 16, 16), max_batch=4)


def test_refused_on_cuda_and_bad_hint_named() -> None:
    with pytest.raises(EngineUnavailable, match="engine 'openvino' needs the cpu backend; this node runs on cuda"):
        OpenVinoEngine.check("cuda")
    with pytest.raises(EngineError, match="hint must be one of latency, throughput, got 'fast'"):
        OpenVinoEngine.check("cpu", {"hint": "fast"})


def test_equals_eager_uses_its_threads_and_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = SRC.build_module()
    eng = make_engine("openvino", SRC, Target("cpu", threads=1), cache=EngineCache(tmp_path))
    info = eng.prepare(module)
    assert not info.cache_hit and (Path(info.artefact or "") / "model.onnx").is_file()
    assert int(eng.compiled.get_property("INFERENCE_NUM_THREADS")) == 1
    for n in (1, 2, 4):
        x = torch.randn(n, *SRC.input_shape)
        with torch.inference_mode():
            want = module(x)
        got = eng.run(x)
        torch.testing.assert_close(got, want, rtol=eng.tolerance[0], atol=eng.tolerance[1])
    first = eng.run(torch.ones(1, *SRC.input_shape))
    eng.run(torch.zeros(1, *SRC.input_shape))
    with torch.inference_mode():
        torch.testing.assert_close(first, module(torch.ones(1, *SRC.input_shape)), rtol=1e-3, atol=1e-4)
    with pytest.raises(EngineError, match=r"batch of 5 is outside 1\.\.4"):
        eng.run(torch.zeros(5, *SRC.input_shape))
    eng.close()

    def no_export(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a cached engine exported the model again")

    monkeypatch.setattr(ov_engine, "export_onnx", no_export)
    again = make_engine("openvino", SRC, Target("cpu", threads=2), cache=EngineCache(tmp_path))
    assert again.prepare(module).cache_hit and again.describe()["threads"] == 2
    assert int(again.compiled.get_property("INFERENCE_NUM_THREADS")) == 2
