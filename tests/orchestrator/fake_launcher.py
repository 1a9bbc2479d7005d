"""A launcher double: instances that play an instance's messages, in the test's own process.

`FakeLauncher` is handed to a `Node` (``launcher=``) run with the in-process control plane
(``control_kind="inproc"``). Each launched `FakeInstance` connects with the environment the supervisor
gave it, exactly as ``orchestrator.worker.launch`` would, and answers the supervisor's commands whenever the
supervisor looks at it (``poll()``): Shutdown and Finish end it (Ended, exit 0), InitGpu makes a
shadow ready. The test plays the rest: `ready`, `beat`, `end`, `error`, `die` (an exit status) and
`hang` (it stops answering and beating). It never takes a request off its consumer ring, so what
it holds when it goes is exactly what the test sent to it. (Like Ray Serve's
serve/tests/unit/test_deployment_state.py, where a mock replica stands in for the actor.)
"""

from __future__ import annotations

import itertools
import signal
import subprocess
from collections.abc import Mapping
from typing import Any

from orchestrator.control.channel import InstanceClient, connect_instance_from_env
from orchestrator.control.messages import Ended, Error, Finish, Heartbeat, InitGpu, Ready, Shutdown
from orchestrator.control.records import InstanceStats
from orchestrator.control.spec import InstanceSpec

_PIDS = itertools.count(900_001)  # no real process has these ids here; they are only labels


class FakeInstance:
    """One played instance (the `orchestrator.node.launcher.InstanceProcess` surface plus the test's verbs)."""

    def __init__(self, spec: InstanceSpec, env: Mapping[str, str], *, auto_ready: bool) -> None:
        self.spec = spec
        self.pid = next(_PIDS)
        self.returncode: int | None = None
        self.hung = False
        self.received: list[Any] = []  # every command the supervisor sent it, in order
        self.client: InstanceClient | None = connect_instance_from_env(env)
        if auto_ready and not spec.defer_init:
            self.ready(initialized=True)
        elif auto_ready:
            self.ready(initialized=False)

    # -- what the test plays ---------------------------------------------------------------------------
    def send(self, msg: Any) -> None:
        assert self.client is not None, f"{self.spec.name} has exited"
        self.client.send(msg)

    def ready(self, *, initialized: bool = True, **info: Any) -> None:
        self.send(Ready(instance=self.spec.name, pid=self.pid, info={"initialized": initialized, **info}))

    def beat(self, **stats: Any) -> None:
        self.send(Heartbeat(instance=self.spec.name, stats=InstanceStats(**stats)))

    def end(self, drained: int = 0) -> None:
        self.send(Ended(instance=self.spec.name, drained_count=drained))

    def error(self, kind: str, message: str) -> None:
        self.send(Error(instance=self.spec.name, kind=kind, message=message))

    def die(self, status: int) -> None:
        """Exit with ``status`` (negative: killed by that signal) without a word."""
        self._exit(status)

    def hang(self) -> None:
        """Stop beating and answering (the process stays alive until it is killed)."""
        self.hung = True

    # -- what the supervisor uses ----------------------------------------------------------------------
    def poll(self) -> int | None:
        if self.returncode is None and not self.hung and self.client is not None:
            self._answer()
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            self._exit(-signal.SIGKILL)

    def terminate(self) -> None:
        if self.returncode is None:
            self._exit(-signal.SIGTERM)

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            raise subprocess.TimeoutExpired(f"fake instance {self.spec.name}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    # -- inside ---------------------------------------------------------------------------------------
    def _answer(self) -> None:
        assert self.client is not None
        while self.returncode is None and (msg := self.client.poll(0)) is not None:
            self.received.append(msg)
            if isinstance(msg, Shutdown | Finish):
                self.end()
                self._exit(0)
            elif isinstance(msg, InitGpu):
                self.ready(initialized=True)

    def _exit(self, status: int) -> None:
        self.returncode = status
        if self.client is not None:
            self.client.close()
            self.client = None

    def __repr__(self) -> str:
        return f"FakeInstance({self.spec.name}, pid={self.pid}, returncode={self.returncode})"


class FakeLauncher:
    """Launches `FakeInstance`s; ``auto_ready`` makes each say Ready at once (a shadow uninitialised).
    ``refuse`` makes the next launches fail with OSError, as a missing interpreter would."""

    def __init__(self, *, auto_ready: bool = True) -> None:
        self.auto_ready = auto_ready
        self.refuse = 0
        self.launched: list[FakeInstance] = []

    def launch(self, spec: InstanceSpec, env: Mapping[str, str]) -> FakeInstance:
        if self.refuse > 0:
            self.refuse -= 1
            raise OSError(f"cannot start {spec.name} (refused by the test)")
        inst = FakeInstance(spec, env, auto_ready=self.auto_ready)
        self.launched.append(inst)
        return inst

    def by_name(self, name: str) -> FakeInstance:
        return next(i for i in self.launched if i.spec.name == name)

    def of_app(self, app: str) -> list[FakeInstance]:
        return [i for i in self.launched if i.spec.app == app]

    def close(self) -> None:
        """Make sure no played instance keeps its control connection (for a test that failed midway)."""
        for inst in self.launched:
            if inst.returncode is None:
                inst.kill()
