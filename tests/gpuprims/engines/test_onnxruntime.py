"""``engine: onnxruntime``: options checked, threads from the target and no spinning, the ONNX and ORT's
optimized model kept in the cache so a second start builds nothing, outputs equal to eager; on CUDA, I/O
binding of the device batch on the target's stream, proven against a recording stand-in of the ORT API."""

from __future__ import annotations

import ctypes
import types
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch

from gpuprims.engines import EngineCache, EngineError, EngineUnavailable, ModelSource, Target, make_engine
from gpuprims.engines import onnxruntime as ort_engine
from gpuprims.engines.onnxruntime import OnnxRuntimeEngine
from tests.gpuprims.engines.tinynet import SPEC

SRC = ModelSource(SPEC, (3, 16, 16), max_batch=4, num_classes=10)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the module's CPU tests: the first prepare builds, the others find it."""
    return tmp_path_factory.mktemp("engine-cache")


def _eager(src: ModelSource, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return src.build_module()(x)


# -- options and backends -----------------------------------------------------------------------------------
@pytest.mark.parametrize("provider", ["cuda", "tensorrt"])
def test_gpu_providers_are_refused_on_the_cpu_backend(provider: str) -> None:
    with pytest.raises(EngineUnavailable, match=f"provider '{provider}' needs the cuda backend; this node runs "
                                                f"on cpu") as info:
        OnnxRuntimeEngine.check("cpu", {"provider": provider})
    assert "\n" not in str(info.value)
    with pytest.raises(EngineUnavailable):
        make_engine("onnxruntime", SRC, Target("cpu"), {"provider": provider})


@pytest.mark.parametrize(("options", "reason"), [
    ({"provider": "rocm"}, "provider must be one of cpu, cuda, tensorrt, got 'rocm'"),
    ({"optimization": "max"}, "optimization must be one of disable, basic, extended, all, got 'max'"),
    ({"precision": "int8"}, "precision must be one of fp32, fp16, got 'int8'"),
    ({"precision": "fp16"}, "precision 'fp16' needs provider 'tensorrt'"),
    ({"threads": 2}, r"has no option\(s\) \['threads'\]"),
])
def test_bad_options_are_named(options: dict[str, Any], reason: str) -> None:
    with pytest.raises(EngineError, match=reason):
        OnnxRuntimeEngine.check("cuda", options)


def test_check_accepts_every_provider_on_cuda() -> None:
    for provider in ("cpu", "cuda", "tensorrt"):
        OnnxRuntimeEngine.check("cuda", {"provider": provider})
    OnnxRuntimeEngine.check("cuda", {"provider": "tensorrt", "precision": "fp16"})


def test_a_gpu_provider_missing_from_this_build_is_named(fake_cuda: Any, tmp_path: Path) -> None:
    eng = make_engine("onnxruntime", SRC, Target("cuda"), {"provider": "cuda"}, cache=EngineCache(tmp_path))
    with pytest.raises(EngineUnavailable, match=r"provider 'cuda' .* is not in this onnxruntime build.*onnxruntime-gpu"):
        eng.prepare()
    assert EngineCache(tmp_path).entries() == []  # refused before building anything


# -- CPU: built once, threads, equal to eager ----------------------------------------------------------------
@pytest.mark.slow
def test_cpu_engine_equals_eager_and_keeps_its_artefacts(cache_dir: Path) -> None:
    eng = make_engine("onnxruntime", SRC, Target("cpu", threads=1), cache=EngineCache(cache_dir))
    info = eng.prepare()
    entry = Path(info.artefact or "")
    assert (entry / "model.onnx").is_file() and (entry / "model.opt.onnx").is_file()
    for n in (1, 2, 4):
        x = torch.randn(n, *SRC.input_shape, generator=torch.Generator().manual_seed(n))
        got = eng.run(x)
        assert isinstance(got, torch.Tensor) and got.shape == (n, 10) and got.dtype == torch.float32
        torch.testing.assert_close(got, _eager(SRC, x), rtol=eng.tolerance[0], atol=eng.tolerance[1])
    d = eng.describe()
    assert d["kind"] == "onnxruntime" and d["provider"] == "cpu" and d["threads"] == 1
    assert d["fingerprint"] == info.fingerprint and d["tolerance"] == list(eng.tolerance)
    assert eng.static_input() is None
    eng.close()
    assert not eng.prepared


def test_second_prepare_is_a_cache_hit_and_exports_nothing(cache_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    first = make_engine("onnxruntime", SRC, Target("cpu", threads=1), cache=EngineCache(cache_dir))
    first.prepare()

    def no_export(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a cached engine exported the model again")

    monkeypatch.setattr(ort_engine, "export_onnx", no_export)
    # another share (2 threads) and a fresh engine object: the same entry
    second = make_engine("onnxruntime", SRC, Target("cpu", threads=2), cache=EngineCache(cache_dir))
    info = second.prepare()
    assert info.cache_hit and info.build_ms == 0.0 and info.fingerprint == first.info.fingerprint
    x = torch.randn(3, *SRC.input_shape)
    torch.testing.assert_close(second.run(x), first.run(x))
    # another optimization level is another artefact: it would build (and so export)
    other = make_engine("onnxruntime", SRC, Target("cpu"), {"optimization": "basic"}, cache=EngineCache(cache_dir))
    with pytest.raises(AssertionError, match="exported the model again"):
        other.prepare()


def test_session_threads_come_from_the_target_and_do_not_spin(cache_dir: Path) -> None:
    for threads in (1, 2):
        eng = make_engine("onnxruntime", SRC, Target("cpu", threads=threads), cache=EngineCache(cache_dir))
        eng.prepare()
        so = eng.session.get_session_options()
        assert so.intra_op_num_threads == threads and so.inter_op_num_threads == 1
        assert so.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
        assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
        assert so.get_session_config_entry("session.inter_op.allow_spinning") == "0"
        eng.close()


def test_threads_default_to_the_affinity(cache_dir: Path) -> None:
    eng = make_engine("onnxruntime", SRC, Target("cpu"), cache=EngineCache(cache_dir))
    assert eng.threads == ort_engine.default_threads() >= 1


def test_bad_batches_and_unprepared_runs_are_refused(cache_dir: Path) -> None:
    eng = make_engine("onnxruntime", SRC, Target("cpu", threads=1), cache=EngineCache(cache_dir))
    with pytest.raises(EngineError, match="not prepared"):
        eng.run(torch.zeros(1, *SRC.input_shape))
    eng.prepare()
    with pytest.raises(EngineError, match=r"batch of 5 is outside 1\.\.4"):
        eng.run(torch.zeros(5, *SRC.input_shape))
    # a uint8 app's batch is taken as float, as eager would be given it
    x = torch.randint(0, 255, (2, *SRC.input_shape), dtype=torch.uint8)
    torch.testing.assert_close(eng.run(x), _eager(SRC, x.float()), rtol=eng.tolerance[0], atol=eng.tolerance[1])


def test_a_corrupt_optimized_model_is_rebuilt(cache_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = ModelSource(SPEC, (3, 16, 16), max_batch=2, num_classes=10, seed=7)
    eng = make_engine("onnxruntime", src, Target("cpu", threads=1), cache=EngineCache(cache_dir))
    entry = Path(eng.prepare().artefact or "")
    (entry / "model.opt.onnx").write_bytes(b"garbage")
    again = make_engine("onnxruntime", src, Target("cpu", threads=1), cache=EngineCache(cache_dir))
    with caplog.at_level("WARNING", logger="gpuprims.engines"):
        info = again.prepare()
    assert not info.cache_hit and "corrupt" in caplog.text
    x = torch.randn(2, *src.input_shape)
    torch.testing.assert_close(again.run(x), _eager(src, x), rtol=again.tolerance[0], atol=again.tolerance[1])


# -- CUDA: I/O binding against a recording stand-in of the ORT API ------------------------------------------
class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []


class _SessionOptions:
    def __init__(self, rec: _Recorder) -> None:
        object.__setattr__(self, "_rec", rec)
        object.__setattr__(self, "config", {})
        object.__setattr__(self, "optimized_model_filepath", "")

    def __setattr__(self, name: str, value: Any) -> None:
        self._rec.calls.append(("SessionOptions." + name, value))
        object.__setattr__(self, name, value)

    def add_session_config_entry(self, key: str, value: str) -> None:
        self._rec.calls.append(("SessionOptions.add_session_config_entry", (key, value)))
        self.config[key] = value


class _RunOptions:
    def __init__(self, rec: _Recorder) -> None:
        self.rec = rec
        self.config: dict[str, str] = {}

    def add_run_config_entry(self, key: str, value: str) -> None:
        self.rec.calls.append(("RunOptions.add_run_config_entry", (key, value)))
        self.config[key] = value


class _IOBinding:
    def __init__(self, rec: _Recorder) -> None:
        self.rec = rec
        self.inputs: dict[str, dict[str, Any]] = {}
        self.outputs: dict[str, dict[str, Any]] = {}

    def bind_input(self, name: str, device_type: str, device_id: int, element_type: Any, shape: Any,
                   buffer_ptr: int) -> None:
        kw = {"device_type": device_type, "device_id": device_id, "element_type": element_type,
              "shape": tuple(shape), "buffer_ptr": buffer_ptr}
        self.rec.calls.append(("IOBinding.bind_input", {"name": name, **kw}))
        self.inputs[name] = kw

    def bind_output(self, name: str, device_type: str = "cpu", device_id: int = 0, element_type: Any = None,
                    shape: Any = None, buffer_ptr: int | None = None) -> None:
        kw = {"device_type": device_type, "device_id": device_id, "element_type": element_type,
              "shape": tuple(shape) if shape is not None else None, "buffer_ptr": buffer_ptr}
        self.rec.calls.append(("IOBinding.bind_output", {"name": name, **kw}))
        self.outputs[name] = kw


def _array_at(ptr: int, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 memory at a bound address (host memory: the fake runtime's device is the host)."""
    count = int(np.prod(shape))
    return np.ctypeslib.as_array((ctypes.c_float * count).from_address(ptr)).reshape(shape)


class _Session:
    """Records how the engine builds and drives a session; computes with a real CPU session over the same
    file, reading the input from and writing the output to the bound addresses, as the CUDA EP would."""

    def __init__(self, rec: _Recorder, path: str, sess_options: Any = None, providers: Any = None) -> None:
        rec.calls.append(("InferenceSession", {"path": Path(path).name, "providers": providers}))
        self.rec = rec
        self.options = sess_options
        if sess_options is not None and sess_options.optimized_model_filepath:
            Path(sess_options.optimized_model_filepath).write_bytes(Path(path).read_bytes())
        if providers and providers[0][0] == "TensorrtExecutionProvider":
            (Path(providers[0][1]["trt_engine_cache_path"]) / "plan.engine").write_bytes(b"plan")
        self.real = ort.InferenceSession(path, providers=["CPUExecutionProvider"])

    def io_binding(self) -> _IOBinding:
        self.rec.calls.append(("InferenceSession.io_binding", None))
        return _IOBinding(self.rec)

    def run_with_iobinding(self, binding: _IOBinding, run_options: Any = None) -> None:
        self.rec.calls.append(("InferenceSession.run_with_iobinding", dict(run_options.config)))
        i, o = binding.inputs["input"], binding.outputs["output"]
        assert i["device_type"] == o["device_type"] == "cuda" and i["element_type"] is np.float32
        x = _array_at(i["buffer_ptr"], i["shape"]).copy()
        (y,) = self.real.run(["output"], {"input": x})
        assert y.shape == o["shape"]
        _array_at(o["buffer_ptr"], o["shape"])[...] = y


def _stand_in(rec: _Recorder) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        SessionOptions=lambda: _SessionOptions(rec), RunOptions=lambda: _RunOptions(rec),
        InferenceSession=lambda path, sess_options=None, providers=None: _Session(rec, path, sess_options,
                                                                                  providers),
        GraphOptimizationLevel=ort.GraphOptimizationLevel, ExecutionMode=ort.ExecutionMode,
        get_available_providers=lambda: ["TensorrtExecutionProvider", "CUDAExecutionProvider",
                                         "CPUExecutionProvider"])


def _calls(rec: _Recorder, name: str) -> list[Any]:
    return [arg for n, arg in rec.calls if n == name]


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch, fake_cuda: Any) -> _Recorder:
    rec = _Recorder()
    monkeypatch.setattr(ort_engine, "_ort", lambda: _stand_in(rec))
    return rec


def test_cuda_io_binding_on_the_targets_stream(recorded: _Recorder, tmp_path: Path) -> None:
    from gpuprims.cuda.event import Stream

    stream = Stream(0)
    try:
        eng = make_engine("onnxruntime", SRC, Target("cuda", device_index=0, threads=1, stream=stream),
                          {"provider": "cuda"}, cache=EngineCache(tmp_path))
        eng.prepare()
        sessions = _calls(recorded, "InferenceSession")
        assert [s["path"] for s in sessions] == ["model.onnx", "model.opt.onnx"]  # build, then load
        for s in sessions:
            assert s["providers"] == [("CUDAExecutionProvider", {
                "device_id": "0", "has_user_compute_stream": "1", "user_compute_stream": str(stream.handle)})]
        assert ("SessionOptions.intra_op_num_threads", 1) in recorded.calls
        assert ("SessionOptions.add_session_config_entry", ("session.intra_op.allow_spinning", "0")) \
            in recorded.calls
        assert _calls(recorded, "RunOptions.add_run_config_entry") == [
            ("disable_synchronize_execution_providers", "1")]
        static = eng.static_input()
        assert static is not None and static.shape == (4, *SRC.input_shape)
        for n in (1, 3, 4):
            # GPU-DMA gathers into the static input; the engine binds that memory where it lies
            static[:n] = torch.randn(n, *SRC.input_shape, generator=torch.Generator().manual_seed(n))
            before = len(recorded.calls)
            out = eng.run(static[:n])
            new = recorded.calls[before:]
            assert [c for c, _ in new] == ["IOBinding.bind_input", "IOBinding.bind_output",
                                           "InferenceSession.run_with_iobinding"]
            bi, bo = new[0][1], new[1][1]
            assert bi == {"name": "input", "device_type": "cuda", "device_id": 0, "element_type": np.float32,
                          "shape": (n, *SRC.input_shape), "buffer_ptr": static.data_ptr()}
            assert bo["name"] == "output" and bo["shape"] == (n, 10) and bo["buffer_ptr"] == out.data_ptr()
            assert out.data_ptr() == eng._output.data_ptr()  # the preallocated output, no allocation
            torch.testing.assert_close(out, _eager(SRC, static[:n].clone()), rtol=eng.tolerance[0],
                                       atol=eng.tolerance[1])
        assert len(_calls(recorded, "InferenceSession.io_binding")) == 1  # one binding, rebound per batch
    finally:
        stream.close()


def test_cuda_without_a_stream_leaves_ort_its_own(recorded: _Recorder, tmp_path: Path) -> None:
    eng = make_engine("onnxruntime", SRC, Target("cuda"), {"provider": "cuda"}, cache=EngineCache(tmp_path))
    eng.prepare()
    for s in _calls(recorded, "InferenceSession"):
        assert s["providers"] == [("CUDAExecutionProvider", {"device_id": "0"})]


def test_tensorrt_provider_profile_precision_and_plan_cache(recorded: _Recorder, tmp_path: Path) -> None:
    eng = make_engine("onnxruntime", SRC, Target("cuda", device_index=0), {"provider": "tensorrt",
                                                                           "precision": "fp16"},
                      cache=EngineCache(tmp_path))
    info = eng.prepare()
    entry = Path(info.artefact or "")
    assert not (entry / "model.opt.onnx").exists() and (entry / "trt" / "plan.engine").is_file()
    sessions = _calls(recorded, "InferenceSession")
    assert [s["path"] for s in sessions] == ["model.onnx", "model.onnx"]
    (trt_name, trt), (cuda_name, _) = sessions[1]["providers"]
    assert trt_name == "TensorrtExecutionProvider" and cuda_name == "CUDAExecutionProvider"
    assert trt["trt_fp16_enable"] == "1" and trt["trt_engine_cache_enable"] == "1"
    assert trt["trt_engine_cache_path"] == str(entry / "trt")
    assert (trt["trt_profile_min_shapes"], trt["trt_profile_opt_shapes"], trt["trt_profile_max_shapes"]) == (
        "input:1x3x16x16", "input:2x3x16x16", "input:4x3x16x16")
    assert eng.describe()["tolerance"] == list(OnnxRuntimeEngine.fp16_tolerance)
    x = torch.randn(2, *SRC.input_shape)
    torch.testing.assert_close(eng.run(x), _eager(SRC, x), rtol=2e-2, atol=2e-2)
    # a second start loads the plan from the entry: no export, no new build
    again = make_engine("onnxruntime", SRC, Target("cuda"), {"provider": "tensorrt", "precision": "fp16"},
                        cache=EngineCache(tmp_path))
    assert again.prepare().cache_hit
