"""Supervision of the instance processes: spawn, wait for READY, route, reap, restart, refill shadows.

The supervisor owns the instance table's processes; the node's loop calls :meth:`Supervisor.reap`
every step. Its rules are what keeps every request answered exactly once when a process goes away:

- **An active instance dies** (crash, SIGKILL, or killed as hung): a replacement is spawned and the
  app's route switched to it *before* the dead instance's requests are reclaimed, so the ingest
  requeues them into the replacement's queue (where they wait while it loads, and expire with
  DEADLINE_MISSED if that takes too long) and new requests never meet an app without a queue. Only
  what a replacement that never became ready held is answered INSTANCE_FAILED instead of requeued,
  so a request cannot circle through failing replacements.
- **An instance that drained** (``Ended``) or was told to stop: whatever it still held is requeued
  to the app's other actives, or answered INSTANCE_FAILED by the ingest.
- **A shadow dies**: its consumer is released and a new shadow is started (after a back-off that
  grows with consecutive failures), so ``shadow: true`` keeps holding.
- **An active goes silent** (no heartbeat for ``node.hang_timeout_s`` once serving): it is killed, and
  the first rule applies.
- **The holder of an app's shared weights dies** (CUDA Param-Share, orchestrator/node/param_share.py): every
  instance that mapped its arena is killed, so none reads freed device memory, and the rules above
  replace them; their replacements import from a new holder. Every instance's exit, whatever its
  role, is told to Param-Share's bookkeeping, and a copy no instance maps any more is released.
- **A CPU overflow instance dies** (role ``overflow``, issue 18): the route drops it first, what it
  held is requeued to the app's accelerator instances (or answered INSTANCE_FAILED when none is
  left), the failure is counted, and a new one is started after a back-off like a shadow's, so the
  accelerator path never stops serving.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuprims.cpushare import CpuShare
from gpuprims.cuda.ipc import ENV_OWNER_PID
from gpuprims.ingest import Ingest
from gpuprims.pool import PacketPool
from orchestrator.config.schema import AppConfig, EngineChoice, NodeConfig
from orchestrator.control.channel import ControlServer, instance_env
from orchestrator.control.errors import SupervisionError
from orchestrator.control.memory import MemoryReading, MemorySampler, NodeMemory, ProcessMemory, total
from orchestrator.control.messages import Error, Finish, InitGpu, Ready, Shutdown
from orchestrator.control.records import EngineSpec, StageSpec
from orchestrator.control.share_spec import ENV_HOLDER, HOLDER_MODULE, HolderSpec
from orchestrator.control.spec import ENV_SPEC, InstanceSpec
from orchestrator.frontdoor import FrontDoor
from orchestrator.frontdoor.core import Unavailable
from orchestrator.node.cpu_overflow import NodeOverflow
from orchestrator.node.launcher import ForkLauncher, Launcher
from orchestrator.node.param_share import HolderProcess, ParamShare
from orchestrator.node.placement import Placement
from orchestrator.node.reconfig import Change, Changes
from orchestrator.node.repository import repository_model_of
from orchestrator.node.state import AppState, InstanceState, InstanceTable, Role
from orchestrator.worker.launch import ENV_IMPORT_NICE

log = logging.getLogger("gpuprims.node")

#: Shadow restarts back off: 1 s after the first consecutive failure, doubling up to this.
SHADOW_BACKOFF_MAX_S = 30.0
#: The nice value a pre-warming shadow (cpu backend) imports its code at (orchestrator.worker.launch).
SHADOW_IMPORT_NICE = 10
#: The MPS percentage a Param-Share holder runs at: it only copies the weights once, then waits.
HOLDER_GPU_PCT = 10
#: The repository's root: a holder's working directory, so ``-m`` finds the package.
_ROOT = Path(__file__).resolve().parents[2]


def start_holder_process(env: dict[str, str]) -> HolderProcess:
    """The node's way to start a Param-Share holder: ``<python> -m orchestrator.worker.param_holder``."""
    return subprocess.Popen([sys.executable, "-m", HOLDER_MODULE], env=env, stdin=subprocess.DEVNULL,
                            cwd=str(_ROOT))


def _engine_spec(choice: EngineChoice) -> EngineSpec:
    """The config's validated engine choice as the instance's spec carries it across the process boundary."""
    return EngineSpec(choice.kind, dict(choice.options))


