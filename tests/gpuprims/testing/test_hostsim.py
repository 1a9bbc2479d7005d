"""The GPU-DMA kernel source, built unchanged with g++ against the host shim of the CUDA runtime,
gives the CPU reference's bytes, verdicts and counts case by case (gpuprims.testing.hostsim). The full
sweep under ASan+UBSan is bench/kernel_host.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuprims.testing import hostsim

pytestmark = pytest.mark.skipif(hostsim.compiler() is None, reason="no g++ to build the host kernel")


#: Builds are cached by content under the build tree, so a rerun compiles nothing.
CACHE = hostsim.ROOT / "build" / "hostsim"


@pytest.fixture(scope="module")
def kernel() -> hostsim.HostKernel:
    # On an FMA-capable target (as the GPU's reference on aarch64 would be), with contraction off.
    return hostsim.HostKernel(hostsim.build(CACHE, extra_flags=hostsim.fma_flags()))


@pytest.mark.slow
def test_kernel_source_matches_cpu_reference_case_by_case(kernel: hostsim.HostKernel) -> None:
    result = hostsim.run_all(kernel, quick=True)
    assert result["cases"] > 40
    assert result["failures"] == {}


def test_launch_does_not_report_an_earlier_calls_error(kernel: hostsim.HostKernel) -> None:
    """launch_gather clears the thread's last-error slot before launching: a stale non-sticky error
    from an unrelated earlier call (here cudaErrorInvalidValue) is not returned as the launch's."""
    case = next(hostsim.cases(quick=True))
    assert hostsim.compare(kernel, case, stale_error=1) == []


@pytest.mark.real
def test_harness_notices_a_wrong_kernel(tmp_path: Path) -> None:
    """The comparison is not vacuous: a kernel whose channel arithmetic is off by one element is caught."""
    src = hostsim.SOURCES[0].read_text()
    bad = src.replace("return (ch + k) % channels;", "return (ch + k + 1) % channels;")
    assert bad != src
    mutated = tmp_path / "dma_mutated.cu"
    mutated.write_text(bad)
    sources = hostsim.SOURCES
    try:
        hostsim.SOURCES = (mutated, sources[1])
        k = hostsim.HostKernel(hostsim.build(CACHE))
    finally:
        hostsim.SOURCES = sources
    result = hostsim.run_all(k, quick=True, only="u8f32x3")
    assert result["cases"] > 0 and len(result["failures"]) == result["cases"]


def test_fused_multiply_add_would_change_the_bits() -> None:
    """Finding 8: the kernel rounds x * a and + b separately (__fmul_rn/__fadd_rn), so its host twin and
    the CPU reference must not let the compiler contract them into an FMA. Built with FMA allowed
    (-mfma -ffp-contract=fast, what GCC does by default on aarch64/Jetson), the fused conversion no
    longer matches the reference (which the extension builds with -ffp-contract=off); with the flag
    it does, on the same FMA-capable target."""
    if not hostsim.fma_flags():
        pytest.skip("this CPU has no FMA instructions to contract into")
    fused = hostsim.HostKernel(hostsim.build(CACHE, extra_flags=("-mfma", "-ffp-contract=fast")))
    result = hostsim.run_all(fused, quick=True, only="u8f32x3")
    assert result["cases"] > 0 and result["failures"]
    # The module's kernel is the same source on the same FMA target with contraction off: it matches
    # (test_kernel_source_matches_cpu_reference_case_by_case).


def test_extension_builds_its_reference_without_contraction() -> None:
    cmake = (hostsim.ROOT / "CMakeLists.txt").read_text()
    line = next(ln for ln in cmake.splitlines() if ln.startswith("target_compile_options(_native"))
    assert "-ffp-contract=off" in line
