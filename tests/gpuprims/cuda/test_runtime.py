from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpuprims.backend import cuda_available
from gpuprims.cuda import DeviceMemory, PinnedBuffer, PinnedRegion, mem_get_info, runtime, set_schedule

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_memory_owners_validate_sizes_before_touching_cuda(bad: object) -> None:
    with pytest.raises(ValueError, match="nbytes"):
        DeviceMemory(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nbytes"):
        PinnedBuffer(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nbytes"):
        PinnedRegion(4096, bad)  # type: ignore[arg-type]


def test_pinned_region_validates_address() -> None:
    with pytest.raises(ValueError, match="address"):
        PinnedRegion(0, 4096)
    with pytest.raises(ValueError, match="address"):
        PinnedRegion(-5, 4096)


def test_schedule_and_device_validation() -> None:
    with pytest.raises(ValueError, match="schedule must be one of"):
        set_schedule(0, "busy")  # type: ignore[arg-type]
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="device must be a non-negative int"):
            runtime.check_device(bad)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("src", sorted(p.name for p in (ROOT / "native" / "cuda").glob("*.cu")))
def test_cuda_sources_compile(src: str, tmp_path: Path) -> None:
    proc = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-Werror", "all-warnings", "-I",
                           str(ROOT / "native" / "include"), "-c", str(ROOT / "native" / "cuda" / src), "-o",
                           str(tmp_path / "k.o")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.gpu
def test_memory_owners_on_gpu() -> None:
    free0, total = mem_get_info(0)
    assert 0 < free0 <= total
    mem = DeviceMemory(1 << 20, 0)
    t = torch.as_tensor(mem, device="cuda:0")
    t.fill_(7)
    assert t.shape == (1 << 20,) and int(t.sum()) == 7 << 20
    del t
    mem.close()
    buf = PinnedBuffer(4096)
    buf.array()[:] = 3
    dst = torch.zeros(4096, dtype=torch.uint8, device="cuda:0")
    runtime.cuda().cuda_memcpy_async(dst.data_ptr(), buf.address, 4096, 0)
    torch.cuda.synchronize()
    assert int(dst.sum()) == 3 * 4096
    assert buf.device_pointer(0) != 0
    buf.close()
    host = torch.zeros(1 << 16, dtype=torch.uint8)
    with PinnedRegion(host.data_ptr(), host.numel(), owner=host) as region:
        assert region.device_pointer(0) != 0
    assert region.closed
    with pytest.raises(ValueError, match="closed"):
        region.device_pointer(0)


@pytest.mark.gpu
def test_schedule_flag_round_trips() -> None:
    before = runtime.get_schedule(0)
    set_schedule(0, "blocking_sync")
    assert runtime.get_schedule(0) == "blocking_sync"
    set_schedule(0, before if before in runtime.SCHEDULE_FLAGS else "auto")  # type: ignore[arg-type]


@pytest.mark.skipif(not runtime.kernels_built(), reason="extension built without CUDA")
@pytest.mark.skipif(cuda_available(), reason="checks what a machine without a GPU driver reports")
def test_every_cuda_entry_point_converts_its_arguments_and_reports_cuda_error() -> None:
    """Without a driver each call gets past argument conversion and fails in the runtime with a
    CudaError, which shows the Python call shapes match the native signatures."""
    from gpuprims.cuda import CudaError, Event, Stream
    from gpuprims.cuda.ipc import _IpcMapping

    rt = runtime.cuda()
    host = torch.zeros(4096, dtype=torch.uint8)
    calls = [
        lambda: DeviceMemory(4096, 0), lambda: PinnedBuffer(4096), lambda: PinnedRegion(host.data_ptr(), 4096),
        lambda: Stream(0), lambda: Event(0, blocking=True), lambda: set_schedule(0, "spin"),
        lambda: runtime.get_schedule(0), lambda: mem_get_info(0), lambda: runtime.pci_bus_id(0),
        lambda: runtime.device_by_pci_bus_id("0000:00:00.0"), lambda: runtime.synchronize(0),
        lambda: _IpcMapping(0, bytes(64), 4096), lambda: rt.cuda_event_poll(0, 0, 100, 1000),
        lambda: rt.cuda_callback_wait(0, 1000), lambda: rt.cuda_memset(0, 0, 0, 16),
        lambda: rt.cuda_memcpy_async(0, 0, 16, 0), lambda: rt.cuda_ipc_get_mem_handle(0, 0),
        lambda: rt.cuda_stream_synchronize(0), lambda: rt.cuda_runtime_version() and rt.cuda_device_count(),
    ]
    for i, call in enumerate(calls):
        with pytest.raises(CudaError):
            call()
            raise AssertionError(f"call {i} did not fail")
    assert rt.cuda_driver_version() == 0  # no driver installed
    with pytest.raises(ValueError, match="64 bytes"):
        rt.cuda_ipc_open_mem_handle(0, b"short")


@pytest.mark.real
def test_the_fake_runtime_is_loaded_by_name_only_when_selected() -> None:
    """The CUDA layer never imports its test rig (gpuprims.testing); GPUPRIMS_FAKE_CUDA loads it."""
    code = ("import os, sys\n"
            "os.environ.pop('GPUPRIMS_FAKE_CUDA', None)\n"
            "import gpuprims.gather, gpuprims.cuda.dma, gpuprims.cuda.ipc, gpuprims.cuda.sync\n"
            "assert not [m for m in sys.modules if m.startswith('gpuprims.testing')], 'imported the rig'\n"
            "os.environ['GPUPRIMS_FAKE_CUDA'] = '1'\n"
            "from gpuprims.cuda import runtime\n"
            "from gpuprims.testing import fake\n"
            "assert runtime.cuda() is fake.runtime()\n"
            "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != runtime.FAKE_ENV}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_a_fake_runtime_that_does_not_import_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "FAKE_MODULE", "gpuprims.testing.no_such_fake")
    with pytest.raises(runtime.CudaUnavailableError,
                       match=r"GPUPRIMS_FAKE_CUDA is set but the fake CUDA runtime \(gpuprims\.testing\.no_such_fake\) "
                             r"does not import"):
        runtime.fake_runtime()