def file_fields(app: AppConfig) -> dict[str, Any]:
    """The instance spec's model-file fields of ``app`` (none for a zoo or module:factory model)."""
    if app.file is None:
        return {}
    f = app.file
    return {"model_config": f.config_json, "model_path": f.path, "model_version": f.version,
            "model_fingerprint": f.fingerprint or None}


class Supervisor:
    """The instance processes of one node (see the module docstring).

    It is also what a change of share (:class:`orchestrator.node.reconfig.ChangeHost`) and a repository
    operation (:class:`orchestrator.node.repository.RepositoryHost`) act through: their instance tables,
    spawning, routing, finishing and killing, ``changes`` (the node's, which the node's loop advances) and
    the front door's model list (``frontdoor``, set once it is up).
    """

    def __init__(self, cfg: NodeConfig, apps: dict[str, AppState], instances: InstanceTable, *,
                 pool: PacketPool, ingest: Ingest, server: ControlServer, token: str, run_dir: Path,
                 placement: Placement, params: ParamShare, backend: str, launcher: Launcher, heartbeat_ms: float,
                 warmup: bool, consumers: int, changes: Changes, mps: Any = None,
                 ready_timeout_s: float = 180.0, stop_timeout_s: float = 15.0,
                 record: Callable[[dict[str, Any]], None] = lambda e: None,
                 on_lost: Callable[[InstanceState], None] = lambda st: None,
                 overflow: NodeOverflow | None = None,
                 holder_launcher: Callable[[dict[str, str]], HolderProcess] = start_holder_process) -> None:
        self.cfg = cfg
        self.apps = apps
        self.instances = instances
        self.pool = pool
        self.ingest = ingest
        self.server = server
        self.token = token
        self.run_dir = run_dir
        self.placement = placement
        self.params = params
        self.backend = backend
        self.launcher = launcher
        self.heartbeat_ms = heartbeat_ms
        self.warmup = warmup
        self.mps = mps
        self.record = record
        self.on_lost = on_lost
        self.free_consumers = list(range(consumers - 1, -1, -1))
        self._seq = itertools.count()
        self._shadow_failures: dict[str, int] = {}
        self._shadow_not_before: dict[str, float] = {}
        self.overflow = overflow
        self._overflow_failures: dict[str, int] = {}
        self._overflow_not_before: dict[str, float] = {}
        self.holder_launcher = holder_launcher
        self.changes = changes
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        #: instance -> the last Error it reported; kept after it is gone (its Error can trail its exit).
        self.last_errors: dict[str, str] = {}
        self.frontdoor: FrontDoor | None = None
        params.bind(backend, self._start_holder, cfg.gpu_of)
        self.memory = MemorySampler()

    # -- processes -------------------------------------------------------------------------------------
    def spawn(self, app: AppConfig, name: str, share: CpuShare | None, *, defer_init: bool = False,
              gpu_pct: int | None = None, role: Role | None = None) -> InstanceState:
        """Start an instance process with the launcher (the node's: ``python -m orchestrator.worker.launch``); an
        active unless ``defer_init``
        or ``role`` (``overflow``: a CPU instance on ``share``'s cores, whatever the node's backend)."""
        if not self.free_consumers:
            raise SupervisionError("no free consumer endpoint in the packet pool")
        consumer = self.free_consumers.pop()
        pct = gpu_pct if gpu_pct is not None else self.placement.instance_pct(app.name)
        scheduled = self.placement.scheduled
        on_cpu = role == Role.OVERFLOW
        backend = "cpu" if on_cpu else self.backend
        engine = app.cpu_overflow_engine if on_cpu else app.engine
        spec = InstanceSpec(
            name=name, app=app.name, app_id=app.app_id, model=app.model or "", pool=self.pool.name, consumer=consumer,
            input_shape=tuple(app.input_shape), dtype=app.dtype, seed=app.seed, num_classes=app.num_classes,
            slo_ms=app.slo_ms, max_batch=app.max_batch, max_wait_ms=app.max_wait_ms, gpu_pct=pct,
            backend=backend, gpu=self.cfg.gpu_of(app) if backend == "cuda" else 0,
            cores=list(share.cores) if share is not None else None,
            threads=share.threads if share is not None else None, defer_init=defer_init,
            heartbeat_ms=self.heartbeat_ms, chunk_payload=self.cfg.node.pool.max_payload, warmup=self.warmup,
            stages=tuple(StageSpec(st.name, st.model, tuple(st.routes), _engine_spec(app.stage_engine(st)))
                         for st in app.stages) if app.stages else None,
            entry=app.entry_stages()[0] if app.stages else None,
            share_params=None if on_cpu else self.params.mode_for(app, name),
            dispatched=scheduled,
            measure_lock=str(self.run_dir / "measure.lock") if scheduled else None,
            stage_pcts=self.placement.stage_pcts(app.name) if scheduled else None,
            # cpu backend: a shadow loads and warms its model at nice 19 before it is needed.
            prewarm=defer_init and self.backend == "cpu" and not scheduled,
            engine=_engine_spec(engine),
            engine_cache=self.cfg.node.engine_cache,
            **file_fields(app),
        )
        env = dict(os.environ)
        env.update(instance_env(self.server.address, name, self.token))
        env[ENV_SPEC] = spec.to_json()
        env["GPUPRIMS_LOG_LEVEL"] = self.cfg.node.log_level
        env["GPUPRIMS_LOG_FORMAT"] = self.cfg.node.log_format
        env[ENV_OWNER_PID] = str(os.getpid())  # Param-Share segments follow the node's life, not the exporter's
        if share is not None:
            env.update(share.env())
        env.pop(ENV_IMPORT_NICE, None)
        if spec.prewarm:
            # Its import too runs below the active instances it shares cores with (orchestrator.worker.launch).
            env[ENV_IMPORT_NICE] = str(SHADOW_IMPORT_NICE)
        if backend == "cuda" and self.mps is not None:
            env.update(self.mps.env(pct))
            if defer_init:
                # A shadow sets its own percentage when told InitGpu, before CUDA initialises.
                env.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)
        try:
            proc = self.launcher.launch(spec, env)
        except OSError as e:
            self.free_consumers.append(consumer)
            raise SupervisionError(f"could not start {name}: {e}") from e
        st = InstanceState(name=name, app=app.name, spec=spec, proc=proc,
                           role=role or (Role.SHADOW if defer_init else Role.ACTIVE))
        self.instances[name] = st
        log.info("spawned %s (pid %d, consumer %d, %d%%)", name, proc.pid, consumer, pct)
        return st

    def _start_holder(self, spec: HolderSpec) -> HolderProcess:
        """Start the Param-Share holder of one copy of weights (CUDA; orchestrator/node/param_share.py), in the
        node's environment and, under MPS, as the daemon's client like the instances."""
        env = dict(os.environ)
        env[ENV_HOLDER] = spec.to_json()
        env["GPUPRIMS_LOG_LEVEL"] = self.cfg.node.log_level
        env[ENV_OWNER_PID] = str(os.getpid())
        if self.mps is not None:
            env.update(self.mps.env(HOLDER_GPU_PCT))
        return self.holder_launcher(env)

    # -- what changes and repository operations act through (ChangeHost, RepositoryHost) ------------------
    def spawn_active(self, app_name: str, gpu_pct: int, share: CpuShare | None) -> InstanceState:
        """Start a new active instance of the app at ``gpu_pct`` (routed to by the next :meth:`route`)."""
        return self.spawn(self.apps[app_name].cfg, self.next_name(app_name, "k"), share, gpu_pct=gpu_pct)

    def share_for(self, app_name: str, gpu_pct: int, index: int) -> CpuShare | None:
        """The CPU share instance ``index`` of the app gets at ``gpu_pct`` (None on cuda)."""
        return self.placement.share_for(app_name, gpu_pct, index)

    def spawn_loading(self, app: AppConfig, index: int, gpu_pct: int) -> InstanceState:
        """Start instance ``index`` of an app being loaded: not routed to, not replaced, until activated."""
        st = self.spawn(app, self.next_name(app.name, "l"), self.share_for(app.name, gpu_pct, index), gpu_pct=gpu_pct)
        st.role = Role.LOADING
        return st

    def activate(self, app_name: str, instances: list[InstanceState]) -> None:
        """A loaded app's instances are all READY: serve them, route to them, start its shadow."""
        for st in instances:
            st.role = Role.ACTIVE
        self.route(app_name)
        if self.apps[app_name].cfg.warm_shadow and not self.placement.scheduled:
            self.spawn_shadow(app_name)

    def unroute(self, app_name: str) -> None:
        """No new request reaches the app (its requests are dropped as for an unknown app)."""
        self.ingest.set_route(self.apps[app_name].cfg.app_id, [])

    def publish_model(self, app: AppConfig) -> None:
        """The front door serves ``app`` (its model metadata is rebuilt), counting its inferences in the
        app's statistics record."""
        if self.frontdoor is not None:
            state = self.apps.get(app.name)
            self.frontdoor.add_model(app, statistics=state.stats if state is not None else None)

    def withdraw_model(self, name: str) -> None:
        """The front door no longer lists or serves ``name``."""
        if self.frontdoor is not None:
            self.frontdoor.remove_model(name)

    def set_gpu(self, app: str, gpu_pct: int, *, origin: str = "set-gpu", method: str = "overlap",
                reason: str | None = None, model: str | None = None) -> Change:
        """Submit a change of the app's share (or model) to the node's changes; ChangeError when refused."""
        return self.changes.submit(app, gpu_pct, origin=origin, method=method, reason=reason, model=model)

    def reported(self, instance: str, error: str) -> None:
        """Keep an instance's Error (the last 64 instances'), also after the instance is gone."""
        st = self.instances.get(instance)
        if st is not None:
            st.error = error
        self.last_errors[instance] = error
        while len(self.last_errors) > 64:
            del self.last_errors[next(iter(self.last_errors))]

    # -- memory --------------------------------------------------------------------------------------
    def _own_processes(self) -> list[tuple[str, int]]:
        """The node's processes that are not instances, as (kind, pid): itself, its fork servers and
        its Param-Share holders."""
        out = [("node", os.getpid())]
        if isinstance(self.launcher, ForkLauncher):
            out += [("fork_server", int(d["pid"])) for d in self.launcher.describe() if isinstance(d.get("pid"), int)]
        out += [("param_holder", h.pid) for h in self.params.holders()]
        return out

    def sample_memory(self, now: float) -> None:
        """Read the PSS of the node's processes that are due, a couple per call (the node's loop calls this
        each pass; each process is read once every ``memory.interval_s``; orchestrator/control/memory.py)."""
        pids = [pid for _, pid in self._own_processes()] + [st.pid for st in self.instances.values()]
        self.memory.sample(now, pids)

    def instance_memory(self, st: InstanceState) -> MemoryReading:
        """An instance's last PSS reading and its heartbeat's device memory (cuda backend)."""
        return MemoryReading(self.memory.get(st.pid), st.stats.device_bytes if st.stats is not None else None)

    def app_memory(self, app_name: str) -> MemoryReading:
        """The sum over the app's instances (actives, shadow, finishing, overflow)."""
        return total(self.instance_memory(st) for st in self.instances.values() if st.app == app_name)

    def node_memory(self) -> NodeMemory:
        """The node's processes, its instances' sum, and the total of the whole tree."""
        procs = tuple(ProcessMemory(kind, pid, self.memory.get(pid)) for kind, pid in self._own_processes())
        insts = total(self.instance_memory(st) for st in self.instances.values())
        whole = total([insts, *(MemoryReading(p.pss_bytes) for p in procs)])
        return NodeMemory(procs, insts, whole, self.memory.unreadable)

    def next_name(self, app: str, kind: str) -> str:
        """A fresh instance name: ``<app>-<kind><n>`` (``s`` shadow, ``r`` replacement, ``k`` restart)."""
        return f"{app}-{kind}{next(self._seq)}"

    def spawn_shadow(self, app_name: str) -> InstanceState:
        """Start a shadow of the app: CPU side initialised, model loaded only on InitGpu."""
        return self.spawn(self.apps[app_name].cfg, self.next_name(app_name, "s"), None, defer_init=True)

    def shadow_of(self, app_name: str) -> InstanceState | None:
        """A live shadow of the app (ready or still starting), if there is one."""
        return next((st for st in self.instances.of(app_name, Role.SHADOW) if st.error is None), None)

    def actives(self, app_name: str) -> list[InstanceState]:
        """The app's active instances, by name."""
        return sorted(self.instances.of(app_name, Role.ACTIVE), key=lambda st: st.name)

    def init_shadow(self, st: InstanceState, gpu_pct: int, share: CpuShare | None) -> None:
        """Tell a shadow to take ``gpu_pct`` (and, on the CPU backend, its new cores) and load its model."""
        settings: dict[str, Any] = {}
        if share is not None:
            settings = {"cores": list(share.cores), "threads": share.threads}
            st.spec.cores, st.spec.threads = list(share.cores), share.threads
        self.server.send(st.name, InitGpu(instance=st.name, gpu_pct=gpu_pct, settings=settings))

    def finish(self, st: InstanceState) -> None:
        """<2, Finish>: the instance serves what it holds, reports Ended and exits."""
        st.role = Role.FINISHING
        self.server.send(st.name, Finish(instance=st.name))

    def kill(self, st: InstanceState, role: Role = Role.STOPPING) -> None:
        """SIGKILL an instance; :meth:`reap` handles its exit by ``role`` on the next step."""
        st.role = role
        if st.alive:
            st.killed = True
            st.proc.kill()

    def route(self, app_name: str) -> None:
        """Point the ingest's route for the app at its active instances (ready or loading) and its
        ready CPU overflow instance."""
        app = self.apps[app_name].cfg
        consumers = [st.spec.consumer for st in self.instances.values()
                     if st.app == app_name and not st.ended
                     and (st.role == Role.ACTIVE or (st.role == Role.OVERFLOW and st.ready))]
        self.ingest.set_route(app.app_id, consumers)
        if self.overflow is not None and app_name in self.overflow.pools:
            self.overflow.reroute(self.instances.values(), self.ingest)

    def start_all(self, shares: dict[str, CpuShare], handle: Callable[[Any], None],
                  stopping: Callable[[], bool]) -> list[Unavailable]:
        """Start-up: spawn every app's instances and wait for each READY (``ready_timeout_s``); other
        messages go to ``handle``. Param-Share: the first instance of each model exports its weights; the
        others start once the export exists and map it instead of loading their own copy. A model of the
        model repository that fails to start (a file its engine cannot run) is UNAVAILABLE alone (returned,
        see :meth:`drop_apps`); every other app starts all-or-nothing (SupervisionError)."""
        later: list[tuple[AppConfig, str]] = []
        for app in self.cfg.apps:
            for i in range(self.apps[app.name].instances):
                name = f"{app.name}-{i}"
                if self.params.exported(app):
                    later.append((app, name))
                else:
                    self.spawn(app, name, shares.get(name))
        from_repository = {a.name for a in self.cfg.apps if a.file is not None and a.file.repository is not None}
        self.await_ready([st for st in self.instances.values() if st.app not in from_repository],
                         self.ready_timeout_s, handle, stopping)
        failed: dict[str, str] = {}
        for name in sorted(from_repository):
            try:  # (a Ready taken while another app was awaited has marked its instance ready already)
                self.await_ready([st for st in self.instances.of(name) if not st.ready], self.ready_timeout_s,
                                 handle, stopping)
            except SupervisionError as e:
                if stopping():
                    raise
                failed[name] = str(e)
        dropped = self.drop_apps(failed) if failed else []
        if later:
            self.await_ready([self.spawn(app, name, shares.get(name)) for app, name in later],
                             self.ready_timeout_s, handle, stopping)
        return dropped

    def drop_apps(self, failed: dict[str, str]) -> list[Unavailable]:
        """Start-up: take the repository models whose instances failed to start out of the node; each is
        returned UNAVAILABLE with its reason, and the other apps start without them. Every instance of
        theirs is killed first (none of them is then taken for a crashed active to replace), waited for
        and reaped."""
        mine = [st for st in self.instances.values() if st.app in failed]
        for st in mine:
            self.kill(st)
        deadline = time.monotonic() + self.stop_timeout_s
        for st in mine:
            with contextlib.suppress(subprocess.TimeoutExpired):
                st.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        self.reap()
        out = []
        for name, why in sorted(failed.items()):
            # Its own words, where an instance's Error was taken while another app was awaited.
            why = next((f"instance {st.name} failed to start: {self.last_errors[st.name]}" for st in mine
                        if st.app == name and st.name in self.last_errors), why)
            cfg = self.apps.pop(name).cfg
            log.error("model %s is UNAVAILABLE: %s", name, why)
            out.append(Unavailable(repository_model_of(cfg) or name,
                                   str(cfg.file.version) if cfg.file is not None else "", why))
            self.record({"event": "model_unavailable", "app": name, "reason": why})
        return out

    def await_ready(self, pending: list[InstanceState], timeout_s: float, handle: Callable[[Any], None],
                    stopping: Callable[[], bool] = lambda: False) -> None:
        """Wait for every instance in ``pending`` to report Ready (start-up); other messages go to ``handle``.
        ``stopping()`` turning true (SIGINT/SIGTERM during start) ends the wait with an error."""
        waiting = {st.name for st in pending}
        deadline = time.monotonic() + timeout_s
        while waiting:
            if stopping():
                raise SupervisionError("interrupted while starting (SIGINT/SIGTERM)")
            left = deadline - time.monotonic()
            if left <= 0:
                raise SupervisionError(f"instance(s) {', '.join(sorted(waiting))} sent no READY within "
                                       f"{timeout_s:.0f} s; raise ready_timeout_s (--ready-timeout) if the "
                                       "models need longer to load")
            item = self.server.poll(min(left, 0.2) * 1000)
            if item is not None:
                msg = item.msg
                if isinstance(msg, Ready) and msg.instance in waiting:
                    self.mark_ready(self.instances[msg.instance], msg)
                    waiting.discard(msg.instance)
                elif isinstance(msg, Error) and msg.instance in waiting:
                    raise SupervisionError(f"instance {msg.instance} failed to start: {msg.kind}: {msg.message}")
                else:
                    handle(item)
            for name in list(waiting):
                rc = self.instances[name].proc.poll()
                if rc is not None:
                    why = self._last_words(name, handle)
                    raise SupervisionError(f"instance {name} failed to start: {why}" if why else
                                           f"instance {name} exited with status {rc} before READY (see its log above)")

    def _last_words(self, name: str, handle: Callable[[Any], None], wait_s: float = 2.0) -> str | None:
        """The Error an instance that just exited sent before it went (its message can trail the exit on
        a busy machine), or None."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            item = self.server.poll(50)
            if item is None:
                continue
            if isinstance(item.msg, Error) and item.msg.instance == name:
                return f"{item.msg.kind}: {item.msg.message}"
            handle(item)
        return None

    @staticmethod
    def mark_ready(st: InstanceState, msg: Ready) -> None:
        st.ready, st.initialized = True, bool(msg.info.get("initialized"))
        st.last_beat, st.info = time.monotonic(), dict(msg.info)

    # -- the loop's duties -------------------------------------------------------------------------------
    def reap(self) -> list[InstanceState]:
        """Handle every instance that exited since the last call (see the module docstring); returns them.
        A dead Param-Share holder is handled first: an instance that left because its weights died with
        the holder (a lost CUDA context) is then still counted among the holder's users, and its
        replacement maps a new holder's copy, never the dead one's."""
        self._reap_holders()
        gone = []
        for st in list(self.instances.values()):
            rc = st.proc.poll()
            if rc is None:
                continue
            del self.instances[st.name]
            gone.append(st)
            self.params.instance_exited(st.name)
            app = self.apps[st.app]
            if st.role == Role.SHADOW:
                self._release(st)
                st.error = st.error or f"exited with status {rc}"
                self._shadow_failed(st.app)
                log.error("shadow %s exited (status %s)", st.name, rc)
                self.record({"event": "shadow_died", "app": st.app, "instance": st.name, "rc": rc})
                continue
            app.retire(st)
            if self.overflow is not None:
                self.overflow.retire(st)
            if st.role == Role.OVERFLOW:
                self._overflow_lost(st, rc)
                continue
            if st.role == Role.ACTIVE and not st.ended:
                self._replace(st, rc)
                continue
            failed, requeued = self._release(st)
            if st.role == Role.FINISHING and not st.ended:
                # Died while draining during a switch: what it held goes to the new active.
                app.failed_by_crash += failed
                app.requeued_by_crash += requeued
                if st.killed:  # the change killed it (a replacement still starting, or a drain timed out)
                    log.info("%s killed by its change (status %s): %d requeued, %d answered INSTANCE_FAILED",
                             st.name, rc, requeued, failed)
                else:
                    log.error("%s died while draining (status %s): %d requeued, %d answered INSTANCE_FAILED",
                              st.name, rc, requeued, failed)
                self.record({"event": "killed_draining" if st.killed else "died_draining", "app": st.app,
                             "instance": st.name, "failed": failed, "requeued": requeued})
        # After the replacements above took their copies, never between an exit and its replacement.
        self.params.release_unused()
        return gone

    def _reap_holders(self) -> None:
        """A Param-Share holder that died took its arena with it: every instance that mapped it is
        killed (SIGKILL, its role kept), so the next :meth:`reap` replaces it by the rules above."""
        for gone in self.params.reap_holders():
            h = gone.export.holder
            pid = h.pid if h is not None else -1
            if not gone.exported:
                log.error("the holder of the shared weights %s (pid %d) exited (status %s) before exporting them; "
                          "the instances waiting for them fail with its reason", gone.export.key, pid, gone.rc)
            else:
                log.error("the holder of the shared weights %s (pid %d) died (status %s); restarting the %d "
                          "instance(s) that mapped them", gone.export.key, pid, gone.rc, len(gone.users))
            self.record({"event": "holder_died", "key": gone.export.key, "pid": pid, "rc": gone.rc,
                         "exported": gone.exported, "users": list(gone.users)})
            if not gone.exported:
                continue
            for name in gone.users:
                st = self.instances.get(name)
                if st is not None and st.alive:
                    log.error("restarting %s: the weights it mapped died with their holder", name)
                    st.killed = True
                    st.proc.kill()

    def check_hangs(self, now: float, timeout_s: float) -> None:
        """Kill active instances that have been serving but sent no heartbeat for ``timeout_s``."""
        for st in list(self.instances.values()):
            if (st.role in (Role.ACTIVE, Role.OVERFLOW) and st.initialized and st.alive and st.last_beat
                    and now - st.last_beat > timeout_s):
                log.error("%s sent no heartbeat for %.1f s (node.hang_timeout_s %.1f); killing it as hung",
                          st.name, now - st.last_beat, timeout_s)
                self.apps[st.app].hangs += 1
                self.record({"event": "hung", "app": st.app, "instance": st.name})
                st.proc.kill()  # stays "active": reap() replaces it and requeues what it held

    def refill_shadows(self, now: float, busy: set[str]) -> None:
        """Start a shadow for every app that wants one and has none (not while a change of it runs)."""
        if self.placement.scheduled:
            return
        for name, app in self.apps.items():
            if not app.cfg.warm_shadow or name in busy or self.shadow_of(name) is not None:
                continue
            if now < self._shadow_not_before.get(name, 0.0):
                continue
            try:
                st = self.spawn_shadow(name)
            except SupervisionError as e:
                log.error("cannot start a shadow of %s: %s", name, e)
                self._shadow_failed(name)
                continue
            app.shadow_restarts += 1
            self.record({"event": "shadow_started", "app": name, "instance": st.name})

    # -- CPU overflow (issue 18) ----------------------------------------------------------------------------
    def spawn_overflow(self, app_name: str) -> InstanceState:
        """Start the app's CPU overflow instance on its pool's cores; routed to once it is ready."""
        assert self.overflow is not None
        return self.spawn(self.apps[app_name].cfg, self.next_name(app_name, "c"), self.overflow.share(app_name),
                          gpu_pct=100, role=Role.OVERFLOW)

    def overflow_of(self, app_name: str) -> InstanceState | None:
        """The app's CPU overflow instance (ready or starting), if there is one."""
        return next(iter(self.instances.of(app_name, Role.OVERFLOW)), None)

    def refill_overflow(self, now: float) -> None:
        """Start a CPU instance for every overflowing app that has none (after its back-off)."""
        if self.overflow is None:
            return
        for name in self.overflow.pools:
            if self.overflow_of(name) is not None or now < self._overflow_not_before.get(name, 0.0):
                continue
            try:
                st = self.spawn_overflow(name)
            except SupervisionError as e:
                log.error("cannot start the CPU overflow instance of %s: %s", name, e)
                self._overflow_backoff(name)
                continue
            self.record({"event": "overflow_started", "app": name, "instance": st.name})

    def overflow_ok(self, st: InstanceState) -> None:
        """The app's CPU instance became ready: route to it and reset its back-off."""
        self._overflow_failures.pop(st.app, None)
        self._overflow_not_before.pop(st.app, None)
        self.route(st.app)

    def _overflow_backoff(self, app_name: str) -> None:
        n = self._overflow_failures.get(app_name, 0) + 1
        self._overflow_failures[app_name] = n
        self._overflow_not_before[app_name] = time.monotonic() + min(SHADOW_BACKOFF_MAX_S, 2.0 ** (n - 1))

    def _overflow_lost(self, st: InstanceState, rc: int) -> None:
        """A CPU overflow instance exited: off the route, what it held to the accelerator (see the
        module docstring), counted; ``refill_overflow`` starts the next one."""
        app = self.apps[st.app]
        self.route(st.app)
        failed, requeued = self._release(st)
        app.failed_by_crash += failed
        app.requeued_by_crash += requeued
        if self.overflow is not None:
            self.overflow.lost(st.app)
        self._overflow_backoff(st.app)
        log.error("CPU overflow instance %s (pid %d) exited (status %s): %d held request(s) requeued to the "
                  "accelerator, %d answered INSTANCE_FAILED", st.name, st.pid, rc, requeued, failed)
        self.record({"event": "overflow_died", "app": st.app, "instance": st.name, "rc": rc, "failed": failed,
                     "requeued": requeued})

    def shadow_ok(self, app_name: str) -> None:
        """A shadow of the app became ready: reset its back-off."""
        self._shadow_failures.pop(app_name, None)
        self._shadow_not_before.pop(app_name, None)

    def _shadow_failed(self, app_name: str) -> None:
        n = self._shadow_failures.get(app_name, 0) + 1
        self._shadow_failures[app_name] = n
        self._shadow_not_before[app_name] = time.monotonic() + min(SHADOW_BACKOFF_MAX_S, 2.0 ** (n - 1))

    def _release(self, st: InstanceState, *, requeue: bool = True) -> tuple[int, int]:
        """Reclaim what a gone instance still held (requeued to the app's actives, or answered
        INSTANCE_FAILED by the ingest), then free its consumer endpoint."""
        try:
            failed, requeued = self.ingest.reclaim(st.spec.consumer, requeue=requeue)
        finally:
            self.free_consumers.insert(0, st.spec.consumer)
        return int(failed), int(requeued)

    def _replace(self, st: InstanceState, rc: int) -> None:
        """An active instance died: replacement first, then reclaim (see the module docstring)."""
        app = self.apps[st.app]
        self.on_lost(st)
        share = None
        if self.backend == "cpu" and st.spec.cores:
            share = CpuShare(cores=list(st.spec.cores), threads=st.spec.threads or 1, gpu_pct=st.spec.gpu_pct)
        new: InstanceState | None = None
        try:
            new = self.spawn(app.cfg, self.next_name(st.app, "r"), share, gpu_pct=st.spec.gpu_pct)
            new.replaces = st.name  # a change that was replacing st replaces this one instead
        except SupervisionError as e:
            log.error("cannot replace %s: %s", st.name, e)
        self.route(st.app)
        # A replacement that never became ready fails what it held rather than pass it on again.
        failed, requeued = self._release(st, requeue=st.ready)
        app.failed_by_crash += failed
        app.requeued_by_crash += requeued
        app.restarts += 1
        why = f"signal {-rc}" if rc < 0 else f"status {rc}"
        log.error("instance %s (pid %d) died (%s): %d held request(s) answered INSTANCE_FAILED, %d requeued to %s",
                  st.name, st.pid, why, failed, requeued, new.name if new else "no replacement")
        self.record({"event": "crash", "app": st.app, "instance": st.name, "rc": rc, "failed": failed,
                     "requeued": requeued, "replacement": new.name if new else None})

    def shutdown(self, drain: bool, timeout_s: float, pump: Callable[[float], None]) -> None:
        """Stop every instance: Shutdown (draining what it holds when ``drain``), then SIGTERM, then SIGKILL.
        ``pump(ms)`` runs the control loop's receive side while waiting."""
        for st in self.instances.values():
            st.role = Role.STOPPING
            if not st.ready:
                # Still starting (a shadow importing at low priority can take seconds on a busy
                # machine): it holds no request and cannot be told yet, so it is not waited for.
                log.info("%s had not started yet; terminating", st.name)
                with contextlib.suppress(OSError):
                    st.proc.terminate()
                continue
            try:
                self.server.send(st.name, Shutdown(instance=st.name, drain=drain and st.initialized))
            except Exception as e:  # a dead peer cannot be told; it is reaped below
                log.debug("could not send Shutdown to %s: %s", st.name, e)
        deadline = time.monotonic() + (timeout_s if drain else 2.0)
        while time.monotonic() < deadline and any(st.alive for st in self.instances.values()):
            pump(50)
        for st in self.instances.values():
            if st.alive:
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
            if st.role != Role.SHADOW:
                self.apps[st.app].retire(st)
            self.params.instance_exited(st.name)
        self.instances.clear()
        # Importers first, then the weights' holders (CUDA frees an exported arena with its process).
        self.params.stop_holders()
