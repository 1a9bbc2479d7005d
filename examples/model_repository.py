"""Build the example Triton model repository from seeded models (no binaries in git).

``python examples/model_repository.py [OUT]`` (default ``build/example-repository``) writes six models,
each in Triton's layout ``<model>/config.pbtxt`` + ``<model>/1/model.<ext>``:

========== ============== ===================================================================================
model      file           what it shows
========== ============== ===================================================================================
mixed      ONNX           three inputs (FP32 image [3,32,32], INT64 ids [4], BOOL mask [4]) and three outputs
                          (FP32 logits [10], FP16 embedding [16], INT64 label [1]), batched up to 8
ocr        ONNX           a dynamic width: image [1,32,-1] in, per-column logits [-1,12] out; requests are
                          batched only with requests of the same width
scripted   TorchScript    ``torch.jit.script`` of a small MLP, Triton's ``INPUT__0`` / ``OUTPUT__<i>`` names
exported   torch.export   ``torch.export.save`` of a two-input module with a dynamic batch (``Dim``)
noconfig   ONNX           no config.pbtxt: the node completes it from the file (every first axis dynamic, so
                          it is batched)
detector   ONNX           ``max_batch_size: 0``: a conv head's candidate boxes, a score threshold and
                          NonMaxSuppression, so the number of boxes, scores and classes depends on the image
========== ============== ===================================================================================

Weights come from fixed seeds (``torch.manual_seed``, numpy's ``default_rng``), so two builds give
byte-identical files. The shares (``parameters`` gpu_pct) add up to 100 with ``noconfig``'s ``auto``
(what the others leave), so the six models multiplex on one GPU or on two CPU cores.

:func:`build` is what the script runs; :data:`MODELS` names each model's file for the client
(examples/repository_client.py), which runs each file directly as the oracle.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "build" / "example-repository"
#: ONNX opset and IR version of the ONNX models: what ONNX Runtime and OpenVINO of the pinned versions take.
OPSET = 17
IR_VERSION = 8

#: Each model's file, relative to the repository: ``<model>/1/model.<ext>``.
MODELS: dict[str, str] = {
    "mixed": "mixed/1/model.onnx",
    "ocr": "ocr/1/model.onnx",
    "scripted": "scripted/1/model.pt",
    "exported": "exported/1/model.pt2",
    "noconfig": "noconfig/1/model.onnx",
    "detector": "detector/1/model.onnx",
}

#: Vocabulary of ``mixed``'s ids (an id is 0..VOCAB-1) and the OCR model's classes per column.
VOCAB = 100
OCR_CLASSES = 12
#: The detector's image side, its grid (one candidate box per cell) and its classes.
DET_SIDE = 64
DET_CELL = 8
DET_CLASSES = 3


def _params(gpu_pct: int, slo_ms: int) -> str:
    return (f'parameters {{ key: "gpu_pct" value {{ string_value: "{gpu_pct}" }} }}\n'
            f'parameters {{ key: "slo_ms" value {{ string_value: "{slo_ms}" }} }}\n')


# Shares: 20 + 20 + 15 + 15 + 15 = 85; noconfig (no parameters) is auto and gets the 15 left.
# On two CPU cores each instance gets one core (cpushare: max(1, round(pct x cores / 100))).
CONFIGS: dict[str, str] = {
    "mixed": """name: "mixed"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  { name: "image" data_type: TYPE_FP32 dims: [ 3, 32, 32 ] },
  { name: "ids" data_type: TYPE_INT64 dims: [ 4 ] },
  { name: "mask" data_type: TYPE_BOOL dims: [ 4 ] }
]
output [
  { name: "logits" data_type: TYPE_FP32 dims: [ 10 ] },
  { name: "embedding" data_type: TYPE_FP16 dims: [ 16 ] },
  { name: "label" data_type: TYPE_INT64 dims: [ 1 ] }
]
dynamic_batching { max_queue_delay_microseconds: 2000 }
instance_group [ { count: 1 kind: KIND_AUTO } ]
""" + _params(20, 200),
    "ocr": """name: "ocr"
