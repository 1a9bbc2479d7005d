"""How the supervisor starts an instance: the launcher it is handed.

The supervisor decides *what* to start (an `InstanceSpec` and the environment that lets the instance
connect to the control plane); a launcher decides *how*. The node's default, `SubprocessLauncher`,
runs ``python -m orchestrator.worker.launch`` (`orchestrator.worker.launch`, then `orchestrator.worker.instance`). A test
hands the supervisor a double instead whose processes play an instance's messages (Ready,
Heartbeat, Ended, Error, an exit status) over the same control plane, so the supervision rules are
tested in one process without real instances (tests/orchestrator/fake_launcher.py), as Ray Serve's
unit tests hand its deployment state a mock replica.

What the supervisor needs of a started instance is the part of `subprocess.Popen` it uses: its
``pid``, ``poll()``, ``kill()``, ``terminate()`` and ``wait(timeout)`` (`InstanceProcess`).

The node's default is `ForkLauncher`: instances are forked from a fork server that has imported the
instance code once (`orchestrator.worker.forkserver`), so an instance starts in milliseconds instead of
seconds of import on the cores the others serve on. Where no fork server is ready (it is starting
again after it died, or it could not start) an instance is started as `SubprocessLauncher` starts it,
so a launch never waits on a server that may not come back.

Fork servers are kept per need (`instance_imports`): an instance of a zoo model (whatever its engine:
its runner gathers into torch tensors) or of a model file on a torch kind is forked from a server that
has imported torch and the zoo; a model file on ONNX Runtime, OpenVINO or TensorRT from one that has
imported only the instance code, numpy, the engine's module and its library. Each is started when the
first instance that needs it is launched, so a node whose apps are all ONNX files holds no torch at all.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from orchestrator.control.spec import InstanceSpec, instance_imports
from orchestrator.worker import forkserver

__all__ = ["ForkLauncher", "ForkedProcess", "InstanceProcess", "Launcher", "SubprocessLauncher", "import_env_key",
           "instance_imports"]

log = logging.getLogger(__name__)

#: The directory ``orchestrator`` is in: the instances' working directory, so ``-m`` finds the package.
_ROOT = Path(__file__).resolve().parents[2]


class InstanceProcess(Protocol):
    """A started instance, as the supervisor sees it (the subset of `subprocess.Popen` it uses)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None:
        """The exit status once it has exited (negative: killed by that signal), else None."""
        ...

    def kill(self) -> None:
        """SIGKILL."""
        ...

    def terminate(self) -> None:
        """SIGTERM."""
        ...

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit; `subprocess.TimeoutExpired` after ``timeout`` seconds."""
        ...


class Launcher(Protocol):
    """Starts one instance from its spec and its environment (control address, token, name, CPU share)."""

    def launch(self, spec: InstanceSpec, env: Mapping[str, str]) -> InstanceProcess:
        """Start the instance; raise OSError if it cannot be started at all."""
        ...


class SubprocessLauncher:
    """The real launcher: ``<python> -m orchestrator.worker.launch`` with ``env`` as its whole environment,
    stdin closed, in the repository's root (the instance reads its spec from ``env``)."""

    def __init__(self, python: str = sys.executable) -> None:
        if not python:
            raise ValueError("python must name the interpreter that runs the instances")
        self.python = python

    def launch(self, spec: InstanceSpec, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen([self.python, "-m", "orchestrator.worker.launch"], env=dict(env), stdin=subprocess.DEVNULL,
                                cwd=str(_ROOT))

    def __repr__(self) -> str:
        return f"SubprocessLauncher(python={self.python!r})"


#: Environment variables the instance applies itself after it starts, so a forked child may differ from
#: its fork server in them: gpuprims' own, CUDA's (read when CUDA initialises, which the server never
#: does). Any other difference (OpenMP's thread count and wait policy, which libgomp reads when torch
#: loads it; a library path; PYTHON*) needs a server imported with it.
RUNTIME_ENV_PREFIXES = ("GPUPRIMS_", "CUDA_", "NVIDIA_")
#: Fork servers kept per process; beyond it the least recently used one without children ends.
MAX_SERVERS = 6
#: Variables that differ between otherwise equal environments and that no library reads at import.
IGNORED_ENV_NAMES = frozenset({"PYTEST_CURRENT_TEST"})


def import_env_key(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of ``env`` a fork server must have been started with for a child to run with ``env``."""
    return tuple(sorted((k, v) for k, v in env.items()
                        if not k.startswith(RUNTIME_ENV_PREFIXES) and k not in IGNORED_ENV_NAMES))


class ForkedProcess:
    """An instance forked by a fork server, with `subprocess.Popen`'s ``pid``, ``returncode``,
    ``poll``, ``kill``, ``terminate`` and ``wait``. Its exit status comes from the server, which
    reaps it; a signal goes through the server, which sends it only while the child is unreaped."""

    def __init__(self, server: _ForkServer, pid: int) -> None:
        self._server = server
        self._pid = pid
        self._rc: int | None = None
        self._done = threading.Event()

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        return self._rc

    def _exited(self, rc: int) -> None:
        if self._rc is None:
            self._rc = rc
        self._done.set()

    def poll(self) -> int | None:
        return self._rc

    def send_signal(self, sig: int) -> None:
        if self._rc is None:
            self._server.signal(self._pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"forked instance {self._pid}", timeout or 0.0)
        assert self._rc is not None
        return self._rc

    def __repr__(self) -> str:
        return f"ForkedProcess(pid={self._pid}, returncode={self._rc})"


class _ForkServer:
    """The launcher's side of one fork server: the process, its socket, a reader thread that matches
    replies to requests and exits to `ForkedProcess` handles."""

    def __init__(self, python: str, env: Mapping[str, str], preload: str | None, entry: str | None) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock = ours
        args = [python, "-m", "orchestrator.worker.forkserver"]
        if preload is not None or entry is not None:
            args += [preload or "", entry or forkserver.ENTRY]
        child_env = dict(env)
        child_env[forkserver.ENV_FD] = str(theirs.fileno())
        try:
            self.proc = subprocess.Popen(args, env=child_env, stdin=subprocess.DEVNULL, cwd=str(_ROOT),
                                         pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        self.ready = threading.Event()
        self.dead = threading.Event()
        self.import_ms: float | None = None
        self.preload = preload
        #: What it imported, as it said when ready (forkserver.REPORTED: torch, numpy, onnxruntime...).
        self.holds: list[str] = []
        self.last_used = time.monotonic()
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._replies: dict[int, dict[str, Any]] = {}
        self._waiting: dict[int, threading.Event] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}
        self._reader = threading.Thread(target=self._read, name="forkserver-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        buf = b""
        try:
            while True:
                data = self.sock.recv(1 << 16)
                if not data:
                    break
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    self._on(json.loads(line))
        except (OSError, ValueError) as e:
            log.warning("fork server %d: reading its socket failed: %s", self.proc.pid, e)
        finally:
            self._lost()

    def _on(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "ready":
            self.import_ms = msg.get("import_ms")
            holds = msg.get("holds")
            self.holds = [str(h) for h in holds] if isinstance(holds, list) else []
            self.ready.set()
        elif op in ("forked", "error"):
            with self._lock:
                ev = self._waiting.pop(msg.get("id"), None)
                if ev is not None:
                    self._replies[msg["id"]] = msg
            if ev is not None:
                ev.set()
        elif op == "exit":
            with self._lock:
                child = self._children.pop(msg["pid"], None)
                if child is None:  # exited before its "forked" reply was handled
                    self._early_exits[msg["pid"]] = int(msg["rc"])
            if child is not None:
                child._exited(int(msg["rc"]))

    def _lost(self) -> None:
        """The server is gone (or its socket is): its children were sent SIGTERM by the kernel; make
        sure they are dead and report each as killed, so the supervisor replaces them."""
        self.dead.set()
        self.ready.set()
        with contextlib.suppress(OSError):
            self.sock.close()
        with self._lock:
            children, self._children = dict(self._children), {}
            waiting, self._waiting = dict(self._waiting), {}
        for ev in waiting.values():
            ev.set()
        for pid, child in children.items():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)  # orphaned moments ago: not yet reaped by init, so still it
            child._exited(-signal.SIGKILL)
        if children:
            log.error("fork server %d died; its %d instances are reported killed", self.proc.pid, len(children))
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)

    def live(self) -> int:
        """How many of its children are alive."""
        with self._lock:
            return len(self._children)

    def idle(self) -> bool:
        """Whether it has no child alive (it may be ended without ending an instance)."""
        with self._lock:
            return not self._children and not self._waiting

    def _send(self, msg: dict[str, Any]) -> None:
        data = json.dumps(msg, separators=(",", ":")).encode() + b"\n"
        # Its own lock: a send that blocks on a full socket must not keep the reader from draining
        # the server's replies (which take self._lock), or both sides would wait on each other.
        with self._send_lock:
            self.sock.sendall(data)

    def fork(self, env: Mapping[str, str], timeout_s: float = 30.0) -> ForkedProcess:
        rid = next(self._ids)
        self.last_used = time.monotonic()
        ev = threading.Event()
        with self._lock:
            self._waiting[rid] = ev
        try:
            self._send({"op": "fork", "id": rid, "env": dict(env)})
        except OSError as e:
            with self._lock:
                self._waiting.pop(rid, None)
            raise OSError(f"fork server {self.proc.pid} is gone: {e}") from e
        if not ev.wait(timeout_s):
            with self._lock:
                self._waiting.pop(rid, None)
            raise OSError(f"fork server {self.proc.pid} did not answer a fork in {timeout_s:g} s")
        with self._lock:
            reply = self._replies.pop(rid, None)
            if reply is None:
                raise OSError(f"fork server {self.proc.pid} died before it forked")
            if reply["op"] == "error":
                raise OSError(f"fork server {self.proc.pid}: {reply.get('error')}")
            pid = int(reply["pid"])
            child = ForkedProcess(self, pid)
            early = self._early_exits.pop(pid, None)
            if early is None:
                self._children[pid] = child
        if early is not None:
            child._exited(early)
        return child

    def signal(self, pid: int, sig: int) -> None:
        with contextlib.suppress(OSError):  # the server is gone: _lost() kills and reports its children
            self._send({"op": "signal", "pid": pid, "sig": int(sig)})

    def close(self, timeout_s: float = 10.0) -> None:
        """End the server (end of file on its socket); it exits and its children get SIGTERM."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout_s)


#: This process's fork servers by (interpreter, preload, entry, import environment).
_SERVERS: dict[tuple[Any, ...], _ForkServer] = {}
_SERVERS_LOCK = threading.Lock()


class ForkLauncher:
    """Starts instances by forking them from a fork server (`orchestrator.worker.forkserver`) that has
    imported the instance code once; one server per import environment (:func:`import_env_key`),
    shared by every `ForkLauncher` of this process with the same interpreter.

    A launch never waits for a server: while the server for its environment imports (at a lowered
    priority, `orchestrator.worker.forkserver`), or after it died and is starting again, the instance starts
    as `SubprocessLauncher` starts it. So the first instances of a process start as before, and every
    later one (replacements, shadows, the instances of a share change) is forked.

    What a server preloads is ``preload`` when given (comma-separated modules), else what the
    instance being launched needs (:func:`instance_imports`): one server for torch instances, another
    for the rest, each started by the first instance that needs it."""

    def __init__(self, python: str = sys.executable, *, preload: str | None = None,
                 entry: str | None = None) -> None:
        if not python:
            raise ValueError("python must name the interpreter that runs the instances")
        self.python = python
        self.preload = preload
        self.entry = entry
        self.fallback = SubprocessLauncher(python)

    def preload_for(self, spec: InstanceSpec | None) -> str:
        """What the server for ``spec``'s instance preloads: ``preload`` when given, else
        :func:`instance_imports` (the instance code alone without a spec)."""
        if self.preload is not None:
            return self.preload
        return ",".join(instance_imports(spec)) if spec is not None else forkserver.PRELOAD

    def server_for(self, env: Mapping[str, str], spec: InstanceSpec | None = None) -> _ForkServer | None:
        """The server for ``env``'s import environment and ``spec``'s imports (:meth:`preload_for`),
        started if there is none or it died."""
        preload = self.preload_for(spec)
        key = (self.python, preload, self.entry, import_env_key(env))
        with _SERVERS_LOCK:
            server = _SERVERS.get(key)
            if server is None or server.dead.is_set():
                base = dict(import_env_key(env))
                try:
                    server = _ForkServer(self.python, base, preload, self.entry)
                except OSError as e:
                    log.warning("could not start a fork server (%s); instances start as processes", e)
                    return None
                _SERVERS[key] = server
                idle = [k for k, s in _SERVERS.items() if s is not server and s.idle()]
                idle.sort(key=lambda k: _SERVERS[k].last_used)
                retired = [_SERVERS.pop(k) for k in idle[:max(0, len(_SERVERS) - MAX_SERVERS)]]
                if retired:  # each holds its imports (torch, for some); none has a child to lose
                    threading.Thread(target=lambda: [r.close() for r in retired], name="forkserver-retire",
                                     daemon=True).start()
        return server

    def launch(self, spec: InstanceSpec, env: Mapping[str, str]) -> InstanceProcess:
        server = self.server_for(env, spec)
        if server is not None and server.ready.is_set() and not server.dead.is_set():
            try:
                return server.fork(env)
            except OSError as e:
                log.warning("fork server failed (%s); %s starts as a process", e, spec.name)
        return self.fallback.launch(spec, env)

    def wait_ready(self, env: Mapping[str, str], timeout_s: float, spec: InstanceSpec | None = None) -> bool:
        """Start the server for ``env`` (and ``spec``'s imports) if there is none and wait until it can
        fork (True) or ``timeout_s`` passes or it dies (False)."""
        server = self.server_for(env, spec)
        return server is not None and server.ready.wait(timeout_s) and not server.dead.is_set()

    @staticmethod
    def describe() -> list[dict[str, Any]]:
        """This process's fork servers: pid, whether ready, its import's milliseconds, its live children,
        what it preloads and which libraries it holds (torch, numpy, onnxruntime...: as it said when ready)."""
        with _SERVERS_LOCK:
            servers = list(_SERVERS.values())
        return [{"pid": s.proc.pid, "ready": s.ready.is_set() and not s.dead.is_set(), "import_ms": s.import_ms,
                 "children": s.live(), "preload": [m for m in (s.preload or "").split(",") if m],
                 "holds": list(s.holds)} for s in servers]

    @staticmethod
    def starting() -> int:
        """How many of this process's fork servers are still importing."""
        with _SERVERS_LOCK:
            return sum(not s.ready.is_set() and not s.dead.is_set() for s in _SERVERS.values())

    @classmethod
    def close_all(cls, timeout_s: float = 10.0) -> None:
        """End every fork server of this process (at exit; tests at the end of a session)."""
        with _SERVERS_LOCK:
            servers = list(_SERVERS.values())
            _SERVERS.clear()
        for server in servers:
            server.close(timeout_s)

    def __repr__(self) -> str:
        return f"ForkLauncher(python={self.python!r})"


atexit.register(ForkLauncher.close_all, 2.0)
