"""Model files run by ONNX Runtime (``onnxruntime``: an ONNX file) and OpenVINO (``openvino``: an ONNX file
or OpenVINO IR ``model.xml``), with any named tensors, numpy in and out.

Neither imports torch, directly or through another module: serving an ONNX file maps no torch into the
instance (tests/gpuprims/engines/test_files.py checks it in a fresh interpreter), so a model file costs
the instance ONNX Runtime's memory, not torch's.

``onnxruntime`` options: ``provider`` (``cpu``; on the cuda backend also ``cuda`` and ``tensorrt``, the
CUDA and TensorRT execution providers of the onnxruntime-gpu build), ``optimization`` (ONNX Runtime's graph
optimization level: ``disable`` | ``basic`` | ``extended`` | ``all``) and ``precision`` (``fp32``, or
``fp16``: TensorRT's half kernels, ``tensorrt`` provider only). The cache entry holds ORT's optimized model
(``SessionOptions.optimized_model_filepath``, the graph after the level's rewrites for this device), loaded
later with optimizations off, so a second start optimizes nothing; with the ``tensorrt`` provider it holds
TensorRT's engine and timing caches instead (a graph with compiled TensorRT nodes cannot be saved as ONNX).
Threads: the intra-op pool has ``Target.threads`` threads (the calling thread is one), one inter-op
thread, and idle threads block instead of spinning (a spinning thread burns the neighbouring app's core).

BF16 tensors travel as their uint16 bits: they go into ORT as OrtValues of ONNX's BFLOAT16 element type
(``OrtValue.ortvalue_from_numpy_with_onnx_type``, which reinterprets without a copy) and BF16 outputs come
back as the uint16 bits of ORT's buffer. An ORT without that call refuses BF16 at prepare.

``openvino`` (cpu backend): option ``hint`` (``latency`` | ``throughput``, OpenVINO's performance hint);
``INFERENCE_NUM_THREADS`` = ``Target.threads``, one stream, no core pinning, f32 inference precision (no
silent bf16). OpenVINO compiles the file at load; there is nothing to cache. BF16 tensors go in as
``ov.Tensor`` of ``Type.bf16`` filled with the uint16 bits, and come out as those bits.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path
from typing import Any

import numpy as np

from gpuprims.cuda import runtime
from gpuprims.engines.base import BuildInfo, EngineError, EngineUnavailable
from gpuprims.engines.cache import EngineCache, device_identity
from gpuprims.engines.files import FileEngine, first_line
from gpuprims.engines.kinds import FILE_ENGINE_KINDS, OV_HINTS
from gpuprims.engines.kinds import ORT_OPTIMIZATION_LEVELS as OPTIMIZATION_LEVELS
from gpuprims.engines.kinds import ORT_PROVIDERS as PROVIDERS
from gpuprims.engines.ort_session import cuda_provider_options, default_threads, session_options
from gpuprims.engines.ort_share import (
    InitializerSource,
    SharedInitializers,
    open_session,
    take_shared,
    trim_heap,
)
from gpuprims.tensors import DataType

OPTIMIZED_FILE = "model.opt.onnx"
TRT_DIR = "trt"
#: ONNX's TensorProto.BFLOAT16 (not imported from onnx: the engine needs only onnxruntime).
ONNX_BFLOAT16 = 16

#: ONNX Runtime's type strings -> datatypes.
ORT_TYPES: dict[str, DataType] = {
    "tensor(bool)": DataType.BOOL, "tensor(uint8)": DataType.UINT8, "tensor(uint16)": DataType.UINT16,
    "tensor(uint32)": DataType.UINT32, "tensor(uint64)": DataType.UINT64, "tensor(int8)": DataType.INT8,
    "tensor(int16)": DataType.INT16, "tensor(int32)": DataType.INT32, "tensor(int64)": DataType.INT64,
    "tensor(float16)": DataType.FP16, "tensor(bfloat16)": DataType.BF16, "tensor(float)": DataType.FP32,
    "tensor(double)": DataType.FP64, "tensor(string)": DataType.BYTES,
}
#: OpenVINO element type names (``ov.Type.get_type_name()``) -> datatypes.
OV_TYPES: dict[str, DataType] = {
    "boolean": DataType.BOOL, "u8": DataType.UINT8, "u16": DataType.UINT16, "u32": DataType.UINT32,
    "u64": DataType.UINT64, "i8": DataType.INT8, "i16": DataType.INT16, "i32": DataType.INT32,
    "i64": DataType.INT64, "f16": DataType.FP16, "bf16": DataType.BF16, "f32": DataType.FP32,
    "f64": DataType.FP64, "string": DataType.BYTES,
}


def _ort() -> Any:
    """The onnxruntime module (imported on use: checking a configuration needs none)."""
    import onnxruntime

    return onnxruntime


def _ov() -> Any:
    import openvino

    return openvino


def onnx_external_files(path: Path) -> list[Path]:
    """The external data files an ONNX model names (large weights kept beside the graph), read from the
    graph without loading them; [] where the onnx package is absent (ONNX Runtime itself needs it not)
    or the file does not parse (prepare then says why)."""
    try:
        import onnx
    except ImportError:
        return []
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:
        return []
    locations: set[str] = set()
    graphs = [model.graph]
    while graphs:  # subgraphs (If, Loop, Scan bodies) may hold initializers of their own
        graph = graphs.pop()
        for t in graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                locations.update(e.value for e in t.external_data if e.key == "location")
        for node in graph.node:
            for attr in node.attribute:
                graphs.extend([attr.g] if attr.HasField("g") else [])
                graphs.extend(attr.graphs)
    return [path.parent / loc for loc in sorted(locations) if (path.parent / loc).is_file()]


def _dims(shape: Any) -> tuple[int | None, ...] | None:
    """A library's shape (ints, symbolic names, None, -1) as ints with None for dynamic dims."""
    if shape is None:
        return None
    return tuple(int(d) if isinstance(d, (int, np.integer)) and int(d) >= 0 else None for d in shape)


