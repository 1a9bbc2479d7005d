"""Param-Share bookkeeping: who owns each shared copy of an app's weights, who maps it, and where the
handles are.

Instances of one model (same model, seed, classes and input shape) share one copy of its weights
(paper V-E): one allocation holds them, its handles are a file in the run directory, and every other
instance maps them instead of loading its own copy.

**Who owns the allocation.** The weights must outlive every instance that maps them, through changes
of share, restarts, crashes and stops:

- **CUDA: a holder process per copy, owned by the node** (``python -m orchestrator.worker.param_holder``).
  It loads the weights onto the app's GPU into one ``cudaMalloc`` arena, exports it
  (``cudaIpcGetMemHandle``), writes the handles and then only waits; every instance, the first
  included, imports. CUDA frees an allocation with its process, and "calling cudaFree on an exported
  memory region before calling cudaIpcCloseMemHandle in the importing context will result in
  undefined behavior" (cudaIpcOpenMemHandle), so the process that owns the arena must be one that no
  change retires. Before, the first instance exported: an Overlapped-Execution change retired it
  (``finishing``), it exited normally and took the arena with it while the new active still mapped it.
  The alternatives were worse: keeping a retired exporter alive as a non-serving holder keeps a whole
  instance (its context, workspace and GPU%) for as long as any later instance maps the weights,
  which after the first change is forever; re-exporting before the exporter retires needs the new
  active to copy the weights into an arena of its own (an importer cannot re-export IPC-mapped
  memory), costs a second copy at every change and still leaves every other importer mapping the old
  arena. With a holder a change, a restart or an instance's crash never touches the weights, so
  Overlapped-Execution and the supervisor's exactly-once rules are unchanged; the cost is one small
  CUDA context per shared model. The holder is stopped once no instance maps its copy any more (the
  app was unloaded) and at ``stop`` after every instance. If it dies (it runs no kernels, so only a
  kill or a lost device does that), every instance that mapped its arena is killed, so none reads
  freed memory, and replaced like any crashed instance (replacement first, then its requests are
  requeued); the replacements import from a new holder.
- **CPU: the node.** The first instance exports into a POSIX shared-memory object named after the
  node (``GPUPRIMS_SHM_OWNER_PID``), which outlives the exporting process: the exporter exits like
  any instance and importers keep reading. The node unlinks it when no instance maps it any more,
  and at ``stop``. A holder would add a process that imports torch to every node for nothing.
- **ONNX Runtime (CPU provider, cpu node): the node, the same way.** The copy is the served ONNX
  model's initializers (:mod:`gpuprims.engines.ort_share`), keyed by model, seed, classes, input shape
  (or the model file's fingerprint and version) and optimization level; every session takes them with
  ``add_initializer`` over the mapping. GPU providers keep their own copy (docs/primitives.md).

Every instance's exit, normal or crash, goes through :meth:`ParamShare.instance_exited`, so no
export names a process that is gone.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from gpuprims.cuda.ipc import ParameterHandles
from gpuprims.engines import EngineError, engine_class
from gpuprims.engines.files import resolve_file_kind
from orchestrator.config.schema import AppConfig
from orchestrator.control.share_spec import ERROR_SUFFIX, HolderSpec

log = logging.getLogger("gpuprims.node")

#: How long :meth:`ParamShare.stop_holders` waits for holders to exit after SIGTERM before SIGKILL.
HOLDER_STOP_S = 5.0

class HolderProcess(Protocol):
    """A started holder, as the node sees it (the subset of `subprocess.Popen` it uses)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass
class Export:
    """One shared copy of an app's weights."""

    key: str
    path: Path
    backend: Literal["cuda", "cpu"]
    #: The instances that map it (or, on the CPU, export it): handed its path and not exited yet.
    users: set[str] = field(default_factory=set)
    #: CPU: the instance that exports it, until it exits (the segment is the node's after that).
    exporter: str | None = None
    #: CUDA: the process that owns the arena.
    holder: HolderProcess | None = None

    @property
    def ready(self) -> bool:
        """True once the handles are written (importers can map it)."""
        return self.path.exists()

    def describe(self) -> dict[str, object]:
        """The copy as plain data (logs, status): with ``mb``, the arena's or segment's size once written."""
        mb = None
        with contextlib.suppress(OSError, ValueError):
            mb = round(ParameterHandles.from_bytes(self.path.read_bytes()).nbytes / 2**20, 2)
        return {"key": self.key, "path": str(self.path), "backend": self.backend, "users": sorted(self.users),
                "exporter": self.exporter, "holder_pid": self.holder.pid if self.holder is not None else None,
                "ready": self.ready, "mb": mb}


