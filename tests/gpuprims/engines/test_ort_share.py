"""Param-Share for ONNX Runtime (:mod:`gpuprims.engines.ort_share`): sessions take their initializers
from one shared-memory segment, ORT really reads that segment (a change to it changes the answer),
every session of a model gives the answers of a session with its own copy, and each failure is one
clear error or a logged fall-back to an own copy. Models are built in tmp_path with onnx.helper."""

from __future__ import annotations

import json
import logging
import mmap
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from gpuprims.cuda.ipc import ENV_OWNER_PID, ParameterHandles
from gpuprims.engines import EngineCache, EngineError, ModelSource, Target, make_engine
from gpuprims.engines.file_onnx import OnnxRuntimeFileEngine
from gpuprims.engines.files import make_file_engine
from gpuprims.engines.ort_share import (
    DISABLE_PREPACKING,
    InitializerSource,
    export_initializers,
    map_initializers,
    open_session,
    read_initializers,
    take_shared,
)
from gpuprims.tensors import DataType, ModelSignature, TensorSpec
from tests.gpuprims.engines.filemodels import IR_VERSION, OPSET
from tests.gpuprims.engines.tinynet import SPEC as TINY

CPU = Target("cpu", threads=1)
SHM = Path("/dev/shm")
ROOT = Path(__file__).resolve().parents[3]


def dense_model(path: Path, seed: int = 0) -> tuple[Path, ModelSignature]:
    """y = relu(x @ W + b) @ W2: two weight matrices and a bias (a few KB)."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "b"),
             numpy_helper.from_array(rng.standard_normal((32, 8)).astype(np.float32), "W2")]
    nodes = [helper.make_node("Gemm", ["x", "W", "b"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["y"])]
    graph = helper.make_graph(nodes, "dense", [helper.make_tensor_value_info("x", TP.FLOAT, ["n", 16])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, ["n", 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    onnx.save(model, str(path))
    sig = ModelSignature((TensorSpec("x", DataType.FP32, (16,)),), (TensorSpec("y", DataType.FP32, (8,)),),
                         max_batch_size=4)
    return path, sig


def _no_initializers(path: Path) -> Path:
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "bare",
                              [helper.make_tensor_value_info("x", TP.FLOAT, ["n", 4])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, ["n", 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION),
              str(path))
    return path


@pytest.fixture(autouse=True)
def _segments(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Segments named after this test's own owner id, all removed afterwards."""
    owner = str(os.getpid() * 1000 + 7)
    monkeypatch.setenv(ENV_OWNER_PID, owner)
    yield
    for p in SHM.glob(f"gpuprims-params-{owner}-*"):
        p.unlink()


def _session(path: Path, shared: object | None = None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if shared is not None:
        shared.add_to(ort, so)  # type: ignore[attr-defined]
    return ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])


def _x() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)


def test_sessions_over_the_segment_answer_as_a_session_with_its_own_copy(tmp_path: Path) -> None:
    path, _ = dense_model(tmp_path / "dense.onnx")
    want = _session(path).run(None, {"x": _x()})[0]
    exported = export_initializers(path, tmp_path / "h.bin")
    assert exported.mode == "exported" and set(exported.arrays) == {"W", "b", "W2"}
    imported = map_initializers((tmp_path / "h.bin").read_bytes())
    assert imported.mode == "imported" and imported.handles.token == exported.handles.token
    for shared in (exported, imported):
        np.testing.assert_array_equal(_session(path, shared).run(None, {"x": _x()})[0], want)
    assert exported.nbytes == (16 * 32 + 32 + 32 * 8) * 4
    assert exported.describe()["initializers"] == 3


