"""The native extension builds and works without CUDA (no toolkit, no driver), as on a CPU-only machine.

CI has nvcc, so the installed extension has its kernels; this builds a second copy with CUDA off and
checks it in a subprocess.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

CHECK = r"""
import importlib.util, sys
import numpy as np
spec = importlib.util.spec_from_file_location("gpuprims._native", sys.argv[1])
native = importlib.util.module_from_spec(spec)
spec.loader.exec_module(native)
sys.modules["gpuprims._native"] = native
import gpuprims
gpuprims._native = native
assert native.CUDA_KERNELS_BUILT is False
from gpuprims import wire
from gpuprims.pool import PacketPool
assert native.check_request(wire.encode_request(1, 1, b"x" * 10)[0]) == 0
with PacketPool.create(slot_count=16, record_count=4, consumer_count=1) as pool:
    assert pool.layout["slot_size"] == 1088
from gpuprims.cuda import runtime
from gpuprims.cuda.errors import CudaUnavailableError
assert not runtime.kernels_built()
try:
    runtime.cuda()
except CudaUnavailableError as e:
    assert "built without CUDA" in str(e), e
else:
    raise AssertionError("CUDA call did not refuse")
print("ok")
"""


def test_extension_builds_and_imports_without_cuda(tmp_path: Path) -> None:
    build = tmp_path / "build"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    env = dict(os.environ, CUDACXX="/nonexistent/nvcc")
    r = subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), *gen, "-DGPUPRIMS_CUDA=OFF",
                        f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "CUDA kernels: OFF" in r.stdout
    r = subprocess.run(["cmake", "--build", str(build), "-j", "2"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (so,) = build.glob("_native*.so")
    r = subprocess.run([sys.executable, "-c", CHECK, str(so)], capture_output=True, text=True, timeout=120,
                       cwd=str(ROOT))
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
