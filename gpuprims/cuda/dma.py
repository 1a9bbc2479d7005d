"""GPU-DMA (paper V-B) and its baseline CUDA-Copy, with a CPU backend of the same shape.

``gpu_dma(packets, num_packets, gpu_buffer, gpu_id)`` places the payloads of complete requests that
sit in the packet pool into rows of a contiguous batch buffer:

* CUDA (``gpu_buffer`` a CUDA tensor): a kernel reads every packet's header and payload straight from
  the pool's mapped pinned memory (zero-copy, registered with cudaHostRegister by
  :class:`PinnedPool`), checks the header against its record and writes the payload to its place in
  the device buffer, on a given stream. The CPU copies nothing.
* CPU (``gpu_buffer`` a CPU tensor or numpy array, ``gpu_id=None``): the same checks and placement in
  native code on the host (the kernel's reference; both share ``native/include/gpuprims/cuda_dma.h``).

``packets`` names the requests: :meth:`PinnedPool.packets` of the record indices a consumer polled.
Row i receives record ``packets.records[i]``; the first ``num_packets`` of them are placed. A row's
verdict is a :class:`DmaStatus`; the return value is the number of rows placed with ``OK``.

``normalize=Normalize(...)`` is the fused variant: uint8 payloads become float32
``(x * scale / std[c] - mean[c] / std[c]) / divide`` (channel ``c = element % len(mean)``, HWC order)
while they are gathered, so a quarter of the bytes cross the bus. :data:`UNIT` is the apps' own
``x / 255`` (bit for bit what ``torch`` computes for ``batch.float().div_(255)``).

``cuda_copy_gather`` is the baseline: the CPU gathers the payloads into a pinned staging buffer and
cudaMemcpyAsync copies it to the device (CUDA-Copy); on the CPU backend, a staging gather then a copy.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from gpuprims.cuda import runtime
from gpuprims.cuda.errors import CudaError, CudaUnavailableError
from gpuprims.cuda.event import Event, StreamLike, stream_handle
from gpuprims.wire import DType

log = logging.getLogger("gpuprims.dma")

MAX_BATCH = 512  # rows per call; equals _native.DMA_MAX_BATCH (a test keeps them in step)
_MODE_COPY = 0
_MODE_U8_TO_F32 = 1
_WARPS_PER_BLOCK = 8


def _torch() -> Any:
    """torch, imported on first use rather than at this module's head: the instance code imports
    this module in processes that serve an ONNX file and map no torch (tests/test_layers.py,
    TORCH_FREE)."""
    import torch

    return torch


class DmaStatus(enum.IntEnum):
    """Verdict for one batch row (native/include/gpuprims/cuda_dma.h); the largest one seen wins."""

    OK = 0
    BAD_RECORD = 1   # record index out of range, or the record is not delivered
    BAD_SHAPE = 2    # total_len is not the row size, or chunk_count/stride are inconsistent
    BAD_DTYPE = 3    # the record's dtype is not the expected one
    BAD_SLOT = 4     # the chunk map names a slot outside the pool
    BAD_HEADER = 5   # a packet's magic, version or kind is wrong
    MISMATCH = 6     # a packet's app/request id, chunk index/count, total or dtype disagree with the record
    BAD_LENGTH = 7   # a packet's payload_len is not what its position implies


@dataclass(frozen=True)
class PoolLayout:
    """Where the regions of a packet pool lie (pool.h), in bytes from the pool's base."""

    nbytes: int
    slots_offset: int
    records_offset: int
    chunkmap_offset: int
    slot_size: int
    slot_count: int
    record_count: int
    max_chunks: int

    @classmethod
    def of(cls, pool: Any) -> PoolLayout:
        """Read the layout of anything shaped like a PacketPool (``nbytes`` and a ``layout`` dict)."""
        try:
            lay = pool.layout
            return cls(int(pool.nbytes), *(int(lay[k]) for k in (
                "slots_offset", "records_offset", "chunkmap_offset", "slot_size", "slot_count", "record_count",
                "max_chunks")))
        except (AttributeError, KeyError, TypeError) as exc:
            raise ValueError(f"{pool!r} does not look like a packet pool (needs address, nbytes and a layout "
                             f"dict with the pool.h offsets): {exc}") from None

    def geometry(self) -> Any:
        """The native, validated form (raises ValueError if the regions do not fit the pool)."""
        return runtime.native().PoolGeometry(self.nbytes, self.slots_offset, self.records_offset,
                                             self.chunkmap_offset, self.slot_size, self.slot_count,
                                             self.record_count, self.max_chunks)


