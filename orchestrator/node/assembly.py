"""The node's parts, each built into the node's ``contextlib.ExitStack`` with its own undoing.

:meth:`orchestrator.node.node.Node.start` calls these in order; each registers how its part is undone
at the moment the part exists, so stopping the node (or a start that failed halfway) is the stack
unwinding, last part first. Where a part must be undone later than it is built (the repository goes
before the front door that serves it), the node registers its undoing at the point of the order it
belongs to. The order of the undoing is the node's stop order: the repository and its poller, the front
door, the running changes, the routes, the instances (drained, then SIGTERM, SIGKILL) and the weights'
holders, Param-Share's segments, the metrics, the ingest, the control socket, the pool, MPS, the
threads' core set, and the run directory last (tests/orchestrator/node/test_node_assembly.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from gpuprims.ingest import Ingest
from gpuprims.pool import PacketPool
from orchestrator.config.schema import NodeConfig
from orchestrator.control.channel import (
    ControlServer,
    control_address,
    make_run_dir,
    open_server,
    write_token,
)
from orchestrator.control.errors import StartError
from orchestrator.control.rundir import (
    CURRENT_LINK,
    NODE_FILES,
    NodeRecord,
    RunDirBusy,
    claim,
    sweep_dead_segments,
    update_record,
)
from orchestrator.frontdoor import FrontDoor, FrontDoorError, start_frontdoor
from orchestrator.frontdoor.core import Unavailable
from orchestrator.node.dispatch import (
    LiveScheduler,
    core_groups,
    measured_profile,
    rename_profile,
    stage_names,
)
from orchestrator.node.metrics import MetricsServer
from orchestrator.node.mps import MpsDaemon, MpsUnavailable
from orchestrator.node.placement import Placement, model_key
from orchestrator.node.repository import Repository
from orchestrator.node.state import AppState, InstanceState, InstanceTable, Role

log = logging.getLogger("gpuprims.node")

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


# -- the run directory ----------------------------------------------------------------------------------
def open_run_dir(stack: ExitStack, setting: str | os.PathLike[str] | None, token: str) -> Path:
    """This node's run directory (``node.run_dir``, or a private one made when None): claimed, its token
    written, ``current`` pointed at it. Undone: the link (when still ours), and the directory made (whole)
    or the node's files in the one given. A directory a live node holds is refused (StartError) untouched."""
    run_dir = make_run_dir(setting)
    try:
        removed = claim(run_dir, NodeRecord.for_this_process(name=run_dir.name))
    except RunDirBusy as e:
        raise StartError(str(e)) from None
    stack.callback(remove_run_dir, run_dir, own=setting is None)
    if removed is not None:
        log.warning("%s", removed.describe())
    # What SIGKILLed nodes and programs left anywhere (a node of the Python API has no CLI to sweep
    # for it): pools and Param-Share segments whose owning process is gone.
    swept = sweep_dead_segments()
    if swept:
        log.warning("removed %d shared-memory object(s) of dead processes (%.1f MB): %s", len(swept),
                    sum(b for _, b in swept) / 1e6, ", ".join(n for n, _ in swept))
    write_token(run_dir, token)
    link = run_dir.parent / CURRENT_LINK
    with contextlib.suppress(OSError):
        tmp = run_dir.parent / f".{CURRENT_LINK}.{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        tmp.symlink_to(run_dir)
        tmp.replace(link)
    return run_dir


def remove_run_dir(run_dir: Path, *, own: bool) -> None:
    """Undo :func:`open_run_dir`."""
    link = run_dir.parent / CURRENT_LINK
    with contextlib.suppress(OSError):
        if link.is_symlink() and Path(os.readlink(link)) == run_dir:
            link.unlink()
    if own:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    for leftover in NODE_FILES:  # a directory given: the node's files only
        with contextlib.suppress(OSError):
            (run_dir / leftover).unlink()


# -- the data path and the control channel ------------------------------------------------------------
def start_mps(stack: ExitStack, run_dir: Path, mode: str) -> MpsDaemon:
    """The MPS daemon (cuda backend, ``node.mps``); StartError when it is required and cannot be used."""
    mps = MpsDaemon(run_dir, mode=mode)
    stack.callback(mps.stop)
    try:
        mps.ensure()
    except MpsUnavailable as e:
        raise StartError(f"node.mps is 'require' but MPS cannot be used: {e}") from e
    return mps


def consumer_count(cfg: NodeConfig, apps: dict[str, AppState], overflow_pools: int, runtime_loads: bool) -> int:
    """The pool's consumer endpoints: room for a shadow per app, replacements and restarts, so a consumer
    index is never reused while a dead instance's requests are being reclaimed (and, with loads at run
    time, :data:`REPOSITORY_CONSUMERS` more)."""
    total = sum(a.instances for a in apps.values())
    return min(1024, 2 * total + 2 * len(apps) + 4 + 2 * overflow_pools
               + (REPOSITORY_CONSUMERS if runtime_loads else 0))


def open_pool(stack: ExitStack, cfg: NodeConfig, consumers: int, run_dir: Path) -> PacketPool:
    """The shared packet pool (``node.pool``), named in the run directory's record; undone: unlinked."""
    p = cfg.node.pool
    pool = PacketPool.create(slot_count=p.slot_count, max_payload=p.max_payload, record_count=p.record_count,
                             max_chunks=p.max_chunks, consumer_count=consumers,
                             answer_ring_bytes=p.answer_ring_kb * 1024)
    stack.callback(pool.close)
    update_record(run_dir, shm=[pool.name.lstrip("/")])
    return pool


