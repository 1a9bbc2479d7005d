"""Process-level CUDA helpers over the private native layer: lazy access with the fork guard, device
queries, schedule flags, and owners of device memory and pinned host memory.

Nothing here touches the GPU at import. The first call that reaches the CUDA runtime records this
process's pid; a child forked after that refuses every CUDA call with a "use spawn" message instead
of failing obscurely inside the driver (CONTRIBUTING.md, house style 6).

With ``GPUPRIMS_FAKE_CUDA`` set in the environment (see :mod:`gpuprims.testing.fake`), :func:`cuda`
returns the fake CUDA runtime instead of the native one: the whole Python CUDA layer, and a node on
top of it, then runs on a machine without a GPU with device memory in host memory. The fake is the
test rig's (``gpuprims.testing``, above this layer: it raises this layer's errors), so it is loaded by
its module name when the variable selects it, as the native extension is loaded by its own.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import sys
import weakref
from types import ModuleType
from typing import Any, Literal

import numpy as np

from gpuprims.cuda.errors import CudaError, CudaUnavailableError

log = logging.getLogger("gpuprims.cuda")

# cudaHostRegister / cudaHostAlloc flags.
HOST_PORTABLE = 0x01
HOST_MAPPED = 0x02
# cudaEventCreateWithFlags flags.
EVENT_DEFAULT = 0x00
EVENT_BLOCKING_SYNC = 0x01
EVENT_DISABLE_TIMING = 0x02
EVENT_INTERPROCESS = 0x04
# cudaSetDeviceFlags schedule flags.
SCHEDULE_FLAGS: dict[str, int] = {"auto": 0x00, "spin": 0x01, "yield": 0x02, "blocking_sync": 0x04}
SCHEDULE_MASK = 0x07
STREAM_NON_BLOCKING = 0x01

Schedule = Literal["auto", "spin", "yield", "blocking_sync"]

_touched_pid: int | None = None


def native() -> ModuleType:
    """The native extension, without touching CUDA (for error names and the CPU reference)."""
    from gpuprims import _native

    return _native


FAKE_ENV = "GPUPRIMS_FAKE_CUDA"
#: The fake CUDA runtime's module: loaded by name when ``GPUPRIMS_FAKE_CUDA`` selects it.
FAKE_MODULE = "gpuprims.testing.fake"


def is_fake() -> bool:
    """True if this process runs on the fake CUDA runtime (``GPUPRIMS_FAKE_CUDA`` is set and not 0)."""
    return os.environ.get(FAKE_ENV, "") not in ("", "0")


def kernels_built() -> bool:
    """True if the extension was compiled with its CUDA kernels (nvcc was found at build), or the
    fake runtime stands in for them."""
    if is_fake():
        return True
    try:
        return bool(native().CUDA_KERNELS_BUILT)
    except ImportError:
        return False


def _check_fork() -> None:
    pid = os.getpid()
    if _touched_pid is not None and _touched_pid != pid:
        raise CudaUnavailableError(
            f"CUDA was used in process {_touched_pid} before it forked this child (pid {pid}); a forked "
            "child cannot use CUDA: start worker processes with multiprocessing's 'spawn' start method")
    torch = sys.modules.get("torch")
    if torch is not None:
        bad_fork = getattr(getattr(torch, "cuda", None), "_is_in_bad_fork", None)
        if bad_fork is not None and bad_fork():
            raise CudaUnavailableError(
                "torch initialised CUDA in the parent of this forked child (pid "
                f"{pid}); a forked child cannot use CUDA: use multiprocessing's 'spawn' start method")


def cuda() -> ModuleType:
    """The native extension for a call that reaches the CUDA runtime.

    Raises CudaUnavailableError if the kernels were not built or if this process is a child forked
    after CUDA was used (use spawn). Records this pid as one that has touched CUDA.
    """
    global _touched_pid
    if not kernels_built():
        raise CudaUnavailableError(
            "gpuprims._native was built without CUDA (nvcc was not found at build time); use the cpu backend")
    _check_fork()
    if _touched_pid is None:
        _touched_pid = os.getpid()
    if is_fake():
        return fake_runtime()
    return native()


def fake_runtime() -> Any:
    """This process's fake CUDA runtime (``gpuprims.testing.fake.runtime()``), loaded by module name."""
    try:
        fake = importlib.import_module(FAKE_MODULE)
    except ImportError as e:
        raise CudaUnavailableError(f"{FAKE_ENV} is set but the fake CUDA runtime ({FAKE_MODULE}) does not "
                                   f"import: {e}") from e
    return fake.runtime()


