"""The control-socket commands (``status``, ``stop``, ``set-gpu``): which node they talk to, what they
say when it is gone or silent, and that they import no heavy module (they start in well under a second
where ``start`` pays for the node's imports; the figures are bench/footprint.py's, not asserted here).

A stand-in node is this test process: a private run dir with this process's record and token, and a
real control server whose requests the test answers, so the CLI runs as a user runs it (a fresh
interpreter) without starting a node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from orchestrator.cli import control as cli_control
from orchestrator.control import rundir
from orchestrator.control.channel import (
    ControlServer,
    control_address,
    make_run_dir,
    new_token,
    open_server,
    write_token,
)
from orchestrator.control.messages import (
    Message,
    Result,
    SetGpuRequest,
    StatusReply,
    StatusRequest,
    StopRequest,
)
from orchestrator.control.records import AppTotals, AppView, NodeView

ROOT = Path(__file__).resolve().parents[3]
#: Modules the control-socket commands must not import: the node and its config schema, the front door's
#: servers, the metrics exporter, numpy, torch and the native extension.
HEAVY = ("torch", "numpy", "aiohttp", "grpc", "pydantic", "yaml", "prometheus_client", "gpuprims._native",
         "gpuprims.backend", "orchestrator.node.node", "orchestrator.config.schema", "orchestrator.frontdoor",
         "orchestrator.node.metrics", "orchestrator.cli.node", "apps.zoo")
#: Runs the CLI in a fresh interpreter as the console script does, then reports which HEAVY modules it loaded.
PROBE = f"""
import json, sys
from orchestrator.cli import main as cli
try:
    cli.main(sys.argv[1:], prog_name="gpuprims-orchestrator")
    code = 0
except SystemExit as e:
    code = e.code
