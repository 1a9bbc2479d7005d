"""MPS daemon handling, with a stand-in nvidia-cuda-mps-control (no GPU here)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchestrator.mps import MpsDaemon, MpsUnavailable

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
