from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from gpuprims import __version__
from orchestrator.cli import main as cli
from orchestrator.config.schema import load_config
from orchestrator.control import rundir
from orchestrator.node.placement import Placement
from orchestrator.node.state import AppState

ROOT = Path(__file__).resolve().parents[3]


def test_help_lists_every_command_with_its_help() -> None:
    r = CliRunner().invoke(cli.main, ["--help"])
    assert r.exit_code == 0, r.output
    listed = r.output.split("Commands:", 1)[1]
    for name in ("start", "validate", "status", "stop", "set-gpu"):
        assert f"  {name} " in listed, r.output
    assert sorted(cli.COMMANDS) == sorted(cli.main.list_commands(click.Context(cli.main)))
    assert "Print apps, instances, GPU%" in listed and "Start the node described by CONFIG" in listed
    r = CliRunner().invoke(cli.main, ["status", "-h"])  # -h reaches the lazily loaded command too
    assert r.exit_code == 0 and "--run-dir" in r.output and "--json" in r.output


def test_every_lazy_command_loads_under_its_name() -> None:
    for name in cli.COMMANDS:
        cmd = cli.main.load(name)
        assert isinstance(cmd, click.Command) and cmd.name == name and cmd.help


def test_an_unknown_command_is_a_usage_error() -> None:
    r = CliRunner().invoke(cli.main, ["statsu"])
    assert r.exit_code == 2 and "No such command 'statsu'" in r.output and "Traceback" not in r.output


def test_a_lazy_entry_that_is_no_command_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"'x'.*'orchestrator\.cli\.main' is not 'module:attribute'"):
        cli.LazyGroup(name="g", lazy_commands={"x": "orchestrator.cli.main"})
    group = cli.LazyGroup(name="g", lazy_commands={"x": "orchestrator.cli.main:COMMANDS", "y": "orchestrator.cli.main:nope"})
    with pytest.raises(TypeError, match=re.escape("'x': orchestrator.cli.main.COMMANDS is dict, not a click command")):
        group.load("x")
    with pytest.raises(TypeError, match=re.escape("'y': orchestrator.cli.main.nope is NoneType")):
        group.load("y")


def test_validate_and_start_refuse_a_bad_config_with_file_and_key(tmp_path: Path) -> None:
    bad = tmp_path / "apps.yaml"
    bad.write_text("node: {backend: cpu}\napps:\n  - {name: a, model: resnet18, slo_ms: -5}\n")
    for command in ("validate", "start"):
        r = CliRunner().invoke(cli.main, [command, str(bad)])
        assert r.exit_code == 1
        assert "apps.yaml" in r.output and "apps[0].slo_ms" in r.output


def test_validate_rejects_unknown_zoo_model(tmp_path: Path) -> None:
    p = tmp_path / "apps.yaml"
    p.write_text("apps:\n  - {name: a, model: resnet51, slo_ms: 50}\n")
    r = CliRunner().invoke(cli.main, ["validate", str(p)])
    assert r.exit_code == 1 and "resnet51" in r.output and "resnet50" in r.output


def test_validate_refuses_overflow_without_a_cpu_profile_and_names_the_command(tmp_path: Path) -> None:
    p = tmp_path / "apps.yaml"
    p.write_text(f"node: {{overflow_profiles: {tmp_path}, overflow_reserved_cores: 0}}\n"
                 "apps:\n  - {name: a, model: resnet18, slo_ms: 50, overflow: cpu, overflow_cores: 1}\n")
    r = CliRunner().invoke(cli.main, ["validate", str(p)])
    assert r.exit_code == 1
    assert "CPU profile of model 'resnet18'" in r.output and "gpuprims-profile resnet18 --device cpu" in r.output


@pytest.mark.slow
def test_validate_accepts_the_bundled_examples() -> None:
    root = Path(__file__).resolve().parents[3]
    for name in ("apps.yaml", "apps-paper.yaml", "apps-table3.yaml"):
        r = CliRunner().invoke(cli.main, ["validate", str(root / "examples" / name)])
        assert r.exit_code == 0, r.output


