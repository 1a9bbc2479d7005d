"""``engine: tensorrt`` against a recording stand-in of the ``tensorrt`` package (tests/.../trt_standin.py)
on the fake CUDA runtime: the API calls and their arguments (explicit-batch network, the ONNX parser, the
profile's three shapes, precision flags, workspace, tensor addresses = the static input, the stream
handle), the plan cached with TensorRT's version and the compute capability, parse and build failures,
FP16 rules; and the ONNX it consumes checked with ONNX Runtime on the CPU against eager."""

from __future__ import annotations

import gc
import sys
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch

from gpuprims.cuda.event import Event, Stream
from gpuprims.engines import (
    EngineCache,
    EngineError,
    EngineUnavailable,
    ExportError,
    ModelSource,
    Target,
    check_engine,
    make_engine,
)
from gpuprims.engines.tensorrt import ONNX, TOLERANCES
from tests.gpuprims.engines import trt_standin

MAX = 8
SOURCE = ModelSource("tests.gpuprims.engines.nets:tiny", (3, 8, 8), max_batch=MAX)


def _eager(x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return SOURCE.build_module("cpu")(x)


@pytest.fixture
def trt(monkeypatch: pytest.MonkeyPatch) -> Any:
    mod = trt_standin.make()
    monkeypatch.setitem(sys.modules, "tensorrt", mod)
    return mod


def _use(monkeypatch: pytest.MonkeyPatch, **kw: Any) -> Any:
    mod = trt_standin.make(**kw)
    monkeypatch.setitem(sys.modules, "tensorrt", mod)
    return mod


def test_check_refuses_cpu_missing_library_and_bad_options(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(EngineUnavailable, match=r"'tensorrt' needs the cuda backend; this node runs on cpu"):
        check_engine("tensorrt", "cpu")
    monkeypatch.delitem(sys.modules, "tensorrt", raising=False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(EngineUnavailable, match=r"needs the tensorrt package .*gpu-engines"):
        check_engine("tensorrt", "cuda")
    _use(monkeypatch)
    check_engine("tensorrt", "cuda", {"precision": "fp16", "opt_batch": 4, "workspace_mb": 512})
    for bad, match in (({"precision": "int8"}, "precision must be one of"), ({"opt_batch": 0}, "opt_batch"),
                       ({"workspace_mb": 1}, "workspace_mb"), ({"profile": 1}, "no option")):
        with pytest.raises(EngineError, match=match):
            check_engine("tensorrt", "cuda", bad)
    with pytest.raises(EngineError, match="opt_batch 9 exceeds max_batch 8"):
        make_engine("tensorrt", SOURCE, Target("cuda"), {"opt_batch": 9})


@pytest.mark.slow
def test_builds_runs_and_caches_the_plan(fake_cuda: Any, trt: Any, tmp_path: Any) -> None:
    cache = EngineCache(tmp_path / "cache")
    stream = Stream(0)
    eng = make_engine("tensorrt", SOURCE, Target("cuda", stream=stream), {"opt_batch": 4}, cache=cache)
    msgs: list[tuple[str, float | None]] = []
    info = eng.prepare(progress=lambda m, f: msgs.append((m, f)))
    assert not info.cache_hit and info.fingerprint in cache.entries()
    # the API shape: explicit-batch network (no flag), parser, config, the profile's three shapes
    assert trt_standin.args_of(trt, "Builder.create_network") == [(0,)]
    assert trt_standin.args_of(trt, "IOptimizationProfile.set_shape") == [
        ("input", (1, 3, 8, 8), (4, 3, 8, 8), (8, 3, 8, 8))]
    assert trt_standin.args_of(trt, "IBuilderConfig.set_memory_pool_limit") == [(trt.MemoryPoolType.WORKSPACE,
                                                                                  1024 << 20)]
    assert trt_standin.args_of(trt, "IBuilderConfig.clear_flag") == [(trt.BuilderFlag.TF32,)]
    assert trt_standin.args_of(trt, "IBuilderConfig.set_flag") == []
    order = trt_standin.names(trt)
    assert order.index("OnnxParser.parse") < order.index("Builder.build_serialized_network") \
        < order.index("Runtime.deserialize_cuda_engine") < order.index("ICudaEngine.create_execution_context")
    # the build said how far it was (IProgressMonitor phases and steps)
    assert any("Building engine step 2/2" in m for m, _ in msgs) and any("building the fp32 plan" in m for m, _ in msgs)
    # bindings: the input is the static device buffer (GPU-DMA's target); the output our device buffer
    static = eng.static_input()
    addrs = dict(trt_standin.args_of(trt, "IExecutionContext.set_tensor_address"))
    assert addrs["input"] == static.data_ptr() and tuple(static.shape) == (MAX, 3, 8, 8)
    assert any(r.handle == addrs["output"] for r in fake_cuda.live("device"))
    ev = Event(0)
    rtol, atol = TOLERANCES["fp32"]
    rng = torch.Generator().manual_seed(2)
    for n in (1, MAX // 2, MAX, 3):
        x = torch.rand((n, 3, 8, 8), generator=rng)
        out = eng.run(x)
        ev.record(stream)
        ev.wait(50, timeout_s=30)
        torch.testing.assert_close(out, _eager(x), rtol=rtol, atol=atol)
    assert {a for (a,) in trt_standin.args_of(trt, "IExecutionContext.execute_async_v3")} == {stream.handle}
    shapes = [s[0] for _, s in trt_standin.args_of(trt, "IExecutionContext.set_input_shape")]
    assert shapes == [MAX, 1, MAX // 2, MAX, 3]  # max at load, then each batch whose size changed
    d = eng.describe()
    assert d["kind"] == "tensorrt" and d["tensorrt"] == "10.9.0" and d["cc"] == "8.6" and d["runs"] == 4
    eng.close()
    # a second engine (a restart, a change of share) takes the plan from the cache: no build
    builds = trt_standin.names(trt).count("Builder.build_serialized_network")
    again = make_engine("tensorrt", SOURCE, Target("cuda", stream=stream), {"opt_batch": 4}, cache=cache)
    assert again.prepare().cache_hit
    assert trt_standin.names(trt).count("Builder.build_serialized_network") == builds
    x = torch.rand((2, 3, 8, 8), generator=rng)
    static = again.static_input()
    static[:2].copy_(x)  # as GPU-DMA would: no copy on the way in
    out = again.run(static[:2])
    again.synchronize()
    torch.testing.assert_close(out, _eager(x), rtol=rtol, atol=atol)
    again.close()
    ev.close()
    stream.close()
    gc.collect()
    assert fake_cuda.live("device") == [] and fake_cuda.live("stream") == [] and fake_cuda.unsafe_frees == []


def test_the_plan_is_keyed_by_tensorrt_version_and_compute_capability(fake_cuda: Any, monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Any) -> None:
    cache = EngineCache(tmp_path)
    keys = []
    for version in ("10.9.0", "10.13.2"):
        _use(monkeypatch, version=version)
        eng = make_engine("tensorrt", SOURCE, Target("cuda"), cache=cache)
        keys.append(eng.prepare().fingerprint)
        assert cache.lookup(keys[-1]).meta["tensorrt"] == version
        eng.close()
    from gpuprims.testing import fake

    monkeypatch.setenv(fake.FAKE_ENV, "capability=9.0")
    fake.reset()
    eng = make_engine("tensorrt", SOURCE, Target("cuda"), cache=cache)
    keys.append(eng.prepare().fingerprint)
    assert cache.lookup(keys[-1]).meta["cc"] == "9.0"
    eng.close()
    assert len(set(keys)) == 3


def test_the_onnx_it_consumes_equals_eager_on_onnx_runtime(fake_cuda: Any, trt: Any, tmp_path: Any) -> None:
    cache = EngineCache(tmp_path)
    eng = make_engine("tensorrt", SOURCE, Target("cuda"), cache=cache)
    key = eng.prepare().fingerprint
    eng.close()
    sess = ort.InferenceSession(str(cache.lookup(key).file(ONNX)), providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    rng = np.random.default_rng(0)
    for n in (1, MAX // 2, MAX):
        x = rng.random((n, 3, 8, 8), dtype=np.float32)
        np.testing.assert_allclose(sess.run(None, {name: x})[0], _eager(torch.from_numpy(x)).numpy(),
                                   rtol=1e-5, atol=1e-6)


def test_a_parse_failure_names_the_layer_and_leaves_no_entry(fake_cuda: Any, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Any) -> None:
    _use(monkeypatch, fail_parse=True)
    cache = EngineCache(tmp_path)
    eng = make_engine("tensorrt", SOURCE, Target("cuda"), cache=cache)
    with pytest.raises(ExportError, match=r"parser refused model 'tests.gpuprims.engines.nets:tiny' at layer "
                                          r"'[^']+' \(Conv\): Unsupported operator"):
        eng.prepare()
    assert cache.entries() == [] and not eng.prepared
    assert fake_cuda.live("device") == []


def test_a_build_failure_says_what_tensorrt_logged(fake_cuda: Any, monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Any) -> None:
    _use(monkeypatch, fail_build=True)
    cache = EngineCache(tmp_path)
    eng = make_engine("tensorrt", SOURCE, Target("cuda"), cache=cache)
    with pytest.raises(EngineError, match=r"could not build a plan .*no implementation fits the workspace"):
        eng.prepare()
    assert cache.entries() == [] and fake_cuda.live("device") == []


def test_fp16_where_the_platform_has_fast_fp16_and_refused_elsewhere(fake_cuda: Any, monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Any) -> None:
    trt = _use(monkeypatch, fast_fp16=True)
    eng = make_engine("tensorrt", SOURCE, Target("cuda"), {"precision": "fp16"}, cache=EngineCache(tmp_path / "a"))
    eng.prepare()
    assert trt_standin.args_of(trt, "IBuilderConfig.set_flag") == [(trt.BuilderFlag.FP16,)]
    assert eng.tolerance == TOLERANCES["fp16"]
    x = torch.rand((MAX, 3, 8, 8), generator=torch.Generator().manual_seed(4))
    out = eng.run(x)
    eng.synchronize()
    torch.testing.assert_close(out, _eager(x), rtol=TOLERANCES["fp16"][0], atol=TOLERANCES["fp16"][1])
    eng.close()
    _use(monkeypatch, fast_fp16=False)
    eng = make_engine("tensorrt", SOURCE, Target("cuda"), {"precision": "fp16"}, cache=EngineCache(tmp_path / "b"))
    with pytest.raises(EngineUnavailable, match="fast native FP16"):
        eng.prepare()
    _use(monkeypatch, version="11.3.0")
    eng = make_engine("tensorrt", SOURCE, Target("cuda"), {"precision": "fp16"}, cache=EngineCache(tmp_path / "c"))
    with pytest.raises(EngineUnavailable, match=r"TensorRT 11.3.0 removed BuilderFlag.FP16"):
        eng.prepare()
    # fp32 on TensorRT 11 builds (no FP16 flag exists there, none is asked for)
    eng = make_engine("tensorrt", SOURCE, Target("cuda"), cache=EngineCache(tmp_path / "d"))
    eng.prepare()
    eng.close()


def test_bad_batches_are_refused_by_name(fake_cuda: Any, trt: Any, tmp_path: Any) -> None:
    eng = make_engine("tensorrt", SOURCE, Target("cuda"), cache=EngineCache(tmp_path))
    with pytest.raises(EngineError, match="not prepared"):
        eng.run(torch.zeros(1, 3, 8, 8))
    eng.prepare()
    for bad in (torch.zeros(MAX + 1, 3, 8, 8), torch.zeros(2, 3, 4, 4)):
        with pytest.raises(EngineError, match=r"takes \(n, 3, 8, 8\)"):
            eng.run(bad)
    eng.close()


@pytest.mark.gpu
def test_on_a_gpu_the_real_tensorrt_plan_equals_eager(tmp_path: Any) -> None:
    """The real TensorRT (where installed on the GPU host) on MobileNetV2, fp32, batch 1 and max."""
    import importlib.util

    if "tensorrt" not in sys.modules and importlib.util.find_spec("tensorrt") is None:
        pytest.skip("the tensorrt package is not installed on this GPU host (pip install 'gpuprims[gpu-engines]')")
    source = ModelSource("mobilenet_v2", (3, 64, 64), max_batch=MAX, num_classes=10)
    stream = torch.cuda.Stream()
    eng = make_engine("tensorrt", source, Target("cuda", stream=stream), cache=EngineCache(tmp_path))
    module = source.build_module("cuda")
    eng.prepare(module)
    rtol, atol = TOLERANCES["fp32"]
    for n in (1, MAX):
        x = torch.rand((n, 3, 64, 64), device="cuda")
        torch.cuda.synchronize()
        out = eng.run(x)
        eng.synchronize()
        with torch.no_grad():
            torch.testing.assert_close(out, module(x), rtol=rtol, atol=atol)
    eng.close()
