"""``engine: openvino``: the model exported to ONNX (:mod:`gpuprims.engines.onnx`) and run by OpenVINO's
CPU plugin (cpu backend only).

There are public reports of OpenVINO crashing on AMD EPYC CPUs. Tried on this machine's (an AMD EPYC,
2 cores, OpenVINO 2026.4.1): MobileNetV2 and ResNet-18 at 3x64x64, 200 inferences each at batch sizes
cycling 1..4, no crash, outputs within 5e-6 (relative to the largest output) of ONNX Runtime's. That is
a brief trial, not a soak: the engine is opt-in (``engine: openvino``, or ``auto`` on the cpu backend,
which holds it to eager like every candidate).

Options: ``hint``: OpenVINO's performance hint, ``latency`` (default: one stream, the app's threads on
one request) or ``throughput``.

Threads: ``INFERENCE_NUM_THREADS`` = ``Target.threads``, one stream, and no pinning of OpenVINO's threads
to cores (``ENABLE_CPU_PINNING`` off: the instance's affinity, set by its share, decides where it runs).
The cache entry holds the exported ``model.onnx``; OpenVINO compiles it for the CPU at load (a fraction
of a second for the zoo's CNNs).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from gpuprims.engines.base import BuildInfo, Engine, EngineError, Progress
from gpuprims.engines.cache import EngineCache, engine_key
from gpuprims.engines.kinds import ENGINE_KINDS, OV_HINTS
from gpuprims.engines.onnx import INPUT_NAME, export_onnx
from gpuprims.engines.onnxruntime import default_threads

ONNX_FILE = "model.onnx"


def _ov() -> Any:
    import openvino

    return openvino


class OpenVinoEngine(Engine):
    """An OpenVINO compiled model on the CPU (see the module docstring)."""

    kind = "openvino"
    spec = ENGINE_KINDS["openvino"]
    #: float32 (INFERENCE_PRECISION_HINT f32: no silent bf16 on CPUs that have it). The VGGs at 224x224
    #: differ from eager by up to 2.6e-4 absolute (float32 sums in another order), hence atol 1e-3.
    tolerance = (1e-3, 1e-3)

    @property
    def threads(self) -> int:
        return self.target.threads or default_threads()

    def _prepare(self, module: Any, progress: Progress | None) -> None:
        ov = _ov()
        cache = self.cache if self.cache is not None else EngineCache()
        key = engine_key(self, module, libraries=("openvino", "onnx"))

        def build(tmp: Path) -> dict[str, Any]:
            if progress is not None:
                progress(f"exporting {self.source.model} to ONNX", 0.0)
            return export_onnx(module, self.source, tmp / ONNX_FILE)

        entry = cache.get_or_build(key, build, progress=progress)
        t0 = time.perf_counter()
        try:
            core = ov.Core()
            model = core.read_model(str(entry.file(ONNX_FILE)))
            c, h, w = self.source.input_shape
            model.reshape({INPUT_NAME: ov.PartialShape([ov.Dimension(1, self.source.max_batch), c, h, w])})
            config = {"INFERENCE_NUM_THREADS": self.threads, "NUM_STREAMS": 1,
                      "PERFORMANCE_HINT": OV_HINTS[self.options["hint"]], "INFERENCE_PRECISION_HINT": "f32",
                      "ENABLE_CPU_PINNING": False}
            self.compiled = core.compile_model(model, "CPU", config)
            self.request = self.compiled.create_infer_request()
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise EngineError(f"engine 'openvino' cannot load {self.source.model!r}: {type(e).__name__}: "
                              f"{first}") from e
        self.info = BuildInfo(fingerprint=entry.key, cache_hit=entry.hit, build_ms=0.0 if entry.hit else entry.build_ms,
                              load_ms=(time.perf_counter() - t0) * 1e3, artefact=str(entry.path),
                              extra={"threads": self.threads, "openvino": ov.__version__})

    def run(self, x: Any) -> Any:
        if not self.prepared:
            raise EngineError("engine 'openvino' is not prepared: call prepare() first")
        n = int(x.shape[0])
        if not 1 <= n <= self.source.max_batch:
            raise EngineError(f"engine 'openvino': batch of {n} is outside 1..{self.source.max_batch} "
                              f"(max_batch of {self.source.model!r})")
        if x.dtype != torch.float32:
            x = x.float()
        result = self.request.infer({INPUT_NAME: x.detach().cpu().contiguous().numpy()})
        return torch.from_numpy(result[0].copy())  # the request's output buffer is reused by the next run

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "tolerance": list(self.tolerance), "threads": self.threads}

    def close(self) -> None:
        for name in ("request", "compiled"):
            self.__dict__.pop(name, None)
        super().close()
