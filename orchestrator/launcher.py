"""How the supervisor starts an instance: the launcher it is handed.

The supervisor decides *what* to start (an `InstanceSpec` and the environment that lets the instance
connect to the control plane); a launcher decides *how*. The node's default, `SubprocessLauncher`,
runs ``python -m orchestrator.launch`` (`orchestrator.launch`, then `orchestrator.instance`). A test
hands the supervisor a double instead whose processes play an instance's messages (Ready,
Heartbeat, Ended, Error, an exit status) over the same control plane, so the supervision rules are
tested in one process without real instances (tests/orchestrator/fake_launcher.py), as Ray Serve's
unit tests hand its deployment state a mock replica.

What the supervisor needs of a started instance is the part of `subprocess.Popen` it uses: its
``pid``, ``poll()``, ``kill()``, ``terminate()`` and ``wait(timeout)`` (`InstanceProcess`).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from orchestrator.spec import InstanceSpec

__all__ = ["InstanceProcess", "Launcher", "SubprocessLauncher"]

#: The directory ``orchestrator`` is in: the instances' working directory, so ``-m`` finds the package.
_ROOT = Path(__file__).resolve().parent.parent


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
    """The real launcher: ``<python> -m orchestrator.launch`` with ``env`` as its whole environment,
    stdin closed, in the repository's root (the instance reads its spec from ``env``)."""

    def __init__(self, python: str = sys.executable) -> None:
        if not python:
            raise ValueError("python must name the interpreter that runs the instances")
        self.python = python

    def launch(self, spec: InstanceSpec, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen([self.python, "-m", "orchestrator.launch"], env=dict(env), stdin=subprocess.DEVNULL,
                                cwd=str(_ROOT))

    def __repr__(self) -> str:
        return f"SubprocessLauncher(python={self.python!r})"
