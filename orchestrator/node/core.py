"""The node's core: its tables, the loop you can step, and what it answers (vLLM's ``EngineCore``).

:class:`NodeCore` holds the node's parts (set by :class:`orchestrator.node.node.Node`, which assembles
them and undoes them) and runs its one loop: each :meth:`NodeCore.step` takes the control messages
(dispatched through orchestrator/node/handlers.py's table) and the live scheduler's ticks for up to its
timeout, then runs the loop's duties in order (orchestrator/node/loop.py), each counted and timed:
reap, hangs, memory, changes, the repository, shadows, CPU overflow, thread pinning, the monitor and
the metrics. ``status`` shows the node (orchestrator/node/view.py) with what each duty has cost.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from gpuprims.ingest import Ingest
from gpuprims.pool import PacketPool
from orchestrator.config.schema import NodeConfig
from orchestrator.control.channel import ControlServer, Incoming, new_token
from orchestrator.control.errors import ChangeError, StartError
from orchestrator.control.records import NodeView
from orchestrator.frontdoor import FrontDoor
from orchestrator.frontdoor.core import Unavailable
from orchestrator.frontdoor.security import ServerTls
from orchestrator.node.cpu_overflow import NodeOverflow
from orchestrator.node.dispatch import LiveScheduler
from orchestrator.node.handlers import handle
from orchestrator.node.launcher import ForkLauncher, Launcher
from orchestrator.node.loop import Duties, RepositoryPolling, ThreadPinning
from orchestrator.node.metrics import MetricsServer
from orchestrator.node.mps import MpsDaemon
from orchestrator.node.param_share import ParamShare
from orchestrator.node.placement import Placement
from orchestrator.node.reconfig import Change, Changes
from orchestrator.node.repository import Repository, RepositoryPoller
from orchestrator.node.state import AppState, InstanceState, InstanceTable
from orchestrator.node.supervisor import Supervisor
from orchestrator.node.view import node_status, node_view

log = logging.getLogger("gpuprims.node")

EVENTS_KEPT = 1000


class NodeCore:
    """A node's tables and loop (see the module docstring); :class:`orchestrator.node.node.Node` starts it."""

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
        # How instances are started: forked from a fork server (python -m orchestrator.worker.launch), or a test's double.
        self.launcher: Launcher = launcher if launcher is not None else ForkLauncher(python)
        self.control_kind = control_kind
        self.heartbeat_ms = heartbeat_ms
        self.warmup = warmup
        self.backend = "cpu"
        self.token = new_token()
        self.apps: dict[str, AppState] = {}
        self.instances: InstanceTable = InstanceTable()
        self.placement = Placement(cfg, self.apps, backend=self.backend)
        self.changes = Changes(None, self._check_change, apps=self.apps, record=self.record,
                               timeout_s=cfg.node.change_timeout_s)  # acting through the supervisor once it is up
        self.events: list[dict[str, Any]] = []
        self.errors: dict[str, int] = {}  # loop failures by where they happened (each logged)
        self.duties = Duties(self.errors)  # the loop (orchestrator/node/loop.py); the rest are added by start()
        self.duties.add("messages", self._handle, "message", each_pass=False)
        self.duties.add("dispatch", lambda: self.dispatcher.tick() if self.dispatcher is not None else None,
                        each_pass=False)
        self.monitor = monitor  # orchestrator.node.monitor.Monitor: automatic GPU% changes when set
        self.share_params = share_params  # Param-Share between instances of the same model
        if monitor is not None and monitor.needed_pct is None:
            monitor.needed_pct = self.placement.needed_pct
        #: Models of node.model_repository that cannot be served (the front door's index lists them).
        self.unavailable: list[Unavailable] = [Unavailable(u.name, u.version, u.reason) for u in cfg.unavailable]
        # The parts (orchestrator/node/assembly.py), set by start() and undone by stop().
        self.run_dir: Path | None = None
        self.mps: MpsDaemon | None = None
        self.overflow: NodeOverflow | None = None  # CPU overflow of apps with `overflow: cpu` (issue 18)
        self.pool: PacketPool | None = None
        self.ingest: Ingest | None = None
        self.server: ControlServer | None = None
        self.metrics: MetricsServer | None = None
        self.params: ParamShare | None = None
        self.supervisor: Supervisor | None = None
        self.dispatcher: LiveScheduler | None = None
        self.repository: Repository | None = None  # load/unload at run time (node.repository; docs/oip.md)
        self.poller: RepositoryPoller | None = None  # model_control_mode poll: the repository read again
        self.frontdoor: FrontDoor | None = None  # Open Inference Protocol over HTTP/gRPC (node.http_port/grpc_port)
        self.repository_token: str | None = None
        self.tls: ServerTls | None = None  # node.tls, read at start
        self.inference_token: str | None = None  # node.auth's, read at start
        self.pinning: ThreadPinning | None = None  # cpu backend, node.pin_node_threads
        self._stack: ExitStack | None = None
        self._stop = threading.Event()
        self._stop_drain = True
        self.started_at = 0.0
        self._lock = threading.RLock()

    @property
    def changing(self) -> set[str]:
        """Apps with a change of share running (no second one may start)."""
        return self.changes.changing

    @property
    def scheduled(self) -> bool:
        """True when a live scheduler (``node.scheduler`` spatiotemporal or temporal) drives the instances."""
        return self.placement.scheduled

    @property
    def own_cores(self) -> list[int] | None:
        """CPU backend: the cores this process's threads are kept on (None: anywhere)."""
        return self.pinning.cores if self.pinning is not None else None

    @property
    def last_errors(self) -> dict[str, str]:
        """Instance -> the last Error it reported (kept after it is gone)."""
        return self.supervisor.last_errors if self.supervisor is not None else {}

    def record(self, event: dict[str, Any]) -> None:
        """Keep an event (with its time) for status and tests."""
        self.events.append({"t": time.monotonic(), **event})
        del self.events[:-EVENTS_KEPT]

    def _instance_lost(self, st: InstanceState) -> None:
        if self.dispatcher is not None:
            self.dispatcher.instance_lost(st.name)

    def shadow_of(self, app_name: str) -> InstanceState | None:
        """A live shadow of the app (ready or still starting), if there is one."""
        if self.supervisor is None:
            raise StartError("the node is not running")
        return self.supervisor.shadow_of(app_name)

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

    # -- the loop ------------------------------------------------------------------------------------
    def step(self, timeout_ms: float = 100.0) -> None:
        """One pass of the loop: the messages (and the live scheduler's ticks) for up to ``timeout_ms``,
        then every duty once. A failure in one duty is logged and counted and never stops the loop."""
        assert self.server is not None and self.supervisor is not None
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            wait_ms = max(0.0, deadline - time.monotonic()) * 1000
            if self.dispatcher is not None:
                wait_ms = min(wait_ms, self.dispatcher.wait_ms())
            item = self.server.poll(wait_ms)
            if item is not None:
                self.duties.call("messages", item)
            if self.dispatcher is not None:
                self.duties.call("dispatch")
            if time.monotonic() >= deadline or (item is None and self.dispatcher is None):
                break
        self.duties.run(time.monotonic())

    def request_stop(self, drain: bool = True) -> None:
        """Ask serve() to stop (safe from signal handlers and other threads)."""
        self._stop_drain = drain
        self._stop.set()

    def _handle(self, item: Incoming) -> None:
        handle(self, item)

    def reply(self, item: Incoming, msg: Any) -> None:
        """Answer a command (orchestrator/node/handlers.py)."""
        assert self.server is not None
        self.server.reply(item, msg)

    def _add_duties(self) -> None:
        """The loop's duties after the messages, in order (orchestrator/node/loop.py)."""
        sup, d = self.supervisor, self.duties
        assert sup is not None
        d.add("reap", lambda now: sup.reap(), "supervision")
        d.add("hangs", lambda now: sup.check_hangs(now, self.cfg.node.hang_timeout_s), "supervision")
        d.add("memory", sup.sample_memory)
        d.add("changes", lambda now: self.changes.advance())
        if self.poller is not None and self.repository is not None:
            d.add("repository_poll", RepositoryPolling(self.poller, self.repository, self.apps, self.record),
                  "repository")
        if self.repository is not None:
            d.add("repository", lambda now, repo=self.repository: repo.advance())
        d.add("shadows", self._refill_shadows, "supervision")
        if self.overflow is not None:
            ov, ingest = self.overflow, self.ingest
            d.add("overflow_refill", sup.refill_overflow, "overflow")
            d.add("overflow_update", lambda now: ov.update(self.instances.values(), ingest, now), "overflow")
        if self.pinning is not None:
            d.add("pinning", self.pinning)
        if self.monitor is not None:
            monitor = self.monitor
            d.add("monitor", lambda now: monitor.autoscale(self, now), interval_s=monitor.policy.interval_s)
        if self.metrics is not None:
            metrics = self.metrics
            d.add("metrics", lambda now: metrics.update(self.view()))

    def _refill_shadows(self, now: float) -> None:
        assert self.supervisor is not None
        settling = self.changes.settling(now, self.cfg.node.shadow_settle_s)
        if self.repository is not None:
            settling |= self.repository.busy
        self.supervisor.refill_shadows(now, set(self.changes.running) | settling)

    # -- status ---------------------------------------------------------------------------------------
    def view(self) -> NodeView:
        """The node now, by field (orchestrator/node/view.py): what its parts read."""
        return node_view(self)

    def status(self) -> dict[str, Any]:
        """A JSON-able snapshot: node, ingest counters and drops, per app and instance statistics, changes
        (the view's JSON, for the control edge), and what each duty of the loop has cost (``node.duties``)."""
        out = node_status(self)
        out["node"]["duties"] = self.duties.status()
        return out
