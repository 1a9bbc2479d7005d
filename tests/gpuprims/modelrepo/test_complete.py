"""A missing or partial config.pbtxt completed from the model file, as Triton's auto-complete does."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from gpuprims.modelrepo import ModelConfigError, complete, config_for_file, load_config, parse_config, proto
from gpuprims.modelrepo.complete import DEFAULT_MAX_BATCH_SIZE, read_file_signature
from gpuprims.tensors import DataType
from tests.gpuprims.modelrepo import onnxmodels


def _tensors(specs: Any) -> list[tuple[str, str, list[int]]]:
    return [(s.name, s.datatype.config_name, list(s.dims)) for s in specs]


def test_onnx_without_config_is_batched_when_every_tensor_has_a_dynamic_first_dim(tmp_path: Path) -> None:
    onnxmodels.multi(tmp_path / "multi" / "1" / "model.onnx")
    c = load_config(tmp_path / "multi")
    assert (c.name, c.platform, c.backend, c.model_format) == ("multi", "onnxruntime_onnx", "onnxruntime", "onnx")
    assert c.max_batch_size == DEFAULT_MAX_BATCH_SIZE == 4
    assert _tensors(c.signature.inputs) == onnxmodels.MULTI_INPUTS  # the weight "w" is not an input
    assert _tensors(c.signature.outputs) == onnxmodels.MULTI_OUTPUTS
    assert c.dynamic_batching is not None and c.dynamic_batching.max_queue_delay_us == 0  # Triton's default
    assert c.source == str(tmp_path / "multi" / "1" / "model.onnx")
    assert c.message.HasField("dynamic_batching") and c.message.max_batch_size == 4


def test_onnx_with_a_fixed_first_dim_is_not_batched(tmp_path: Path) -> None:
    onnxmodels.fixed(tmp_path / "fx" / "1" / "model.onnx")
    c = load_config(tmp_path / "fx")
    assert c.max_batch_size == 0 and c.dynamic_batching is None
    assert _tensors(c.signature.inputs) == [("in", "TYPE_FP32", [2, 3])]
    assert _tensors(c.signature.outputs) == [("total", "TYPE_FP32", [2])]


def test_a_scalar_output_is_dims_one_reshaped_to_nothing(tmp_path: Path) -> None:
    onnxmodels.fixed(tmp_path / "sc" / "1" / "model.onnx", scalar_out=True)
    out = load_config(tmp_path / "sc").signature.outputs[0]
    assert (out.dims, out.reshape) == ((1,), ())


def test_the_highest_version_completes(tmp_path: Path) -> None:
    onnxmodels.fixed(tmp_path / "m" / "1" / "model.onnx")
    onnxmodels.multi(tmp_path / "m" / "7" / "model.onnx")
    assert load_config(tmp_path / "m").max_batch_size == 4


def test_a_partial_config_keeps_its_batch_size_and_gets_the_tensors(tmp_path: Path) -> None:
    onnxmodels.multi(tmp_path / "p" / "1" / "model.onnx")
    (tmp_path / "p" / "config.pbtxt").write_text('max_batch_size: 16\ndynamic_batching { max_queue_delay_microseconds:'
                                                 ' 100 }\n')
    c = load_config(tmp_path / "p")
    assert c.max_batch_size == 16 and c.platform == "onnxruntime_onnx"
    assert _tensors(c.signature.inputs) == onnxmodels.MULTI_INPUTS
    assert c.dynamic_batching is not None and c.dynamic_batching.max_queue_delay_us == 100
    assert c.source == str(tmp_path / "p" / "config.pbtxt")


def test_a_written_max_batch_size_of_zero_is_kept(tmp_path: Path) -> None:
    onnxmodels.multi(tmp_path / "z" / "1" / "model.onnx")
    (tmp_path / "z" / "config.pbtxt").write_text('# no batching: the first dimension is the model\'s own\n'
                                                 'max_batch_size: 0\n')
    c = load_config(tmp_path / "z")
    assert c.max_batch_size == 0 and c.dynamic_batching is None
    assert c.signature.input("x y").dims == (-1, 3, -1)
    over = config_for_file(tmp_path / "z" / "1" / "model.onnx", "max_batch_size: 0")
    assert over.max_batch_size == 0 and over.signature.input("h").dims == (-1, 2)
    # Config keys as a mapping (apps.yaml's config:) keep their written 0 through the text too.
    text = proto.text_from_dict({"max_batch_size": 0, "instance_group": [{"count": 2}]})
    over = config_for_file(tmp_path / "z" / "1" / "model.onnx", text)
    assert over.max_batch_size == 0 and over.instance_groups[0].count == 2
    assert config_for_file(tmp_path / "z" / "1" / "model.onnx", proto.text_from_dict({})).max_batch_size == 4


def test_a_config_with_inputs_only_gets_the_outputs(tmp_path: Path) -> None:
    onnxmodels.fixed(tmp_path / "q" / "1" / "model.onnx")
    (tmp_path / "q" / "config.pbtxt").write_text('platform: "onnxruntime_onnx"\n'
                                                 'input { name: "in" data_type: TYPE_FP32 dims: [ 6 ] '
                                                 'reshape { shape: [ 2, 3 ] } }\n')
    c = load_config(tmp_path / "q")
    assert c.max_batch_size == 0 and c.signature.inputs[0].dims == (6,)
    assert _tensors(c.signature.outputs) == [("total", "TYPE_FP32", [2])]


def test_a_batch_size_the_file_cannot_batch_is_refused(tmp_path: Path) -> None:
    onnxmodels.fixed(tmp_path / "b" / "1" / "model.onnx")
    (tmp_path / "b" / "config.pbtxt").write_text("max_batch_size: 8\n")
    with pytest.raises(ModelConfigError) as ei:
        load_config(tmp_path / "b")
    assert str(ei.value).startswith(f"{tmp_path / 'b' / 'config.pbtxt'}: input: ")
    assert "input 'in'" in str(ei.value) and "first dimension must be the batch" in str(ei.value)


def test_bytes_tensors_of_the_file_are_refused_by_name(tmp_path: Path) -> None:
    onnxmodels.strings(tmp_path / "s" / "1" / "model.onnx")
    with pytest.raises(ModelConfigError) as ei:
        load_config(tmp_path / "s")
    assert str(ei.value) == (f"{tmp_path / 's' / '1' / 'model.onnx'}: input[0].data_type: BYTES tensors are not "
                             "supported yet: input 'text in' is TYPE_STRING")


def test_a_tensor_without_a_shape_is_refused(tmp_path: Path) -> None:
    p = onnxmodels.unranked(tmp_path / "u" / "1" / "model.onnx")
    with pytest.raises(ModelConfigError) as ei:
        load_config(tmp_path / "u")
    assert str(ei.value) == f"{p}: input: input 'a' has no shape in {p}: give the inputs' dims in config.pbtxt"
    # With the tensors in config.pbtxt, the unknown shapes are not held against it.
    (tmp_path / "u" / "config.pbtxt").write_text('platform: "onnxruntime_onnx"\n'
                                                 'input { name: "a" data_type: TYPE_FP32 dims: [ 2 ] }\n'
                                                 'output { name: "b" data_type: TYPE_FP32 dims: [ 2 ] }\n')
    complete.check_model_file(load_config(tmp_path / "u"), p)


def test_a_corrupt_onnx_file_is_named(tmp_path: Path) -> None:
    p = tmp_path / "c" / "1" / "model.onnx"
    p.parent.mkdir(parents=True)
    p.write_bytes(b"\x08\x07not a protobuf at all \xff\xff\xff")
    with pytest.raises(ModelConfigError) as ei:
        load_config(tmp_path / "c")
    assert str(ei.value).startswith(f"{p}: model file: not a readable ONNX model")


def test_no_version_or_no_file_to_complete_from(tmp_path: Path) -> None:
    (tmp_path / "e").mkdir()
    with pytest.raises(ModelConfigError) as ei:
        load_config(tmp_path / "e")
    assert str(ei.value).startswith(f"{tmp_path / 'e'}: version: ") and "no version directory" in str(ei.value)
    (tmp_path / "e" / "1").mkdir()
    (tmp_path / "e" / "1" / "notes.txt").write_text("x")
    with pytest.raises(ModelConfigError, match=r"holds none of model\.onnx"):
        load_config(tmp_path / "e")
    (tmp_path / "e" / "config.pbtxt").write_text('platform: "onnxruntime_onnx"\n')
    with pytest.raises(ModelConfigError) as ei:
        load_config(tmp_path / "e")
    assert "default_model_filename: version 1 has no model file 'model.onnx'" in str(ei.value)


def test_a_torchscript_file_needs_its_config(tmp_path: Path) -> None:
    p = tmp_path / "ts" / "1" / "model.pt"
    p.parent.mkdir(parents=True)
    p.write_bytes(b"PK")
    with pytest.raises(ModelConfigError) as ei:
        load_config(tmp_path / "ts")
    assert str(ei.value) == (f"{p}: input: a TorchScript model.pt carries no tensor datatypes or shapes: give input "
                             "and output in config.pbtxt")


@pytest.mark.slow  # loads torch / OpenVINO and converts a model: seconds on a busy machine
def test_an_openvino_ir_completes_where_openvino_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import openvino as ov

    src = onnxmodels.multi(tmp_path / "src.onnx")
    xml = tmp_path / "ov" / "1" / "model.xml"
    xml.parent.mkdir(parents=True)
    ov.save_model(ov.convert_model(str(src)), str(xml))
    c = load_config(tmp_path / "ov")
    assert (c.backend, c.platform, c.model_format, c.engine_kind(), c.max_batch_size) == (
        "openvino", "", "openvino_ir", "openvino", 4)
    assert _tensors(c.signature.inputs) == onnxmodels.MULTI_INPUTS
    assert _tensors(c.signature.outputs) == onnxmodels.MULTI_OUTPUTS
    complete.check_model_file(c, xml)
    # A port with several names: a config may use any of them.
    model = ov.convert_model(str(src))
    model.inputs[0].get_tensor().add_names({"pixels"})
    ov.save_model(model, str(xml))
    complete.check_model_file(c, xml)
    with pytest.raises(ModelConfigError, match="the model file has no input 'image'"):
        complete.check_model_file(parse_config(proto.to_text(c.message).replace('"x y"', '"image"', 1),
                                               str(tmp_path / "ov" / "config.pbtxt")), xml)
    xml.write_text("<net/>")
    with pytest.raises(ModelConfigError, match="model file: not a readable OpenVINO IR"):
        load_config(tmp_path / "ov")
    monkeypatch.setitem(sys.modules, "openvino", None)
    with pytest.raises(ModelConfigError, match="completing an OpenVINO IR needs the openvino package"):
        load_config(tmp_path / "ov")


def test_a_plan_needs_tensorrt_to_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "trt" / "1" / "model.plan"
    p.parent.mkdir(parents=True)
    p.write_bytes(b"plan")
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # importing it fails, as on a host without TensorRT
    with pytest.raises(ModelConfigError) as ei:
        load_config(tmp_path / "trt")
    assert str(ei.value) == (f"{p}: input: completing a TensorRT plan needs the tensorrt package on a GPU host: "
                             "give input and output in config.pbtxt")


def _fake_tensorrt(io: list[tuple[str, bool, str, tuple[int, ...]]], profile_max: int, loads: bool = True) -> Any:
    """A stand-in of the TensorRT 10 API calls plan_signature makes (Runtime, deserialize_cuda_engine,
    the engine's I/O tensor queries and its first optimization profile)."""
    trt = types.ModuleType("tensorrt")

    class TensorIOMode:
        INPUT = "INPUT"
        OUTPUT = "OUTPUT"

    class DType:
        def __init__(self, name: str) -> None:
            self.name = name

    class Engine:
        num_io_tensors = len(io)
        num_optimization_profiles = 1

        def get_tensor_name(self, i: int) -> str:
            return io[i][0]

        def _find(self, name: str) -> tuple[str, bool, str, tuple[int, ...]]:
            return next(t for t in io if t[0] == name)

        def get_tensor_mode(self, name: str) -> str:
            return TensorIOMode.INPUT if self._find(name)[1] else TensorIOMode.OUTPUT

        def get_tensor_dtype(self, name: str) -> DType:
            return DType(self._find(name)[2])

        def get_tensor_shape(self, name: str) -> tuple[int, ...]:
            return self._find(name)[3]

        def get_tensor_profile_shape(self, name: str, profile: int) -> list[tuple[int, ...]]:
            assert profile == 0
            shape = self._find(name)[3]
            return [(1, *shape[1:]), (2, *shape[1:]), (profile_max, *shape[1:])]

    class Logger:
        WARNING = 2

        def __init__(self, severity: int) -> None:
            self.severity = severity

    class Runtime:
        def __init__(self, logger: Logger) -> None:
            self.logger = logger

        def deserialize_cuda_engine(self, data: bytes) -> Engine | None:
            assert data == b"plan"
            return Engine() if loads else None

    trt.TensorIOMode = TensorIOMode  # type: ignore[attr-defined]
    trt.Logger = Logger  # type: ignore[attr-defined]
    trt.Runtime = Runtime  # type: ignore[attr-defined]
    return trt


def test_a_plan_completes_where_tensorrt_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "trt" / "1" / "model.plan"
    p.parent.mkdir(parents=True)
    p.write_bytes(b"plan")
    io = [("images", True, "HALF", (-1, 3, 8, 8)), ("scores", False, "FLOAT", (-1, 10)),
          ("labels", False, "INT32", (-1, 10))]
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_tensorrt(io, profile_max=2))
    c = load_config(tmp_path / "trt")
    assert (c.platform, c.model_format, c.max_batch_size) == ("tensorrt_plan", "tensorrt_plan", 2)  # the profile's cap
    assert _tensors(c.signature.inputs) == [("images", "TYPE_FP16", [3, 8, 8])]
    assert _tensors(c.signature.outputs) == [("scores", "TYPE_FP32", [10]), ("labels", "TYPE_INT32", [10])]
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_tensorrt(io, profile_max=2, loads=False))
    with pytest.raises(ModelConfigError, match="model file: TensorRT cannot load this plan"):
        load_config(tmp_path / "trt")
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_tensorrt([("q", True, "FP8", (4,)), ("r", False, "FLOAT", (4,))],
                                                                profile_max=1))
    with pytest.raises(ModelConfigError, match="input 'q' has element type FP8, which has no Triton datatype"):
        load_config(tmp_path / "trt")


