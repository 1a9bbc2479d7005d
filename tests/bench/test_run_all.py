"""`make bench` (bench/run_all.py) knows every experiment in bench/, and bench/README.md lists each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench import run_all

ROOT = Path(__file__).resolve().parents[2]
#: Modules of bench/ that are not experiments: shared helpers, the runner, the peer servers bench.peer starts.
HELPERS = {"__init__", "common", "serving", "run_all", "peer_ray", "peer_litserve", "peer_mlserver"}


def test_every_experiment_is_run_or_skipped_with_a_reason() -> None:
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")} - HELPERS
    assert set(run_all.ORDER) == scripts
    for e in run_all.EXPERIMENTS:
        why = e.skip()
        assert why is None or (isinstance(why, str) and why)


def test_the_readme_lists_every_experiment_with_its_command() -> None:
    readme = (ROOT / "bench" / "README.md").read_text()
    for name in run_all.ORDER:
        assert f"python -m bench.{name}" in readme, name


@pytest.mark.real  # bench.run_all in child interpreters
def test_list_says_what_would_run_and_unknown_names_are_refused() -> None:
    r = subprocess.run([sys.executable, "-m", "bench.run_all", "--list"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "soak: skipped: runs for an hour" in r.stdout
    assert {ln.split(":")[0].strip() for ln in r.stdout.splitlines()} == set(run_all.ORDER)
    r = subprocess.run([sys.executable, "-m", "bench.run_all", "--only", "nope"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "unknown benchmark(s) ['nope']" in r.stderr