platform: "onnxruntime_onnx"
max_batch_size: 4
input [ { name: "image" data_type: TYPE_FP32 dims: [ 1, 32, -1 ] } ]
output [ { name: "logits" data_type: TYPE_FP32 dims: [ -1, 12 ] } ]
dynamic_batching { max_queue_delay_microseconds: 2000 }
instance_group [ { count: 1 kind: KIND_AUTO } ]
""" + _params(20, 200),
    "scripted": """name: "scripted"
platform: "pytorch_libtorch"
max_batch_size: 8
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [
  { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "OUTPUT__1" data_type: TYPE_INT64 dims: [ 1 ] }
]
dynamic_batching { max_queue_delay_microseconds: 2000 }
instance_group [ { count: 1 kind: KIND_AUTO } ]
""" + _params(15, 200),
    # The node never loads torch, so a torch.export file's tensors are written here (docs/model-repository.md).
    "exported": """name: "exported"
backend: "pytorch"
default_model_filename: "model.pt2"
max_batch_size: 8
input [
  { name: "features" data_type: TYPE_FP32 dims: [ 12 ] },
  { name: "scale" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "scores" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "norm" data_type: TYPE_FP32 dims: [ 1 ] }
]
dynamic_batching { max_queue_delay_microseconds: 2000 }
instance_group [ { count: 1 kind: KIND_AUTO } ]
""" + _params(15, 200),
    "detector": """name: "detector"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "image" data_type: TYPE_FP32 dims: [ 3, 64, 64 ] } ]
