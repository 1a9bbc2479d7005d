"""The CUDA MPS control daemon: use a running one, or start ours inside the run directory.

Controlled spatial sharing on CUDA is MPS: each instance's GPU% is
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, read when CUDA initialises in that process. The node needs a
control daemon for that. ``MpsDaemon.ensure()`` looks for one answering on the pipe directory
(``CUDA_MPS_PIPE_DIRECTORY``, default ``/tmp/nvidia-mps``); if there is none it starts
``nvidia-cuda-mps-control -d`` with pipe and log directories inside the node's run directory, and
``stop()`` quits only a daemon it started. ``env()`` gives the variables every instance needs to
reach it.

Policy (apps.yaml ``node.mps``): ``require`` refuses to start without MPS; ``best_effort`` says so at
start and runs the instances without isolation (GPU% is then not enforced); ``off`` never uses MPS.

A daemon that runs is not enough: when CUDA initialises in a process and cannot connect to the
daemon, the process silently runs without MPS (and so without its GPU% limit). After the instances
have initialised CUDA, :meth:`MpsDaemon.check_clients` asks the daemon which processes it serves;
an instance missing there is refused under ``require`` (MpsUnavailable) and reported at ERROR under
``best_effort``, with its pid and the GPU% it was meant to have.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("gpuprims.mps")

CONTROL = "nvidia-cuda-mps-control"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"


class MpsUnavailable(RuntimeError):
    """MPS is required but cannot be used on this machine; the message says why."""


@dataclass
class MpsClients:
    """What :meth:`MpsDaemon.check_clients` found: instances served by MPS and those running without
    their GPU% limit, each as {pid: gpu_pct}."""

    active: bool
    served: dict[int, int] = field(default_factory=dict)
    unenforced: dict[int, int] = field(default_factory=dict)


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip()
    except OSError:
        return ""


def _query(binary: str, pipe_dir: str, command: str, timeout_s: float = 5.0) -> tuple[bool, str]:
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=pipe_dir)
    try:
        r = subprocess.run([binary], input=command + "\n", capture_output=True, text=True, env=env,
                           timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    return r.returncode == 0, (r.stdout + r.stderr).strip()


class MpsDaemon:
    """Finds or starts the MPS control daemon for one node (see the module docstring)."""

    def __init__(self, run_dir: str | os.PathLike[str], *, mode: str = "best_effort", binary: str | None = None,
                 start_timeout_s: float = 10.0) -> None:
        if mode not in ("require", "best_effort", "off"):
            raise ValueError(f"mps mode must be 'require', 'best_effort' or 'off', got {mode!r}")
        self.run_dir = Path(run_dir)
        self.mode = mode
        self.binary = binary or shutil.which(CONTROL)
        self.start_timeout_s = start_timeout_s
        self.pipe_dir: str | None = None
        self.log_dir: str | None = None
        self.started = False
        self.active = False
        self.reason = ""

    def ensure(self) -> bool:
        """Make MPS usable for this node. Returns whether instances run under MPS."""
        if self.mode == "off":
            self.reason = "node.mps is off"
            return False
        try:
            self._ensure()
        except MpsUnavailable as e:
            self.reason = str(e)
            if self.mode == "require":
                raise
            log.warning("MPS unavailable (%s): GPU%% is NOT enforced; instances share the GPU without "
                        "isolation (set node.mps: require to refuse instead)", e)
            return False
        self.active = True
        return True

    def _ensure(self) -> None:
        if not self.binary:
            raise MpsUnavailable(f"{CONTROL} is not installed (not on PATH)")
        existing = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIR)
        ok, out = _query(self.binary, existing, "get_server_list")
        if ok:
            self.pipe_dir = existing
            log.info("using the running MPS control daemon (pipe directory %s)", existing)
            return
        pipe = self.run_dir / "mps-pipe"
        logs = self.run_dir / "mps-log"
        pipe.mkdir(mode=0o700, exist_ok=True)
        logs.mkdir(mode=0o700, exist_ok=True)
        env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(pipe), CUDA_MPS_LOG_DIRECTORY=str(logs))
        # `-d` forks the daemon and returns. Its output goes to a file, never to pipes: the daemon
        # inherits them, so waiting for their end would wait for the daemon's exit (a start that
        # "times out" while the daemon runs on, leaked). Its own session, so it can be killed whole.
        out_path = logs / "control-start.out"
        try:
            with open(out_path, "w") as out:
                proc = subprocess.Popen([self.binary, "-d"], env=env, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            raise MpsUnavailable(f"cannot start {CONTROL} -d: {e}") from e
        self._start_pgid = proc.pid
        try:
            rc = proc.wait(timeout=self.start_timeout_s)
        except subprocess.TimeoutExpired:
            self._abort_start(str(pipe))
            raise MpsUnavailable(f"{CONTROL} -d did not return within {self.start_timeout_s} s "
                                 "(raise MpsDaemon start_timeout_s); it was stopped") from None
        if rc != 0:
            self._abort_start(str(pipe))
            raise MpsUnavailable(f"{CONTROL} -d exited with {rc}: {_tail(out_path)}")
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            ok, answer = _query(self.binary, str(pipe), "get_server_list")
            if ok:
                break
            if time.monotonic() > deadline:
                self._abort_start(str(pipe))
                raise MpsUnavailable(f"the MPS daemon started but does not answer on {pipe} within "
                                     f"{self.start_timeout_s} s: {answer}; it was stopped")
            time.sleep(0.1)
        self.pipe_dir, self.log_dir, self.started = str(pipe), str(logs), True
        log.info("started an MPS control daemon (pipe %s, log %s)", pipe, logs)

    def _abort_start(self, pipe_dir: str) -> None:
        """A start that failed must not leave a daemon behind: ask it to quit, then kill what is left
        of the process group the start ran in."""
        if self.binary:
            _query(self.binary, pipe_dir, "quit", timeout_s=2.0)
        pgid = getattr(self, "_start_pgid", None)
        if pgid:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def check_clients(self, expected: dict[int, int]) -> MpsClients:
        """Which of the instances `expected` ({pid: gpu_pct}) the daemon serves, after they have
        initialised CUDA. An instance it does not serve runs without a GPU% limit (CUDA falls back to
        no MPS silently when it cannot connect): MpsUnavailable under ``require``, ERROR under
        ``best_effort``. Nothing is checked with MPS off or inactive."""
        report = MpsClients(active=self.active)
        if not self.active:
            report.unenforced = dict(expected)
            return report
        served = self.clients()
        report.served = {pid: pct for pid, pct in expected.items() if pid in served}
        report.unenforced = {pid: pct for pid, pct in expected.items() if pid not in served}
        if report.unenforced:
            msg = ("instance(s) not connected to the MPS daemon, running WITHOUT their GPU% limit: "
                   + ", ".join(f"pid {pid} (GPU% {pct})" for pid, pct in sorted(report.unenforced.items()))
                   + f"; pipe directory {self.pipe_dir}")
            self.reason = msg
            if self.mode == "require":
                raise MpsUnavailable(msg)
            log.error("%s (set node.mps: require to refuse instead)", msg)
        return report

    def env(self, gpu_pct: int) -> dict[str, str]:
        """Variables for an instance that runs at ``gpu_pct`` under this daemon (none without MPS)."""
        if not self.active or self.pipe_dir is None:
            return {}
        env = {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(gpu_pct)}
        if self.log_dir:
            env["CUDA_MPS_LOG_DIRECTORY"] = self.log_dir
        return env

    def clients(self) -> set[int]:
        """PIDs of the processes the MPS servers currently serve (get_server_list, get_client_list)."""
        if not self.active or self.binary is None or self.pipe_dir is None:
            return set()
        ok, out = _query(self.binary, self.pipe_dir, "get_server_list")
        pids: set[int] = set()
        for server in (out.split() if ok else []):
            if not server.isdigit():
                continue
            ok2, out2 = _query(self.binary, self.pipe_dir, f"get_client_list {server}")
            pids.update(int(p) for p in (out2.split() if ok2 else []) if p.isdigit())
        return pids

    def stop(self) -> None:
        """Quit the daemon if this node started it (a daemon found running is left alone)."""
        if not self.started or self.binary is None or self.pipe_dir is None:
            return
        ok, out = _query(self.binary, self.pipe_dir, "quit")
        if not ok:
            log.warning("MPS daemon did not quit cleanly: %s", out)
        self.started = False
        self.active = False


def probe_daemon(pipe_dir: str | None = None, binary: str | None = None) -> dict[str, object]:
    """What a running MPS control daemon says, without starting one (for ``gpuprims doctor``):
    ``installed``, ``answering``, the ``pipe_dir`` asked, and ``servers`` as {server pid: [client pids]}."""
    binary = binary or shutil.which(CONTROL)
    pipe = pipe_dir or os.environ.get("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIR)
    info: dict[str, object] = {"installed": binary is not None, "answering": False, "pipe_dir": pipe, "servers": {}}
    if binary is None:
        return info
    ok, out = _query(binary, pipe, "get_server_list")
    info["answering"] = ok
    if not ok:
        info["error"] = out
        return info
    servers: dict[int, list[int]] = {}
    for server in out.split():
        if server.isdigit():
            ok2, out2 = _query(binary, pipe, f"get_client_list {server}")
            servers[int(server)] = [int(p) for p in (out2.split() if ok2 else []) if p.isdigit()]
    info["servers"] = servers
    return info
