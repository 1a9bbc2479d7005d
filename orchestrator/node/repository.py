"""The node's model repository: load and unload apps while it runs (the OIP model-repository extension).

A controller (the fleet's agent, a Kubernetes operator, an operator's script) drives a node through
three calls, served on the HTTP front door (``orchestrator/frontdoor/repository_api.py``, docs/oip.md):
``index``, ``load`` (with the app's apps.yaml entry) and ``unload``. Each call becomes an operation
the node's loop advances, step by step, never waiting inside the loop (like a change of share):

- **load of a new app**: the entry is validated exactly as an apps.yaml entry is (the whole config
  with it added goes through :func:`orchestrator.config.schema.parse_config`), its share must fit its GPU,
  then its instances start (role ``loading``: not routed to, not replaced if they die); once every
  one is READY they become active, the app is routed to, its shadow starts and the front door lists
  it. An instance that fails, or a start that outlasts ``ready_timeout_s``, fails the load: what it
  started is killed and the node is as it was.
- **load of a running app**: a change, not a restart. The same entry is a no-op; an entry that
  differs in ``gpu_pct`` only is an Overlapped-Execution change of share; anything else is refused
  (unload it first or load it under another name), and in every failure the old app keeps serving.
- **unload**: the route goes first (new requests for it are dropped and counted as unknown app, as
  for any app the node does not host), the front door stops listing it, its actives drain what they
  hold (<2, Finish>) and exit, its shadow is killed; the app is gone once its last process is.

Callers on other threads (the front door's) :meth:`Repository.submit` and get a
``concurrent.futures.Future``; only the node's loop touches the node.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from apps.zoo.names import NAMES
from gpuprims.modelrepo import RepositoryError as ModelRepositoryError
from gpuprims.modelrepo import RepositoryModel
from gpuprims.modelrepo import load_model as load_repository_model
from gpuprims.modelrepo import scan as scan_repository
from orchestrator.config.model_files import (
    ModelFileError,
    model_name,
    repository_app,
    repository_version_apps,
)
from orchestrator.config.schema import AppConfig, ConfigError, NodeConfig, parse_config
from orchestrator.control.errors import ChangeError, RepositoryError, SupervisionError
from orchestrator.node.placement import Placement
from orchestrator.node.reconfig import Change, Phase, model_key
from orchestrator.node.state import AppState, InstanceState, Role

log = logging.getLogger("gpuprims.node")

#: How long a failed load waits for the Error message of an instance that exited.
ERROR_GRACE_S = 2.0
#: The app keys a new version of a model file may change while it serves (a change of model): the file and
#: what its config sets. Anything else (instances, ports, overflow...) is refused as for any running app.
SWAPPABLE = frozenset({"model", "file", "config", "max_batch", "max_wait_ms", "slo_ms", "engine"})


class RepositoryHost(Protocol):
    """What an operation may use of the node (the node's :class:`~orchestrator.node.supervisor.Supervisor`
    implements it)."""

    cfg: NodeConfig
    apps: dict[str, AppState]
    instances: dict[str, InstanceState]
    placement: Placement
    ready_timeout_s: float
    stop_timeout_s: float
    last_errors: dict[str, str]

    @property
    def changes(self) -> Iterable[Change]: ...

    def spawn_loading(self, app: AppConfig, index: int, gpu_pct: int) -> InstanceState: ...
    def activate(self, app_name: str, instances: list[InstanceState]) -> None: ...
    def unroute(self, app_name: str) -> None: ...
    def finish(self, st: InstanceState) -> None: ...
    def kill(self, st: InstanceState, role: Role = Role.STOPPING) -> None: ...
    def publish_model(self, app: AppConfig) -> None: ...
    def withdraw_model(self, name: str) -> None: ...
    def record(self, event: dict[str, Any]) -> None: ...
    def set_gpu(self, app: str, gpu_pct: int, *, origin: str = ..., method: str = ...,
                reason: str | None = None, model: str | None = None) -> Change: ...
    def shadow_of(self, app_name: str) -> InstanceState | None: ...


def file_key(app: AppConfig) -> str | None:
    """The :func:`orchestrator.node.reconfig.model_key` of the instances of ``app`` (a model file's path, version
    and fingerprint, as the supervisor puts them in their specs); None for an app without a model file."""
    if app.file is None:
        return None
    return f"{app.file.path}|{app.file.version}|{app.file.fingerprint or None}"


def repository_model_of(app: AppConfig) -> str | None:
    """The model of the node's model repository that ``app`` serves (one version of it), or None for an app
    of apps.yaml (or one loaded with a config of its own)."""
    if app.file is None or app.file.repository is None:
        return None
    return model_name(app.name, app.file.config.name, app.file.repository)


def validate_entry(cfg: NodeConfig, apps: Mapping[str, AppState], name: str, entry: Any) -> AppConfig:
    """The app ``entry`` (an apps.yaml ``apps:`` item) for ``name``, validated as in apps.yaml next to
    the node's other apps; RepositoryError(invalid) naming the key and what is wrong."""
    source = f"load of {name!r}"
    if not isinstance(entry, Mapping):
        raise RepositoryError("invalid", f"{source}: the config must be a JSON object of apps.yaml app keys, "
                                         f"got {type(entry).__name__}")
    entry = dict(entry)
    if entry.setdefault("name", name) != name:
        raise RepositoryError("invalid", f"{source}: config name {entry['name']!r} differs from the model "
                                         f"name in the URL {name!r}")
    for key, why in (("port", "the ingest's ports are fixed at start; send to the node's listen port"),
                     ("overflow", "CPU overflow pools are planned at start; put the app in apps.yaml")):
        if key in entry and entry[key] not in (None, "none"):
            raise RepositoryError("invalid", f"{source}: {key}: cannot be given in a load ({why})")
    if name in apps and "app_id" not in entry:
        entry["app_id"] = apps[name].cfg.app_id  # a running app keeps its wire id
    others = [a.cfg.model_dump() for n, a in apps.items() if n != name]
    data = {"node": cfg.node.model_dump(), "apps": [*others, entry]}
    try:
        new = parse_config(data, source=source, known_models=set(NAMES), scan_repository=False).apps[-1]
    except ConfigError as e:
        here = f"apps[{len(others)}]"
        lines = [f"{key.replace(here, 'config', 1)}: {what}" if key else what for key, what in e.problems
                 if not key or key.startswith(here) or key == "apps"]
        raise RepositoryError("invalid", f"{source}: " + "; ".join(lines or [str(e)])) from None
    return new