def _export(path: Path) -> Path:
    import torch

    class Net(torch.nn.Module):
        def forward(self, image: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = image * scale
            return y.sum(dim=1), (y > 0)

    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(Net(), (torch.ones(2, 3, 4), torch.ones(2, 1, 4, dtype=torch.float16).float()),
                             dynamic_shapes={"image": {0: batch}, "scale": {0: batch}})
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(ep, str(path))
    return path


@pytest.mark.slow  # loads torch / OpenVINO and converts a model: seconds on a busy machine
def test_a_torch_export_file_completes_where_torch_imports(tmp_path: Path) -> None:
    _export(tmp_path / "ex" / "1" / "model.pt2")
    c = load_config(tmp_path / "ex")
    assert (c.backend, c.model_format, c.model_filename, c.engine_kind()) == (
        "pytorch", "torch_export", "model.pt2", "torch_export")
    assert c.max_batch_size == 4
    assert _tensors(c.signature.inputs) == [("image", "TYPE_FP32", [3, 4]), ("scale", "TYPE_FP32", [1, 4])]
    assert _tensors(c.signature.outputs) == [("output__0", "TYPE_FP32", [4]), ("output__1", "TYPE_BOOL", [3, 4])]


@pytest.mark.slow  # loads torch / OpenVINO and converts a model: seconds on a busy machine
def test_a_pytorch_config_with_a_pt2_file_is_torch_export(tmp_path: Path) -> None:
    _export(tmp_path / "ex" / "1" / "model.pt2")
    (tmp_path / "ex" / "config.pbtxt").write_text(
        'backend: "pytorch"\nmax_batch_size: 2\ninput { name: "image" data_type: TYPE_FP32 dims: [ 3, 4 ] }\n'
        'input { name: "scale" data_type: TYPE_FP32 dims: [ 1, 4 ] }\n'
        'output { name: "output__0" data_type: TYPE_FP32 dims: [ 4 ] }\n'
        'output { name: "output__1" data_type: TYPE_BOOL dims: [ 3, 4 ] }\n')
    c = load_config(tmp_path / "ex")
    assert (c.model_format, c.model_filename, c.max_batch_size) == ("torch_export", "model.pt2", 2)


@pytest.mark.slow  # loads torch / OpenVINO and converts a model: seconds on a busy machine
def test_a_torch_export_config_is_checked_in_order(tmp_path: Path) -> None:
    p = _export(tmp_path / "ex" / "1" / "model.pt2")
    text = ('backend: "pytorch"\nmax_batch_size: 2\ninput { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 3, 4 ] }\n'
            'input { name: "INPUT__1" data_type: TYPE_FP32 dims: [ 1, 4 ] }\n'
            'output { name: "sums" data_type: TYPE_FP32 dims: [ 4 ] }\n'
            'output { name: "positive" data_type: TYPE_BOOL dims: [ 3, 4 ] }\n')
    src = str(tmp_path / "ex" / "config.pbtxt")
    cfg = parse_config(text + 'default_model_filename: "model.pt2"', src)
    complete.check_model_file(cfg, p, torch_ok=True)
    bad = parse_config(text.replace("TYPE_BOOL", "TYPE_UINT8") + 'default_model_filename: "model.pt2"', src)
    with pytest.raises(ModelConfigError, match=r"output 'positive' is TYPE_BOOL in the model file, TYPE_UINT8"):
        complete.check_model_file(bad, p, torch_ok=True)
    short = parse_config(text.split("output")[0] + 'output { name: "sums" data_type: TYPE_FP32 dims: [ 4 ] }\n'
                         'default_model_filename: "model.pt2"', src)
    with pytest.raises(ModelConfigError, match="the config lists 1 outputs, the program has 2"):
        complete.check_model_file(short, p, torch_ok=True)


def test_a_torch_export_file_without_torch_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "ex" / "1" / "model.pt2"
    p.parent.mkdir(parents=True)
    p.write_bytes(b"PK")
    with pytest.raises(ModelConfigError) as ei:
        load_config(tmp_path / "ex", torch_ok=False)  # the node: torch stays out even where it imports
    assert str(ei.value) == (f"{p}: input: completing a torch.export model.pt2 loads torch, which this process "
                             "does not: give input and output in config.pbtxt")
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ModelConfigError) as ei:
        load_config(tmp_path / "ex")
    assert str(ei.value) == (f"{p}: input: completing a torch.export model.pt2 needs torch in this process: give "
                             "input and output in config.pbtxt")