def start_ingest(stack: ExitStack, cfg: NodeConfig, pool: PacketPool) -> Ingest:
    """The native ingest on ``node.listen`` and every app's own port."""
    node = cfg.node
    listen: list[tuple[str, int] | tuple[str, int, int]] = [(node.listen.host, port) for port in node.listen.ports]
    listen += [(node.listen.host, a.port, a.app_id) for a in cfg.apps if a.port]
    ingest = Ingest(pool, listen, timeout_ms=node.reassembly_timeout_ms).start()
    stack.callback(ingest.stop)
    return ingest


def open_control(stack: ExitStack, kind: str, run_dir: Path, token: str) -> ControlServer:
    """The control channel's server (instances and commands) in the run directory."""
    server = open_server(control_address(kind, run_dir), token)
    stack.callback(server.close)
    return server


def start_metrics(stack: ExitStack, port: int) -> MetricsServer:
    """The Prometheus exporter on ``node.metrics_port``; its failure to stop is not the node's."""
    metrics = MetricsServer(port)
    metrics.start()

    def stop() -> None:
        with contextlib.suppress(Exception):
            metrics.stop()

    stack.callback(stop)
    return metrics


def start_node_frontdoor(stack: ExitStack, cfg: NodeConfig, apps: dict[str, AppState], ingest: Ingest, *,
                         repository: Repository | None, repository_token: str | None,
                         unavailable: list[Unavailable], tls: Any, inference_token: str | None) -> FrontDoor:
    """The Open Inference Protocol front door: its requests are placed straight into the node's packet
    pool by the ingest (and answered back in-process), so they share the pool, the instances, batching,
    statuses and metrics with UDP requests."""
    node = cfg.node
    h = node.listen.host
    udp_host = "127.0.0.1" if h in ("0.0.0.0", "") else ("::1" if h == "::" else h)
    try:
        door = start_frontdoor(
            [a for a in cfg.apps if a.name in apps], (udp_host, ingest.ports[0]),
            http_port=node.http_port or None, grpc_port=node.grpc_port or None, host=h,
            ready=lambda name: name in apps and bool(ingest.route(apps[name].cfg.app_id)),
            statistics={name: a.stats for name, a in apps.items()},
            ingest=ingest, repository=repository if node.repository.enabled else None,
            repository_token=repository_token, fleet_routes=node.fleet_routes,
            max_request_bytes=node.pool.max_request_bytes, unavailable=unavailable, tls=tls,
            inference_token=inference_token)
    except FrontDoorError as e:
        raise StartError(f"the Open Inference Protocol front door could not start: {e}") from e

    def close() -> None:
        with contextlib.suppress(Exception):
            door.close()

    stack.callback(close)
    return door


def build_dispatcher(cfg: NodeConfig, apps: dict[str, AppState], instances: InstanceTable,
                     placement: Placement, pool: PacketPool, server: ControlServer, backend: str) -> LiveScheduler:
    """The live scheduler (``node.scheduler``) over the instances' measured warm-up (or node.profiles),
    every app's first active bound to it."""
    files = placement.profiles()
    profiles: dict[str, Any] = {}
    pcts: dict[str, dict[str, int]] = {}
    bound: list[tuple[str, InstanceState]] = []
    for name, a in apps.items():
        pcts[name] = placement.stage_pcts(name)
        st = instances.of(name, Role.ACTIVE)[0]
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
            profiles[key] = measured_profile(key, measured, pct, backend=backend,
                                             input_shape=tuple(a.cfg.input_shape), dtype=a.cfg.dtype,
                                             note=f"warm-up of {st.name} at {pct}%")
    # CPU backend: instances that share a core take turns on it, so the scheduler runs them one at a time.
    exclusive = core_groups({name: st.spec.cores for name, st in bound}) if backend == "cpu" else []
    try:
        sched = LiveScheduler(cfg.node.scheduler, list(cfg.apps), pcts, profiles, pool, server.send,
                              round_ms=cfg.node.round_ms, exclusive=exclusive)
    except ValueError as e:
        raise StartError(f"node.scheduler {cfg.node.scheduler!r}: {e}") from e
    for name, st in bound:
        sched.bind(name, st.name, st.spec.consumer)
    log.info("live %s scheduler: %d app(s), %d ms rounds", cfg.node.scheduler, len(bound), cfg.node.round_ms)
    return sched


def plan_apps(cfg: NodeConfig, apps: dict[str, AppState], placement: Placement) -> None:
    """Every app of the config in ``apps`` with its instance count, sized (Multi-Model) unless a live
    scheduler owns the shares, and given its GPU%; the models that cannot be served are logged."""
    for app in cfg.apps:
        n = app.instances if isinstance(app.instances, int) else 1
        apps[app.name] = AppState(cfg=app, gpu_pct=0, instances=n)
        if app.file is not None and app.file.config.ignored:
            log.info("app %s: %s: fields accepted without effect (they tune Triton's own internals): %s",
                     app.name, app.file.config.source, ", ".join(app.file.config.ignored))
    for u in cfg.unavailable:
        log.error("model %s%s is UNAVAILABLE: %s", u.name, f" version {u.version}" if u.version else "", u.reason)
    if placement.scheduled:
        placement.check_scheduled()
    else:
        placement.size_auto_apps()
    placement.assign_pcts()
