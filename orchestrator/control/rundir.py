"""Who runs in a run directory, whether it is still alive, and cleaning up after one that is not.

A node records itself in ``<run_dir>/node.json`` (`NodeRecord`): its pid and that process's start
time (``/proc/<pid>/stat`` field 22, clock ticks since boot, so a recycled pid is not mistaken for
the node), wall-clock start, config path, name, UDP ports, URLs and the names of the shared-memory
objects it created. `node_state` tells a live node from a dead one: the pid with the same start
time, else (a directory without a record, from an older node) whether ``command.sock`` still
accepts a connection. `reap` removes what a dead node left: the packet pool (``/dev/shm/gpuprims-
<pid>-*``, the name `gpuprims.pool.PacketPool.create` gives), the CPU Param-Share segments named in
its ``params-*.bin`` handle files, its sockets, token and record, and the run directory itself when
nothing else is in it. `claim` is what a starting node calls on its run directory: it refuses a live
node's, clears a dead node's, and writes the new record. `sweep_dead_segments` is what every node does
at start, wherever its run directory: it removes this user's pools and CPU Param-Share segments whose
owning process is gone (a node or program SIGKILLed anywhere), which no run directory may name.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import signal
import socket
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.control.channel import ENV_ADDRESS

log = logging.getLogger("gpuprims.rundir")

RECORD_FILE = "node.json"
SHM_DIR = Path("/dev/shm")
#: Files a node creates in its run directory (besides params-*.bin), removed by `reap`.
NODE_FILES = ("token", "control.sock", "command.sock", "measure.lock", RECORD_FILE)
CURRENT_LINK = "current"
#: Shared-memory objects named after the process whose lifetime they follow: packet pools
#: (``gpuprims-<pid>-*``, `gpuprims.pool.PacketPool.create`) and CPU Param-Share segments
#: (``gpuprims-params-<pid>-*``, `gpuprims.cuda.ipc.export_parameters`: the node's pid for its
#: instances' exports, which importers use while the node runs even after their exporter died).
SEGMENT_NAME = re.compile(r"gpuprims-(?:params-)?(\d+)-[^/]+")


class RunDirBusy(RuntimeError):
    """The run directory belongs to a node that is still running."""


def proc_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, /proc/<pid>/stat field 22); None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields resume after the last ')'.
    rest = raw[raw.rfind(b")") + 2:].split()
    try:
        if rest[0] == b"Z":  # a zombie has exited; only its parent has not reaped it yet
            return None
        return int(rest[19])
    except (IndexError, ValueError):
        return None


@dataclass
class NodeRecord:
    """What ``node.json`` holds about the node of one run directory."""

    pid: int
    start_ticks: int
    started_at: float  # Unix time (s)
    config: str | None = None
    name: str | None = None
    ports: list[int] = field(default_factory=list)
    urls: dict[str, str] = field(default_factory=dict)
    shm: list[str] = field(default_factory=list)  # shared-memory object names (without /dev/shm/)

    @classmethod
    def for_this_process(cls, **fields: Any) -> NodeRecord:
        ticks = proc_start_ticks(os.getpid())
        return cls(pid=os.getpid(), start_ticks=ticks or 0, started_at=time.time(), **fields)

    @property
    def alive(self) -> bool:
        """True while the recorded process (same pid and start time) exists."""
        return proc_start_ticks(self.pid) == self.start_ticks

    def describe(self) -> str:
        """One line naming the node: name, config, ports, start time, pid."""
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started_at))
        ports = ",".join(map(str, self.ports)) or "-"
        return f"{self.name or '?'} (config {self.config or '-'}, UDP port {ports}, started {started}, pid {self.pid})"


def write_record(run_dir: str | os.PathLike[str], rec: NodeRecord) -> Path:
    """Write (or replace) ``node.json`` atomically, mode 0600."""
    path = Path(run_dir) / RECORD_FILE
    tmp = path.with_name(f".{RECORD_FILE}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(rec), f)
    tmp.replace(path)
    return path


def read_record(run_dir: str | os.PathLike[str]) -> NodeRecord | None:
    """The record of ``run_dir``, or None when there is none or it is unreadable."""
    try:
        d = json.loads((Path(run_dir) / RECORD_FILE).read_text())
        return NodeRecord(**d)
    except (OSError, ValueError, TypeError):
        return None


def update_record(run_dir: str | os.PathLike[str], **fields: Any) -> NodeRecord:
    """Change some fields of this process's record (ports, urls, shm...) and rewrite it."""
    rec = read_record(run_dir)
    if rec is None or rec.pid != os.getpid():
        rec = NodeRecord.for_this_process()
    for k, v in fields.items():
        if not hasattr(rec, k):
            raise ValueError(f"NodeRecord has no field {k!r}")
        setattr(rec, k, v)
    write_record(run_dir, rec)
    return rec