@dataclass(frozen=True)
class HolderExit:
    """A holder that exited while the node ran: its copy is forgotten, and ``users`` mapped a freed
    arena if ``exported`` (they must be restarted)."""

    export: Export
    rc: int
    exported: bool
    users: tuple[str, ...]


def _no_holder(spec: HolderSpec) -> HolderProcess:
    raise OSError("no holder launcher bound (ParamShare.bind)")


class ParamShare:
    """Shared copies of weights by weight key (see the module docstring)."""

    def __init__(self, run_dir: Path, *, enabled: bool = True) -> None:
        self.run_dir = run_dir
        self.enabled = enabled
        self.exports: dict[str, Export] = {}  # key -> the live copy new instances get
        self.backend: Literal["cuda", "cpu"] = "cpu"
        self._start_holder: Callable[[HolderSpec], HolderProcess] = _no_holder
        self._gpu_of: Callable[[AppConfig], int] = lambda app: 0
        self._paths = itertools.count()  # a path is never reused, so a late reader never gets another copy
        self._retiring: list[Export] = []  # CUDA copies no instance maps any more, holders told to exit
        self._reasons: list[Path] = []  # failed holders' reasons, kept for their waiting instances until stop

    def bind(self, backend: str, start_holder: Callable[[HolderSpec], HolderProcess],
             gpu_of: Callable[[AppConfig], int]) -> None:
        """The node's backend, how to start a holder process, and which GPU an app is on."""
        if backend not in ("cuda", "cpu"):
            raise ValueError(f"backend must be 'cuda' or 'cpu', got {backend!r}")
        self.backend = "cuda" if backend == "cuda" else "cpu"
        self._start_holder = start_holder
        self._gpu_of = gpu_of

    def key(self, app: AppConfig) -> str | None:
        """Instances with the same key have identical weights and share one copy."""
        if not self.enabled or app.is_dag or not app.model:
            return None
        ort = self._ort_key(app)
        if ort is not None or app.file is not None:
            return ort  # (another model file's engine holds its own copy of the weights)
        if not engine_class(app.engine.kind).uses_torch_weights:
            return None  # the engine runs its own copy of the weights (an ONNX session, a plan...)
        gpu = f"|gpu{self._gpu_of(app)}" if self.backend == "cuda" else ""
        return f"{app.model}|{app.seed}|{app.num_classes}|{'x'.join(map(str, app.input_shape))}{gpu}"

    def _ort_key(self, app: AppConfig) -> str | None:
        """ONNX Runtime on the CPU provider of a cpu node: its sessions take one copy of the served
        model's initializers (:mod:`gpuprims.engines.ort_share`). Device initializers are not shared
        (docs/primitives.md says why)."""
        if self.backend != "cpu":
            return None
        kind = app.engine.kind
        if app.file is not None:
            try:
                kind = resolve_file_kind(None if kind == "eager" else kind, app.file.path)
            except EngineError:
                return None
        if kind != "onnxruntime" or app.engine.options.get("provider", "cpu") != "cpu":
            return None
        level = app.engine.options.get("optimization", "all")
        if app.file is not None:
            return f"onnxruntime|{app.file.fingerprint or app.file.path}|v{app.file.version}|{level}"
        return f"onnxruntime|{app.model}|{app.seed}|{app.num_classes}|{'x'.join(map(str, app.input_shape))}|{level}"

    def exported(self, app: AppConfig) -> bool:
        """True if a copy of this app's weights exists (or is being made)."""
        key = self.key(app)
        return key is not None and key in self.exports

    def mode_for(self, app: AppConfig, instance: str) -> str | None:
        """The instance's ``share_params``, and ``instance`` counted as a user of the copy: on CUDA
        always ``import:PATH`` (the first call starts the copy's holder); on the CPU ``export:PATH`` for
        the first instance of its weights and ``import:PATH`` after that. None when the app does not
        share, or when its holder cannot be started (the instance then loads weights of its own)."""
        key = self.key(app)
        if key is None:
            return None
        exp = self.exports.get(key)
        if exp is None:
            path = self.run_dir / f"params-{next(self._paths)}.bin"
            if self.backend == "cpu":
                self.exports[key] = Export(key, path, "cpu", users={instance}, exporter=instance)
                return f"export:{path}"
            spec = HolderSpec(key, app.model or "", app.seed, app.num_classes, tuple(app.input_shape),
                              self._gpu_of(app), str(path))
            try:
                holder = self._start_holder(spec)
            except OSError as e:
                log.error("cannot start the holder of %s's shared weights (%s); %s loads weights of its own",
                          app.name, e, instance)
                return None
            log.info("holder of the shared weights %s started (pid %d, handles %s)", key, holder.pid, path)
            exp = self.exports[key] = Export(key, path, "cuda", holder=holder)
        exp.users.add(instance)
        return f"import:{exp.path}"

    def instance_exited(self, instance: str) -> None:
        """``instance`` is gone (any exit: drained, crashed, killed): it maps nothing any more. A CPU
        exporter's segment stays valid (it is the node's); one that died before writing the handles
        leaves nothing to import, so the copy is forgotten and the next instance exports again."""
        for key, exp in list(self.exports.items()):
            exp.users.discard(instance)
            if exp.exporter == instance:
                exp.exporter = None
                if not exp.ready:
                    self._forget(self.exports.pop(key))

    def reap_holders(self) -> list[HolderExit]:
        """Collect holders that exited: a copy's holder that died is forgotten (new instances get a new
        holder), and returned with the instances that mapped it; retired holders are only collected."""
        gone: list[HolderExit] = []
        for key, exp in list(self.exports.items()):
            rc = exp.holder.poll() if exp.holder is not None else None
            if rc is None:
                continue
            exported = exp.ready
            reason = Path(str(exp.path) + ERROR_SUFFIX)
            if not exported and not reason.exists():
                # Killed before it could say why: its waiting instances must not wait out their deadline.
                with contextlib.suppress(OSError):
                    reason.write_text(f"the holder (pid {exp.holder.pid if exp.holder else -1}) exited with status "
                                      f"{rc} before exporting them")
            del self.exports[key]
            self._forget(exp, keep_error=True)
            gone.append(HolderExit(exp, rc, exported, tuple(sorted(exp.users))))
        self._retiring = [exp for exp in self._retiring if exp.holder is not None and exp.holder.poll() is None]
        return gone

    def release_unused(self) -> list[Export]:
        """Release the copies no instance maps any more (their app was unloaded): a holder is told to
        exit (SIGTERM), a CPU segment is unlinked. Call it once replacements have been started, never
        between an instance's exit and its replacement's start."""
        released = []
        for key, exp in list(self.exports.items()):
            if exp.users:
                continue
            del self.exports[key]
            released.append(exp)
            if exp.holder is not None:
                log.info("no instance maps the shared weights %s any more; stopping their holder (pid %d)",
                         key, exp.holder.pid)
                with contextlib.suppress(OSError):
                    exp.holder.terminate()
                self._retiring.append(exp)
            self._forget(exp)
        return released

    def holders(self) -> list[HolderProcess]:
        """Every holder process still to be reaped (serving a copy, or told to exit)."""
        return [exp.holder for exp in [*self.exports.values(), *self._retiring] if exp.holder is not None]

    def stop_holders(self, timeout_s: float = HOLDER_STOP_S) -> None:
        """Stop every holder (after every instance is gone): SIGTERM, then SIGKILL after ``timeout_s``."""
        procs = self.holders()
        for p in procs:
            with contextlib.suppress(OSError):
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("holder pid %d ignored SIGTERM; killing it", p.pid)
                p.kill()
                p.wait()
        self._retiring.clear()

    def describe(self) -> list[dict[str, object]]:
        """Each live copy: key, path, backend, users, exporter or holder pid, ready."""
        return [exp.describe() for exp in self.exports.values()]

    def remove_all(self) -> None:
        """Stop the holders and remove the exported handles, and the shared-memory objects behind CPU
        exports (every instance is gone by now)."""
        self.stop_holders()
        for exp in self.exports.values():
            self._forget(exp)
        self.exports.clear()
        for reason in self._reasons:
            with contextlib.suppress(OSError):
                reason.unlink()
        self._reasons.clear()

    def _forget(self, exp: Export, *, keep_error: bool = False) -> None:
        """Remove a copy's handles file (and its CPU segment, which only the node still names)."""
        with contextlib.suppress(OSError, ValueError):
            h = ParameterHandles.from_bytes(exp.path.read_bytes())
            if h.backend == "cpu":
                os.unlink("/dev/shm/" + h.handle.decode())
        with contextlib.suppress(OSError):
            exp.path.unlink()
        reason = Path(str(exp.path) + ERROR_SUFFIX)
        if keep_error:
            self._reasons.append(reason)
            return
        with contextlib.suppress(OSError):
            reason.unlink()
