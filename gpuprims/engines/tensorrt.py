"""``engine: tensorrt``: the model as a TensorRT plan (the ``tensorrt`` Python package, TensorRT 10/11 API),
built once from ONNX and cached, run with ``execute_async_v3`` on the instance's stream (cuda backend only).

Build (at :meth:`~TensorRTEngine.prepare`, only when the cache has no plan for this fingerprint):

1. ONNX from the torch module (:func:`gpuprims.engines.onnx.export_onnx`, a dynamic batch axis);
2. ``trt.Builder`` -> ``create_network`` (networks are always explicit-batch in TensorRT 10+; no flag) ->
   ``trt.OnnxParser.parse`` (a refusal becomes :class:`ExportError` naming the layer and operator);
3. a builder config: one optimization profile on the input with min ``(1, C, H, W)``, opt
   ``(opt_batch, C, H, W)`` (default max_batch) and max ``(max_batch, C, H, W)``; the workspace pool
   limit (``workspace_mb``); FP32 with TF32 cleared (so fp32 matches eager within the stated tolerance)
   or FP16 (``BuilderFlag.FP16``, only where ``builder.platform_has_fast_fp16``; TensorRT 11 removed
   the flag, so fp16 there is refused with the reason); an ``IProgressMonitor`` that reports every
   phase through the ``progress`` callback (a plan takes minutes);
4. ``build_serialized_network``; the plan (and the ONNX) go into the engine cache, keyed with
   TensorRT's version and the device's compute capability (a plan runs only where it was built).

Load: ``trt.Runtime.deserialize_cuda_engine``, ``create_execution_context``, and
``set_tensor_address`` for the input (the static device buffer ``(max_batch, C, H, W)`` that *is*
:meth:`~TensorRTEngine.static_input`, so GPU-DMA writes into TensorRT's input binding) and the output.
Run: ``set_input_shape`` for the batch (when it changes) and ``execute_async_v3(stream)`` on the
instance's stream; returns at once (complete after an event recorded on the stream: Sync-lite).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from gpuprims.cuda import runtime
from gpuprims.cuda.event import Event, Stream, stream_handle
from gpuprims.cuda.graph import _torch_stream
from gpuprims.engines.base import Engine, EngineError, EngineUnavailable, ExportError, Progress, check_batch
from gpuprims.engines.cache import EngineCache, device_identity, fingerprint, model_identity
from gpuprims.engines.cudagraph import _settle, device_tensor
from gpuprims.engines.file_tensorrt import trt_logger
from gpuprims.engines.kinds import ENGINE_KINDS
from gpuprims.engines.onnx import export_onnx

log = logging.getLogger("gpuprims.engines")

PLAN = "model.plan"
ONNX = "model.onnx"
#: The tolerances (rtol, atol) against eager per precision: FP32 without TF32 is close to eager (kernels
#: and fusions differ); FP16 rounds every activation to 11 significant bits.
TOLERANCES: dict[str, tuple[float, float]] = {"fp32": (1e-3, 1e-4), "fp16": (2e-2, 2e-2)}


def _trt() -> Any:
    try:
        return importlib.import_module("tensorrt")
    except ImportError as e:
        raise EngineUnavailable("engine 'tensorrt' needs the tensorrt package (TensorRT 10 or 11): install it on "
                                "the GPU host with pip install 'gpuprims[gpu-engines]'") from e


class TensorRTEngine(Engine):
    """A TensorRT plan behind the run seam (see the module docstring)."""

    kind = "tensorrt"
    spec = ENGINE_KINDS["tensorrt"]
    tolerance = TOLERANCES["fp32"]
    asynchronous: ClassVar[bool] = True

    def __init__(self, source: Any, target: Any, options: Mapping[str, Any] | None = None, *,
                 cache: Any = None) -> None:
        super().__init__(source, target, options, cache=cache)
        ob = self.options["opt_batch"]
        if ob is not None and ob > source.max_batch:
            raise EngineError(f"engine 'tensorrt' option opt_batch {ob} exceeds max_batch {source.max_batch}")
        self.tolerance = TOLERANCES[self.options["precision"]]  # type: ignore[misc]

    # -- build ---------------------------------------------------------------------------------------
    def _prepare(self, module: Any, progress: Progress | None) -> None:
        trt = _trt()
        version = str(getattr(trt, "__version__", "unknown"))
        if self.options["precision"] == "fp16" and _major(version) >= 11:
            raise EngineUnavailable(f"engine 'tensorrt' precision: fp16 needs TensorRT 10 here: TensorRT {version} "
                                    "removed BuilderFlag.FP16 (weak typing) and needs an FP16 ONNX (ModelOpt "
                                    "AutoCast), which gpuprims does not make yet; use precision: fp32")
        device = device_identity(self.target)
        key = fingerprint({"kind": self.kind, "model": model_identity(self.source, module), "options": self.options,
                           "tensorrt": version, "device": device})
        cache = self.cache if self.cache is not None else EngineCache()
        self._logger = trt_logger(trt)

        def build(tmp: Path) -> dict[str, Any]:
            mod = module
            if mod is None:
                mod = self.source.build_module("cpu")
            self._say(progress, "tensorrt: exporting ONNX", 0.0)
            meta = export_onnx(mod, self.source, tmp / ONNX)  # ExportError names the model and why
            plan = self._build_plan(trt, (tmp / ONNX).read_bytes(), meta.get("input", "input"), progress)
            (tmp / PLAN).write_bytes(bytes(plan))
            return {"input": meta.get("input", "input"), "output": meta.get("output", "output"),
                    "tensorrt": version, "cc": device.get("cc"), "precision": self.options["precision"]}

        entry = cache.get_or_build(key, build, progress=progress)
        self.info.fingerprint, self.info.cache_hit, self.info.artefact = key, entry.hit, str(entry.file(PLAN))
        self.info.build_ms = 0.0 if entry.hit else entry.build_ms
        t0 = time.perf_counter()
        self._load(trt, entry.file(PLAN).read_bytes(), entry.meta)
        self.info.load_ms = (time.perf_counter() - t0) * 1e3
        self.info.extra.update({"tensorrt": version, "precision": self.options["precision"], "cc": device.get("cc"),
                                "opt_batch": self._opt_batch()})

    def _opt_batch(self) -> int:
        ob = self.options["opt_batch"]
        return self.source.max_batch if ob is None else int(ob)

    def _say(self, progress: Progress | None, msg: str, frac: float | None) -> None:
        log.info("%s", msg)
        if progress is not None:
            progress(msg, frac)

    def _build_plan(self, trt: Any, onnx: bytes, input_name: str, progress: Progress | None) -> Any:
        builder = trt.Builder(self._logger)
        network = builder.create_network(0)  # explicit batch is the only mode since TensorRT 10
        parser = trt.OnnxParser(network, self._logger)
        if not parser.parse(onnx):
            raise ExportError(_parse_errors(parser, self.source.model))
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, self.options["workspace_mb"] << 20)
        if self.options["precision"] == "fp16":
            if not getattr(builder, "platform_has_fast_fp16", False):
                raise EngineUnavailable("engine 'tensorrt' precision: fp16 needs a GPU with fast native FP16 "
                                        "(TensorRT's platform_has_fast_fp16 is False here); use precision: fp32")
            config.set_flag(trt.BuilderFlag.FP16)
        elif hasattr(trt.BuilderFlag, "TF32"):
            config.clear_flag(trt.BuilderFlag.TF32)  # fp32 means fp32: TF32 would round inputs to 10 bits
        c, h, w = self.source.input_shape
        profile = builder.create_optimization_profile()
        profile.set_shape(input_name, (1, c, h, w), (self._opt_batch(), c, h, w), (self.source.max_batch, c, h, w))
        config.add_optimization_profile(profile)
        monitor = _monitor(trt, progress)
        if monitor is not None:
            config.progress_monitor = monitor
        self._say(progress, f"tensorrt: building the {self.options['precision']} plan for {self.source.model} "
                            f"(max batch {self.source.max_batch}; this takes minutes on a GPU)", 0.05)
        t0 = time.perf_counter()
        plan = builder.build_serialized_network(network, config)
        if plan is None:
            errors = "; ".join(self._logger.errors[-3:]) or "no error was logged"
            raise EngineError(f"engine 'tensorrt': TensorRT could not build a plan for {self.source.model} "
                              f"(build_serialized_network returned None): {errors}")
        self._say(progress, f"tensorrt: plan built in {time.perf_counter() - t0:.1f} s", 1.0)
        return plan

    # -- load and run --------------------------------------------------------------------------------
    def _load(self, trt: Any, plan: bytes, meta: Mapping[str, Any]) -> None:
        self._runtime = trt.Runtime(self._logger)
        self._engine = self._runtime.deserialize_cuda_engine(plan)
        if self._engine is None:
            raise EngineError(f"engine 'tensorrt': the cached plan does not deserialize ({'; '.join(self._logger.errors[-2:])}); "
                              "it was built by another TensorRT or for another GPU: clear the engine cache entry")
        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        inputs = [n for n in names if self._engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [n for n in names if self._engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        if len(inputs) != 1 or len(outputs) != 1:
            raise EngineError(f"engine 'tensorrt' serves models with one input and one output; the plan has inputs "
                              f"{inputs} and outputs {outputs}")
        self.input_name, self.output_name = inputs[0], outputs[0]
        if self._engine.get_tensor_dtype(self.output_name) != trt.DataType.FLOAT:
            raise EngineError(f"engine 'tensorrt': output {self.output_name!r} is not float32")
        self._context = self._engine.create_execution_context()
        dev = self.target.device_index
        mb = self.source.max_batch
        self._in_mem, self._static = device_tensor((mb, *self.source.input_shape), dev)
        self._set_shape(mb)
        out_shape = tuple(int(d) for d in self._context.get_tensor_shape(self.output_name))
        if not out_shape or out_shape[0] != mb or any(d < 1 for d in out_shape):
            raise EngineError(f"engine 'tensorrt': output shape {out_shape} at batch {mb} is not (batch, ...)")
        self._out_mem, self._out = device_tensor(out_shape, dev)
        self._bind(self.input_name, self._static.data_ptr())
        self._bind(self.output_name, self._out.data_ptr())
        self._own_stream: Stream | None = None
        self._event: Event | None = None
        self._keep: Any = None
        self.runs = 0

    def _bind(self, name: str, ptr: int) -> None:
        if not self._context.set_tensor_address(name, ptr):
            raise EngineError(f"engine 'tensorrt': set_tensor_address({name!r}, 0x{ptr:x}) was refused")

    def _set_shape(self, n: int) -> None:
        shape = (n, *self.source.input_shape)
        if not self._context.set_input_shape(self.input_name, shape):
            raise EngineError(f"engine 'tensorrt': set_input_shape({self.input_name!r}, {shape}) was refused "
                              f"(outside the optimization profile 1..{self.source.max_batch}?)")
        self._shape_n = n

    def static_input(self) -> Any:
        """TensorRT's input binding: the device buffer ``(max_batch, C, H, W)`` float32 (GPU-DMA writes here)."""
        return self._static if self.prepared else None

    def _stream(self) -> Any:
        if self.target.stream is not None:
            return self.target.stream
        if runtime.is_fake():
            if self._own_stream is None:
                self._own_stream = Stream(self.target.device_index)
            return self._own_stream

        return torch.cuda.current_stream(self.target.device_index)

    def run(self, x: Any) -> Any:
        """``execute_async_v3`` on the instance's stream for ``x`` (float32 ``(n, C, H, W)``; rows already in
        the static input are not copied); returns the output's first ``n`` rows at once (complete after an
        event recorded on the stream after this call; valid until the next run)."""
        if not self.prepared:
            raise EngineError("engine 'tensorrt' is not prepared: call prepare() before run()")
        n = check_batch(self.kind, x, self.source)
        stream = self._stream()
        if x.data_ptr() != self._static.data_ptr():
            self._copy_in(x, n, stream)
        if n != self._shape_n:
            self._set_shape(n)
        if not self._context.execute_async_v3(stream_handle(stream)):
            raise EngineError(f"engine 'tensorrt': execute_async_v3 failed for a batch of {n} (see the TensorRT log)")
        self.runs += 1
        return self._out[:n]

    def _copy_in(self, x: Any, n: int, stream: Any) -> None:
        src = x.detach().to(torch.float32).contiguous()
        if runtime.is_fake():
            self._keep = src
            runtime.cuda().cuda_memcpy_async(self._static.data_ptr(), src.data_ptr(), src.numel() * 4,
                                             stream_handle(stream))
            return

        with torch.cuda.stream(_torch_stream(stream, self.target.device_index)):
            self._static[:n].copy_(src, non_blocking=True)

    def synchronize(self, interval_us: float = 100, timeout_s: float | None = 30.0) -> None:
        """Sync-lite wait for the last run (event after it on the stream, cudaEventQuery polling)."""
        if self._event is None:
            self._event = Event(self.target.device_index)
        self._event.record(self._stream())
        self._event.wait(interval_us, timeout_s=timeout_s)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        if self.prepared:
            d.update(runs=self.runs, input=self.input_name, output=self.output_name)
        return d

    def close(self) -> None:
        """Wait for the last run, then release the context, the engine and the device buffers."""
        if self.__dict__.get("runs"):
            _settle(self)
        for name in ("_context", "_engine", "_runtime", "_static", "_out"):
            self.__dict__.pop(name, None)
        self._keep = None
        for name in ("_in_mem", "_out_mem", "_event", "_own_stream"):
            obj = self.__dict__.pop(name, None)
            if obj is not None:
                obj.close()
        super().close()


