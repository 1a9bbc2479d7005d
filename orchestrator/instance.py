"""One inference app instance: a process that serves one app from its consumer queue of the pool.

Started by the orchestrator as ``python -m orchestrator.launch`` (which runs :func:`main`) with its :class:`InstanceSpec` as JSON in
``GPUPRIMS_INSTANCE_SPEC`` and the control-plane variables of ``orchestrator.control.instance_env``.
It maps the packet pool, confines itself to its share (CPU cores on the cpu backend; on cuda the
orchestrator set ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` before CUDA initialises), loads its model, and
then loops: take complete requests from its queue, answer those that can no longer meet their deadline
with DEADLINE_MISSED, form a batch as large as the deadline allows (``gpuprims.batching``), gather the
payloads into the batch, run the model, send each response to its client and release the slots.

A *dispatched* instance (``spec.dispatched``, under the node's spatio-temporal or temporal scheduler)
does not batch on its own: it waits for ``RunBatch`` messages, each naming a stage, a batch size and a
GPU%, takes exactly that many requests from the front of the stage's queue (its ring for the entry
stage; for a DAG app's later stages, the requests an earlier stage routed there, which it keeps
holding), runs them and replies ``BatchDone`` with the model time and where the requests went. Its
Ready carries the measured latency of every stage over ``profile_batches``.

A *shadow* instance (``defer_init``) does everything CPU-side first and only loads the model when told
``InitGpu`` with its new GPU% (Overlapped-Execution, paper V-C). ``Finish`` tells an active instance
to drain: it serves what is already queued, reports ``Ended`` and exits.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import numpy as np
import torch

from apps.zoo import load_model
from gpuprims.batching import BatchPolicy
from gpuprims.cpushare import CpuShare, apply_cpu_share, lower_thread_priority, raise_low_threads
from gpuprims.cuda.ipc import export_parameters, share_parameters
from gpuprims.device import warm_up
from gpuprims.gather import Gatherer, ModelRunner, make_gatherer, torch_device
from gpuprims.pool import RECORD_DTYPE, PacketPool
from gpuprims.stats import RequestHistograms, StageClock
from gpuprims.wire import DType, Status
from orchestrator.control import connect_instance_from_env
from orchestrator.launch import die_with_parent
from orchestrator.logs import setup_logging
from orchestrator.messages import (
    BatchDone,
    Ended,
    Error,
    Finish,
    Heartbeat,
    InitGpu,
    Ready,
    RunBatch,
    Shutdown,
    StatsReply,
    StatsRequest,
)
from orchestrator.spec import ENV_SPEC, InstanceSpec

#: After this long without running a batch, a request is served even if the latency model predicts
#: it will miss (see Instance._expire).
PROBE_AFTER_S = 1.0
#: The latency model forgets batch times older than this: a spell of slow batches (a shadow starting
#: beside the instance, a neighbour's burst) stops predicting misses seconds after it ends, instead of
#: after a whole window of new measurements of each size, which at one probe a second took half a
#: minute of DEADLINE_MISSED answers (measured in bench/overlap).
LATENCY_MEMORY_S = 5.0
#: How long closing the control socket may wait for queued messages to leave (bounded if the
#: orchestrator is gone).
LAST_WORDS_MS = 2000
#: How many batches deep (x max_batch) an instance looks for a backlog's early drop.
EARLY_DROP_SCAN = 4
#: The most requests one poll of the ring takes into the local queue.
PULL_MAX = 64

#: InitGpu waits this long for a pre-warm it could raise to normal priority before loading itself.
PREWARM_JOIN_S = 60.0
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


class LatencyStats:
    """Counters and a bounded reservoir of recent latencies for the heartbeat."""

    def __init__(self, slo_ms: float, window: int = 4096) -> None:
        self.slo_ms = slo_ms
        self.latencies_ms: collections.deque[float] = collections.deque(maxlen=window)
        self.model_ms: collections.deque[float] = collections.deque(maxlen=512)
        self.counts: collections.Counter[str] = collections.Counter()
        self.batch_sizes: collections.Counter[int] = collections.Counter()
        self.busy_ms = 0.0  # time spent running the model
        self.hist = RequestHistograms()  # request, queue and compute durations (Prometheus histograms)
        self.stages = StageClock()  # per-batch stage breakdown (gpuprims.stats.STAGES)
        self.started = time.monotonic()
        # The data path's view of a switch (CLOCK_MONOTONIC ns, the same clock in every process):
        # when the first request this instance took had arrived, when it answered first and last, and
        # the model time of that first answered batch.
        self.first_request_ns = 0
        self.first_ok_ns = 0
        self.last_ok_ns = 0
        self.first_model_ms: float | None = None

    def mark_answered(self, model_ms: float) -> None:
        """Note a batch just answered OK (and the model's run time for it)."""
        now = time.monotonic_ns()
        if not self.first_ok_ns:
            self.first_ok_ns = now
            self.first_model_ms = round(model_ms, 3)
        self.last_ok_ns = now

    def snapshot(self, queue_len: int, held: int) -> dict[str, Any]:
        lat = np.asarray(self.latencies_ms, dtype=float)
        elapsed = max(time.monotonic() - self.started, 1e-9)
        ok = self.counts["ok"]
        within = self.counts["within_slo"]
        served = ok + self.counts["deadline_missed"] + self.counts["error"]
        return {
            "received": self.counts["received"],
            "ok": ok,
            "deadline_missed": self.counts["deadline_missed"],
            "early_dropped": self.counts["early_dropped"],  # of deadline_missed: given up on under a backlog
            "errors": self.counts["error"],
            "within_slo": within,
            "slo_attainment": (within / served) if served else None,
            "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
            "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
            "model_p50_ms": float(np.median(self.model_ms)) if self.model_ms else None,
            "arrival_rps": self.counts["received"] / elapsed,
            "service_rps": served / elapsed,
            "queue_len": queue_len,
            "held": held,
            "busy_ms": self.busy_ms,
            "batches": sum(self.batch_sizes.values()),
            "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
            "hist": self.hist.to_wire(),
            "stages": self.stages.snapshot(),
            "first_request_ns": self.first_request_ns,
            "first_ok_ns": self.first_ok_ns,
            "last_ok_ns": self.last_ok_ns,
            "first_model_ms": self.first_model_ms,
            "uptime_s": elapsed,
        }


class Instance:
    """The serving loop of one instance (see the module docstring)."""

    def __init__(self, spec: InstanceSpec, control: Any | None) -> None:
        self.spec = spec
        self.control = control
        self.pool = PacketPool.attach(spec.pool)
        self.consumer = self.pool.consumer(spec.consumer)
        self.policy = BatchPolicy(spec.max_batch, spec.max_wait_ms, spec.slo_ms, margin_ms=0.3)
        self.stats = LatencyStats(spec.slo_ms)
        self.queue: collections.deque[tuple[int, np.ndarray]] = collections.deque()
        self.model: Any = None
        self.device: Any = None
        self.row_bytes = int(np.prod(spec.input_shape)) * (1 if spec.dtype == "uint8" else 4)
        self.wire_dtype = int(DType.UINT8 if spec.dtype == "uint8" else DType.FLOAT32)
        # Wire dtypes a body may name (by code): the app's, or untyped BYTES.
        self._dtype_ok = np.zeros(256, dtype=bool)
        self._dtype_ok[[self.wire_dtype, int(DType.BYTES)]] = True
        self.finishing = False
        self.stopping = False
        self.initialized = False
        self.params_mode = "own"  # own | exported | imported (Param-Share)
        self._last_served = 0.0
        self.exported: Any = None
        self.shared: Any = None
        self._last_beat = 0.0
        # Dispatched mode: requests routed to a later DAG stage, held until a RunBatch for it.
        self.stage_queues: dict[str, collections.deque[tuple[int, np.ndarray]]] = {}
        self.measured: dict[str, dict[str, float]] = {}  # stage -> {batch: ms}, from the warm-up
        self._threads: int | None = None
        self._last_error: str | None = None
        self.gatherer: Gatherer | None = None
        self.runner: ModelRunner | None = None
        # Pre-warm (spec.prewarm): idle -> warming -> warm | failed | abandoned (InitGpu came first).
        self.prewarm_state = "idle"
        self.prewarm_info: dict[str, Any] = {}
        self._prewarmed: dict[str, Any] | None = None
        self._prewarm_lock = threading.Lock()
        self._prewarm_thread: threading.Thread | None = None
        self._warm_announced = False

    # -- start-up ----------------------------------------------------------------------------------
    def init_compute(self, gpu_pct: int) -> None:
        """Apply the share, load the model and warm it up (the GPU-side half of start-up)."""
        self.spec.gpu_pct = gpu_pct
        # cuda:<gpu> on the cuda backend; cpu on the cpu backend and on the fake CUDA runtime.
        self.device = torch_device(self.spec.backend, self.spec.gpu)
        if self.spec.backend == "cuda":
            os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(gpu_pct)
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
        else:
            if self.spec.cores:
                apply_cpu_share(CpuShare(cores=list(self.spec.cores), threads=self.spec.threads or len(self.spec.cores),
                                         gpu_pct=gpu_pct))
        loaded = self._take_prewarmed()
        for key, value in (loaded or self._build_models(self.device)).items():
            setattr(self, key, value)
        # The gather and run seams: GPU-DMA into a preallocated device batch and Sync-lite on cuda
        # (the spec's gather_method may pick the CUDA-Copy baseline); the native host gather on cpu.
        self.gatherer = make_gatherer(self.spec.backend, self.pool, tuple(self.spec.input_shape), self.spec.dtype,
                                      self.spec.max_batch, self.spec.gpu, self.spec.gather_method)
        self.gatherer.clock = self.stats.stages
        self.runner = ModelRunner(self.spec.backend, self.spec.gpu, stream=self.gatherer.stream)
        if self.spec.dispatched:
            self._measure_stages()  # the scheduler's starting profile, needed even without warm-up
        elif self.spec.warmup:
            self._warm_up()
        self.initialized = True

    def _build_models(self, device: Any) -> dict[str, Any]:
        """Load the app's model(s) on ``device``; returns the attributes to set (model, stage_models,
        routes, and the Param-Share ones), so that the pre-warm thread can build them without touching
        the instance."""
        if self.spec.stages:
            stage_models = {
                st["name"]: load_model(st["model"], seed=self.spec.seed, input_shape=tuple(self.spec.input_shape))
                .to(device).eval()
                for st in self.spec.stages}
            routes = {st["name"]: list(st.get("routes") or []) for st in self.spec.stages}
            entry = self.spec.entry or self.spec.stages[0]["name"]
            return {"stage_models": stage_models, "routes": routes, "model": DagModel(stage_models, routes, entry)}
        out: dict[str, Any] = {}
        out["model"] = self._load_single(load_model, device, out)
        return out

    def _load_single(self, load_model: Any, device: Any, out: dict[str, Any]) -> Any:
        """Load the app's model: its own weights, or (Param-Share) the weights another instance exported.

        ``share_params`` is ``export:PATH`` (load, then move the weights into one shared allocation
        and write its handles to PATH) or ``import:PATH`` (build on the meta device, so no weight
        memory is allocated, and map the exported weights; CUDA IPC on a GPU, shared memory on CPU).
        """
        kw = {"seed": self.spec.seed, "num_classes": self.spec.num_classes, "input_shape": tuple(self.spec.input_shape)}
        mode, _, path = (self.spec.share_params or "").partition(":")
        if mode == "import":
            with open(path, "rb") as f:
                handles = f.read()
            model = load_model(self.spec.model, device="meta", **kw)
            shared = share_parameters(handles, model)
            out.update(shared=shared, params_mode="imported")
            return shared.model.eval()
        model = load_model(self.spec.model, **kw).to(device).eval()
        if mode == "export":
            exported = export_parameters(model)
            tmp = f"{path}.{os.getpid()}"
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(exported.to_bytes())
            os.replace(tmp, path)  # importers never see a partial file
            out.update(exported=exported, params_mode="exported")
        return model

    @property
    def entry_stage(self) -> str:
        """The stage whose queue is the ring: the DAG entry, or ``main`` for a one-model app."""
        if self.spec.stages:
            return self.spec.entry or self.spec.stages[0]["name"]
        return "main"

    def _stage_model(self, stage: str) -> Any:
        if self.spec.stages:
            return self.stage_models[stage]
        if stage != "main":
            raise KeyError(stage)
        return self.model

    def _stage_pct(self, stage: str) -> int:
        """The GPU% a stage runs at (the spec's ``stage_pcts``, else the instance's)."""
        return int((self.spec.stage_pcts or {}).get(stage, self.spec.gpu_pct))

    def _measure_stages(self) -> None:
        """Dispatched mode: median latency of every stage over ``profile_batches`` (the scheduler's
        starting profile; it corrects itself from measured latencies later)."""

        batches = sorted(set(self.spec.profile_batches or _default_profile_batches(self.spec.max_batch)))
        stages = [st["name"] for st in self.spec.stages] if self.spec.stages else ["main"]
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
            self._set_threads(self._stage_pct(stage))
            medians = warm_up(self._stage_model(stage), tuple(self.spec.input_shape), batches, self.device,
                              repeats=3, discard=1)
            self.measured[stage] = {str(b): ms for b, ms in medians.items()}

    def _warm_sizes(self) -> list[int]:
        return sorted({1, max(1, self.spec.max_batch // 2), self.spec.max_batch})

    def _warm_up(self) -> None:
        """Run batches of 1, max_batch/2 and max_batch to seed the latency model."""
        sizes = self._warm_sizes()
        run = self.model.run_all if isinstance(self.model, DagModel) else self.model
        for b, ms in warm_up(run, tuple(self.spec.input_shape), sizes, self.device, repeats=1, discard=1).items():
            self.policy.model.observe(b, ms, at_s=time.monotonic())

    # -- shadow pre-warm (cpu backend) ----------------------------------------------------------------
    def start_prewarm(self) -> None:
        """Load and warm the model now, before any InitGpu, in a thread at the lowest priority
        (``lower_thread_priority``: nice 19; its OpenMP workers inherit it), so that the shadow takes
        (almost) no CPU time an active instance wants. The serving (main) thread is never demoted, so nothing
        has to be raised back at InitGpu, which works without CAP_SYS_NICE. When done, the main loop
        sends a second Ready with ``warm: true``; InitGpu then only applies the share and re-times the
        served batch sizes at the new thread count. An InitGpu that comes first abandons the pre-warm
        (a low-priority thread cannot be hurried unprivileged) and loads on the main thread as before."""
        if self.spec.stages or (self.spec.share_params or "").startswith("export:"):
            return  # DAG apps and the weights' exporter load at InitGpu as before
        self.prewarm_state = "warming"
        self._prewarm_thread = threading.Thread(target=self._prewarm_run, name="prewarm", daemon=True)
        self._prewarm_thread.start()

    def _prewarm_run(self) -> None:
        t0 = time.monotonic()
        priority = lower_thread_priority()
        try:
            device = torch.device("cpu")
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
            built = self._build_models(device)
            if self.spec.warmup:  # (a node started with warmup off, as in tests, only loads)
                warm_up(built["model"], tuple(self.spec.input_shape), self._warm_sizes(), device, repeats=1,
                        discard=1)
        except Exception as e:  # the main thread loads at InitGpu instead, and says why
            log.warning("pre-warm failed (%s: %s); the model loads at InitGpu instead", type(e).__name__, e)
            with self._prewarm_lock:
                if self.prewarm_state == "warming":
                    self.prewarm_state = "failed"
                    self.prewarm_info["error"] = f"{type(e).__name__}: {e}"
            return
        with self._prewarm_lock:
            if self.prewarm_state == "warming":
                self._prewarmed = built
                self.prewarm_state = "warm"
                self.prewarm_info.update(priority=priority, prewarm_ms=round((time.monotonic() - t0) * 1e3, 1))

    def _take_prewarmed(self) -> dict[str, Any] | None:
        """The pre-warmed models if the pre-warm finished. If it is still running, its threads are
        raised to normal priority where the system allows it (CAP_SYS_NICE or RLIMIT_NICE) and it is
        waited for; otherwise (unprivileged) it is abandoned (None) and the caller loads as before."""
        if self.prewarm_state == "warming" and self._prewarm_thread is not None:
            raised, refused = raise_low_threads()
            self.prewarm_info["raised"] = raised
            if raised and not refused:
                self._prewarm_thread.join(timeout=PREWARM_JOIN_S)
        with self._prewarm_lock:
            if self.prewarm_state == "warm":
                built, self._prewarmed = self._prewarmed, None
                self.prewarm_state = "used"
                return built
            if self.prewarm_state == "warming":
                self.prewarm_state = "abandoned"
                log.info("InitGpu before the pre-warm finished: loading on the serving thread")
            return None

    def _announce_warm(self) -> None:
        """Main thread: tell the node once that the pre-warm finished (a second Ready)."""
        if self._warm_announced or self.prewarm_state not in ("warm", "failed") or self.control is None:
            return
        self._warm_announced = True
        self.control.send(Ready(instance=self.spec.name, pid=os.getpid(),
                                info={"initialized": False, "warm": self.prewarm_state == "warm",
                                      "prewarm": self.prewarm_state, **self.prewarm_info}))

    # -- serving -----------------------------------------------------------------------------------
    def _pull(self, timeout_ms: float) -> int:
        """Take up to PULL_MAX complete requests into the local queue; returns how many."""
        recs = self.consumer.poll(PULL_MAX, timeout_ms)
        if recs.size:
            if not self.stats.stages.running:
                self.stats.stages.start()  # the next batch's clock starts when its first request is taken
            info = self.pool.requests(recs)
            self.stats.counts["received"] += int(recs.size)
            if not self.stats.first_request_ns:
                self.stats.first_request_ns = int(info["first_ns"].min())
            for r, row in zip(recs.tolist(), info):
                self.queue.append((r, row))
        return int(recs.size)

    def _deadline_ms(self, row: np.ndarray) -> float:
        d = int(row["deadline_us"])
        return d / 1e3 if d else self.spec.slo_ms

    def _expire(self, now_ns: int) -> None:
        """Answer queued requests that cannot meet their deadline any more, oldest first.

        A request past its deadline always expires. One that the latency model predicts will miss
        expires only while that prediction is fresh (a batch ran within ``PROBE_AFTER_S``): otherwise
        one slow measurement could make every later request look hopeless, nothing would run, and
        the model would never learn that the instance is fast again. After that long without serving,
        the next request is let through as a probe. Batch times older than ``LATENCY_MEMORY_S`` are
        forgotten first.
        """
        now_s = time.monotonic()
        self.policy.model.forget(now_s - LATENCY_MEMORY_S)
        predictive = now_s - self._last_served < PROBE_AFTER_S
        expired = []
        while self.queue:
            row = self.queue[0][1]
            age_ms = max(0.0, (now_ns - int(row["first_ns"])) / 1e6)
            deadline_ms = self._deadline_ms(row)
            if age_ms < deadline_ms and not (predictive and self.policy.expired(age_ms, deadline_ms)):
                break
            expired.append(self.queue.popleft())
        if expired:
            self.fail(np.array([r for r, _ in expired], np.uint32),
                      np.array([row for _, row in expired], dtype=RECORD_DTYPE), Status.DEADLINE_MISSED)

    def _early_drop(self, now_ns: int) -> None:
        """Under a backlog, answer DEADLINE_MISSED the head requests whose deadline would hold the
        instance to small batches while a full batch behind them can still be served in time
        (`BatchPolicy.early_drop`). Looks at most ``EARLY_DROP_SCAN`` batches deep."""
        if len(self.queue) <= self.spec.max_batch or not self.policy.model.known:
            return
        row0 = self.queue[0][1]
        if (now_ns - int(row0["first_ns"])) / 1e6 + self.policy.predict(self.spec.max_batch) <= self._deadline_ms(row0):
            return  # a full batch fits the oldest request: no backlog to cut (the common case, kept cheap)
        head = [self.queue[i][1] for i in range(min(len(self.queue), EARLY_DROP_SCAN * self.spec.max_batch))]
        ages = [max(0.0, (now_ns - int(row["first_ns"])) / 1e6) for row in head]
        k = self.policy.early_drop(ages, [self._deadline_ms(row) for row in head])
        if k:
            dropped = [self.queue.popleft() for _ in range(k)]
            self.stats.counts["early_dropped"] += k
            self.fail(np.array([r for r, _ in dropped], np.uint32),
                      np.array([row for _, row in dropped], dtype=RECORD_DTYPE), Status.DEADLINE_MISSED)

    # -- the data path: one seam per step (gather, run, answer) ---------------------------------------------
    def gather(self, items: list[tuple[int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, Any] | None:
        """The seam every serving mode gathers through: ``(records, rows, batch)`` for the requests in
        ``items``, the batch model-ready on the instance's device; requests whose body is not the app's
        input size are answered BAD_REQUEST here. None when nothing is left to run.

        A record stays held until its answer is published to the answer ring, and the ingest is the only
        sender: if this process dies first, the ingest requeues the request or answers it
        INSTANCE_FAILED, so every request is answered exactly once.
        """
        recs = np.array([r for r, _ in items], np.uint32)
        info = np.array([row for _, row in items], dtype=RECORD_DTYPE)
        # The body must be the app's input: its size, and its wire dtype when it names one (a uint8 body of
        # a float32 app's byte size is not a float32 image; untyped BYTES bodies are taken as the app's).
        bad = (info["total_len"] != self.row_bytes) | ~self._dtype_ok[info["dtype"]]
        if bad.any():
            self.fail(recs[bad], info[bad], Status.BAD_REQUEST)
            recs, info = recs[~bad], info[~bad]
        if not recs.size:
            return None
        assert self.gatherer is not None
        x = self.gatherer.gather(recs)  # valid until the next gather
        if self.gatherer.statuses.any():  # the GPU-DMA kernel's verdicts on the records it read
            ok = self.gatherer.statuses == 0
            self.fail(recs[~ok], info[~ok], Status.BAD_REQUEST)
            recs, info, x = recs[ok], info[ok], x[torch.from_numpy(ok).to(x.device)]
            if not recs.size:
                return None
        return recs, info, x

    def run(self, fn: Any, x: Any) -> Any:
        """The seam every serving mode runs a model through: ``fn(x)`` without autograd; on CUDA its
        completion is awaited with Sync-lite (event polling with the GIL released)."""
        assert self.runner is not None
        return self.runner.run(fn, x)

    def fail(self, recs: np.ndarray, info: np.ndarray, status: Status) -> None:
        """Answer requests with an error status (published to the answer ring; the ingest sends it)."""
        if not recs.size:
            return
        self.consumer.answer_status(recs, info, status)
        key = "deadline_missed" if status == Status.DEADLINE_MISSED else "error"
        self.stats.counts[key] += int(recs.size)

    def _timed_run(self, fn: Any, x: Any, what: str, recs: np.ndarray, info: np.ndarray) -> tuple[Any, float] | None:
        """:meth:`run` with its model time; a failing model answers its batch INTERNAL (None is returned)
        and the instance carries on."""
        t0 = time.perf_counter()
        try:
            out = self.run(fn, x)
        except Exception as e:
            log.error("%s failed on a batch of %d: %s", what, recs.size, e)
            self.fail(recs, info, Status.INTERNAL)
            self._last_error = str(e)
            return None
        model_ms = (time.perf_counter() - t0) * 1e3
        self.stats.model_ms.append(model_ms)
        self.stats.busy_ms += model_ms
        self.stats.batch_sizes[int(recs.size)] += 1
        return out, model_ms

    @staticmethod
    def _groups(out: Any, n: int) -> list[tuple[np.ndarray, Any]]:
        """A model's output as ``[(rows, output)]``: DagModel returns groups already."""
        return out if isinstance(out, list) else [(np.arange(n), out)]

    def _serve_batch(self, take: int) -> None:
        clock = self.stats.stages
        if not clock.running:
            clock.start()
        clock.lap("wait")
        gathered = self.gather([self.queue.popleft() for _ in range(take)])
        if gathered is None:
            clock.cancel()
            return
        recs, info, x = gathered
        clock.lap("gather")  # the seam's own bookkeeping (the host gatherer laps its copy itself)
        done = self._timed_run(self.model, x, "model", recs, info)
        if done is None:
            clock.cancel()
            return
        clock.lap("model")
        out, model_ms = done
        self.policy.model.observe(recs.size, model_ms, at_s=time.monotonic())
        if isinstance(out, list):  # a DAG app's groups of rows
            for rows, group in out:
                self._answer(recs[rows], info[rows], group.float().cpu().numpy().reshape(len(rows), -1),
                             compute_s=model_ms / 1e3)
        else:  # one model: the whole batch, without copying its records into groups
            self._answer(recs, info, out.float().cpu().numpy().reshape(recs.size, -1), compute_s=model_ms / 1e3)
        self.stats.mark_answered(model_ms)
        clock.lap("respond")
        self._clock_ingest(info)
        clock.end()
        if self.queue:
            clock.start()  # requests left in the local queue: the next batch's wait starts now

    def _clock_ingest(self, info: np.ndarray) -> None:
        """The ingest-side stages of the batch's oldest request: reassembly (first datagram to complete)
        and delivery (complete to taken off the ring by this instance)."""
        oldest = info[int(np.argmin(info["first_ns"]))]
        first, complete = int(oldest["first_ns"]), int(oldest["complete_ns"])
        if complete >= first > 0:
            self.stats.stages.observe("reassembly", complete - first)
            self.stats.stages.observe("delivery", self.stats.stages.start_ns - complete)

    def step(self, max_wait_ms: float = 50.0) -> None:
        """One iteration: pull, expire, decide, maybe serve."""
        now = time.monotonic_ns()
        pulled = 0
        if self.queue:
            oldest_age = max(0.0, (now - int(self.queue[0][1]["first_ns"])) / 1e6)
            decision = self.policy.decide(len(self.queue), oldest_age)
            if decision.take == 0:
                pulled = self._pull(min(max_wait_ms, max(0.0, decision.wait_ms)))
        else:
            pulled = self._pull(max_wait_ms)
        if not self.queue:
            return
        if pulled in (0, PULL_MAX):  # a pull that just returned took all there was (unless it was full)
            self._pull(0)
        self._expire(time.monotonic_ns())  # after the pull: a request just taken has age >= 0
        if not self.queue:
            self.stats.stages.cancel()  # all of it expired: no batch runs, the next one's clock starts afresh
            return
        self._early_drop(time.monotonic_ns())
        oldest_age = max(0.0, (time.monotonic_ns() - int(self.queue[0][1]["first_ns"])) / 1e6)
        decision = self.policy.decide(len(self.queue), oldest_age)
        if decision.take:
            self._serve_batch(min(decision.take, len(self.queue)))
            self._last_served = time.monotonic()

    def drain(self) -> int:
        """Serve everything already queued for this instance (its ring and local queue). Returns count."""
        served_before = self.stats.counts["ok"] + self.stats.counts["deadline_missed"] + self.stats.counts["error"]
        idle_since = time.monotonic()
        # New requests are already routed elsewhere; requests completing reassembly just before the
        # switch can still land here for a moment, so wait for a short quiet period.
        while time.monotonic() - idle_since < 0.05:
            self._pull(5)
            if self.queue:
                self._expire(time.monotonic_ns())
                while self.queue:
                    self._serve_batch(min(len(self.queue), self.spec.max_batch))
                idle_since = time.monotonic()
        self._drain_stages()
        return self.stats.counts["ok"] + self.stats.counts["deadline_missed"] + self.stats.counts["error"] - served_before

    # -- dispatched mode ----------------------------------------------------------------------------
    def _take_from_ring(self, n: int, timeout_s: float = 0.2) -> list[tuple[int, np.ndarray]]:
        """Exactly ``n`` requests from the ring (the scheduler saw them there), waiting briefly."""
        got: list[tuple[int, np.ndarray]] = []
        end = time.monotonic() + timeout_s
        while len(got) < n:
            recs = self.consumer.poll(n - len(got), max(0.0, (end - time.monotonic()) * 1e3))
            if recs.size:
                got += zip(recs.tolist(), self.pool.requests(recs))
            elif time.monotonic() >= end:
                log.warning("RunBatch asked for %d request(s) but only %d were queued", n, len(got))
                break
        self.stats.counts["received"] += len(got)
        return got

    def _set_threads(self, gpu_pct: int) -> None:
        """CPU backend: run a stage with the threads its GPU% stands for, within the instance's cores."""
        if self.device is None or self.device.type != "cpu":
            return
        cores = len(self.spec.cores) if self.spec.cores else (os.cpu_count() or 1)
        n = max(1, min(cores, round((os.cpu_count() or 1) * gpu_pct / 100)))
        if n != self._threads:
            torch.set_num_threads(n)
            self._threads = n

    def run_batch(self, msg: RunBatch) -> BatchDone:
        """Serve one RunBatch (see the module docstring) and return its BatchDone."""
        stage = msg.stage
        if stage == self.entry_stage:
            items = self._take_from_ring(msg.batch)
        else:
            q = self.stage_queues.get(stage)
            if q is None:
                try:
                    self._stage_model(stage)
                except KeyError:
                    return BatchDone(instance=self.spec.name, id=msg.id, taken=0, measured_ms=0.0,
                                     error=f"unknown stage {stage!r}")
                q = self.stage_queues.setdefault(stage, collections.deque())
            items = [q.popleft() for _ in range(min(msg.batch, len(q)))]
        taken = len(items)
        if not items:
            return BatchDone(instance=self.spec.name, id=msg.id, taken=0, measured_ms=0.0)
        if msg.action == "reject":
            self.fail(np.array([r for r, _ in items], np.uint32), np.array([row for _, row in items],
                                                                            dtype=RECORD_DTYPE), Status.DEADLINE_MISSED)
            return BatchDone(instance=self.spec.name, id=msg.id, taken=taken, measured_ms=0.0)
        by_rec = dict(items)
        gathered = self.gather(items)
        if gathered is None:
            return BatchDone(instance=self.spec.name, id=msg.id, taken=taken, measured_ms=0.0)
        recs, info, x = gathered
        n = recs.size
        self._set_threads(msg.gpu_pct)
        targets = (self.routes.get(stage) or []) if self.spec.stages else []
        self._last_error = None
        done = self._timed_run(self._stage_model(stage), x, f"stage {stage}", recs, info)
        if done is None:
            return BatchDone(instance=self.spec.name, id=msg.id, taken=taken, measured_ms=0.0,
                             error=self._last_error)
        out, model_ms = done
        cls = out.argmax(dim=1).cpu().numpy() if targets else None
        logits = out.float().cpu().numpy().reshape(n, -1)
        routed: dict[str, list[float]] = {}
        finished = np.ones(n, dtype=bool)
        if cls is not None:
            for i, target in enumerate(targets):
                sel = np.flatnonzero(cls == i)
                if not sel.size:
                    continue
                finished[sel] = False
                q = self.stage_queues.setdefault(target, collections.deque())
                for k in sel.tolist():
                    q.append((int(recs[k]), by_rec[int(recs[k])]))
                routed[target] = [self._abs_deadline_ms(info[k]) for k in sel.tolist()]
        if finished.any():
            self._answer(recs[finished], info[finished], logits[finished], compute_s=model_ms / 1e3)
        return BatchDone(instance=self.spec.name, id=msg.id, taken=taken, measured_ms=model_ms, routed=routed)

    def _abs_deadline_ms(self, row: np.ndarray) -> float:
        """A request's deadline in ms on CLOCK_MONOTONIC (the clock the scheduler plans on)."""
        return int(row["first_ns"]) / 1e6 + self._deadline_ms(row)

    def _answer(self, recs: np.ndarray, info: np.ndarray, logits: np.ndarray, compute_s: float = 0.0) -> None:
        """The seam every serving mode answers through: OK with the results, published in one store each
        to the answer ring (the ingest sends them)."""
        try:
            self.consumer.answer(recs, info, Status.OK, logits)
        except ValueError as e:  # a result row larger than the answer ring takes: a config problem
            log.error("%s: cannot answer %d requests: %s", self.spec.name, recs.size, e)
            self.fail(recs, info, Status.INTERNAL)
            return
        done_ns = time.monotonic_ns()
        self.stats.hist.observe_answered(info["first_ns"], compute_s=compute_s, done_ns=done_ns)
        lat_ms = (done_ns - info["first_ns"].astype(np.int64)) / 1e6
        deadlines = np.where(info["deadline_us"] > 0, info["deadline_us"] / 1e3, self.spec.slo_ms)
        self.stats.latencies_ms.extend(lat_ms.tolist())
        self.stats.counts["ok"] += int(recs.size)
        self.stats.counts["within_slo"] += int((lat_ms <= deadlines).sum())

    def _drain_stages(self) -> None:
        """Serve what earlier stages routed to later ones and no RunBatch took (drain, shutdown)."""
        for _ in range(len(self.stage_queues) + 1):
            pending = [(st, q) for st, q in self.stage_queues.items() if q]
            if not pending:
                return
            for stage, q in pending:
                while q:
                    gathered = self.gather([q.popleft() for _ in range(min(len(q), self.spec.max_batch))])
                    if gathered is None:
                        continue
                    recs, info, x = gathered
                    dag = DagModel(self.stage_models, self.routes, stage)
                    done = self._timed_run(dag, x, f"stage {stage} (draining)", recs, info)
                    if done is None:
                        continue
                    for rows, group in self._groups(done[0], recs.size):
                        self._answer(recs[rows], info[rows], group.float().cpu().numpy().reshape(len(rows), -1),
                                     compute_s=done[1] / 1e3)

    def heartbeat(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.control is None or (not force and (now - self._last_beat) * 1e3 < self.spec.heartbeat_ms):
            return

        self._last_beat = now
        held = len(self.queue) + sum(len(q) for q in self.stage_queues.values())
        snap = self.stats.snapshot(self.consumer.depth() + held, held)
        snap.update(gpu_pct=self.spec.gpu_pct, initialized=self.initialized, finishing=self.finishing,
                    params=self.params_mode, mps_pct=os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"))
        with contextlib.suppress(Exception):
            self.control.send(Heartbeat(instance=self.spec.name, stats=snap))

    def handle(self, msg: Any) -> None:
        if isinstance(msg, InitGpu):
            if "cores" in msg.settings:
                self.spec.cores = [int(c) for c in msg.settings["cores"]]
                self.spec.threads = int(msg.settings.get("threads") or len(self.spec.cores))
            self.init_compute(msg.gpu_pct)
            self.control.send(Ready(instance=self.spec.name, pid=os.getpid(),
                                    info={"initialized": True, "gpu_pct": msg.gpu_pct, "measured": self.measured,
                                          "prewarm": self.prewarm_state}))
        elif isinstance(msg, Finish):
            self.finishing = True
            drained = self.drain()
            self.heartbeat(force=True)
            self.control.send(Ended(instance=self.spec.name, drained_count=drained))
            self.stopping = True
        elif isinstance(msg, Shutdown):
            if msg.drain and self.initialized:
                drained = self.drain()
                self.heartbeat(force=True)
                self.control.send(Ended(instance=self.spec.name, drained_count=drained))
            self.stopping = True
        elif isinstance(msg, RunBatch):
            self.control.send(self.run_batch(msg))
        elif isinstance(msg, StatsRequest):
            snap = self.stats.snapshot(self.consumer.depth() + len(self.queue), len(self.queue))
            self.control.send(StatsReply(instance=self.spec.name, stats=snap))
        else:
            log.warning("ignoring unexpected control message %s", type(msg).__name__)

    def serve(self) -> None:
        """Serve until told to stop or the parent dies."""
        parent = os.getppid()
        while not self.stopping:
            if os.getppid() != parent:
                log.error("orchestrator died; exiting")
                return
            if self.control is not None:
                msg = self.control.poll(0)
                if msg is not None:
                    self.handle(msg)
                    continue
            if self.initialized and self.spec.dispatched:
                msg = self.control.poll(min(100.0, self.spec.heartbeat_ms)) if self.control is not None else None
                if msg is not None:
                    self.handle(msg)
                self.heartbeat()
            elif self.initialized:
                self.step()
                self.heartbeat()
            else:
                self._announce_warm()
                msg = self.control.poll(20 if self.prewarm_state == "warming" else 100) \
                    if self.control is not None else None
                if msg is not None:
                    self.handle(msg)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
        if self.gatherer is not None:
            self.gatherer.close()  # before the pool it registered goes
        self.pool.close()


def _default_profile_batches(max_batch: int) -> list[int]:
    """Powers of two up to ``max_batch``, and ``max_batch`` itself."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return [*out, max_batch]


def main(import_info: dict[str, Any] | None = None) -> int:
    """Run one instance (spec from the environment) until told to stop. ``import_info``: how
    ``orchestrator.launch`` imported this module (at a lowered nice value), reported in Ready."""
    die_with_parent()
    spec = InstanceSpec.from_json(os.environ[ENV_SPEC])
    setup_logging(os.environ.get("GPUPRIMS_LOG_LEVEL", "INFO"), os.environ.get("GPUPRIMS_LOG_FORMAT", "text"),
                  instance=spec.name)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # A terminal's Ctrl-C reaches the whole process group: stopping is the orchestrator's to decide
    # (it drains this instance), so the instance does not die of it with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Its last words (Error, Ended) get up to LAST_WORDS_MS to leave before the process exits.
    control = connect_instance_from_env(linger_ms=LAST_WORDS_MS)
    inst = None
    rc = 1
    try:
        inst = Instance(spec, control)
        if not spec.defer_init:
            inst.init_compute(spec.gpu_pct)
        elif spec.prewarm:
            inst.start_prewarm()
        info: dict[str, Any] = {"initialized": inst.initialized, "gpu_pct": spec.gpu_pct, "consumer": spec.consumer,
                                "measured": inst.measured}
        if import_info is not None:
            info["import"] = inst.prewarm_info["import"] = import_info  # (the warm Ready says it again)
        control.send(Ready(instance=spec.name, pid=os.getpid(), info=info))
        inst.serve()
        rc = 0
    except Exception as e:
        if isinstance(e, ValueError):  # a bad model or spec: its message says it all
            log.error("instance %s failed: %s", spec.name, e)
        else:
            log.exception("instance %s failed", spec.name)
        with contextlib.suppress(Exception):
            control.send(Error(instance=spec.name, kind=type(e).__name__, message=str(e)))
    finally:
        if inst is not None:
            inst.close()
        control.close()
        if inst is not None and inst._prewarm_thread is not None and inst._prewarm_thread.is_alive():
            # A pre-warm still running (a low-priority thread inside torch) cannot be stopped, and
            # the interpreter's exit would tear torch down under it (std::terminate): leave now.
            logging.shutdown()
            os._exit(rc)
    return rc

if __name__ == "__main__":
    sys.exit(main())