def _socket_answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def node_state(run_dir: str | os.PathLike[str]) -> str:
    """``live``, ``dead`` (a node ran here and is gone), ``starting`` (a token but no record and no
    socket yet: a node of an older version starting, or one that died that early) or ``empty``."""
    d = Path(run_dir)
    rec = read_record(d)
    if rec is not None:
        return "live" if rec.alive else "dead"
    sock = d / "command.sock"
    if sock.exists():
        return "live" if _socket_answers(sock) else "dead"
    if (d / "token").exists():
        return "starting"
    return "empty"


@dataclass
class Removed:
    """What `reap` removed after a dead node."""

    run_dir: Path
    record: NodeRecord | None
    shm: list[str] = field(default_factory=list)
    shm_bytes: int = 0
    files: list[str] = field(default_factory=list)
    dir_removed: bool = False
    killed: list[int] = field(default_factory=list)  # its instance processes that were still running

    def describe(self) -> str:
        who = self.record.describe() if self.record is not None else "a node with no record"
        parts = []
        if self.killed:
            parts.append(f"{len(self.killed)} leftover instance process(es) (pid {', '.join(map(str, self.killed))})")
        if self.shm:
            parts.append(f"{len(self.shm)} shared-memory segment(s) ({self.shm_bytes / 1e6:.1f} MB: "
                         f"{', '.join(self.shm)})")
        if self.dir_removed:
            parts.append(f"run dir {self.run_dir}")
        elif self.files:
            parts.append(f"{', '.join(self.files)} in {self.run_dir}")
        return f"removed what dead node {who} left: " + ("; ".join(parts) if parts else "nothing")


def _param_segments(run_dir: Path) -> list[str]:
    from gpuprims.cuda.ipc import ParameterHandles

    out = []
    for p in sorted(run_dir.glob("params-*.bin")):
        with contextlib.suppress(OSError, ValueError, TypeError):
            h = ParameterHandles.from_bytes(p.read_bytes())
            if h.backend == "cpu":
                out.append(h.handle.decode())
    return out


def _segments_of(run_dir: Path, rec: NodeRecord | None) -> list[str]:
    names = list(rec.shm) if rec is not None else []
    if rec is not None:
        # The packet pool is named after the process that created it (gpuprims.pool._fresh_name).
        names += [p.name for p in SHM_DIR.glob(f"gpuprims-{rec.pid}-*")]
    names += _param_segments(run_dir)
    return sorted({n.lstrip("/") for n in names if n and "/" not in n.lstrip("/")})


def leftover_processes(run_dir: str | os.PathLike[str]) -> list[int]:
    """Processes of this user started as instances of the node in ``run_dir`` (their environment
    names its control socket), other than this one."""
    needle = f"{ENV_ADDRESS}=ipc://{Path(run_dir).absolute()}/".encode()
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            env = (p / "environ").read_bytes()
        except OSError:
            continue
        if any(entry.startswith(needle) for entry in env.split(b"\0")):
            out.append(int(p.name))
    return sorted(out)