@dataclass
class Operation:
    """One repository call the node's loop advances; ``future`` gets its result dict or its error."""

    kind: str  # load | unload
    name: str
    entry: Any
    future: concurrent.futures.Future[dict[str, Any]]
    started: float = field(default_factory=time.monotonic)
    phase: str = "pending"
    new: AppConfig | None = None
    mine: list[str] = field(default_factory=list)  # instances this operation started
    change: Change | None = None
    created: bool = False  # this load added the app to the node
    error: RepositoryError | None = None
    deadline: float = 0.0
    exit_seen: float | None = None  # when an instance of the load was first seen gone
    previous: AppConfig | None = None  # a change of model: the config it replaces (restored if it fails)
    children: list[tuple[str, concurrent.futures.Future[dict[str, Any]]]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.future.done()

    def mine_alive(self, host: RepositoryHost) -> bool:
        """True while an instance this operation started is still in the node's table."""
        return any(n in host.instances for n in self.mine)

    def ok(self, message: str) -> None:
        self.phase = "done"
        log.info("repository: %s %s: %s", self.kind, self.name, message)
        self.future.set_result({"name": self.name, "kind": self.kind, "message": message})

    def fail(self, err: RepositoryError) -> None:
        self.phase = "failed"
        log.warning("repository: %s %s failed: %s", self.kind, self.name, err)
        self.future.set_exception(err)


class Repository:
    """The node's repository operations (see the module docstring)."""

    def __init__(self, host: RepositoryHost) -> None:
        self.host = host
        self._inbox: queue.SimpleQueue[Operation] = queue.SimpleQueue()
        self.running: dict[str, Operation] = {}
        self.recent: list[dict[str, Any]] = []
        self._closed = False

    # -- any thread ------------------------------------------------------------------------------------
    def submit(self, kind: str, name: str, entry: Any = None) -> concurrent.futures.Future[dict[str, Any]]:
        """Queue a ``load`` (``entry``: the app's config, or None to load what is there) or ``unload``."""
        if kind not in ("load", "unload"):
            raise ValueError(f"kind must be 'load' or 'unload', got {kind!r}")
        fut: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        if self._closed:
            fut.set_exception(RepositoryError("unavailable", "the node is stopping"))
            return fut
        self._inbox.put(Operation(kind, name, entry, fut))
        return fut

    @property
    def busy(self) -> set[str]:
        """Apps a load or unload is working on (no shadow refill for them meanwhile)."""
        return set(self.running)

    # -- the node's loop ---------------------------------------------------------------------------------
    def advance(self) -> None:
        """Take new calls and advance every running operation one step (never waits)."""
        while True:
            try:
                op = self._inbox.get_nowait()
            except queue.Empty:
                break
            if op.name in self.running:
                op.fail(RepositoryError("unavailable", f"a {self.running[op.name].kind} of {op.name!r} is "
                                                       "still running; retry when it ends"))
                continue
            self.running[op.name] = op
        for name, op in list(self.running.items()):
            if op.error is None:
                try:
                    self._step(op)
                except RepositoryError as e:
                    self._abort(op, e)
            if op.error is not None and not op.mine_alive(self.host):
                # Answered only once what it started is gone: the node is as it was before the call.
                if op.created and name in self.host.apps:
                    del self.host.apps[name]
                if not op.done:
                    op.fail(op.error)
            if op.done:
                del self.running[name]
                self.recent = [*self.recent[-19:], {"kind": op.kind, "app": name, "phase": op.phase,
                                                    "error": str(op.error) if op.error else None}]

    def close(self) -> None:
        """Refuse new calls and fail the running ones (the node is stopping)."""
        self._closed = True
        self.advance_inbox_only()
        for op in self.running.values():
            if not op.done:
                op.fail(RepositoryError("unavailable", "the node is stopping"))
        self.running.clear()

    def advance_inbox_only(self) -> None:
        while True:
            try:
                op = self._inbox.get_nowait()
            except queue.Empty:
                return
            op.fail(RepositoryError("unavailable", "the node is stopping"))

    def _abort(self, op: Operation, err: RepositoryError) -> None:
        """Kill what the operation started; :meth:`advance` answers once they are gone."""
        op.error = err
        op.phase = "failing"
        for name in op.mine:
            st = self.host.instances.get(name)
            if st is not None and st.alive:
                self.host.kill(st)

    # -- the operations ----------------------------------------------------------------------------------
    def _step(self, op: Operation) -> None:
        h = self.host
        if op.phase == "pending" and op.name not in h.apps and self._versions_of(op):
            return
        if op.phase == "children":
            self._await_children(op)
        elif op.kind == "unload":
            self._unload(op)
        elif op.phase == "pending":
            self._start_load(op)
        elif op.phase == "changing":
            assert op.change is not None
            ch = op.change
            if ch.phase.terminal:
                if ch.phase is not Phase.DONE:
                    if op.previous is not None:  # a change of model: its next shadow serves the old model again
                        h.apps[op.name].cfg = op.previous
                        shadow = h.shadow_of(op.name)
                        if shadow is not None and model_key(shadow.spec) != file_key(op.previous):
                            h.kill(shadow)
                    raise RepositoryError("unavailable", f"the change of {op.name!r} failed, the old instances "
                                                         f"keep serving: {ch.message()}")
                assert op.new is not None
                h.apps[op.name].cfg = op.new
                h.publish_model(op.new)
                if ch.model is not None and op.new.file is not None:
                    op.ok(f"version {op.new.file.version} of {op.new.file.path} serving by Overlapped-Execution "
                          f"(change {ch.id})")
                else:
                    op.ok(f"changed to {op.new.gpu_pct}% by Overlapped-Execution (change {ch.id})")
        elif op.phase == "starting":
            self._await_ready(op)

    def _start_load(self, op: Operation) -> None:
        h = self.host
        if h.placement.scheduled:
            raise RepositoryError("invalid", f"node.scheduler is {h.cfg.node.scheduler!r}: the live scheduler is "
                                             "planned at start; put the app in apps.yaml")
        current = h.apps.get(op.name)
        entry = op.entry
        if entry is None:
            if h.cfg.node.model_repository is None or (current is not None and current.cfg.file is None):
                if current is None:
                    raise RepositoryError("invalid", f"{op.name!r} is not loaded; a load of a new app needs its "
                                                     "config (parameters.config), or node.model_repository")
                op.ok("already loaded")
                return
            entry = self._repository_entry(op.name)  # (re)load it from the node's model repository
        new = validate_entry(h.cfg, h.apps, op.name, entry)
        op.new = new
        if current is not None:
            self._load_running(op, current, new)
            return
        n = new.instances if isinstance(new.instances, int) else 1
        dev = h.cfg.gpu_of(new) if h.placement.backend == "cuda" else 0
        held = sum(a.gpu_pct * a.instances for nm, a in h.apps.items() if h.placement.device_of(nm) == dev)
        pct = new.gpu_pct if isinstance(new.gpu_pct, int) else (100 - held) // n
        if new.is_dag and not isinstance(new.gpu_pct, int):
            pct = min(100, new.fixed_pct_per_instance() or pct)
        where = f"GPU {dev}" if h.placement.backend == "cuda" else "the CPU device"
        if pct < 1 or (held + pct * n > 100 and not h.cfg.node.allow_oversubscribe):
            raise RepositoryError("invalid", f"load of {op.name!r}: {where} has {max(0, 100 - held)}% left, the app "
                                             f"asks {pct}% x {n} instance(s); lower gpu_pct or place it on "
                                             "another GPU")
        h.apps[op.name] = AppState(cfg=new, gpu_pct=pct, instances=n)
        op.created = True
        op.deadline = time.monotonic() + h.ready_timeout_s
        op.phase = "starting"
        self._spawn(op, 0)
        h.record({"event": "repository_load", "app": op.name, "gpu_pct": pct, "instances": n})

    def _spawn(self, op: Operation, index: int) -> None:
        assert op.new is not None
        h = self.host
        try:
            st = h.spawn_loading(op.new, index, h.apps[op.name].gpu_pct)
        except SupervisionError as e:
            raise RepositoryError("unavailable", f"load of {op.name!r}: {e}") from None
        op.mine.append(st.name)

    def _await_ready(self, op: Operation) -> None:
        h = self.host
        mine = [h.instances.get(n) for n in op.mine]
        for name, st in zip(op.mine, mine):
            why = (st.error if st is not None else None) or h.last_errors.get(name)
            if why is None and (st is None or not st.alive):
                # Its Error message can trail its exit on a busy machine: give it a moment.
                op.exit_seen = op.exit_seen or time.monotonic()
                if time.monotonic() - op.exit_seen < ERROR_GRACE_S:
                    return
                why = "it exited before READY (see the node's log)"
            if why is not None:
                raise RepositoryError("invalid", f"load of {op.name!r}: instance {name} failed to start: {why}; "
                                                 "the node is as it was")
        if time.monotonic() > op.deadline:
            raise RepositoryError("unavailable", f"load of {op.name!r}: not READY within {h.ready_timeout_s:.0f} s "
                                                 "(the node's ready_timeout_s)")
        if not all(st is not None and st.ready for st in mine):
            return
        n = h.apps[op.name].instances
        if len(op.mine) < n:  # the first one exported the weights (Param-Share); the others map them
            for i in range(len(op.mine), n):
                self._spawn(op, i)
            return
        assert op.new is not None
        h.activate(op.name, [st for st in mine if st is not None])
        h.publish_model(op.new)
        op.mine = []  # serving now: the node owns them
        op.ok(f"loaded: {n} instance(s) at {h.apps[op.name].gpu_pct}%")

    def _versions_of(self, op: Operation) -> bool:
        """A load or unload of a repository model whose versions are apps of their own (``<model>-v<N>``):
        one operation per version app (children of ``op``, which ends when they all have). True when ``op``
        became such a parent."""
        h = self.host
        apps = sorted(n for n, a in h.apps.items() if repository_model_of(a.cfg) == op.name)
        if op.kind == "unload":
            jobs: list[tuple[str, str, Any]] = [("unload", n, None) for n in apps]
        else:
            if op.entry is not None or h.cfg.node.model_repository is None:
                return False
            entries = self._repository_entries(op.name)
            if len(entries) == 1 and entries[0]["name"] == op.name:
                return False  # one app named as the model: the load below
            wanted = {e["name"] for e in entries}
            jobs = [("load", e["name"], e) for e in entries] + [("unload", n, None) for n in apps if n not in wanted]
        if not jobs:
            return False
        for kind, name, entry in jobs:
            fut: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
            self._inbox.put(Operation(kind, name, entry, fut))
            op.children.append((name, fut))
        op.phase = "children"
        return True

    def _await_children(self, op: Operation) -> None:
        if not all(f.done() for _, f in op.children):
            return
        failed = [(n, f.exception()) for n, f in op.children if f.exception() is not None]
        if failed:
            kind = next((e.kind for _, e in failed if isinstance(e, RepositoryError)), "unavailable")
            raise RepositoryError(kind, f"{op.kind} of {op.name!r}: " + "; ".join(f"{n}: {e}" for n, e in failed))
        op.ok(f"{op.kind}ed: " + ", ".join(f"{n} ({f.result()['message']})" for n, f in op.children))

    def _repository_entries(self, name: str) -> list[dict[str, Any]]:
        """The app entries of every version model ``name`` of the node's model repository serves now."""
        node = self.host.cfg.node
        assert node.model_repository is not None
        try:
            m = load_repository_model(node.model_repository, name, torch_ok=False)
            entries, failed = repository_version_apps(m, slo_ms=node.repository_slo_ms,
                                                      backend=self.host.placement.backend)
        except (ModelFileError, ModelRepositoryError) as e:
            raise RepositoryError("invalid", f"load of {name!r} from {node.model_repository}: {e}") from None
        if not entries:
            raise RepositoryError("invalid", f"load of {name!r} from {node.model_repository}: no version can be "
                                             "served: " + "; ".join(f"version {b['version']}: {b['reason']}"
                                                                   for b in failed))
        return entries

    def _repository_entry(self, name: str) -> dict[str, Any]:
        """The app entry of model ``name`` of the node's model repository as its files are now."""
        node = self.host.cfg.node
        assert node.model_repository is not None
        current = self.host.apps.get(name)
        model = repository_model_of(current.cfg) if current is not None else None
        if model is not None and model != name:  # one version's app of a model that serves several
            entry = next((e for e in self._repository_entries(model) if e["name"] == name), None)
            if entry is None:
                raise RepositoryError("invalid", f"load of {name!r}: {model}'s version_policy no longer serves it")
            return entry
        try:
            m = load_repository_model(node.model_repository, name, torch_ok=False)
            return repository_app(m, slo_ms=node.repository_slo_ms, backend=self.host.placement.backend)
        except (ModelFileError, ModelRepositoryError) as e:
            raise RepositoryError("invalid", f"load of {name!r} from {node.model_repository}: {e}") from None

    def _load_running(self, op: Operation, current: AppState, new: AppConfig) -> None:
        h = self.host
        old = current.cfg.model_dump()
        want = new.model_dump()
        differ = sorted(k for k in want if want[k] != old.get(k) and k != "gpu_pct")
        if current.cfg.file is not None and new.file is not None and differ and set(differ) <= SWAPPABLE:
            self._swap(op, current, new)
            return
        if differ:
            raise RepositoryError("invalid", f"load of running app {op.name!r}: only gpu_pct can change while it "
                                             f"serves (an Overlapped-Execution change); {', '.join(differ)} "
                                             "differ: unload it first, or load it under another name")
        if not isinstance(new.gpu_pct, int) or new.gpu_pct == current.gpu_pct:
            current.cfg = new
            op.ok("unchanged")
            return
        try:
            op.change = h.set_gpu(op.name, new.gpu_pct, origin="repository", reason="repository load")
        except ChangeError as e:
            raise RepositoryError("invalid", f"load of running app {op.name!r}: {e}") from None
        op.phase = "changing"

    def _swap(self, op: Operation, current: AppState, new: AppConfig) -> None:
        """A model file's new version or changed file (or config): an Overlapped-Execution change of model.
        The app's config becomes the new one (so its next shadow serves it), the shadow of the old model is
        replaced, and each active is switched to an instance of the new model as in a change of share; if
        the change fails, the old config comes back and the old instances keep serving."""
        h = self.host
        assert new.file is not None
        op.previous = current.cfg
        pct = new.gpu_pct if isinstance(new.gpu_pct, int) else current.gpu_pct
        current.cfg = new
        try:
            op.change = h.set_gpu(op.name, pct, origin="repository", model=file_key(new),
                                  reason=f"model file {new.file.path} version {new.file.version}")
        except ChangeError as e:
            current.cfg = op.previous
            raise RepositoryError("invalid", f"load of running app {op.name!r}: {e}") from None
        h.record({"event": "repository_swap", "app": op.name, "version": new.file.version, "path": new.file.path})
        op.phase = "changing"

    def _unload(self, op: Operation) -> None:
        h = self.host
        if op.phase == "pending":
            if op.name not in h.apps:
                raise RepositoryError("not_found", f"no app named {op.name!r} is loaded; apps: "
                                                   f"{', '.join(sorted(h.apps)) or 'none'}")
            if any(not ch.phase.terminal for ch in h.changes if ch.app == op.name):
                raise RepositoryError("unavailable", f"a change of share of {op.name!r} is running; unload "
                                                     "it when the change ends")
            h.unroute(op.name)
            h.withdraw_model(op.name)
            for st in list(h.instances.values()):
                if st.app != op.name:
                    continue
                if st.role == Role.ACTIVE and st.ready:
                    h.finish(st)
                else:
                    h.kill(st)
            op.phase = "draining"
            op.deadline = time.monotonic() + h.stop_timeout_s
            h.record({"event": "repository_unload", "app": op.name})
        left = [st for st in h.instances.values() if st.app == op.name]
        if left and time.monotonic() > op.deadline:
            for st in left:
                h.kill(st)
        if not left:
            del h.apps[op.name]
            op.ok("unloaded")



@dataclass(frozen=True)
class PollAction:
    """A repository operation a poll found due: ``load`` (``entry``: a new model, or a new version or file of a
    served one) or ``unload`` (the model left the repository)."""

    kind: str
    name: str
    entry: dict[str, Any] | None = None
    why: str = ""


def _entry_key(entry: Mapping[str, Any]) -> str:
    f = entry["file"]
    return f"{f['path']}|{f['version']}|{f['fingerprint'] or None}"


class RepositoryPoller:
    """``model_control_mode: poll``: the node's model repository read again every ``interval_s``.

    The scan runs on a thread of its own (reading and fingerprinting files never stalls the node's loop; a
    rescan reads again only files whose name, size or time changed); the loop takes what the last scan
    found with :meth:`due` and submits it to the :class:`Repository`, where a new model is a load, a new
    version or changed file of a served model an Overlapped-Execution change of model (no request lost,
    none answered twice) and a model gone from the repository an unload. A model whose new files fail to
    read keeps serving what it served, and its error is logged once.
    """

    def __init__(self, root: str, interval_s: float, *, slo_ms: float, backend: str,
                 scanner: Any = None) -> None:
        self.root = root
        self.interval_s = interval_s
        self.slo_ms = slo_ms
        self.backend = backend
        self._scan = scanner or (lambda previous: scan_repository(root, previous, torch_ok=False))
        self._latest: list[RepositoryModel] | None = None
        self._previous: dict[str, RepositoryModel] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported: dict[str, str] = {}  # model -> the error last logged for it
        self._given_up: dict[str, str | None] = {}  # model -> the files whose load failed (not tried again)
        self.scans = 0
        self.errors = 0

    def start(self) -> RepositoryPoller:
        self._thread = threading.Thread(target=self._run, name="repository-poll", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.scan_once()

    def scan_once(self) -> None:
        """Read the repository once (the poll thread's step; tests call it directly)."""
        try:
            models = self._scan(self._previous)
        except Exception as e:  # the repository itself unreadable: keep serving, say so
            self.errors += 1
            log.error("repository poll of %s failed: %s", self.root, e)
            return
        with self._lock:
            self._latest = models
            self._previous = {m.name: m for m in models}
            self.scans += 1

    def due(self, served: Mapping[str, AppConfig], busy: Collection[str]) -> list[PollAction]:
        """What the last scan (if it is new) asks of the node: loads and unloads of the repository's models
        against ``served`` (the node's apps), skipping those a repository operation is working on. A model
        whose policy serves several versions has an app per version (``<model>-v<N>``): a version that
        appears is loaded as an app of its own, one that leaves the policy (or its directory) is unloaded."""
        with self._lock:
            models, self._latest = self._latest, None
        if models is None:
            return []
        out: list[PollAction] = []
        seen = set()
        by_model: dict[str, list[str]] = {}  # the repository's model -> the apps serving it now
        for name, cfg in served.items():
            m_name = repository_model_of(cfg)
            if m_name is not None:
                by_model.setdefault(m_name, []).append(name)
        for m in models:
            seen.add(m.name)
            current = served.get(m.name)
            if current is not None and repository_model_of(current) is None:
                continue  # an apps.yaml app of that name: not the repository's
            mine = by_model.get(m.name, [])
            if m.error is not None:
                if self._reported.get(m.name) != m.error:
                    self._reported[m.name] = m.error
                    log.error("repository poll: model %s cannot be %s: %s", m.name,
                              "updated (it keeps serving what it served)" if mine else "loaded", m.error)
                continue
            try:
                entries, failed = repository_version_apps(m, slo_ms=self.slo_ms, backend=self.backend)
            except ModelFileError as e:
                if self._reported.get(m.name) != str(e):
                    self._reported[m.name] = str(e)
                    log.error("repository poll: model %s cannot be served: %s", m.name, e)
                continue
            why = "; ".join(f"version {b['version']}: {b['reason']}" for b in failed)
            if why and self._reported.get(m.name) != why:
                self._reported[m.name] = why
                log.error("repository poll: model %s: %s", m.name, why)
            elif not why:
                self._reported.pop(m.name, None)
            wanted = {e["name"] for e in entries}
            for entry in entries:
                app = entry["name"]
                if app in busy:
                    continue
                key = _entry_key(entry)
                if self._given_up.get(app, "") == key:
                    continue
                now = served.get(app)
                if now is None:
                    out.append(PollAction("load", app, entry, "new model" if not mine else
                                          f"version {entry['file']['version']} of {m.name} is served"))
                elif file_key(now) != key:
                    out.append(PollAction("load", app, entry, f"version {entry['file']['version']} or its files changed"))
            for app in mine:
                if app not in wanted and app not in busy:
                    out.append(PollAction("unload", app, None, f"{m.name}'s version_policy or versions no longer "
                                                               "serve it"))
        for m_name, apps in by_model.items():
            if m_name not in seen:
                out.extend(PollAction("unload", app, None, "gone from the repository") for app in apps if app not in busy)
        return out

    def give_up(self, act: PollAction) -> None:
        """The operation ``act`` failed: it is not asked for again until the model's files change again."""
        self._given_up[act.name] = _entry_key(act.entry) if act.entry is not None else None
        log.error("repository poll: %s of %s failed; it is tried again when its files change", act.kind, act.name)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