def test_onnx_completion_without_the_onnx_package_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = onnxmodels.fixed(tmp_path / "m" / "1" / "model.onnx")
    monkeypatch.setitem(sys.modules, "onnx", None)
    with pytest.raises(ModelConfigError, match="completing an ONNX model needs the onnx package"):
        read_file_signature(p, "onnx")


def test_a_model_file_outside_a_repository(tmp_path: Path) -> None:
    p = onnxmodels.multi(tmp_path / "det.onnx")
    c = config_for_file(p)
    assert (c.name, c.model_filename, c.max_batch_size) == ("det", "det.onnx", 4)
    assert c.signature.input("ids.0").datatype is DataType.INT64
    over = config_for_file(p, 'max_batch_size: 32\ninstance_group { count: 2 kind: KIND_CPU }', source="apps.yaml")
    assert over.max_batch_size == 32 and over.instance_groups[0].count == 2 and over.source == "apps.yaml"
    with pytest.raises(ModelConfigError) as ei:
        config_for_file(p, "max_batch_size: 32\nsequence_batching { }", source="apps.yaml")
    assert str(ei.value).startswith("apps.yaml:2: sequence_batching: refused")
    with pytest.raises(ModelConfigError, match="no such model file"):
        config_for_file(tmp_path / "gone.onnx")
    with pytest.raises(ModelConfigError, match="is not a model file gpuprims knows"):
        config_for_file(tmp_path / "weights.bin")


