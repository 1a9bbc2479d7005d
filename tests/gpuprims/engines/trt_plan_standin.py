"""A recording stand-in for the runtime half of the ``tensorrt`` package (TensorRT 10/11 named-tensor API:
``Runtime.deserialize_cuda_engine``, ``ICudaEngine.num_io_tensors`` / ``get_tensor_name`` / ``get_tensor_mode``
/ ``get_tensor_dtype`` / ``get_tensor_shape``, ``IExecutionContext.set_input_shape`` / ``get_tensor_shape``
/ ``set_tensor_address`` / ``set_output_allocator`` / ``execute_async_v3``, ``IOutputAllocator``), for tests
of ``gpuprims.engines.file_tensorrt`` on a machine without TensorRT. Installed in ``sys.modules`` by a
test, it records every call and holds callers to the API's shape as TensorRT's documentation gives it.

A "plan" here is :func:`make_plan`'s bytes: a header naming each I/O tensor (datatype, shape with -1 for
dynamic, the profile's min/max for inputs, and for each output dimension the input dimension it follows,
or ``"dds"`` for a data-dependent size) and the ONNX model it runs. Its execution runs that model with ONNX
Runtime as a host launch on the fake CUDA stream given to ``execute_async_v3``, reading the inputs from
and writing the outputs to the bound addresses (fake device memory); a data-dependent output is written
where the caller's ``IOutputAllocator`` says, after ``reallocate_output_async`` and ``notify_shape``, as
TensorRT 10 does while a plan runs.
"""

from __future__ import annotations

import ctypes
import enum
import json
import math
import types
from typing import Any

import numpy as np

from .trt_standin import ILogger, Severity  # the same logger API as the builder's stand-in

MAGIC = b"FAKEPLAN"


class IOutputAllocator:
    def __init__(self) -> None:
        pass


