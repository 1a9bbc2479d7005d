"""gpuprims.cpushare in a process that runs no torch: it is confined without loading torch."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.real
def test_a_process_without_torch_is_confined_without_loading_it() -> None:
    """An instance that runs no torch (a model file on ONNX Runtime) gets its cores and OMP_NUM_THREADS,
    and torch stays unloaded (it would map libtorch into the instance)."""
    code = ("import os, sys; from gpuprims.cpushare import CpuShare, apply_cpu_share; "
            "core = sorted(os.sched_getaffinity(0))[0]; "
            "apply_cpu_share(CpuShare(cores=[core], threads=1, gpu_pct=50)); "
            "print(sorted(os.sched_getaffinity(0)) == [core], os.environ['OMP_NUM_THREADS'], 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert r.stdout.split() == ["True", "1", "False"], r.stderr