def test_completion_fills_the_message_the_instance_receives(tmp_path: Path) -> None:
    onnxmodels.multi(tmp_path / "multi" / "1" / "model.onnx")
    msg = proto.ModelConfigMessage()
    complete.complete_message(msg, tmp_path / "multi", str(tmp_path / "multi" / "config.pbtxt"))
    assert [t.name for t in msg.input] == [n for n, _, _ in onnxmodels.MULTI_INPUTS]
    assert msg.platform == "onnxruntime_onnx" and msg.max_batch_size == 4


CHECKED = [
    # (a change to the completed multi config's text, field, words)
    (lambda t: t.replace('"ids.0"', '"ids_0"', 1), "input[1]", "the model file has no input 'ids_0'"),
    (lambda t: t.replace('TYPE_BOOL', 'TYPE_UINT8', 1), "input[2].data_type",
     "input 'mask' is TYPE_BOOL in the model file, TYPE_UINT8 in the config"),
    (lambda t: t.replace('dims: 4\n', 'dims: 4\n  dims: 1\n', 1), "input[1].dims",
     "input 'ids.0' has shape [-1, 4] in the model file; the config gives [-1, 4, 1]"),
    (lambda t: t.replace('dims: 2\n', 'dims: 3\n', 1), "input[3].dims", "has shape [-1, 2]"),
    (lambda t: t.replace('dims: 4\n', 'dims: -1\n', 1), "input[1].dims", "gives [-1, -1]"),
    (lambda t: t.replace('max_batch_size: 4', 'max_batch_size: 0'), "input[0].dims", "has shape [-1, 3, -1]"),
    (lambda t: t.replace('name: "h2"', 'name: "h3"'), "output[3]", "no output 'h3'"),
]


