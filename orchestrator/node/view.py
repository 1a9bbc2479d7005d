"""What a node is, read at one moment: :func:`node_view` builds a :class:`NodeView` from the node's
parts, and the status reply's dict is that view's ``to_dict()``.

:func:`node_view` reads the parts a running node holds (:class:`NodeParts`) and never changes them.
Inside the node process its parts read the view by field (the monitor's `Monitor.sample`); the JSON
(`node_status`) is made only for the control edge: the ``StatusReply``, the metrics exporter and the CLI.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from gpuprims.ingest import Ingest
from orchestrator.control.channel import ControlServer
from orchestrator.control.records import AppView, InstanceView, NodeView, Role
from orchestrator.node.cpu_overflow import NodeOverflow
from orchestrator.node.dispatch import LiveScheduler
from orchestrator.node.launcher import ForkLauncher, Launcher
from orchestrator.node.mps import MpsDaemon
from orchestrator.node.param_share import ParamShare
from orchestrator.node.placement import Placement
from orchestrator.node.reconfig import Changes
from orchestrator.node.repository import Repository
from orchestrator.node.state import AppState, InstanceState, InstanceTable
from orchestrator.node.supervisor import Supervisor


class NodeParts(Protocol):
    """The parts of a node its view is read from (:class:`orchestrator.node.node.Node` has them)."""

    backend: str
    run_dir: Path | None
    mps: MpsDaemon | None
    ingest: Ingest | None
    server: ControlServer | None
    supervisor: Supervisor | None
    launcher: Launcher
    placement: Placement
    apps: dict[str, AppState]
    instances: InstanceTable
    changes: Changes
    overflow: NodeOverflow | None
    dispatcher: LiveScheduler | None
    params: ParamShare | None
    repository: Repository | None
    events: list[dict[str, Any]]
    errors: dict[str, int]
    own_cores: list[int] | None
    started_at: float


def device_label(backend: str, dev: int) -> int | str:
    """How status names a device: the GPU index on cuda, ``"cpu"`` on the CPU backend."""
    return dev if backend == "cuda" else "cpu"


def ready_engine(info: Mapping[str, Any]) -> dict[str, Any] | None:
    """The engine an instance's Ready described: its own, or (a shadow's warm Ready) the pre-warm's."""
    if info.get("engine"):
        return info["engine"]
    warm = info.get("engine_prewarm") or {}
    return warm.get("main") or ({"stages": warm} if warm else None)


def instance_view(node: NodeParts, st: InstanceState) -> InstanceView:
    """One instance as the node sees it now."""
    sup = node.supervisor
    return InstanceView(
        name=st.name, pid=st.pid, role=Role(st.role), ready=st.ready, gpu_pct=st.spec.gpu_pct,
        gpu=device_label(node.backend, st.spec.gpu), consumer=st.spec.consumer,
        cores=None if st.spec.cores is None else tuple(st.spec.cores), warm=bool(st.info.get("warm")),
        prewarm=st.info.get("prewarm"), stats=st.stats,
        # the heartbeat's; before the first one, what its (warm) Ready said
        engine=(st.stats.engine if st.stats is not None else None) or ready_engine(st.info),
        memory=sup.instance_memory(st).to_dict() if sup is not None else None)


def app_view(node: NodeParts, name: str, a: AppState) -> AppView:
    """One app as the node sees it now: its instances, its statistics, its running change."""
    sup = node.supervisor
    mine = [st for st in node.instances.values() if st.app == name]
    running = node.changes.running.get(name)
    return AppView(
        name=name, app_id=a.cfg.app_id, model=a.cfg.model, slo_ms=a.cfg.slo_ms, gpu_pct=a.gpu_pct,
        gpu=device_label(node.backend, node.placement.device_of(name)),
        instances=tuple(instance_view(node, st) for st in mine),
        totals=a.stats.totals({st.name: Role(st.role) for st in mine}),
        restarts=a.restarts, failed_by_crash=a.failed_by_crash, requeued_by_crash=a.requeued_by_crash,
        hangs=a.hangs, shadow_restarts=a.shadow_restarts,
        change=running.to_dict() if running is not None else None,
        memory=sup.app_memory(name).to_dict() if sup is not None else None,
        overflow=node.overflow.split(name, node.instances.values())
        if node.overflow is not None and name in node.overflow.pools else None,
        # a model file: its version, and the config fields without effect
        model_file=None if a.cfg.file is None else {"version": a.cfg.file.version,
                                                    "repository": a.cfg.file.repository,
                                                    "ignored": list(a.cfg.file.config.ignored)})


def node_view(node: NodeParts) -> NodeView:
    """The node now: node, ingest counters and drops, per app and instance statistics, changes."""
    counters = node.ingest.counters() if node.ingest is not None else {}
    sup = node.supervisor
    return NodeView(
        apps={name: app_view(node, name, a) for name, a in node.apps.items()},
        node={"backend": node.backend, "pid": os.getpid(), "run_dir": str(node.run_dir),
              "mps": None if node.mps is None else {"active": node.mps.active, "started": node.mps.started,
                                                    "reason": node.mps.reason},
              "ports": node.ingest.ports if node.ingest else [],
              # GPU% held on each device (cuda: by GPU index; cpu: the one CPU device)
              "gpus": {str(device_label(node.backend, dev)): pct for dev, pct in
                       sorted(node.placement.device_load().items())},
              "uptime_s": time.monotonic() - node.started_at if node.started_at else 0.0,
              "errors": dict(node.errors),
              # CPU backend: the cores the node's own threads are kept on (null: any)
              "own_cores": node.own_cores,
              # The fork servers instances are forked from (orchestrator/worker/forkserver.py): their
              # memory is the node's too.
              "fork_servers": node.launcher.describe() if isinstance(node.launcher, ForkLauncher) else [],
              # PSS of every process of the node, and the instances' device memory (orchestrator/control/memory.py)
              "memory": sup.node_memory().to_dict() if sup is not None else None},
        ingest=counters,
        # Datagrams dropped by reason: the packets' (drop_*), and answers held for a full send
        # buffer until their request's deadline passed.
        drops={k[5:] if k.startswith("drop_") else k: v for k, v in counters.items()
               if (k.startswith("drop_") or k == "answers_expired") and v},
        control_rejected=dict(node.server.rejected) if node.server is not None else {},
        decisions=tuple(e for e in node.events if e["event"] == "decision")[-20:],
        changes={"counts": dict(node.changes.counts), "recent": [ch.to_dict() for ch in list(node.changes)[-10:]]},
        scheduler=node.dispatcher.status() if node.dispatcher is not None else {"name": "spatial"},
        # Param-Share's live copies: who owns each (a holder pid, or the node's segment) and who maps it
        param_share=tuple(node.params.describe()) if node.params is not None else (),
        repository=None if node.repository is None else {
            "running": {n: op.phase for n, op in node.repository.running.items()},
            "recent": list(node.repository.recent)},
    )


def node_status(node: NodeParts) -> dict[str, Any]:
    """The status reply's body: `node_view` as JSON (the control edge)."""
    return node_view(node).to_dict()