def _bf16_bits(value: Any) -> np.ndarray:
    """The uint16 bits of a BF16 OrtValue (numpy has no bfloat16, so ``.numpy()`` refuses it): a copy of
    ORT's buffer."""
    shape = tuple(value.shape())
    nbytes = int(value.tensor_size_in_bytes())
    if nbytes == 0:
        return np.zeros(shape, np.uint16)
    raw = (ctypes.c_uint8 * nbytes).from_address(int(value.data_ptr()))
    return np.frombuffer(raw, np.uint8).view(np.uint16).reshape(shape).copy()


class OnnxRuntimeFileEngine(FileEngine):
    """An ONNX file in an ONNX Runtime session (see the module docstring)."""

    kind = "onnxruntime"
    spec = FILE_ENGINE_KINDS["onnxruntime"]
    #: Against the same file in a plain InferenceSession: the optimized graph fuses and reorders float
    #: sums (a few 1e-7 on the tests' models).
    tolerance = (1e-5, 1e-5)
    suffixes = (".onnx",)
    #: Param-Share (CPU provider): where the served session takes its initializers from (set before
    #: prepare; :mod:`gpuprims.engines.ort_share`). None: the session loads its own copy.
    initializers_from: InitializerSource | None = None
    shared: SharedInitializers | None = None
    share_refused: str | None = None

    @property
    def threads(self) -> int:
        return self.target.threads or default_threads()

    def related_files(self) -> list[Path]:
        return onnx_external_files(self.path)

    def device_identity(self) -> dict[str, Any]:
        # On cuda, the GPU from our own runtime layer rather than torch's: this engine maps no torch.
        if self.target.backend == "cpu":
            return device_identity(self.target)
        rt: Any = runtime.cuda()
        major, minor = rt.cuda_device_capability(self.target.device_index)
        return {"backend": "cuda", "fake": runtime.is_fake(), "name": rt.cuda_device_name(self.target.device_index),
                "cc": f"{major}.{minor}"}

    # -- build and load ----------------------------------------------------------------------------------
    def _session_options(self, ort: Any, level: str) -> Any:
        return session_options(ort, self.threads, level)

    def _providers(self, trt_dir: Path | None) -> list[Any]:
        provider = self.options["provider"]
        if provider == "cpu":
            return [PROVIDERS["cpu"]]
        cuda, handle = cuda_provider_options(self.target.device_index, self.target.stream)
        providers: list[Any] = [(PROVIDERS["cuda"], cuda), PROVIDERS["cpu"]]
        if provider == "tensorrt":
            trt = {"device_id": str(self.target.device_index),
                   "trt_fp16_enable": "1" if self.options["precision"] == "fp16" else "0",
                   "trt_engine_cache_enable": "1", "trt_timing_cache_enable": "1"}
            if handle:
                trt.update(has_user_compute_stream="1", user_compute_stream=str(handle))
            if trt_dir is not None:
                trt.update(trt_engine_cache_path=str(trt_dir), trt_timing_cache_path=str(trt_dir))
            providers.insert(0, (PROVIDERS["tensorrt"], trt))
        return providers

    def _session(self, ort: Any, path: Path, level: str, trt_dir: Path | None, optimized_out: Path | None = None,
                 shared: SharedInitializers | None = None) -> Any:
        so = self._session_options(ort, level)
        if shared is not None:
            shared.add_to(ort, so)
        if optimized_out is not None:
            so.optimized_model_filepath = str(optimized_out)
            if self.related_files():
                # a model with external data may pass protobuf's 2 GB limit inlined: keep its weights
                # outside the optimized graph too, in a file beside it in the cache entry
                so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                            optimized_out.name + ".data")
                so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                            "1024")
        try:
            return ort.InferenceSession(str(path), sess_options=so, providers=self._providers(trt_dir))
        except Exception as e:
            raise EngineError(f"engine 'onnxruntime' cannot load {self.path.name} (provider "
                              f"{self.options['provider']!r}): {first_line(e)}") from e

    def _prepare(self, cache: EngineCache) -> None:
        ort = _ort()
        provider = self.options["provider"]
        available = list(ort.get_available_providers())
        if PROVIDERS[provider] not in available:
            raise EngineUnavailable(f"engine 'onnxruntime': provider {provider!r} ({PROVIDERS[provider]}) is not in "
                                    f"this onnxruntime build (it has {', '.join(available)}); the GPU providers "
                                    "need the onnxruntime-gpu package")
        self._bf16_inputs = [s.name for s in self.signature.inputs if s.datatype is DataType.BF16]
        if self._bf16_inputs and not hasattr(ort.OrtValue, "ortvalue_from_numpy_with_onnx_type"):
            raise EngineUnavailable(f"engine 'onnxruntime': BF16 input(s) {self._bf16_inputs} need "
                                    f"OrtValue.ortvalue_from_numpy_with_onnx_type, which onnxruntime "
                                    f"{ort.__version__} lacks")
        level = OPTIMIZATION_LEVELS[self.options["optimization"]]

        def build(tmp: Path) -> dict[str, Any]:
            if provider == "tensorrt":
                (tmp / TRT_DIR).mkdir()
                session = self._session(ort, self.path, level, tmp / TRT_DIR)  # builds TensorRT's engines
            else:
                session = self._session(ort, self.path, level, None, optimized_out=tmp / OPTIMIZED_FILE)
            self._check_session(session)  # a file that disagrees with the signature leaves no entry
            return {"provider": provider, "source": self.path.name}

        entry = cache.get_or_build(self.cache_key(), build)
        t0 = time.perf_counter()
        optimized = entry.file(OPTIMIZED_FILE)
        served = optimized if optimized.is_file() else self.path
        who = f"engine 'onnxruntime' ({self.path.name})"
        self.shared, self.share_refused = take_shared(self.initializers_from, served, provider, who)
        if optimized.is_file():  # already rewritten at the chosen level for this device: load it as it is
            self.session, self.shared, self.share_refused = open_session(
                lambda shared: self._session(ort, optimized, "ORT_DISABLE_ALL", None, shared=shared),
                self.shared, self.share_refused, who)
        else:
            trt_dir = entry.file(TRT_DIR) if provider == "tensorrt" else None
            self.session, self.shared, self.share_refused = open_session(
                lambda shared: self._session(ort, self.path, level, trt_dir, shared=shared),
                self.shared, self.share_refused, who)
        trim_heap()  # the parsed model's buffers, freed by ORT, leave the heap (they count in PSS)
        self._check_session(self.session)
        self._bf16_outputs = {o.name for o in self.session.get_outputs() if o.type == "tensor(bfloat16)"}
        self._ort = ort
        self.info = BuildInfo(fingerprint=self.fingerprint, cache_hit=entry.hit,
                              build_ms=0.0 if entry.hit else entry.build_ms,
                              load_ms=(time.perf_counter() - t0) * 1e3, artefact=str(entry.path),
                              extra={"provider": provider, "threads": self.threads, "cache_key": entry.key,
                                     "onnxruntime": ort.__version__})

    def _check_session(self, session: Any) -> None:
        def io(args: Any) -> dict[str, tuple[DataType | None, tuple[int | None, ...] | None]]:
            return {a.name: (ORT_TYPES.get(a.type), _dims(a.shape)) for a in args}
        self.check_file_signature(io(session.get_inputs()), io(session.get_outputs()))

    # -- serving -----------------------------------------------------------------------------------------
    def _run(self, feed: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        if not self._bf16_inputs and not self._bf16_outputs.intersection(outputs):
            return dict(zip(outputs, self.session.run(outputs, feed)))
        # BF16 somewhere: every tensor as an OrtValue, BF16 ones reinterpreting the uint16 bits
        ov = self._ort.OrtValue
        values = {name: (ov.ortvalue_from_numpy_with_onnx_type(arr, ONNX_BFLOAT16) if name in self._bf16_inputs
                         else ov.ortvalue_from_numpy(arr)) for name, arr in feed.items()}
        got = self.session.run_with_ort_values(outputs, values)
        return {name: (_bf16_bits(v) if name in self._bf16_outputs else v.numpy()) for name, v in zip(outputs, got)}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "threads": self.threads,
                "initializers": self.shared.describe() if self.shared is not None
                else {"mode": "own", **({"why": self.share_refused} if self.share_refused else {})}}

    def close(self) -> None:
        self.__dict__.pop("session", None)
        self.__dict__.pop("shared", None)
        super().close()