def test_ort_reads_the_shared_segment_not_a_copy_of_its_own(tmp_path: Path) -> None:
    """Writing the segment (through a writable mapping of the node's object) changes what an already
    created session answers: ORT computes on the segment's pages."""
    path, _ = dense_model(tmp_path / "dense.onnx")
    shared = map_initializers(export_initializers(path, tmp_path / "h.bin").handles)
    sess = _session(path, shared)
    before = sess.run(None, {"x": _x()})[0]
    entry = next(e for e in shared.handles.entries if e.names == ("W2",))
    fd = os.open(SHM / shared.handles.handle.decode(), os.O_RDWR)
    try:
        with mmap.mmap(fd, shared.handles.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
            w2 = np.frombuffer(mm, dtype=np.float32, count=entry.nbytes // 4, offset=entry.offset)
            w2 *= 2.0
            del w2
    finally:
        os.close(fd)
    after = sess.run(None, {"x": _x()})[0]
    np.testing.assert_allclose(after, 2.0 * before, rtol=1e-6)


def test_a_session_that_refuses_the_shared_initializers_loads_its_own_copy(tmp_path: Path) -> None:
    path, _ = dense_model(tmp_path / "dense.onnx")
    shared = export_initializers(path, tmp_path / "h.bin")

    def make(s: object | None) -> str:
        if s is not None:
            raise EngineError("refused")
        return "own session"

    assert open_session(make, shared, None, "test") == ("own session", None, "EngineError: refused")
    assert open_session(lambda s: "shared session", shared, None, "test") == ("shared session", shared, None)


def test_a_sharing_session_does_not_prepack_into_buffers_of_its_own(tmp_path: Path) -> None:
    path, _ = dense_model(tmp_path / "dense.onnx")
    shared = export_initializers(path, tmp_path / "h.bin")
    so = ort.SessionOptions()
    shared.add_to(ort, so)
    assert so.get_session_config_entry(DISABLE_PREPACKING) == "1"


def test_the_file_engine_exports_then_imports_and_says_so(tmp_path: Path) -> None:
    path, sig = dense_model(tmp_path / "dense.onnx")
    cache = EngineCache(tmp_path / "cache")
    reference = make_file_engine("onnxruntime", path, sig, CPU)
    reference.prepare(cache)
    want = reference.run({"x": _x()})["y"]
    assert reference.describe()["initializers"] == {"mode": "own"}
    handles = tmp_path / "h.bin"
    engines = []
    for mode in ("export", "import"):
        eng = make_file_engine("onnxruntime", path, sig, CPU)
        assert isinstance(eng, OnnxRuntimeFileEngine)
        eng.initializers_from = InitializerSource.parse(f"{mode}:{handles}", lambda p: Path(p).read_bytes())
        eng.prepare(cache)
        np.testing.assert_allclose(eng.run({"x": _x()})["y"], want, rtol=1e-5, atol=1e-5)
        assert eng.describe()["initializers"]["mode"] == f"{mode}ed"
        engines.append(eng)
    segment = engines[0].describe()["initializers"]["segment"]
    assert engines[1].describe()["initializers"]["segment"] == segment and (SHM / segment).exists()
    for eng in engines:
        eng.close()


def test_the_zoo_engine_shares_its_optimized_models_initializers(tmp_path: Path) -> None:
    source = ModelSource(TINY, (3, 16, 16), max_batch=2, num_classes=10)
    cache = EngineCache(tmp_path / "cache")
    module = source.build_module()
    x = torch.ones((2, 3, 16, 16))
    own = make_engine("onnxruntime", source, CPU, cache=cache)
    own.prepare(module)
    want = own.run(x).numpy()
    handles = tmp_path / "h.bin"
    for mode in ("export", "import"):
        eng = make_engine("onnxruntime", source, CPU, cache=cache)
        eng.initializers_from = InitializerSource.parse(  # type: ignore[attr-defined]
            f"{mode}:{handles}", lambda p: Path(p).read_bytes())
        eng.prepare(module)
        np.testing.assert_allclose(eng.run(x).numpy(), want, rtol=1e-5, atol=1e-5)
        assert eng.describe()["initializers"]["mode"] == f"{mode}ed"
        eng.close()


# -- bad input and faults -------------------------------------------------------------------------------
def test_a_model_without_initializers_fails_its_export_and_tells_the_waiting_importers(tmp_path: Path) -> None:
    path = _no_initializers(tmp_path / "bare.onnx")
    with pytest.raises(OSError, match="no initializers"):
        read_initializers(path) or export_initializers(path, tmp_path / "h.bin")
    source = InitializerSource("export", str(tmp_path / "h.bin"), lambda p: b"")
    with pytest.raises(OSError, match="no initializers"):
        source.get(path)
    assert "no initializers" in (tmp_path / "h.bin.error").read_text()
    assert not (tmp_path / "h.bin").exists()


def test_mapping_a_released_or_malformed_export_is_a_clear_error(tmp_path: Path) -> None:
    path, _ = dense_model(tmp_path / "dense.onnx")
    handles = export_initializers(path, tmp_path / "h.bin").handles
    (SHM / handles.handle.decode()).unlink()
    with pytest.raises(ValueError, match="do not exist"):
        map_initializers(handles)
    with pytest.raises(ValueError, match="bad magic"):
        map_initializers(b"not handles")
    with pytest.raises(ValueError, match="another model"):
        map_initializers(handles, _no_initializers(tmp_path / "bare.onnx"))
    cuda = ParameterHandles("cuda", "t", 1, 64, b"\0" * 64, "0000:00:00.0", ())
    with pytest.raises(ValueError, match="CPU shared memory"):
        map_initializers(cuda)


def test_a_short_segment_is_refused(tmp_path: Path) -> None:
    path, _ = dense_model(tmp_path / "dense.onnx")
    handles = export_initializers(path, tmp_path / "h.bin").handles
    os.truncate(SHM / handles.handle.decode(), 16)
    with pytest.raises(ValueError, match="less than"):
        map_initializers(handles)


@pytest.mark.parametrize("bad", ["copy:/x", "export:", "import"])
def test_a_malformed_share_mode_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="share_params must be"):
        InitializerSource.parse(bad, lambda p: b"")
    assert InitializerSource.parse(None, lambda p: b"") is None


def test_a_gpu_provider_or_a_failed_import_loads_its_own_copy(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    path, sig = dense_model(tmp_path / "dense.onnx")
    source = InitializerSource("import", str(tmp_path / "h.bin"), lambda p: Path(p).read_bytes())
    shared, why = take_shared(source, path, "cuda", "test")
    assert shared is None and why is not None and "CPU provider only" in why
    with caplog.at_level(logging.WARNING, logger="gpuprims.engines"):
        shared, why = take_shared(source, path, "cpu", "test")  # no handles written: the import fails
    assert shared is None and why is not None and "FileNotFoundError" in why
    assert "loads its own copy" in caplog.text
    eng = make_file_engine("onnxruntime", path, sig, CPU)
    eng.initializers_from = source  # type: ignore[attr-defined]
    eng.prepare(EngineCache(tmp_path / "cache"))
    assert eng.describe()["initializers"]["mode"] == "own" and "FileNotFoundError" in eng.describe()[
        "initializers"]["why"]
    assert eng.run({"x": _x()})["y"].shape == (3, 8)


def test_a_segment_of_another_model_is_refused_and_the_session_loads_its_own_copy(tmp_path: Path) -> None:
    """Initializers of another shape under the model's names (ORT itself would take them at load and
    fail at run): the import is refused by the model's digest and the session loads its own copy."""
    path, sig = dense_model(tmp_path / "dense.onnx")
    other = tmp_path / "other.onnx"
    model = onnx.load(str(path))
    for init in model.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(np.zeros((3, 3), np.float32), init.name))
    onnx.save(model, str(other))
    export_initializers(other, tmp_path / "h.bin")
    eng = make_file_engine("onnxruntime", path, sig, CPU, {"optimization": "disable"})
    eng.initializers_from = InitializerSource("import", str(tmp_path / "h.bin"),  # type: ignore[attr-defined]
                                              lambda p: Path(p).read_bytes())
    eng.prepare(EngineCache(tmp_path / "cache"))
    init = eng.describe()["initializers"]
    assert init["mode"] == "own" and "another model" in init["why"]
    want = _session(path).run(None, {"x": _x()})[0]
    np.testing.assert_allclose(eng.run({"x": _x()})["y"], want, rtol=1e-5, atol=1e-5)


def test_sharing_an_onnx_files_initializers_maps_no_torch(tmp_path: Path) -> None:
    """Exporting and importing (the file engine's whole sharing path) imports neither torch nor the zoo."""
    path, sig = dense_model(tmp_path / "dense.onnx")
    owner = os.environ[ENV_OWNER_PID]
    code = ("import sys, json, numpy as np\n"
            "from pathlib import Path\n"
            "from gpuprims.engines import EngineCache, Target\n"
            "from gpuprims.engines.files import make_file_engine\n"
            "from gpuprims.engines.ort_share import InitializerSource\n"
            "from gpuprims.tensors import ModelSignature\n"
            f"sig = ModelSignature.from_dict(json.loads({json.dumps(sig.to_dict())!r}))\n"
            "for mode in ('export', 'import'):\n"
            f"    e = make_file_engine('onnxruntime', {str(path)!r}, sig, Target('cpu', threads=1))\n"
            f"    e.initializers_from = InitializerSource.parse(mode + ':' + {str(tmp_path / 'h.bin')!r},\n"
            "                                                  lambda p: Path(p).read_bytes())\n"
            f"    e.prepare(EngineCache({str(tmp_path / 'c')!r}))\n"
            "    assert e.describe()['initializers']['mode'] == mode + 'ed'\n"
            "    assert e.run({'x': np.ones((2, 16), np.float32)})['y'].shape == (2, 8)\n"
            "assert 'torch' not in sys.modules and 'apps.zoo' not in sys.modules\n"
            "print('ok')\n")
    env = {**os.environ, ENV_OWNER_PID: owner}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
