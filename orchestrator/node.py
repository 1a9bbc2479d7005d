"""The node: packet pool, native ingest, inference instances as processes, and their supervision.

``Node(cfg).start()`` is all-or-nothing: it creates the private run directory, the shared packet
pool and the ingest, spawns every instance (``python -m apps.instance``) and waits for each READY
within ``ready_timeout_s`` (the error names that setting); if any fails, everything started is torn
down and the error says which instance failed and why. ``serve()`` then runs the control loop until
``stop()``: it receives heartbeats (the statistics ``status`` reports), answers CLI commands, and
restarts an instance that dies — the requests it held are answered INSTANCE_FAILED (or handed to a
live instance of the same app) by the ingest, and counted. ``stop()`` drains: routes are removed, each
instance serves what it already holds and reports ``Ended``; stragglers get SIGTERM then SIGKILL; the
ingest, the pool (its shared memory is unlinked) and the run directory go last.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apps.instance import ENV_SPEC, InstanceSpec
from gpuprims.backend import resolve_backend
from gpuprims.ingest import Ingest
from gpuprims.pool import PacketPool
from orchestrator.config import AppConfig, NodeConfig
from orchestrator.control import (
    ControlServer,
    control_address,
    instance_env,
    make_run_dir,
    new_token,
    open_server,
    write_token,
)
from orchestrator.messages import (
    BatchDone,
    Ended,
    Error,
    Heartbeat,
    Ready,
    Result,
    SetGpuRequest,
    Shutdown,
    StatusReply,
    StatusRequest,
    StopRequest,
)

log = logging.getLogger("gpuprims.node")

RATE_WINDOW_S = 5.0  # status rates are over about this many seconds of heartbeats
CURRENT_LINK = "current"  # runtime_base()/current -> the run dir of the last node started


class StartError(RuntimeError):
    """The node could not start; nothing it started is left running."""


@dataclass
class InstanceState:
    """What the node knows about one instance process."""

    name: str
    app: str
    spec: InstanceSpec
    proc: subprocess.Popen[bytes]
    role: str = "active"  # active | shadow | finishing | stopping
    ready: bool = False
    initialized: bool = False
    stats: dict[str, Any] = field(default_factory=dict)
    last_beat: float = 0.0
    started: float = field(default_factory=time.monotonic)
    ended: bool = False
    error: str | None = None
    history: list[tuple[float, float, float]] = field(default_factory=list)  # (t, received, served)
    info: dict[str, Any] = field(default_factory=dict)  # what its Ready said

    @property
    def pid(self) -> int:
        return self.proc.pid


@dataclass
class AppState:
    """Per-app bookkeeping: its config, shares and lifetime counters across restarts."""

    cfg: AppConfig
    gpu_pct: int
    instances: int
    restarts: int = 0
    failed_by_crash: int = 0
    requeued_by_crash: int = 0
    retired: dict[str, int] = field(default_factory=dict)  # counters of instances that are gone


class Node:
    """One gpuprims node (see the module docstring)."""

    def __init__(self, cfg: NodeConfig, *, ready_timeout_s: float = 180.0, stop_timeout_s: float = 15.0,
                 python: str = sys.executable, control_kind: str = "zmq", heartbeat_ms: float = 500.0,
                 warmup: bool = True, monitor: Any = None, share_params: bool = True) -> None:
        if ready_timeout_s <= 0 or stop_timeout_s <= 0:
            raise ValueError("ready_timeout_s and stop_timeout_s must be positive")
        self.cfg = cfg
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.python = python
        self.control_kind = control_kind
        self.heartbeat_ms = heartbeat_ms
        self.warmup = warmup
        self.backend = "cpu"
        self.run_dir: Path | None = None
        self._own_run_dir = False
        self.pool: PacketPool | None = None
        self.ingest: Ingest | None = None
        self.server: ControlServer | None = None
        self.metrics: Any = None
        self.mps: Any = None  # orchestrator.mps.MpsDaemon on the cuda backend
        self.token = new_token()
        self.apps: dict[str, AppState] = {}
        self.instances: dict[str, InstanceState] = {}
        self._free_consumers: list[int] = []
        self._seq = itertools.count()
        self._stop = threading.Event()
        self._stop_drain = True
        self.started_at = 0.0
        self.events: list[dict[str, Any]] = []
        self.changing: set[str] = set()
        self.monitor = monitor  # orchestrator.monitor.Monitor: automatic GPU% changes when set
        self.share_params = share_params  # Param-Share between instances of the same model
        self._profiles: dict[str, Any] | None = None
        if monitor is not None and monitor.needed_pct is None:
            monitor.needed_pct = self.needed_pct
        self._exports: dict[str, dict[str, Any]] = {}
        self._next_sample = 0.0
        self._lock = threading.RLock()
        self.dispatcher: Any = None  # orchestrator.dispatch.LiveScheduler under a live scheduler

    # -- start ---------------------------------------------------------------------------------------
    def start(self) -> Node:
        """Start everything or nothing (see the module docstring)."""
        try:
            self._start()
        except BaseException:
            self._teardown(drain=False)
            raise
        return self

    def _start(self) -> None:
        node = self.cfg.node
        self.backend = resolve_backend(node.backend)
        why = "CUDA device found" if self.backend == "cuda" else "no CUDA device with a driver" \
            if node.backend == "auto" else "requested"
        log.info("backend: %s (%s)", self.backend, why)
        self._own_run_dir = node.run_dir is None
        self.run_dir = make_run_dir(node.run_dir)
        write_token(self.run_dir, self.token)
        self._link_current()
        if self.backend == "cuda":
            from orchestrator.mps import MpsDaemon, MpsUnavailable

            self.mps = MpsDaemon(self.run_dir, mode=node.mps)
            try:
                self.mps.ensure()
            except MpsUnavailable as e:
                raise StartError(f"node.mps is 'require' but MPS cannot be used: {e}") from e

        for app in self.cfg.apps:
            n = app.instances if isinstance(app.instances, int) else 1
            self.apps[app.name] = AppState(cfg=app, gpu_pct=0, instances=n)
        if self.scheduled:
            self._check_scheduled()
        else:
            self._size_auto_apps()
        self._assign_pcts()
        total = sum(a.instances for a in self.apps.values())
        # Room for a shadow per app and restarts, so a consumer index is never reused while a dead
        # instance's requests are being reclaimed.
        consumers = min(1024, 2 * total + len(self.apps) + 4)
        p = node.pool
        self.pool = PacketPool.create(slot_count=p.slot_count, max_payload=p.max_payload, record_count=p.record_count,
                                      max_chunks=p.max_chunks, consumer_count=consumers)
        self._free_consumers = list(range(consumers - 1, -1, -1))
        listen: list[tuple[str, int] | tuple[str, int, int]] = [(node.listen.host, port) for port in node.listen.ports]
        listen += [(node.listen.host, a.port, a.app_id) for a in self.cfg.apps if a.port]
        self.ingest = Ingest(self.pool, listen, timeout_ms=node.reassembly_timeout_ms).start()
        self.server = open_server(control_address(self.control_kind, self.run_dir), self.token)
        if node.metrics_enabled:
            from orchestrator.metrics import MetricsServer

            self.metrics = MetricsServer(node.metrics_port)
            self.metrics.start()

        shares = self._plan_shares()
        # Param-Share: the first instance of each model exports its weights; the others start once
        # the export exists and map it instead of loading their own copy.
        later: list[tuple[AppConfig, str]] = []
        for app in self.cfg.apps:
            for i in range(self.apps[app.name].instances):
                key = self._param_key(app)
                if key is not None and key in self._exports:
                    later.append((app, f"{app.name}-{i}"))
                else:
                    self._spawn(app, f"{app.name}-{i}", shares.get(f"{app.name}-{i}"))
        self._await_ready(list(self.instances.values()))
        if later:
            self._await_ready([self._spawn(app, name, shares.get(name)) for app, name in later])
        if self.scheduled:
            self._start_dispatcher()
        for app in self.cfg.apps:
            self._update_route(app.name)
            if app.shadow and not self.scheduled:
                self.spawn_shadow(app.name)
        self.started_at = time.monotonic()
        log.info("node up: %d app(s), %d instance(s), listening on %s:%s, run dir %s", len(self.apps),
                 len(self.instances), node.listen.host, ",".join(map(str, self.ingest.ports)), self.run_dir)

    @property
    def scheduled(self) -> bool:
        """True when a live scheduler (``node.scheduler`` spatiotemporal or temporal) drives the instances."""
        return self.cfg.node.scheduler != "spatial"

    def _check_scheduled(self) -> None:
        """A live scheduler runs one dispatched instance per app and owns the shares."""
        many = [a.cfg.name for a in self.apps.values() if isinstance(a.cfg.instances, int) and a.cfg.instances > 1]
        if many:
            raise StartError(f"node.scheduler {self.cfg.node.scheduler!r} runs one instance per app (the scheduler "
                             f"batches and times its runs); set instances: 1 for {', '.join(many)}")
        if self.monitor is not None:
            log.info("autoscale is off under node.scheduler %r: the scheduler owns the shares",
                     self.cfg.node.scheduler)
            self.monitor = None

    def _stage_pcts(self, name: str) -> dict[str, int]:
        from orchestrator.dispatch import stage_pcts

        a = self.apps[name]
        return stage_pcts(a.cfg, a.gpu_pct, self.cfg.node.scheduler)

    def _start_dispatcher(self) -> None:
        """Build the live scheduler from the instances' measured warm-up (or node.profiles) and bind them."""
        from apps.zoo.registry import canonical_name
        from orchestrator.dispatch import LiveScheduler, measured_profile, rename_profile, stage_names

        assert self.pool is not None and self.server is not None
        files = self._load_profiles()
        profiles: dict[str, Any] = {}
        pcts: dict[str, dict[str, int]] = {}
        bound: list[tuple[str, InstanceState]] = []
        for name, a in self.apps.items():
            pcts[name] = self._stage_pcts(name)
            st = next(s for s in self.instances.values() if s.app == name and s.role == "active")
            bound.append((name, st))
            models = {s.name: s.model for s in a.cfg.stages} if a.cfg.stages else {"main": a.cfg.model or ""}
            for stage in stage_names(a.cfg):
                key = f"{name}.{stage}"
                try:
                    prof = files.get(canonical_name(models[stage]))
                except ValueError:
                    prof = files.get(models[stage])
                pct = pcts[name][stage]
                if (prof is not None and tuple(prof.conditions.input_shape) == tuple(a.cfg.input_shape)
                        and prof.gpu_pcts[0] <= pct <= prof.gpu_pcts[-1]):
                    profiles[key] = rename_profile(prof, key)
                    continue
                measured = (st.info.get("measured") or {}).get(stage)
                if not measured:
                    raise StartError(f"{st.name} reported no warm-up latencies for stage {stage!r}; the live "
                                     "scheduler needs them (or a matching profile in node.profiles)")
                profiles[key] = measured_profile(key, measured, pct, backend=self.backend,
                                                 input_shape=tuple(a.cfg.input_shape), dtype=a.cfg.dtype,
                                                 note=f"warm-up of {st.name} at {pct}%")
        try:
            self.dispatcher = LiveScheduler(self.cfg.node.scheduler, list(self.cfg.apps), pcts, profiles, self.pool,
                                            self.server.send, round_ms=self.cfg.node.round_ms)
        except ValueError as e:
            raise StartError(f"node.scheduler {self.cfg.node.scheduler!r}: {e}") from e
        for name, st in bound:
            self.dispatcher.bind(name, st.name, st.spec.consumer)
        log.info("live %s scheduler: %d app(s), %d ms rounds", self.cfg.node.scheduler, len(bound),
                 self.cfg.node.round_ms)

    def _size_auto_apps(self) -> None:
        """Multi-Model: apps with ``instances: auto`` get the instance count (and, with ``gpu_pct: auto``,
        the share each) that ``multi_model`` finds best within their SLO on their model's profile."""
        autos = [a for a in self.apps.values() if a.cfg.instances == "auto" and not a.cfg.is_dag]
        if not autos:
            return
        profiles = self._load_profiles()
        fixed = sum(a.cfg.gpu_pct * a.instances for a in self.apps.values()
                    if isinstance(a.cfg.gpu_pct, int) and a.cfg.instances != "auto")
        available = max(1, (100 - fixed) // len(autos))
        from apps.zoo.registry import canonical_name
        from gpuprims.sched import multi_model

        for a in autos:
            prof = profiles.get(canonical_name(a.cfg.model or ""))
            if prof is None:
                log.warning("%s: instances is auto but there is no profile of %s in node.profiles; running 1 "
                            "instance (make one with gpuprims-profile)", a.cfg.name, a.cfg.model)
                continue
            budget = a.cfg.gpu_pct if isinstance(a.cfg.gpu_pct, int) else available
            batch = max(b for b in prof.batch_sizes if b <= a.cfg.max_batch) if min(prof.batch_sizes) <= \
                a.cfg.max_batch else min(prof.batch_sizes)
            n, pct = multi_model(prof, budget, a.cfg.slo_ms, batch_size=batch)
            if n < 1:
                log.warning("%s: no instance count meets %.0f ms at %d%% by its profile; running 1",
                            a.cfg.name, a.cfg.slo_ms, budget)
                continue
            a.instances = n
            if not isinstance(a.cfg.gpu_pct, int):
                a.gpu_pct = pct
            log.info("%s: Multi-Model sizing from its profile: %d instance(s) x %d%% (budget %d%%, SLO %.0f ms)",
                     a.cfg.name, n, pct, budget, a.cfg.slo_ms)

    def _load_profiles(self) -> dict[str, Any]:
        d = self.cfg.node.profiles
        if not d:
            return {}
        from apps.zoo.registry import canonical_name
        from gpuprims.profile import ProfileError, load_profile

        out = {}
        for path in sorted(Path(d).glob("*.json")):
            try:
                prof = load_profile(path)
            except ProfileError as e:
                raise StartError(f"node.profiles: {e}") from e
            try:
                out[canonical_name(prof.model)] = prof
            except ValueError:
                out[prof.model] = prof
        return out

    def _assign_pcts(self) -> None:
        """Every app's GPU% per instance: as configured; a DAG app the sum of its stages' shares;
        what Multi-Model sized; the rest of ``auto`` apps split what is left evenly."""
        for a in self.apps.values():
            if a.gpu_pct:
                continue  # sized by Multi-Model
            if isinstance(a.cfg.gpu_pct, int):
                a.gpu_pct = a.cfg.gpu_pct
            elif a.cfg.is_dag and a.cfg.fixed_pct_per_instance():
                # A DAG app runs its stages in one process, with the sum of their shares.
                a.gpu_pct = min(100, a.cfg.fixed_pct_per_instance())
        taken = sum(a.gpu_pct * a.instances for a in self.apps.values() if a.gpu_pct)
        autos = [a for a in self.apps.values() if not a.gpu_pct]
        auto_instances = sum(a.instances for a in autos)
        each = max(1, (100 - taken) // auto_instances) if auto_instances else 0
        for a in autos:
            a.gpu_pct = each
        total = sum(a.gpu_pct * a.instances for a in self.apps.values())
        if total > 100 and not self.cfg.node.allow_oversubscribe and not self.scheduled:
            raise StartError(f"the apps' shares add up to {total}% (> 100) after sizing; set "
                             "node.allow_oversubscribe or lower gpu_pct")

    def _plan_shares(self) -> dict[str, Any]:
        if self.backend != "cpu":
            return {}
        from gpuprims.cpushare import plan_cpu_shares

        reqs = [(f"{name}-{i}", self._instance_pct(name)) for name, a in self.apps.items() for i in range(a.instances)]
        # Under a live scheduler the shares may add up to more than 100: it keeps what runs at once within 100.
        return plan_cpu_shares(reqs, allow_oversubscribe=self.cfg.node.allow_oversubscribe or self.scheduled)

    def _instance_pct(self, name: str) -> int:
        """The share an instance of ``name`` is started with: the app's, or under a live scheduler the
        largest of its stages' (a dispatched instance runs one stage at a time)."""
        if not self.scheduled:
            return self.apps[name].gpu_pct
        return max(self._stage_pcts(name).values())

    def _link_current(self) -> None:
        assert self.run_dir is not None
        link = self.run_dir.parent / CURRENT_LINK
        with contextlib.suppress(OSError):
            tmp = self.run_dir.parent / f".{CURRENT_LINK}.{os.getpid()}"
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            tmp.symlink_to(self.run_dir)
            tmp.replace(link)

    def _param_key(self, app: AppConfig) -> str | None:
        """Instances with the same key have identical weights and share one copy (Param-Share)."""
        if not self.share_params or app.is_dag or not app.model:
            return None
        return f"{app.model}|{app.seed}|{app.num_classes}|{'x'.join(map(str, app.input_shape))}"

    def _share_mode(self, app: AppConfig, name: str) -> str | None:
        key = self._param_key(app)
        if key is None:
            return None
        assert self.run_dir is not None
        exp = self._exports.get(key)
        if exp is None:
            path = self.run_dir / f"params-{len(self._exports)}.bin"
            self._exports[key] = {"path": path, "exporter": name}
            return f"export:{path}"
        return f"import:{exp['path']}"

    def _spawn(self, app: AppConfig, name: str, share: Any, *, defer_init: bool = False,
               gpu_pct: int | None = None) -> InstanceState:
        assert self.pool is not None and self.server is not None and self.run_dir is not None
        if not self._free_consumers:
            raise RuntimeError("no free consumer endpoint in the packet pool")
        consumer = self._free_consumers.pop()
        pct = gpu_pct if gpu_pct is not None else self._instance_pct(app.name)
        spec = InstanceSpec(
            name=name, app=app.name, app_id=app.app_id, model=app.model or "", pool=self.pool.name, consumer=consumer,
            input_shape=tuple(app.input_shape), dtype=app.dtype, seed=app.seed, num_classes=app.num_classes,
            slo_ms=app.slo_ms, max_batch=app.max_batch, max_wait_ms=app.max_wait_ms, gpu_pct=pct,
            backend=self.backend, gpu=self.cfg.gpu_of(app) if self.backend == "cuda" else 0,
            cores=list(share.cores) if share is not None else None,
            threads=share.threads if share is not None else None, defer_init=defer_init,
            heartbeat_ms=self.heartbeat_ms, chunk_payload=self.cfg.node.pool.max_payload, warmup=self.warmup,
            stages=[{"name": st.name, "model": st.model, "routes": list(st.routes)} for st in app.stages]
            if app.stages else None,
            entry=app.entry_stages()[0] if app.stages else None,
            share_params=self._share_mode(app, name),
            dispatched=self.scheduled,
            measure_lock=str(self.run_dir / "measure.lock") if self.scheduled else None,
            stage_pcts=self._stage_pcts(app.name) if self.scheduled else None,
        )
        env = dict(os.environ)
        env.update(instance_env(self.server.address, name, self.token))
        env[ENV_SPEC] = spec.to_json()
        env["GPUPRIMS_LOG_LEVEL"] = self.cfg.node.log_level
        env["GPUPRIMS_LOG_FORMAT"] = self.cfg.node.log_format
        if share is not None:
            env.update(share.env())
        if self.backend == "cuda" and self.mps is not None:
            env.update(self.mps.env(pct))
            if defer_init:
                # A shadow sets its own percentage when told InitGpu, before CUDA initialises.
                env.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)
        proc = subprocess.Popen([self.python, "-m", "apps.instance"], env=env, stdin=subprocess.DEVNULL,
                                cwd=str(Path(__file__).resolve().parent.parent))
        st = InstanceState(name=name, app=app.name, spec=spec, proc=proc, role="shadow" if defer_init else "active")
        self.instances[name] = st
        log.info("spawned %s (pid %d, consumer %d, %d%%)", name, proc.pid, consumer, pct)
        return st

    def spawn_shadow(self, app_name: str) -> InstanceState:
        """Start a shadow of the app: CPU side initialised, model loaded only on InitGpu."""
        app = self.apps[app_name].cfg
        return self._spawn(app, f"{app_name}-s{next(self._seq)}", None, defer_init=True)

    def shadow_of(self, app_name: str) -> InstanceState | None:
        """A live shadow of the app (ready or still starting), if there is one."""
        for st in self.instances.values():
            if st.app == app_name and st.role == "shadow" and st.error is None:
                return st
        return None

    def _await_ready(self, pending: list[InstanceState]) -> None:
        assert self.server is not None
        waiting = {st.name for st in pending}
        deadline = time.monotonic() + self.ready_timeout_s
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StartError(f"instance(s) {', '.join(sorted(waiting))} sent no READY within "
                                 f"{self.ready_timeout_s:.0f} s; raise ready_timeout_s (--ready-timeout) if the "
                                 "models need longer to load")
            item = self.server.poll(min(left, 0.2) * 1000)
            if item is not None:
                msg = item.msg
                if isinstance(msg, Ready) and msg.instance in waiting:
                    st = self.instances[msg.instance]
                    st.ready, st.initialized = True, bool(msg.info.get("initialized"))
                    st.last_beat, st.info = time.monotonic(), dict(msg.info)
                    waiting.discard(msg.instance)
                elif isinstance(msg, Error) and msg.instance in waiting:
                    raise StartError(f"instance {msg.instance} failed to start: {msg.kind}: {msg.message}")
                else:
                    self._handle(item)
            for name in list(waiting):
                rc = self.instances[name].proc.poll()
                if rc is not None:
                    raise StartError(f"instance {name} exited with status {rc} before READY (see its log above)")

    # -- routing ---------------------------------------------------------------------------------------
    def _update_route(self, app_name: str) -> None:
        assert self.ingest is not None
        app = self.apps[app_name].cfg
        consumers = [st.spec.consumer for st in self.instances.values()
                     if st.app == app_name and st.role == "active" and not st.ended]
        self.ingest.set_route(app.app_id, consumers)

    # -- running ---------------------------------------------------------------------------------------
    def serve(self, *, duration_s: float | None = None) -> None:
        """Run the control loop until stop() is called (or a stop command / signal arrives)."""
        end = None if duration_s is None else time.monotonic() + duration_s
        while not self._stop.is_set() and (end is None or time.monotonic() < end):
            self.step(100)
        if self._stop.is_set():
            self._teardown(drain=self._stop_drain)

    def step(self, timeout_ms: float = 100.0) -> None:
        """One iteration of the control loop: messages, crashed instances, metrics."""
        assert self.server is not None
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            wait_ms = max(0.0, deadline - time.monotonic()) * 1000
            if self.dispatcher is not None:
                wait_ms = min(wait_ms, self.dispatcher.wait_ms())
            item = self.server.poll(wait_ms)
            if item is not None:
                self._handle(item)
            if self.dispatcher is not None:
                self.dispatcher.tick()
            if time.monotonic() >= deadline or (item is None and self.dispatcher is None):
                break
        self._check_processes()
        if self.monitor is not None and time.monotonic() >= self._next_sample and not self.changing:
            self._next_sample = time.monotonic() + self.monitor.policy.interval_s
            self._autoscale()
        if self.metrics is not None:
            self.metrics.update(self.status())

    def needed_pct(self, app_name: str, arrival_rps: float) -> int | None:
        """The smallest GPU% at which the app's instances serve ``arrival_rps`` (with 20% headroom)
        within its SLO, by its model's profile; None without a profile."""
        a = self.apps.get(app_name)
        if a is None or not a.cfg.model:
            return None
        if self._profiles is None:
            self._profiles = self._load_profiles()
        from apps.zoo.registry import canonical_name

        try:
            prof = self._profiles.get(canonical_name(a.cfg.model))
        except ValueError:
            return None
        if prof is None:
            return None
        for pct in sorted(prof.gpu_pcts):
            for b in sorted(prof.batch_sizes):
                if b > a.cfg.max_batch:
                    break
                ms = prof.latency_ms(b, pct, stat="p99")
                if ms <= a.cfg.slo_ms and a.instances * b * 1000.0 / ms >= 1.2 * arrival_rps:
                    return int(pct)
        return None

    def _autoscale(self) -> None:
        for d in self.monitor.sample(time.monotonic(), self.status()):
            log.info("monitor: %s %s -> change %d%% to %d%% (%s)", d.app, d.verdict, d.from_pct, d.to_pct, d.reason)
            ok, text = self.set_gpu(d.app, d.to_pct)
            self.events.append({"t": d.t, "event": "decision", "app": d.app, "verdict": d.verdict,
                                "reason": d.reason, "from_pct": d.from_pct, "to_pct": d.to_pct, "ok": ok,
                                "result": text})
            if not ok:
                log.warning("monitor: change of %s failed: %s", d.app, text)

    def request_stop(self, drain: bool = True) -> None:
        """Ask serve() to stop (safe from signal handlers and other threads)."""
        self._stop_drain = drain
        self._stop.set()

    def _handle(self, item: Any) -> None:
        msg = item.msg
        if isinstance(msg, Heartbeat):
            st = self.instances.get(msg.instance)
            if st is not None:
                now = time.monotonic()
                stats = dict(msg.stats)
                # Rates over the last few seconds of heartbeats rather than since the process started.
                st.history.append((now, float(stats.get("received") or 0),
                                   float((stats.get("ok") or 0) + (stats.get("deadline_missed") or 0)
                                         + (stats.get("errors") or 0))))
                while len(st.history) > 2 and now - st.history[1][0] >= RATE_WINDOW_S:
                    st.history.pop(0)
                (t0, r0, s0), (t1, r1, s1) = st.history[0], st.history[-1]
                if t1 - t0 > 0.2:
                    stats["arrival_rps"], stats["service_rps"] = (r1 - r0) / (t1 - t0), (s1 - s0) / (t1 - t0)
                st.stats, st.last_beat = stats, now
        elif isinstance(msg, Ready):
            st = self.instances.get(msg.instance)
            if st is not None:
                st.ready, st.initialized, st.last_beat = True, bool(msg.info.get("initialized")), time.monotonic()
                st.info = dict(msg.info)
                if st.role == "active":
                    self._update_route(st.app)
                    if self.dispatcher is not None:
                        self.dispatcher.bind(st.app, st.name, st.spec.consumer)
                log.info("%s ready (pid %d)", msg.instance, msg.pid)
        elif isinstance(msg, BatchDone):
            if self.dispatcher is not None and msg.instance in self.instances:
                self.dispatcher.on_done(msg)
        elif isinstance(msg, Ended):
            st = self.instances.get(msg.instance)
            if st is not None:
                st.ended = True
                log.info("%s ended after draining %d request(s)", msg.instance, msg.drained_count)
        elif isinstance(msg, Error):
            st = self.instances.get(msg.instance)
            if st is not None:
                st.error = f"{msg.kind}: {msg.message}"
            log.error("instance %s reported %s: %s", msg.instance, msg.kind, msg.message)
        elif isinstance(msg, StatusRequest):
            self.server.reply(item, StatusReply(status=self.status()))  # type: ignore[union-attr]
        elif isinstance(msg, StopRequest):
            self.server.reply(item, Result(ok=True, message="stopping"))  # type: ignore[union-attr]
            self.request_stop(drain=msg.drain)
        elif isinstance(msg, SetGpuRequest):
            ok, text = self.set_gpu(msg.app, msg.gpu_pct)
            self.server.reply(item, Result(ok=ok, message=text))  # type: ignore[union-attr]

    def set_gpu(self, app: str, gpu_pct: int) -> tuple[bool, str]:
        """Change an app's GPU% (Overlapped-Execution). Returns (ok, message)."""
        from orchestrator.reconfig import change_gpu_pct

        if self.scheduled:
            return False, (f"node.scheduler is {self.cfg.node.scheduler!r}: the scheduler decides when and at what "
                           "GPU% each app runs; change gpu_pct in apps.yaml instead")
        return change_gpu_pct(self, app, gpu_pct)

    def _check_processes(self) -> None:
        for st in list(self.instances.values()):
            rc = st.proc.poll()
            if rc is None:
                continue
            del self.instances[st.name]
            if st.ended or st.role == "stopping":
                self._retire(st)
                self._release_consumer(st)
            elif st.role == "finishing":
                # Died while draining during a switch: what it held goes to the new active.
                self._retire(st)
                failed, requeued = self.ingest.reclaim(st.spec.consumer, requeue=True)  # type: ignore[union-attr]
                app = self.apps[st.app]
                app.failed_by_crash += failed
                app.requeued_by_crash += requeued
                self._free_consumers.insert(0, st.spec.consumer)
                log.error("%s died while draining (status %s): %d requeued, %d answered INSTANCE_FAILED",
                          st.name, rc, requeued, failed)
                self.events.append({"t": time.monotonic(), "event": "died_draining", "instance": st.name,
                                    "failed": failed, "requeued": requeued})
            elif st.role == "shadow":
                self._release_consumer(st)
                st.error = st.error or f"exited with status {rc}"
                log.error("shadow %s exited (status %s)", st.name, rc)
                self.events.append({"t": time.monotonic(), "event": "shadow_died", "instance": st.name, "rc": rc})
            else:
                self._on_crash(st, rc)

    def _retire(self, st: InstanceState) -> None:
        app = self.apps[st.app]
        for k in ("received", "ok", "deadline_missed", "errors", "within_slo", "busy_ms"):
            app.retired[k] = app.retired.get(k, 0) + int(st.stats.get(k) or 0)

    def _release_consumer(self, st: InstanceState) -> None:
        assert self.ingest is not None
        # Whatever it still held (nothing after a clean drain) is answered or requeued.
        self.ingest.reclaim(st.spec.consumer, requeue=True)
        self._free_consumers.insert(0, st.spec.consumer)

    def _on_crash(self, st: InstanceState, rc: int) -> None:
        assert self.ingest is not None
        app = self.apps[st.app]
        self._retire(st)
        if self.dispatcher is not None:
            self.dispatcher.instance_lost(st.name)
        failed, requeued = self.ingest.reclaim(st.spec.consumer, requeue=True)
        app.failed_by_crash += failed
        app.requeued_by_crash += requeued
        app.restarts += 1
        self._free_consumers.insert(0, st.spec.consumer)
        key = self._param_key(app.cfg)
        if self.backend == "cuda" and key is not None and self._exports.get(key, {}).get("exporter") == st.name:
            # CUDA IPC memory dies with its exporter: forget the export (the replacement exports
            # anew) and restart the importers rather than let them read freed device memory.
            exp = self._exports.pop(key)
            with contextlib.suppress(OSError):
                Path(exp["path"]).unlink()
            for other in self.instances.values():
                if other.spec.share_params == f"import:{exp['path']}":
                    log.error("restarting %s: the weights it imported were exported by %s, which died",
                              other.name, st.name)
                    other.proc.kill()
        why = f"signal {-rc}" if rc < 0 else f"status {rc}"
        log.error("instance %s (pid %d) died (%s): %d held request(s) answered INSTANCE_FAILED, %d requeued; "
                  "restarting", st.name, st.pid, why, failed, requeued)
        self.events.append({"t": time.monotonic(), "event": "crash", "instance": st.name, "rc": rc,
                            "failed": failed, "requeued": requeued})
        share = None
        if self.backend == "cpu" and st.spec.cores:
            from gpuprims.cpushare import CpuShare

            share = CpuShare(cores=list(st.spec.cores), threads=st.spec.threads or 1, gpu_pct=st.spec.gpu_pct)
        name = f"{st.app}-r{next(self._seq)}"
        # Queue new requests for the replacement right away: they wait in its ring while it loads
        # (and are answered DEADLINE_MISSED if that takes too long) instead of being dropped.
        new = self._spawn(app.cfg, name, share, gpu_pct=st.spec.gpu_pct)
        self._update_route(st.app)
        del new

    # -- status ---------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """A JSON-able snapshot: node, ingest counters and drops, and per app and instance statistics."""
        counters = self.ingest.counters() if self.ingest is not None else {}
        apps: dict[str, Any] = {}
        for name, a in self.apps.items():
            insts = []
            totals = dict(a.retired)
            for st in self.instances.values():
                if st.app != name:
                    continue
                s = st.stats
                insts.append({"name": st.name, "pid": st.pid, "role": st.role, "ready": st.ready,
                              "gpu_pct": st.spec.gpu_pct, "consumer": st.spec.consumer,
                              "cores": st.spec.cores, **s})
                for k in ("received", "ok", "deadline_missed", "errors", "within_slo"):
                    totals[k] = totals.get(k, 0) + int(s.get(k) or 0)
            served = totals.get("ok", 0) + totals.get("deadline_missed", 0) + totals.get("errors", 0)
            live = [i for i in insts if i.get("role") == "active" and i.get("p50_ms") is not None]
            weight = sum(max(1, int(i.get("ok") or 0)) for i in live)
            # App-level latency from the instances' recent windows: p50 weighted by what each served,
            # p99 the worst instance's (an upper bound of the app's p99).
            totals["p50_ms"] = (sum(i["p50_ms"] * max(1, int(i.get("ok") or 0)) for i in live) / weight
                                if live else None)
            totals["p99_ms"] = max((i["p99_ms"] for i in live if i.get("p99_ms") is not None), default=None)
            totals["arrival_rps"] = sum(float(i.get("arrival_rps") or 0) for i in insts)
            totals["service_rps"] = sum(float(i.get("service_rps") or 0) for i in insts)
            apps[name] = {
                "app_id": a.cfg.app_id, "model": a.cfg.model, "slo_ms": a.cfg.slo_ms, "gpu_pct": a.gpu_pct,
                "instances": insts, "restarts": a.restarts, "failed_by_crash": a.failed_by_crash,
                "requeued_by_crash": a.requeued_by_crash, **totals,
                "slo_attainment": (totals.get("within_slo", 0) / served) if served else None,
            }
        return {
            "node": {"backend": self.backend, "pid": os.getpid(), "run_dir": str(self.run_dir),
                     "mps": None if self.mps is None else {"active": self.mps.active, "started": self.mps.started,
                                                           "reason": self.mps.reason},
                     "ports": self.ingest.ports if self.ingest else [],
                     "uptime_s": time.monotonic() - self.started_at if self.started_at else 0.0},
            "ingest": counters,
            "drops": {k[5:]: v for k, v in counters.items() if k.startswith("drop_") and v},
            "apps": apps,
            "decisions": [e for e in self.events if e["event"] == "decision"][-20:],
            "scheduler": self.dispatcher.status() if self.dispatcher is not None else {"name": "spatial"},
        }

    # -- stop -----------------------------------------------------------------------------------------
    def stop(self, drain: bool = True) -> None:
        """Stop the node: drain instances (when ``drain``), then remove everything it created."""
        self._teardown(drain=drain)

    def _teardown(self, drain: bool) -> None:
        with self._lock:
            if self.ingest is not None:
                for a in self.apps.values():
                    with contextlib.suppress(Exception):
                        self.ingest.set_route(a.cfg.app_id, [])
            if self.server is not None:
                for st in self.instances.values():
                    st.role = "stopping"
                    with contextlib.suppress(Exception):
                        self.server.send(st.name, Shutdown(instance=st.name, drain=drain and st.initialized))
            deadline = time.monotonic() + (self.stop_timeout_s if drain else 2.0)
            while time.monotonic() < deadline and any(st.proc.poll() is None for st in self.instances.values()):
                if self.server is not None:
                    item = self.server.poll(50)
                    if item is not None and isinstance(item.msg, (Heartbeat, Ended)):
                        self._handle(item)
                else:
                    time.sleep(0.05)
            for st in self.instances.values():
                if st.proc.poll() is None:
                    log.warning("%s did not exit in time; terminating", st.name)
                    st.proc.terminate()
            for st in self.instances.values():
                try:
                    st.proc.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    log.warning("%s ignored SIGTERM; killing", st.name)
                    st.proc.kill()
                    st.proc.wait()
            for st in list(self.instances.values()):
                self._retire(st)
            self.instances.clear()
            if self.metrics is not None:
                with contextlib.suppress(Exception):
                    self.metrics.stop()
                self.metrics = None
            if self.mps is not None:
                self.mps.stop()
                self.mps = None
            if self.ingest is not None:
                self.ingest.stop()
            if self.server is not None:
                self.server.close()
                self.server = None
            if self.pool is not None:
                self.pool.close()
                self.pool = None
            self._remove_exports()
            if self.run_dir is not None:
                link = self.run_dir.parent / CURRENT_LINK
                with contextlib.suppress(OSError):
                    if link.is_symlink() and Path(os.readlink(link)) == self.run_dir:
                        link.unlink()
                if self._own_run_dir:
                    shutil.rmtree(self.run_dir, ignore_errors=True)
                else:
                    for leftover in ("token", "control.sock", "command.sock", "measure.lock"):
                        with contextlib.suppress(OSError):
                            (self.run_dir / leftover).unlink()

    def _remove_exports(self) -> None:
        """Remove the shared-memory objects of exported weights (CPU). Every instance is gone by now."""
        from gpuprims.cuda.ipc import ParameterHandles

        for exp in self._exports.values():
            path = Path(exp["path"])
            with contextlib.suppress(OSError, ValueError):
                h = ParameterHandles.from_bytes(path.read_bytes())
                if h.backend == "cpu":
                    os.unlink("/dev/shm/" + h.handle.decode())
            with contextlib.suppress(OSError):
                path.unlink()
        self._exports.clear()

    def __enter__(self) -> Node:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(drain=True)


def install_signal_handlers(node: Node) -> None:
    """SIGINT/SIGTERM ask the node to stop gracefully (drain)."""

    def _handler(signum: int, _frame: Any) -> None:
        log.info("received %s; stopping", signal.Signals(signum).name)
        node.request_stop(drain=True)

    signal.signal(signal.SIGINT, _handler)
    signal.signal(signal.SIGTERM, _handler)
