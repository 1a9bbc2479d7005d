"""The model runner of an instance that serves a model file (ONNX, TorchScript, torch.export, a TensorRT
plan...) with named tensors: the app's :class:`gpuprims.modelrepo.ModelConfig` on the instance's share.

The counterpart of :class:`orchestrator.runner.AppRunner` for models users bring: it takes the share
(cores and threads on cpu, the MPS percentage on cuda), makes the file's engine
(:mod:`gpuprims.engines.files`), prepares it at start or in a shadow's pre-warm (never on the serving
path), and warms it up on zero inputs of the model's own datatypes to seed the batching policy's
latency model. The serving loop (:class:`orchestrator.tensor_serving.TensorServingLoop`) runs batches
of named tensors through :attr:`model`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

from gpuprims.batching import LatencyModel
from gpuprims.cpushare import CpuShare, apply_cpu_share
from gpuprims.engines import EngineCache, Target
from gpuprims.engines.files import FileEngine, make_file_engine, resolve_file_kind
from gpuprims.modelrepo import ModelConfig
from gpuprims.pool import PacketPool
from gpuprims.tensors import DataType, ModelSignature, TensorSpec
from orchestrator.spec import InstanceSpec

log = logging.getLogger("gpuprims.instance")

#: A dynamic dimension's size in the warm-up's inputs (and in a profile's, until requests say more).
WARM_DYNAMIC_DIM = 1


def zero_request(signature: ModelSignature) -> dict[str, np.ndarray]:
    """One request of zeros of every required input's datatype, each dynamic dimension of size
    :data:`WARM_DYNAMIC_DIM` (the warm-up's and a test's stand-in for a real request)."""
    def one(s: TensorSpec) -> np.ndarray:
        return np.zeros(tuple(WARM_DYNAMIC_DIM if d == -1 else d for d in s.dims), s.datatype.numpy)
    return {s.name: one(s) for s in signature.inputs if not s.optional and s.datatype is not DataType.BYTES}


class FileRunner:
    """The model file on the instance's device (see the module docstring). ``model`` is the engine's
    ``run``: named input tensors (a whole batch) in, named output tensors out."""

    def __init__(self, spec: InstanceSpec) -> None:
        if not spec.model_config or not spec.model_path:
            raise ValueError(f"instance {spec.name}: a file model needs model_config and model_path in its spec")
        self.spec = spec
        self.config = ModelConfig.from_json(spec.model_config)
        self.signature: ModelSignature = self.config.signature
        self.device: Any = None
        self.engine: FileEngine | None = None
        self.model: Any = None
        self.params_mode = "engine"  # the engine holds its own copy of the weights
        self.measured: dict[str, dict[str, float]] = {}
        self.fallbacks: dict[str, str] = {}
        self.cache = EngineCache(spec.engine_cache)
        self.stream: Any = None
        self.stages: dict[str, Any] = {}

    # -- the device --------------------------------------------------------------------------------
    def init_device(self, gpu_pct: int) -> None:
        """Take the share: the MPS percentage on cuda (before CUDA initialises here), the cores and
        threads on cpu."""
        self.spec.gpu_pct = gpu_pct
        if self.spec.backend == "cuda":
            os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(gpu_pct)
            self.device = f"cuda:{self.spec.gpu}"
        else:
            self.device = "cpu"
            if self.spec.cores:
                apply_cpu_share(CpuShare(cores=list(self.spec.cores),
                                         threads=self.spec.threads or len(self.spec.cores), gpu_pct=gpu_pct))

    def _target(self) -> Target:
        threads = None
        if self.spec.backend == "cpu":
            threads = self.spec.threads or (len(self.spec.cores) if self.spec.cores else None)
        return Target(self.spec.backend, self.spec.gpu if self.spec.backend == "cuda" else 0, threads, self.stream)

    # -- the model ---------------------------------------------------------------------------------
    def build(self, device: Any) -> dict[str, Any]:
        """Make and prepare the file's engine (built, or taken from the engine cache by the file's
        content); returns what :meth:`install` takes, so a pre-warm thread can build it."""
        kind = resolve_file_kind(self.spec.engine, self.spec.model_path)  # (eager on a torch file: the file run by torch)
        t0 = time.perf_counter()
        engine = make_file_engine(kind, self.spec.model_path, self.signature, self._target(),
                                  self.spec.engine_options or {}, self.spec.model_fingerprint)
        info = engine.prepare(self.cache)
        log.info("app %s: %s engine for %s ready in %.0f ms (%s)", self.spec.app, kind, self.spec.model_path,
                 (time.perf_counter() - t0) * 1e3, "cache hit" if info.cache_hit else "built")
        return {"engine": engine}

    def install(self, built: dict[str, Any]) -> None:
        """Take what :meth:`build` returned. An engine prepared before the share was known (a
        shadow's pre-warm) with other threads is made again for it; the cache makes that a load."""
        engine: FileEngine = built["engine"]
        if engine.target.threads != self._target().threads:
            fresh = make_file_engine(engine.kind, self.spec.model_path, self.signature, self._target(),
                                     self.spec.engine_options or {}, self.spec.model_fingerprint)
            fresh.prepare(self.cache)
            engine.close()
            engine = fresh
        self.engine = engine
        self.model = engine.run

    def describe(self) -> dict[str, Any]:
        """What status shows about the engine, plus the model file and version it serves."""
        d = self.engine.describe() if self.engine is not None else {}
        return {**d, "model_path": self.spec.model_path, "model_version": self.spec.model_version}

    def warm(self, built: dict[str, Any]) -> None:
        """Run the freshly built engine once on zeros (a shadow's pre-warm)."""
        engine: FileEngine = built["engine"]
        engine.run(self._zeros(1))

    # -- the seams around the model ------------------------------------------------------------------
    def open_seams(self, pool: PacketPool) -> None:
        """No gather step: a file model's requests are decoded per request (named tensors of any
        shape), so there is no fixed-size batch buffer to gather into."""
        return None

    def run(self, fn: Any, x: Any) -> Any:
        """``fn(x)``: the engine runs a batch to completion before it returns its outputs."""
        return fn(x)

    # -- warm-up ------------------------------------------------------------------------------------
    def _zeros(self, batch: int) -> dict[str, np.ndarray]:
        one = zero_request(self.signature)
        if not self.signature.batched:
            return one
        return {k: np.broadcast_to(v, (batch, *v.shape)).copy() for k, v in one.items()}

    def warm_sizes(self) -> list[int]:
        """The batch sizes a warm-up runs: 1, max/2 and max of the model's ``max_batch_size`` capped by
        the app's ``max_batch``; 1 for a model without batching."""
        if not self.signature.batched:
            return [1]
        top = max(1, min(self.spec.max_batch, self.signature.max_batch_size))
        return sorted({1, max(1, top // 2), top})

    def warm_up(self, latency: LatencyModel) -> None:
        """Run each warm size twice (the first run pays one-time costs) and seed ``latency`` with the
        second, at the model's own datatypes and dynamic dimensions of size 1."""
        assert self.engine is not None
        for b in self.warm_sizes():
            x = self._zeros(b)
            self.engine.run(x)
            t0 = time.perf_counter()
            self.engine.run(x)
            latency.observe(b, (time.perf_counter() - t0) * 1e3, at_s=time.monotonic())

    def measure_stages(self) -> None:
        raise ValueError(f"app {self.spec.app}: a model file is served by its own instance's batching; "
                         "node.scheduler spatiotemporal/temporal does not take model files yet")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self.model = None

    def close_stream(self) -> None:
        self.stream = None
