from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CONFIG = """node:
  listen: {host: 127.0.0.1, port: 9000}
  backend: cpu
  autoscale: false        # no GPU% changes mid-test: the control loop is busy during one
  pool: {slot_count: 512, max_chunks: 16}
apps:
  - {name: cls, model: mobilenet_v2, input_shape: [3, 16, 16], slo_ms: 5000, gpu_pct: 50, max_batch: 2, app_id: 1,
     shadow: false}
"""


def _as_a_background_job() -> None:
    """Start the child as a shell without job control starts `cmd &`: with SIGINT ignored. A Ctrl-C
    (SIGINT to its process group) must still end it with its partial result."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.real
def test_ctrl_c_ends_the_demo_with_its_partial_report(tmp_path: Path) -> None:
    cfg = tmp_path / "demo.yaml"
    cfg.write_text(CONFIG)
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    out_path, err_path = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli.demo", "--config", str(cfg), "--duration", "120",
                                 "--rate", "5"], cwd=ROOT, stdout=out, stderr=err, start_new_session=True,
                                 preexec_fn=_as_a_background_job,
                                 env={**os.environ, "XDG_RUNTIME_DIR": str(xdg), "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120  # the node loads its model on a busy 2-core machine
        while "replaying" not in err_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()
            time.sleep(0.1)
        time.sleep(5.0)  # past the 1 s warm-up and the plan build: measured traffic for the partial report
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C
        rc = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out, err = out_path.read_text(), err_path.read_text()
    assert rc == 130, out + err
    assert "PARTIAL: interrupted" in out and "== node status ==" in out and "cls" in out, out
    answered = int(next(ln for ln in out.splitlines() if ln.startswith("cls")).split()[2])
    assert answered > 0
    assert "stopped in" in err
    assert not [b for b in err.split("Traceback")[1:] if "orchestrator/worker/instance.py" not in b], err
    assert not any((xdg / "gpuprims").glob("run-*"))  # the node removed its run dir


@pytest.mark.real
def test_a_runtime_dir_too_long_for_the_control_socket_ends_the_demo_in_one_line(tmp_path: Path) -> None:
    cfg = tmp_path / "demo.yaml"
    cfg.write_text(CONFIG)
    xdg = tmp_path / ("x" * 60) / ("y" * 40)
    xdg.mkdir(mode=0o700, parents=True)
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli.demo", "--config", str(cfg), "--duration", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "XDG_RUNTIME_DIR": str(xdg), "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("node did not start: ") and "Unix socket" in last, r.stderr
    assert not any((xdg / "gpuprims").glob("run-*"))  # the run dir it made is gone
