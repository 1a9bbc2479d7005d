"""``tensorrt`` for model files: a serialized TensorRT plan (``model.plan``, Triton's name) with named
tensors, run on the instance's stream (cuda backend only; the ``tensorrt`` package, TensorRT 10/11 API).

The plan is the artefact: it was built for one GPU and one TensorRT version, so there is nothing to
build or cache here (BuildInfo.cache_hit stays False; ``extra['cached']`` says why). A plan that does not
deserialize (another TensorRT, another GPU, not a plan) is one EngineError with TensorRT's own words.

Load (TensorRT's named-tensor API, docs "Migrating I/O Buffer Allocation to Named Tensors"):
``trt.Runtime(logger).deserialize_cuda_engine(plan)``; the I/O tensors by ``num_io_tensors`` /
``get_tensor_name(i)`` / ``get_tensor_mode`` / ``get_tensor_dtype`` / ``get_tensor_shape`` (checked against
the signature: names, datatypes, ranks); ``create_execution_context``.

Run (numpy in and out, so it completes before it returns): each input copied host -> device
(``cudaMemcpyAsync`` on the stream) into a device buffer of ours (grown when a batch needs more),
``set_input_shape`` (a shape outside the plan's optimization profile is refused by TensorRT and named
here) and ``set_tensor_address``; each output bound to a device buffer sized from
``context.get_tensor_shape`` once the input shapes are set, or, when that shape still has a ``-1`` (a
data-dependent size: NonZero, a detector's boxes), to an ``IOutputAllocator`` that TensorRT asks for
memory (``reallocate_output[_async]``) and tells the shape (``notify_shape``) while it runs;
``execute_async_v3(stream)`` on ``Target.stream`` (or a stream of the engine's own); a Sync-lite wait
(an event recorded after it, polled); each wanted output copied device -> page-locked host -> numpy. Since TensorRT 10,
``get_tensor_shape`` of a data-dependent output stays ``-1`` after the run, which is why the allocator's
``notify_shape`` is where such a shape is read.

Proven here only against a recording stand-in of the ``tensorrt`` package on the fake CUDA runtime
(tests/gpuprims/engines/test_file_tensorrt.py); the real-GPU test is marked ``gpu``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import time
from typing import Any

import numpy as np

from gpuprims.cuda import runtime
from gpuprims.cuda.errors import CudaError
from gpuprims.cuda.event import Event, Stream, stream_handle
from gpuprims.engines.base import BuildInfo, EngineError, EngineUnavailable
from gpuprims.engines.cache import EngineCache
from gpuprims.engines.files import FileEngine, first_line
from gpuprims.engines.kinds import FILE_ENGINE_KINDS
from gpuprims.tensors import DataType

log = logging.getLogger("gpuprims.engines")

#: TensorRT's DataType member names -> datatypes (TensorRT has no 16/32/64-bit unsigned integers).
TRT_TYPES: dict[str, DataType] = {
    "FLOAT": DataType.FP32, "HALF": DataType.FP16, "BF16": DataType.BF16, "INT8": DataType.INT8,
    "INT32": DataType.INT32, "INT64": DataType.INT64, "BOOL": DataType.BOOL, "UINT8": DataType.UINT8,
    "DOUBLE": DataType.FP64,
}
#: Device memory is asked for in multiples of this (TensorRT wants 256-byte aligned tensor addresses;
#: cudaMalloc gives that, and rounding sizes up keeps a growing batch from reallocating every time).
ALIGN = 256
#: Sync-lite's polling interval while a run completes (the house's wait: cudaEventQuery with the GIL
#: released between polls, not a spinning cudaStreamSynchronize).
SYNC_INTERVAL_US = 100


def _trt() -> Any:
    try:
        return importlib.import_module("tensorrt")
    except ImportError as e:
        raise EngineUnavailable("engine 'tensorrt' needs the tensorrt package (TensorRT 10 or 11): install it on "
                                "the GPU host with pip install 'gpuprims[gpu-engines]'") from e


def _round_up(nbytes: int) -> int:
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


class _DeviceBuffers:
    """Device memory per tensor name, grown (never shrunk) to the largest size asked for."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.mem: dict[str, runtime.DeviceMemory] = {}

    def get(self, name: str, nbytes: int) -> int:
        have = self.mem.get(name)
        if have is None or have.nbytes < nbytes:
            if have is not None:
                have.close()
            have = self.mem[name] = runtime.DeviceMemory(_round_up(nbytes), self.device)
        return have.ptr

    def close(self) -> None:
        for m in self.mem.values():
            m.close()
        self.mem.clear()


