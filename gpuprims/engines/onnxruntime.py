"""``engine: onnxruntime``: the model exported to ONNX (:mod:`gpuprims.engines.onnx`) and run by ONNX Runtime.

Options:

- ``provider``: ``cpu`` (CPUExecutionProvider), ``cuda`` (CUDAExecutionProvider) or ``tensorrt``
  (TensorrtExecutionProvider, CUDA for what TensorRT does not take). The GPU ones need the cuda backend
  and the ``onnxruntime-gpu`` build; :meth:`OnnxRuntimeEngine.check` refuses them on the cpu backend.
- ``optimization``: ONNX Runtime's graph optimization level, ``disable`` | ``basic`` | ``extended`` |
  ``all`` (default).
- ``precision``: ``fp32`` (default) or ``fp16`` (``tensorrt`` provider only: TensorRT's FP16 kernels).

Threads: the session's intra-op pool has exactly the threads the app's share gives (``Target.threads``;
the calling thread is one of them), one inter-op thread, sequential execution, and its threads do not
spin while idle (``session.intra_op.allow_spinning=0``), so an idle app leaves its neighbour's core alone.

Cache entry: the exported ``model.onnx`` and ONNX Runtime's optimized model ``model.opt.onnx`` (the graph
after the chosen level's rewrites, written by ``SessionOptions.optimized_model_filepath``), so a later start
exports nothing and loads the optimized graph with optimizations off. With the ``tensorrt`` provider the
entry holds TensorRT's engine and timing caches instead of an optimized model (a graph with compiled
TensorRT nodes cannot be saved as ONNX).

On CUDA the engine runs with I/O binding: the input is bound where it lies on the device (the device
batch GPU-DMA gathered, or :meth:`static_input`), the output into a preallocated device buffer, and the
session computes on the target's stream (``user_compute_stream``) without synchronizing at the end of
the run, so Sync-lite's event recorded after :meth:`run` is what the instance waits on. cupy is not
needed for any of it: torch holds the buffers and gives their addresses.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpuprims.backend import torch_device
from gpuprims.engines.base import BuildInfo, Engine, EngineError, EngineUnavailable, Progress
from gpuprims.engines.cache import EngineCache, engine_key
from gpuprims.engines.kinds import ENGINE_KINDS
from gpuprims.engines.kinds import ORT_OPTIMIZATION_LEVELS as OPTIMIZATION_LEVELS
from gpuprims.engines.kinds import ORT_PROVIDERS as PROVIDERS
from gpuprims.engines.onnx import INPUT_NAME, OUTPUT_NAME, export_onnx
from gpuprims.engines.ort_session import cuda_provider_options, default_threads, session_options
from gpuprims.engines.ort_share import (
    InitializerSource,
    SharedInitializers,
    open_session,
    take_shared,
    trim_heap,
)

ONNX_FILE = "model.onnx"
OPTIMIZED_FILE = "model.opt.onnx"
TRT_DIR = "trt"


def _ort() -> Any:
    """The onnxruntime module (imported on use; tests hand in a recording stand-in here)."""
    import onnxruntime

    return onnxruntime


def _say(progress: Progress | None, message: str, fraction: float | None) -> None:
    if progress is not None:
        progress(message, fraction)


class OnnxRuntimeEngine(Engine):
    """An ONNX Runtime session over the exported model (see the module docstring)."""

    kind = "onnxruntime"
    spec = ENGINE_KINDS["onnxruntime"]
    #: float32, CPU provider, every zoo model tests/gpuprims/engines/test_equal.py covers. Most differ from
    #: eager by a few 1e-6; the VGGs at 224x224 (16-19 conv layers, then a 25088-wide linear layer) by up
    #: to 1.7e-4 absolute, from float32 sums taken in another order, hence atol 1e-3.
    tolerance = (1e-3, 1e-3)
    #: With ``precision: fp16`` (TensorRT): half precision keeps about 3 significant digits.
    fp16_tolerance = (2e-2, 2e-2)
    uses_torch_weights = False
    #: Param-Share (CPU provider): where the served session takes its initializers from (set before
    #: prepare; :mod:`gpuprims.engines.ort_share`). None: the session loads its own copy.
    initializers_from: InitializerSource | None = None
    shared: SharedInitializers | None = None
    share_refused: str | None = None

    @property
    def tolerance_now(self) -> tuple[float, float]:
        """The tolerance that applies with this engine's options."""
        return self.fp16_tolerance if self.options["precision"] == "fp16" else self.tolerance

    @property
    def threads(self) -> int:
        return self.target.threads or default_threads()

    @property
    def on_device(self) -> bool:
        """True when the session runs on the GPU (I/O binding on the device batch)."""
        return self.options["provider"] != "cpu"

    # -- build and load ----------------------------------------------------------------------------------
    def _session_options(self, ort: Any, level: str) -> Any:
        return session_options(ort, self.threads, level)

    def _providers(self, trt_dir: Path | None) -> list[Any]:
        provider = self.options["provider"]
        if provider == "cpu":
            return [PROVIDERS["cpu"]]
        cuda, _ = cuda_provider_options(self.target.device_index, self.target.stream)
        providers: list[Any] = [(PROVIDERS["cuda"], cuda)]
        if provider == "tensorrt":
            c, h, w = self.source.input_shape
            top = self.source.max_batch
            opt = max(1, top // 2)
            trt = {**cuda, "trt_fp16_enable": "1" if self.options["precision"] == "fp16" else "0",
                   "trt_engine_cache_enable": "1", "trt_timing_cache_enable": "1",
                   "trt_profile_min_shapes": f"{INPUT_NAME}:1x{c}x{h}x{w}",
                   "trt_profile_opt_shapes": f"{INPUT_NAME}:{opt}x{c}x{h}x{w}",
                   "trt_profile_max_shapes": f"{INPUT_NAME}:{top}x{c}x{h}x{w}"}
            if trt_dir is not None:
                trt.update(trt_engine_cache_path=str(trt_dir), trt_timing_cache_path=str(trt_dir))
            providers.insert(0, (PROVIDERS["tensorrt"], trt))
        return providers

    def _session(self, ort: Any, path: Path, level: str, trt_dir: Path | None, optimized_out: Path | None = None,
                 shared: SharedInitializers | None = None) -> Any:
        so = self._session_options(ort, level)
        if optimized_out is not None:
            so.optimized_model_filepath = str(optimized_out)
        if shared is not None:
            shared.add_to(ort, so)
        try:
            return ort.InferenceSession(str(path), sess_options=so, providers=self._providers(trt_dir))
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise EngineError(f"engine 'onnxruntime' cannot load {self.source.model!r} "
                              f"({path.name}, provider {self.options['provider']!r}): {type(e).__name__}: "
                              f"{first}") from e

    def _prepare(self, module: Any, progress: Progress | None) -> None:
        ort = _ort()
        provider = self.options["provider"]
        available = list(ort.get_available_providers())
        if PROVIDERS[provider] not in available:
            raise EngineUnavailable(f"engine 'onnxruntime': provider {provider!r} ({PROVIDERS[provider]}) is not "
                                    f"in this onnxruntime build (it has {', '.join(available)}); the GPU "
                                    "providers need the onnxruntime-gpu package")
        cache = self.cache if self.cache is not None else EngineCache()
        key = engine_key(self, module, libraries=("onnxruntime", "onnx"))
        level = OPTIMIZATION_LEVELS[self.options["optimization"]]

        def build(tmp: Path) -> dict[str, Any]:
            _say(progress, f"exporting {self.source.model} to ONNX", 0.0)
            meta = export_onnx(module, self.source, tmp / ONNX_FILE)
            _say(progress, f"optimizing {self.source.model} with ONNX Runtime ({provider})", 0.5)
            if provider == "tensorrt":
                (tmp / TRT_DIR).mkdir()
                self._session(ort, tmp / ONNX_FILE, level, tmp / TRT_DIR)  # builds the TensorRT plan
            else:
                self._session(ort, tmp / ONNX_FILE, level, None, optimized_out=tmp / OPTIMIZED_FILE)
            _say(progress, f"built the onnxruntime engine of {self.source.model}", 1.0)
            return meta

        entry = cache.get_or_build(key, build, progress=progress)
        t0 = time.perf_counter()
        optimized = entry.file(OPTIMIZED_FILE)
        served = optimized if optimized.is_file() else entry.file(ONNX_FILE)
        who = f"engine 'onnxruntime' ({self.source.model})"
        self.shared, self.share_refused = take_shared(self.initializers_from, served, provider, who)
        if optimized.is_file():  # already rewritten at the chosen level: load it as it is
            self.session, self.shared, self.share_refused = open_session(
                lambda shared: self._session(ort, optimized, "ORT_DISABLE_ALL", None, shared=shared),
                self.shared, self.share_refused, who)
        else:
            trt_dir = entry.file(TRT_DIR) if provider == "tensorrt" else None
            self.session, self.shared, self.share_refused = open_session(
                lambda shared: self._session(ort, served, level, trt_dir, shared=shared),
                self.shared, self.share_refused, who)
        trim_heap()  # the parsed model's buffers, freed by ORT, leave the heap (they count in PSS)
        self.output_shape = tuple(int(d) for d in entry.meta.get("output_shape", ()))
        if self.on_device:
            self._bind(ort)
        self.info = BuildInfo(fingerprint=entry.key, cache_hit=entry.hit, build_ms=0.0 if entry.hit else entry.build_ms,
                              load_ms=(time.perf_counter() - t0) * 1e3, artefact=str(entry.path),
                              extra={"provider": provider, "threads": self.threads,
                                     "exporter": entry.meta.get("exporter"), "opset": entry.meta.get("opset")})

    def _bind(self, ort: Any) -> None:
        """The device buffers I/O binding uses: the static input and the preallocated output."""
        device = torch_device(self.target.backend, self.target.device_index)
        top = self.source.max_batch
        self._input = torch.empty((top, *self.source.input_shape), dtype=torch.float32, device=device)
        self._output = torch.empty((top, *self.output_shape), dtype=torch.float32, device=device)
        self._binding = self.session.io_binding()
        self._run_options = ort.RunOptions()
        # Sync-lite waits on an event recorded after run(); ORT need not block the host at the end of it.
        self._run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")

    # -- serving -----------------------------------------------------------------------------------------
    def static_input(self) -> Any:
        return self._input if self.on_device and self.prepared else None

    def run(self, x: Any) -> Any:
        if not self.prepared:
            raise EngineError("engine 'onnxruntime' is not prepared: call prepare() first")
        n = int(x.shape[0])
        if not 1 <= n <= self.source.max_batch:
            raise EngineError(f"engine 'onnxruntime': batch of {n} is outside 1..{self.source.max_batch} "
                              f"(max_batch of {self.source.model!r})")
        if x.dtype != torch.float32:
            x = x.float()
        if self.on_device:
            return self._run_bound(x, n)
        out = self.session.run([OUTPUT_NAME], {INPUT_NAME: x.detach().cpu().contiguous().numpy()})[0]
        y = torch.from_numpy(out)
        return y if x.device.type == "cpu" else y.to(x.device)

    def _run_bound(self, x: Any, n: int) -> Any:
        if x.device != self._input.device:
            x = x.to(self._input.device)
        x = x.contiguous()
        out = self._output[:n]
        b = self._binding
        b.bind_input(name=INPUT_NAME, device_type="cuda", device_id=self.target.device_index,
                     element_type=np.float32, shape=tuple(x.shape), buffer_ptr=x.data_ptr())
        b.bind_output(name=OUTPUT_NAME, device_type="cuda", device_id=self.target.device_index,
                      element_type=np.float32, shape=tuple(out.shape), buffer_ptr=out.data_ptr())
        self.session.run_with_iobinding(b, self._run_options)
        return out  # a view of the preallocated output: valid until the next run()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "tolerance": list(self.tolerance_now), "threads": self.threads,
                "initializers": self.shared.describe() if self.shared is not None
                else {"mode": "own", **({"why": self.share_refused} if self.share_refused else {})}}

    def close(self) -> None:
        for name in ("session", "_binding", "_run_options", "_input", "_output", "shared"):
            self.__dict__.pop(name, None)
        super().close()
