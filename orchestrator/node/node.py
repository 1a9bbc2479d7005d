"""The node: packet pool, native ingest, and the parts that run the inference instances.

``Node(cfg).start()`` is all-or-nothing: it creates the private run directory, the shared packet pool
and the ingest, spawns every instance (``python -m orchestrator.worker.launch``) and waits for each READY
within ``ready_timeout_s`` (the error names that setting); if any fails, everything started is torn
down and the error says which instance failed and why. ``serve()`` then runs the node's one loop
until ``stop()``; each :meth:`Node.step` receives heartbeats and commands, lets the supervisor reap,
replace and refill instances, advances the running changes of share, samples the monitor, and updates
the metrics. ``stop()`` drains: routes are removed, each instance serves what it already holds and
reports ``Ended``; stragglers get SIGTERM then SIGKILL; the ingest, the pool (its shared memory is
unlinked) and the run directory go last.

The node composes its parts and owns the loop; each part has one role:

- :class:`~orchestrator.node.placement.Placement`: sizing (Multi-Model), shares, CPU core sets;
- :class:`~orchestrator.node.supervisor.Supervisor`: processes, routes, crashes, hangs, shadows;
- :class:`~orchestrator.node.param_share.ParamShare`: who exported which weights;
- :class:`~orchestrator.node.reconfig.Changes`: changes of share as objects the loop advances;
- ``orchestrator.node.dispatch.LiveScheduler`` under ``node.scheduler`` spatiotemporal/temporal.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gpuprims.backend import resolve_backend
from gpuprims.cpushare import CpuShare, available_cores, pin_own_threads
from gpuprims.ingest import Ingest
from gpuprims.pool import PacketPool
from orchestrator.config.schema import AppConfig, NodeConfig, engine_problems
from orchestrator.control.channel import (
    ControlServer,
    Incoming,
    control_address,
    make_run_dir,
    new_token,
    open_server,
    write_token,
)
from orchestrator.control.errors import ChangeError, StartError, SupervisionError
from orchestrator.control.messages import (
    BatchDone,
    Ended,
    Error,
    Heartbeat,
    Ready,
    Result,
    SetGpuRequest,
    StatusReply,
    StatusRequest,
    StopRequest,
)
from orchestrator.control.records import InstanceStats, NodeView
from orchestrator.control.rundir import NodeRecord, RunDirBusy, claim, sweep_dead_segments, update_record
from orchestrator.frontdoor import FrontDoor, FrontDoorError, start_frontdoor
from orchestrator.frontdoor.core import Unavailable
from orchestrator.frontdoor.security import ServerTls, TlsError, load_tls
from orchestrator.node.cpu_overflow import NodeOverflow, OverflowSetupError
from orchestrator.node.dispatch import (
    LiveScheduler,
    core_groups,
    measured_profile,
    rename_profile,
    stage_names,
)
from orchestrator.node.launcher import ForkLauncher, Launcher
from orchestrator.node.metrics import MetricsServer
from orchestrator.node.mps import MpsDaemon, MpsUnavailable
from orchestrator.node.param_share import ParamShare
from orchestrator.node.placement import Placement, model_key
from orchestrator.node.reconfig import Change, Changes
from orchestrator.node.repository import (
    PollAction,
    Repository,
    RepositoryPoller,
    repository_model_of,
)
from orchestrator.node.state import AppState, InstanceState, InstanceTable, Role
from orchestrator.node.supervisor import Supervisor
from orchestrator.node.view import node_status, node_view

__all__ = ["AppState", "InstanceState", "Node", "StartError", "install_signal_handlers"]

log = logging.getLogger("gpuprims.node")

CURRENT_LINK = "current"  # runtime_base()/current -> the run dir of the last node started
EVENTS_KEPT = 1000
#: Pool consumer endpoints kept for apps loaded at run time (each takes instances, a shadow, replacements).
REPOSITORY_CONSUMERS = 32


def read_repository_token(rc: Any) -> str | None:
    """The repository API's bearer token from ``node.repository`` (token_file or token_env), or None when
    none is configured; StartError when the configured source is missing, unreadable or empty."""
    if not rc.has_token:
        log.warning("node.repository is on without a token: anyone who reaches the loopback front door can load "
                    "apps (and user code) into this node")
    return read_bearer_token(rc, "node.repository")


def read_bearer_token(src: Any, key: str) -> str | None:
    """The bearer token of the TokenSource ``src`` (the setting ``key``: its token_file or token_env), or None
    when it names none; StartError when the named source is missing, unreadable, empty or too short."""
    if src.token_file is not None:
        try:
            token = Path(src.token_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise StartError(f"{key}.token_file {src.token_file!r} cannot be read: {e.strerror or e}") from None
        where = f"{key}.token_file {src.token_file!r}"
    elif src.token_env is not None:
        token = os.environ.get(src.token_env, "").strip()
        where = f"{key}.token_env: the environment variable {src.token_env}"
    else:
        return None
    if len(token) < 16:
        raise StartError(f"{where} holds {'no' if not token else 'a too short'} token; use at least 16 "
                         "characters (e.g. python -c 'import secrets; print(secrets.token_urlsafe())')")
    return token


class Node:
    """One gpuprims node (see the module docstring)."""

    def __init__(self, cfg: NodeConfig, *, ready_timeout_s: float = 180.0, stop_timeout_s: float = 15.0,
                 python: str = sys.executable, control_kind: str = "zmq", heartbeat_ms: float = 500.0,
                 warmup: bool = True, monitor: Any = None, share_params: bool = True,
                 launcher: Launcher | None = None) -> None:
        if ready_timeout_s <= 0 or stop_timeout_s <= 0:
            raise ValueError("ready_timeout_s and stop_timeout_s must be positive")
        self.cfg = cfg
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.python = python
        # How instances are started: python -m orchestrator.worker.launch, or a test's double.
        self.launcher: Launcher = launcher if launcher is not None else ForkLauncher(python)
        self.control_kind = control_kind
        self.heartbeat_ms = heartbeat_ms
        self.warmup = warmup
        self.backend = "cpu"
        self.run_dir: Path | None = None
        self._own_run_dir = False
        self.pool: PacketPool | None = None
        self.ingest: Ingest | None = None
        self.server: ControlServer | None = None
        self.metrics: MetricsServer | None = None
        self.mps: MpsDaemon | None = None
        self.token = new_token()
        self.apps: dict[str, AppState] = {}
        self.instances: InstanceTable = InstanceTable()
        self.placement = Placement(cfg, self.apps, backend=self.backend)
        self.params: ParamShare | None = None
        self.supervisor: Supervisor | None = None
        self.changes = Changes(self, self._check_change, timeout_s=cfg.node.change_timeout_s)
        self._stop = threading.Event()
        self._stop_drain = True
        self._stopped = False
        self.started_at = 0.0
        self.events: list[dict[str, Any]] = []
        self.errors: dict[str, int] = {}  # loop errors by where they happened (each logged)
        self.monitor = monitor  # orchestrator.node.monitor.Monitor: automatic GPU% changes when set
        self.share_params = share_params  # Param-Share between instances of the same model
        if monitor is not None and monitor.needed_pct is None:
            monitor.needed_pct = self.placement.needed_pct
        self._next_sample = 0.0
        self._lock = threading.RLock()
        self.dispatcher: LiveScheduler | None = None
        self.frontdoor: FrontDoor | None = None  # Open Inference Protocol over HTTP/gRPC (node.http_port/grpc_port)
        self.overflow: NodeOverflow | None = None  # CPU overflow of apps with `overflow: cpu` (issue 18)
        self.repository: Repository | None = None  # load/unload at run time (node.repository; docs/oip.md)
        self.poller: RepositoryPoller | None = None  # model_control_mode poll: the repository read again
        #: Models of node.model_repository that cannot be served (the front door's index lists them).
        self.unavailable: list[Unavailable] = [Unavailable(u.name, u.version, u.reason) for u in cfg.unavailable]
        self._poll_ops: dict[str, tuple[PollAction, concurrent.futures.Future[dict[str, Any]]]] = {}
        self.repository_token: str | None = None
        self.tls: ServerTls | None = None  # node.tls, read at start
        self.inference_token: str | None = None  # node.auth's, read at start
        self.last_errors: dict[str, str] = {}  # instance -> the last Error it reported
        self.own_cores: list[int] | None = None  # where this process's threads are kept (None: anywhere)
        self._pin_wish: tuple[int, ...] | None = None

    @property
    def changing(self) -> set[str]:
        """Apps with a change of share running (no second one may start)."""
        return self.changes.changing

    @property
    def scheduled(self) -> bool:
        """True when a live scheduler (``node.scheduler`` spatiotemporal or temporal) drives the instances."""
        return self.placement.scheduled

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
        # isolated: the probe runs in a child, so the orchestrator itself never holds a CUDA context.
        self.backend = resolve_backend(node.backend, isolated=True)
        self.placement.backend = self.backend
        why = "CUDA device found" if self.backend == "cuda" else "no CUDA device with a driver" \
            if node.backend == "auto" else "requested"
        log.info("backend: %s (%s)", self.backend, why)
        problems = engine_problems(self.cfg, self.backend)  # a GPU-only engine on the cpu backend, ...
        if problems:
            raise StartError("; ".join(f"{key}: {what}" for key, what in problems))
        # The front door's certificate, key and token are read before anything starts.
        try:
            self.tls = load_tls(node.tls.cert, node.tls.key, node.tls.ca) if node.tls is not None else None
        except TlsError as e:
            raise StartError(str(e)) from None
        self.inference_token = read_bearer_token(node.auth, "node.auth")
        self._own_run_dir = node.run_dir is None
        self.run_dir = make_run_dir(node.run_dir)
        try:
            removed = claim(self.run_dir, NodeRecord.for_this_process(name=self.run_dir.name))
        except RunDirBusy as e:
            raise StartError(str(e)) from None
        if removed is not None:
            log.warning("%s", removed.describe())
        # What SIGKILLed nodes and programs left anywhere (a node of the Python API has no CLI to sweep
        # for it): pools and Param-Share segments whose owning process is gone.
        swept = sweep_dead_segments()
        if swept:
            log.warning("removed %d shared-memory object(s) of dead processes (%.1f MB): %s", len(swept),
                        sum(b for _, b in swept) / 1e6, ", ".join(n for n, _ in swept))
        write_token(self.run_dir, self.token)
        self._link_current()
        if self.backend == "cuda":
            self.mps = MpsDaemon(self.run_dir, mode=node.mps)
            try:
                self.mps.ensure()
            except MpsUnavailable as e:
                raise StartError(f"node.mps is 'require' but MPS cannot be used: {e}") from e

        try:
            self.overflow = NodeOverflow.plan(self.cfg)
        except OverflowSetupError as e:
            raise StartError(str(e)) from None
        for app in self.cfg.apps:
            n = app.instances if isinstance(app.instances, int) else 1
            self.apps[app.name] = AppState(cfg=app, gpu_pct=0, instances=n)
            if app.file is not None and app.file.config.ignored:
                log.info("app %s: %s: fields accepted without effect (they tune Triton's own internals): %s",
                         app.name, app.file.config.source, ", ".join(app.file.config.ignored))
        for u in self.cfg.unavailable:
            log.error("model %s%s is UNAVAILABLE: %s", u.name, f" version {u.version}" if u.version else "", u.reason)
        if self.scheduled:
            self.placement.check_scheduled()
            if self.monitor is not None:
                log.info("autoscale is off under node.scheduler %r: the scheduler owns the shares", node.scheduler)
                self.monitor = None
        else:
            self.placement.size_auto_apps()
        self.placement.assign_pcts()
        total = sum(a.instances for a in self.apps.values())
        # Room for a shadow per app, replacements and restarts, so a consumer index is never reused
        # while a dead instance's requests are being reclaimed.
        consumers = min(1024, 2 * total + 2 * len(self.apps) + 4 + 2 * len(self.overflow.pools if self.overflow else {})
                        + (REPOSITORY_CONSUMERS if node.repository.enabled or self._polls else 0))
        p = node.pool
        self.pool = PacketPool.create(slot_count=p.slot_count, max_payload=p.max_payload, record_count=p.record_count,
                                      max_chunks=p.max_chunks, consumer_count=consumers,
                                      answer_ring_bytes=p.answer_ring_kb * 1024)
        update_record(self.run_dir, shm=[self.pool.name.lstrip("/")])
        listen: list[tuple[str, int] | tuple[str, int, int]] = [(node.listen.host, port) for port in node.listen.ports]
        listen += [(node.listen.host, a.port, a.app_id) for a in self.cfg.apps if a.port]
        self.ingest = Ingest(self.pool, listen, timeout_ms=node.reassembly_timeout_ms).start()
        self.server = open_server(control_address(self.control_kind, self.run_dir), self.token)
        if node.metrics_enabled:
            self.metrics = MetricsServer(node.metrics_port)
            self.metrics.start()
        self.params = ParamShare(self.run_dir, enabled=self.share_params)
        self.supervisor = Supervisor(
            self.cfg, self.apps, self.instances, pool=self.pool, ingest=self.ingest, server=self.server,
            token=self.token, run_dir=self.run_dir, placement=self.placement, params=self.params,
            backend=self.backend, launcher=self.launcher, heartbeat_ms=self.heartbeat_ms, warmup=self.warmup,
            consumers=consumers, mps=self.mps, record=self.record, on_lost=self._instance_lost, overflow=self.overflow)

        shares = self.placement.plan_shares()
        # Param-Share: the first instance of each model exports its weights; the others start once
        # the export exists and map it instead of loading their own copy.
        later: list[tuple[Any, str]] = []
        for app in self.cfg.apps:
            for i in range(self.apps[app.name].instances):
                name = f"{app.name}-{i}"
                if self.params.exported(app):
                    later.append((app, name))
                else:
                    self.supervisor.spawn(app, name, shares.get(name))
        # A model of the model repository that fails to start (a file its engine cannot run) is UNAVAILABLE
        # alone; every other app starts all-or-nothing, as before.
        from_repository = {a.name for a in self.cfg.apps if a.file is not None and a.file.repository is not None}
        self.supervisor.await_ready([st for st in self.instances.values() if st.app not in from_repository],
                                    self.ready_timeout_s, self._handle, self._stop.is_set)
        failed: dict[str, str] = {}
        for name in sorted(from_repository):
            try:  # (a Ready taken while another app was awaited has marked its instance ready already)
                self.supervisor.await_ready([st for st in self.instances.values() if st.app == name and not st.ready],
                                            self.ready_timeout_s, self._handle, self._stop.is_set)
            except SupervisionError as e:
                if self._stop.is_set():
                    raise
                failed[name] = str(e)
        if failed:
            self._drop_apps(failed)
        if later:
            self.supervisor.await_ready([self.supervisor.spawn(app, name, shares.get(name)) for app, name in later],
                                        self.ready_timeout_s, self._handle, self._stop.is_set)
        if self.mps is not None:
            try:  # every instance must be the MPS daemon's client at its percentage, or run without a limit
                self.mps.check_clients({st.pid: st.spec.gpu_pct for st in self.instances.values()})
            except MpsUnavailable as e:
                raise StartError(f"node.mps is 'require' but an instance is not an MPS client: {e}") from e
        if self.overflow is not None:
            self._start_overflow(self.overflow)
        if self.scheduled:
            self._start_dispatcher()
        for app in self.cfg.apps:
            if app.name not in self.apps:
                continue  # a repository model that failed to start (UNAVAILABLE)
            self.supervisor.route(app.name)
            if app.warm_shadow and not self.scheduled:
                self.supervisor.spawn_shadow(app.name)
        if self.overflow is not None:
            self.overflow.update(self.instances.values(), self.ingest, time.monotonic(), force=True)
        if node.repository.enabled:
            self.repository_token = read_repository_token(node.repository)
        if node.repository.enabled or self._polls:
            self.repository = Repository(self)
        if self._polls:
            assert node.model_repository is not None
            self.poller = RepositoryPoller(node.model_repository, node.repository_poll_s, slo_ms=node.repository_slo_ms,
                                           backend=self.backend).start()
            log.info("polling the model repository %s every %g s", node.model_repository, node.repository_poll_s)
        if node.frontdoor_enabled:
            self._start_frontdoor()
        self._pin_threads()
        self.started_at = time.monotonic()
        log.info("node up: %d app(s), %d instance(s), listening on %s:%s, run dir %s", len(self.apps),
                 len(self.instances), node.listen.host, ",".join(map(str, self.ingest.ports)), self.run_dir)

    def _start_overflow(self, ov: NodeOverflow) -> None:
        """Start each overflowing app's CPU instance (its pool's cores) and its decision point."""
        sup = self._sup()
        sup.await_ready([sup.spawn_overflow(name) for name in ov.pools], self.ready_timeout_s, self._handle,
                        self._stop.is_set)
        for name in ov.pools:
            a = self.apps[name]
            ov.attach(a.cfg, self.placement.profile_of, a.instances)
            log.info("CPU overflow of %s on cores %s (alpha %.3g ms)", name, list(ov.pools[name].cores),
                     ov.pools[name].alpha_ms)

    def _start_frontdoor(self) -> None:
        """The Open Inference Protocol front door: its requests are placed straight into the node's
        packet pool by the ingest (and answered back in-process), so they share the pool, the
        instances, batching, statuses and metrics with UDP requests."""
        assert self.ingest is not None
        node = self.cfg.node
        h = node.listen.host
        udp_host = "127.0.0.1" if h in ("0.0.0.0", "") else ("::1" if h == "::" else h)
        ingest = self.ingest
        try:
            self.frontdoor = start_frontdoor(
                [a for a in self.cfg.apps if a.name in self.apps], (udp_host, ingest.ports[0]),
                http_port=node.http_port or None,
                grpc_port=node.grpc_port or None, host=h,
                ready=lambda name: name in self.apps and bool(ingest.route(self.apps[name].cfg.app_id)),
                statistics={name: a.stats for name, a in self.apps.items()},
                ingest=ingest, repository=self.repository if node.repository.enabled else None,
                repository_token=self.repository_token,
                fleet_routes=node.fleet_routes, max_request_bytes=node.pool.max_request_bytes,
                unavailable=self.unavailable, tls=self.tls, inference_token=self.inference_token)
        except FrontDoorError as e:
            raise StartError(f"the Open Inference Protocol front door could not start: {e}") from e

    def _start_dispatcher(self) -> None:
        """Build the live scheduler from the instances' measured warm-up (or node.profiles) and bind them."""
        assert self.pool is not None and self.server is not None
        files = self.placement.profiles()
        profiles: dict[str, Any] = {}
        pcts: dict[str, dict[str, int]] = {}
        bound: list[tuple[str, InstanceState]] = []
        for name, a in self.apps.items():
            pcts[name] = self.placement.stage_pcts(name)
            st = self.instances.of(name, Role.ACTIVE)[0]
            bound.append((name, st))
            models = {s.name: s.model for s in a.cfg.stages} if a.cfg.stages else {"main": a.cfg.model or ""}
            for stage in stage_names(a.cfg):
                key = f"{name}.{stage}"
                prof = files.get(model_key(models[stage]))
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
        # CPU backend: instances that share a core take turns on it, so the scheduler runs them one at a time.
        exclusive = core_groups({name: st.spec.cores for name, st in bound}) if self.backend == "cpu" else []
        try:
            self.dispatcher = LiveScheduler(self.cfg.node.scheduler, list(self.cfg.apps), pcts, profiles, self.pool,
                                            self.server.send, round_ms=self.cfg.node.round_ms, exclusive=exclusive)
        except ValueError as e:
            raise StartError(f"node.scheduler {self.cfg.node.scheduler!r}: {e}") from e
        for name, st in bound:
            self.dispatcher.bind(name, st.name, st.spec.consumer)
        log.info("live %s scheduler: %d app(s), %d ms rounds", self.cfg.node.scheduler, len(bound),
                 self.cfg.node.round_ms)

    def _link_current(self) -> None:
        assert self.run_dir is not None
        link = self.run_dir.parent / CURRENT_LINK
        with contextlib.suppress(OSError):
            tmp = self.run_dir.parent / f".{CURRENT_LINK}.{os.getpid()}"
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            tmp.symlink_to(self.run_dir)
            tmp.replace(link)

    # -- what the parts ask of the node (reconfig.ChangeHost) -----------------------------------------------
    def _sup(self) -> Supervisor:
        if self.supervisor is None:
            raise StartError("the node is not running")
        return self.supervisor

    def shadow_of(self, app_name: str) -> InstanceState | None:
        """A live shadow of the app (ready or still starting), if there is one."""
        return self._sup().shadow_of(app_name)

    def spawn_shadow(self, app_name: str) -> InstanceState:
        """Start a shadow of the app: CPU side initialised, model loaded only on InitGpu."""
        return self._sup().spawn_shadow(app_name)

    def spawn_active(self, app_name: str, gpu_pct: int, share: CpuShare | None) -> InstanceState:
        """Start a new active instance of the app at ``gpu_pct`` (routed to by the next :meth:`route`)."""
        sup = self._sup()
        return sup.spawn(self.apps[app_name].cfg, sup.next_name(app_name, "k"), share, gpu_pct=gpu_pct)

    def init_shadow(self, st: InstanceState, gpu_pct: int, share: CpuShare | None) -> None:
        self._sup().init_shadow(st, gpu_pct, share)

    def share_for(self, app_name: str, gpu_pct: int, index: int) -> CpuShare | None:
        return self.placement.share_for(app_name, gpu_pct, index)

    def route(self, app_name: str) -> None:
        self._sup().route(app_name)

    def finish(self, st: InstanceState) -> None:
        self._sup().finish(st)

    def kill(self, st: InstanceState, role: Role = Role.STOPPING) -> None:
        self._sup().kill(st, role)

    # -- what the repository asks of the node (repository.RepositoryHost) --------------------------------
    def spawn_loading(self, app: AppConfig, index: int, gpu_pct: int) -> InstanceState:
        """Start instance ``index`` of an app being loaded: not routed to, not replaced, until activated."""
        sup = self._sup()
        share = self.placement.share_for(app.name, gpu_pct, index)
        st = sup.spawn(app, sup.next_name(app.name, "l"), share, gpu_pct=gpu_pct)
        st.role = Role.LOADING
        return st

    def activate(self, app_name: str, instances: list[InstanceState]) -> None:
        """A loaded app's instances are all READY: serve them, route to them, start its shadow."""
        for st in instances:
            st.role = Role.ACTIVE
        sup = self._sup()
        sup.route(app_name)
        if self.apps[app_name].cfg.warm_shadow and not self.scheduled:
            sup.spawn_shadow(app_name)

    def unroute(self, app_name: str) -> None:
        """No new request reaches the app (its requests are dropped as for an unknown app)."""
        assert self.ingest is not None
        self.ingest.set_route(self.apps[app_name].cfg.app_id, [])

    def publish_model(self, app: AppConfig) -> None:
        """The front door serves ``app`` (its model metadata is rebuilt), counting its inferences in the
        app's statistics record."""
        if self.frontdoor is not None:
            state = self.apps.get(app.name)
            self.frontdoor.add_model(app, statistics=state.stats if state is not None else None)

    def withdraw_model(self, name: str) -> None:
        if self.frontdoor is not None:
            self.frontdoor.remove_model(name)

    def record(self, event: dict[str, Any]) -> None:
        """Keep an event (with its time) for status and tests."""
        self.events.append({"t": time.monotonic(), **event})
        del self.events[:-EVENTS_KEPT]

    def _instance_lost(self, st: InstanceState) -> None:
        if self.dispatcher is not None:
            self.dispatcher.instance_lost(st.name)

    # -- changes of share ----------------------------------------------------------------------------------
    def _check_change(self, app_name: str, gpu_pct: int) -> None:
        if self.scheduled:
            raise ChangeError(f"node.scheduler is {self.cfg.node.scheduler!r}: the scheduler decides when and at "
                              "what GPU% each app runs; change gpu_pct in apps.yaml instead")
        if self._stop.is_set():
            raise ChangeError("the node is stopping")
        self.placement.check_share(app_name, gpu_pct)

    def set_gpu(self, app: str, gpu_pct: int, *, origin: str = "set-gpu", method: str = "overlap",
                reason: str | None = None, model: str | None = None) -> Change:
        """Accept a change of the app's GPU% (Overlapped-Execution, or the restart baseline), or with
        ``model`` a change of its model file (reconfig.model_key). The node's loop carries it out; raises
        ChangeError when it is refused."""
        return self.changes.submit(app, gpu_pct, origin=origin, method=method, reason=reason, model=model)

    # -- running ---------------------------------------------------------------------------------------
    def serve(self, *, duration_s: float | None = None) -> None:
        """Run the control loop until stop() is called (or a stop command / signal arrives)."""
        end = None if duration_s is None else time.monotonic() + duration_s
        while not self._stop.is_set() and (end is None or time.monotonic() < end):
            self.step(100)
        if self._stop.is_set():
            self._teardown(drain=self._stop_drain)

    def step(self, timeout_ms: float = 100.0) -> None:
        """One iteration of the loop: messages, supervision, changes, monitor, metrics. A failure in one
        duty is logged and counted and never stops the loop."""
        assert self.server is not None and self.supervisor is not None
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            wait_ms = max(0.0, deadline - time.monotonic()) * 1000
            if self.dispatcher is not None:
                wait_ms = min(wait_ms, self.dispatcher.wait_ms())
            item = self.server.poll(wait_ms)
            if item is not None:
                self._guard("message", self._handle, item)
            if self.dispatcher is not None:
                self._guard("dispatch", self.dispatcher.tick)
            if time.monotonic() >= deadline or (item is None and self.dispatcher is None):
                break
        now = time.monotonic()
        self._guard("supervision", self.supervisor.reap)
        self._guard("supervision", self.supervisor.check_hangs, now, self.cfg.node.hang_timeout_s)
        self._guard("memory", self.supervisor.sample_memory, now)
        self._guard("changes", self.changes.advance)
        settling = self.changes.settling(now, self.cfg.node.shadow_settle_s)
        if self.repository is not None:
            if self.poller is not None:
                self._guard("repository", self._poll_repository)
            self._guard("repository", self.repository.advance)
            settling |= self.repository.busy
        self._guard("supervision", self.supervisor.refill_shadows, now, set(self.changes.running) | settling)
        if self.overflow is not None:
            self._guard("overflow", self.supervisor.refill_overflow, now)
            self._guard("overflow", self.overflow.update, self.instances.values(), self.ingest, now)
        self._guard("pinning", self._pin_threads)
        if self.monitor is not None and now >= self._next_sample:
            self._next_sample = now + self.monitor.policy.interval_s
            self._guard("monitor", self.monitor.autoscale, self, now)
        if self.metrics is not None:
            self._guard("metrics", self.metrics.update, self.status())

    def _pin_threads(self) -> None:
        """CPU backend, ``node.pin_node_threads``: keep this process's threads on the usable cores no
        instance (nor overflow pool) holds, re-done whenever that set changes (a share change, a
        restart); anywhere when every core is held. A shadow or a replacement inherits the node's set
        at spawn and takes its own share before it loads anything."""
        if self.backend != "cpu" or not self.cfg.node.pin_node_threads:
            return
        held: set[int] = set()
        for st in self.instances.values():
            held.update(st.spec.cores or ())
        if self.overflow is not None:
            for pool in self.overflow.pools.values():
                held.update(pool.cores)
        free = tuple(c for c in available_cores() if c not in held)
        if free == self._pin_wish:
            return
        self._pin_wish = free
        self.own_cores = pin_own_threads(self, free if free else None)

    def _guard(self, where: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:
            self.errors[where] = self.errors.get(where, 0) + 1
            log.exception("node loop: %s failed (counted in status errors.%s); the node carries on", where, where)
            return None

    def request_stop(self, drain: bool = True) -> None:
        """Ask serve() to stop (safe from signal handlers and other threads)."""
        self._stop_drain = drain
        self._stop.set()

    def _handle(self, item: Incoming) -> None:
        msg = item.msg
        if isinstance(msg, Heartbeat):
            st = self.instances.get(msg.instance)
            if st is not None:
                self._beat(st, msg.stats)
        elif isinstance(msg, Ready):
            st = self.instances.get(msg.instance)
            if st is not None:
                Supervisor.mark_ready(st, msg)
                if st.role == Role.ACTIVE:
                    self._sup().route(st.app)
                    if self.dispatcher is not None:
                        self.dispatcher.bind(st.app, st.name, st.spec.consumer)
                elif st.role == Role.SHADOW:
                    self._sup().shadow_ok(st.app)
                elif st.role == Role.OVERFLOW:
                    self._sup().overflow_ok(st)
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
            # Kept after the instance is gone: its Error can trail its exit (a failed repository load).
            self.last_errors[msg.instance] = f"{msg.kind}: {msg.message}"
            while len(self.last_errors) > 64:
                del self.last_errors[next(iter(self.last_errors))]
            log.error("instance %s reported %s: %s", msg.instance, msg.kind, msg.message)
        elif isinstance(msg, StatusRequest):
            self._reply(item, StatusReply(status=self.status()))
        elif isinstance(msg, StopRequest):
            self._reply(item, Result(ok=True, message="stopping"))
            self.request_stop(drain=msg.drain)
        elif isinstance(msg, SetGpuRequest):
            try:
                ch = self.set_gpu(msg.app, msg.gpu_pct)
            except ChangeError as e:
                self._reply(item, Result(ok=False, message=str(e)))
            else:
                text = ch.message() if ch.phase.terminal else \
                    f"change {ch.id} accepted: {ch.app} {ch.from_pct}% -> {ch.to_pct}%"
                self._reply(item, Result(ok=True, message=text, data={"change": ch.to_dict()}))

    def _reply(self, item: Incoming, msg: Any) -> None:
        assert self.server is not None
        self.server.reply(item, msg)

    def _beat(self, st: InstanceState, stats: InstanceStats) -> None:
        now = time.monotonic()
        st.stats, st.last_beat = self.apps[st.app].stats.beat(st.name, stats, now), now

    # -- status ---------------------------------------------------------------------------------------
    def view(self) -> NodeView:
        """The node now, by field (orchestrator/node/view.py): what its parts read."""
        return node_view(self)

    def status(self) -> dict[str, Any]:
        """A JSON-able snapshot: node, ingest counters and drops, per app and instance statistics, changes
        (the view's JSON, for the control edge)."""
        return node_status(self)

    # -- stop -----------------------------------------------------------------------------------------
    def stop(self, drain: bool = True) -> None:
        """Stop the node: drain instances (when ``drain``), then remove everything it created."""
        self._teardown(drain=drain)

    def _pump(self, ms: float) -> None:
        """While stopping: heartbeats and Ended only."""
        assert self.server is not None
        item = self.server.poll(ms)
        if item is not None and isinstance(item.msg, (Heartbeat, Ended)):
            self._handle(item)

    def _drop_apps(self, failed: dict[str, str]) -> None:
        """Start-up: take the repository models whose instances failed to start out of the node and list each
        UNAVAILABLE with its reason; the other apps start without them. Every instance of theirs is killed
        first (none of them is then taken for a crashed active to replace), waited for and reaped."""
        sup = self._sup()
        mine = [st for st in self.instances.values() if st.app in failed]
        for st in mine:
            sup.kill(st)
        deadline = time.monotonic() + self.stop_timeout_s
        for st in mine:
            with contextlib.suppress(subprocess.TimeoutExpired):
                st.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        sup.reap()
        for name, why in sorted(failed.items()):
            # Its own words, where an instance's Error was taken while another app was awaited.
            why = next((f"instance {st.name} failed to start: {self.last_errors[st.name]}" for st in mine
                        if st.app == name and st.name in self.last_errors), why)
            cfg = self.apps.pop(name).cfg
            log.error("model %s is UNAVAILABLE: %s", name, why)
            self.unavailable.append(Unavailable(repository_model_of(cfg) or name,
                                                str(cfg.file.version) if cfg.file is not None else "", why))
            self.record({"event": "model_unavailable", "app": name, "reason": why})

    @property
    def _polls(self) -> bool:
        return self.cfg.node.model_repository is not None and self.cfg.node.model_control_mode == "poll"

    def _poll_repository(self) -> None:
        """Submit what the last poll of the model repository found (new models, new versions, models gone)."""
        assert self.poller is not None and self.repository is not None
        for name, (act, fut) in list(self._poll_ops.items()):
            if fut.done():
                del self._poll_ops[name]
                if fut.exception() is not None:  # not tried again until its files change again
                    self.poller.give_up(act)
        for act in self.poller.due({n: a.cfg for n, a in self.apps.items()},
                                   self.repository.busy | set(self._poll_ops)):
            log.info("repository poll: %s %s (%s)", act.kind, act.name, act.why)
            self.record({"event": "repository_poll", "kind": act.kind, "app": act.name, "why": act.why})
            self._poll_ops[act.name] = (act, self.repository.submit(act.kind, act.name, act.entry))

    def _teardown(self, drain: bool) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._stop.set()
            if self.poller is not None:
                self.poller.close()
            if self.repository is not None:
                self.repository.close()
            if self.frontdoor is not None:
                with contextlib.suppress(Exception):
                    self.frontdoor.close()
                self.frontdoor = None
            self.changes.cancel_all("the node is stopping")
            if self.ingest is not None:
                for a in self.apps.values():
                    with contextlib.suppress(Exception):
                        self.ingest.set_route(a.cfg.app_id, [])
            if self.supervisor is not None and self.server is not None:
                self.supervisor.shutdown(drain, self.stop_timeout_s, self._pump)
            else:
                for st in self.instances.values():
                    with contextlib.suppress(Exception):
                        st.proc.kill()
                        st.proc.wait(timeout=5)
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
            if self.params is not None:
                self.params.remove_all()
            if self._pin_wish is not None:
                with contextlib.suppress(Exception):
                    pin_own_threads(self, None)
                self._pin_wish = None
                self.own_cores = None
            if self.run_dir is not None:
                link = self.run_dir.parent / CURRENT_LINK
                with contextlib.suppress(OSError):
                    if link.is_symlink() and Path(os.readlink(link)) == self.run_dir:
                        link.unlink()
                if self._own_run_dir:
                    shutil.rmtree(self.run_dir, ignore_errors=True)
                else:
                    for leftover in ("token", "control.sock", "command.sock", "measure.lock", "node.json"):
                        with contextlib.suppress(OSError):
                            (self.run_dir / leftover).unlink()

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
