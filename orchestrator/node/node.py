"""The node: packet pool, native ingest, and the parts that run the inference instances.

``Node(cfg).start()`` is all-or-nothing: it creates the private run directory, the shared packet pool
and the ingest, starts every instance through the launcher (by default a fork server, which forks each
instance from an interpreter that has imported the worker already: orchestrator/worker/forkserver.py;
``python -m orchestrator.worker.launch`` is the plain way) and waits for each READY within
``ready_timeout_s`` (the error names that setting); if any fails, everything started is torn down and
the error says which instance failed and why. ``serve()`` then runs the node's one loop until
``stop()``; each :meth:`~orchestrator.node.core.NodeCore.step` receives heartbeats and commands, then runs the loop's duties in
order: the supervisor reaps, replaces and refills instances, the running changes of share advance, the
monitor samples, the metrics update. ``stop()`` drains: routes are removed, each instance serves what
it already holds and reports ``Ended``; stragglers get SIGTERM then SIGKILL; the ingest, the pool (its
shared memory is unlinked) and the run directory go last.

The node is assembled apart from its loop (vLLM's ``EngineCore`` / ``EngineCoreProc``): :class:`Node`
starts and stops the parts of :class:`~orchestrator.node.core.NodeCore`, which holds them and runs the loop.

- orchestrator/node/assembly.py builds each part into the node's ``ExitStack`` with its undoing, so
  stopping is the stack unwinding (the order is said there);
- orchestrator/node/loop.py: the loop's duties, each counted and timed (``status`` node.duties);
- orchestrator/node/handlers.py: the control messages, dispatched through a table;
- orchestrator/node/view.py: what ``status`` shows.

Each part has one role:

- :class:`~orchestrator.node.placement.Placement`: sizing (Multi-Model), shares, CPU core sets;
- :class:`~orchestrator.node.supervisor.Supervisor`: processes, routes, crashes, hangs, shadows; what
  changes and repository operations act through;
- :class:`~orchestrator.node.param_share.ParamShare`: who exported which weights;
- :class:`~orchestrator.node.reconfig.Changes`: changes of share as objects the loop advances;
- ``orchestrator.node.dispatch.LiveScheduler`` under ``node.scheduler`` spatiotemporal/temporal.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from contextlib import ExitStack
from typing import Any

from gpuprims.backend import resolve_backend
from orchestrator.config.schema import engine_problems
from orchestrator.control.errors import StartError
from orchestrator.control.messages import Ended, Heartbeat
from orchestrator.frontdoor.security import TlsError, load_tls
from orchestrator.node import assembly
from orchestrator.node.assembly import read_bearer_token, read_repository_token
from orchestrator.node.core import NodeCore
from orchestrator.node.cpu_overflow import NodeOverflow, OverflowSetupError
from orchestrator.node.loop import ThreadPinning
from orchestrator.node.mps import MpsUnavailable
from orchestrator.node.param_share import ParamShare
from orchestrator.node.repository import Repository, RepositoryPoller
from orchestrator.node.state import AppState, InstanceState
from orchestrator.node.supervisor import Supervisor

__all__ = ["AppState", "InstanceState", "Node", "StartError", "install_signal_handlers", "read_bearer_token",
           "read_repository_token"]

log = logging.getLogger("gpuprims.node")


class Node(NodeCore):
    """One gpuprims node (see the module docstring)."""

    # -- start ---------------------------------------------------------------------------------------
    def start(self) -> Node:
        """Start everything or nothing (see the module docstring)."""
        with self._lock:
            if self._stack is not None:
                raise StartError("the node is running already")
            self._stack = ExitStack()
        try:
            self._start(self._stack)
        except BaseException:
            self._teardown(drain=False)
            raise
        return self

    def _start(self, stack: ExitStack) -> None:
        node = self.cfg.node
        # isolated: the probe runs in a child, so the orchestrator itself never holds a CUDA context.
        self.backend = self.placement.backend = resolve_backend(node.backend, isolated=True)
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
        self.run_dir = assembly.open_run_dir(stack, node.run_dir, self.token)
        if self.backend == "cpu" and node.pin_node_threads:
            self.pinning = ThreadPinning(self.instances, None)
            stack.callback(self.pinning.release)
        if self.backend == "cuda":
            self.mps = assembly.start_mps(stack, self.run_dir, node.mps)
        try:
            self.overflow = NodeOverflow.plan(self.cfg)
        except OverflowSetupError as e:
            raise StartError(str(e)) from None
        if self.pinning is not None:
            self.pinning.overflow = self.overflow
        assembly.plan_apps(self.cfg, self.apps, self.placement)
        if self.scheduled and self.monitor is not None:
            log.info("autoscale is off under node.scheduler %r: the scheduler owns the shares", node.scheduler)
            self.monitor = None
        polls = node.model_repository is not None and node.model_control_mode == "poll"
        consumers = assembly.consumer_count(self.cfg, self.apps, len(self.overflow.pools) if self.overflow else 0,
                                            node.repository.enabled or polls)
        self.pool = assembly.open_pool(stack, self.cfg, consumers, self.run_dir)
        self.server = assembly.open_control(stack, self.control_kind, self.run_dir, self.token)
        self.ingest = assembly.start_ingest(stack, self.cfg, self.pool)
        if node.metrics_enabled:
            self.metrics = assembly.start_metrics(stack, node.metrics_port)
        self.params = ParamShare(self.run_dir, enabled=self.share_params)
        stack.callback(self.params.remove_all)
        sup = self.supervisor = Supervisor(
            self.cfg, self.apps, self.instances, pool=self.pool, ingest=self.ingest, server=self.server,
            token=self.token, run_dir=self.run_dir, placement=self.placement, params=self.params,
            backend=self.backend, launcher=self.launcher, heartbeat_ms=self.heartbeat_ms, warmup=self.warmup,
            consumers=consumers, changes=self.changes, mps=self.mps, ready_timeout_s=self.ready_timeout_s,
            stop_timeout_s=self.stop_timeout_s, record=self.record, on_lost=self._instance_lost,
            overflow=self.overflow)
        self.changes.host = sup
        stack.callback(lambda: sup.shutdown(self._stop_drain, self.stop_timeout_s, self._pump))
        stack.callback(self._unroute_all)
        stack.callback(self.changes.cancel_all, "the node is stopping")
        self.unavailable += sup.start_all(self.placement.plan_shares(), self._handle, self._stop.is_set)
        if self.mps is not None:
            try:  # every instance must be the MPS daemon's client at its percentage, or run without a limit
                self.mps.check_clients({st.pid: st.spec.gpu_pct for st in self.instances.values()})
            except MpsUnavailable as e:
                raise StartError(f"node.mps is 'require' but an instance is not an MPS client: {e}") from e
        if self.overflow is not None:
            self._start_overflow(sup, self.overflow)
        if self.scheduled:
            self.dispatcher = assembly.build_dispatcher(self.cfg, self.apps, self.instances, self.placement,
                                                        self.pool, self.server, self.backend)
        for app in self.cfg.apps:
            if app.name in self.apps:  # (not a repository model that failed to start: UNAVAILABLE)
                sup.route(app.name)
                if app.warm_shadow and not self.scheduled:
                    sup.spawn_shadow(app.name)
        if self.overflow is not None:
            self.overflow.update(self.instances.values(), self.ingest, time.monotonic(), force=True)
        if node.repository.enabled:
            self.repository_token = read_repository_token(node.repository)
        if node.repository.enabled or polls:
            self.repository = Repository(sup)
        if polls:
            assert node.model_repository is not None
            self.poller = RepositoryPoller(node.model_repository, node.repository_poll_s, slo_ms=node.repository_slo_ms,
                                           backend=self.backend).start()
            log.info("polling the model repository %s every %g s", node.model_repository, node.repository_poll_s)
        stack.callback(self._close_repository)
        if node.frontdoor_enabled:
            self.frontdoor = sup.frontdoor = assembly.start_node_frontdoor(
                stack, self.cfg, self.apps, self.ingest, repository=self.repository,
                repository_token=self.repository_token, unavailable=self.unavailable, tls=self.tls,
                inference_token=self.inference_token)
            stack.callback(self._close_repository)  # (again) before the front door: its requests may wait on it
        self._add_duties()
        if self.pinning is not None:
            self.duties.call("pinning", time.monotonic())
        self.started_at = time.monotonic()
        log.info("node up: %d app(s), %d instance(s), listening on %s:%s, run dir %s", len(self.apps),
                 len(self.instances), node.listen.host, ",".join(map(str, self.ingest.ports)), self.run_dir)

    def _start_overflow(self, sup: Supervisor, ov: NodeOverflow) -> None:
        """Start each overflowing app's CPU instance (its pool's cores) and its decision point."""
        sup.await_ready([sup.spawn_overflow(name) for name in ov.pools], self.ready_timeout_s, self._handle,
                        self._stop.is_set)
        for name in ov.pools:
            a = self.apps[name]
            ov.attach(a.cfg, self.placement.profile_of, a.instances)
            log.info("CPU overflow of %s on cores %s (alpha %.3g ms)", name, list(ov.pools[name].cores),
                     ov.pools[name].alpha_ms)

    def _unroute_all(self) -> None:
        assert self.ingest is not None
        for a in self.apps.values():
            with contextlib.suppress(Exception):
                self.ingest.set_route(a.cfg.app_id, [])

    def _close_repository(self) -> None:
        """Stop polling and fail the running repository operations (both may be done twice)."""
        if self.poller is not None:
            self.poller.close()
        if self.repository is not None:
            self.repository.close()

    # -- running ---------------------------------------------------------------------------------------
    def serve(self, *, duration_s: float | None = None) -> None:
        """Run the control loop until stop() is called (or a stop command / signal arrives)."""
        end = None if duration_s is None else time.monotonic() + duration_s
        while not self._stop.is_set() and (end is None or time.monotonic() < end):
            self.step(100)
        if self._stop.is_set():
            self._teardown(drain=self._stop_drain)

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

    def _teardown(self, drain: bool) -> None:
        """Unwind the parts once (orchestrator/node/assembly.py says the order); later calls do nothing."""
        with self._lock:
            stack, self._stack = self._stack, None
            if stack is None:
                return
            self._stop_drain = drain
            self._stop.set()
            try:
                stack.close()
            finally:
                self.server = self.pool = self.metrics = self.mps = self.frontdoor = None
                self.instances.clear()

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
