"""Model files as users bring them, built in the test (never the zoo), and a Triton repository of them.

- :func:`multi_io_onnx`: three inputs (FP32 with a dynamic width, INT64, BOOL) and four outputs (FP32, FP16,
  BOOL, INT64), odd tensor names (spaces, dots), a batch dimension;
- :func:`detector_onnx`: no batch dimension, an output whose length depends on the input (NonZero), as a
  detector's boxes;
- :func:`run_onnx`: the file run directly in ONNX Runtime, the oracle every answer is compared with.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

OPSET = 17

MULTI_CONFIG = """
name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
input [
  {{ name: "image in" data_type: TYPE_FP32 dims: [ 3, -1 ] }},
  {{ name: "scale.k" data_type: TYPE_INT64 dims: [ 1 ] }},
  {{ name: "flag" data_type: TYPE_BOOL dims: [ 1 ] }}
]
output [
  {{ name: "mean out" data_type: TYPE_FP32 dims: [ 3 ] }},
  {{ name: "half" data_type: TYPE_FP16 dims: [ 3 ] }},
  {{ name: "is pos" data_type: TYPE_BOOL dims: [ 1 ] }},
  {{ name: "k twice" data_type: TYPE_INT64 dims: [ 1 ] }}
]
dynamic_batching {{ max_queue_delay_microseconds: 2000 }}
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
parameters {{ key: "slo_ms" value {{ string_value: "5000" }} }}
"""

DETECTOR_CONFIG = """
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ {{ name: "scores" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "idx" data_type: TYPE_INT64 dims: [ -1 ] }} ]
parameters {{ key: "slo_ms" value {{ string_value: "5000" }} }}
"""


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def multi_io_onnx(path: Path) -> Path:
    """``mean out`` = mean of ``image in`` over its width x ``scale.k``; ``half`` the same as FP16;
    ``is pos`` = ``flag`` and the row's sum > 0; ``k twice`` = 2 x ``scale.k``."""
    x = helper.make_tensor_value_info("image in", TensorProto.FLOAT, ["N", 3, "W"])
    k = helper.make_tensor_value_info("scale.k", TensorProto.INT64, ["N", 1])
    f = helper.make_tensor_value_info("flag", TensorProto.BOOL, ["N", 1])
    outs = [helper.make_tensor_value_info("mean out", TensorProto.FLOAT, ["N", 3]),
            helper.make_tensor_value_info("half", TensorProto.FLOAT16, ["N", 3]),
            helper.make_tensor_value_info("is pos", TensorProto.BOOL, ["N", 1]),
            helper.make_tensor_value_info("k twice", TensorProto.INT64, ["N", 1])]
    nodes = [
        helper.make_node("ReduceMean", ["image in"], ["m"], axes=[2], keepdims=0),
        helper.make_node("Cast", ["scale.k"], ["kf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["m", "kf"], ["mean out"]),
        helper.make_node("Cast", ["mean out"], ["half"], to=TensorProto.FLOAT16),
        helper.make_node("ReduceSum", ["mean out", "one"], ["s"], keepdims=1),
        helper.make_node("Greater", ["s", "zero"], ["g"]),
        helper.make_node("And", ["g", "flag"], ["is pos"]),
        helper.make_node("Add", ["scale.k", "scale.k"], ["k twice"]),
    ]
    inits = [helper.make_tensor("one", TensorProto.INT64, [1], [1]),
             helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])]
    return _save(helper.make_graph(nodes, "multi io", [x, k, f], outs, inits), path)


def detector_onnx(path: Path, threshold: float = 0.5) -> Path:
    """``idx`` = the indices of ``scores`` above ``threshold``: its length depends on the input."""
    s = helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["K"])
    out = helper.make_tensor_value_info("idx", TensorProto.INT64, ["M"])
    nodes = [helper.make_node("Greater", ["scores", "half"], ["g"]),
             helper.make_node("NonZero", ["g"], ["nz"]),
             helper.make_node("Reshape", ["nz", "flat"], ["idx"])]
    inits = [helper.make_tensor("half", TensorProto.FLOAT, [], [threshold]),
             helper.make_tensor("flat", TensorProto.INT64, [1], [-1])]
    return _save(helper.make_graph(nodes, "detector", [s], [out], inits), path)


def unrunnable_onnx(path: Path) -> Path:
    """A well-formed ONNX file whose one op no runtime has (``Foo`` of domain ``com.example``): it reads,
    its tensors match its config, and it fails only when an engine loads it."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["K"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["K"])
    graph = helper.make_graph([helper.make_node("Foo", ["x"], ["y"], domain="com.example")], "unrunnable", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid("com.example", 1)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def multi_inputs(n: int, width: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A batch of ``n`` requests of :func:`multi_io_onnx` (image width ``width``)."""
    rng = np.random.default_rng(seed)
    return {"image in": rng.standard_normal((n, 3, width)).astype(np.float32),
            "scale.k": rng.integers(-3, 4, size=(n, 1)).astype(np.int64),
            "flag": rng.integers(0, 2, size=(n, 1)).astype(bool)}


def run_onnx(path: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The file run directly in ONNX Runtime (CPU): the oracle."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, inputs)))


def repository(root: Path) -> Path:
    """A Triton model repository: ``multi`` (config.pbtxt, version 1), ``noconfig`` (the same file, no
    config: completed from it), ``detector`` (max_batch_size 0) and ``broken`` (a corrupt file)."""
    multi_io_onnx(root / "multi" / "1" / "model.onnx")
    (root / "multi" / "config.pbtxt").write_text(MULTI_CONFIG.format(name="multi"))
    multi_io_onnx(root / "noconfig" / "1" / "model.onnx")
    detector_onnx(root / "detector" / "1" / "model.onnx")
    (root / "detector" / "config.pbtxt").write_text(DETECTOR_CONFIG.format(name="detector"))
    (root / "broken" / "1").mkdir(parents=True)
    (root / "broken" / "1" / "model.onnx").write_bytes(b"this is not an onnx file")
    (root / "broken" / "config.pbtxt").write_text(DETECTOR_CONFIG.format(name="broken"))
    return root
