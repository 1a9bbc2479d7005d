"""Triton's own benchmarking client, perf_analyzer, measures the front door with its defaults.

Without ``-x`` it picks the model version whose statistics moved during a measurement (see
test_frontdoor.py's ``_stats_version``); it used to fail with "failed to find the requested model
version". ``scripts/install-tools.sh`` fetches the binary from the tritonclient 2.43 manylinux wheel
(the last whose binary runs on Debian 12's glibc) into ``build/tools/``, with the libraries it links.
The two settings passed besides the URL and protocol only shorten the run on a busy machine: a 0.5 s
window instead of 5 s, and any variation between windows taken as stable.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import Stack

pytestmark = pytest.mark.tools

TOOLS = Path(__file__).resolve().parents[3] / "build" / "tools"
TIMEOUT_S = 180


def _env() -> dict[str, str]:
    env = dict(os.environ)
    lib = str(TOOLS / "lib")
    env["LD_LIBRARY_PATH"] = f"{lib}{os.pathsep}{env['LD_LIBRARY_PATH']}" if env.get("LD_LIBRARY_PATH") else lib
    return env


@pytest.fixture(scope="module")
def perf_analyzer() -> str:
    exe = os.environ.get("PERF_ANALYZER") or (str(TOOLS / "perf_analyzer") if (TOOLS / "perf_analyzer").exists()
                                              else shutil.which("perf_analyzer"))
    if exe is None:
        pytest.skip("perf_analyzer not found; scripts/install-tools.sh fetches it from the tritonclient 2.43 wheel")
    r = subprocess.run([exe, "--version"], capture_output=True, text=True, env=_env(), timeout=60)
    if "error while loading shared libraries" in r.stderr:
        pytest.skip(f"perf_analyzer cannot start here: {r.stderr.strip()} (scripts/install-tools.sh installs them)")
    return exe


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_the_front_door_without_a_version(stack: Stack, perf_analyzer: str,
                                                                  protocol: str) -> None:
    url = stack.door.http_url.removeprefix("http://") if protocol == "http" else stack.door.grpc_target
    assert url is not None
    r = subprocess.run([perf_analyzer, "-m", "classify", "-u", url, "-i", protocol, "--measurement-interval", "500",
                        "-s", "1000"], capture_output=True, text=True, env=_env(), timeout=TIMEOUT_S)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "failed to find the requested model version" not in out
    assert re.search(r"Concurrency: 1, throughput: [0-9.]+ infer/sec", out), out[-3000:]
    # The server-side figures come from the front door's statistics, read without a version.
    assert re.search(r"Server:\s+Inference count: [1-9]", out), out[-3000:]