class OpenVinoFileEngine(FileEngine):
    """An ONNX or OpenVINO IR file compiled by OpenVINO's CPU plugin (see the module docstring)."""

    kind = "openvino"
    spec = FILE_ENGINE_KINDS["openvino"]
    #: Against ONNX Runtime on the same file: other kernels, other float summation order.
    tolerance = (1e-4, 1e-5)
    suffixes = (".onnx", ".xml")

    @property
    def threads(self) -> int:
        return self.target.threads or default_threads()

    def related_files(self) -> list[Path]:
        return onnx_external_files(self.path) if self.path.suffix.lower() == ".onnx" else []

    def _prepare(self, cache: EngineCache) -> None:
        ov = _ov()
        t0 = time.perf_counter()
        try:
            core = ov.Core()
            model = core.read_model(str(self.path))
        except Exception as e:
            raise EngineError(f"engine 'openvino' cannot read {self.path.name}: {first_line(e)}") from e
        self.check_file_signature(self._io(model.inputs), self._io(model.outputs))
        config = {"INFERENCE_NUM_THREADS": self.threads, "NUM_STREAMS": 1,
                  "PERFORMANCE_HINT": OV_HINTS[self.options["hint"]], "INFERENCE_PRECISION_HINT": "f32",
                  "ENABLE_CPU_PINNING": False}
        try:
            self.compiled = core.compile_model(model, "CPU", config)
            self.request = self.compiled.create_infer_request()
        except Exception as e:
            raise EngineError(f"engine 'openvino' cannot compile {self.path.name}: {first_line(e)}") from e
        # each signature output's port: OpenVINO gives a port several names; the signature's is one of them
        self._ports = {}
        for port in self.compiled.outputs:
            for name in port.get_names():
                self._ports[name] = port
        self._ov = ov
        self._bf16_inputs = {s.name for s in self.signature.inputs if s.datatype is DataType.BF16}
        self._bf16_outputs = {s.name for s in self.signature.outputs if s.datatype is DataType.BF16}
        self.info = BuildInfo(fingerprint=self.fingerprint, cache_hit=False, load_ms=(time.perf_counter() - t0) * 1e3,
                              artefact=str(self.path), extra={"threads": self.threads, "openvino": ov.__version__,
                                                              "cached": "nothing: OpenVINO compiles at load"})

    def _io(self, ports: Any) -> dict[str, tuple[DataType | None, tuple[int | None, ...] | None]]:
        """Each port under the signature's name for it (OpenVINO gives a port several names), else its
        first name."""
        known = {s.name for s in (*self.signature.inputs, *self.signature.outputs)}
        out: dict[str, tuple[DataType | None, tuple[int | None, ...] | None]] = {}
        for port in ports:
            dtype = OV_TYPES.get(port.get_element_type().get_type_name())
            ps = port.get_partial_shape()
            shape = None if ps.rank.is_dynamic else tuple(d.get_length() if d.is_static else None for d in ps)
            names = sorted(port.get_names())
            name = next((n for n in names if n in known), port.get_any_name())
            out[name] = (dtype, shape)
        return out

    def _run(self, feed: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
        values: dict[str, Any] = dict(feed)
        for name in self._bf16_inputs.intersection(feed):
            # a bf16 Tensor's .data is typed float16 by OpenVINO's python API: write the bits through a
            # uint16 view, never a numeric conversion
            t = self._ov.Tensor(self._ov.Type.bf16, self._ov.Shape(list(feed[name].shape)))
            t.data.view(np.uint16)[...] = feed[name]
            values[name] = t
        result = self.request.infer(values)
        # copies: the request's output buffers are reused by the next run
        return {name: (np.array(result[self._ports[name]]).view(np.uint16).copy() if name in self._bf16_outputs
                       else np.array(result[self._ports[name]], copy=True)) for name in outputs}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "threads": self.threads}

    def close(self) -> None:
        for name in ("request", "compiled", "_ports"):
            self.__dict__.pop(name, None)
        super().close()