@pytest.mark.parametrize(("change", "fld", "words"), CHECKED, ids=[c[1] for c in CHECKED])
def test_a_config_is_checked_against_its_file(tmp_path: Path, change: Any, fld: str, words: str) -> None:
    p = onnxmodels.multi(tmp_path / "m" / "1" / "model.onnx")
    good = load_config(tmp_path / "m")
    complete.check_model_file(good, p)
    text = change(proto.to_text(good.message))
    assert text != proto.to_text(good.message)
    cfg = parse_config(text, str(tmp_path / "m" / "config.pbtxt"))
    with pytest.raises(ModelConfigError) as ei:
        complete.check_model_file(cfg, p)
    assert str(ei.value).startswith(f"{p}: {fld}: ") and words in str(ei.value), str(ei.value)


def test_the_check_needs_every_input_the_file_takes_and_sees_the_reshape(tmp_path: Path) -> None:
    p = onnxmodels.fixed(tmp_path / "f" / "1" / "model.onnx")
    cfg = parse_config('platform: "onnxruntime_onnx"\ninput { name: "in" data_type: TYPE_FP32 dims: [ 6 ] '
                       'reshape { shape: [ 2, 3 ] } }\noutput { name: "total" data_type: TYPE_FP32 dims: [ 2 ] }\n',
                       str(tmp_path / "f" / "config.pbtxt"))
    complete.check_model_file(cfg, p)
    q = onnxmodels.multi(tmp_path / "m" / "1" / "model.onnx")
    partial = parse_config('platform: "onnxruntime_onnx"\nmax_batch_size: 2\n'
                           'input { name: "x y" data_type: TYPE_FP32 dims: [ 3, -1 ] }\n'
                           'output { name: "h2" data_type: TYPE_FP16 dims: [ 2 ] }\n', str(tmp_path / "m" / "c"))
    with pytest.raises(ModelConfigError, match=r"takes inputs \['ids.0', 'mask', 'h'\] the config does not list"):
        complete.check_model_file(partial, q)


