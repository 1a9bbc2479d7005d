"""The GPU-DMA kernel source, built unchanged with g++ against the host shim of the CUDA runtime,
gives the CPU reference's bytes, verdicts and counts case by case (gpuprims.cuda.hostsim). The full
sweep under ASan+UBSan is bench/kernel_host.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuprims.cuda import hostsim

pytestmark = pytest.mark.skipif(hostsim.compiler() is None, reason="no g++ to build the host kernel")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> hostsim.HostKernel:
    return hostsim.HostKernel(hostsim.build(Path(tmp_path_factory.mktemp("hostkernel"))))


def test_kernel_source_matches_cpu_reference_case_by_case(kernel: hostsim.HostKernel) -> None:
    result = hostsim.run_all(kernel, quick=True)
    assert result["cases"] > 100
    assert result["failures"] == {}


def test_launch_does_not_report_an_earlier_calls_error(kernel: hostsim.HostKernel) -> None:
    """launch_gather clears the thread's last-error slot before launching: a stale non-sticky error
    from an unrelated earlier call (here cudaErrorInvalidValue) is not returned as the launch's."""
    case = next(hostsim.cases(quick=True))
    assert hostsim.compare(kernel, case, stale_error=1) == []


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
        k = hostsim.HostKernel(hostsim.build(tmp_path))
    finally:
        hostsim.SOURCES = sources
    failures = hostsim.run_all(k, quick=True)["failures"]
    assert failures and all("u8f32x" in name for name in failures)


def test_fused_multiply_add_would_change_the_bits(tmp_path: Path) -> None:
    """Finding 8: the kernel rounds x * a and + b separately (__fmul_rn/__fadd_rn), so its host twin and
    the CPU reference must not let the compiler contract them into an FMA. Built with FMA allowed
    (-mfma -ffp-contract=fast, what GCC does by default on aarch64/Jetson), the fused conversion no
    longer matches the reference (which the extension builds with -ffp-contract=off); with the flag
    it does, on the same FMA-capable target."""
    if "fma" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no FMA instructions to contract into")
    fused = hostsim.HostKernel(hostsim.build(tmp_path, extra_flags=("-mfma", "-ffp-contract=fast")))
    failures = hostsim.run_all(fused, quick=True)["failures"]
    assert failures and all("u8f32x" in name for name in failures)
    exact = hostsim.HostKernel(hostsim.build(tmp_path, extra_flags=("-mfma", "-ffp-contract=off")))
    assert hostsim.run_all(exact, quick=True)["failures"] == {}


def test_extension_builds_its_reference_without_contraction() -> None:
    cmake = (hostsim.ROOT / "CMakeLists.txt").read_text()
    line = next(ln for ln in cmake.splitlines() if ln.startswith("target_compile_options(_native"))
    assert "-ffp-contract=off" in line