def _allocator(trt: Any, buffers: _DeviceBuffers) -> Any:
    """An ``IOutputAllocator`` (TensorRT's callback for outputs whose size is known only while the plan
    runs): memory from ``buffers``, the shape TensorRT notifies kept in ``.shapes``."""
    base = trt.IOutputAllocator

    class OutputAllocator(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            base.__init__(self)
            self.shapes: dict[str, tuple[int, ...]] = {}

        def reallocate_output(self, tensor_name: str, memory: int, size: int, alignment: int) -> int:
            return buffers.get(f"dds:{tensor_name}", int(size))

        def reallocate_output_async(self, tensor_name: str, memory: int, size: int, alignment: int,
                                    stream: int) -> int:
            return buffers.get(f"dds:{tensor_name}", int(size))

        def notify_shape(self, tensor_name: str, shape: Any) -> None:
            self.shapes[tensor_name] = tuple(int(d) for d in shape)

    return OutputAllocator()


def trt_logger(trt: Any) -> Any:
    """A TensorRT logger that sends warnings and errors to ours and keeps the errors for messages (both
    TensorRT engines use it: this one on a plan file, ``engine: tensorrt`` on a zoo model's export)."""
    base = trt.ILogger

    class Logger(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            base.__init__(self)
            self.errors: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            if severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                self.errors.append(str(msg))
                log.error("TensorRT: %s", msg)
            elif severity == trt.ILogger.Severity.WARNING:
                log.warning("TensorRT: %s", msg)

    return Logger()


class TensorRTFileEngine(FileEngine):
    """A serialized TensorRT plan with named tensors (see the module docstring)."""

    kind = "tensorrt"
    spec = FILE_ENGINE_KINDS["tensorrt"]
    #: The plan's own kernels, against the same plan run directly with TensorRT.
    tolerance = (1e-5, 1e-6)
    suffixes = (".plan", ".engine")

    def device_identity(self) -> dict[str, Any]:
        rt: Any = runtime.cuda()
        major, minor = rt.cuda_device_capability(self.target.device_index)
        return {"backend": "cuda", "fake": runtime.is_fake(), "name": rt.cuda_device_name(self.target.device_index),
                "cc": f"{major}.{minor}"}

    # -- load ----------------------------------------------------------------------------------------
    def _prepare(self, cache: EngineCache) -> None:
        trt = _trt()
        t0 = time.perf_counter()
        self._trt = trt
        self._own_stream: Stream | None = None
        self._logger = trt_logger(trt)
        try:
            plan = self.path.read_bytes()
        except OSError as e:
            raise EngineError(f"engine 'tensorrt': {self.path.name} cannot be read: {e.strerror or e}") from e
        self._runtime = trt.Runtime(self._logger)
        try:
            engine = self._runtime.deserialize_cuda_engine(plan)
        except Exception as e:  # some versions raise rather than return None
            engine = None
            self._logger.errors.append(first_line(e))
        if engine is None:
            why = "; ".join(self._logger.errors[-2:]) or "TensorRT gave no reason"
            raise EngineError(f"engine 'tensorrt': {self.path.name} does not deserialize ({why}): a plan runs only "
                              "with the TensorRT version and on the GPU model it was built for")
        self._engine = engine
        inputs, outputs = {}, {}
        self._io_dtype: dict[str, DataType] = {}
        self._outputs: list[str] = []
        for i in range(int(engine.num_io_tensors)):
            name = engine.get_tensor_name(i)
            dtype = TRT_TYPES.get(getattr(engine.get_tensor_dtype(name), "name", ""))
            shape = tuple(int(d) if int(d) >= 0 else None for d in engine.get_tensor_shape(name))
            if dtype is not None:
                self._io_dtype[name] = dtype
            if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                inputs[name] = (dtype, shape)
            else:
                outputs[name] = (dtype, shape)
                self._outputs.append(name)
        self.check_file_signature(inputs, outputs)
        self._context = engine.create_execution_context()
        if self._context is None:
            raise EngineError(f"engine 'tensorrt': {self.path.name}: create_execution_context failed "
                              f"({'; '.join(self._logger.errors[-2:]) or 'out of device memory?'})")
        if self.options["profile"]:
            n = int(getattr(engine, "num_optimization_profiles", 1))
            if self.options["profile"] >= n:
                raise EngineError(f"engine 'tensorrt': {self.path.name} has {n} optimization profile(s); option "
                                  f"profile is {self.options['profile']}")
            # the profile is set on the stream the plan runs on
            self._context.set_optimization_profile_async(self.options["profile"], self._stream_handle())
        dev = self.target.device_index
        self._device = _DeviceBuffers(dev)
        self._host: dict[str, runtime.PinnedBuffer] = {}
        self._allocator = _allocator(trt, self._device)
        self.info = BuildInfo(fingerprint=self.fingerprint, cache_hit=False, load_ms=(time.perf_counter() - t0) * 1e3,
                              artefact=str(self.path),
                              extra={"tensorrt": str(getattr(trt, "__version__", "unknown")),
                                     "cached": "nothing: the plan is the artefact"})

    def _stream_handle(self) -> int:
        if self.target.stream is not None:
            return stream_handle(self.target.stream)
        if self.__dict__.get("_own_stream") is None:
            self._own_stream = Stream(self.target.device_index)
        assert self._own_stream is not None
        return self._own_stream.handle

    def _host_buffer(self, name: str, nbytes: int) -> np.ndarray:
        have = self._host.get(name)
        if have is None or have.nbytes < nbytes:
            if have is not None:
                have.close()
            have = self._host[name] = runtime.PinnedBuffer(_round_up(nbytes))
        return have.array()[:nbytes]

    # -- run -----------------------------------------------------------------------------------------
    def _run(self, feed: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        stream = self._stream_handle()
        try:
            return self._run_on(stream, feed, outputs)
        except BaseException:
            # copies may still be queued from the request's arrays: let them finish before those go
            runtime.cuda().cuda_stream_synchronize(stream)
            raise

    def _run_on(self, stream: int, feed: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        rt: Any = runtime.cuda()
        ctx = self._context
        for name, arr in feed.items():
            ptr = self._device.get(name, max(arr.nbytes, 1))
            if arr.nbytes:
                rt.cuda_memcpy_async(ptr, arr.ctypes.data, arr.nbytes, stream)
            if not ctx.set_input_shape(name, tuple(arr.shape)):
                raise EngineError(f"engine 'tensorrt': {self.path.name} refuses input {name!r} of shape "
                                  f"{list(arr.shape)} (set_input_shape: outside its optimization profile?)")
            self._bind(name, ptr)
        static: dict[str, tuple[int, ...]] = {}
        for name in self._outputs:  # TensorRT needs every output bound, wanted or not
            shape = tuple(int(d) for d in ctx.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                if not ctx.set_output_allocator(name, self._allocator):
                    raise EngineError(f"engine 'tensorrt': set_output_allocator({name!r}) was refused")
                continue
            static[name] = shape
            nbytes = math.prod(shape) * self._itemsize(name)
            self._bind(name, self._device.get(name, max(nbytes, 1)))
        if not ctx.execute_async_v3(stream):
            raise EngineError(f"engine 'tensorrt': execute_async_v3 failed on {self.path.name} "
                              f"({'; '.join(self._logger.errors[-2:]) or 'see the TensorRT log'})")
        # the outputs' sizes are known (data-dependent ones through notify_shape) once the run is done
        self._wait(stream)
        out: dict[str, np.ndarray] = {}
        staged: list[tuple[str, np.ndarray, tuple[int, ...]]] = []
        for name in outputs:
            if name in static:
                shape, ptr = static[name], self._device.mem[name].ptr
            else:
                if name not in self._allocator.shapes:
                    raise EngineError(f"engine 'tensorrt': TensorRT gave no shape for data-dependent output {name!r}")
                shape = self._allocator.shapes[name]
                mem = self._device.mem.get(f"dds:{name}")
                ptr = mem.ptr if mem is not None else 0
            nbytes = math.prod(shape) * self._itemsize(name)
            host = self._host_buffer(name, max(nbytes, 1))
            if nbytes:
                rt.cuda_memcpy_async(host.ctypes.data, ptr, nbytes, stream)
            staged.append((name, host[:nbytes], shape))
        self._wait(stream)
        for name, host, shape in staged:
            out[name] = host.view(self._numpy(name)).reshape(shape).copy()
        return out

    def _wait(self, stream: int) -> None:
        """Sync-lite: an event recorded after the work queued on ``stream``, polled until it completes."""
        if self.__dict__.get("_event") is None:
            self._event = Event(self.target.device_index)
        self._event.record(stream)
        self._event.wait(SYNC_INTERVAL_US)

    def _bind(self, name: str, ptr: int) -> None:
        if not self._context.set_tensor_address(name, ptr):
            raise EngineError(f"engine 'tensorrt': set_tensor_address({name!r}, 0x{ptr:x}) was refused")

    def _numpy(self, name: str) -> np.dtype:
        dtype = self._io_dtype.get(name)
        if dtype is None:
            raise EngineError(f"engine 'tensorrt': tensor {name!r} of {self.path.name} has a TensorRT datatype "
                              f"gpuprims does not serve ({', '.join(TRT_TYPES)} are)")
        return dtype.numpy

    def _itemsize(self, name: str) -> int:
        return self._numpy(name).itemsize

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        if self.prepared:
            d.update(outputs=list(self._outputs))
        return d

    def close(self) -> None:
        """Wait for what is still queued on the stream (a run that failed after enqueueing its copies),
        then release the context, the plan and the buffers."""
        if self.prepared and (self.target.stream is not None or self.__dict__.get("_own_stream") is not None):
            try:
                runtime.cuda().cuda_stream_synchronize(self._stream_handle())
            except CudaError as e:  # a lost context: the memory goes with it; close() must finish
                log.error("engine tensorrt: the stream did not drain before close (%s); releasing anyway", e)
        for name in ("_context", "_engine", "_runtime", "_allocator"):
            self.__dict__.pop(name, None)
        event = self.__dict__.pop("_event", None)
        if event is not None:
            event.close()
        dev = self.__dict__.pop("_device", None)
        if dev is not None:
            dev.close()
        for buf in self.__dict__.pop("_host", {}).values():
            buf.close()
        own = self.__dict__.pop("_own_stream", None)
        if own is not None:
            own.close()
        super().close()