def _registering_backend() -> Literal["cpu", "cuda"]:
    """``auto`` for a pinned pool: ``cuda`` if the CUDA runtime loads and sees a device, else ``cpu``."""
    try:
        return "cuda" if runtime.device_count() > 0 else "cpu"
    except (CudaError, CudaUnavailableError, OSError) as e:
        log.info("PinnedPool backend auto: cpu (%s)", e)
        return "cpu"


class PinnedPool:
    """A packet pool as GPU-DMA reads it.

    With the ``cuda`` backend the pool's whole mapping is page-locked and mapped for the GPU with
    cudaHostRegister(cudaHostRegisterMapped | cudaHostRegisterPortable) in this process, and its device
    pointer is obtained per device (cudaHostGetDevicePointer). ``cpu`` registers nothing. ``auto``
    (the default) is ``cuda`` where this layer's runtime sees a device (the fake runtime included) and
    ``cpu`` elsewhere: registering host memory needs the runtime and a device, not torch, so this is
    decided here; the node's choice of backend for a whole app is :func:`gpuprims.backend.resolve_backend`.
    close() unregisters (cudaHostUnregister); call it before the pool itself is closed.
    """

    def __init__(self, pool: Any, *, backend: Literal["auto", "cpu", "cuda"] = "auto") -> None:
        if backend not in ("auto", "cpu", "cuda"):
            raise ValueError(f"backend must be 'auto', 'cpu' or 'cuda', got {backend!r}")
        if backend == "auto":
            backend = _registering_backend()
        self.layout = PoolLayout.of(pool)
        self.address = int(pool.address)
        if self.address <= 0 or self.address % 16:
            raise ValueError(f"pool address must be positive and 16-byte aligned, got 0x{self.address:x}")
        self._geometry = self.layout.geometry()
        self.pool = pool
        self.backend = backend
        self.region: runtime.PinnedRegion | None = None
        if self.backend == "cuda":
            self.region = runtime.PinnedRegion(self.address, self.layout.nbytes, owner=pool)
        self._engines: dict[int, _Engine] = {}
        self._lock = threading.Lock()

    def packets(self, records: Sequence[int] | np.ndarray) -> Packets:
        """The requests at these record indices (as a consumer's poll returns them), in row order."""
        arr = np.asarray(records)
        if arr.ndim != 1:
            raise ValueError(f"records must be one-dimensional, got shape {arr.shape}")
        if arr.size and (arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
            raise ValueError(f"records must be non-negative uint32 record indices, got {arr!r}")
        return Packets(self, np.ascontiguousarray(arr, dtype=np.uint32))

    def device_pointer(self, device: int) -> int:
        """The pool's base address as `device` sees it (cudaHostGetDevicePointer)."""
        if self.region is None:
            raise ValueError("pool is not registered with CUDA (backend='cpu')")
        return self.region.device_pointer(device)

    def _engine(self, device: int) -> _Engine:
        with self._lock:
            eng = self._engines.get(device)
            if eng is None:
                eng = self._engines[device] = _Engine(device)
            return eng

    def close(self, timeout_s: float = 10.0) -> None:
        """Release per-device scratch and unregister the pool (cudaHostUnregister). Idempotent.

        A GPU-DMA job still in flight reads the pool and writes the scratch, so it is waited for
        first (up to `timeout_s`). If it is still running then, nothing is freed or unregistered
        (a later close() tries again) and TimeoutError says so: freeing memory under a running
        kernel is a device fault or silent corruption. A job that failed with a device error frees
        normally (the context is gone; nothing runs any more).
        """
        with self._lock:
            engines = list(self._engines.items())
        for dev, eng in engines:
            job = eng.pending
            if job is not None:
                try:
                    job.wait(timeout_s=timeout_s)
                except TimeoutError:
                    raise TimeoutError(
                        f"a GPU-DMA job on device {dev} is still running after {timeout_s} s; the pool stays "
                        "registered and its scratch allocated (call close() again once the device is idle)") from None
                except CudaError as e:
                    log.error("closing a pool whose last GPU-DMA job failed: %s", e)
            _release_lost(eng.close)
            with self._lock:
                self._engines.pop(dev, None)
        if self.region is not None:
            _release_lost(self.region.close)

    def __enter__(self) -> PinnedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PinnedPool(address=0x{self.address:x}, nbytes={self.layout.nbytes}, backend={self.backend!r})"


@dataclass(frozen=True)
class Packets:
    """Complete requests in a pinned pool, by record index, in batch-row order."""

    pool: PinnedPool
    records: np.ndarray

    def __len__(self) -> int:
        return int(self.records.shape[0])


@dataclass(frozen=True)
class Normalize:
    """uint8 -> float32 conversion of the fused gather:
    ``(x * (scale / std[c]) + (-mean[c] / std[c])) / divide``, each operation rounded to float32."""

    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    scale: float = 1.0 / 255.0
    divide: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= len(self.mean) <= 4 or len(self.mean) != len(self.std):
            raise ValueError(f"mean and std need the same length, 1..4 channels; got {self.mean!r}, {self.std!r}")
        vals = (*self.mean, *self.std, self.scale, self.divide)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in vals):
            raise ValueError(f"mean, std and scale must be finite numbers, got {self!r}")
        if any(s == 0 for s in self.std) or self.divide == 0:
            raise ValueError(f"std and divide must not contain 0, got std={self.std!r}, divide={self.divide!r}")

    @property
    def coefficients(self) -> tuple[list[float], list[float], list[float]]:
        """(a, b, d) per channel in float32, padded to 4: y = (x * a[c] + b[c]) / d[c]."""
        a = [float(np.float32(self.scale) / np.float32(s)) for s in self.std]
        b = [float(-np.float32(m) / np.float32(s)) for m, s in zip(self.mean, self.std)]
        d = [float(np.float32(self.divide))] * len(a)
        return a + [0.0] * (4 - len(a)), b + [0.0] * (4 - len(b)), d + [1.0] * (4 - len(d))


