"""Static GPU checks (scripts/check_cuda_archs.py): the kernels build for every target architecture
with warnings, spills and local memory as errors, and their resources match the committed snapshot."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("check_cuda_archs", ROOT / "scripts/check_cuda_archs.py")
assert _spec is not None and _spec.loader is not None
check = importlib.util.module_from_spec(_spec)
sys.modules["check_cuda_archs"] = check
_spec.loader.exec_module(check)

SPILLING = """ptxas info    : Compiling entry function '_ZN8gpuprims3dma13gather_kernelE' for 'sm_80'
ptxas info    : Function properties for _ZN8gpuprims3dma13gather_kernelE
    24 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 40 bytes smem, 2552 bytes cmem[0]
"""


def test_parse_and_invariants_catch_spills_and_missing_archs() -> None:
    usage = check.parse(SPILLING)
    assert usage == {"gather_kernel": {"sm_80": {"stack_bytes": 24, "spill_store_bytes": 8, "spill_load_bytes": 8,
                                                 "registers": 255, "smem_bytes": 40}}}
    bad = check.invariants(usage)
    assert any("spills" in b for b in bad) and any("no machine code" in b for b in bad)
    assert any("finalize_kernel: not found" in b for b in bad)


def test_snapshot_covers_every_arch_without_spills() -> None:
    import json

    snap = json.loads(check.SNAPSHOT.read_text())
    assert snap["archs"] == [f"sm_{a}" for a in check.ARCHS] and snap["ptx"] == f"compute_{check.PTX_ARCH}"
    assert check.invariants(snap["kernels"]) == []
    # The CMake default builds exactly these.
    cmake = (ROOT / "CMakeLists.txt").read_text()
    assert '"' + ";".join([f"{a}-real" for a in check.ARCHS] + [f"{check.PTX_ARCH}-virtual"]) + '"' in cmake


@pytest.mark.real
@pytest.mark.skipif(check.nvcc() is None, reason="nvcc not found: the per-architecture build check needs it")
def test_kernels_build_for_every_arch_and_match_the_snapshot(capsys: pytest.CaptureFixture[str]) -> None:
    assert check.main([]) == 0, capsys.readouterr().out


@pytest.mark.skipif(check.cuobjdump() is None, reason="cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
def test_the_built_extension_carries_every_arch_and_the_ptx() -> None:
    """What was actually built, not what CMake was asked: an old build tree once kept building sm_90
    only (a cached architecture list outlives a new default)."""
    from gpuprims import _native

    if not _native.CUDA_KERNELS_BUILT:
        pytest.skip("the installed extension was built without CUDA kernels (no nvcc at build)")
    assert check.check_built(Path(_native.__file__), check.cuobjdump()) == []
