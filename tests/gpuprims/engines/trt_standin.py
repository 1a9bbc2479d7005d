"""A recording stand-in for the ``tensorrt`` package (TensorRT 10/11 Python API), for tests on a machine
without TensorRT: installed in ``sys.modules`` by a test, it records every call with its arguments and
holds callers to the API's shape as the TensorRT docs give it (class and method names, an optimization
profile of three shapes min <= opt <= max, precision flags, tensor addresses, an int stream handle).

Its "engine" runs the ONNX model it was built from with ONNX Runtime on the CPU, reading the input from
and writing the output to the bound addresses (fake device memory), as a host launch on the fake CUDA
stream given to ``execute_async_v3``; so a test sees the bindings and the stream really used.
"""

from __future__ import annotations

import ctypes
import enum
import json
import types
from typing import Any

import numpy as np

MAGIC = b"FAKETRT1"


class Severity(enum.IntEnum):
    INTERNAL_ERROR = 0
    ERROR = 1
    WARNING = 2
    INFO = 3
    VERBOSE = 4


class ILogger:
    Severity = Severity

    def __init__(self) -> None:
        pass

    def log(self, severity: Severity, msg: str) -> None:  # overridden by the caller's logger
        raise NotImplementedError


class IProgressMonitor:
    def __init__(self) -> None:
        pass


class NetworkDefinitionCreationFlag(enum.IntEnum):
    EXPLICIT_BATCH = 0
    STRONGLY_TYPED = 1


class MemoryPoolType(enum.IntEnum):
    WORKSPACE = 0