def device_count() -> int:
    """Number of CUDA devices (cudaGetDeviceCount); raises CudaError where there is no driver."""
    return int(cuda().cuda_device_count())


def check_device(device: int) -> int:
    """Return ``device`` if it is a valid index of this process's CUDA devices, else raise ValueError."""
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise ValueError(f"device must be a non-negative int, got {device!r}")
    n = device_count()
    if device >= n:
        raise ValueError(f"device {device} does not exist: this process sees {n} CUDA device(s)")
    return device


def set_schedule(device: int, schedule: Schedule) -> None:
    """Set how host threads wait on `device` (cudaSetDeviceFlags with cudaDeviceSchedule*).

    ``spin`` busy-waits, ``yield`` spins with yields, ``blocking_sync`` sleeps on an OS primitive,
    ``auto`` lets the runtime choose. Call it before the device's context is first used in this
    process (before torch touches the device) for it to apply everywhere.
    """
    if schedule not in SCHEDULE_FLAGS:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULE_FLAGS)}, got {schedule!r}")
    rt = cuda()
    flags = rt.cuda_get_device_flags(device) & ~SCHEDULE_MASK
    rt.cuda_set_device_flags(device, flags | SCHEDULE_FLAGS[schedule])


def get_schedule(device: int) -> str:
    """The schedule flag in force for `device` (cudaGetDeviceFlags)."""
    bits = cuda().cuda_get_device_flags(device) & SCHEDULE_MASK
    return {v: k for k, v in SCHEDULE_FLAGS.items()}.get(bits, f"0x{bits:x}")


def mem_get_info(device: int) -> tuple[int, int]:
    """(free_bytes, total_bytes) of `device` (cudaMemGetInfo)."""
    free_b, total_b = cuda().cuda_mem_get_info(device)
    return int(free_b), int(total_b)


def pci_bus_id(device: int) -> str:
    """PCI bus id of `device` (cudaDeviceGetPCIBusId), stable across CUDA_VISIBLE_DEVICES orderings."""
    return str(cuda().cuda_pci_bus_id(device))


def device_by_pci_bus_id(bus_id: str) -> int:
    """This process's index of the device at `bus_id` (cudaDeviceGetByPCIBusId)."""
    return int(cuda().cuda_device_by_pci_bus_id(bus_id))


def synchronize(device: int) -> None:
    """Block until `device` is idle (cudaDeviceSynchronize), with the GIL released."""
    cuda().cuda_device_synchronize(device)


def _release(fn: Any, *args: Any) -> None:
    """A finalizer's release call: if the CUDA context is lost (sticky error) the memory goes with the
    process, so that is logged, not raised from a finalizer; any other error is raised."""
    try:
        fn(*args)
    except CudaError as e:
        if not e.is_sticky:
            raise
        log.error("CUDA context lost (%s): %s not released, it goes with the process", e.name, e.call)


#: Device memory this process holds through :class:`DeviceMemory`, by device (bytes).
_device_bytes: dict[int, int] = {}


def _count_device(device: int, nbytes: int) -> None:
    _device_bytes[device] = _device_bytes.get(device, 0) + nbytes


def _free_device(rt: Any, device: int, ptr: int, nbytes: int) -> None:
    """DeviceMemory's finalizer: cudaFree, then the count goes down (also when the context is lost: the
    memory goes with it)."""
    _release(rt.cuda_free, device, ptr)
    _count_device(device, -nbytes)


def device_bytes_in_use(device: int | None = None) -> int:
    """Bytes of device memory this process allocated through :class:`DeviceMemory` (cudaMalloc) and has
    not freed, on ``device`` or on all devices. A per-process count (cudaMemGetInfo's is per device);
    memory torch's allocator holds is not in it (see ``orchestrator.control.memory``)."""
    if device is not None:
        return _device_bytes.get(device, 0)
    return sum(_device_bytes.values())


def _host_array(address: int, nbytes: int, dtype: np.dtype | type = np.uint8) -> np.ndarray:
    buf = (ctypes.c_char * nbytes).from_address(address)
    return np.frombuffer(buf, dtype=np.uint8).view(dtype)