output [
  { name: "boxes" data_type: TYPE_FP32 dims: [ -1, 4 ] },
  { name: "scores" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "classes" data_type: TYPE_INT64 dims: [ -1 ] }
]
instance_group [ { count: 1 kind: KIND_AUTO } ]
""" + _params(15, 300),
}


def _tensor(name: str, array: np.ndarray) -> TensorProto:
    return numpy_helper.from_array(np.ascontiguousarray(array), name=name)


def _save_onnx(graph: onnx.GraphProto, path: Path) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="gpuprims-example")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def _weights(rng: np.random.Generator, *shape: int, scale: float = 0.3) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def mixed_onnx(path: Path) -> None:
    """``mixed``: a conv feature of ``image`` and the mean of the unmasked ``ids``' embeddings, concatenated,
    give ``embedding`` (tanh, as FP16), ``logits`` (a linear head) and ``label`` (their argmax)."""
    rng = np.random.default_rng(1)
    inputs = [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, 32, 32]),
              helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 4]),
              helper.make_tensor_value_info("mask", TensorProto.BOOL, ["N", 4])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10]),
               helper.make_tensor_value_info("embedding", TensorProto.FLOAT16, ["N", 16]),
               helper.make_tensor_value_info("label", TensorProto.INT64, ["N", 1])]
    inits = [_tensor("conv_w", _weights(rng, 8, 3, 3, 3)), _tensor("conv_b", _weights(rng, 8)),
             _tensor("table", _weights(rng, VOCAB, 8, scale=1.0)),
             _tensor("w1", _weights(rng, 16, 16)), _tensor("b1", _weights(rng, 16)),
             _tensor("w2", _weights(rng, 16, 10)), _tensor("b2", _weights(rng, 10)),
             _tensor("axis1", np.array([1], np.int64)), _tensor("axis2", np.array([2], np.int64)),
             _tensor("eps", np.array(1.0, np.float32))]
    nodes = [
        helper.make_node("Conv", ["image", "conv_w", "conv_b"], ["c"], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["p"]),
        helper.make_node("Flatten", ["p"], ["img_feat"], axis=1),                  # [N, 8]
        helper.make_node("Gather", ["table", "ids"], ["emb"], axis=0),             # [N, 4, 8]
        helper.make_node("Cast", ["mask"], ["m"], to=TensorProto.FLOAT),           # [N, 4]
        helper.make_node("Unsqueeze", ["m", "axis2"], ["m3"]),                     # [N, 4, 1]
        helper.make_node("Mul", ["emb", "m3"], ["kept"]),
        helper.make_node("ReduceSum", ["kept", "axis1"], ["tok_sum"], keepdims=0),  # [N, 8]
        helper.make_node("ReduceSum", ["m", "axis1"], ["count"], keepdims=1),       # [N, 1]
        helper.make_node("Max", ["count", "eps"], ["count1"]),                     # no division by 0
        helper.make_node("Div", ["tok_sum", "count1"], ["tok_feat"]),
        helper.make_node("Concat", ["img_feat", "tok_feat"], ["feat"], axis=1),    # [N, 16]
        helper.make_node("Gemm", ["feat", "w1", "b1"], ["h"]),
        helper.make_node("Tanh", ["h"], ["emb32"]),
        helper.make_node("Cast", ["emb32"], ["embedding"], to=TensorProto.FLOAT16),
        helper.make_node("Gemm", ["emb32", "w2", "b2"], ["logits"]),
        helper.make_node("ArgMax", ["logits"], ["label"], axis=1, keepdims=1),
    ]
    _save_onnx(helper.make_graph(nodes, "mixed", inputs, outputs, inits), path)


def ocr_onnx(path: Path) -> None:
    """``ocr``: a conv over the full height of a text line, then a linear map per column: ``logits`` has
    one row of :data:`OCR_CLASSES` per column of the image, however wide it is."""
    rng = np.random.default_rng(2)
    inputs = [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 1, 32, "W"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", "W", OCR_CLASSES])]
    inits = [_tensor("conv_w", _weights(rng, 16, 1, 32, 3, scale=0.1)), _tensor("conv_b", _weights(rng, 16)),
             _tensor("w", _weights(rng, 16, OCR_CLASSES)), _tensor("b", _weights(rng, OCR_CLASSES)),
             _tensor("axis2", np.array([2], np.int64))]
    nodes = [
        helper.make_node("Conv", ["image", "conv_w", "conv_b"], ["c"], pads=[0, 1, 0, 1]),  # [N, 16, 1, W]
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Squeeze", ["r", "axis2"], ["s"]),                                # [N, 16, W]
        helper.make_node("Transpose", ["s"], ["t"], perm=[0, 2, 1]),                       # [N, W, 16]
        helper.make_node("MatMul", ["t", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["logits"]),
    ]
    _save_onnx(helper.make_graph(nodes, "ocr", inputs, outputs, inits), path)


def noconfig_onnx(path: Path) -> None:
    """``noconfig``: ``y`` = a linear map of ``x``, ``top`` = its largest element; every tensor's first
    axis is dynamic, so completion batches it (max_batch_size 4, as Triton's auto-complete)."""
    rng = np.random.default_rng(3)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3]),
               helper.make_tensor_value_info("top", TensorProto.FLOAT, ["N", 1])]
    inits = [_tensor("w", _weights(rng, 6, 3)), _tensor("b", _weights(rng, 3))]
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["y"]),
             helper.make_node("ReduceMax", ["y"], ["top"], axes=[1], keepdims=1)]
    _save_onnx(helper.make_graph(nodes, "noconfig", inputs, outputs, inits), path)


