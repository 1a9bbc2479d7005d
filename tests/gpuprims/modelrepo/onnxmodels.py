"""Small ONNX models built with onnx.helper for the model repository's tests (never the zoo): several
inputs and outputs, odd names, FP16/INT64/BOOL, dynamic and fixed dimensions, a weight listed as a
graph input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: The multi-tensor model's tensors as completion must read them (per-request dims, batch dropped).
MULTI_INPUTS = [("x y", "TYPE_FP32", [3, -1]), ("ids.0", "TYPE_INT64", [4]), ("mask", "TYPE_BOOL", [4]),
                ("h", "TYPE_FP16", [2])]
MULTI_OUTPUTS = [("out.sum", "TYPE_FP32", [3, -1]), ("ids out", "TYPE_INT64", [4]), ("mask out", "TYPE_BOOL", [4]),
                 ("h2", "TYPE_FP16", [2])]


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def multi(path: Path) -> Path:
    """Four inputs and four outputs, every one with a dynamic first dimension ``N`` (``x y`` also a
    symbolic width ``W``); a weight ``w`` is an initializer listed among the graph inputs."""
    inputs = [
        helper.make_tensor_value_info("x y", TensorProto.FLOAT, ["N", 3, "W"]),
        helper.make_tensor_value_info("ids.0", TensorProto.INT64, ["N", 4]),
        helper.make_tensor_value_info("mask", TensorProto.BOOL, ["N", 4]),
        helper.make_tensor_value_info("h", TensorProto.FLOAT16, ["N", 2]),
        helper.make_tensor_value_info("w", TensorProto.FLOAT, [1]),
    ]
    outputs = [
        helper.make_tensor_value_info("out.sum", TensorProto.FLOAT, ["N", 3, "W"]),
        helper.make_tensor_value_info("ids out", TensorProto.INT64, ["N", 4]),
        helper.make_tensor_value_info("mask out", TensorProto.BOOL, ["N", 4]),
        helper.make_tensor_value_info("h2", TensorProto.FLOAT16, ["N", 2]),
    ]
    nodes = [
        helper.make_node("Mul", ["x y", "w"], ["out.sum"]),
        helper.make_node("Identity", ["ids.0"], ["ids out"]),
        helper.make_node("Not", ["mask"], ["mask out"]),
        helper.make_node("Identity", ["h"], ["h2"]),
    ]
    w = numpy_helper.from_array(np.array([2.0], np.float32), "w")
    return _save(helper.make_graph(nodes, "multi", inputs, outputs, [w]), path)


def fixed(path: Path, scalar_out: bool = False) -> Path:
    """One FP32 input of fixed shape [2, 3] (no batch dimension) and its sum: a vector [2] or, with
    ``scalar_out``, a scalar."""
    inputs = [helper.make_tensor_value_info("in", TensorProto.FLOAT, [2, 3])]
    if scalar_out:
        outputs = [helper.make_tensor_value_info("total", TensorProto.FLOAT, [])]
        nodes = [helper.make_node("ReduceSum", ["in"], ["total"], keepdims=0)]
    else:
        outputs = [helper.make_tensor_value_info("total", TensorProto.FLOAT, [2])]
        axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
        nodes = [helper.make_node("ReduceSum", ["in", "axes"], ["total"], keepdims=0)]
        return _save(helper.make_graph(nodes, "fixed", inputs, outputs, [axes]), path)
    return _save(helper.make_graph(nodes, "fixed", inputs, outputs), path)


def strings(path: Path) -> Path:
    """A STRING (BYTES) input echoed: completion must refuse it, naming the tensor."""
    inputs = [helper.make_tensor_value_info("text in", TensorProto.STRING, ["N", 1])]
    outputs = [helper.make_tensor_value_info("text out", TensorProto.STRING, ["N", 1])]
    return _save(helper.make_graph([helper.make_node("Identity", ["text in"], ["text out"])], "s", inputs, outputs),
                 path)


def unranked(path: Path) -> Path:
    """An input without a shape in the graph."""
    inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, None)]
    outputs = [helper.make_tensor_value_info("b", TensorProto.FLOAT, None)]
    return _save(helper.make_graph([helper.make_node("Identity", ["a"], ["b"])], "u", inputs, outputs), path)