def test_files_without_a_checkable_signature_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = ('platform: "%s"\ninput { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 3 ] }\n'
            'output { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 3 ] }\n')
    for platform, name in (("pytorch_libtorch", "model.pt"), ("tensorrt_plan", "model.plan")):
        p = tmp_path / name
        p.write_bytes(b"plan")
        monkeypatch.setitem(sys.modules, "tensorrt", None)
        complete.check_model_file(parse_config(text % platform, str(tmp_path / "config.pbtxt")), p)
    pt2 = tmp_path / "model.pt2"
    pt2.write_bytes(b"PK")
    cfg = parse_config((text % "").replace('platform: ""', 'backend: "pytorch" default_model_filename: "model.pt2"'),
                       str(tmp_path / "config.pbtxt"))
    complete.check_model_file(cfg, pt2)  # torch_ok False: not loaded here


@pytest.mark.slow  # loads torch: seconds on a busy machine
def test_a_torch_export_file_that_does_not_load_is_named(tmp_path: Path) -> None:
    pt2 = tmp_path / "model.pt2"
    pt2.write_bytes(b"PK")
    cfg = parse_config('backend: "pytorch" default_model_filename: "model.pt2"\n'
                       'input { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 3 ] }\n'
                       'output { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 3 ] }\n', str(tmp_path / "config.pbtxt"))
    with pytest.raises(ModelConfigError) as ei:
        complete.check_model_file(cfg, pt2, torch_ok=True)
    assert str(ei.value).startswith(f"{pt2}: model file: not a loadable torch.export program")