class DeviceMemory:
    """Device memory of our own (cudaMalloc on `device`), freed with cudaFree by close() or when the
    last reference goes, never during interpreter shutdown.

    It exposes ``__cuda_array_interface__`` (bytes), so ``torch.as_tensor(mem, device=...)`` views it
    without a copy and keeps it alive for as long as the view lives.
    """

    def __init__(self, nbytes: int, device: int = 0) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        rt = cuda()
        self.device = device
        self.nbytes = nbytes
        self.ptr = int(rt.cuda_malloc(device, nbytes))
        _count_device(device, nbytes)
        self._finalizer = weakref.finalize(self, _free_device, rt, device, self.ptr, nbytes)
        self._finalizer.atexit = False

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3,
                "strides": None, "stream": None}

    def close(self) -> None:
        """Free the memory now (cudaFree). Views made from it must be gone."""
        self._finalizer()

    def __repr__(self) -> str:
        return f"DeviceMemory(ptr=0x{self.ptr:x}, nbytes={self.nbytes}, device={self.device})"


class PinnedBuffer:
    """Page-locked host memory of our own (cudaHostAlloc; mapped and portable by default), freed with
    cudaFreeHost by close() or when unreferenced."""

    def __init__(self, nbytes: int, *, mapped: bool = True, portable: bool = True) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        rt = cuda()
        flags = (HOST_MAPPED if mapped else 0) | (HOST_PORTABLE if portable else 0)
        self.nbytes = nbytes
        self.mapped = mapped
        self.address = int(rt.cuda_host_alloc(nbytes, flags))
        self._device_ptrs: dict[int, int] = {}
        self._finalizer = weakref.finalize(self, _release, rt.cuda_free_host, self.address)
        self._finalizer.atexit = False

    def array(self, dtype: np.dtype | type = np.uint8) -> np.ndarray:
        """A numpy view of the whole buffer (valid until close())."""
        return _host_array(self.address, self.nbytes, dtype)

    def device_pointer(self, device: int) -> int:
        """The address `device` uses for this buffer (cudaHostGetDevicePointer); needs mapped=True."""
        if not self.mapped:
            raise ValueError("buffer was allocated without mapped=True; it has no device pointer")
        if device not in self._device_ptrs:
            self._device_ptrs[device] = int(cuda().cuda_host_get_device_pointer(self.address, device))
        return self._device_ptrs[device]

    def close(self) -> None:
        """Free the buffer (cudaFreeHost)."""
        self._finalizer()

    def __repr__(self) -> str:
        return f"PinnedBuffer(address=0x{self.address:x}, nbytes={self.nbytes})"


class PinnedRegion:
    """Host memory owned by someone else (a packet pool's shared mapping), page-locked and mapped for
    the GPU with cudaHostRegister(cudaHostRegisterMapped | cudaHostRegisterPortable) in this process.

    ``owner`` is kept referenced so the mapping outlives the registration; close() unregisters
    (cudaHostUnregister) and must come before the owner unmaps the memory.
    """

    def __init__(self, address: int, nbytes: int, *, owner: object = None, portable: bool = True) -> None:
        if isinstance(address, bool) or not isinstance(address, int) or address <= 0:
            raise ValueError(f"address must be a positive int, got {address!r}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        rt = cuda()
        self.address = address
        self.nbytes = nbytes
        self._owner = owner
        rt.cuda_host_register(address, nbytes, HOST_MAPPED | (HOST_PORTABLE if portable else 0))
        self._device_ptrs: dict[int, int] = {}
        self._finalizer = weakref.finalize(self, _release, rt.cuda_host_unregister, address)
        self._finalizer.atexit = False

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def device_pointer(self, device: int) -> int:
        """The address `device` uses for the region (cudaHostGetDevicePointer; UVA makes it equal to the
        host address on current platforms, but it is asked, not assumed)."""
        if self.closed:
            raise ValueError("region is closed (unregistered)")
        if device not in self._device_ptrs:
            self._device_ptrs[device] = int(cuda().cuda_host_get_device_pointer(self.address, device))
        return self._device_ptrs[device]

    def close(self) -> None:
        """Unregister the region (cudaHostUnregister). Idempotent."""
        self._finalizer()
        self._owner = None

    def __enter__(self) -> PinnedRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "registered"
        return f"PinnedRegion(address=0x{self.address:x}, nbytes={self.nbytes}, {state})"
