"""The model runner of an instance that serves a model file (ONNX, TorchScript, torch.export, a TensorRT
plan...) with named tensors: the app's :class:`gpuprims.modelrepo.ModelConfig` on the instance's share.

The counterpart of :class:`orchestrator.worker.zoo_runner.AppRunner` for models users bring: it takes the share
(cores and threads on cpu, the MPS percentage on cuda), makes the file's engine
(:mod:`gpuprims.engines.files`), prepares it at start or in a shadow's pre-warm (never on the serving
path), runs the config's ``model_warmup`` samples as Triton does at load (:meth:`FileRunner.model_warmup`:
each sample's ``zero_data``, ``random_data`` or ``input_data_file`` inputs, repeated to its ``batch_size``,
``count`` times; a sample that cannot be read or run fails the instance's start with the reason, so the
model is UNAVAILABLE), and warms it up on zero inputs of the model's own datatypes to seed the batching
policy's latency model. The serving loop (:class:`orchestrator.worker.loops.tensors.TensorLoop`) runs batches
of named tensors through :attr:`model`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from gpuprims.batching import LatencyModel
from gpuprims.cpushare import CpuShare, apply_cpu_share
from gpuprims.engines import EngineCache, Target
from gpuprims.engines.files import FileEngine, make_file_engine, resolve_file_kind
from gpuprims.engines.ort_share import InitializerSource, SharesInitializers
from gpuprims.modelrepo import ModelConfig
from gpuprims.modelrepo.config import Warmup, WarmupInput
from gpuprims.pool import PacketPool
from gpuprims.tensors import DataType, ModelSignature, TensorSpec
from orchestrator.control.share_spec import await_handles
from orchestrator.control.spec import InstanceSpec

log = logging.getLogger("gpuprims.instance")

#: A dynamic dimension's size in the warm-up's inputs (and in a profile's, until requests say more).
WARM_DYNAMIC_DIM = 1
#: The seed of ``random_data`` warm-up inputs (the same values at every start).
WARMUP_SEED = 0


class WarmupError(ValueError):
    """A ``model_warmup`` sample that cannot be read or run: the instance does not start (Triton does not
    load a model whose warm-up fails)."""


def warmup_dir(model_path: str) -> Path:
    """The ``warmup/`` directory of a model file's model: beside its version directory
    (``<model>/<version>/model.onnx`` -> ``<model>/warmup``), else beside the file."""
    path = Path(model_path)
    for parent in path.parents:
        if parent.name.isdigit():
            return parent.parent / "warmup"
    return path.parent / "warmup"


def warmup_input(inp: WarmupInput, directory: Path, rng: np.random.Generator) -> np.ndarray:
    """One warm-up input of one request (its ``dims``), as Triton makes it: zeros, random values of its
    datatype, or the raw row-major bytes of ``directory/<input_data_file>``. WarmupError when the file is
    missing, unreadable or not exactly the input's size."""
    dt = inp.datatype.numpy
    if inp.data == "zero":
        return np.zeros(inp.dims, dt)
    if inp.data == "random":
        if dt.kind == "f":
            return rng.random(inp.dims).astype(dt)
        if dt.kind == "b":
            return rng.integers(0, 2, inp.dims).astype(dt)
        info = np.iinfo(dt)
        return rng.integers(max(info.min, -128), min(info.max, 127), inp.dims, endpoint=True).astype(dt)
    assert inp.data_file is not None
    path = directory / inp.data_file
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise WarmupError(f"input {inp.name!r}: input_data_file {path} cannot be read: {e.strerror or e}") from None
    want = int(np.prod(inp.dims, dtype=np.int64)) * dt.itemsize
    if len(raw) != want:
        raise WarmupError(f"input {inp.name!r}: input_data_file {path} holds {len(raw)} bytes; dims "
                          f"{list(inp.dims)} of {inp.datatype.value} take {want}")
    return np.frombuffer(raw, dt).reshape(inp.dims).copy()


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
        #: The model_warmup samples ran on the installed engine (a shadow's pre-warm runs them early).
        self.samples_run = False

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
        kind = resolve_file_kind(self.spec.engine.kind, self.spec.model_path)  # (eager on a torch file: the file run by torch)
        t0 = time.perf_counter()
        engine = make_file_engine(kind, self.spec.model_path, self.signature, self._target(),
                                  dict(self.spec.engine.options), self.spec.model_fingerprint)
        if isinstance(engine, SharesInitializers):  # Param-Share: the node's segment of its initializers
            engine.initializers_from = InitializerSource.parse(self.spec.share_params, await_handles)
        info = engine.prepare(self.cache)
        log.info("app %s: %s engine for %s ready in %.0f ms (%s)", self.spec.app, kind, self.spec.model_path,
                 (time.perf_counter() - t0) * 1e3, "cache hit" if info.cache_hit else "built")
        return {"engine": engine}

    def install(self, built: dict[str, Any]) -> None:
        """Take what :meth:`build` returned. An engine prepared before the share was known (a
        shadow's pre-warm) with other threads is made again for it; the cache makes that a load."""
        engine: FileEngine = built["engine"]
        self.samples_run = bool(built.get("samples_run"))
        if engine.target.threads != self._target().threads:
            fresh = make_file_engine(engine.kind, self.spec.model_path, self.signature, self._target(),
                                     dict(self.spec.engine.options), self.spec.model_fingerprint)
            if isinstance(engine, SharesInitializers) and isinstance(fresh, SharesInitializers):
                fresh.initializers_from = engine.initializers_from  # the mapping made for the first
            fresh.prepare(self.cache)
            engine.close()
            engine = fresh
            self.samples_run = False
        self.engine = engine
        self.model = engine.run
        if isinstance(engine, SharesInitializers) and engine.shared is not None:
            self.params_mode = engine.shared.mode  # exported | imported: the node's segment

    def describe(self) -> dict[str, Any]:
        """What status shows about the engine, plus the model file and version it serves."""
        d = self.engine.describe() if self.engine is not None else {}
        return {**d, "model_path": self.spec.model_path, "model_version": self.spec.model_version}

    def warm(self, built: dict[str, Any]) -> None:
        """Run the freshly built engine's model_warmup samples, then once on zeros (a shadow's pre-warm)."""
        engine: FileEngine = built["engine"]
        self._run_samples(engine)
        built["samples_run"] = True
        engine.run(self._zeros(1))

    def warmup_requests(self) -> list[tuple[Warmup, dict[str, np.ndarray]]]:
        """Each ``model_warmup`` sample of the config as the batch it runs: its inputs (read from the model's
        ``warmup/`` directory where a file gives them) repeated to its ``batch_size`` on a batched model.
        WarmupError naming the sample and the input when one cannot be made."""
        directory = warmup_dir(self.spec.model_path or "")
        rng = np.random.default_rng(WARMUP_SEED)
        out = []
        for w in self.config.warmup:
            try:
                one = {inp.name: warmup_input(inp, directory, rng) for inp in w.inputs}
            except WarmupError as e:
                raise WarmupError(f"app {self.spec.app}: model_warmup {w.name!r}: {e}") from None
            if self.signature.batched:
                one = {k: np.broadcast_to(v, (w.batch_size, *v.shape)).copy() for k, v in one.items()}
            out.append((w, one))
        return out

    def _run_samples(self, engine: FileEngine) -> None:
        for w, x in self.warmup_requests():
            for _ in range(w.count):
                try:
                    engine.run(x)
                except Exception as e:  # the engine's own error (onnxruntime's, torch's...): the sample fails
                    raise WarmupError(f"app {self.spec.app}: model_warmup {w.name!r} failed in the engine: "
                                      f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None

    def model_warmup(self) -> None:
        """Run the config's ``model_warmup`` samples on the installed engine, unless a pre-warm ran them on
        it already (Triton runs them at every load). WarmupError when one cannot be read or run."""
        assert self.engine is not None
        if not self.samples_run:
            self._run_samples(self.engine)
            self.samples_run = True

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
