"""Inferences of model files through the front door: any number of named inputs and outputs.

A model file's app (its :class:`ModelInfo` has a ``signature``) takes the OIP request's inputs by name,
each of its own datatype and shape. For a batched model (``max_batch_size`` > 0) each input carries a
leading batch dimension of the same size N, and the inference becomes N requests of the per-row tensors
(so they batch with every other client's requests in the instance); a model without batching takes the
inputs as they are, as one request. Each request travels to the instance as one multi-tensor body
(``gpuprims.tensorwire``); its answer is the model's outputs, stacked back along the batch dimension.
The request's ``outputs`` pick which outputs are returned (all by default).

Everything a request gets wrong is refused here, before anything reaches the node, with
:class:`OipError` ``invalid`` naming the tensor and what the model wants.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gpuprims.tensors import DataType, ModelSignature, SignatureError
from orchestrator.frontdoor.core import OipError
from orchestrator.frontdoor.models import ModelInfo

#: The typed ``contents`` field of each datatype in a gRPC request (None: raw contents only).
CONTENTS_FIELD: dict[DataType, str | None] = {
    DataType.BOOL: "bool_contents", DataType.UINT8: "uint_contents", DataType.UINT16: "uint_contents",
    DataType.UINT32: "uint_contents", DataType.UINT64: "uint64_contents", DataType.INT8: "int_contents",
    DataType.INT16: "int_contents", DataType.INT32: "int_contents", DataType.INT64: "int64_contents",
    DataType.FP16: None, DataType.BF16: None, DataType.FP32: "fp32_contents", DataType.FP64: "fp64_contents",
}


def _signature(info: ModelInfo) -> ModelSignature:
    assert info.signature is not None
    return info.signature


def _shape(value: Any, name: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                       for d in value):
        raise OipError("invalid", f"input {name!r}: 'shape' must be a list of non-negative integers, got {value!r}")
    return list(value)


def check_head(info: ModelInfo, name: str, datatype: str, shape: list[int]) -> DataType:
    """Refuse an input that is not this model's (its name, datatype, shape and batch) before its data is
    read; returns its datatype."""
    sig = _signature(info)
    try:
        spec = sig.input(name)
    except SignatureError as e:
        raise OipError("invalid", f"model {info.name!r}: {e}") from None
    if datatype != spec.datatype.value:
        raise OipError("invalid", f"model {info.name!r}: input {name!r} is {spec.datatype.value}, got {datatype}")
    per = shape[1:] if sig.batched else shape
    if sig.batched and not shape:
        raise OipError("invalid", f"model {info.name!r}: input {name!r} needs a leading batch dimension, "
                                  f"shape [-1,{','.join(map(str, spec.dims))}]")
    if not spec.accepts(tuple(per)):
        want = ([-1] if sig.batched else []) + list(spec.dims)
        raise OipError("invalid", f"model {info.name!r}: input {name!r} has shape {shape}, the model wants "
                                  f"{want} (-1: any size)")
    if sig.batched and not 1 <= shape[0] <= info.rows_max:
        raise OipError("invalid", f"model {info.name!r}: batch of {shape[0]} in input {name!r}; the model takes "
                                  f"1..{info.rows_max} per inference (max_batch_size)")
    return spec.datatype


def check_inputs(info: ModelInfo, inputs: Mapping[str, np.ndarray]) -> int:
    """Check the whole set of inputs (every required one present, one batch size); returns the number
    of requests the inference becomes (N for a batched model, else 1)."""
    sig = _signature(info)
    missing = [s.describe() for s in sig.inputs if not s.optional and s.name not in inputs]
    if missing:
        raise OipError("invalid", f"model {info.name!r}: missing input(s) {', '.join(missing)}")
    if not sig.batched:
        return 1
    sizes = {name: int(a.shape[0]) for name, a in inputs.items()}
    if len(set(sizes.values())) > 1:
        raise OipError("invalid", f"model {info.name!r}: inputs have different batch sizes {sizes}")
    return next(iter(sizes.values()))


def requested_outputs(info: ModelInfo, names: Sequence[str]) -> list[str]:
    """The outputs an inference returns: those named (each must be the model's), else all of them."""
    sig = _signature(info)
    if not names:
        return [s.name for s in sig.outputs]
    for n in names:
        try:
            sig.output(n)
        except SignatureError as e:
            raise OipError("invalid", f"model {info.name!r}: {e}") from None
    return list(dict.fromkeys(names))


def _from_bytes(info: ModelInfo, name: str, dt: DataType, shape: list[int], raw: bytes | memoryview) -> np.ndarray:
    want = math.prod(shape) * dt.itemsize
    if len(raw) != want:
        raise OipError("invalid", f"model {info.name!r}: input {name!r} {dt.value} {shape} needs {want} bytes, "
                                  f"got {len(raw)}")
    if dt is DataType.BOOL:  # any nonzero byte is true, as Triton takes it (perf_analyzer sends random bytes)
        return (np.frombuffer(raw, dtype=np.uint8) != 0).reshape(shape)
    return np.frombuffer(raw, dtype=dt.numpy).reshape(shape)


def _from_values(info: ModelInfo, name: str, dt: DataType, shape: list[int], values: Any) -> np.ndarray:
    if dt is DataType.BF16:
        raise OipError("invalid", f"model {info.name!r}: input {name!r} is BF16, which travels as binary data only")
    try:
        arr = np.asarray(values, dtype=dt.numpy)
    except (ValueError, TypeError, OverflowError) as e:
        raise OipError("invalid", f"model {info.name!r}: input {name!r} data is not {dt.value}: {e}") from None
    if arr.size != math.prod(shape):
        raise OipError("invalid", f"model {info.name!r}: input {name!r} has {arr.size} elements, shape {shape} "
                                  f"needs {math.prod(shape)}")
    return arr.reshape(shape)


def http_inputs(info: ModelInfo, req: Mapping[str, Any], binary: memoryview) -> dict[str, np.ndarray]:
    """The inputs of an HTTP/REST inference (JSON ``data``, or binary data after the JSON header in
    the order of the inputs that declare ``binary_data_size``)."""
    inputs = req.get("inputs")
    if not isinstance(inputs, list) or not inputs or not all(isinstance(t, dict) for t in inputs):
        raise OipError("invalid", "'inputs' must be a non-empty list of objects")
    out: dict[str, np.ndarray] = {}
    offset = 0
    for t in inputs:
        name = str(t.get("name"))
        shape = _shape(t.get("shape"), name)
        dt = check_head(info, name, str(t.get("datatype")), shape)
        if name in out:
            raise OipError("invalid", f"model {info.name!r}: input {name!r} is given twice")
        params = t.get("parameters") or {}
        if not isinstance(params, dict):
            raise OipError("invalid", f"input {name!r}: 'parameters' must be an object")
        if "binary_data_size" in params:
            size = params["binary_data_size"]
            if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(binary):
                raise OipError("invalid", f"input {name!r}: binary_data_size {size!r} does not fit the "
                                          f"{len(binary) - offset} bytes of binary data left")
            out[name] = _from_bytes(info, name, dt, shape, binary[offset:offset + size])
            offset += size
        elif "data" in t:
            out[name] = _from_values(info, name, dt, shape, t["data"])
        else:
            raise OipError("invalid", f"input {name!r} has neither 'data' nor binary_data_size")
    if offset != len(binary):
        raise OipError("invalid", f"{len(binary) - offset} bytes of binary data are not claimed by any input's "
                                  "binary_data_size")
    check_inputs(info, out)
    return out


def http_outputs(req: Mapping[str, Any]) -> tuple[list[str], set[str]]:
    """The outputs an HTTP/REST request names, and those of them it wants as binary data (all of them
    with the request's ``binary_data_output`` parameter)."""
    outputs = req.get("outputs")
    if outputs is None:
        outputs = []
    if not isinstance(outputs, list) or not all(isinstance(o, dict) for o in outputs):
        raise OipError("invalid", "'outputs' must be a list of objects")
    names = [str(o.get("name")) for o in outputs]
    binary = {str(o.get("name")) for o in outputs if (o.get("parameters") or {}).get("binary_data")}
    return names, binary


def grpc_inputs(info: ModelInfo, req: Any) -> dict[str, np.ndarray]:
    """The inputs of a gRPC ModelInferRequest (``raw_input_contents`` in the inputs' order, or each
    input's typed ``contents``)."""
    if req.raw_input_contents and len(req.raw_input_contents) != len(req.inputs):
        raise OipError("invalid", f"{len(req.raw_input_contents)} raw_input_contents for {len(req.inputs)} inputs")
    out: dict[str, np.ndarray] = {}
    for i, t in enumerate(req.inputs):
        shape = _shape(list(t.shape), t.name)
        dt = check_head(info, t.name, t.datatype, shape)
        if t.name in out:
            raise OipError("invalid", f"model {info.name!r}: input {t.name!r} is given twice")
        if req.raw_input_contents:
            out[t.name] = _from_bytes(info, t.name, dt, shape, req.raw_input_contents[i])
        else:
            field = CONTENTS_FIELD.get(dt)
            if field is None:
                raise OipError("invalid", f"model {info.name!r}: input {t.name!r} is {dt.value}, which travels "
                                          "in raw_input_contents only")
            out[t.name] = _from_values(info, t.name, dt, shape, list(getattr(t.contents, field)))
    check_inputs(info, out)
    return out


def rows_of(info: ModelInfo, inputs: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """The requests an inference becomes: row i of every input for a batched model, else the inputs."""
    if not _signature(info).batched:
        return [dict(inputs)]
    n = check_inputs(info, inputs)
    return [{name: a[i] for name, a in inputs.items()} for i in range(n)]


def gather_outputs(info: ModelInfo, answers: list[dict[str, np.ndarray]], wanted: Sequence[str]) -> dict[str, np.ndarray]:
    """The inference's outputs from its requests' answers: stacked along the batch dimension for a
    batched model (rows whose outputs differ in shape cannot be; OipError says to send them apart)."""
    sig = _signature(info)
    out: dict[str, np.ndarray] = {}
    for name in wanted:
        parts = []
        for a in answers:
            if name not in a:
                raise OipError("internal", f"model {info.name!r}: the answer lacks output {name!r}")
            parts.append(a[name])
        if not sig.batched:
            out[name] = parts[0]
            continue
        shapes = {p.shape for p in parts}
        if len(shapes) > 1:
            raise OipError("invalid", f"model {info.name!r}: output {name!r} differs in shape between the rows "
                                      f"of this inference ({sorted(shapes)}); send them as separate inferences")
        out[name] = np.stack(parts)
    return out


def datatype_of(info: ModelInfo, name: str) -> DataType:
    return _signature(info).output(name).datatype


def json_data(arr: np.ndarray, dt: DataType) -> list[Any]:
    """An output's values as JSON (BF16 as the float32 it stands for)."""
    if dt is DataType.BF16:
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.reshape(-1).tolist()
