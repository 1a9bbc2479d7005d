"""scripts/install-tools.sh when clang's sanitizer runtime is missing: it installs it where it can and
otherwise says in one line which package is missing and how to install it, and never fails `make test`.

The script runs with stand-ins first on PATH (clang++ without the runtime, apt-get, id, the tools it
checks for) and a failing interpreter for its pip step, so nothing is installed or downloaded.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "install-tools.sh"


def _stub(d: Path, name: str, body: str) -> None:
    p = d / name
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(p.stat().st_mode | stat.S_IXUSR)


def _run(tmp_path: Path, *, uid: int, apt_rc: int) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """install-tools.sh with clang 19 lacking its runtime, as user ``uid``, with apt-get exiting ``apt_rc``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "apt.log"
    _stub(bin_dir, "clang++", 'case "$1" in -print-file-name=*) echo "${1#-print-file-name=}";; '
                              '-dumpversion) echo 19;; esac')
    _stub(bin_dir, "apt-get", f'echo "$*" >> {log}; [ {apt_rc} = 0 ] || echo "E: Failed to fetch" >&2; exit {apt_rc}')
    _stub(bin_dir, "id", f"echo {uid}")
    for tool in ("tshark", "tcpreplay", "promtool", "ldconfig"):
        _stub(bin_dir, tool, "exit 0")
    _stub(bin_dir, "nopython", "exit 1")  # the perf_analyzer step: pip cannot download here
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHON": str(bin_dir / "nopython")}
    r = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    calls = log.read_text().splitlines() if log.exists() else []
    return r, calls


def _runtime_lines(r: subprocess.CompletedProcess[str]) -> list[str]:
    return [ln for ln in r.stderr.splitlines() if "libclang-rt-19-dev" in ln]


def test_without_root_it_names_the_package_and_the_command(tmp_path: Path) -> None:
    r, calls = _run(tmp_path, uid=1000, apt_rc=0)
    assert r.returncode == 0, r.stderr
    (line,) = _runtime_lines(r)
    assert "sanitizer runtime (libclang-rt-19-dev) is missing and cannot be installed here" in line
    assert "the fuzz tests will skip (as root: apt-get update && apt-get install libclang-rt-19-dev)" in line
    assert calls == []


def test_without_network_it_says_apt_failed_and_goes_on(tmp_path: Path) -> None:
    r, calls = _run(tmp_path, uid=0, apt_rc=100)
    assert r.returncode == 0, r.stderr
    (line,) = _runtime_lines(r)
    assert line.startswith("install-tools: apt-get could not install libclang-rt-19-dev") and "as root:" in line
    runtime_calls = [c for c in calls if "libclang-rt-19-dev" in c or c.endswith("update -qq")]
    assert runtime_calls and all("DPkg::Lock::Timeout=120" in c and "Acquire::http::Timeout=30" in c
                                 for c in runtime_calls)  # bounded: a held lock or a dead mirror cannot hang it


def test_an_install_that_leaves_the_runtime_missing_is_said(tmp_path: Path) -> None:
    r, calls = _run(tmp_path, uid=0, apt_rc=0)  # apt-get "succeeds", clang++ still finds no runtime
    assert r.returncode == 0, r.stderr
    (line,) = _runtime_lines(r)
    assert "installed libclang-rt-19-dev, but clang++ still finds no libclang_rt.asan-" in line
    assert any(c.endswith("--no-install-recommends libclang-rt-19-dev") for c in calls)
