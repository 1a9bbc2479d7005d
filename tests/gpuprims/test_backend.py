"""gpuprims.backend: a supervisor resolves ``auto`` without importing torch (its check runs in a child)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpuprims import backend
from gpuprims.testing import fake

_RESOLVE = """
import sys
from gpuprims.backend import resolve_backend
print(resolve_backend("auto", isolated=True))
try:
    resolve_backend("cuda", isolated=True)
except RuntimeError as e:
    print("refused:", e)
print("torch" in sys.modules)
"""


@pytest.mark.real
def test_isolated_resolve_imports_no_torch() -> None:
    """On this machine (no GPU): auto is cpu, cuda is refused with the reason, and torch stays out."""
    r = subprocess.run([sys.executable, "-c", _RESOLVE], capture_output=True, text=True, timeout=300, check=True)
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "cpu"
    assert lines[1].startswith("refused: ") and "no CUDA device" in lines[1]
    assert lines[2] == "False", r.stderr


def test_a_failed_check_process_means_cpu_and_is_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fake.FAKE_ENV, raising=False)
    monkeypatch.setattr(backend, "_RESOLVED", {})
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the child prints nothing
    assert backend.resolve_backend("auto", isolated=True) == "cpu"
    with pytest.raises(RuntimeError, match="no CUDA device"):
        backend.resolve_backend("cuda", isolated=True)
    assert backend._RESOLVED == {}  # a failure is not kept


def test_an_answer_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(fake.FAKE_ENV, raising=False)
    monkeypatch.setattr(backend, "_RESOLVED", {None: (True, backend.CudaProbe(True))})
    monkeypatch.setattr(sys, "executable", "/bin/false")  # would fail if asked
    assert backend.resolve_backend("auto", isolated=True) == "cuda"
    monkeypatch.setattr(backend, "_RESOLVED", {None: (True, backend.CudaProbe(False, "kernels missing"))})
    assert backend.resolve_backend("auto", isolated=True) == "cpu"
    with pytest.raises(RuntimeError, match="kernels missing"):
        backend.resolve_backend("cuda", isolated=True)
