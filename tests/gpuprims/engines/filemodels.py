"""Small model files built in a test's tmp_path (never the zoo), with the signatures that describe them:
ONNX graphs made with onnx.helper (several inputs and outputs, odd names, FP16/INT64/BOOL/BF16, dynamic
dims, data-dependent output sizes, reshape), and TorchScript and torch.export files.

Importing this module imports onnx and numpy only; the torch builders import torch when called."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
from onnx import TensorProto as TP
from onnx import helper

from gpuprims.tensors import DataType, ModelSignature, TensorSpec

#: ORT 1.31 reads ONNX IR versions up to 13 (onnx 1.23 writes newer by default).
IR_VERSION = 9
OPSET = 18
MAX_BATCH = 8


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _const(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TP.INT64, [len(values)], values))


def multi_io(path: Path) -> tuple[Path, ModelSignature]:
    """Four inputs and four outputs with spaces and dots in their names, FP32/FP16/INT64/BOOL, a dynamic
    batch dimension (max_batch_size 8)."""
    vi = helper.make_tensor_value_info
    inputs = [vi("image in", TP.FLOAT, ["n", 3, 4]), vi("scale.factor", TP.FLOAT16, ["n", 1, 1]),
              vi("ids", TP.INT64, ["n", 5]), vi("mask", TP.BOOL, ["n", 5])]
    outputs = [vi("out.sum", TP.FLOAT, ["n", 3]), vi("ids x2", TP.INT64, ["n", 5]),
               vi("not mask", TP.BOOL, ["n", 5]), vi("half out", TP.FLOAT16, ["n", 3])]
    nodes = [
        helper.make_node("Cast", ["scale.factor"], ["scale32"], to=TP.FLOAT),
        helper.make_node("Mul", ["image in", "scale32"], ["scaled"]),
        _const("axis2", [2]),
        helper.make_node("ReduceSum", ["scaled", "axis2"], ["out.sum"], keepdims=0),
        helper.make_node("Add", ["ids", "ids"], ["ids x2"]),
        helper.make_node("Not", ["mask"], ["not mask"]),
        helper.make_node("Cast", ["out.sum"], ["half out"], to=TP.FLOAT16),
    ]
    _save(helper.make_graph(nodes, "multi", inputs, outputs), path)
    sig = ModelSignature(
        (TensorSpec("image in", DataType.FP32, (3, 4)), TensorSpec("scale.factor", DataType.FP16, (1, 1)),
         TensorSpec("ids", DataType.INT64, (5,)), TensorSpec("mask", DataType.BOOL, (5,))),
        (TensorSpec("out.sum", DataType.FP32, (3,)), TensorSpec("ids x2", DataType.INT64, (5,)),
         TensorSpec("not mask", DataType.BOOL, (5,)), TensorSpec("half out", DataType.FP16, (3,))),
        max_batch_size=MAX_BATCH)
    return path, sig


def multi_inputs(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"image in": rng.standard_normal((n, 3, 4)).astype(np.float32),
            "scale.factor": rng.uniform(0.5, 2, (n, 1, 1)).astype(np.float16),
            "ids": rng.integers(-1000, 1000, (n, 5)).astype(np.int64),
            "mask": rng.random((n, 5)) > 0.5}


def dynamic(path: Path) -> tuple[Path, ModelSignature]:
    """An OCR-like model whose second dimension is any width: ``tokens`` [n, -1] -> ``twice`` [n, -1]
    and ``peak`` [n, 1]."""
    vi = helper.make_tensor_value_info
    nodes = [helper.make_node("Add", ["tokens", "tokens"], ["twice"]), _const("axis1", [1]),
             helper.make_node("ReduceMax", ["tokens", "axis1"], ["peak"], keepdims=1)]
    graph = helper.make_graph(nodes, "dynamic", [vi("tokens", TP.FLOAT, ["n", "w"])],
                              [vi("twice", TP.FLOAT, ["n", "w"]), vi("peak", TP.FLOAT, ["n", 1])])
    _save(graph, path)
    sig = ModelSignature((TensorSpec("tokens", DataType.FP32, (-1,)),),
                         (TensorSpec("twice", DataType.FP32, (-1,)), TensorSpec("peak", DataType.FP32, (1,))),
                         max_batch_size=MAX_BATCH)
    return path, sig


def data_dependent(path: Path) -> tuple[Path, ModelSignature]:
    """max_batch_size 0, outputs whose size depends on the input's values: NonZero of ``x`` and a TopK
    whose k is an input."""
    vi = helper.make_tensor_value_info
    nodes = [helper.make_node("NonZero", ["x"], ["where"]),
             helper.make_node("TopK", ["x", "k"], ["top values", "top.indices"], axis=0)]
    graph = helper.make_graph(nodes, "data_dependent", [vi("x", TP.FLOAT, ["len"]), vi("k", TP.INT64, [1])],
                              [vi("where", TP.INT64, [1, "nz"]), vi("top values", TP.FLOAT, ["k"]),
                               vi("top.indices", TP.INT64, ["k"])])
    _save(graph, path)
    sig = ModelSignature((TensorSpec("x", DataType.FP32, (-1,)), TensorSpec("k", DataType.INT64, (1,))),
                         (TensorSpec("where", DataType.INT64, (1, -1)), TensorSpec("top values", DataType.FP32, (-1,)),
                          TensorSpec("top.indices", DataType.INT64, (-1,))), max_batch_size=0)
    return path, sig


def bf16(path: Path) -> tuple[Path, ModelSignature]:
    """BF16 in, BF16 and FP32 out: ``in x`` [n, 4] -> ``out.y`` = 2x (BF16), ``z`` = 2x (FP32)."""
    vi = helper.make_tensor_value_info
    nodes = [helper.make_node("Cast", ["in x"], ["xf"], to=TP.FLOAT), helper.make_node("Add", ["xf", "xf"], ["z"]),
             helper.make_node("Cast", ["z"], ["out.y"], to=TP.BFLOAT16)]
    graph = helper.make_graph(nodes, "bf16", [vi("in x", TP.BFLOAT16, ["n", 4])],
                              [vi("out.y", TP.BFLOAT16, ["n", 4]), vi("z", TP.FLOAT, ["n", 4])])
    _save(graph, path)
    sig = ModelSignature((TensorSpec("in x", DataType.BF16, (4,)),),
                         (TensorSpec("out.y", DataType.BF16, (4,)), TensorSpec("z", DataType.FP32, (4,))),
                         max_batch_size=MAX_BATCH)
    return path, sig


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> the uint16 bits of bfloat16 (truncated: exact for values with 8 significant bits)."""
    return (np.ascontiguousarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def reshaped(path: Path) -> tuple[Path, ModelSignature]:
    """config.pbtxt's reshape both ways: requests carry ``flat`` [12], the model sees [3, 4]; it gives
    [n, 3, 1], requests get ``rows`` [3]."""
    vi = helper.make_tensor_value_info
    nodes = [_const("axis2", [2]), helper.make_node("ReduceSum", ["flat", "axis2"], ["rows"], keepdims=1)]
    graph = helper.make_graph(nodes, "reshaped", [vi("flat", TP.FLOAT, ["n", 3, 4])],
                              [vi("rows", TP.FLOAT, ["n", 3, 1])])
    _save(graph, path)
    sig = ModelSignature((TensorSpec("flat", DataType.FP32, (12,), reshape=(3, 4)),),
                         (TensorSpec("rows", DataType.FP32, (3,), reshape=(3, 1)),), max_batch_size=MAX_BATCH)
    return path, sig


def external_data(path: Path) -> tuple[Path, ModelSignature]:
    """``y = x @ W`` with W (64x64 float32, 16 KiB) kept as ONNX external data in ``<name>.data`` beside
    the graph, as large models are saved."""
    vi = helper.make_tensor_value_info
    w = np.random.default_rng(7).standard_normal((64, 64)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "external",
                              [vi("x", TP.FLOAT, ["n", 64])], [vi("y", TP.FLOAT, ["n", 64])],
                              initializer=[onnx.numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location=path.name + ".data", size_threshold=0)
    sig = ModelSignature((TensorSpec("x", DataType.FP32, (64,)),), (TensorSpec("y", DataType.FP32, (64,)),),
                         max_batch_size=MAX_BATCH)
    return path, sig


# -- torch files ---------------------------------------------------------------------------------------------
def torchscript(path: Path, how: str = "script", returns: str = "tuple") -> tuple[Path, ModelSignature]:
    """A TorchScript archive (``how``: script or trace) of ``forward(x: FP32 [n,4], y: INT64 [n,4])``
    returning a ``tuple`` (sum FP32, y+1 INT64) or a ``dict`` of the same under the names ``sum`` and
    ``next``. Its signature uses Triton's TorchScript names INPUT__0.. / OUTPUT__0.. for a tuple."""
    import torch

    class Tup(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.lin(x) + y.to(torch.float32), y + 1

    class Dic(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"next": y + 1, "sum": self.lin(x) + y.to(torch.float32)}

    torch.manual_seed(0)
    mod = (Tup() if returns == "tuple" else Dic()).eval()
    ex = (torch.rand(2, 4), torch.randint(0, 9, (2, 4)))
    sm = torch.jit.script(mod) if how == "script" else torch.jit.trace(mod, ex, strict=False)
    torch.jit.save(sm, str(path))
    if returns == "tuple":
        ins, outs = ("INPUT__0", "INPUT__1"), ("OUTPUT__0", "OUTPUT__1")
    else:
        ins, outs = ("x", "y"), ("sum", "next")
    sig = ModelSignature((TensorSpec(ins[0], DataType.FP32, (4,)), TensorSpec(ins[1], DataType.INT64, (4,))),
                         (TensorSpec(outs[0], DataType.FP32, (4,)), TensorSpec(outs[1], DataType.INT64, (4,))),
                         max_batch_size=MAX_BATCH)
    return path, sig


def torch_inputs(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 4)).astype(np.float32), rng.integers(-50, 50, (n, 4)).astype(np.int64)


def exported(path: Path) -> tuple[Path, ModelSignature]:
    """A torch.export program (``torch.export.save``): ``forward(image: FP32 [n,3], scale: FP32 [n,3])`` ->
    (image * scale + bias FP32, (image + 1) FP16), the batch dimension dynamic (torch.export.Dim)."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))

        def forward(self, image: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return image * scale + self.bias, (image + 1).to(torch.float16)

    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    ep = torch.export.export(Net().eval(), (torch.rand(2, 3), torch.rand(2, 3)),
                             dynamic_shapes={"image": {0: batch}, "scale": {0: batch}})
    torch.export.save(ep, str(path))
    sig = ModelSignature((TensorSpec("image", DataType.FP32, (3,)), TensorSpec("scale", DataType.FP32, (3,))),
                         (TensorSpec("scaled", DataType.FP32, (3,)), TensorSpec("plus one", DataType.FP16, (3,))),
                         max_batch_size=MAX_BATCH)
    return path, sig


def bf16_torchscript(path: Path) -> tuple[Path, ModelSignature]:
    """A TorchScript module taking and giving bfloat16: ``x`` [n, 4] BF16 -> ``y`` = 2x BF16."""
    import torch

    class Twice(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    torch.jit.save(torch.jit.script(Twice()), str(path))
    sig = ModelSignature((TensorSpec("x", DataType.BF16, (4,)),), (TensorSpec("y", DataType.BF16, (4,)),),
                         max_batch_size=MAX_BATCH)
    return path, sig
