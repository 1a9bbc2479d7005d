"""``tensorrt`` for model files (a serialized plan with named tensors) against a recording stand-in of the
``tensorrt`` runtime API (tests/gpuprims/engines/trt_plan_standin.py) on the fake CUDA runtime: the
named-tensor calls and their arguments (set_input_shape, set_tensor_address of our device buffers,
execute_async_v3 on the target's stream, an IOutputAllocator for data-dependent outputs), answers equal
to the plan's model run directly at batch 1, the middle and the max, and every error path. A real plan
on a real GPU is the ``gpu`` test at the end."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from gpuprims.cuda.event import Stream
from gpuprims.engines import EngineCache, EngineError, EngineUnavailable, Target
from gpuprims.engines.file_tensorrt import TensorRTFileEngine
from gpuprims.engines.files import check_file_engine, make_file_engine
from gpuprims.tensors import DataType, ModelSignature, TensorSpec
from tests.gpuprims.engines import filemodels as fm
from tests.gpuprims.engines import trt_plan_standin as standin

MAX = fm.MAX_BATCH


def _batched(name: str, dtype: str, dims: list[int]) -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "shape": [-1, *dims], "min": [1, *dims], "max": [MAX, *dims]}


def _follows(name: str, dtype: str, dims: list[int]) -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "shape": [-1, *dims], "follows": [["image in", 0]] + [None] * len(dims)}


@pytest.fixture
def trt(monkeypatch: pytest.MonkeyPatch) -> Any:
    mod = standin.make()
    monkeypatch.setitem(sys.modules, "tensorrt", mod)
    return mod


def _multi_plan(onnx_path: Path, profiles: int = 1) -> bytes:
    return standin.make_plan(
        onnx_path.read_bytes(),
        [_batched("image in", "FLOAT", [3, 4]), _batched("scale.factor", "HALF", [1, 1]),
         _batched("ids", "INT64", [5]), _batched("mask", "BOOL", [5])],
        [_follows("out.sum", "FLOAT", [3]), _follows("ids x2", "INT64", [5]), _follows("not mask", "BOOL", [5]),
         _follows("half out", "HALF", [3])], profiles=profiles)


@pytest.fixture
def multi_plan(tmp_path: Path) -> tuple[Path, Path, ModelSignature]:
    onnx_path, sig = fm.multi_io(tmp_path / "multi.onnx")
    path = tmp_path / "model.plan"
    path.write_bytes(_multi_plan(onnx_path))
    return path, onnx_path, sig


@pytest.fixture
def dds_plan(tmp_path: Path) -> tuple[Path, Path, ModelSignature]:
    onnx_path, sig = fm.data_dependent(tmp_path / "nonzero.onnx")
    plan = standin.make_plan(
        onnx_path.read_bytes(),
        [{"name": "x", "dtype": "FLOAT", "shape": [-1], "min": [1], "max": [64]},
         {"name": "k", "dtype": "INT64", "shape": [1], "min": [1], "max": [1]}],
        [{"name": "where", "dtype": "INT64", "shape": [1, -1], "follows": [None, "dds"]},
         {"name": "top values", "dtype": "FLOAT", "shape": [-1], "follows": ["dds"]},
         {"name": "top.indices", "dtype": "INT64", "shape": [-1], "follows": ["dds"]}])
    path = tmp_path / "nonzero.plan"
    path.write_bytes(plan)
    return path, onnx_path, sig


def _direct(onnx_path: Path, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feed)))


def test_check_refuses_cpu_a_missing_library_and_bad_options(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(EngineUnavailable, match=r"'tensorrt' needs the cuda backend; this node runs on cpu"):
        check_file_engine("tensorrt", "cpu")
    monkeypatch.delitem(sys.modules, "tensorrt", raising=False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(EngineUnavailable, match=r"needs the tensorrt package .*gpu-engines"):
        check_file_engine("tensorrt", "cuda")
    monkeypatch.setitem(sys.modules, "tensorrt", standin.make())
    check_file_engine("tensorrt", "cuda", {"profile": 0})
    for bad, match in (({"profile": -1}, "profile .* must be an integer >= 0"),
                       ({"precision": "fp16"}, r"has no option\(s\) \['precision'\]")):
        with pytest.raises(EngineError, match=match):
            check_file_engine("tensorrt", "cuda", bad)


def test_runs_a_plan_with_named_tensors_on_the_targets_stream(fake_cuda: Any, trt: Any, multi_plan: Any,
                                                              tmp_path: Path) -> None:
    path, onnx_path, sig = multi_plan
    stream = Stream(0)
    eng = make_file_engine("tensorrt", path, sig, Target("cuda", stream=stream))
    info = eng.prepare(EngineCache(tmp_path / "cache"))
    assert not info.cache_hit and info.extra["cached"] == "nothing: the plan is the artefact"
    assert standin.args_of(trt, "Runtime.deserialize_cuda_engine") == [(path.stat().st_size,)]
    for n in (1, MAX // 2, MAX):
        trt.calls.clear()
        x = fm.multi_inputs(n, seed=n)
        got = eng.run(x)
        want = _direct(onnx_path, x)
        assert list(got) == [s.name for s in sig.outputs]
        for name, ref in want.items():
            assert got[name].dtype == ref.dtype and got[name].shape == ref.shape
            np.testing.assert_allclose(got[name], ref, *TensorRTFileEngine.tolerance)
        # every input's shape set, every tensor bound, then one launch on the instance's stream
        assert sorted(standin.args_of(trt, "IExecutionContext.set_input_shape")) == sorted(
            (k, v.shape) for k, v in x.items())
        bound = {a[0] for a in standin.args_of(trt, "IExecutionContext.set_tensor_address")}
        assert bound == {*x, *(s.name for s in sig.outputs)}
        assert standin.args_of(trt, "IExecutionContext.execute_async_v3") == [(stream.handle,)]
        assert standin.names(trt)[-1] == "IExecutionContext.execute_async_v3"
    # the outputs a request names; the others are still bound (TensorRT needs every output bound)
    got = eng.run(fm.multi_inputs(2), outputs=["ids x2"])
    assert list(got) == ["ids x2"]
    d = eng.describe()
    assert d["kind"] == "tensorrt" and d["runs"] == 4 and d["outputs"] == [s.name for s in sig.outputs]
    eng.close()
    assert not fake_cuda.live("device")  # our device buffers went with close()


def test_data_dependent_outputs_through_an_output_allocator(fake_cuda: Any, trt: Any, dds_plan: Any,
                                                            tmp_path: Path) -> None:
    path, onnx_path, sig = dds_plan
    eng = make_file_engine("tensorrt", path, sig, Target("cuda"))  # no stream given: the engine's own
    eng.prepare(EngineCache(tmp_path / "cache"))
    for x, k in (([0, 1.5, 0, 3], 1), ([2, 0, 0, 0, 0, 7, 1], 3), ([5, 4, 3, 2, 1, 0.5, 9, 8], 6)):
        feed = {"x": np.array(x, np.float32), "k": np.array([k], np.int64)}
        got = eng.run(feed)
        for name, ref in _direct(onnx_path, feed).items():
            np.testing.assert_array_equal(got[name], ref, err_msg=name)
    allocs = standin.args_of(trt, "IExecutionContext.set_output_allocator")
    assert {a[0] for a in allocs} == {"where", "top values", "top.indices"}
    eng.close()


def test_plan_errors_are_one_clear_engine_error(fake_cuda: Any, trt: Any, multi_plan: Any, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path, onnx_path, sig = multi_plan
    cache = EngineCache(tmp_path / "cache")
    bad = tmp_path / "corrupt.plan"
    bad.write_bytes(b"not a plan at all")
    with pytest.raises(EngineError, match=r"corrupt.plan does not deserialize \(stand-in: the plan's magic tag is "
                                          r"wrong \(not a plan\)\): a plan runs only with the TensorRT version"):
        make_file_engine("tensorrt", bad, sig, Target("cuda")).prepare(cache)
    with pytest.raises(EngineError, match=r"engine 'tensorrt' runs .plan or .engine files; x.onnx is an ONNX model "
                                          r"\(use engine 'onnxruntime'\)"):
        (tmp_path / "x.onnx").write_bytes(b"")
        make_file_engine("tensorrt", tmp_path / "x.onnx", sig, Target("cuda"))
    wrong = ModelSignature((TensorSpec("image in", DataType.FP16, (3, 4)), *sig.inputs[1:]), sig.outputs, MAX)
    with pytest.raises(EngineError, match=r"input 'image in' is FP32 in the file, the signature says FP16"):
        make_file_engine("tensorrt", path, wrong, Target("cuda")).prepare(cache)
    renamed = ModelSignature(sig.inputs, (TensorSpec("sum", DataType.FP32, (3,)), *sig.outputs[1:]), MAX)
    with pytest.raises(EngineError, match=r"model.plan has no output 'sum'"):
        make_file_engine("tensorrt", path, renamed, Target("cuda")).prepare(cache)
    # a profile the plan does not have; one it has is set on the stream the plan runs on
    with pytest.raises(EngineError, match=r"model.plan has 1 optimization profile\(s\); option profile is 1"):
        make_file_engine("tensorrt", path, sig, Target("cuda"), {"profile": 1}).prepare(cache)
    two = tmp_path / "two.plan"
    two.write_bytes(_multi_plan(onnx_path, profiles=2))
    stream = Stream(0)
    eng = make_file_engine("tensorrt", two, sig, Target("cuda", stream=stream), {"profile": 1})
    eng.prepare(cache)
    assert standin.args_of(trt, "IExecutionContext.set_optimization_profile_async") == [(1, stream.handle)]
    eng.close()
    # a shape outside the plan's profile is named
    wide = ModelSignature(sig.inputs, sig.outputs, 16)
    eng = make_file_engine("tensorrt", path, wide, Target("cuda"))
    eng.prepare(cache)
    with pytest.raises(EngineError, match=r"refuses input '.*' of shape \[12, .*outside its optimization profile"):
        eng.run(fm.multi_inputs(12))
    eng.close()
    failing = standin.make(fail_execute=True)
    monkeypatch.setitem(sys.modules, "tensorrt", failing)
    eng = make_file_engine("tensorrt", path, sig, Target("cuda"))
    eng.prepare(cache)
    with pytest.raises(EngineError, match=r"execute_async_v3 failed on model.plan"):
        eng.run(fm.multi_inputs(1))
    eng.close()


@pytest.mark.gpu
def test_on_a_gpu_a_real_plan_equals_tensorrt_run_directly(tmp_path: Path) -> None:
    """A real TensorRT plan built here from the multi-input ONNX model (where tensorrt is installed on the
    GPU host), run by the engine and by TensorRT directly (set_tensor_address/execute_async_v3 over torch
    CUDA tensors), at batch 1, the middle and the max."""
    import importlib.util

    if "tensorrt" not in sys.modules and importlib.util.find_spec("tensorrt") is None:
        pytest.skip("the tensorrt package is not installed on this GPU host (pip install 'gpuprims[gpu-engines]')")
    import tensorrt as real
    import torch

    onnx_path, sig = fm.multi_io(tmp_path / "multi.onnx")
    logger = real.Logger(real.Logger.WARNING)
    builder = real.Builder(logger)
    network = builder.create_network(0)
    parser = real.OnnxParser(network, logger)
    assert parser.parse(onnx_path.read_bytes())
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for spec in sig.inputs:
        profile.set_shape(spec.name, (1, *spec.dims), (MAX // 2, *spec.dims), (MAX, *spec.dims))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    path = tmp_path / "model.plan"
    path.write_bytes(bytes(plan))
    eng = make_file_engine("tensorrt", path, sig, Target("cuda"))
    eng.prepare(EngineCache(tmp_path / "cache"))
    engine = real.Runtime(logger).deserialize_cuda_engine(bytes(plan))
    ctx = engine.create_execution_context()
    for n in (1, MAX // 2, MAX):
        x = fm.multi_inputs(n, seed=n)
        got = eng.run(x)
        keep = {k: torch.from_numpy(v).cuda() for k, v in x.items()}
        for k, t in keep.items():
            ctx.set_input_shape(k, tuple(t.shape))
            ctx.set_tensor_address(k, t.data_ptr())
        outs = {}
        for spec in sig.outputs:
            outs[spec.name] = torch.empty(tuple(ctx.get_tensor_shape(spec.name)),
                                          dtype=torch.from_numpy(np.zeros(0, spec.datatype.numpy)).dtype, device="cuda")
            ctx.set_tensor_address(spec.name, outs[spec.name].data_ptr())
        s = torch.cuda.Stream()
        ctx.execute_async_v3(s.cuda_stream)
        s.synchronize()
        for name, ref in outs.items():
            np.testing.assert_allclose(got[name], ref.cpu().numpy(), *TensorRTFileEngine.tolerance)