def detector_onnx(path: Path) -> None:
    """``detector``: one candidate box per :data:`DET_CELL` x :data:`DET_CELL` cell (its centre moved and
    sized by a conv head), an objectness score and a class per cell; the candidates scoring above 0.5
    are kept by NonMaxSuppression (IoU 0.3, at most 16), highest score first. How many come out depends
    on the image (none for some)."""
    rng = np.random.default_rng(4)
    grid = DET_SIDE // DET_CELL
    cells = grid * grid
    # Candidate centres, one per cell: (y, x) of the cell's middle, in pixels.
    ys, xs = np.meshgrid(np.arange(grid), np.arange(grid), indexing="ij")
    centres = (np.stack([ys, xs], -1).reshape(cells, 2) * DET_CELL + DET_CELL / 2).astype(np.float32)
    head_w = _weights(rng, 1 + 4 + DET_CLASSES, 3, DET_CELL, DET_CELL, scale=0.1)
    head_b = np.zeros(1 + 4 + DET_CLASSES, np.float32)
    head_b[0] = -1.0  # objectness below even: a bright, busy image keeps boxes, a blank one keeps none
    inputs = [helper.make_tensor_value_info("image", TensorProto.FLOAT, [3, DET_SIDE, DET_SIDE])]
    outputs = [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, ["K", 4]),
               helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["K"]),
               helper.make_tensor_value_info("classes", TensorProto.INT64, ["K"])]
    inits = [_tensor("head_w", head_w), _tensor("head_b", head_b), _tensor("centres", centres),
             _tensor("axis0", np.array([0], np.int64)),
             _tensor("flat_shape", np.array([1 + 4 + DET_CLASSES, cells], np.int64)),
             _tensor("split", np.array([1, 2, 2, DET_CLASSES], np.int64)),
             _tensor("half_cell", np.array(DET_CELL / 2, np.float32)),
             _tensor("max_boxes", np.array([16], np.int64)), _tensor("iou", np.array([0.3], np.float32)),
             _tensor("min_score", np.array([0.5], np.float32)), _tensor("col2", np.array([2], np.int64)),
             _tensor("flat", np.array([-1], np.int64))]
    nodes = [
        helper.make_node("Unsqueeze", ["image", "axis0"], ["batch"]),                             # [1, 3, H, W]
        helper.make_node("Conv", ["batch", "head_w", "head_b"], ["head"], strides=[DET_CELL, DET_CELL]),
        helper.make_node("Reshape", ["head", "flat_shape"], ["flat_head"]),                       # [8, cells]
        helper.make_node("Transpose", ["flat_head"], ["per_cell"], perm=[1, 0]),                  # [cells, 8]
        helper.make_node("Split", ["per_cell", "split"], ["obj", "offset", "size", "cls"], axis=1),
        helper.make_node("Sigmoid", ["obj"], ["obj_p"]),
        helper.make_node("Reshape", ["obj_p", "flat"], ["all_scores"]),                           # [cells]
        helper.make_node("Mul", ["offset", "half_cell"], ["shift"]),
        helper.make_node("Add", ["centres", "shift"], ["centre"]),                                # (y, x)
        helper.make_node("Exp", ["size"], ["size_e"]),
        helper.make_node("Mul", ["size_e", "half_cell"], ["half_size"]),
        helper.make_node("Sub", ["centre", "half_size"], ["corner0"]),
        helper.make_node("Add", ["centre", "half_size"], ["corner1"]),
        helper.make_node("Concat", ["corner0", "corner1"], ["all_boxes"], axis=1),                # y1 x1 y2 x2
        helper.make_node("ArgMax", ["cls"], ["cls_k"], axis=1, keepdims=0),                       # [cells]
        helper.make_node("Unsqueeze", ["all_boxes", "axis0"], ["nms_boxes"]),                     # [1, cells, 4]
        helper.make_node("Reshape", ["all_scores", "flat"], ["s1"]),
        helper.make_node("Unsqueeze", ["s1", "axis0"], ["s2"]),
        helper.make_node("Unsqueeze", ["s2", "axis0"], ["nms_scores"]),                           # [1, 1, cells]
        helper.make_node("NonMaxSuppression", ["nms_boxes", "nms_scores", "max_boxes", "iou", "min_score"],
                         ["selected"]),                                                           # [K, 3]
        helper.make_node("Gather", ["selected", "col2"], ["sel_col"], axis=1),                    # [K, 1]
        helper.make_node("Reshape", ["sel_col", "flat"], ["keep"]),                               # [K]
        helper.make_node("Gather", ["all_boxes", "keep"], ["boxes"], axis=0),
        helper.make_node("Gather", ["all_scores", "keep"], ["scores"], axis=0),
        helper.make_node("Gather", ["cls_k", "keep"], ["classes"], axis=0),
    ]
    _save_onnx(helper.make_graph(nodes, "detector", inputs, outputs, inits), path)


