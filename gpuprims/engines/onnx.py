"""ONNX export of an app's model: what the ``onnxruntime`` engine runs and the ``tensorrt`` engine parses.

:func:`export_onnx` writes one self-contained ``.onnx`` file (weights inside, no external data) whose input
is ``input`` of shape ``(batch, C, H, W)`` float32 and whose output is ``output`` of shape ``(batch, ...)``,
with the batch axis dynamic, so one file serves every batch size from 1 to max_batch.

The exporter is torch's TorchScript-based one (``torch.onnx.export(..., dynamo=False)``), chosen over the
``torch.export``-based one (``dynamo=True``, which also needs ``onnxscript``) because it is an order of
magnitude faster to build and its output is as close to eager. Measured on this (busy, 2-core) machine
with torch 2.13, onnx 1.23.2, ONNX Runtime 1.31.1, batch 2: MobileNetV2 3x64x64 4.1 s against 72 s,
ResNet-18 3x64x64 3.3 s against 31 s, Siamese (LSTMs) 1.1 s against 81 s, the largest difference from
eager the same for both (3.5e-6 against 3.7e-6, 2.4e-6 against 2.0e-6, 1.2e-7 for both, relative to the
largest output). A first start's build is on a node's critical path, so the fast one wins; the dynamo
exporter is not needed, so neither is ``onnxscript``. Only ``onnx`` is, besides torch (the TorchScript
exporter of torch 2.13 refuses to run without it): ``pip install 'gpuprims[onnx]'``.

A model that does not export raises :class:`ExportError` with one line naming the model and the reason.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from gpuprims.engines.base import EngineUnavailable, ExportError, ModelSource

log = logging.getLogger("gpuprims.engines")

INPUT_NAME = "input"
OUTPUT_NAME = "output"
#: The ONNX opset written: new enough for every zoo operator, old enough for ONNX Runtime >= 1.14 and
#: TensorRT >= 8.6 to parse.
OPSET = 17
#: Past this size a single-file model would break protobuf's 2 GiB limit.
MAX_ONNX_BYTES = 2 * 2**30 - 2**20


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def export_onnx(module: Any, source: ModelSource, path: str | os.PathLike[str], *,
                opset: int = OPSET) -> dict[str, Any]:
    """Export ``module`` (or, when None, the model ``source`` names, built on the CPU) to ``path``.

    Returns what the file is: ``{"exporter", "opset", "input", "output", "input_shape", "output_shape"
    (per sample), "bytes", "export_ms", "torch", "onnx"}``. Raises :class:`ExportError` (one line naming
    the model and the reason) when the model does not export, returns something other than one tensor,
    or exports to a file without a dynamic batch axis; :class:`EngineUnavailable` when ``onnx`` is not
    installed.
    """
    try:
        import onnx
    except ImportError as e:
        raise EngineUnavailable("ONNX export needs the onnx package: pip install 'gpuprims[onnx]'") from e

    path = Path(path)
    name = source.model
    t0 = time.perf_counter()
    if module is None:
        try:
            module = source.build_module("cpu")
        except Exception as e:
            raise ExportError(f"model {name!r} cannot be built for ONNX export: {_first_line(e)}") from e
    module = module.eval()
    params = list(module.parameters())
    device = params[0].device if params else torch.device("cpu")
    # batch 2, not 1: an example of size 1 invites exporters to take the batch axis for a constant.
    example = torch.randn(2, *source.input_shape, generator=torch.Generator().manual_seed(0)).to(device)
    try:
        with torch.inference_mode():
            out = module(example)
    except Exception as e:
        raise ExportError(f"model {name!r} does not run on an input of shape {tuple(example.shape)}: "
                          f"{_first_line(e)}") from e
    if not isinstance(out, torch.Tensor):
        raise ExportError(f"model {name!r} returns {type(out).__name__}, not one tensor: an engine needs a "
                          "single output")
    if out.dim() < 1 or out.shape[0] != example.shape[0]:
        raise ExportError(f"model {name!r} returns shape {tuple(out.shape)} for a batch of "
                          f"{example.shape[0]}: the first axis must be the batch")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
            warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer chatter
            torch.onnx.export(module, (example,), str(path), dynamo=False, opset_version=opset,
                              input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                              dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
                              do_constant_folding=True)
    except Exception as e:
        with contextlib.suppress(OSError):
            path.unlink()
        raise ExportError(f"model {name!r} does not export to ONNX: {_first_line(e)}") from e
    try:
        model = onnx.load(str(path), load_external_data=False)
        onnx.checker.check_model(model)
        signature = _signature(model)
    except ExportError:
        raise
    except Exception as e:
        raise ExportError(f"model {name!r} exported an invalid ONNX file: {_first_line(e)}") from e
    ins, outs = signature
    if [n for n, _ in ins] != [INPUT_NAME] or [n for n, _ in outs] != [OUTPUT_NAME]:
        raise ExportError(f"model {name!r} exported inputs {[n for n, _ in ins]} and outputs "
                          f"{[n for n, _ in outs]}; an engine needs one input and one output")
    if isinstance(ins[0][1][0], int) or isinstance(outs[0][1][0], int):
        raise ExportError(f"model {name!r} exported with a fixed batch axis (input {ins[0][1]}, output "
                          f"{outs[0][1]}): its graph does not keep the batch dimension symbolic")
    size = path.stat().st_size
    if size > MAX_ONNX_BYTES:
        raise ExportError(f"model {name!r} is {size / 2**30:.1f} GiB as ONNX, past protobuf's 2 GiB limit")
    meta = {"exporter": "torchscript", "opset": opset, "input": INPUT_NAME, "output": OUTPUT_NAME,
            "input_shape": list(source.input_shape), "output_shape": list(out.shape[1:]), "bytes": size,
            "export_ms": round((time.perf_counter() - t0) * 1e3, 1), "torch": torch.__version__,
            "onnx": onnx.__version__}
    log.info("exported %s to ONNX (%d bytes, %.0f ms)", name, size, meta["export_ms"])
    return meta


def _signature(model: Any) -> tuple[list[tuple[str, list[Any]]], list[tuple[str, list[Any]]]]:
    """The graph's real inputs and outputs as (name, dims), a dim an int or a symbol's name."""
    initializers = {i.name for i in model.graph.initializer}

    def dims(value: Any) -> list[Any]:
        return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
                for d in value.type.tensor_type.shape.dim]

    ins = [(v.name, dims(v)) for v in model.graph.input if v.name not in initializers]
    outs = [(v.name, dims(v)) for v in model.graph.output]
    return ins, outs
