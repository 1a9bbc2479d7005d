"""One inference app instance: the process that serves one app from its consumer queue of the pool.

Started by the orchestrator as ``python -m orchestrator.worker.launch`` (which runs :func:`main`) with its
:class:`InstanceSpec` as JSON in ``GPUPRIMS_INSTANCE_SPEC`` and the control-plane variables of
``orchestrator.control.channel.instance_env``. Three objects, one role each (as vLLM v1 splits WorkerProc,
gpu_worker and gpu_model_runner):

- :class:`Instance` (this module) is the process: the control connection, signals, Ready, the
  heartbeat, the messages of the serve loop, and a shadow's pre-warm thread.
- :class:`orchestrator.worker.zoo_runner.AppRunner` is the model: it takes the share (CPU cores on the cpu
  backend; on cuda the orchestrator set ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` before CUDA
  initialises), builds the model(s), warms them up and measures them.
- a serving loop (:mod:`orchestrator.worker.loops`, one class per serving mode, picked from the spec)
  serves the queue: take complete requests from the queue, answer those that can no longer meet their
  deadline with DEADLINE_MISSED, form a batch as large as the deadline allows (``gpuprims.batching``),
  gather the payloads into the batch, run the model, answer each request and release the slots.

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

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from gpuprims.batching import BatchPolicy
from gpuprims.cpushare import lower_thread_priority, raise_low_threads
from gpuprims.gather import Gatherer
from gpuprims.pool import PacketPool
from orchestrator.control.channel import connect_instance_from_env
from orchestrator.control.logs import setup_logging
from orchestrator.control.memory import instance_device_bytes
from orchestrator.control.messages import (
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
from orchestrator.control.records import InstanceStats
from orchestrator.control.spec import ENV_SPEC, InstanceSpec
from orchestrator.worker.file_runner import FileRunner
from orchestrator.worker.launch import die_with_parent
from orchestrator.worker.loops import ServingLoop, serving_loop
from orchestrator.worker.loops.base import LATENCY_MEMORY_S, PROBE_AFTER_S
from orchestrator.worker.loops.stats import LatencyStats

if TYPE_CHECKING:
    from orchestrator.worker.zoo_runner import AppRunner

__all__ = ["LATENCY_MEMORY_S", "PROBE_AFTER_S", "Instance", "InstanceSpec", "LatencyStats", "main"]

#: How long closing the control socket may wait for queued messages to leave (bounded if the
#: orchestrator is gone).
LAST_WORDS_MS = 2000
#: A due heartbeat may wait this fraction of ``heartbeat_ms`` for the serving loop to be idle.
HEARTBEAT_SLACK = 0.5
#: InitGpu waits this long for a pre-warm it could raise to normal priority before loading itself.
PREWARM_JOIN_S = 60.0
log = logging.getLogger("gpuprims.instance")


class Instance:
    """The instance process (see the module docstring): its control connection, the messages it
    handles, the heartbeat and the shadow's pre-warm thread. It owns a model runner
    (:class:`orchestrator.worker.zoo_runner.AppRunner`: the device and the model) and a serving loop
    (:class:`orchestrator.worker.loops.ServingLoop` of its serving mode: the queue and the data path's seams)."""

    def __init__(self, spec: InstanceSpec, control: Any | None) -> None:
        self.spec = spec
        self.control = control
        self.pool = PacketPool.attach(spec.pool)
        self.runner: AppRunner | FileRunner
        if spec.serves_file:
            self.runner = FileRunner(spec)
        else:
            # A zoo model's runner imports torch and the zoo: only an instance that serves one pays for
            # them, so a model file's instance (and its fork server) maps no torch.
            from orchestrator.worker.zoo_runner import AppRunner

            self.runner = AppRunner(spec)
        self.serving: ServingLoop = serving_loop(spec, self.pool, self.runner)  # adaptive, dispatched or a file's
        self.finishing = False
        self.stopping = False
        self.initialized = False
        self._last_beat = 0.0
        # Pre-warm (spec.prewarm): idle -> warming -> warm | failed | abandoned (InitGpu came first).
        self.prewarm_state = "idle"
        self.prewarm_info: dict[str, Any] = {}
        self._prewarmed: dict[str, Any] | None = None
        self._prewarm_lock = threading.Lock()
        self._prewarm_thread: threading.Thread | None = None
        self._warm_announced = False

    # -- the serving loop's and the runner's state, as the tests and bench/stage_cost reach it ---------
    @property
    def consumer(self) -> Any:
        return self.serving.consumer

    @property
    def policy(self) -> BatchPolicy:
        return self.serving.policy

    @property
    def stats(self) -> LatencyStats:
        return self.serving.stats

    @property
    def queue(self) -> Any:
        return self.serving.queue

    @property
    def gatherer(self) -> Gatherer | None:
        return self.serving.gatherer

    @property
    def measured(self) -> dict[str, dict[str, float]]:
        return self.runner.measured

    def step(self, max_wait_ms: float = 50.0) -> None:
        """One iteration of the serving loop (:meth:`AdaptiveLoop.step`)."""
        self.serving.step(max_wait_ms)

    def drain(self) -> int:
        return self.serving.drain()

    def _pull(self, timeout_ms: float) -> int:
        return self.serving._pull(timeout_ms)

    def _expire(self, now_ns: int) -> None:
        self.serving._expire(now_ns)

    def _early_drop(self, now_ns: int) -> None:
        self.serving._early_drop(now_ns)

    # -- start-up ----------------------------------------------------------------------------------
    def init_compute(self, gpu_pct: int) -> None:
        """Apply the share, load the model and warm it up (the GPU-side half of start-up)."""
        self.runner.init_device(gpu_pct)
        loaded = self._take_prewarmed()
        self.runner.install(loaded or self._build_models(self.runner.device))
        self.serving.attach(self.runner.open_seams(self.pool))
        if isinstance(self.runner, FileRunner):
            self.runner.model_warmup()  # config.pbtxt's model_warmup samples, before the model serves
        if self.spec.dispatched:
            self.runner.measure_stages()  # the scheduler's starting profile, needed even without warm-up
        elif self.spec.warmup:
            self.runner.warm_up(self.serving.policy.model)
        self.initialized = True

    def _build_models(self, device: Any) -> dict[str, Any]:
        """The runner's :meth:`AppRunner.build` (the pre-warm thread calls it too)."""
        return self.runner.build(device)

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
            if self.spec.serves_file:
                built = self._build_models("cpu")
                if self.spec.warmup:
                    self.runner.warm(built)
            else:
                built = self._prewarm_zoo()
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
                self.prewarm_info.update(priority=priority, prewarm_ms=round((time.monotonic() - t0) * 1e3, 1))
                if isinstance(built.get("engines"), dict):  # what the pre-warm built (or found in the cache)
                    self.prewarm_info["engine_prewarm"] = {k: e.describe() for k, e in built["engines"].items()}
                self.prewarm_state = "warm"  # last: the main thread's _announce_warm reads the record after it

    def _prewarm_zoo(self) -> dict[str, Any]:
        """Build (and warm, unless the node runs with warmup off, as in tests) the zoo model on the CPU."""
        import torch  # a zoo model's instance only (see __init__)

        from gpuprims.device import warm_up
        from orchestrator.worker.zoo_runner import warm_sizes

        device = torch.device("cpu")
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
        built = self._build_models(device)
        if self.spec.warmup:
            warm_up(built["model"], tuple(self.spec.input_shape), warm_sizes(self.spec.max_batch), device, repeats=1,
                    discard=1)
        return built

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
        if self._warm_announced or self.control is None:
            return
        with self._prewarm_lock:  # the pre-warm thread writes the record and the state under it
            state, record = self.prewarm_state, dict(self.prewarm_info)
        if state not in ("warm", "failed"):
            return
        self._warm_announced = True
        self.control.send(Ready(instance=self.spec.name, pid=os.getpid(),
                                info={"initialized": False, "warm": state == "warm", "prewarm": state, **record}))


    def heartbeat(self, force: bool = False) -> None:
        """Send the statistics, once every ``heartbeat_ms`` (``force``: now).

        The snapshot is taken on the serving thread (a thread of its own would contend for the GIL the
        serving thread needs the moment a request arrives, for up to the interpreter's 5 ms switch
        interval), so a due heartbeat waits for a moment with nothing to serve, up to half a period
        (HEARTBEAT_SLACK): at light and medium load no request waits behind it.
        """
        now = time.monotonic()
        if self.control is None:
            return
        since_ms = (now - self._last_beat) * 1e3
        if not force and (since_ms < self.spec.heartbeat_ms or (
                since_ms < self.spec.heartbeat_ms * (1 + HEARTBEAT_SLACK) and self.serving.busy())):
            return

        self._last_beat = now
        stats = InstanceStats(**self.serving.snapshot(), gpu_pct=self.spec.gpu_pct, initialized=self.initialized,
                              finishing=self.finishing, params=self.runner.params_mode,
                              engine=self.runner.describe(),
                              mps_pct=os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
                              device_bytes=instance_device_bytes(self.spec.backend))
        with contextlib.suppress(Exception):
            self.control.send(Heartbeat(instance=self.spec.name, stats=stats))

    def handle(self, msg: Any) -> None:
        if isinstance(msg, InitGpu):
            if "cores" in msg.settings:
                self.spec.cores = [int(c) for c in msg.settings["cores"]]
                self.spec.threads = int(msg.settings.get("threads") or len(self.spec.cores))
            self.init_compute(msg.gpu_pct)
            self.control.send(Ready(instance=self.spec.name, pid=os.getpid(),
                                    info={"initialized": True, "gpu_pct": msg.gpu_pct, "measured": self.measured,
                                          "prewarm": self.prewarm_state, "engine": self.runner.describe()}))
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
            self.control.send(self.serving.run_batch(msg))
        elif isinstance(msg, StatsRequest):
            snap = self.stats.snapshot(self.consumer.depth() + len(self.queue), len(self.queue))
            self.control.send(StatsReply(instance=self.spec.name, stats=InstanceStats(**snap)))
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
        self.runner.close()
        self.serving.close()  # the gatherer, before the pool it registered goes
        self.runner.close_stream()  # after the gatherer that ran on it
        self.pool.close()


def main(import_info: dict[str, Any] | None = None) -> int:
    """Run one instance (spec from the environment) until told to stop. ``import_info``: how
    ``orchestrator.worker.launch`` imported this module (at a lowered nice value), reported in Ready."""
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
                                "measured": inst.measured, "engine": inst.runner.describe()}
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