class ScriptedMLP(torch.nn.Module):
    """``scripted``: a two-layer MLP; OUTPUT__0 its class probabilities, OUTPUT__1 the most likely class."""

    def __init__(self) -> None:
        super().__init__()
        # Plain parameters, not nn.Linear: TorchScript writes a submodule's __constants__ (a set) in the
        # order of the string hash, which changes with PYTHONHASHSEED, so the file's bytes would too.
        self.w1 = torch.nn.Parameter(torch.randn(16, 32) * 0.25)
        self.b1 = torch.nn.Parameter(torch.randn(32) * 0.1)
        self.w2 = torch.nn.Parameter(torch.randn(32, 4) * 0.25)
        self.b2 = torch.nn.Parameter(torch.randn(4) * 0.1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.relu(torch.matmul(x, self.w1) + self.b1)
        probs = torch.softmax(torch.matmul(hidden, self.w2) + self.b2, dim=1)
        return probs, torch.argmax(probs, dim=1, keepdim=True)


class Exported(torch.nn.Module):
    """``exported``: ``scores`` = a linear map of ``features`` times ``scale``; ``norm`` = their L2 norm."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(12, 4)

    def forward(self, features: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.linear(features) * scale
        return scores, torch.sqrt((scores * scores).sum(dim=1, keepdim=True))


def scripted_pt(path: Path) -> None:
    """``scripted``: :class:`ScriptedMLP` with seed 5, saved by ``torch.jit.script`` + ``torch.jit.save``."""
    torch.manual_seed(5)
    path.parent.mkdir(parents=True, exist_ok=True)
    # TorchScript is deprecated in torch, and is still what Triton's pytorch_libtorch backend serves: the
    # example shows that format on purpose, so its warnings say nothing to the user here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(ScriptedMLP().eval()), str(path))


def exported_pt2(path: Path) -> None:
    """``exported``: :class:`Exported` with seed 6, exported with a dynamic batch of 1..8 and saved by
    ``torch.export.save``."""
    torch.manual_seed(6)
    module = Exported().eval()
    batch = torch.export.Dim("batch", min=1, max=8)
    example = (torch.zeros(2, 12), torch.ones(2, 4))
    program = torch.export.export(module, example, dynamic_shapes={"features": {0: batch}, "scale": {0: batch}})
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, str(path))


BUILDERS: dict[str, Callable[[Path], None]] = {
    "mixed": mixed_onnx, "ocr": ocr_onnx, "scripted": scripted_pt, "exported": exported_pt2,
    "noconfig": noconfig_onnx, "detector": detector_onnx,
}


def build(out: Path = DEFAULT_OUT) -> Path:
    """Write the example repository to ``out`` (replacing what is there) and return it; every model has
    its file under ``<model>/1/`` and, but for ``noconfig``, its ``config.pbtxt``."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    for name, make in BUILDERS.items():
        make(out / MODELS[name])
        if name in CONFIGS:
            (out / name / "config.pbtxt").write_text(CONFIGS[name])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default=str(DEFAULT_OUT), help="the repository directory (replaced)")
    args = ap.parse_args(argv)
    out = build(Path(args.out))
    for name, rel in MODELS.items():
        print(f"{name:<10} {out / rel}" + ("" if name in CONFIGS else "   (no config.pbtxt)"))
    print(f"serve it with: gpuprims-orchestrator start --model-repository {out}")
    return 0


if __name__ == "__main__":
    # The torch files record their modules' qualified names (``__torch__.model_repository.ScriptedMLP``): run
    # as a script, build from the module imported by its name, so every way of building writes the same bytes.
    import model_repository

    sys.exit(model_repository.main())
