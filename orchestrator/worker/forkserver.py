"""The fork server: imports the instance code once and forks each instance from it.

``python -m orchestrator.worker.launch`` spends most of an instance's start importing torch and the instance
code (about 2.8 s of one core on the 2-core CPU machine, more behind busy loops). A node that starts,
restarts and replaces instances pays that every time, on the cores its active instances serve on.
The fork server (``python -m orchestrator.worker.forkserver``, started by
:class:`orchestrator.node.launcher.ForkLauncher`) pays it once: it imports :data:`PRELOAD` and then, per
request, forks a child that takes the environment it is given and runs the instance
(:func:`orchestrator.worker.launch.run_forked`). The child starts in a few milliseconds.

The server is single-threaded: a loop on its socket to the launcher and a self-pipe woken by
SIGCHLD, so a fork never copies a thread that holds a lock. It is the children's parent, so it alone
reaps them, and it signals a child only for the launcher and only before reaping it: a signal can
never reach a reused pid. Messages are newline-delimited JSON over a stream socket:

- launcher to server: ``{"op": "fork", "id": n, "env": {...}}`` and
  ``{"op": "signal", "pid": p, "sig": s}``;
- server to launcher: ``{"op": "ready", "pid": p, "import_ms": t, "holds": [...]}`` once imported
  (``holds``: which of :data:`REPORTED` it imported),
  ``{"op": "forked", "id": n, "pid": p}`` or ``{"op": "error", "id": n, "error": "..."}``, and
  ``{"op": "exit", "pid": p, "rc": rc}`` when a child has exited (``rc`` as `subprocess.Popen`'s
  ``returncode``: negative for a signal).

The server imports at nice 10 (`orchestrator.worker.launch.import_at_nice`: only the importing thread is
lowered, so the children are forked at normal priority), because it imports beside instances that
serve; until it is ready the launcher starts instances as processes.

The server ends when its socket reaches end of file: the launcher closed it, or the process that holds
it died (a SIGKILLed orchestrator). Its children then get SIGTERM from the kernel
(`orchestrator.worker.launch.die_with_parent`), as instances did when their orchestrator died.

What a forked child cannot change is what the libraries read from the environment when they were
imported (OpenMP's wait policy, for one). The launcher therefore keeps one server per such
environment (:func:`orchestrator.node.launcher.import_env_key`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from orchestrator.worker.launch import die_with_parent, exit_status, import_at_nice

__all__ = ["PRELOAD", "main", "serve"]

#: What the server imports before it forks (modules, comma-separated): what ``orchestrator.worker.launch`` would
#: import in each instance. The launcher asks per need (`orchestrator.node.launcher.instance_imports`): the
#: zoo's runner (torch) for torch instances, the engine's module and library for the rest.
PRELOAD = "orchestrator.worker.instance"
#: Libraries a server reports holding when it is ready (what status says of it).
REPORTED = ("torch", "numpy", "onnxruntime", "openvino", "tensorrt", "apps.zoo")
#: The function a forked child runs (module:function); it returns the exit status.
ENTRY = "orchestrator.worker.launch:run_forked"
#: The file descriptor the launcher passes the server's end of the socket on.
ENV_FD = "GPUPRIMS_FORKSERVER_FD"
#: The nice value the server imports at (a thread of its own: the forking thread keeps its priority).
IMPORT_NICE = 10
#: The largest message accepted (an instance's environment with its spec is a few KiB).
MAX_MESSAGE = 4 << 20


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall(json.dumps(msg, separators=(",", ":")).encode() + b"\n")


def _entry(spec: str) -> Callable[[], int]:
    module, _, name = spec.partition(":")
    fn = getattr(importlib.import_module(module), name)
    if not callable(fn):
        raise TypeError(f"{spec} is not callable")
    return fn  # type: ignore[no-any-return]


def _child(sock: socket.socket, wake: tuple[int, int], env: dict[str, str], entry: Callable[[], int],
           server_pid: int) -> None:
    """In the forked child: drop the server's descriptors and handlers, take ``env``, run ``entry``;
    never returns."""
    rc = 1
    try:
        # Before anything else: a child must not outlive the server (nor, through it, the orchestrator).
        die_with_parent()
        if os.getppid() != server_pid:  # the server died before the request above took effect
            os._exit(1)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        for fd in wake:
            os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        rc = int(entry())
    except SystemExit as e:
        rc = exit_status(e)
    except BaseException:  # the child's own failure: said on its stderr, as a started process would
        with contextlib.suppress(Exception):
            traceback.print_exc()
        rc = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(rc)


def _valid_env(raw: object) -> dict[str, str] | None:
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items()):
        return None
    if any(not k or "=" in k or "\0" in k or "\0" in v for k, v in raw.items()):
        return None
    return raw


def serve(sock: socket.socket, entry: Callable[[], int], import_ms: float) -> int:
    """Fork children for the launcher on ``sock`` until it closes; returns the server's exit status."""
    rfd, wfd = os.pipe()
    os.set_blocking(rfd, False)
    os.set_blocking(wfd, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wfd)
    children: set[int] = set()
    server = os.getpid()
    buf = b""
    _send(sock, {"op": "ready", "pid": os.getpid(), "import_ms": import_ms,
                 "holds": [m for m in REPORTED if m in sys.modules]})
    while True:
        try:
            readable = select.select([sock, rfd], [], [])[0]
        except InterruptedError:  # pragma: no cover - PEP 475 retries select
            continue
        if rfd in readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(rfd, 512):
                    pass
        for pid in sorted(children):  # only our own children, each at most once
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                children.discard(pid)
                _send(sock, {"op": "exit", "pid": pid, "rc": os.waitstatus_to_exitcode(status)})
        if sock not in readable:
            continue
        data = sock.recv(1 << 16)
        if not data:
            return 0
        buf += data
        if len(buf) > MAX_MESSAGE and b"\n" not in buf:
            print("forkserver: message too long; closing", file=sys.stderr)
            return 1
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                msg = json.loads(line)
            except ValueError:
                msg = None
            if not isinstance(msg, dict):
                print("forkserver: ignoring a malformed message", file=sys.stderr)
                continue
            if msg.get("op") == "fork":
                env = _valid_env(msg.get("env"))
                if env is None:
                    _send(sock, {"op": "error", "id": msg.get("id"), "error": "env must map names to strings"})
                    continue
                try:
                    pid = os.fork()
                except OSError as e:
                    _send(sock, {"op": "error", "id": msg.get("id"), "error": f"fork failed: {e}"})
                    continue
                if pid == 0:
                    _child(sock, (rfd, wfd), env, entry, server)
                children.add(pid)
                _send(sock, {"op": "forked", "id": msg.get("id"), "pid": pid})
            elif msg.get("op") == "signal":
                pid, sig = msg.get("pid"), msg.get("sig")
                if pid in children and isinstance(sig, int):  # not reaped yet: the pid is still that child
                    with contextlib.suppress(ProcessLookupError, ValueError, OSError):
                        os.kill(pid, sig)
            else:
                print(f"forkserver: ignoring unknown op {msg.get('op')!r}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    preload = args[0] if len(args) > 0 else PRELOAD
    entry_spec = args[1] if len(args) > 1 else ENTRY
    # Ctrl-C in a terminal goes to the whole process group: the orchestrator's to handle. SIGTERM ends
    # the server (its children then get their own SIGTERM from the kernel).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(os.environ.pop(ENV_FD)))
    t0 = time.monotonic()
    for module in filter(None, preload.split(",")):
        # Below the instances it serves beside: launches start processes until it is ready.
        import_at_nice(module, IMPORT_NICE)
    entry = _entry(entry_spec)
    try:
        return serve(sock, entry, round((time.monotonic() - t0) * 1e3, 1))
    except (BrokenPipeError, ConnectionResetError):
        return 0


if __name__ == "__main__":
    os._exit(main())