class TensorIOMode(enum.IntEnum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class DataType(enum.IntEnum):
    FLOAT = 0
    HALF = 1


def make(version: str = "10.9.0", *, fast_fp16: bool = True, fail_parse: bool = False,
         fail_build: bool = False) -> types.ModuleType:
    """A fresh stand-in module; ``mod.calls`` lists (name, args) of every call made on it."""
    mod = types.ModuleType("tensorrt")
    calls: list[tuple[str, tuple[Any, ...]]] = []
    mod.calls = calls  # type: ignore[attr-defined]
    mod.__version__ = version  # type: ignore[attr-defined]
    major = int(version.split(".")[0])
    flags = {"TF32": 7}
    if major < 11:  # TensorRT 11 removed the weak-typing precision flags
        flags["FP16"] = 0
    BuilderFlag = enum.IntEnum("BuilderFlag", flags)

    def rec(name: str, *args: Any) -> None:
        calls.append((name, args))

    def need_logger(logger: Any) -> None:
        assert isinstance(logger, ILogger), f"a TensorRT logger must subclass tensorrt.ILogger, got {logger!r}"

    class INetworkDefinition:
        def __init__(self, flags: int) -> None:
            self.flags = flags
            self.onnx: bytes | None = None
            self.inputs: list[str] = []
            self.outputs: list[str] = []

    class ParserError:
        def __init__(self, desc: str, node: int, name: str, op: str) -> None:
            self._d, self._n, self._name, self._op = desc, node, name, op

        def desc(self) -> str:
            return self._d

        def node(self) -> int:
            return self._n

        def node_name(self) -> str:
            return self._name

        def node_operator(self) -> str:
            return self._op

        def code(self) -> int:
            return 8  # ErrorCode.UNSUPPORTED_NODE

    class OnnxParser:
        def __init__(self, network: INetworkDefinition, logger: Any) -> None:
            rec("OnnxParser", network, logger)
            assert isinstance(network, INetworkDefinition)
            need_logger(logger)
            self.network = network
            self.errors: list[ParserError] = []

        def parse(self, model: bytes) -> bool:
            rec("OnnxParser.parse", len(model))
            assert isinstance(model, bytes | bytearray), "parse takes the serialized ONNX model"
            import onnx

            m = onnx.load_model_from_string(bytes(model))
            if fail_parse:
                node = m.graph.node[0]
                self.errors.append(ParserError("Unsupported operator in this stand-in", 0, node.name, node.op_type))
                return False
            init = {i.name for i in m.graph.initializer}
            self.network.inputs = [i.name for i in m.graph.input if i.name not in init]
            self.network.outputs = [o.name for o in m.graph.output]
            self.network.onnx = bytes(model)
            return True

        @property
        def num_errors(self) -> int:
            return len(self.errors)

        def get_error(self, i: int) -> ParserError:
            return self.errors[i]

    class IOptimizationProfile:
        def __init__(self) -> None:
            self.shapes: dict[str, tuple[tuple[int, ...], ...]] = {}

        def set_shape(self, name: str, min: Any, opt: Any, max: Any) -> None:
            rec("IOptimizationProfile.set_shape", name, tuple(min), tuple(opt), tuple(max))
            lo, mid, hi = (tuple(int(d) for d in s) for s in (min, opt, max))
            assert len(lo) == len(mid) == len(hi), "min, opt and max must have the same rank"
            assert all(a <= b <= c for a, b, c in zip(lo, mid, hi, strict=True)), "need min <= opt <= max"
            self.shapes[name] = (lo, mid, hi)

    class IBuilderConfig:
        def __init__(self) -> None:
            self.flags: set[int] = {BuilderFlag.TF32}  # TF32 is on by default in TensorRT
            self.pools: dict[int, int] = {}
            self.profiles: list[IOptimizationProfile] = []
            self._monitor: Any = None

        def set_memory_pool_limit(self, pool: MemoryPoolType, size: int) -> None:
            rec("IBuilderConfig.set_memory_pool_limit", pool, size)
            assert isinstance(pool, MemoryPoolType) and isinstance(size, int) and size > 0
            self.pools[pool] = size

        def set_flag(self, flag: Any) -> None:
            rec("IBuilderConfig.set_flag", flag)
            assert isinstance(flag, BuilderFlag)
            self.flags.add(flag)

        def clear_flag(self, flag: Any) -> None:
            rec("IBuilderConfig.clear_flag", flag)
            assert isinstance(flag, BuilderFlag)
            self.flags.discard(flag)

        def add_optimization_profile(self, profile: IOptimizationProfile) -> int:
            rec("IBuilderConfig.add_optimization_profile", profile)
            assert isinstance(profile, IOptimizationProfile) and profile.shapes, "an empty profile"
            self.profiles.append(profile)
            return len(self.profiles) - 1

        @property
        def progress_monitor(self) -> Any:
            return self._monitor

        @progress_monitor.setter
        def progress_monitor(self, monitor: Any) -> None:
            rec("IBuilderConfig.progress_monitor", monitor)
            assert isinstance(monitor, IProgressMonitor)
            self._monitor = monitor

    class Builder:
        def __init__(self, logger: Any) -> None:
            rec("Builder", logger)
            need_logger(logger)
            self.logger = logger
            self.platform_has_fast_fp16 = fast_fp16
            if major >= 11:
                del self.platform_has_fast_fp16  # removed in TensorRT 11

        def create_network(self, flags: int = 0) -> INetworkDefinition:
            rec("Builder.create_network", flags)
            assert isinstance(flags, int)
            return INetworkDefinition(flags)

        def create_builder_config(self) -> IBuilderConfig:
            rec("Builder.create_builder_config")
            return IBuilderConfig()

        def create_optimization_profile(self) -> IOptimizationProfile:
            rec("Builder.create_optimization_profile")
            return IOptimizationProfile()

        def build_serialized_network(self, network: INetworkDefinition, config: IBuilderConfig) -> bytes | None:
            rec("Builder.build_serialized_network", network, config)
            assert network.onnx is not None, "build before a successful parse"
            mon = config.progress_monitor
            if mon is not None:
                mon.phase_start("Building engine", None, 2)
                for step in range(2):
                    assert mon.step_complete("Building engine", step) is True
                mon.phase_finish("Building engine")
            if fail_build:
                self.logger.log(Severity.ERROR, "stand-in: no implementation fits the workspace")
                return None
            (name,) = network.inputs
            profile = config.profiles[0].shapes[name]
            head = json.dumps({"input": name, "output": network.outputs[0], "profile": profile,
                               "fp16": int("FP16" in BuilderFlag.__members__ and BuilderFlag.FP16 in config.flags),
                               "tf32": int(BuilderFlag.TF32 in config.flags)}).encode()
            return MAGIC + len(head).to_bytes(4, "little") + head + network.onnx

    class IExecutionContext:
        def __init__(self, engine: ICudaEngine) -> None:
            self.engine = engine
            self.shape: tuple[int, ...] | None = None
            self.addresses: dict[str, int] = {}

        def set_input_shape(self, name: str, shape: Any) -> bool:
            rec("IExecutionContext.set_input_shape", name, tuple(shape))
            lo, _, hi = self.engine.head["profile"]
            shape = tuple(int(d) for d in shape)
            if name != self.engine.head["input"] or not all(a <= d <= b for a, d, b in zip(lo, shape, hi, strict=True)):
                return False
            self.shape = shape
            return True

        def get_tensor_shape(self, name: str) -> tuple[int, ...]:
            assert self.shape is not None, "input shape not set"
            if name == self.engine.head["input"]:
                return self.shape
            dims = self.engine.session.get_outputs()[0].shape
            return tuple(self.shape[0] if not isinstance(d, int) else d for d in dims)

        def set_tensor_address(self, name: str, ptr: int) -> bool:
            rec("IExecutionContext.set_tensor_address", name, ptr)
            assert isinstance(ptr, int) and ptr > 0
            self.addresses[name] = ptr
            return name in (self.engine.head["input"], self.engine.head["output"])

        def execute_async_v3(self, stream_handle: int) -> bool:
            rec("IExecutionContext.execute_async_v3", stream_handle)
            assert isinstance(stream_handle, int), "execute_async_v3 takes the raw cudaStream_t as an int"
            from gpuprims.cuda import runtime

            head, sess = self.engine.head, self.engine.session
            assert self.shape is not None and set(self.addresses) == {head["input"], head["output"]}
            shape, src, dst = self.shape, self.addresses[head["input"]], self.addresses[head["output"]]
            out_shape = self.get_tensor_shape(head["output"])
            fp16 = bool(head["fp16"])

            def execute() -> None:  # "the kernels": read the input binding, write the output binding
                n = int(np.prod(shape))
                x = np.ctypeslib.as_array((ctypes.c_float * n).from_address(src)).reshape(shape).copy()
                if fp16:
                    x = x.astype(np.float16).astype(np.float32)
                y = sess.run(None, {head["input"]: x})[0]
                if fp16:
                    y = y.astype(np.float16).astype(np.float32)
                m = int(np.prod(out_shape))
                np.ctypeslib.as_array((ctypes.c_float * m).from_address(dst))[:] = y.reshape(-1)

            runtime.cuda().launch_host_func(stream_handle, execute)
            return True

    class ICudaEngine:
        def __init__(self, head: dict[str, Any], onnx_bytes: bytes) -> None:
            import onnxruntime as ort

            self.head = head
            self.session = ort.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])

        @property
        def num_io_tensors(self) -> int:
            return 2

        def get_tensor_name(self, i: int) -> str:
            return (self.head["input"], self.head["output"])[i]

        def get_tensor_mode(self, name: str) -> TensorIOMode:
            return TensorIOMode.INPUT if name == self.head["input"] else TensorIOMode.OUTPUT

        def get_tensor_dtype(self, name: str) -> DataType:
            return DataType.FLOAT

        def create_execution_context(self) -> IExecutionContext:
            rec("ICudaEngine.create_execution_context")
            return IExecutionContext(self)

    class Runtime:
        def __init__(self, logger: Any) -> None:
            rec("Runtime", logger)
            need_logger(logger)
            self.logger = logger

        def deserialize_cuda_engine(self, plan: bytes) -> ICudaEngine | None:
            rec("Runtime.deserialize_cuda_engine", len(plan))
            if not plan.startswith(MAGIC):
                self.logger.log(Severity.ERROR, "stand-in: the plan's magic is wrong")
                return None
            n = int.from_bytes(plan[8:12], "little")
            head = json.loads(plan[12:12 + n])
            head["profile"] = [tuple(s) for s in head["profile"]]
            return ICudaEngine(head, plan[12 + n:])

    for name, value in {"ILogger": ILogger, "Logger": ILogger, "IProgressMonitor": IProgressMonitor,
                        "NetworkDefinitionCreationFlag": NetworkDefinitionCreationFlag, "BuilderFlag": BuilderFlag,
                        "MemoryPoolType": MemoryPoolType, "TensorIOMode": TensorIOMode, "DataType": DataType,
                        "Builder": Builder, "OnnxParser": OnnxParser, "Runtime": Runtime}.items():
        setattr(mod, name, value)
    return mod


def names(mod: types.ModuleType) -> list[str]:
    """The names of the calls recorded, in order."""
    return [c[0] for c in mod.calls]  # type: ignore[attr-defined]


def args_of(mod: types.ModuleType, name: str) -> list[tuple[Any, ...]]:
    """The arguments of every recorded call of ``name``."""
    return [c[1] for c in mod.calls if c[0] == name]  # type: ignore[attr-defined]