class TensorIOMode(enum.IntEnum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class DataType(enum.IntEnum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    BF16 = 7
    INT64 = 8


NUMPY = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT8: np.int8, DataType.INT32: np.int32,
         DataType.BOOL: np.bool_, DataType.UINT8: np.uint8, DataType.BF16: np.uint16, DataType.INT64: np.int64}


def make_plan(onnx_bytes: bytes, inputs: list[dict[str, Any]], outputs: list[dict[str, Any]],
              profiles: int = 1) -> bytes:
    """A stand-in plan. ``inputs``: ``{"name", "dtype" (DataType name), "shape" (-1 dynamic), "min", "max"}``;
    ``outputs``: ``{"name", "dtype", "shape", "follows"}`` where ``follows[i]`` is ``[input, axis]`` for a
    dimension that follows an input's, or ``"dds"`` for a data-dependent one (None: fixed)."""
    head = json.dumps({"inputs": inputs, "outputs": outputs, "profiles": profiles}).encode()
    return MAGIC + len(head).to_bytes(4, "little") + head + onnx_bytes


def make(version: str = "10.9.0", *, fail_execute: bool = False) -> types.ModuleType:
    """A fresh stand-in module; ``mod.calls`` lists (name, args) of every call made on it."""
    mod = types.ModuleType("tensorrt")
    calls: list[tuple[str, tuple[Any, ...]]] = []
    mod.calls = calls  # type: ignore[attr-defined]
    mod.__version__ = version  # type: ignore[attr-defined]

    def rec(name: str, *args: Any) -> None:
        calls.append((name, args))

    class IExecutionContext:
        def __init__(self, engine: ICudaEngine) -> None:
            self.engine = engine
            self.shapes: dict[str, tuple[int, ...]] = {}
            self.addresses: dict[str, int] = {}
            self.allocators: dict[str, Any] = {}

        def set_input_shape(self, name: str, shape: Any) -> bool:
            rec("IExecutionContext.set_input_shape", name, tuple(shape))
            spec = self.engine.inputs.get(name)
            shape = tuple(int(d) for d in shape)
            if spec is None or len(shape) != len(spec["shape"]):
                return False
            if not all(lo <= d <= hi for lo, d, hi in zip(spec["min"], shape, spec["max"], strict=True)):
                return False
            self.shapes[name] = shape
            return True

        def get_tensor_shape(self, name: str) -> tuple[int, ...]:
            if name in self.engine.inputs:
                return self.shapes.get(name, tuple(self.engine.inputs[name]["shape"]))
            spec = self.engine.outputs[name]
            dims = []
            for d, f in zip(spec["shape"], spec["follows"], strict=True):
                if f == "dds":
                    dims.append(-1)  # TensorRT 10: stays -1 for a data-dependent size, even after the run
                elif f is not None:
                    src, axis = f
                    dims.append(self.shapes[src][axis] if src in self.shapes else -1)
                else:
                    dims.append(d)
            return tuple(dims)

        def set_tensor_address(self, name: str, ptr: int) -> bool:
            rec("IExecutionContext.set_tensor_address", name, ptr)
            assert isinstance(ptr, int) and ptr > 0, "a tensor address is a non-zero int"
            assert ptr % 256 == 0, "TensorRT wants 256-byte aligned tensor addresses"
            if name not in self.engine.inputs and name not in self.engine.outputs:
                return False
            self.addresses[name] = ptr
            return True

        def set_optimization_profile_async(self, index: int, stream_handle: int) -> bool:
            rec("IExecutionContext.set_optimization_profile_async", index, stream_handle)
            assert isinstance(stream_handle, int)
            return 0 <= index < self.engine.num_optimization_profiles

        def set_output_allocator(self, name: str, allocator: Any) -> bool:
            rec("IExecutionContext.set_output_allocator", name, allocator)
            assert isinstance(allocator, IOutputAllocator), "an output allocator must subclass IOutputAllocator"
            if name not in self.engine.outputs:
                return False
            self.allocators[name] = allocator
            return True

        def execute_async_v3(self, stream_handle: int) -> bool:
            rec("IExecutionContext.execute_async_v3", stream_handle)
            assert isinstance(stream_handle, int), "execute_async_v3 takes the raw cudaStream_t as an int"
            if fail_execute:
                return False
            from gpuprims.cuda import runtime

            eng = self.engine
            assert set(self.shapes) == set(eng.inputs), "every input shape must be set before execute_async_v3"
            for name in eng.outputs:
                assert name in self.addresses or name in self.allocators, f"output {name!r} is not bound"
            shapes = dict(self.shapes)
            addresses = dict(self.addresses)
            allocators = dict(self.allocators)
            static = {n: self.get_tensor_shape(n) for n in eng.outputs}

            def compute() -> list[tuple[str, np.ndarray]]:  # "the kernels": read the input bindings
                feed = {}
                for name, spec in eng.inputs.items():
                    dt = np.dtype(NUMPY[DataType[spec["dtype"]]])
                    n = math.prod(shapes[name]) * dt.itemsize
                    raw = (ctypes.c_uint8 * max(n, 1)).from_address(addresses[name])
                    feed[name] = np.frombuffer(raw, np.uint8, n).view(dt).reshape(shapes[name]).copy()
                got = eng.session.run(list(eng.outputs), feed)
                return [(name, np.ascontiguousarray(y, NUMPY[DataType[spec["dtype"]]]))
                        for (name, spec), y in zip(eng.outputs.items(), got, strict=True)]

            def write(results: list[tuple[str, np.ndarray]], where: dict[str, int]) -> None:
                for name, y in results:
                    if name not in where:
                        assert tuple(y.shape) == static[name], (name, y.shape, static[name])
                    if y.nbytes:
                        ctypes.memmove(where.get(name, addresses.get(name, 0)), y.ctypes.data, y.nbytes)

            if not any(any(d < 0 for d in shape) for shape in static.values()):
                runtime.cuda().launch_host_func(stream_handle, lambda: write(compute(), {}))
                return True
            # Data-dependent sizes: TensorRT learns them mid-run and asks the allocator on the calling
            # thread (no CUDA call may run inside a stream callback); the stand-in waits for the inputs.
            runtime.cuda().cuda_stream_synchronize(stream_handle)
            results = compute()
            where: dict[str, int] = {}
            for name, y in results:
                if any(d < 0 for d in static[name]):
                    alloc = allocators[name]
                    ptr = alloc.reallocate_output_async(name, 0, y.nbytes, 256, stream_handle)
                    assert isinstance(ptr, int) and ptr > 0 and ptr % 256 == 0
                    alloc.notify_shape(name, tuple(y.shape))
                    where[name] = ptr
            runtime.cuda().launch_host_func(stream_handle, lambda: write(results, where))
            return True

    class ICudaEngine:
        def __init__(self, head: dict[str, Any], onnx_bytes: bytes) -> None:
            import onnxruntime as ort

            self.head = head
            self.inputs = {i["name"]: i for i in head["inputs"]}
            self.outputs = {o["name"]: o for o in head["outputs"]}
            self.session = ort.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])
            self.names = [*self.inputs, *self.outputs]

        @property
        def num_optimization_profiles(self) -> int:
            return int(self.head.get("profiles", 1))

        @property
        def num_io_tensors(self) -> int:
            return len(self.names)

        def get_tensor_name(self, i: int) -> str:
            return self.names[i]

        def get_tensor_mode(self, name: str) -> TensorIOMode:
            return TensorIOMode.INPUT if name in self.inputs else TensorIOMode.OUTPUT

        def get_tensor_dtype(self, name: str) -> DataType:
            spec = self.inputs.get(name) or self.outputs[name]
            return DataType[spec["dtype"]]

        def get_tensor_shape(self, name: str) -> tuple[int, ...]:
            spec = self.inputs.get(name) or self.outputs[name]
            return tuple(spec["shape"])

        def create_execution_context(self) -> IExecutionContext:
            rec("ICudaEngine.create_execution_context")
            return IExecutionContext(self)

    class Runtime:
        def __init__(self, logger: Any) -> None:
            rec("Runtime", logger)
            assert isinstance(logger, ILogger), "a TensorRT logger must subclass tensorrt.ILogger"
            self.logger = logger

        def deserialize_cuda_engine(self, plan: bytes) -> ICudaEngine | None:
            rec("Runtime.deserialize_cuda_engine", len(plan))
            assert isinstance(plan, bytes | bytearray | memoryview), "deserialize_cuda_engine takes the plan's bytes"
            if bytes(plan[:8]) != MAGIC:
                self.logger.log(Severity.ERROR, "stand-in: the plan's magic tag is wrong (not a plan)")
                return None
            n = int.from_bytes(plan[8:12], "little")
            head = json.loads(plan[12:12 + n])
            return ICudaEngine(head, bytes(plan[12 + n:]))

    for name, value in {"ILogger": ILogger, "Logger": ILogger, "IOutputAllocator": IOutputAllocator,
                        "TensorIOMode": TensorIOMode, "DataType": DataType, "Runtime": Runtime}.items():
        setattr(mod, name, value)
    return mod


def names(mod: types.ModuleType) -> list[str]:
    """The names of the calls recorded, in order."""
    return [c[0] for c in mod.calls]  # type: ignore[attr-defined]


def args_of(mod: types.ModuleType, name: str) -> list[tuple[Any, ...]]:
    """The arguments of every recorded call of ``name``."""
    return [c[1] for c in mod.calls if c[0] == name]  # type: ignore[attr-defined]