# ---- real orchestrator processes (private runtime base, loopback, every process reaped)

TINY = """node:
  listen: {host: 127.0.0.1, port: %(port)d}
  backend: cpu
  metrics_port: %(metrics)d
  pool: {slot_count: 512, max_chunks: 16}
apps:
  - {name: cls, model: %(model)s, input_shape: [3, 16, 16], slo_ms: 5000, gpu_pct: 50, max_batch: 2, app_id: 1,
     shadow: false}
"""
READY_S = 120.0  # loading one small model on a busy 2-core machine


def _config(tmp_path: Path, *, port: int = 0, metrics: int = 0, model: str = "mobilenet_v2") -> Path:
    p = tmp_path / "tiny.yaml"
    p.write_text(TINY % {"port": port, "metrics": metrics, "model": model})
    return p


def _env(tmp_path: Path) -> dict[str, str]:
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700, exist_ok=True)
    return {**os.environ, "XDG_RUNTIME_DIR": str(xdg), "PYTHONUNBUFFERED": "1"}


def _base(tmp_path: Path) -> Path:
    return tmp_path / "xdg" / "gpuprims"


def _cli(tmp_path: Path, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args], env=_env(tmp_path), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


class _Started:
    """A `start` process in its own process group (as a terminal would run it), reaped at the end."""

    def __init__(self, tmp_path: Path, config: Path, name: str) -> None:
        self.err_path = tmp_path / f"{name}.{time.monotonic_ns()}.err"
        self.run_dir = _base(tmp_path) / name
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli.main", "start", str(config), "--name", name],
                                         env=_env(tmp_path), cwd=ROOT, stdout=err, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    @property
    def output(self) -> str:
        return self.err_path.read_text()

    def wait_up(self) -> rundir.NodeRecord:
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            rec = rundir.read_record(self.run_dir)
            if rec is not None and rec.pid == self.proc.pid and rec.ports:
                return rec
            assert self.proc.poll() is None, self.output
            time.sleep(0.1)
        raise AssertionError(f"node not up within {READY_S} s:\n{self.output}")

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # instances left in the group


def _gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(rundir.proc_start_ticks(p) is None for p in pids):
            return True
        time.sleep(0.05)
    return False


