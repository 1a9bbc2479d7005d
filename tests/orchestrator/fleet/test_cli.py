"""gpuprims-fleet: a bad fleet.yaml is refused before Ray starts; the commands are there."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from click.testing import CliRunner

from gpuprims.client import FleetClient
from gpuprims.wire import Status

pytest.importorskip("ray", reason="the fleet extra is not installed (pip install -e '.[fleet]')")

from orchestrator.fleet import cli


def test_a_bad_fleet_yaml_is_refused_with_the_key(tmp_path: Path) -> None:
    p = tmp_path / "fleet.yaml"
    p.write_text("apps:\n  - {name: a, model: resnet18, slo_ms: 0}\n")
    r = CliRunner().invoke(cli.main, ["start", str(p)])
    assert r.exit_code == 1 and "apps[0].slo_ms" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(cli.main, ["start", str(tmp_path / "nope.yaml")])
    assert r.exit_code == 1 and "No such file" in r.output


def test_a_local_fleet_starts_ray_so_its_machines_outlive_a_dead_head(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "fleet.yaml"
    p.write_text("ray: {head_outage_s: 3600}\napps: []\n")
    seen: dict = {}

    def init(**kw: object) -> None:
        seen.update(kw)
        raise RuntimeError("stopped before Ray starts")

    monkeypatch.setattr(cli, "secure_ray_env", lambda token_file: None)
    monkeypatch.setattr(cli.ray, "init", init)
    r = CliRunner().invoke(cli.main, ["start", str(p)])
    assert isinstance(r.exception, RuntimeError)
    assert seen["_system_config"] == {"gcs_rpc_server_reconnect_timeout_s": 3600}
    assert seen["include_dashboard"] is False


def test_the_commands_are_there() -> None:
    r = CliRunner().invoke(cli.main, ["--help"])
    assert r.exit_code == 0
    for cmd in ("start", "status", "stop", "drain", "set-gpu"):
        assert cmd in r.output


def test_the_ray_token_is_kept_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "TOKEN_FILE", tmp_path / "sub" / "fleet.token")
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.setenv(var, "x")  # records the variable's state before the test, restored after it
        monkeypatch.delenv(var)
    cli.secure_ray_env(None)
    token = os.environ["RAY_AUTH_TOKEN"]
    assert os.environ["RAY_AUTH_MODE"] == "token" and len(token) == 64
    assert (tmp_path / "sub" / "fleet.token").stat().st_mode & 0o777 == 0o600
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    cli.secure_ray_env(None)
    assert os.environ["RAY_AUTH_TOKEN"] == token  # the other commands present the same token
    cli.secure_ray_env(str(tmp_path / "given.token"))
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(tmp_path / "given.token")


def test_status_shows_nodes_apps_routes_and_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    st = {"routes": {"version": 4, "apps": {}},
          "nodes": {"a" * 40: {"host": "10.0.0.1", "udp_port": 9000, "http_port": 8000, "gpus": 2, "alive": True,
                               "suspected": True, "draining": False}},
          "apps": {"cls": {"primary": {"node": "a" * 40, "gpu": 1, "gpu_pct": 50, "instances": 1}, "standby": None}},
          "pending": ["big"],
          "node_events": [{"action": "suspect", "node": "a" * 40, "reason": "did not answer pings for 1.20 s"}],
          "decisions": [{"action": "place", "app": "cls", "reason": "gpu_pct from its entry"}]}
    monkeypatch.setattr(cli, "_call", lambda *a: st)
    r = CliRunner().invoke(cli.main, ["status"])
    assert r.exit_code == 0, r.output
    for text in ("routing table version 4", "10.0.0.1:udp 9000", "suspected", "cls: primary aaaaaaaaaaaa/gpu1 1x50%",
                 "no standby", "big: not placed", "did not answer pings", "gpu_pct from its entry"):
        assert text in r.output


def _fleet_cli(*args: str, env: dict[str, str], timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator.fleet.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout_s, check=False)


@pytest.mark.slow
def test_the_readme_commands_start_show_answer_and_stop_a_local_fleet() -> None:
    # A short private directory for Ray's sessions (its socket paths must stay under 108 bytes) and
    # for the fleet's token, never the user's /tmp/ray or their own token.
    tmp = Path(tempfile.mkdtemp(prefix="gf", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_TMPDIR=str(tmp / "ray"), XDG_RUNTIME_DIR=str(tmp), RAY_USAGE_STATS_ENABLED="0")
    (tmp / "fleet.yaml").write_text(
        "node: {backend: cpu}\n"
        "apps:\n  - {name: cls, model: mobilenet_v2, input_shape: [3, 32, 32], num_classes: 10, slo_ms: 2000,\n"
        "     gpu_pct: 50, max_batch: 4, shadow: false}\n")
    lines: queue.Queue[str] = queue.Queue()
    start = subprocess.Popen([sys.executable, "-m", "orchestrator.fleet.cli", "start", str(tmp / "fleet.yaml")],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             start_new_session=True)
    threading.Thread(target=lambda: [lines.put(line) for line in start.stdout], daemon=True).start()  # type: ignore[union-attr]
    node_pid = None
    try:
        deadline = time.monotonic() + 180
        address = None
        while address is None:
            left = deadline - time.monotonic()
            assert left > 0 and start.poll() is None, "the local fleet did not come up"
            with contextlib.suppress(queue.Empty):
                m = re.search(r"local fleet up at (\S+)", lines.get(timeout=min(left, 1.0)))
                address = m.group(1) if m else None
        assert (tmp / "gpuprims-fleet.token").stat().st_mode & 0o777 == 0o600
        deadline = time.monotonic() + 300
        while True:  # placed and loaded on the one machine (no standby: there is no other machine)
            r = _fleet_cli("status", "--address", address, "--json", env=env)
            st = json.loads(r.stdout) if r.returncode == 0 else {}
            if any(d["action"] == "applied" and d.get("app") == "cls" for d in st.get("decisions", [])):
                break
            assert time.monotonic() < deadline, f"cls not placed: {r.stdout[-2000:]} {r.stderr[-2000:]}"
            time.sleep(1)
        (node,) = st["nodes"].values()
        node_pid = int(node["node_pid"])
        with FleetClient([f"http://{node['host']}:{node['routes_port']}"], timeout_s=60.0) as client:
            assert client.refresh() >= 0 and "cls" in client.table["apps"]
            x = np.random.default_rng(0).random((3, 32, 32), dtype=np.float32)
            assert client.infer("cls", x).status == Status.OK
        r = _fleet_cli("set-gpu", "cls", "101", "--address", address, env=env)
        assert r.returncode == 2 and "101 is not in the range 1<=x<=100" in r.stderr, r.stderr
        r = _fleet_cli("set-gpu", "nope", "30", "--address", address, env=env)
        assert r.returncode == 1 and "'nope' is not placed" in r.stderr and "Traceback" not in r.stderr, r.stderr
        r = _fleet_cli("set-gpu", "cls", "30", "--address", address, env=env)
        assert r.returncode == 0 and "cls: 1 x 30% on" in r.stdout, r.stdout + r.stderr
        r = _fleet_cli("status", "--address", address, env=env)
        assert r.returncode == 0 and "cls: primary" in r.stdout and "1x30%" in r.stdout and "no standby" in r.stdout, \
            r.stdout
        r = _fleet_cli("stop", "--address", address, env=env)
        assert r.returncode == 0 and "fleet stopped" in r.stdout, r.stdout + r.stderr
        start.send_signal(signal.SIGINT)  # Ctrl-C: the local cluster goes down with the start command
        assert start.wait(timeout=180) == 0
        deadline = time.monotonic() + 60
        while psutil.pid_exists(node_pid) and psutil.Process(node_pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the node outlived its fleet"
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(start.pid, signal.SIGKILL)
        start.wait(timeout=60)
        for p in psutil.process_iter(["cmdline"]):  # anything of this Ray cluster still running
            if any(str(tmp) in a for a in p.info["cmdline"] or ()):
                with contextlib.suppress(psutil.Error):
                    p.kill()
        if node_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(node_pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)
