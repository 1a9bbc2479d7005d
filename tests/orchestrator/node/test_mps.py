"""MPS daemon handling, with a stand-in nvidia-cuda-mps-control (no GPU here)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from orchestrator.node.mps import MpsDaemon, MpsUnavailable

FAKE = """#!/bin/sh
# Stand-in for nvidia-cuda-mps-control: "-d" creates the pipe dir's control file; commands on stdin
# answer only when that file exists; "quit" removes it. Every call is logged.
echo "$CUDA_MPS_PIPE_DIRECTORY $*" >> "{log}"
if [ "$1" = "-d" ]; then
  [ -n "{fail_start}" ] && {{ echo "cannot start" >&2; exit 3; }}
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0
fi
read cmd
[ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] || {{ echo "no daemon" >&2; exit 1; }}
echo "$cmd" >> "{log}"
[ "$cmd" = "quit" ] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
exit 0
"""


def fake_binary(tmp_path: Path, *, fail_start: bool = False) -> tuple[str, Path]:
    log = tmp_path / "calls.log"
    p = tmp_path / "nvidia-cuda-mps-control"
    p.write_text(FAKE.format(log=log, fail_start="1" if fail_start else ""))
    p.chmod(0o755)
    return str(p), log


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    return d


def test_starts_daemon_in_run_dir_and_stops_it(tmp_path: Path, run_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    binary, log = fake_binary(tmp_path)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "no-daemon-here"))
    d = MpsDaemon(run_dir, mode="require", binary=binary)
    assert d.ensure() and d.started
    assert d.pipe_dir == str(run_dir / "mps-pipe") and (run_dir / "mps-pipe" / "control").exists()
    env = d.env(30)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30" and env["CUDA_MPS_PIPE_DIRECTORY"] == d.pipe_dir
    d.stop()
    assert not (run_dir / "mps-pipe" / "control").exists()
    assert "quit" in log.read_text()


def test_uses_a_running_daemon_and_leaves_it(tmp_path: Path, run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    binary, log = fake_binary(tmp_path)
    existing = tmp_path / "system-mps"
    existing.mkdir()
    (existing / "control").touch()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(existing))
    d = MpsDaemon(run_dir, binary=binary)
    assert d.ensure() and not d.started and d.pipe_dir == str(existing)
    d.stop()
    assert (existing / "control").exists()
    assert "quit" not in log.read_text()


def test_require_refuses_when_missing(run_dir: Path) -> None:
    d = MpsDaemon(run_dir, mode="require", binary=None)
    d.binary = None
    with pytest.raises(MpsUnavailable, match="not installed"):
        d.ensure()


def test_best_effort_falls_back_and_says_why(tmp_path: Path, run_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    binary, _ = fake_binary(tmp_path, fail_start=True)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "none"))
    d = MpsDaemon(run_dir, mode="best_effort", binary=binary)
    assert d.ensure() is False
    assert "cannot start" in d.reason and d.env(50) == {}
    assert "NOT enforced" in caplog.text


def test_off_and_bad_mode(run_dir: Path) -> None:
    assert MpsDaemon(run_dir, mode="off").ensure() is False
    with pytest.raises(ValueError, match="mps mode"):
        MpsDaemon(run_dir, mode="sometimes")
    assert os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") is None


DAEMONISING = """#!/bin/sh
# Stand-in that daemonises like the real one: "-d" leaves a background process behind that keeps the
# inherited stdout/stderr open. {answer} decides whether the daemon ever answers on the pipe dir.
if [ "$1" = "-d" ]; then
  sleep 60 &
  echo $! > "{pidfile}"
  [ -n "{answer}" ] && touch "$CUDA_MPS_PIPE_DIRECTORY/control"
  exit 0
fi
read cmd args
[ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] || {{ echo "no daemon" >&2; exit 1; }}
case "$cmd" in
  get_server_list) echo 4242 ;;
  get_client_list) cat "$CUDA_MPS_PIPE_DIRECTORY/clients" 2>/dev/null ;;
  quit) rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"; kill "$(cat {pidfile})" 2>/dev/null ;;
esac
exit 0
"""


def daemonising_binary(tmp_path: Path, *, answer: bool) -> tuple[str, Path]:
    pidfile = tmp_path / "daemon.pid"
    p = tmp_path / "nvidia-cuda-mps-control"
    p.write_text(DAEMONISING.format(pidfile=pidfile, answer="1" if answer else ""))
    p.chmod(0o755)
    return str(p), pidfile


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.02)
    return False


def test_start_returns_although_the_daemon_holds_inherited_output(tmp_path: Path, run_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 7: the daemon inherits -d's stdout; reading it through pipes waited for the daemon to
    exit, so the start timed out with the daemon up (and leaked it)."""
    binary, pidfile = daemonising_binary(tmp_path, answer=True)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "none"))
    d = MpsDaemon(run_dir, mode="require", binary=binary, start_timeout_s=5)
    t0 = time.monotonic()
    assert d.ensure() and d.started
    assert time.monotonic() - t0 < 4
    pid = int(pidfile.read_text())
    assert _alive(pid)
    d.stop()
    assert _wait_gone(pid)


def test_a_daemon_that_never_answers_is_stopped_not_leaked(tmp_path: Path, run_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    binary, pidfile = daemonising_binary(tmp_path, answer=False)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "none"))
    d = MpsDaemon(run_dir, mode="require", binary=binary, start_timeout_s=0.5)
    with pytest.raises(MpsUnavailable, match="does not answer"):
        d.ensure()
    assert _wait_gone(int(pidfile.read_text()))


@pytest.mark.parametrize("mode", ["require", "best_effort"])
def test_instances_that_are_not_mps_clients_are_refused_or_reported(tmp_path: Path, run_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture,
                                                                    mode: str) -> None:
    """Finding 7: CUDA silently runs without MPS when a client cannot connect; the node asks the
    daemon which instances it serves."""
    binary, _ = daemonising_binary(tmp_path, answer=True)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "none"))
    d = MpsDaemon(run_dir, mode=mode, binary=binary, start_timeout_s=5)
    assert d.ensure()
    try:
        (run_dir / "mps-pipe" / "clients").write_text("1001\n1002\n")
        ok = d.check_clients({1001: 30, 1002: 50})
        assert ok.served == {1001: 30, 1002: 50} and ok.unenforced == {}
        if mode == "require":
            with pytest.raises(MpsUnavailable, match=r"pid 1003 \(GPU% 20\)"):
                d.check_clients({1001: 30, 1003: 20})
        else:
            report = d.check_clients({1001: 30, 1003: 20})
            assert report.unenforced == {1003: 20}
            assert "WITHOUT their GPU% limit" in caplog.text and "pid 1003" in caplog.text
    finally:
        d.stop()