def _children(pid: int) -> list[int]:
    try:
        return [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _instance_pids(rec: rundir.NodeRecord) -> list[int]:
    """The node's child processes and theirs: instances, started or forked by its fork server."""
    kids = _children(rec.pid)
    return kids + [g for k in kids for g in _children(k)]


def _segments(rec: rundir.NodeRecord, run_dir: Path) -> list[Path]:
    out = [rundir.SHM_DIR / n for n in rec.shm]
    out += [rundir.SHM_DIR / n for n in rundir._param_segments(run_dir)]
    return out


@pytest.mark.real
def test_a_sigkilled_orchestrator_is_recognised_and_cleaned_up(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    node = _Started(tmp_path, cfg, "n1")
    load = None
    try:
        rec = node.wait_up()
        kids = _instance_pids(rec)
        segs = _segments(rec, node.run_dir)
        assert kids and len(segs) == 2 and all(s.exists() for s in segs)  # the pool and the exported weights
        load = subprocess.Popen([sys.executable, "-m", "gpuprims.traffic.cli", "replay", "--app", "1:3x16x16:float32",
                                 "--rate", "100", "--duration", "60", "--to", f"127.0.0.1:{rec.ports[0]}",
                                 "--no-progress"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:  # under load: the node is answering when it is killed
            r = _cli(tmp_path, "status", "--json")
            if r.returncode == 0 and json.loads(r.stdout)["apps"]["cls"]["ok"] > 0:
                break
            assert time.monotonic() < deadline, r.stdout + r.stderr
        os.kill(rec.pid, signal.SIGKILL)
        node.proc.wait(timeout=10)
        assert _gone(kids, 30.0)  # instances follow their orchestrator (PDEATHSIG)
        assert node.run_dir.exists() and all(s.exists() for s in segs)  # what a SIGKILL leaves

        t0 = time.monotonic()
        r = _cli(tmp_path, "status")  # no 5 s timeout on the dead node's socket
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert "removed what dead node n1" in r.stderr and "2 shared-memory segment(s)" in r.stderr
        assert "no running node" in r.stderr and time.monotonic() - t0 < 30
        assert not node.run_dir.exists() and not any(s.exists() for s in segs)
    finally:
        if load is not None:
            load.kill()
            load.wait()
        node.close()


@pytest.mark.real
def test_start_after_a_sigkill_cleans_up_and_stop_waits(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    first = _Started(tmp_path, cfg, "n1")
    second = None
    try:
        rec = first.wait_up()
        segs = _segments(rec, first.run_dir)
        os.kill(rec.pid, signal.SIGKILL)
        first.proc.wait(timeout=10)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            metrics_port = s.getsockname()[1]
        # The same run dir (it used to fail on the old token), now with metrics.
        second = _Started(tmp_path, _config(tmp_path, metrics=metrics_port), "n1")
        rec2 = second.wait_up()
        assert "removed what dead node n1" in second.output and "FileExistsError" not in second.output
        assert not any(s.exists() for s in segs)
        assert "stop it with: gpuprims-orchestrator stop --name n1" in second.output
        base = f"http://127.0.0.1:{metrics_port}"
        assert rec2.urls["metrics"] == base + "/metrics" and rec2.urls["health_ready"] == base + "/health/ready"
        for url in rec2.urls.values():
            assert url in second.output  # the start log prints every URL
        with urllib.request.urlopen(rec2.urls["health_ready"], timeout=10) as resp:
            assert resp.status == 200  # ready as soon as the node says it is up
        with urllib.request.urlopen(rec2.urls["metrics"], timeout=10) as resp:
            assert 'gpuprims_request_failure_total{app="cls",reason="instance_failed"} 0.0' in resp.read().decode()

        r = _cli(tmp_path, "stop")  # never acts on a node it was not given
        assert r.returncode == 1 and "--name n1" in r.stderr and str(cfg) in r.stderr
        assert second.proc.poll() is None
        r = _cli(tmp_path, "status")  # the only node: fine without a name
        assert r.returncode == 0 and "cls" in r.stdout, r.stderr
        r = _cli(tmp_path, "stop", "--name", "n1", timeout=90)
        assert r.returncode == 0 and "stopped n1" in r.stdout, r.stderr
        assert not rec2.alive  # stop returned once the node had stopped
        assert second.proc.wait(timeout=10) == 0
        assert not second.run_dir.exists() and not any(s.exists() for s in _segments(rec2, second.run_dir))
        r = _cli(tmp_path, "status", "--name", "n1")
        assert r.returncode == 1 and "no node is running" in r.stderr
    finally:
        first.close()
        if second is not None:
            second.close()


@pytest.fixture(scope="module")
def ctrl_c(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A node stopped by SIGINT to its whole process group, as a terminal's Ctrl-C sends it."""
    tmp_path = tmp_path_factory.mktemp("ctrlc")
    node = _Started(tmp_path, _config(tmp_path), "c1")
    try:
        rec = node.wait_up()
        segs = _segments(rec, node.run_dir)
        kids = _instance_pids(rec)
        os.killpg(node.proc.pid, signal.SIGINT)
        rc = node.proc.wait(timeout=60)
        return {"rc": rc, "output": node.output, "run_dir": node.run_dir, "segs": segs, "kids_gone": _gone(kids, 10)}
    finally:
        node.close()


@pytest.mark.real
def test_ctrl_c_stops_start_cleanly(ctrl_c: dict[str, Any]) -> None:
    out = ctrl_c["output"]
    assert ctrl_c["rc"] == 0 and "received SIGINT; stopping" in out and "node stopped" in out, out
    assert ctrl_c["kids_gone"] and not ctrl_c["run_dir"].exists() and not any(s.exists() for s in ctrl_c["segs"])
    tracebacks = [b for b in out.split("Traceback")[1:] if "orchestrator/worker/instance.py" not in b]
    assert not tracebacks, out  # none from the orchestrator


@pytest.mark.real
def test_ctrl_c_leaves_no_instance_traceback(ctrl_c: dict[str, Any]) -> None:
    assert "Traceback" not in ctrl_c["output"] and "KeyboardInterrupt" not in ctrl_c["output"]


def _assert_one_line_error(r: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: ") and all(f in last for f in fragments), r.stderr


@pytest.mark.real
def test_start_in_a_run_dir_too_long_for_a_unix_socket_ends_in_one_line(tmp_path: Path) -> None:
    """The control socket's path is limited to 107 bytes: a longer run dir is refused in one line, and
    the node leaves nothing running."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    r = _cli(tmp_path, "start", "--run-dir", str(deep), str(_config(tmp_path)))
    _assert_one_line_error(r, "cannot start", "run_dir")


@pytest.mark.real
def test_start_says_which_port_is_in_use(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.bind(("127.0.0.1", 0))
        port = udp.getsockname()[1]
        r = _cli(tmp_path, "start", str(_config(tmp_path, port=port)))
    _assert_one_line_error(r, f"127.0.0.1:{port}", "in use")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen(1)
        port = tcp.getsockname()[1]
        r = _cli(tmp_path, "start", str(_config(tmp_path, metrics=port)))
    _assert_one_line_error(r, f"127.0.0.1:{port}", "in use", "metrics_port")
    assert not any(_base(tmp_path).iterdir())  # nothing left behind


@pytest.mark.real
def test_start_refuses_an_unimportable_user_model(tmp_path: Path) -> None:
    r = _cli(tmp_path, "start", str(_config(tmp_path, model="no_such_module_xyz:factory")))
    _assert_one_line_error(r, "apps[0].model", "no_such_module_xyz", "cannot import")
    r = _cli(tmp_path, "validate", str(_config(tmp_path, model="no_such_pkg_xyz.sub:factory")))
    _assert_one_line_error(r, "no_such_pkg_xyz")


@pytest.mark.real
def test_start_refuses_a_live_nodes_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("orchestrator.control.channel.runtime_base", lambda: tmp_path)
    d = tmp_path / "busy"
    d.mkdir(mode=0o700)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ticks = rundir.proc_start_ticks(other.pid)
        assert ticks is not None
        rundir.write_record(d, rundir.NodeRecord(pid=other.pid, start_ticks=ticks, started_at=0.0, name="busy",
                                                 config="/a.yaml"))
        r = CliRunner().invoke(cli.main, ["start", str(ROOT / "examples" / "apps.yaml"), "--name", "busy"])
    finally:
        other.kill()
        other.wait()
    assert r.exit_code == 1 and "already running" in r.output and "/a.yaml" in r.output
    r = CliRunner().invoke(cli.main, ["start", str(ROOT / "examples" / "apps.yaml"), "--name", "../x"])
    assert r.exit_code == 2 and "node name" in r.output


@pytest.mark.parametrize("prog", ["orchestrator.cli.main", "gpuprims.traffic.cli", "gpuprims.profile.cli",
                                  "gpuprims.sched.sim_cli"])
def test_every_cli_has_h_and_version(prog: str) -> None:
    main = importlib.import_module(prog).main
    r = CliRunner().invoke(main, ["-h"])
    assert r.exit_code == 0 and "Usage:" in r.output
    r = CliRunner().invoke(main, ["--version"])
    assert r.exit_code == 0 and __version__ in r.output and "gpuprims-" in r.output


def test_readme_set_gpu_fits_the_example_shares() -> None:
    cfg = load_config(ROOT / "examples" / "apps.yaml")
    lines = [ln for ln in (ROOT / "README.md").read_text().splitlines() if "gpuprims-orchestrator set-gpu" in ln]
    assert lines
    apps = {a.name: AppState(cfg=a, gpu_pct=a.gpu_pct, instances=a.instances) for a in cfg.apps}  # type: ignore[arg-type]
    placement = Placement(cfg, apps, backend="cpu")
    for ln in lines:
        app, pct = ln.split("set-gpu", 1)[1].split()[:2]
        placement.check_share(app, int(pct))


@pytest.mark.real
def test_a_user_model_without_its_factory_ends_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "ops_nofactory_mod.py").write_text("x = 1\n")
    env = {**_env(tmp_path), "PYTHONPATH": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "start",
                        str(_config(tmp_path, model="ops_nofactory_mod:factory"))], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=READY_S)
    assert r.returncode == 1 and "has no attribute 'factory'" in r.stderr.strip().splitlines()[-1], r.stderr
    assert "Traceback" not in r.stderr, r.stderr


@pytest.mark.real
def test_set_gpu_follows_the_change_through_its_phases(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    cfg.write_text(cfg.read_text().replace("shadow: false", "shadow: true"))
    node = _Started(tmp_path, cfg, "sg")
    try:
        node.wait_up()
        r = _cli(tmp_path, "set-gpu", "cls", "30", "--name", "sg", timeout=2 * READY_S)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "change 1 accepted: cls 50% -> 30%" in r.stdout
        lines = r.stdout.splitlines()
        phases = [ln.split()[-1] for ln in lines if ln.startswith("  ") and ln.split()[-1].isalpha()]
        assert phases[:5] == ["pending", "initialising", "switched", "draining", "done"], r.stdout
        assert lines[-1] == "cls now at 30%"
        refused = _cli(tmp_path, "set-gpu", "nope", "10", "--name", "sg")
        assert refused.returncode == 1 and "no app named 'nope'" in refused.stdout, refused.stdout + refused.stderr
        status = _cli(tmp_path, "status", "--name", "sg", "--json")
        st = json.loads(status.stdout)
        assert st["apps"]["cls"]["gpu_pct"] == 30
        assert st["changes"]["counts"]["done"] == 1 and st["changes"]["counts"]["refused"] == 1
        assert _cli(tmp_path, "stop", "--name", "sg", timeout=READY_S).returncode == 0
    finally:
        node.close()


def test_start_tls_and_token_flags_set_node_tls_and_auth(tmp_path: Path) -> None:
    from orchestrator.cli.node import _load, _security

    cert, key, ca, token = (tmp_path / n for n in ("s.pem", "s.key", "ca.pem", "token"))
    for p in (cert, key, ca, token):
        p.write_text("x\n")
    config = _config(tmp_path)
    runner = CliRunner()
    for flags, why in ((["--tls-cert", str(cert)], "--tls-cert and --tls-key go together"),
                       (["--tls-key", str(key)], "--tls-cert and --tls-key go together"),
                       (["--tls-ca", str(ca)], "--tls-ca (require client certificates) needs")):
        r = runner.invoke(cli.main, ["start", str(config), *flags])
        assert r.exit_code == 2 and why in r.output, r.output
    r = runner.invoke(cli.main, ["start", str(config), "--tls-cert", str(tmp_path / "none.pem"), "--tls-key", str(key)])
    assert r.exit_code == 2 and "does not exist" in r.output
    # A config without a front door: TLS has nothing to apply to, and says which key to set.
    with pytest.raises(click.ClickException, match=r"node\.tls: .*node\.http_port or grpc_port"):
        _load(str(config), None, security=_security(str(cert), str(key), None, None))
    text = config.read_text().replace("  backend: cpu\n", "  backend: cpu\n  http_port: 18000\n")
    config.write_text(text)
    cfg, _ = _load(str(config), None, security=_security(str(cert), str(key), str(ca), str(token)))
    assert cfg.node.tls is not None and (cfg.node.tls.cert, cfg.node.tls.key, cfg.node.tls.ca) == (str(cert), str(key),
                                                                                                    str(ca))
    assert cfg.node.auth.token_file == str(token) and cfg.node.auth.token_env is None