#: ImageNet normalisation, the usual input convention of the zoo's models.
IMAGENET = Normalize(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
#: The apps' input transform (gpuprims.gather.preprocess): uint8 x becomes x / 255 in float32, computed
#: as ((x * 1) + -0) / 255, which is exactly torch's ``x.to(torch.float32).div_(255.0)``.
UNIT = Normalize(scale=1.0, divide=255.0)


@dataclass(frozen=True)
class DeviceRows:
    """A destination given by address: `rows` equal rows of `nbytes` in all on `device` (a gatherer's
    preallocated batch buffer). ``keepalive`` is held while a launch writes it."""

    ptr: int
    nbytes: int
    rows: int
    device: int
    is_float32: bool
    keepalive: Any = None


@dataclass
class _Target:
    backend: str  # "cuda" or "cpu"
    ptr: int
    nbytes: int
    rows: int
    row_stride: int
    is_float32: bool
    device: int | None
    keepalive: Any


def _target(gpu_buffer: Any) -> _Target:
    if isinstance(gpu_buffer, DeviceRows):
        if gpu_buffer.rows <= 0 or gpu_buffer.nbytes <= 0 or gpu_buffer.nbytes % gpu_buffer.rows:
            raise ValueError(f"DeviceRows needs rows > 0 dividing nbytes, got {gpu_buffer!r}")
        return _Target("cuda", gpu_buffer.ptr, gpu_buffer.nbytes, gpu_buffer.rows, gpu_buffer.nbytes // gpu_buffer.rows,
                       gpu_buffer.is_float32, gpu_buffer.device, gpu_buffer.keepalive)
    if isinstance(gpu_buffer, np.ndarray):
        if not gpu_buffer.flags.c_contiguous or not gpu_buffer.flags.writeable:
            raise ValueError("gpu_buffer must be a writable C-contiguous array")
        if gpu_buffer.ndim < 1 or gpu_buffer.shape[0] == 0 or gpu_buffer.nbytes == 0:
            raise ValueError(f"gpu_buffer needs at least one non-empty row, got shape {gpu_buffer.shape}")
        return _Target("cpu", gpu_buffer.ctypes.data, gpu_buffer.nbytes, gpu_buffer.shape[0],
                       gpu_buffer.nbytes // gpu_buffer.shape[0], gpu_buffer.dtype == np.float32, None, gpu_buffer)
    try:
        torch = _torch()
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None
    if torch is not None and isinstance(gpu_buffer, torch.Tensor):
        if not gpu_buffer.is_contiguous():
            raise ValueError("gpu_buffer must be contiguous")
        if gpu_buffer.dim() < 1 or gpu_buffer.shape[0] == 0 or gpu_buffer.numel() == 0:
            raise ValueError(f"gpu_buffer needs at least one non-empty row, got shape {tuple(gpu_buffer.shape)}")
        nbytes = gpu_buffer.numel() * gpu_buffer.element_size()
        dev = gpu_buffer.device
        if dev.type not in ("cuda", "cpu"):
            raise ValueError(f"gpu_buffer must be on a CUDA device or the CPU, got {dev}")
        return _Target(dev.type, gpu_buffer.data_ptr(), nbytes, gpu_buffer.shape[0], nbytes // gpu_buffer.shape[0],
                       gpu_buffer.dtype == torch.float32, dev.index if dev.type == "cuda" else None, gpu_buffer)
    raise TypeError(f"gpu_buffer must be a torch tensor or a numpy array, got {type(gpu_buffer).__name__}")


@dataclass
class _Plan:
    packets: Packets
    records: np.ndarray
    target: _Target
    row_src_bytes: int
    expect_dtype: int
    mode: int
    a: list[float]
    b: list[float]
    d: list[float]
    channels: int


def _plan(packets: Packets, num_packets: int, gpu_buffer: Any, gpu_id: int | None, normalize: Normalize | None,
          expect_dtype: int | None) -> _Plan:
    if not isinstance(packets, Packets):
        raise TypeError(f"packets must come from PinnedPool.packets(records), got {type(packets).__name__}")
    if isinstance(num_packets, bool) or not isinstance(num_packets, (int, np.integer)):
        raise TypeError(f"num_packets must be an int, got {num_packets!r}")
    num_packets = int(num_packets)
    if not 0 <= num_packets <= len(packets):
        raise ValueError(f"num_packets must be in 0..{len(packets)} (the records given), got {num_packets}")
    if num_packets > MAX_BATCH:
        raise ValueError(f"at most {MAX_BATCH} requests per call, got {num_packets}")
    if normalize is not None and not isinstance(normalize, Normalize):
        raise TypeError(f"normalize must be a Normalize, got {type(normalize).__name__}")
    t = _target(gpu_buffer)
    if num_packets > t.rows:
        raise ValueError(f"gpu_buffer has {t.rows} rows, fewer than num_packets={num_packets}")
    if t.backend == "cuda":
        if isinstance(gpu_id, bool) or not isinstance(gpu_id, int):
            raise ValueError(f"gpu_buffer is on cuda:{t.device}, so gpu_id must be {t.device}, got {gpu_id!r}")
        if gpu_id != t.device:
            raise ValueError(f"gpu_id={gpu_id} but gpu_buffer is on cuda:{t.device}")
        if packets.pool.region is None:
            raise ValueError("the pool is not registered with CUDA: make the PinnedPool with backend='cuda'")
    elif gpu_id is not None:
        raise ValueError(f"gpu_buffer is in host memory (cpu backend) but gpu_id={gpu_id!r} was given; pass None")
    if normalize is None:
        mode, row_src, channels = _MODE_COPY, t.row_stride, 1
        a, b, d = [1.0] * 4, [0.0] * 4, [1.0] * 4
    else:
        if not t.is_float32:
            raise ValueError("the fused uint8 -> float32 gather needs a float32 gpu_buffer")
        if t.row_stride % 4:
            raise ValueError(f"row of {t.row_stride} bytes is not a whole number of float32")
        mode, row_src, channels = _MODE_U8_TO_F32, t.row_stride // 4, len(normalize.mean)
        a, b, d = normalize.coefficients
        if expect_dtype is None:

            expect_dtype = int(DType.UINT8)
    return _Plan(packets, packets.records[:num_packets], t, row_src, -1 if expect_dtype is None else int(expect_dtype),
                 mode, a, b, d, channels)


def _check_statuses(statuses: np.ndarray | None, n: int) -> None:
    if statuses is not None and (not isinstance(statuses, np.ndarray) or statuses.dtype != np.int32
                                 or statuses.ndim != 1 or statuses.shape[0] < n or not statuses.flags.writeable):
        raise ValueError(f"statuses must be a writable 1-D int32 array of at least {n} entries")


def _gather_cpu(plan: _Plan, out_ptr: int, out_nbytes: int, status: np.ndarray) -> int:
    pool = plan.packets.pool
    return int(runtime.native().dma_gather_cpu(
        pool.address, pool._geometry, plan.records, out_ptr, out_nbytes, plan.target.row_stride, plan.row_src_bytes,
        plan.expect_dtype, plan.mode, plan.channels, plan.a, plan.b, plan.d, status))


class _Engine:
    """Per (pool, device) scratch of GPU-DMA: row verdicts in device memory, the result in mapped
    pinned host memory, a completion event, and CUDA-Copy's staging buffer. One job in flight."""

    def __init__(self, device: int) -> None:
        rt = runtime.cuda()
        self.device = device
        self.status = runtime.DeviceMemory(MAX_BATCH * 4, device)
        rt.cuda_memset(device, self.status.ptr, 0, self.status.nbytes)
        self.result = runtime.PinnedBuffer((1 + MAX_BATCH) * 4, mapped=True)
        self.result_dev = self.result.device_pointer(device)
        self.result_view = self.result.array(np.int32)
        self.event = Event(device)
        self.staging: runtime.PinnedBuffer | None = None
        self.pending: DmaJob | None = None
        self.lock = threading.Lock()

    def staging_buffer(self, nbytes: int) -> runtime.PinnedBuffer:
        if self.staging is None or self.staging.nbytes < nbytes:
            if self.staging is not None:
                self.staging.close()
            self.staging = runtime.PinnedBuffer(nbytes, mapped=False)
        return self.staging

    def close(self) -> None:
        for obj in (self.staging, self.result, self.status, self.event):
            if obj is not None:
                _release_lost(obj.close)


def _release_lost(close: Any) -> None:
    """Run a release; if the device context is lost (a sticky error), the release cannot succeed and
    is not needed (the driver frees everything with the process): log it once and carry on."""
    try:
        close()
    except CudaError as e:
        if not e.is_sticky:
            raise
        log.error("the CUDA context is lost (%s); its memory is released with the process", e.name)


class DmaJob:
    """A GPU-DMA launch in flight. :meth:`wait` completes it (Sync-lite polling) and returns the rows
    placed; ``event`` completes when the rows are in place (later work on the same stream is ordered
    after it anyway)."""

    def __init__(self, engine: _Engine | None, n: int, placed: int | None = None,
                 statuses: np.ndarray | None = None) -> None:
        self._engine = engine
        self.n = n
        self._placed = placed
        self._statuses = np.zeros(n, dtype=np.int32) if statuses is None else statuses
        self._user_statuses: np.ndarray | None = None
        self._keepalive: Any = None
        self._error: CudaError | None = None

    @property
    def event(self) -> Event | None:
        return None if self._engine is None else self._engine.event

    @property
    def done(self) -> bool:
        """True once the job has completed (cudaEventQuery); never blocks."""
        return self._placed is not None or (self._engine is not None and self._engine.event.query())

    def wait(self, interval_us: float = 20, *, timeout_s: float | None = None) -> int:
        """Wait for completion, polling cudaEventQuery every `interval_us` with the GIL released, and
        return the number of rows placed with status OK."""
        if self._error is not None:
            raise self._error
        if self._placed is None:
            eng = self._engine
            assert eng is not None
            try:
                eng.event.wait(interval_us, timeout_s=timeout_s)
            except CudaError as e:
                if not e.is_sticky:
                    # The query failed but the kernel may still run: block until it cannot touch the
                    # pool or the scratch any more before letting anyone free them.
                    _release_lost(eng.event.synchronize)
                # The job is over (a lost context completes nothing), so the engine is free again and
                # every later wait or launch sees this error, not "in flight".
                self._fail(e)
                raise
            self._complete()
        return self._placed

    def _complete(self) -> None:
        eng = self._engine
        assert eng is not None
        self._placed = int(eng.result_view[0])
        self._statuses[:] = eng.result_view[1:1 + self.n]
        self._keepalive = None
        with eng.lock:
            if eng.pending is self:
                eng.pending = None
        if self._user_statuses is not None:
            self._user_statuses[:self.n] = self._statuses

    def _fail(self, e: CudaError) -> None:
        self._error = e
        self._keepalive = None
        eng = self._engine
        if eng is not None and eng.pending is self:
            eng.pending = None

    @property
    def statuses(self) -> np.ndarray:
        """Per-row :class:`DmaStatus` codes (valid after :meth:`wait`)."""
        if self._placed is None:
            raise ValueError("job not complete: call wait() first")
        return self._statuses


def gpu_dma_async(packets: Packets, num_packets: int, gpu_buffer: Any, gpu_id: int | None, *,
                  stream: StreamLike = None, normalize: Normalize | None = None, expect_dtype: int | None = None,
                  statuses: np.ndarray | None = None) -> DmaJob:
    """Launch GPU-DMA on `stream` (default: torch's current stream of the buffer's device) and return
    the :class:`DmaJob` without waiting. On the CPU backend the work is done before it returns.

    One job per pool and device may be in flight; wait for it before launching the next.
    """
    plan = _plan(packets, num_packets, gpu_buffer, gpu_id, normalize, expect_dtype)
    n = int(plan.records.shape[0])
    _check_statuses(statuses, n)
    t = plan.target
    if t.backend == "cpu":
        st = np.zeros(n, dtype=np.int32)
        placed = _gather_cpu(plan, t.ptr, t.nbytes, st) if n else 0
        if statuses is not None:
            statuses[:n] = st
        return DmaJob(None, n, placed, st)
    if n == 0:
        return DmaJob(None, 0, 0)
    assert t.device is not None
    eng = packets.pool._engine(t.device)
    _settle(eng)
    with eng.lock:
        if eng.pending is not None:
            raise RuntimeError("a GPU-DMA job on this pool and device is still in flight: wait() for it first")
        handle = _default_stream(stream, t)
        _launch(plan, t.device, handle, packets.pool.device_pointer(t.device), eng.status.ptr, eng.result_dev)
        try:
            eng.event.record(handle)
        except CudaError:
            # The kernel is queued but cannot be tracked: wait for the stream so that nothing it
            # reads or writes is freed under it, then report the error.
            _release_lost(lambda: runtime.cuda().cuda_stream_synchronize(handle))
            raise
        job = DmaJob(eng, n)
        job._user_statuses = statuses
        job._keepalive = t.keepalive  # the destination must outlive the kernel writing it
        eng.pending = job
    return job


def _settle(eng: _Engine) -> None:
    """Before a launch: a previous job that finished unwaited is completed; one the device failed
    under raises its real error (CudaError) instead of a misleading "still in flight"."""
    job = eng.pending
    if job is None:
        return
    try:
        done = job._engine is not None and job._engine.event.query()
    except CudaError as e:
        job._fail(e)
        raise
    if done:
        job._complete()


def _launch(plan: _Plan, device: int, stream: int, pool_dev: int, status_ptr: int, result_dev: int) -> None:
    """One native launch of the gather and finalize kernels (no synchronisation)."""
    t = plan.target
    chunks = -(-plan.row_src_bytes // (plan.packets.pool.layout.slot_size - 48))
    blocks_per_row = max(1, min(64, -(-chunks // _WARPS_PER_BLOCK)))
    runtime.cuda().dma_launch(device, stream, plan.packets.pool._geometry, pool_dev, plan.records, t.ptr, t.nbytes,
                              t.row_stride, plan.row_src_bytes, plan.expect_dtype, plan.mode, plan.channels, plan.a,
                              plan.b, plan.d, status_ptr, result_dev, blocks_per_row)


def gpu_dma(packets: Packets, num_packets: int, gpu_buffer: Any, gpu_id: int | None, *, stream: StreamLike = None,
            normalize: Normalize | None = None, expect_dtype: int | None = None, statuses: np.ndarray | None = None,
            interval_us: float = 20, timeout_s: float | None = None) -> int:
    """Place the first `num_packets` requests of `packets` into rows of `gpu_buffer` and return how
    many were placed with status OK (per-row verdicts into `statuses` if given).

    CUDA: the GPU-DMA kernel (reads the mapped pinned pool directly) on `stream`, then a Sync-lite
    wait (cudaEventQuery every `interval_us`, GIL released). `gpu_id` is the buffer's device index.
    CPU: the same checks and placement on the host; `gpu_id` must be None.
    `expect_dtype` (a wire DType) refuses records of another dtype; `normalize` selects the fused
    uint8 -> float32 variant (float32 buffer).
    """
    job = gpu_dma_async(packets, num_packets, gpu_buffer, gpu_id, stream=stream, normalize=normalize,
                        expect_dtype=expect_dtype, statuses=statuses)
    return job.wait(interval_us, timeout_s=timeout_s)


def _default_stream(stream: StreamLike, t: _Target) -> int:
    if stream is not None:
        return stream_handle(stream)
    if runtime.is_fake():
        return 0  # the fake runtime has no torch streams: the legacy default stream
    torch = _torch()

    return int(torch.cuda.current_stream(t.device).cuda_stream)


def cuda_copy_gather(packets: Packets, num_packets: int, gpu_buffer: Any, gpu_id: int | None, *,
                     stream: StreamLike = None, expect_dtype: int | None = None,
                     statuses: np.ndarray | None = None) -> int:
    """Baseline CUDA-Copy: the CPU gathers the payloads into a pinned staging buffer (same checks as
    GPU-DMA), then cudaMemcpyAsync copies the rows to `gpu_buffer` on `stream` and
    cudaStreamSynchronize waits for it. Returns the rows placed with status OK.

    On the CPU backend: the gather into a host staging buffer, then a copy into `gpu_buffer`.
    """
    plan = _plan(packets, num_packets, gpu_buffer, gpu_id, None, expect_dtype)
    n = int(plan.records.shape[0])
    _check_statuses(statuses, n)
    t = plan.target
    st = np.zeros(n, dtype=np.int32)
    nbytes = n * t.row_stride
    if n == 0:
        return 0
    if t.backend == "cpu":
        staging = np.empty(nbytes, dtype=np.uint8)
        placed = _gather_cpu(plan, staging.ctypes.data, nbytes, st)
        dst = np.frombuffer((_ctypes_bytes(t.ptr, nbytes)), dtype=np.uint8)
        dst[:] = staging
    else:
        assert t.device is not None
        eng = packets.pool._engine(t.device)
        with eng.lock:
            buf = eng.staging_buffer(nbytes)
            # A row the checks refuse carries whatever the staging buffer held; its status says so.
            placed = _gather_cpu(plan, buf.address, nbytes, st)
            handle = _default_stream(stream, t)
            rt = runtime.cuda()
            rt.cuda_memcpy_async(t.ptr, buf.address, nbytes, handle)
            rt.cuda_stream_synchronize(handle)
    if statuses is not None:
        statuses[:n] = st
    return placed


def _ctypes_bytes(address: int, nbytes: int) -> Any:
    return (ctypes.c_char * nbytes).from_address(address)
