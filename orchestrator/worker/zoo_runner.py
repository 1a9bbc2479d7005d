"""The model runner of one instance: the app's model(s) on the instance's device, and nothing else.

An :class:`orchestrator.worker.instance.Instance` (the process) owns one :class:`AppRunner`; its serving loop
(:mod:`orchestrator.worker.loops`) runs batches through it. The runner takes the device (the share: MPS
percentage on cuda, cores and threads on cpu), makes the app's engine (``gpuprims.engines``: eager torch,
ONNX Runtime, ...; one per stage of a DAG app) and prepares it (built, or taken from the engine cache) at
start or in a shadow's pre-warm, never on the serving path; makes the gather step for the device (GPU-DMA
into the engine's own input buffer when it has one) and the run seam (Sync-lite on cuda); warms the
engine up to seed the batching policy's latency model, and in dispatched mode measures every stage for
the node's scheduler. Like vLLM's ``gpu_model_runner`` beside its ``gpu_worker``: the process never
touches the model, the serving loop never builds one.

Param-Share (export or import of the torch weights) applies where the engine runs on them
(``Engine.uses_torch_weights``: eager); an ONNX Runtime session on the CPU provider takes the served
model's initializers from the node's shared segment instead (:mod:`gpuprims.engines.ort_share`); any
other engine holds its own copy, and ``params_mode`` says so.
A model the engine cannot take (an export that fails) is served with eager instead, after one ERROR line
naming the app, the engine and the reason; :meth:`AppRunner.describe` says ``fallback`` with the reason.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import time
from typing import Any

import numpy as np
import torch

from apps.zoo import load_model
from gpuprims.batching import LatencyModel
from gpuprims.cpushare import CpuShare, apply_cpu_share
from gpuprims.cuda import runtime
from gpuprims.cuda.event import Stream
from gpuprims.cuda.ipc import export_parameters, share_parameters
from gpuprims.device import warm_up
from gpuprims.engines import Engine, EngineCache, EngineError, ModelSource, Target, engine_class, make_engine
from gpuprims.engines.ort_share import InitializerSource, SharesInitializers
from gpuprims.gather import Gatherer, ModelRunner, default_method, make_gatherer, torch_device
from gpuprims.pool import PacketPool
from orchestrator.control.share_spec import await_handles
from orchestrator.control.spec import InstanceSpec

log = logging.getLogger("gpuprims.instance")


class DagModel:
    """The stages of a DAG app in one process: run the entry stage on the batch, then send each
    request on by the class its output picks (class i -> routes[i]); a request whose class has no
    route (or a stage with no routes) is answered with that stage's output.

    Calling it returns ``[(rows, output), ...]``: the batch rows each final output belongs to.
    """

    def __init__(self, models: dict[str, Any], routes: dict[str, list[str]], entry: str) -> None:
        if entry not in models:
            raise ValueError(f"entry stage {entry!r} is not one of {sorted(models)}")
        for name, targets in routes.items():
            unknown = [t for t in targets if t not in models]
            if unknown:
                raise ValueError(f"stage {name!r} routes to unknown stage(s) {unknown}")
        self.models, self.routes, self.entry = models, routes, entry

    def __call__(self, x: Any) -> list[tuple[np.ndarray, Any]]:
        done: list[tuple[np.ndarray, Any]] = []
        pending = [(self.entry, np.arange(x.shape[0]))]
        for _ in range(len(self.models) + 1):  # a DAG has no cycles: at most one pass per stage
            if not pending:
                break
            nxt = []
            for stage, rows in pending:
                out = self.models[stage](x[rows])
                targets = self.routes.get(stage) or []
                if not targets:
                    done.append((rows, out))
                    continue
                cls = out.argmax(dim=1).cpu().numpy()
                stay = cls >= len(targets)
                if stay.any():
                    done.append((rows[stay], out[stay]))
                for i, target in enumerate(targets):
                    sel = cls == i
                    if sel.any():
                        nxt.append((target, rows[sel]))
            pending = nxt
        return done

    def run_all(self, x: Any) -> None:
        """Run every stage on x (warm-up: each stage's one-time costs and latency)."""
        for m in self.models.values():
            m(x)


def default_profile_batches(max_batch: int) -> list[int]:
    """Powers of two up to ``max_batch``, and ``max_batch`` itself."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return [*out, max_batch]


def warm_sizes(max_batch: int) -> list[int]:
    """The batch sizes a warm-up runs: 1, max_batch/2 and max_batch."""
    return sorted({1, max(1, max_batch // 2), max_batch})


class AppRunner:
    """The app's model(s) on the instance's device (see the module docstring)."""

    def __init__(self, spec: InstanceSpec) -> None:
        self.spec = spec
        self.device: Any = None
        self.model: Any = None
        self.stage_models: dict[str, Any] = {}
        self.routes: dict[str, list[str]] = {}
        self.params_mode = "own"  # own | exported | imported (Param-Share)
        self.exported: Any = None
        self.shared: Any = None
        self.measured: dict[str, dict[str, float]] = {}  # stage -> {batch: ms}, from the warm-up
        self._threads: int | None = None
        self.seam: ModelRunner | None = None
        # The engine of each stage (``main`` for a one-model app) and what it did at prepare.
        self.engines: dict[str, Engine] = {}
        self.fallbacks: dict[str, str] = {}  # stage -> why its engine fell back to eager
        self.cache = EngineCache(spec.engine_cache)
        self.stream: Any = None  # cuda: the stream GPU-DMA gathers on, the engine runs on, Sync-lite waits on
        self._own_stream: Stream | None = None

    # -- the device --------------------------------------------------------------------------------
    def init_device(self, gpu_pct: int) -> None:
        """Take the share: on cuda the MPS percentage (before CUDA initialises here) and the device; on
        cpu the cores and threads (affinity)."""
        self.spec.gpu_pct = gpu_pct
        # cuda:<gpu> on the cuda backend; cpu on the cpu backend and on the fake CUDA runtime.
        self.device = torch_device(self.spec.backend, self.spec.gpu)
        if self.spec.backend == "cuda":
            os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(gpu_pct)
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            if self.stream is None:
                if runtime.is_fake():
                    self.stream = self._own_stream = Stream(self.spec.gpu)
                else:
                    self.stream = torch.cuda.current_stream(self.device)
        elif self.spec.cores:
            apply_cpu_share(CpuShare(cores=list(self.spec.cores), threads=self.spec.threads or len(self.spec.cores),
                                     gpu_pct=gpu_pct))

    def set_threads(self, gpu_pct: int) -> None:
        """CPU backend: run a stage with the threads its GPU% stands for, within the instance's cores."""
        if self.device is None or self.device.type != "cpu":
            return
        cores = len(self.spec.cores) if self.spec.cores else (os.cpu_count() or 1)
        n = max(1, min(cores, round((os.cpu_count() or 1) * gpu_pct / 100)))
        if n != self._threads:
            torch.set_num_threads(n)
            self._threads = n

    # -- the model ---------------------------------------------------------------------------------
    def build(self, device: Any) -> dict[str, Any]:
        """Make and prepare the app's engine(s) on ``device``; returns the attributes :meth:`install`
        sets (engines, model, stage_models, routes, and the Param-Share ones), so that a pre-warm thread
        can build them without touching the runner."""
        if self.spec.stages:
            engines: dict[str, Engine] = {}
            fallbacks: dict[str, str] = {}
            for st in self.spec.stages:
                engines[st.name] = self._prepared(st.name, st.model, st.engine.kind, dict(st.engine.options),
                                                  device, None, fallbacks)
            routes = {st.name: list(st.routes) for st in self.spec.stages}
            entry = self.spec.entry or self.spec.stages[0].name
            return {"engines": engines, "fallbacks": fallbacks, "stage_models": dict(engines), "routes": routes,
                    "model": DagModel(dict(engines), routes, entry)}
        out: dict[str, Any] = {}
        module = None
        if engine_class(self.spec.engine.kind).uses_torch_weights:
            module = self._load_single(device, out)  # Param-Share applies: the engine runs on these weights
        else:
            out["params_mode"] = "engine"  # the engine holds its own copy of the weights
        fallbacks = {}
        engine = self._prepared("main", self.spec.model, self.spec.engine.kind, dict(self.spec.engine.options),
                                device, module, fallbacks)
        out.update(engines={"main": engine}, fallbacks=fallbacks, model=engine)
        if isinstance(engine, SharesInitializers) and engine.shared is not None:
            out["params_mode"] = engine.shared.mode  # the session's initializers are the node's segment
        if fallbacks:
            out["params_mode"] = "own"
        return out

    @functools.cached_property
    def initializers(self) -> InitializerSource | None:
        """Where an ONNX Runtime session takes its initializers from (the spec's ``share_params``)."""
        return InitializerSource.parse(self.spec.share_params, await_handles)

    def _load_single(self, device: Any, out: dict[str, Any]) -> Any:
        """Load the app's model: its own weights, or (Param-Share) the weights another instance exported.

        ``share_params`` is ``export:PATH`` (load, then move the weights into one shared allocation
        and write its handles to PATH) or ``import:PATH`` (build on the meta device, so no weight
        memory is allocated, and map the exported weights; CUDA IPC on a GPU, shared memory on CPU).
        """
        kw = {"seed": self.spec.seed, "num_classes": self.spec.num_classes, "input_shape": tuple(self.spec.input_shape)}
        mode, _, path = (self.spec.share_params or "").partition(":")
        if mode == "import":
            handles = await_handles(path)
            model = load_model(self.spec.model, device="meta", **kw)
            shared = share_parameters(handles, model)
            out.update(shared=shared, params_mode="imported")
            return shared.model.eval()
        model = load_model(self.spec.model, **kw).to(device).eval()
        if mode == "export":
            # On the fake CUDA runtime the model is on the CPU, yet a cuda instance exports through
            # the fake's IPC, so its lifetime rules hold in the node's tests as on a GPU.
            exported = export_parameters(model, backend="cuda" if self.spec.backend == "cuda" else "cpu",
                                         gpu=self.spec.gpu)
            tmp = f"{path}.{os.getpid()}"
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(exported.to_bytes())
            os.replace(tmp, path)  # importers never see a partial file
            out.update(exported=exported, params_mode="exported")
        return model

    def _target(self) -> Target:
        threads = None
        if self.spec.backend == "cpu":
            threads = self.spec.threads or (len(self.spec.cores) if self.spec.cores else None)
        return Target(self.spec.backend, self.spec.gpu if self.spec.backend == "cuda" else 0, threads, self.stream)

    def _prepared(self, stage: str, model: str, kind: str, options: dict[str, Any] | None, device: Any,
                  module: Any, fallbacks: dict[str, str]) -> Engine:
        """The engine of one model, prepared (built or found in the cache, and loaded). An engine that
        cannot take the model (EngineError: an export that fails, a library missing here) is replaced
        by eager after one ERROR line naming the app, the engine and the reason."""
        source = ModelSource(model, tuple(self.spec.input_shape), self.spec.max_batch, seed=self.spec.seed,
                             num_classes=None if self.spec.stages else self.spec.num_classes)
        where = self.spec.app if stage == "main" else f"{self.spec.app} (stage {stage})"

        def progress(msg: str, fraction: float | None) -> None:
            log.info("app %s: engine %s: %s%s", where, kind, msg, "" if fraction is None else f" ({fraction:.0%})")

        try:
            engine = make_engine(kind, source, self._target(), options, cache=self.cache)
            if stage == "main" and module is None and isinstance(engine, SharesInitializers):
                engine.initializers_from = self.initializers
            engine.prepare(module, progress)
        except EngineError as e:
            log.error("app %s: engine %s cannot serve model %s: %s; serving it with eager instead",
                      where, kind, model, e)
            fallbacks[stage] = f"{type(e).__name__}: {e}"
            engine = make_engine("eager", source, self._target())
            engine.prepare(module if module is not None else source.build_module(device))
        return engine

    def install(self, built: dict[str, Any]) -> None:
        """Take what :meth:`build` returned. Engines whose CPU threads come from the share and were
        prepared before it was known (a shadow's pre-warm) are made again for it: the artefact is in the
        cache by then, so this loads and builds nothing."""
        for key, value in built.items():
            setattr(self, key, value)
        want = self._target().threads
        for stage, engine in list(self.engines.items()):
            if engine.uses_torch_weights or engine.target.threads == want:
                continue
            fresh = make_engine(engine.kind, engine.source, self._target(), engine.options, cache=self.cache)
            if isinstance(engine, SharesInitializers) and isinstance(fresh, SharesInitializers):
                fresh.initializers_from = engine.initializers_from  # the mapping made for the first
            fresh.prepare()
            engine.close()
            self.engines[stage] = fresh
            if self.spec.stages:
                self.stage_models[stage] = fresh
            else:
                self.model = fresh
        if self.spec.stages:
            self.model = DagModel(self.stage_models, self.routes, self.entry_stage)

    def describe(self) -> dict[str, Any]:
        """What status shows about the engine(s): a one-model app's engine (``describe()``, plus
        ``fallback`` with the reason where it fell back to eager); a DAG app's per stage."""
        def one(stage: str, engine: Engine) -> dict[str, Any]:
            d = engine.describe()
            if stage in self.fallbacks:
                d["fallback"] = self.fallbacks[stage]
            return d

        if self.spec.stages:
            return {"stages": {name: one(name, e) for name, e in self.engines.items()}}
        return one("main", self.engines["main"]) if "main" in self.engines else {}

    @property
    def entry_stage(self) -> str:
        """The stage whose queue is the ring: the DAG entry, or ``main`` for a one-model app."""
        if self.spec.stages:
            return self.spec.entry or self.spec.stages[0].name
        return "main"

    def stage_model(self, stage: str) -> Any:
        """The model of ``stage`` (``main`` for a one-model app); KeyError for an unknown stage."""
        if self.spec.stages:
            return self.stage_models[stage]
        if stage != "main":
            raise KeyError(stage)
        return self.model

    def dag(self, entry: str) -> DagModel:
        """The app's DAG entered at ``entry`` (serving what an earlier stage routed there)."""
        return DagModel(self.stage_models, self.routes, entry)

    def stage_pct(self, stage: str) -> int:
        """The GPU% a stage runs at (the spec's ``stage_pcts``, else the instance's)."""
        return int((self.spec.stage_pcts or {}).get(stage, self.spec.gpu_pct))

    # -- the seams around the model ------------------------------------------------------------------
    def open_seams(self, pool: PacketPool) -> Gatherer:
        """The gather step for this device, and the run seam on its stream: GPU-DMA into a preallocated
        device batch and Sync-lite on cuda (the spec's gather_method may pick the CUDA-Copy baseline);
        the native host gather on cpu."""
        method = self.spec.gather_method or default_method(self.spec.backend)
        out = None
        if method == "gpu_dma" and not self.spec.stages and "main" in self.engines:
            out = self.engines["main"].static_input()  # pool -> kernel -> engine, no copy
        gatherer = make_gatherer(self.spec.backend, pool, tuple(self.spec.input_shape), self.spec.dtype,
                                 self.spec.max_batch, self.spec.gpu, method, stream=self.stream, out=out)
        self.seam = ModelRunner(self.spec.backend, self.spec.gpu, stream=gatherer.stream)
        return gatherer

    def run(self, fn: Any, x: Any) -> Any:
        """``fn(x)`` without autograd; on CUDA its completion is awaited with Sync-lite."""
        assert self.seam is not None
        return self.seam.run(fn, x)

    # -- warm-up and measurement ----------------------------------------------------------------------
    def measure_stages(self) -> None:
        """Dispatched mode: median latency of every stage over ``profile_batches`` (the scheduler's
        starting profile; it corrects itself from measured latencies later)."""
        batches = sorted(set(self.spec.profile_batches or default_profile_batches(self.spec.max_batch)))
        stages = [st.name for st in self.spec.stages] if self.spec.stages else ["main"]
        lock = open(self.spec.measure_lock, "a") if self.spec.measure_lock else None  # noqa: SIM115
        try:
            if lock is not None:
                fcntl.flock(lock, fcntl.LOCK_EX)  # one instance measures at a time
            self._measure(stages, batches)
        finally:
            if lock is not None:
                lock.close()  # releases the lock

    def _measure(self, stages: list[str], batches: list[int]) -> None:
        for stage in stages:
            self.set_threads(self.stage_pct(stage))
            medians = warm_up(self.stage_model(stage), tuple(self.spec.input_shape), batches, self.device,
                              repeats=3, discard=1)
            self.measured[stage] = {str(b): ms for b, ms in medians.items()}

    def warm_up(self, latency: LatencyModel) -> None:
        """Run batches of 1, max_batch/2 and max_batch to seed ``latency`` (the batching policy's)."""
        run = self.model.run_all if isinstance(self.model, DagModel) else self.model
        for b, ms in warm_up(run, tuple(self.spec.input_shape), warm_sizes(self.spec.max_batch), self.device,
                             repeats=1, discard=1).items():
            latency.observe(b, ms, at_s=time.monotonic())

    def close(self) -> None:
        """Release the run seam and the engines (the gatherer is the serving loop's: it closes it)."""
        if self.seam is not None:
            self.seam.close()
            self.seam = None
        for engine in self.engines.values():
            engine.close()
        self.engines.clear()

    def close_stream(self) -> None:
        """Release the stream this runner made (after the gatherer that used it is closed)."""
        if self._own_stream is not None:
            self._own_stream.close()
            self._own_stream = None
        self.stream = None
