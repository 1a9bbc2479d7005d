"""ONNX export: one file, input ``input`` / output ``output`` with a dynamic batch axis, that ONNX Runtime
runs to eager's outputs; a model that will not export is one clear line naming the model and why."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from gpuprims.engines import ExportError, ModelSource
from gpuprims.engines.onnx import INPUT_NAME, OUTPUT_NAME, export_onnx
from tests.gpuprims.engines.tinynet import SPEC


def test_export_has_a_dynamic_batch_and_runs_like_eager(tmp_path: Path) -> None:
    src = ModelSource(SPEC, (3, 16, 16), max_batch=4, num_classes=1000)
    module = src.build_module()
    path = tmp_path / "m.onnx"
    meta = export_onnx(module, src, path)
    assert meta["input"] == INPUT_NAME and meta["output"] == OUTPUT_NAME and meta["output_shape"] == [1000]
    assert meta["bytes"] == path.stat().st_size and meta["exporter"] and meta["opset"] >= 17
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]  # weights inside, no external data
    model = onnx.load(str(path))
    (inp,) = model.graph.input
    assert inp.name == INPUT_NAME and inp.type.tensor_type.shape.dim[0].dim_param
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for n in (1, 3, 4):
        x = torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(n))
        with torch.inference_mode():
            want = module(x).numpy()
        (got,) = sess.run([OUTPUT_NAME], {INPUT_NAME: x.numpy()})
        assert got.shape == (n, 1000)
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)


def test_export_builds_the_model_when_none_is_given(tmp_path: Path) -> None:
    src = ModelSource(SPEC, (3, 16, 16), max_batch=2, num_classes=10)
    meta = export_onnx(None, src, tmp_path / "r.onnx")
    assert meta["output_shape"] == [10] and (tmp_path / "r.onnx").is_file()


class _TwoOutputs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.fc(x.flatten(1))
        return y, y


class _Broken(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this model always fails\nsecond line")


class _NoBatch(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum().reshape(1)


class _Unsupported(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.fft(x.flatten(1)).real  # no ONNX symbolic for aten::fft_fft


@pytest.mark.parametrize(("module", "reason"), [
    (_TwoOutputs(), "returns tuple, not one tensor"),
    (_Broken(), "does not run on an input of shape.*this model always fails"),
    (_NoBatch(), "the first axis must be the batch"),
    (_Unsupported(), "does not export to ONNX: "),
])
def test_a_model_that_will_not_export_is_one_clear_line(tmp_path: Path, module: torch.nn.Module,
                                                         reason: str) -> None:
    src = ModelSource("mypkg.models:build", (1, 2, 2), max_batch=2)
    with pytest.raises(ExportError, match=reason) as info:
        export_onnx(module, src, tmp_path / "x.onnx")
    text = str(info.value)
    assert "\n" not in text and "'mypkg.models:build'" in text
    assert not (tmp_path / "x.onnx").exists()


def test_unbuildable_model_is_an_export_error(tmp_path: Path) -> None:
    src = ModelSource("no_such_zoo_model", (3, 8, 8), max_batch=1)
    with pytest.raises(ExportError, match="'no_such_zoo_model' cannot be built"):
        export_onnx(None, src, tmp_path / "x.onnx")


@pytest.mark.slow
def test_adaptive_pool_that_does_not_divide_is_refused_in_one_line(tmp_path: Path) -> None:
    # AlexNet pools to 6x6 from 1x1 at a 32x32 input: the exporter has no ONNX form for that
    src = ModelSource("alexnet", (3, 32, 32), max_batch=2, num_classes=10)
    with pytest.raises(ExportError, match=r"'alexnet' does not export to ONNX: .*adaptive_avg_pool2d") as info:
        export_onnx(None, src, tmp_path / "a.onnx")
    assert "\n" not in str(info.value)