def _major(version: str) -> int:
    try:
        return int(version.split(".")[0])
    except ValueError:
        return 0


def _parse_errors(parser: Any, model: str) -> str:
    """One line naming the first refused layer, its operator and TensorRT's reason (then the rest)."""
    parts = []
    for i in range(int(parser.num_errors)):
        err = parser.get_error(i)
        name = _call(err, "node_name") or f"node #{_call(err, 'node')}"
        op = _call(err, "node_operator")
        parts.append(f"layer {name!r}{f' ({op})' if op else ''}: {_call(err, 'desc')}")
    detail = "; ".join(parts) or "no error was reported"
    return f"engine 'tensorrt': TensorRT's ONNX parser refused model {model!r} at {detail}"


def _call(obj: Any, name: str) -> Any:
    fn = getattr(obj, name, None)
    return fn() if callable(fn) else None



def _monitor(trt: Any, progress: Progress | None) -> Any:
    """An IProgressMonitor reporting each phase and step through ``progress`` (thread-safe, as TensorRT
    calls it from its own threads), or None where the API or a callback is absent."""
    base = getattr(trt, "IProgressMonitor", None)
    if base is None or progress is None:
        return None

    class Monitor(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            base.__init__(self)
            self.lock = threading.Lock()
            self.steps: dict[str, int] = {}

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            with self.lock:
                self.steps[phase_name] = max(1, int(num_steps))
            progress(f"tensorrt: {phase_name}" + (f" ({parent_phase})" if parent_phase else ""), None)

        def step_complete(self, phase_name: str, step: int) -> bool:
            with self.lock:
                total = self.steps.get(phase_name, 1)
            progress(f"tensorrt: {phase_name} step {step + 1}/{total}", min(1.0, (step + 1) / total))
            return True  # False would cancel the build

        def phase_finish(self, phase_name: str) -> None:
            with self.lock:
                self.steps.pop(phase_name, None)

    return Monitor()