def _kill(pids: list[int], grace_s: float = 2.0) -> list[int]:
    """SIGTERM, then SIGKILL what is left after ``grace_s``; the pids that were running."""
    ticks = {pid: proc_start_ticks(pid) for pid in pids}
    alive = [pid for pid, t in ticks.items() if t is not None]
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(proc_start_ticks(p) == ticks[p] for p in alive):
        time.sleep(0.02)
    for pid in alive:
        if proc_start_ticks(pid) == ticks[pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return alive


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def sweep_dead_segments(shm_dir: str | os.PathLike[str] = SHM_DIR) -> list[tuple[str, int]]:
    """Remove this user's pools and Param-Share segments whose owning process is gone; returns each
    removed ``(name, bytes)``. A segment of a live process (or of a recycled pid) is kept."""
    out: list[tuple[str, int]] = []
    d = Path(shm_dir)
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return out
    uid = os.getuid()
    for name in names:
        m = SEGMENT_NAME.fullmatch(name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        p = d / name
        try:
            st = p.stat()
            if st.st_uid != uid:
                continue
            p.unlink()
        except OSError:
            continue
        out.append((name, st.st_size))
    return out


def reap(run_dir: str | os.PathLike[str]) -> Removed:
    """Remove what the dead node of ``run_dir`` left. Raises RunDirBusy if it is alive after all."""
    d = Path(run_dir)
    if node_state(d) == "live":
        rec = read_record(d)  # "starting" is reaped only when asked for by name (claim, --run-dir)
        raise RunDirBusy(f"a node is running in {d}" + (f": {rec.describe()}" if rec else ""))
    rec = read_record(d)
    out = Removed(run_dir=d, record=rec)
    # Instances normally follow their orchestrator (PDEATHSIG); one that did not still maps the memory.
    out.killed = _kill(leftover_processes(d))
    for name in _segments_of(d, rec):
        p = SHM_DIR / name
        try:
            size = p.stat().st_size
            p.unlink()
        except OSError:
            continue
        out.shm.append(name)
        out.shm_bytes += size
    for name in (*NODE_FILES, *(p.name for p in d.glob("params-*.bin")), *(p.name for p in d.glob(f".{RECORD_FILE}.*"))):
        with contextlib.suppress(OSError):
            (d / name).unlink()
            out.files.append(name)
    link = d.parent / CURRENT_LINK
    with contextlib.suppress(OSError):
        if link.is_symlink() and Path(os.readlink(link)) == d:
            link.unlink()
    try:
        d.rmdir()
        out.dir_removed = True
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
            raise
    return out


def claim(run_dir: str | os.PathLike[str], rec: NodeRecord) -> Removed | None:
    """Make ``run_dir`` (created, mode 0700) this node's: refuse a live node's (RunDirBusy), reap a
    dead node's (returned, so the caller can say what it removed), then write ``rec``."""
    d = Path(run_dir)
    removed = None
    state = node_state(d)
    if state == "live":
        other = read_record(d)
        if other is None or other.pid != os.getpid():
            raise RunDirBusy(f"a node is already running in {d}" + (f": {other.describe()}" if other else "")
                             + "; stop it first or give this one another --name / --run-dir")
        return None  # this process claimed it already (the CLI, before its Node): keep that record
    elif state in ("dead", "starting"):
        removed = reap(d)
        if removed.dir_removed:
            d.mkdir(mode=0o700)
    write_record(d, rec)
    return removed


@dataclass
class NodeEntry:
    """A run directory found under the runtime base, with its record and state."""

    run_dir: Path
    record: NodeRecord | None
    state: str

    def describe(self) -> str:
        who = self.record.describe() if self.record is not None else "(no record)"
        return f"{who} in {self.run_dir}"


def find_nodes(base: str | os.PathLike[str]) -> list[NodeEntry]:
    """Every run directory under ``base`` that holds a node, live or dead (not the ``current`` link)."""
    out = []
    b = Path(base)
    for d in sorted(p for p in b.iterdir() if p.is_dir() and not p.is_symlink()) if b.is_dir() else []:
        state = node_state(d)
        if state not in ("empty", "starting"):
            out.append(NodeEntry(d.resolve(), read_record(d), state))
    return out


def reap_dead(entries: Iterable[NodeEntry]) -> list[Removed]:
    """`reap` every dead entry; a node that came alive meanwhile is left alone."""
    out = []
    for e in entries:
        if e.state != "dead":
            continue
        with contextlib.suppress(RunDirBusy):
            out.append(reap(e.run_dir))
    return out
