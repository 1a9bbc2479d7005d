"""The agent: one per gpuprims machine, a Ray actor that runs today's orchestrator beside it.

The agent starts ``gpuprims-orchestrator start`` (``python -m orchestrator.cli.main start``) unchanged as
its child process, with a generated apps.yaml that turns the model-repository API on (a fresh bearer
token, private to the run directory) and lists no app: the controller loads them. The child is told
to die with the agent (PR_SET_PDEATHSIG, SIGTERM: it drains and exits), so an orchestrator is never
left running on a machine the fleet forgot; the agent also stops it on :meth:`Agent.stop`.

Requests never pass through the agent or Ray: clients send to the node's UDP ingest (or its front
door). The agent only (a) applies the controller's desired app set through the repository API
(:meth:`Agent.apply`), (b) reports the node's state (:meth:`Agent.state`), (c) answers the
controller's pings, and (d) serves the fleet's routing table to clients on a small HTTP port
(``GET /fleet/routes``), so that the table is fetched from any machine and survives the head.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from orchestrator.control.channel import connect_command, control_address, read_token
from orchestrator.control.messages import StatusReply, StatusRequest
from orchestrator.control.records import NodeView
from orchestrator.control.rundir import read_record
from orchestrator.fleet.routes import RoutesServer
from orchestrator.worker.launch import die_with_parent

log = logging.getLogger("gpuprims.fleet")

#: How long the orchestrator may take to come up (its front door answering), and each API call.
START_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 300.0


class AgentError(RuntimeError):
    """The agent could not start or drive its orchestrator."""


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (the orchestrator binds it a moment later)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Agent:
    """One machine's agent (see the module docstring). ``node_settings`` are apps.yaml ``node:`` keys
    every machine gets; ``host`` is the address its node listens on (clients must reach it)."""

    def __init__(self, name: str, node_settings: dict[str, Any], *, host: str = "127.0.0.1", gpus: int = 1,
                 routes_port: int = 0, python: str = sys.executable, base_dir: str | None = None) -> None:
        self.name = name
        self.host = host
        self.gpus = gpus
        # Short names: the run dir holds Unix sockets, whose paths may be at most 107 bytes.
        self.dir = Path(tempfile.mkdtemp(prefix="gpa-", dir=base_dir))
        os.chmod(self.dir, 0o700)
        self.run_dir = self.dir / "r"
        self.token = secrets.token_urlsafe(32)
        tok = self.dir / "repository.token"
        tok.write_text(self.token)
        tok.chmod(0o600)
        self.http_port = free_port(host)
        self.routes: dict[str, Any] = {"version": 0, "apps": {}}
        self._routes_server: RoutesServer | None = RoutesServer(lambda: self.routes, host, routes_port)
        self.routes_port = self._routes_server.port
        # The node's front door forwards requests for apps it does not host by this agent's table.
        node = {**node_settings, "listen": {"host": host, "port": 0}, "http_port": self.http_port,
                "run_dir": str(self.run_dir),
                "repository": {"enabled": True, "token_file": str(tok)},
                "fleet_routes": [self._routes_server.url]}
        node.setdefault("autoscale", False)
        self.config_path = self.dir / "apps.yaml"
        self.config_path.write_text(yaml.safe_dump({"node": node, "apps": []}))
        self.loaded: dict[str, dict[str, Any]] = {}
        self.started = time.monotonic()
        self.log_path = self.dir / "orchestrator.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen([python, "-m", "orchestrator.cli.main", "start", str(self.config_path)],
                                     stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                                     start_new_session=True)
        try:
            self.udp_port = self._await_up()
        except BaseException:
            self.stop()
            raise

    # -- start ---------------------------------------------------------------------------------------
    def _await_up(self) -> int:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AgentError(f"the orchestrator on {self.name} exited with status {self.proc.returncode}: "
                                 f"{self._tail()}")
            rec = read_record(self.run_dir) if self.run_dir.exists() else None
            if rec is not None and rec.ports and self._live():
                return int(rec.ports[0])
            time.sleep(0.1)
        raise AgentError(f"the orchestrator on {self.name} was not up within {START_TIMEOUT_S:g} s: {self._tail()}")

    def _live(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/live", timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def _tail(self, n: int = 1500) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_bytes()[-n:].decode(errors="replace").strip()
        return ""

    @property
    def http_url(self) -> str:
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{h}:{self.http_port}"

    # -- what the controller calls ---------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """Where this node is reached: its UDP ingest, HTTP front door and routing-table port."""
        return {"node": self.name, "host": self.host, "udp_port": self.udp_port, "http_port": self.http_port,
                "routes_port": self.routes_port, "gpus": self.gpus, "pid": os.getpid(), "node_pid": self.proc.pid}

    def ping(self) -> dict[str, Any]:
        """Cheap liveness: the agent answers and its orchestrator process is running."""
        return {"node": self.name, "orchestrator": self.proc.poll() is None, "t": time.time()}

    def apply(self, desired: dict[str, dict[str, Any]]) -> dict[str, str]:
        """Make the node serve exactly ``desired`` (app -> apps.yaml entry): load what is new or changed
        (a change of share is Overlapped-Execution on the node), unload what is no longer wanted.
        Returns each app's outcome ("ok" or the error); one app's failure does not stop the others."""
        out: dict[str, str] = {}
        for name in sorted(set(self.loaded) - set(desired)):
            out[name] = self._call(name, "unload", None)
            if out[name] == "ok" or "is loaded" in out[name]:
                self.loaded.pop(name, None)
        for name, entry in sorted(desired.items()):
            if self.loaded.get(name) == entry:
                continue
            out[name] = self._call(name, "load", entry)
            if out[name] == "ok":
                self.loaded[name] = dict(entry)
        return out

    def _call(self, name: str, kind: str, entry: dict[str, Any] | None) -> str:
        body = json.dumps({"parameters": {"config": entry}} if entry is not None else {}).encode()
        req = urllib.request.Request(f"{self.http_url}/v2/repository/models/{name}/{kind}", data=body,
                                     method="POST", headers={"Authorization": f"Bearer {self.token}",
                                                             "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=CALL_TIMEOUT_S):
                return "ok"
        except urllib.error.HTTPError as e:
            try:
                return str(json.loads(e.read()).get("error") or e)
            except (ValueError, OSError):
                return f"HTTP {e.code}"
        except OSError as e:
            return f"the node's front door did not answer: {e}"

    def state(self) -> dict[str, Any]:
        """The node's state for the controller: GPUs, share held per GPU, apps with rates and SLO (read
        by field from the node's status reply; an unusable reply reads as no apps, its reason logged)."""
        status = self.status()
        view = NodeView()
        if "error" not in status:
            try:
                view = NodeView.from_dict(status)
            except ValueError as e:
                log.warning("agent %s: the node's status reply is malformed (%s); reporting no apps", self.name, e)
        apps = {n: {"gpu": a.gpu, "gpu_pct": a.gpu_pct, "arrival_rps": a.totals.arrival_rps,
                    "service_rps": a.totals.service_rps, "slo_attainment": a.totals.slo_attainment,
                    "instances": len(a.active)}
                for n, a in view.apps.items()}
        return {**self.info(), "held": dict(view.node.get("gpus") or {}), "apps": apps,
                "loaded": sorted(self.loaded), "orchestrator": self.proc.poll() is None,
                "errors": dict(view.node.get("errors") or {})}

    def status(self) -> dict[str, Any]:
        """The orchestrator's full status (its command socket)."""
        try:
            with connect_command(control_address("zmq", self.run_dir), read_token(self.run_dir)) as c:
                reply = c.request(StatusRequest(), timeout_ms=5000)
        except Exception as e:  # the node is starting or stopping: the state says so
            return {"error": str(e)}
        return dict(reply.status) if isinstance(reply, StatusReply) else {"error": f"unexpected reply {reply!r}"}

    def set_routes(self, table: dict[str, Any]) -> int:
        """Keep the newest routing table for clients (an older version is ignored); returns the version kept."""
        if int(table.get("version", 0)) >= int(self.routes.get("version", 0)):
            self.routes = table
        return int(self.routes["version"])

    def stop(self) -> None:
        """Stop the orchestrator (SIGTERM: it drains; SIGKILL after a grace) and the routes server."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if self._routes_server is not None:
            self._routes_server.close()
            self._routes_server = None
        with contextlib.suppress(OSError):
            self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
