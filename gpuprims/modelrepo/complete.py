"""Completing a model's configuration from its file, as Triton's auto-complete does.

A model directory may leave ``config.pbtxt`` out, or give only part of it (``max_batch_size`` and a
dynamic batcher, say). What the config leaves out is read from the model file of the highest version:

- the platform/backend, from the file present (``model.onnx``, ``model.plan``, ``model.pt``,
  ``model.pt2``, ``model.xml``); a ``pytorch`` model whose version holds ``model.pt2`` (and no
  ``model.pt``) is a torch.export file;
- the inputs or outputs (names, datatypes, dims), where the config lists none of them: from the ONNX
  graph (the ``onnx`` package, imported when needed; initializers listed as graph inputs are weights,
  not inputs), from an OpenVINO IR where ``openvino`` imports, from a ``torch.export`` program where
  torch may be loaded (inputs by argument name, outputs ``output__<i>``), from a TensorRT plan where
  ``tensorrt`` imports (a GPU host). A TorchScript file carries no datatypes or shapes, so it needs
  its inputs and outputs in config.pbtxt. Unknown or symbolic dimensions are ``-1``;
- batching: when the config lists no tensors and writes no ``max_batch_size``, a model whose every
  input and output has a dynamic first dimension is batched, with ``max_batch_size`` 4 (Triton's
  default for auto-complete; a TensorRT plan's optimization profile may cap it lower) and that
  dimension left out of ``dims``, and gets a dynamic batcher with default settings as Triton gives it;
  otherwise ``max_batch_size`` is 0. A written ``max_batch_size: 0`` is kept (the model is not
  batched, its first dimension stays in ``dims``): protobuf reads it as "not set", so the text is asked.

:func:`check_model_file` holds a config to its file as Triton does at load.

Importing this module imports none of onnx, openvino, torch or tensorrt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gpuprims.modelrepo import formats, proto
from gpuprims.modelrepo.errors import ModelConfigError, TextIndex
from gpuprims.tensors import DataType, ModelSignature

#: Triton's default ``max_batch_size`` for an auto-completed model that can batch.
DEFAULT_MAX_BATCH_SIZE = 4

#: Platform and backend a completed config names, by format.
PLATFORM_OF_FORMAT: dict[str, tuple[str, str]] = {
    "onnx": ("onnxruntime_onnx", "onnxruntime"),
    "tensorrt_plan": ("tensorrt_plan", "tensorrt"),
    "torchscript": ("pytorch_libtorch", "pytorch"),
    "torch_export": ("", "pytorch"),
    "openvino_ir": ("", "openvino"),
}

_ONNX_TYPES: dict[str, DataType] = {
    "FLOAT": DataType.FP32, "UINT8": DataType.UINT8, "INT8": DataType.INT8, "UINT16": DataType.UINT16,
    "INT16": DataType.INT16, "INT32": DataType.INT32, "INT64": DataType.INT64, "STRING": DataType.BYTES,
    "BOOL": DataType.BOOL, "FLOAT16": DataType.FP16, "DOUBLE": DataType.FP64, "UINT32": DataType.UINT32,
    "UINT64": DataType.UINT64, "BFLOAT16": DataType.BF16,
}
_TORCH_TYPES: dict[str, DataType] = {
    "torch.float32": DataType.FP32, "torch.float16": DataType.FP16, "torch.bfloat16": DataType.BF16,
    "torch.float64": DataType.FP64, "torch.uint8": DataType.UINT8, "torch.int8": DataType.INT8,
    "torch.int16": DataType.INT16, "torch.int32": DataType.INT32, "torch.int64": DataType.INT64,
    "torch.bool": DataType.BOOL, "torch.uint16": DataType.UINT16, "torch.uint32": DataType.UINT32,
    "torch.uint64": DataType.UINT64,
}
_OPENVINO_TYPES: dict[str, DataType] = {
    "f32": DataType.FP32, "f16": DataType.FP16, "bf16": DataType.BF16, "f64": DataType.FP64,
    "u8": DataType.UINT8, "u16": DataType.UINT16, "u32": DataType.UINT32, "u64": DataType.UINT64,
    "i8": DataType.INT8, "i16": DataType.INT16, "i32": DataType.INT32, "i64": DataType.INT64,
    "boolean": DataType.BOOL, "string": DataType.BYTES,
}
_TRT_TYPES: dict[str, DataType] = {
    "FLOAT": DataType.FP32, "HALF": DataType.FP16, "BF16": DataType.BF16, "INT8": DataType.INT8,
    "INT32": DataType.INT32, "INT64": DataType.INT64, "BOOL": DataType.BOOL, "UINT8": DataType.UINT8,
}


class ModelConfigLike(Protocol):
    """What :func:`check_model_file` reads of a ``ModelConfig`` (config.py imports this module, so it
    names the record by its shape)."""

    @property
    def model_format(self) -> str: ...

    @property
    def signature(self) -> ModelSignature: ...


@dataclass(frozen=True)
class FileTensor:
    """An input or output as the model file declares it: its full shape (batch dimension included,
    ``-1`` where dynamic), None where the file does not say (an ONNX output shape inference left out)."""

    name: str
    datatype: DataType
    shape: tuple[int, ...] | None
    #: Other names the file gives the same tensor (an OpenVINO port has a set of names).
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class FileSignature:
    """What a model file says of its tensors; ``max_batch`` caps batching where the file bounds it
    (a TensorRT profile), else None."""

    inputs: tuple[FileTensor, ...]
    outputs: tuple[FileTensor, ...]
    max_batch: int | None = None


def complete_message(msg: Any, model_dir: str | Path, config_path: str, text: str | None = None,
                     torch_ok: bool = True) -> str:
    """Complete ``msg`` (a ModelConfig message, changed in place) from the model file of the highest
    version in ``model_dir``, where it leaves out the platform/backend, its inputs or outputs (see the
    module docstring). Returns the source errors name: ``config_path`` when the model has a config
    text, else the model file read. ``torch_ok`` False: a process that must not load torch (the node)
    refuses to complete a torch.export file. Raises :class:`ModelConfigError`."""
    d = Path(model_dir)
    source = config_path if text is not None else str(d)
    if formats.platform_problem(msg.platform, msg.backend) is not None:
        return source  # build_config names it on its line
    versions = formats.version_dirs(d)
    needs_tensors = not len(msg.input) or not len(msg.output)
    needs_backend = not (msg.platform or msg.backend)
    if not versions:
        if needs_tensors or needs_backend:
            raise ModelConfigError(source, None, "version", f"{d} has no version directory (1/, 2/, ...) holding "
                                                            "a model file to complete the config from")
        return source
    top = versions[max(versions)]
    if needs_backend:
        filename = msg.default_model_filename or formats.guess_filename(top)
        fmt = formats.format_of_file(filename) if filename else None
        if fmt is None:
            raise ModelConfigError(source, None, "platform",
                                   f"no platform or backend given and {top} holds none of "
                                   f"{', '.join(formats.DEFAULT_FILENAMES.values())} to tell it")
        msg.platform, msg.backend = PLATFORM_OF_FORMAT[fmt]
        if fmt == "torch_export" and not msg.default_model_filename:
            msg.default_model_filename = "model.pt2"
    backend = formats.backend_of(msg.platform, msg.backend) or ""
    if backend == "pytorch" and not msg.default_model_filename and formats.model_file(top, "model.pt") is None \
            and formats.model_file(top, "model.pt2") is not None:
        msg.default_model_filename = "model.pt2"
    if not needs_tensors:
        return source
    fmt = formats.format_of(backend, msg.default_model_filename)
    if fmt is None:
        return source
    filename = msg.default_model_filename or formats.DEFAULT_FILENAMES[fmt]
    path = formats.model_file(top, filename)
    if path is None:
        raise ModelConfigError(source, None, "default_model_filename",
                               f"version {top.name} has no model file {filename!r} to complete the config from")
    complete_from_file(msg, path, fmt, source if text is not None else str(path), torch_ok, text)
    return source if text is not None else str(path)


def complete_from_file(msg: Any, path: str | Path, fmt: str, source: str, torch_ok: bool = True,
                       text: str | None = None) -> None:
    """Fill ``msg``'s missing inputs or outputs (and batching, when it lists no tensor and no
    ``max_batch_size``) from the model file ``path`` of format ``fmt``. ``text``, the config's text
    where there is one, tells a written ``max_batch_size: 0`` (kept: the model is not batched) from
    none (protobuf cannot). Raises :class:`ModelConfigError` naming ``source``."""
    sig = read_file_signature(path, fmt, torch_ok)
    gave_tensors = bool(len(msg.input) or len(msg.output))
    gave_batch = msg.max_batch_size != 0 or (
        text is not None and any(n.name == "max_batch_size" for n in TextIndex(text).root.children))
    batchable = all(t.shape is not None and len(t.shape) >= 1 and t.shape[0] == -1
                    for t in (*sig.inputs, *sig.outputs))
    if not gave_tensors and not gave_batch and batchable:
        msg.max_batch_size = min(DEFAULT_MAX_BATCH_SIZE, sig.max_batch or DEFAULT_MAX_BATCH_SIZE)
        if msg.max_batch_size > 1 and not (msg.HasField("dynamic_batching") or msg.HasField("sequence_batching")):
            msg.dynamic_batching.SetInParent()
    for what, have, tensors in (("input", msg.input, sig.inputs), ("output", msg.output, sig.outputs)):
        if len(have):
            continue
        for t in tensors:
            if t.shape is None:
                raise ModelConfigError(source, None, what, f"{what} {t.name!r} has no shape in {path}: give the "
                                                           f"{what}s' dims in config.pbtxt")
            dims = list(t.shape)
            if msg.max_batch_size > 0:
                if not dims or dims[0] != -1:
                    raise ModelConfigError(source, None, what,
                                           f"{what} {t.name!r} of {path} has shape {list(t.shape)}: with "
                                           f"max_batch_size {msg.max_batch_size} its first dimension must be "
                                           "the batch (dynamic)")
                dims = dims[1:]
            entry = have.add()
            entry.name = t.name
            entry.data_type = proto.pb.DataType.Value(t.datatype.config_name)
            if dims:
                entry.dims.extend(dims)
            else:
                # A scalar per request: Triton writes it as dims [1] reshaped to [].
                entry.dims.append(1)
                entry.reshape.SetInParent()


def read_file_signature(path: str | Path, fmt: str, torch_ok: bool = True) -> FileSignature:
    """The tensors a model file of format ``fmt`` declares. Raises :class:`ModelConfigError` where the
    format carries none (TorchScript), the library that reads it is missing, or it needs torch and
    ``torch_ok`` is False."""
    p = Path(path)
    if fmt == "onnx":
        return onnx_signature(p)
    if fmt == "torch_export":
        if not torch_ok:
            raise ModelConfigError(str(p), None, "input",
                                   "completing a torch.export model.pt2 loads torch, which this process does not: "
                                   "give input and output in config.pbtxt")
        return torch_export_signature(p)
    if fmt == "tensorrt_plan":
        return plan_signature(p)
    if fmt == "openvino_ir":
        return openvino_signature(p)
    if fmt == "torchscript":
        raise ModelConfigError(str(p), None, "input",
                               "a TorchScript model.pt carries no tensor datatypes or shapes: give input and "
                               "output in config.pbtxt")
    raise ModelConfigError(str(p), None, "input",
                           f"completing a model of format {fmt} from its file is not supported: give input and output in "
                           "config.pbtxt")


def _file_tensor(path: Path, what: str, name: str, dtype: DataType | None, type_name: str,
                 shape: Sequence[int] | None) -> FileTensor:
    if dtype is None:
        raise ModelConfigError(str(path), None, what, f"{what} {name!r} has element type {type_name}, which has no "
                                                      "Triton datatype")
    return FileTensor(name, dtype, tuple(shape) if shape is not None else None)


def onnx_signature(path: Path) -> FileSignature:
    """The graph inputs (less initializers) and outputs of an ONNX file, read without its external data."""
    try:
        import onnx
    except ImportError:
        raise ModelConfigError(str(path), None, "input", "completing an ONNX model needs the onnx package "
                                                         "(the onnx extra: pip install -e '.[onnx]')") from None
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # onnx raises DecodeError, OSError, ValueError... for a bad file
        raise ModelConfigError(str(path), None, "model file", f"not a readable ONNX model: {e}") from None
    graph = model.graph
    weights = {t.name for t in graph.initializer} | {t.values.name for t in graph.sparse_initializer}

    def one(vi: Any, what: str) -> FileTensor:
        kind = vi.type.WhichOneof("value")
        if kind != "tensor_type":
            raise ModelConfigError(str(path), None, what, f"{what} {vi.name!r} is a {kind or 'typeless value'}, "
                                                          "not a tensor")
        tt = vi.type.tensor_type
        type_name = onnx.TensorProto.DataType.Name(tt.elem_type)
        shape = None
        if tt.HasField("shape"):
            shape = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1 for d in tt.shape.dim]
        return _file_tensor(path, what, vi.name, _ONNX_TYPES.get(type_name), type_name, shape)

    inputs = tuple(one(vi, "input") for vi in graph.input if vi.name not in weights)
    outputs = tuple(one(vi, "output") for vi in graph.output)
    return _nonempty(path, inputs, outputs)


def _nonempty(path: Path, inputs: tuple[FileTensor, ...], outputs: tuple[FileTensor, ...],
              max_batch: int | None = None) -> FileSignature:
    for what, items in (("input", inputs), ("output", outputs)):
        if not items:
            raise ModelConfigError(str(path), None, what, f"the model file declares no {what}")
    return FileSignature(inputs, outputs, max_batch)


def openvino_signature(path: Path) -> FileSignature:
    """The inputs and outputs of an OpenVINO IR (``model.xml`` beside its ``model.bin``), each by its
    first tensor name."""
    try:
        import openvino as ov
    except ImportError:
        raise ModelConfigError(str(path), None, "input", "completing an OpenVINO IR needs the openvino package "
                                                         "(the openvino extra): give input and output in "
                                                         "config.pbtxt") from None
    try:
        model = ov.Core().read_model(str(path))
    except Exception as e:  # OpenVINO raises RuntimeError subclasses for a bad IR
        raise ModelConfigError(str(path), None, "model file", f"not a readable OpenVINO IR: {e}") from None

    def one(port: Any, what: str) -> FileTensor:
        try:
            name = port.get_any_name()
        except RuntimeError:
            raise ModelConfigError(str(path), None, what, f"an {what} of the IR has no tensor name: give input and "
                                                          "output in config.pbtxt") from None
        type_name = port.get_element_type().get_type_name()
        ps = port.get_partial_shape()
        shape = None if ps.rank.is_dynamic else [d.get_length() if d.is_static else -1 for d in ps]
        t = _file_tensor(path, what, name, _OPENVINO_TYPES.get(type_name), type_name, shape)
        return FileTensor(t.name, t.datatype, t.shape, tuple(sorted(set(port.get_names()) - {name})))

    return _nonempty(path, tuple(one(p, "input") for p in model.inputs),
                     tuple(one(p, "output") for p in model.outputs))


def torch_export_signature(path: Path) -> FileSignature:
    """The user inputs (by their argument names) and outputs (``output__0``, ``output__1``... in order,
    Triton's PyTorch naming) of a ``torch.export`` program. Imports torch: call it only where torch
    may be loaded (an instance, a tool), never in the node."""
    try:
        import torch
    except ImportError:
        raise ModelConfigError(str(path), None, "input",
                               "completing a torch.export model.pt2 needs torch in this process: give input "
                               "and output in config.pbtxt") from None
    try:
        ep = torch.export.load(str(path))
    except Exception as e:  # torch raises many kinds for a bad archive
        raise ModelConfigError(str(path), None, "model file", f"not a loadable torch.export program: {e}") from None
    nodes = {n.name: n for n in ep.graph.nodes}
    sig = ep.graph_signature

    def one(node_name: str, name: str, what: str) -> FileTensor:
        val = nodes[node_name].meta.get("val") if node_name in nodes else None
        if val is None or not hasattr(val, "dtype"):
            raise ModelConfigError(str(path), None, what, f"{what} {name!r} is not a tensor (torch.export "
                                                          "models with non-tensor inputs or outputs need a "
                                                          "config.pbtxt)")
        shape = [d if type(d) is int else -1 for d in val.shape]
        return _file_tensor(path, what, name, _TORCH_TYPES.get(str(val.dtype)), str(val.dtype), shape)

    inputs = tuple(one(n, n, "input") for n in sig.user_inputs)
    outputs = tuple(one(n, f"output__{i}", "output") for i, n in enumerate(sig.user_outputs))
    return _nonempty(path, inputs, outputs)


def plan_signature(path: Path) -> FileSignature:
    """The I/O tensors of a TensorRT plan (TensorRT 10+ API) and the batch its first optimization
    profile allows. Needs the ``tensorrt`` package, which deserializes plans on a GPU."""
    try:
        import tensorrt as trt
    except ImportError:
        raise ModelConfigError(str(path), None, "input",
                               "completing a TensorRT plan needs the tensorrt package on a GPU host: give input "
                               "and output in config.pbtxt") from None
    try:
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
    except Exception as e:  # TensorRT raises RuntimeError/TypeError for a bad or foreign plan
        raise ModelConfigError(str(path), None, "model file", f"TensorRT cannot load this plan: {e}") from None
    if engine is None:
        raise ModelConfigError(str(path), None, "model file", "TensorRT cannot load this plan (built by another "
                                                              "TensorRT version or for another GPU?)")
    inputs: list[FileTensor] = []
    outputs: list[FileTensor] = []
    max_batch: int | None = None
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        what = "input" if is_input else "output"
        dtype_name = getattr(engine.get_tensor_dtype(name), "name", str(engine.get_tensor_dtype(name)))
        shape = [int(d) for d in engine.get_tensor_shape(name)]
        t = _file_tensor(path, what, name, _TRT_TYPES.get(dtype_name), dtype_name, shape)
        (inputs if is_input else outputs).append(t)
        if is_input and shape and shape[0] == -1 and engine.num_optimization_profiles > 0:
            top = int(engine.get_tensor_profile_shape(name, 0)[2][0])
            max_batch = top if max_batch is None else min(max_batch, top)
    return _nonempty(path, tuple(inputs), tuple(outputs), max_batch)


def check_model_file(config: ModelConfigLike, path: str | Path, torch_ok: bool = False) -> None:
    """Check a config's inputs and outputs against what its model file declares, as Triton does when it
    loads a model: every tensor the config lists is the file's, of the same datatype and rank (plus the
    batch dimension when ``max_batch_size`` > 0), each fixed size equal where the file fixes it (the
    ``reshape`` is what the file sees where there is one); every input the file takes is listed. Files
    that declare nothing checkable (TorchScript; a torch.export program when ``torch_ok`` is False; a plan
    without ``tensorrt``) pass unchecked. Raises :class:`ModelConfigError` naming the file and tensor."""
    p = Path(path)
    fmt = config.model_format
    try:
        if fmt == "torchscript" or (fmt == "torch_export" and not torch_ok):
            return
        sig = read_file_signature(p, fmt, torch_ok)
    except ModelConfigError as e:
        if fmt == "tensorrt_plan" and e.field == "input":
            return  # no tensorrt here: the engine checks the plan where it loads it
        raise
    batched = config.signature.max_batch_size > 0
    for what, specs, have in (("input", config.signature.inputs, sig.inputs),
                              ("output", config.signature.outputs, sig.outputs)):
        by_name = {n: t for t in have for n in (t.name, *t.aliases)}
        if fmt == "torch_export" and not all(s.name in by_name for s in specs):
            # A torch.export program's tensors are positional (its outputs have no names, its inputs
            # are bound by name, INPUT__<i> or order: gpuprims.engines.file_torch): pair them in order.
            if len(specs) != len(have):
                raise ModelConfigError(str(p), None, what, f"the config lists {len(specs)} {what}s, the program "
                                                           f"has {len(have)}")
            by_name = {s.name: t for s, t in zip(specs, have)}
        for i, spec in enumerate(specs):
            fld = f"{what}[{i}]"
            t = by_name.get(spec.name)
            if t is None:
                raise ModelConfigError(str(p), None, fld, f"the model file has no {what} {spec.name!r} (its {what}s: "
                                                          f"{', '.join(repr(t.name) for t in have)})")
            if t.datatype is not spec.datatype:
                raise ModelConfigError(str(p), None, f"{fld}.data_type",
                                       f"{what} {spec.name!r} is {t.datatype.config_name} in the model file, "
                                       f"{spec.datatype.config_name} in the config")
            want = list(spec.reshape if spec.reshape is not None else spec.dims)
            if batched:
                want = [-1, *want]
            if t.shape is None:
                continue  # the file does not say: the engine finds out
            got = list(t.shape)
            # A size the file fixes must be the config's (a config -1 there would take requests the model
            # refuses); a size the file leaves dynamic takes whatever the config says.
            if len(got) != len(want) or any(g != -1 and g != w for g, w in zip(got, want)):
                raise ModelConfigError(str(p), None, f"{fld}.dims",
                                       f"{what} {spec.name!r} has shape {got} in the model file; the config gives "
                                       f"{want} (-1: any size{', the first the batch' if batched else ''})")
        if what == "input":
            paired = {id(by_name[s.name]) for s in specs}
            extra = [t.name for t in have if id(t) not in paired]
            if extra:
                raise ModelConfigError(str(p), None, "input", f"the model file takes inputs {extra} the config "
                                                              "does not list")
