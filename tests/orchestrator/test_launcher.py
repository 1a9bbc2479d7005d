"""The real launcher starts ``python -m orchestrator.launch`` with exactly the environment it is given."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from orchestrator.launcher import SubprocessLauncher
from orchestrator.spec import InstanceSpec


def test_the_subprocess_launcher_runs_orchestrator_launch_with_the_given_environment() -> None:
    spec = InstanceSpec(name="a-0", app="a", app_id=1, model="mobilenet_v2", pool="p", consumer=0)
    # No control address in the environment: the instance says so and exits non-zero, without a hang.
    proc = SubprocessLauncher(sys.executable).launch(spec, {"PATH": "/usr/bin:/bin"})
    try:
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc != 0 and proc.pid > 0


def test_the_subprocess_launcher_refuses_an_empty_interpreter_and_reports_a_missing_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="interpreter"):
        SubprocessLauncher("")
    spec = InstanceSpec(name="a-0", app="a", app_id=1, model="m", pool="p", consumer=0)
    with pytest.raises(OSError):
        SubprocessLauncher(str(tmp_path / "no-python")).launch(spec, {})
    assert "no-python" in repr(SubprocessLauncher(str(tmp_path / "no-python")))
