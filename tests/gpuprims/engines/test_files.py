"""Model files with named tensors on the ONNX engines (``onnxruntime``, ``openvino``), and the interface
they share (:mod:`gpuprims.engines.files`): every answer equals the file run directly in ONNX Runtime
within the engine's stated tolerance at batch 1, a middle batch and the max; several inputs and outputs
with odd names, FP16/INT64/BOOL/BF16, dynamic dims, a max_batch_size-0 model with data-dependent output
sizes, reshape; a second prepare is a cache hit; serving an ONNX file maps no torch; every error path
is one clear EngineError (or SignatureError for a request that does not fit). Models are built in
tmp_path (tests/gpuprims/engines/filemodels.py), never the zoo."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from gpuprims.engines import EngineCache, EngineError, EngineUnavailable, Target
from gpuprims.engines.file_onnx import OnnxRuntimeFileEngine, OpenVinoFileEngine
from gpuprims.engines.files import (
    FILE_KINDS,
    FileEngine,
    batch_groups,
    check_file_engine,
    default_file_kind,
    file_engine_class,
    file_fingerprint,
    file_kinds_for,
    make_file_engine,
    resolve_file_kind,
    split,
    stack,
)
from gpuprims.tensors import DataType, ModelSignature, SignatureError, TensorSpec
from tests.gpuprims.engines import filemodels as fm

ROOT = Path(__file__).resolve().parents[3]
ONNX_KINDS = ("onnxruntime", "openvino")
BATCHES = (1, fm.MAX_BATCH // 2, fm.MAX_BATCH)
CPU = Target("cpu", threads=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, ModelSignature]]:
    d = tmp_path_factory.mktemp("models")
    return {"multi": fm.multi_io(d / "multi.onnx"), "dynamic": fm.dynamic(d / "dynamic.onnx"),
            "data_dependent": fm.data_dependent(d / "nonzero.onnx"), "bf16": fm.bf16(d / "bf16.onnx"),
            "reshaped": fm.reshaped(d / "reshaped.onnx")}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> EngineCache:
    return EngineCache(tmp_path_factory.mktemp("engine-cache"))


def _direct(path: Path, feed: dict[str, np.ndarray], outputs: list[str] | None = None) -> dict[str, np.ndarray]:
    """The file run directly in a plain ONNX Runtime session: the reference."""
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = outputs or [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feed)))


def _assert_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray], tol: tuple[float, float]) -> None:
    assert set(got) == set(want)
    for name, ref in want.items():
        g = got[name]
        assert g.dtype == ref.dtype and g.shape == ref.shape, (name, g.dtype, g.shape, ref.dtype, ref.shape)
        if np.issubdtype(ref.dtype, np.floating):
            np.testing.assert_allclose(g, ref, rtol=tol[0], atol=tol[1], err_msg=name)
        else:
            np.testing.assert_array_equal(g, ref, err_msg=name)


# -- answers equal the file run directly ---------------------------------------------------------------
@pytest.mark.parametrize("kind", ONNX_KINDS)
def test_several_named_inputs_and_outputs_of_mixed_datatypes(kind: str, models: Any, cache: EngineCache) -> None:
    path, sig = models["multi"]
    eng = make_file_engine(kind, path, sig, CPU)
    eng.prepare(cache)
    for n in BATCHES:
        x = fm.multi_inputs(n, seed=n)
        got = eng.run(x)
        assert list(got) == [s.name for s in sig.outputs]  # by default every output, in the signature's order
        _assert_close(got, _direct(path, x), eng.tolerance)
    # the outputs a request names, and only those
    x = fm.multi_inputs(3)
    got = eng.run(x, outputs=["not mask", "out.sum"])
    assert list(got) == ["not mask", "out.sum"]
    _assert_close(got, _direct(path, x, ["not mask", "out.sum"]), eng.tolerance)
    eng.close()


@pytest.mark.parametrize("kind", ONNX_KINDS)
def test_read_only_request_arrays_in_outputs_the_caller_owns(kind: str, models: Any, cache: EngineCache) -> None:
    path, sig = models["multi"]
    eng = make_file_engine(kind, path, sig, CPU)
    eng.prepare(cache)
    x = fm.multi_inputs(2)
    for v in x.values():
        v.setflags(write=False)  # zero-copy views of wire bodies are read-only
    first = eng.run(x)
    kept = {k: v.copy() for k, v in first.items()}
    assert all(v.flags.writeable for v in first.values())
    eng.run(fm.multi_inputs(2, seed=9))  # a later run leaves the earlier outputs alone
    _assert_close(first, kept, (0, 0))


@pytest.mark.parametrize("kind", ONNX_KINDS)
def test_dynamic_dimension_any_width(kind: str, models: Any, cache: EngineCache) -> None:
    path, sig = models["dynamic"]
    eng = make_file_engine(kind, path, sig, CPU)
    eng.prepare(cache)
    rng = np.random.default_rng(1)
    for n, width in ((1, 3), (4, 17), (fm.MAX_BATCH, 1), (2, 64)):
        x = {"tokens": rng.standard_normal((n, width)).astype(np.float32)}
        got = eng.run(x)
        assert got["twice"].shape == (n, width)
        _assert_close(got, _direct(path, x), eng.tolerance)


@pytest.mark.parametrize("kind", ONNX_KINDS)
def test_unbatched_model_with_data_dependent_output_sizes(kind: str, models: Any, cache: EngineCache) -> None:
    path, sig = models["data_dependent"]
    eng = make_file_engine(kind, path, sig, CPU)
    eng.prepare(cache)
    sizes = set()
    for x, k in (([0, 1.5, 0, 3], 1), ([2, 0, 0, 0, 0, 7, 1], 3), ([0.0], 1), ([5, 4, 3, 2, 1, 0.5], 6)):
        feed = {"x": np.array(x, np.float32), "k": np.array([k], np.int64)}
        got = eng.run(feed)
        _assert_close(got, _direct(path, feed), eng.tolerance)
        assert got["top values"].shape == (k,)
        sizes.add(got["where"].shape[1])
    assert len(sizes) > 2  # the output's size followed the input's values


def test_bf16_travels_as_uint16_bits(models: Any, cache: EngineCache) -> None:
    path, sig = models["bf16"]
    eng = make_file_engine("onnxruntime", path, sig, CPU)
    eng.prepare(cache)
    values = np.array([[1.0, -2.5, 0.15625, 3.0e10]], np.float32)
    for n in BATCHES:
        bits = fm.to_bf16_bits(np.repeat(values, n, axis=0))
        got = eng.run({"in x": bits})
        assert got["out.y"].dtype == np.uint16 and got["out.y"].shape == (n, 4)
        np.testing.assert_array_equal(fm.from_bf16_bits(got["out.y"]), fm.from_bf16_bits(bits) * 2)
        np.testing.assert_array_equal(got["z"], fm.from_bf16_bits(bits) * 2)
        # against ORT itself, fed the same bits as an OrtValue of ONNX's BFLOAT16
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        ref = sess.run_with_ort_values(["z"], {"in x": ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, 16)})
        np.testing.assert_array_equal(got["z"], ref[0].numpy())
    # OpenVINO: the same bits through an ov.Tensor of Type.bf16
    ov_eng = make_file_engine("openvino", path, sig, CPU)
    ov_eng.prepare(cache)
    for n in BATCHES:
        bits = fm.to_bf16_bits(np.repeat(values, n, axis=0))
        got_ov = ov_eng.run({"in x": bits})
        assert got_ov["out.y"].dtype == np.uint16 and got_ov["out.y"].shape == (n, 4)
        np.testing.assert_array_equal(fm.from_bf16_bits(got_ov["out.y"]), fm.from_bf16_bits(bits) * 2)
        np.testing.assert_array_equal(got_ov["z"], fm.from_bf16_bits(bits) * 2)


def test_bf16_refused_at_prepare_where_ort_cannot_take_it(models: Any, cache: EngineCache,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path, sig = models["bf16"]
    monkeypatch.delattr(ort.OrtValue, "ortvalue_from_numpy_with_onnx_type")
    with pytest.raises(EngineUnavailable, match=r"BF16 input\(s\) \['in x'\] need OrtValue.ortvalue_from_numpy_"
                                                r"with_onnx_type, which onnxruntime .* lacks"):
        make_file_engine("onnxruntime", path, sig, CPU).prepare(cache)


@pytest.mark.parametrize("kind", ONNX_KINDS)
def test_reshape_applies_both_ways(kind: str, models: Any, cache: EngineCache) -> None:
    path, sig = models["reshaped"]
    eng = make_file_engine(kind, path, sig, CPU)
    eng.prepare(cache)
    for n in BATCHES:
        flat = np.arange(n * 12, dtype=np.float32).reshape(n, 12)
        got = eng.run({"flat": flat})
        assert got["rows"].shape == (n, 3)
        want = _direct(path, {"flat": flat.reshape(n, 3, 4)})["rows"].reshape(n, 3)
        np.testing.assert_allclose(got["rows"], want, *eng.tolerance)


def test_openvino_reads_ir_xml_beside_its_bin(models: Any, tmp_path: Path, cache: EngineCache) -> None:
    import openvino as ov

    path, sig = models["multi"]
    xml = tmp_path / "model.xml"
    ov.save_model(ov.Core().read_model(str(path)), str(xml), compress_to_fp16=False)
    assert default_file_kind(xml) == "openvino" and xml.with_suffix(".bin").is_file()
    eng = make_file_engine("openvino", xml, sig, CPU)
    eng.prepare(cache)
    x = fm.multi_inputs(fm.MAX_BATCH)
    _assert_close(eng.run(x), _direct(path, x), eng.tolerance)
    # the weights are part of the file's identity
    before = file_fingerprint(xml)
    xml.with_suffix(".bin").write_bytes(xml.with_suffix(".bin").read_bytes() + b"\0")
    assert file_fingerprint(xml) != before


# -- the cache ------------------------------------------------------------------------------------------
def test_second_prepare_is_a_cache_hit_keyed_by_the_files_content(models: Any, tmp_path: Path) -> None:
    path, sig = models["multi"]
    cache = EngineCache(tmp_path / "cache")
    first = make_file_engine("onnxruntime", path, sig, CPU)
    info = first.prepare(cache)
    assert not info.cache_hit and info.build_ms > 0 and info.fingerprint == file_fingerprint(path)
    assert (Path(info.artefact or "") / "model.opt.onnx").is_file()  # ORT's optimized graph is the artefact
    second = make_file_engine("onnxruntime", path, sig, Target("cpu", threads=2))  # another share: same entry
    again = second.prepare(cache)
    assert again.cache_hit and again.build_ms == 0 and again.artefact == info.artefact
    x = fm.multi_inputs(4)
    _assert_close(second.run(x), first.run(x), (0, 0))
    assert len(cache.entries()) == 1
    # the caller's fingerprint (the repository's content hash) keys it; other options make another entry
    third = make_file_engine("onnxruntime", path, sig, CPU, {"optimization": "basic"}, fingerprint="f" * 32)
    assert not third.prepare(cache).cache_hit and third.describe()["fingerprint"] == "f" * 32
    assert len(cache.entries()) == 2
    # a changed file is another model
    import onnx

    changed = onnx.load(str(path))
    changed.doc_string = "another version"
    copy = tmp_path / "copy.onnx"
    onnx.save(changed, str(copy))
    assert not make_file_engine("onnxruntime", copy, sig, CPU).prepare(cache).cache_hit


@pytest.mark.parametrize("kind", ONNX_KINDS)
def test_external_data_is_part_of_the_model(kind: str, tmp_path: Path) -> None:
    path, sig = fm.external_data(tmp_path / "model.onnx")
    data = tmp_path / "model.onnx.data"
    assert data.is_file()
    cache = EngineCache(tmp_path / "cache")
    eng = make_file_engine(kind, path, sig, CPU)
    info = eng.prepare(cache)
    rng = np.random.default_rng(2)
    for n in BATCHES:
        x = {"x": rng.standard_normal((n, 64)).astype(np.float32)}
        _assert_close(eng.run(x), _direct(path, x), eng.tolerance)
    if kind == "onnxruntime":  # the optimized graph keeps its weights outside too, in the entry
        assert (Path(info.artefact or "") / "model.opt.onnx.data").is_file()
        assert make_file_engine(kind, path, sig, CPU).prepare(cache).cache_hit
    # new weights in the external file are a new model: another fingerprint, another entry
    before = eng.fingerprint
    w = np.fromfile(data, np.float32)
    (w * 2).tofile(data)
    again = make_file_engine(kind, path, sig, CPU)
    assert again.fingerprint != before
    if kind == "onnxruntime":
        assert not again.prepare(cache).cache_hit
        x = {"x": np.ones((1, 64), np.float32)}
        _assert_close(again.run(x), _direct(path, x), again.tolerance)


def test_threads_from_the_target_and_describe(models: Any, cache: EngineCache) -> None:
    path, sig = models["dynamic"]
    eng = make_file_engine("onnxruntime", path, sig, Target("cpu", threads=2))
    assert not eng.describe()["prepared"]
    eng.prepare(cache)
    so = eng._session_options(ort, "ORT_ENABLE_ALL")
    assert so.intra_op_num_threads == 2 and so.inter_op_num_threads == 1
    d = eng.describe()
    assert d["kind"] == "onnxruntime" and d["threads"] == 2 and d["prepared"] and d["path"] == str(path)
    assert d["signature"] == sig.to_dict() and d["tolerance"] == list(OnnxRuntimeFileEngine.tolerance)
    ov_eng = make_file_engine("openvino", path, sig, Target("cpu", threads=1))
    ov_eng.prepare(cache)
    assert ov_eng.compiled.get_property("INFERENCE_NUM_THREADS") == 1
    assert ov_eng.describe()["cached"].startswith("nothing")


def test_serving_an_onnx_file_maps_no_torch(models: Any, tmp_path: Path) -> None:
    path, sig = models["multi"]
    code = ("import sys, json, numpy as np\n"
            "from gpuprims.engines import EngineCache, Target\n"
            "from gpuprims.engines.files import make_file_engine\n"
            "from gpuprims.tensors import ModelSignature\n"
            f"sig = ModelSignature.from_dict(json.loads({__import__('json').dumps(sig.to_dict())!r}))\n"
            "rng = np.random.default_rng(0)\n"
            "x = {'image in': rng.random((2, 3, 4), np.float32), 'scale.factor': np.ones((2, 1, 1), np.float16),\n"
            "     'ids': np.arange(10).reshape(2, 5), 'mask': np.zeros((2, 5), bool)}\n"
            "for kind in ('onnxruntime', 'openvino'):\n"
            f"    e = make_file_engine(kind, {str(path)!r}, sig, Target('cpu', threads=1))\n"
            f"    e.prepare(EngineCache({str(tmp_path / 'c')!r}))\n"
            "    assert e.run(x)['ids x2'][1, 4] == 18\n"
            "    assert 'torch' not in sys.modules, kind\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


# -- the registry and the checks --------------------------------------------------------------------------
def test_registry_names_every_kind() -> None:
    assert set(FILE_KINDS) == {"onnxruntime", "openvino", "torchscript", "torch_export", "compile", "tensorrt"}
    for kind in FILE_KINDS:
        cls = file_engine_class(kind)
        assert issubclass(cls, FileEngine) and cls.kind == kind and cls.suffixes
    with pytest.raises(EngineError, match=r"unknown model file engine 'pytorch'; known: onnxruntime, openvino"):
        file_engine_class("pytorch")
    assert [default_file_kind(f"m{s}") for s in (".onnx", ".xml", ".pt", ".pt2", ".plan")] == \
        ["onnxruntime", "openvino", "torchscript", "torch_export", "tensorrt"]
    with pytest.raises(EngineError, match=r"no engine serves \.pb"):
        default_file_kind("model.pb")
    for kind in FILE_KINDS:  # the registry's suffix table is the classes' own
        assert file_engine_class(kind).suffixes == tuple(
            s for s in (".onnx", ".xml", ".pt", ".pth", ".pt2", ".plan", ".engine") if kind in file_kinds_for(f"m{s}"))
    assert file_kinds_for("m.onnx") == ["onnxruntime", "openvino"] and file_kinds_for("m.pt2")[0] == "torch_export"
    # what an app's engine: means for a file
    assert resolve_file_kind("openvino", "m.onnx") == "openvino" and resolve_file_kind(None, "m.plan") == "tensorrt"
    assert resolve_file_kind("eager", "m.pt") == "torchscript" and resolve_file_kind("eager", "m.pt2") == "torch_export"
    with pytest.raises(EngineError, match=r"engine 'eager' does not run model files like m.onnx; it runs on "
                                          r"onnxruntime, openvino"):
        resolve_file_kind("eager", "m.onnx")
    with pytest.raises(EngineError, match=r"engine 'cudagraph' does not run model files like m.pt2; it runs on "
                                          r"torch_export, compile"):
        resolve_file_kind("cudagraph", "m.pt2")


@pytest.mark.parametrize(("kind", "backend", "options", "error", "match"), [
    ("onnxruntime", "cpu", {"provider": "cuda"}, EngineUnavailable,
     r"provider 'cuda' needs the cuda backend; this node runs on cpu"),
    ("onnxruntime", "cpu", {"provider": "tensorrt"}, EngineUnavailable, "needs the cuda backend"),
    ("onnxruntime", "cpu", {"provider": "rocm"}, EngineError, "provider must be one of cpu, cuda, tensorrt"),
    ("onnxruntime", "cpu", {"threads": 2}, EngineError, r"has no option\(s\) \['threads'\] \(it takes: "
                                                        r"optimization, precision, provider\)"),
    ("onnxruntime", "cuda", {"precision": "fp16"}, EngineError, "precision 'fp16' needs provider 'tensorrt'"),
    ("openvino", "cuda", None, EngineUnavailable, r"'openvino' needs the cpu backend; this node runs on cuda"),
    ("openvino", "cpu", {"hint": "fast"}, EngineError, "hint must be one of latency, throughput"),
    ("tensorrt", "cpu", None, EngineUnavailable, r"'tensorrt' needs the cuda backend; this node runs on cpu"),
    ("torchscript", "cpu", {"mode": "default"}, EngineError, r"has no option\(s\) \['mode'\] \(it takes: none\)"),
    ("compile", "cpu", {"mode": "reduce-overhead"}, EngineUnavailable, "is CUDA graphs and needs the cuda backend"),
    ("compile", "cpu", {"backend": "tvm"}, EngineError, "backend must be one of inductor, aot_eager"),
])
def test_check_refuses_with_the_reason(kind: str, backend: str, options: Any, error: type[Exception],
                                       match: str) -> None:
    with pytest.raises(error, match=match) as info:
        check_file_engine(kind, backend, options)
    assert "\n" not in str(info.value)


def test_a_missing_library_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    real = __import__("importlib").util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "openvino" else real(name, *a))
    with pytest.raises(EngineUnavailable, match=r"'openvino' needs the openvino package: pip install "
                                                r"'gpuprims\[openvino\]'"):
        OpenVinoFileEngine.check("cpu")


def test_file_errors_are_one_clear_engine_error(models: Any, tmp_path: Path, cache: EngineCache) -> None:
    path, sig = models["multi"]
    with pytest.raises(EngineError, match=r"'onnxruntime': model file '.*nowhere.onnx' does not exist"):
        make_file_engine("onnxruntime", tmp_path / "nowhere.onnx", sig, CPU)
    bad = tmp_path / "corrupt.onnx"
    bad.write_bytes(b"\x08\x07not a protobuf at all" * 10)
    for kind, match in (("onnxruntime", r"engine 'onnxruntime' cannot load corrupt.onnx \(provider 'cpu'\): "),
                        ("openvino", r"engine 'openvino' cannot read corrupt.onnx: ")):
        with pytest.raises(EngineError, match=match) as info:
            make_file_engine(kind, bad, sig, CPU).prepare(cache)
        assert "\n" not in str(info.value)
    # the wrong kind for the file says which kind takes it
    pt = tmp_path / "model.pt"
    pt.write_bytes(b"x")
    with pytest.raises(EngineError, match=r"engine 'onnxruntime' runs .onnx files; model.pt is a TorchScript "
                                          r"archive \(use engine 'torchscript'\)"):
        make_file_engine("onnxruntime", pt, sig, CPU)
    with pytest.raises(EngineError, match=r"engine 'torchscript' runs .pt or .pth files; multi.onnx is an ONNX "
                                          r"model \(use engine 'onnxruntime'\)"):
        make_file_engine("torchscript", path, sig, CPU)
    with pytest.raises(EngineUnavailable, match="needs the cuda backend"):
        make_file_engine("tensorrt", path, sig, CPU)
    with pytest.raises(EngineError, match=r"has no option\(s\) \['fast'\]"):
        make_file_engine("onnxruntime", path, sig, CPU, {"fast": True})


def _with(sig: ModelSignature, which: str, i: int, **change: Any) -> ModelSignature:
    specs = list(getattr(sig, which))
    s = specs[i]
    specs[i] = TensorSpec(change.get("name", s.name), change.get("datatype", s.datatype), change.get("dims", s.dims))
    return ModelSignature(**{**{"inputs": sig.inputs, "outputs": sig.outputs, "max_batch_size": sig.max_batch_size},
                             which: tuple(specs), **({"max_batch_size": change["mbs"]} if "mbs" in change else {})})


@pytest.mark.parametrize("kind", ONNX_KINDS)
def test_a_signature_the_file_disagrees_with_is_refused_at_prepare(kind: str, models: Any,
                                                                   cache: EngineCache) -> None:
    path, sig = models["multi"]
    cases = [
        (_with(sig, "inputs", 0, name="image"), r"multi.onnx has no input 'image' \(its inputs: 'image in', "
                                                 r"'scale.factor', 'ids', 'mask'\)"),
        (_with(sig, "outputs", 1, name="ids"), r"multi.onnx has no output 'ids'"),
        (_with(sig, "inputs", 2, datatype=DataType.INT32), r"input 'ids' is INT64 in the file, the signature "
                                                            r"says INT32"),
        (_with(sig, "outputs", 3, datatype=DataType.FP32), r"output 'half out' is FP16 in the file, the "
                                                             r"signature says FP32"),
        (_with(sig, "inputs", 0, dims=(3, 5)), r"input 'image in' has shape \[\?,3,4\] in the file, the "
                                                 r"signature gives \[-1,3,5\]"),
        (_with(sig, "inputs", 0, mbs=0), r"input 'image in' has shape \[\?,3,4\] in the file, the signature "
                                          r"gives \[3,4\] \(max_batch_size 0\)"),
        (ModelSignature(sig.inputs[:3], sig.outputs, sig.max_batch_size),
         r"multi.onnx takes input\(s\) \['mask'\] that the signature does not name"),
    ]
    for bad, match in cases:
        with pytest.raises(EngineError, match=match) as info:
            make_file_engine(kind, path, bad, CPU).prepare(cache)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("kind", ONNX_KINDS)
def test_a_fixed_batch_dimension_is_refused_for_a_batched_signature(kind: str, models: Any, tmp_path: Path,
                                                                    cache: EngineCache) -> None:
    import onnx

    path, sig = models["multi"]
    fixed = onnx.load(str(path))
    fixed.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2  # 'image in' exported at batch 2
    fixed_path = tmp_path / "fixed.onnx"
    onnx.save(fixed, str(fixed_path))
    with pytest.raises(EngineError, match=r"input 'image in' has a fixed first dimension of 2, so it takes no batch "
                                          r"of up to 8 \(max_batch_size\): export the model with a dynamic batch "
                                          r"axis, or set max_batch_size 0"):
        make_file_engine(kind, fixed_path, sig, CPU).prepare(cache)


@pytest.mark.parametrize("kind", ONNX_KINDS)
def test_requests_that_do_not_fit_are_signature_errors(kind: str, models: Any, cache: EngineCache) -> None:
    path, sig = models["multi"]
    eng = make_file_engine(kind, path, sig, CPU)
    with pytest.raises(EngineError, match="not prepared: call prepare"):
        eng.run(fm.multi_inputs(1))
    eng.prepare(cache)
    x = fm.multi_inputs(2)
    for change, match in (
        ({"ids": x["ids"].astype(np.int32)}, r"input 'ids' has numpy dtype int32, the model wants INT64"),
        ({"image in": x["image in"][:, :, :3].copy()}, r"input 'image in' has per-request shape \[3,3\], the "
                                                       r"model wants \[3,4\]"),
        ({"mask": x["mask"][:1]}, r"input 'mask' has 1 rows, the other inputs 2"),
        ({"extra": x["ids"]}, r"unknown input 'extra'"),
        ({k: np.concatenate([v] * 5) for k, v in x.items()}, r"a batch of 1..8 rows"),
    ):
        with pytest.raises(SignatureError, match=match):
            eng.run({**x, **change})
    with pytest.raises(SignatureError, match=r"missing input 'mask' BOOL \[5\]"):
        eng.run({k: v for k, v in x.items() if k != "mask"})
    with pytest.raises(SignatureError, match=r"unknown output 'nope'"):
        eng.run(x, outputs=["nope"])


def test_bytes_tensors_are_refused(models: Any) -> None:
    path, sig = models["dynamic"]
    strings = ModelSignature((TensorSpec("tokens", DataType.BYTES, (-1,)),), sig.outputs, sig.max_batch_size)
    with pytest.raises(EngineError, match=r"tensor 'tokens' is BYTES, which no engine takes yet"):
        make_file_engine("onnxruntime", path, strings, CPU)


# -- batching helpers -------------------------------------------------------------------------------------
def test_batch_groups_stack_and_split() -> None:
    a = {"x": np.zeros((3, 4), np.float32), "k": np.zeros(1, np.int64)}
    b = {"x": np.ones((3, 5), np.float32), "k": np.zeros(1, np.int64)}  # another width
    c = {"x": np.full((3, 4), 2, np.float32), "k": np.ones(1, np.int64)}
    d = {"x": np.zeros((3, 4), np.float64), "k": np.zeros(1, np.int64)}  # another dtype
    e = {"x": np.zeros((3, 4), np.float32)}  # another set of names
    reqs = [a, b, c, d, a, e, b]
    assert batch_groups(reqs) == [[0, 2, 4], [1, 6], [3], [5]]
    assert batch_groups([]) == []
    batch = stack(reqs, [0, 2, 4])
    assert batch["x"].shape == (3, 3, 4) and batch["k"].shape == (3, 1)
    np.testing.assert_array_equal(batch["x"][1], c["x"])
    with pytest.raises(ValueError, match="request 1 has other input names, shapes or dtypes than request 0"):
        stack(reqs, [0, 1])
    per = split({"y": np.arange(6).reshape(3, 2), "z": np.arange(3)}, 3)
    assert len(per) == 3 and per[2]["y"].tolist() == [4, 5] and per[1]["z"] == 1
    with pytest.raises(EngineError, match=r"output 'w' has shape \[1,3\]: its first "
                                          r"dimension is not the batch of 3"):
        split({"y": np.zeros((3, 2)), "w": np.zeros((1, 3))}, 3)
    with pytest.raises(EngineError, match=r"needs max_batch_size: 0"):
        split({"s": np.float32(1.0)}, 1)


def test_a_served_batch_round_trips_through_the_helpers(models: Any, cache: EngineCache) -> None:
    path, sig = models["dynamic"]
    eng = make_file_engine("onnxruntime", path, sig, CPU)
    eng.prepare(cache)
    rng = np.random.default_rng(3)
    reqs = [{"tokens": rng.standard_normal(w).astype(np.float32)} for w in (4, 7, 4, 4, 7)]
    answers: dict[int, dict[str, np.ndarray]] = {}
    for group in batch_groups(reqs):
        for i, out in zip(group, split(eng.run(stack(reqs, group)), len(group))):
            answers[i] = out
    for i, req in enumerate(reqs):
        np.testing.assert_allclose(answers[i]["twice"], req["tokens"] * 2)
        assert answers[i]["peak"].shape == (1,) and answers[i]["peak"][0] == req["tokens"].max()


# -- onnxruntime on the cuda backend (this machine's ORT is the CPU build) ---------------------------------
def test_onnxruntime_gpu_providers_on_the_targets_stream(fake_cuda: Any, models: Any, tmp_path: Path) -> None:
    from gpuprims.cuda.event import Stream

    path, sig = models["multi"]
    stream = Stream(0)
    eng = make_file_engine("onnxruntime", path, sig, Target("cuda", device_index=0, stream=stream),
                           {"provider": "tensorrt", "precision": "fp16"})
    providers = eng._providers(tmp_path / "trt")
    assert [p if isinstance(p, str) else p[0] for p in providers] == [
        "TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    trt_opts, cuda_opts = providers[0][1], providers[1][1]
    assert cuda_opts["user_compute_stream"] == trt_opts["user_compute_stream"] == str(stream.handle)
    assert trt_opts["trt_fp16_enable"] == "1" and trt_opts["trt_engine_cache_path"] == str(tmp_path / "trt")
    # the device in the cache key comes from our CUDA layer, not torch's
    assert eng.device_identity() == {"backend": "cuda", "fake": True, "name": fake_cuda.cuda_device_name(0),
                                     "cc": "{}.{}".format(*fake_cuda.cuda_device_capability(0))}
    with pytest.raises(EngineUnavailable, match=r"provider 'tensorrt' \(TensorrtExecutionProvider\) is not in this "
                                                r"onnxruntime build .*onnxruntime-gpu"):
        eng.prepare(EngineCache(tmp_path / "cache"))
    # the cpu provider on a cuda node runs as on a cpu node
    cpu_there = make_file_engine("onnxruntime", path, sig, Target("cuda"), {"provider": "cpu"})
    cpu_there.prepare(EngineCache(tmp_path / "cache"))
    x = fm.multi_inputs(2)
    _assert_close(cpu_there.run(x), _direct(path, x), cpu_there.tolerance)
