"""An instance process's entry point: ``python -m orchestrator.worker.launch`` (the supervisor starts every
instance this way; :func:`orchestrator.worker.instance.main` does the rest).

Importing the instance code (torch, the model zoo) is the largest part of an instance's start-up on
the CPU backend: about 1.5 s of one core. For an active instance that is urgent work. A shadow that
pre-warms (cpu backend) is started ahead of need while the app's active instance serves on the same
cores; at normal priority its import took CPU time from the active and the app missed its SLO for a
second or two after every shadow start (bench/overlap). So when the supervisor sets
``GPUPRIMS_IMPORT_NICE``, the import runs in a thread at that nice value (nice is per thread on
Linux) while the main thread waits; the main thread, which will serve, keeps its normal priority, so
nothing has to be raised back (which an unprivileged process could not do).

The nice value is a trade: at 10 (weight 110 against 1024) the import gets about a tenth of a core
that normal threads keep busy, so it ends within about 15 s behind two busy loops, and it takes at
most about a tenth of a core from an active instance it shares a core with.

This module imports nothing heavy at its top, on purpose: that is its whole job. What it imports at the
lowered priority is what the instance needs (`orchestrator.control.spec.instance_imports`): torch and the zoo's
runner for a zoo model, only numpy and the engine's library for a model file on ONNX Runtime.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from orchestrator.control.spec import ENV_SPEC, INSTANCE_MODULE, InstanceSpec, instance_imports

#: The nice value to import the instance code at, for a pre-warming shadow (set by the supervisor).
ENV_IMPORT_NICE = "GPUPRIMS_IMPORT_NICE"


def import_at_nice(module: str, nice: int) -> dict[str, Any]:
    """Import ``module`` in a thread whose nice value is ``nice`` and wait for it; the calling thread's
    priority is not touched. Returns what happened: ``nice`` (the value the import ran at, or None if
    the system refused it: the import then ran at normal priority) and ``import_ms``. An exception
    raised by the import is raised here, in the calling thread."""
    if not isinstance(nice, int) or isinstance(nice, bool) or not 0 <= nice <= 19:
        raise ValueError(f"nice must be an integer in 0..19, got {nice!r}")
    result: dict[str, Any] = {"nice": None}
    error: list[BaseException] = []

    def run() -> None:
        with contextlib.suppress(OSError):  # refused: import at normal priority rather than not at all
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            result["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        try:
            importlib.import_module(module)
        except BaseException as e:  # re-raised in the calling thread
            error.append(e)

    t0 = time.monotonic()
    thread = threading.Thread(target=run, name="import", daemon=True)
    thread.start()
    thread.join()
    result["import_ms"] = round((time.monotonic() - t0) * 1e3, 1)
    if error:
        raise error[0]
    return result


def import_nice_from_env(env: dict[str, str] | os._Environ[str] = os.environ) -> int | None:
    """The nice value the supervisor asked for (None: import at normal priority). A value that is not
    an integer in 0..19 is ignored (the import runs at normal priority) rather than failing the start."""
    raw = env.get(ENV_IMPORT_NICE)
    if raw is None:
        return None
    try:
        nice = int(raw)
    except ValueError:
        return None
    return nice if 0 <= nice <= 19 else None


def imports_from_env(env: dict[str, str] | os._Environ[str] = os.environ) -> tuple[str, ...]:
    """The modules this instance imports (`orchestrator.control.spec.instance_imports` of the spec in ``env``),
    or the instance code alone when the spec does not read (the instance then says why and exits)."""
    try:
        return instance_imports(InstanceSpec.from_json(env[ENV_SPEC]))
    except (KeyError, ValueError, TypeError):
        return (INSTANCE_MODULE,)


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when the orchestrator dies (PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)


def main() -> int:
    # Before the import, which can take seconds: an orphan must not outlive the orchestrator, and a
    # terminal's Ctrl-C (sent to the whole process group) is the orchestrator's to handle.
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    nice = import_nice_from_env()
    info = None
    if nice is not None:  # what the instance will import (torch too, for a zoo model), all at that nice value
        for module in imports_from_env():
            done = import_at_nice(module, nice)
            info = done if info is None else {**done, "import_ms": round(info["import_ms"] + done["import_ms"], 1)}
    instance = importlib.import_module(INSTANCE_MODULE)
    try:
        rc = int(instance.main(import_info=info))
    except SystemExit as e:  # SIGTERM's handler, or a bad spec: main has closed what it held
        rc = exit_status(e)
    return rc


def run_forked() -> int:
    """An instance forked from the fork server (`orchestrator.worker.forkserver`), its environment already
    taken: the code is imported, so only what :func:`main` does around the import is left. Its
    import info says it was forked (``import_ms`` 0, ``forked`` true)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the server forked it already dying with its parent)
    instance = importlib.import_module(INSTANCE_MODULE)
    try:
        rc = int(instance.main(import_info={"nice": None, "import_ms": 0.0, "forked": True}))
    except SystemExit as e:
        rc = exit_status(e)
    logging.shutdown()
    return rc


def exit_status(e: SystemExit) -> int:
    """The process exit status a SystemExit stands for, as the interpreter would make it: its int
    code, 0 for none, 1 for anything else (a message)."""
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def exit_now(rc: int) -> None:
    """Leave without the interpreter's teardown. The instance has closed what it holds (pool, control
    socket, its last words sent) by now; tearing down torch's modules would cost about 0.35 s of one
    core (measured), run at normal priority on the cores an app's new active instance serves on right
    after a switch, and stall it (an OpenMP team with one thread descheduled waits at every barrier):
    bench/overlap showed a 0.5 s dip in SLO attainment right after each switch."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(rc)


if __name__ == "__main__":
    exit_now(main())