print("HEAVY=" + json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)), file=sys.stderr)
sys.exit(code)
"""
CLI_S = 120.0  # a fresh interpreter's start plus one request, on a busy 2-core machine
STATUS = NodeView(apps={"cls": AppView(name="cls", app_id=1, model="m", slo_ms=50.0, gpu_pct=50, gpu=0,
                                       totals=AppTotals(ok=7))}, ingest={"drops": {}}).to_dict()
#: A status reply this CLI cannot read (another version's shape): no app_id, instances as a mapping.
FOREIGN = {"apps": {"cls": {"gpu_pct": 50, "ok": 7, "instances": {}}}, "ingest": {"drops": {}}}


def _node_dir(base: Path, name: str) -> Path:
    """A run dir whose record names this (live) process."""
    d = base / name
    d.mkdir(mode=0o700)
    rundir.write_record(d, rundir.NodeRecord.for_this_process(name=name, config=f"/cfg/{name}.yaml", ports=[9000]))
    return d


def test_finds_the_one_live_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("orchestrator.control.channel.runtime_base", lambda: tmp_path)
    d = _node_dir(tmp_path, "run-a")
    (tmp_path / "current").symlink_to(d)
    assert cli_control.find_run_dir(None) == d.resolve()
    assert cli_control.find_run_dir(None, "run-a") == d
    assert cli_control.find_run_dir(str(d)) == d
    with pytest.raises(click.ClickException, match="no node is running"):
        cli_control.find_run_dir(str(tmp_path / "x"))
    with pytest.raises(click.UsageError, match="not both"):
        cli_control.find_run_dir(str(d), "run-a")


def test_refuses_to_guess_between_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("orchestrator.control.channel.runtime_base", lambda: tmp_path)
    with pytest.raises(click.ClickException, match="no running node"):
        cli_control.find_run_dir(None)
    _node_dir(tmp_path, "run-a")
    with pytest.raises(click.ClickException, match="which node to stop") as e:
        cli_control.find_run_dir(None, must_name=True)
    assert "--name run-a" in e.value.message and "/cfg/run-a.yaml" in e.value.message
    _node_dir(tmp_path, "run-b")
    with pytest.raises(click.ClickException, match="several nodes are running") as e:
        cli_control.find_run_dir(None)
    assert "--name run-a" in e.value.message and "--name run-b" in e.value.message


def test_a_named_dead_node_is_cleaned_up_and_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("orchestrator.control.channel.runtime_base", lambda: tmp_path)
    d = tmp_path / "gone"
    d.mkdir(mode=0o700)
    (d / "token").write_text("x")
    with pytest.raises(click.ClickException, match="has not opened its command socket"):
        cli_control.find_run_dir(None, "gone")
    rundir.write_record(d, rundir.NodeRecord(pid=2**22 + 1, start_ticks=1, started_at=0.0, name="gone"))
    with pytest.raises(click.ClickException, match="not running"):
        cli_control.find_run_dir(None, "gone")
    assert not d.exists()


def _env(tmp_path: Path) -> dict[str, str]:
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700, exist_ok=True)
    return {**os.environ, "XDG_RUNTIME_DIR": str(xdg), "PYTHONUNBUFFERED": "1"}


def _heavy(stderr: str) -> list[str]:
    line = next(ln for ln in stderr.splitlines() if ln.startswith("HEAVY="))
    return json.loads(line[len("HEAVY="):])


def _probe(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", PROBE, *args], env=_env(tmp_path), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    proc = _probe(tmp_path, *args)
    try:
        out, err = proc.communicate(timeout=CLI_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class _StandIn:
    """This process as a live node: run dir, record, token and a control server the test answers."""

    def __init__(self, tmp_path: Path, answer: Callable[[Message], Message | None]) -> None:
        self.run_dir = make_run_dir(tmp_path / "node")
        token = new_token()
        write_token(self.run_dir, token)
        rundir.write_record(self.run_dir, rundir.NodeRecord.for_this_process(name="node", config="/cfg/a.yaml"))
        self.server: ControlServer = open_server(control_address("zmq", self.run_dir), token)
        self.answer = answer
        self.requests: list[Message] = []

    def run(self, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
        """Run the CLI with ``args`` against this node, answering its requests until it exits."""
        proc = _probe(tmp_path, *args, "--run-dir", str(self.run_dir))
        try:
            deadline = time.monotonic() + CLI_S
            while proc.poll() is None:
                assert time.monotonic() < deadline, f"the CLI did not exit within {CLI_S} s"
                item = self.server.poll(50)
                if item is None:
                    continue
                self.requests.append(item.msg)
                reply = self.answer(item.msg)
                if reply is not None:
                    self.server.reply(item, reply)
            out, err = proc.communicate(timeout=CLI_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[_StandIn]:
    def answer(msg: Message) -> Message | None:
        if isinstance(msg, StatusRequest):
            return StatusReply(status=STATUS)
        if isinstance(msg, StopRequest):
            return Result(ok=True, message="stopping")
        if isinstance(msg, SetGpuRequest):
            return Result(ok=False, message=f"no app named {msg.app!r}")
        return None

    n = _StandIn(tmp_path, answer)
    yield n
    n.close()


def _one_line_error(r: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("Error: ")]
    assert len(errors) == 1 and all(f in errors[0] for f in fragments), r.stderr


@pytest.mark.real  # the CLI in child interpreters
def test_status_and_stop_without_a_node_import_no_heavy_module(tmp_path: Path) -> None:
    r = _run(tmp_path, "status")
    _one_line_error(r, "no running node found")
    assert _heavy(r.stderr) == []
    r = _run(tmp_path, "status", "--run-dir", str(tmp_path / "none"))
    _one_line_error(r, "no node is running in", "none")
    assert _heavy(r.stderr) == []
    r = _run(tmp_path, "stop", "--name", "n1")
    _one_line_error(r, "no node is running in", "n1")
    assert _heavy(r.stderr) == []


@pytest.mark.real  # the CLI in child interpreters
def test_status_stop_and_set_gpu_against_a_node_import_no_heavy_module(tmp_path: Path, node: _StandIn) -> None:
    r = node.run(tmp_path, "status", "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == STATUS, r.stderr
    assert _heavy(r.stderr) == []
    r = node.run(tmp_path, "status")
    assert r.returncode == 0 and "cls" in r.stdout, r.stderr
    assert _heavy(r.stderr) == []
    r = node.run(tmp_path, "stop", "--no-drain", "--no-wait")
    assert r.returncode == 0 and "stopping node" in r.stdout, r.stderr
    assert _heavy(r.stderr) == []
    r = node.run(tmp_path, "set-gpu", "nope", "10")
    assert r.returncode == 1 and "no app named 'nope'" in r.stdout, r.stdout + r.stderr
    assert _heavy(r.stderr) == []
    assert [type(m) for m in node.requests] == [StatusRequest, StatusRequest, StopRequest, SetGpuRequest]
    assert node.requests[2] == StopRequest(drain=False)
    assert node.requests[3] == SetGpuRequest(app="nope", gpu_pct=10)


def test_stop_says_when_the_node_outlives_its_timeout(tmp_path: Path, node: _StandIn) -> None:
    r = node.run(tmp_path, "stop", "--timeout", "0.5")  # the stand-in (this process) accepts and goes on
    _one_line_error(r, "accepted the stop but is still running after 0.5 s (--timeout)")
    assert node.requests == [StopRequest(drain=True)]


def test_status_from_a_silent_node_ends_in_one_line(tmp_path: Path) -> None:
    silent = _StandIn(tmp_path, lambda msg: None)
    try:
        r = silent.run(tmp_path, "status", "--timeout", "0.5")
    finally:
        silent.close()
    _one_line_error(r, "cannot reach the node in", str(silent.run_dir))
    assert [type(m) for m in silent.requests] == [StatusRequest]


@pytest.mark.parametrize(("reply", "fragments"), [
    (StatusReply(status=FOREIGN), ("sent a status this CLI cannot read", "app 'cls' lacks ['app_id', 'gpu'")),
    (StatusReply(status={**STATUS, "apps": {"cls": {**STATUS["apps"]["cls"], "instances": [{"name": "cls-0"}]}}}),
     ("sent a status this CLI cannot read", "an instance lacks")),
    (StatusReply(status={**STATUS, "drops": 5}), ("sent a status this CLI cannot read", "a status reply.drops")),
    (Result(ok=False, message="not now"), ("answered the status request with a Result, not a status",)),
])
def test_a_malformed_or_foreign_status_is_one_line_not_a_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reply: Message, fragments: tuple[str, ...]) -> None:
    """The status reply becomes a NodeView at the CLI's edge: one it cannot read (another version's
    node, a wrong message) is one line on stderr and exit 1. The node is faked in this process."""
    asked: list[Message] = []

    def command(d: Path, msg: Message, timeout_ms: float) -> Message:
        asked.append(msg)
        return reply

    monkeypatch.setattr(cli_control, "find_run_dir", lambda run_dir, name: tmp_path)
    monkeypatch.setattr(cli_control, "command", command)
    r = CliRunner().invoke(cli_control.status, [])
    assert isinstance(r.exception, SystemExit), r.exception  # click's exit, not an error escaping
    _one_line_error(subprocess.CompletedProcess([], r.exit_code, r.stdout, r.stderr), str(tmp_path), *fragments)
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert asked == [StatusRequest()]


def test_status_prints_the_table_of_a_readable_reply(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_control, "find_run_dir", lambda run_dir, name: tmp_path)
    monkeypatch.setattr(cli_control, "command", lambda d, msg, timeout_ms: StatusReply(status=STATUS))
    r = CliRunner().invoke(cli_control.status, [])
    assert r.exit_code == 0 and r.stderr == "", r.output
    assert r.stdout.splitlines()[2].split() == ["cls", "(id", "1)", "app", "gpu", "0", "50", "0.0", "0.0", "0", "0",
                                                "-", "-", "50", "ms", "-", "-", "-", "-"], r.stdout
