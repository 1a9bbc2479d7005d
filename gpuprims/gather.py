"""The gather and run steps of the serving data path (CONTRIBUTING.md, house style 16): an instance turns the record
indices of a batch into the model-ready input with one call, and runs its model with another.

    gatherer = make_gatherer(backend, pool, input_shape, dtype, max_batch, device)
    runner = ModelRunner(backend, device, stream=gatherer.stream)
    x = gatherer.gather(recs)          # float32 (len(recs), *input_shape); uint8 inputs scaled to [0, 1]
    out = runner.run(model, x)         # completed output (Sync-lite on cuda)
    ...
    gatherer.close()                   # before the pool is closed

Methods (``method=``):

* ``host`` (the cpu backend's, and the default there): the native host gather into a preallocated
  host tensor, then the apps' transform, bit for bit what ``preprocess(pool.gather(...))`` gave.
* ``gpu_dma`` (the cuda default): the pool is registered once as mapped pinned memory; the GPU-DMA
  kernel reads the packets straight from it into a preallocated device batch buffer, converting
  uint8 to float32 / 255 as it goes (fused, exact: the same bits as torch's ``div_(255)``), then a
  Sync-lite wait (cudaEventQuery polling) for the verdicts.
* ``cuda_copy`` (the baseline): the CPU gathers into pinned staging memory, cudaMemcpyAsync copies it
  to the device, and the transform runs there.

On the fake CUDA runtime (``GPUPRIMS_FAKE_CUDA``, :mod:`gpuprims.testing.fake`) the cuda methods run the
same code with "device" memory in host memory, so the tensors they return are CPU tensors and
:func:`torch_device` (:mod:`gpuprims.backend`, where device resolution lives; re-exported here) says ``cpu``: an instance uses that device for its model.

Rows whose packets fail the kernel's checks (see :class:`gpuprims.cuda.dma.DmaStatus`) are not
placed; ``gatherer.statuses`` holds each row's verdict after a gather (0 = OK), so the caller answers
those requests with an error instead of running the model on stale bytes.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any, Literal, Protocol

import numpy as np

from gpuprims.backend import torch_device
from gpuprims.cuda import runtime
from gpuprims.cuda.dma import UNIT, DeviceRows, PinnedPool, cuda_copy_gather, gpu_dma_async
from gpuprims.cuda.event import Event, Stream, stream_handle
from gpuprims.cuda.sync import sync_lite
from gpuprims.stats import StageClock

Method = Literal["host", "gpu_dma", "cuda_copy"]
METHODS: tuple[str, ...] = ("host", "gpu_dma", "cuda_copy")
DTYPES = ("uint8", "float32")

__all__ = ["DTYPES", "METHODS", "CudaCopyGatherer", "Gatherer", "GpuDmaGatherer", "HostGatherer", "Method",
           "ModelRunner", "default_method", "keep_rows", "make_gatherer", "preprocess", "torch_device"]

#: How long a gather or a model run may take before it is reported as stuck (a device that stopped).
DEFAULT_TIMEOUT_S = 30.0


def _torch() -> Any:
    """torch, imported on first use rather than at this module's head: the instance code imports
    this module in processes that serve an ONNX file and map no torch (tests/test_layers.py,
    TORCH_FREE)."""
    import torch

    return torch


class Gatherer(Protocol):
    """What every gather method offers."""

    method: str
    statuses: np.ndarray
    stream: Any
    #: Where a gather laps its ``gather`` and ``preprocess`` stages, if set (the instance's clock).
    clock: StageClock | None

    def gather(self, recs: np.ndarray) -> Any: ...

    def close(self) -> None: ...


def preprocess(batch: Any, dtype: str) -> Any:
    """The apps' input transform on the host: uint8 bodies become float32 in [0, 1] (x / 255, as the
    GPU-DMA kernel's UNIT normalisation computes it); float32 passes unchanged. The correctness oracle
    applies the same transform before running the model directly in torch."""
    torch = _torch()

    if dtype == "uint8":
        return batch.to(torch.float32).div_(255.0)
    return batch


def keep_rows(batch: Any, keep: np.ndarray) -> Any:
    """The rows of a gathered batch (a torch tensor on its device) where the boolean mask ``keep`` is
    true (a copy)."""
    torch = _torch()

    return batch[torch.from_numpy(keep).to(batch.device)]


def default_method(backend: str) -> Method:
    """``gpu_dma`` on cuda, ``host`` on cpu."""
    return "gpu_dma" if backend == "cuda" else "host"


def _check_args(backend: str, input_shape: tuple[int, ...], dtype: str, max_batch: int, method: str) -> None:
    if backend not in ("cpu", "cuda"):
        raise ValueError(f"backend must be 'cpu' or 'cuda' (resolve 'auto' first), got {backend!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if (backend == "cpu") != (method == "host"):
        raise ValueError(f"method {method!r} does not run on the {backend} backend "
                         f"({'host' if backend == 'cpu' else 'gpu_dma or cuda_copy'} does)")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if not input_shape or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in input_shape):
        raise ValueError(f"input_shape must be positive ints, got {input_shape!r}")
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or not 1 <= max_batch <= 512:
        raise ValueError(f"max_batch must be an int in 1..512 (the GPU-DMA launch limit), got {max_batch!r}")


def _records(recs: Any, max_batch: int) -> np.ndarray:
    arr = np.ascontiguousarray(recs, dtype=np.uint32)
    if arr.ndim != 1 or not 1 <= arr.size <= max_batch:
        raise ValueError(f"recs must be 1..{max_batch} record indices, got shape {arr.shape}")
    return arr


class HostGatherer:
    """``host``: native gather into a preallocated host tensor, then the apps' transform."""

    method = "host"
    clock: StageClock | None = None

    def __init__(self, pool: Any, input_shape: tuple[int, ...], dtype: str, max_batch: int) -> None:
        torch = _torch()

        self.pool = pool
        self.dtype = dtype
        self.max_batch = max_batch
        self.stream = None
        self._host = torch.empty((max_batch, *input_shape), dtype=torch.uint8 if dtype == "uint8" else torch.float32)
        # Made once, not per batch: the batch's rows as bytes for the pool, the tensor of the first n
        # rows for each n, and all-OK verdicts (a host gather has no per-row verdicts).
        self._bytes = self._host.numpy().reshape(max_batch, -1).view(np.uint8)
        self._rows = [self._host[:n] for n in range(max_batch + 1)]
        self._ok = np.zeros(max_batch, dtype=np.int32)
        self._ok.flags.writeable = False
        self.statuses = self._ok[:0]

    def gather(self, recs: np.ndarray) -> Any:
        """float32 rows for `recs`; raises ValueError (from the pool) if a request has the wrong size.
        The result is valid until the next gather."""
        arr = _records(recs, self.max_batch)
        self.pool.gather(arr, self._bytes)
        return self.gathered(arr.size)

    @property
    def rows(self) -> np.ndarray:
        """The batch buffer as ``(max_batch, row bytes)`` uint8, for a caller that copies the payloads in
        itself (the serving loop's :meth:`gpuprims.pool.LocalQueue.take`), then calls :meth:`gathered`."""
        return self._bytes

    def gathered(self, n: int) -> Any:
        """What :meth:`gather` returns, for ``n`` rows already copied into :attr:`rows`."""
        host = self._rows[n]
        self.statuses = self._ok[:n]
        if self.clock is not None:
            self.clock.lap("gather")
        out = preprocess(host, self.dtype)
        if self.clock is not None:
            self.clock.lap("preprocess")
        return out

    def close(self) -> None:
        """Nothing to release (the host tensor goes with the object)."""


def _check_out(out: Any, max_batch: int, input_shape: tuple[int, ...]) -> None:
    """Refuse an ``out`` buffer the GPU-DMA kernel cannot write as a batch, naming what is wrong."""
    torch = _torch()

    want = (max_batch, *input_shape)
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a torch tensor of shape {want}, got {type(out).__name__}")
    if tuple(out.shape) != want or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 tensor of shape {want}, got "
                         f"{out.dtype} {tuple(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}")
    if runtime.is_fake() != (out.device.type == "cpu"):
        raise ValueError(f"out must live on {'the host (fake runtime)' if runtime.is_fake() else 'the GPU'}, "
                         f"got a tensor on {out.device}")


class _DeviceBatch:
    """A device buffer of max_batch rows, as DeviceRows for the kernels and as a torch tensor: allocated
    here, or (``out``) a float32 tensor someone else owns (an engine's static input), written in place."""

    def __init__(self, device: int, max_batch: int, input_shape: tuple[int, ...], elem: Any,
                 out: Any = None) -> None:
        torch = _torch()

        self.mem: Any = None
        if out is not None:
            _check_out(out, max_batch, input_shape)
            self.tensor = out
            self.rows = DeviceRows(out.data_ptr(), out.numel() * 4, max_batch, device, True, out)
            return
        row = math.prod(input_shape) * torch.tensor([], dtype=elem).element_size()
        self.mem = runtime.DeviceMemory(row * max_batch, device)
        if runtime.is_fake():  # "device" memory is host memory: a CPU tensor views it
            raw = (ctypes.c_char * self.mem.nbytes).from_address(self.mem.ptr)
            flat = torch.frombuffer(raw, dtype=torch.uint8)
        else:
            flat = torch.as_tensor(self.mem, device=torch.device("cuda", device))
        self.tensor = flat.view(elem).view(max_batch, *input_shape)
        self.rows = DeviceRows(self.mem.ptr, self.mem.nbytes, max_batch, device, elem == torch.float32, self.mem)

    def close(self) -> None:
        self.tensor = None
        if self.mem is not None:  # (an ``out`` tensor is its owner's to free)
            self.mem.close()


class _CudaGatherer:
    """Shared by gpu_dma and cuda_copy: the pinned pool, the device batch, the stream."""

    method = ""
    clock: StageClock | None = None

    def __init__(self, pool: Any, input_shape: tuple[int, ...], dtype: str, max_batch: int, device: int,
                 stream: Any, interval_us: float, timeout_s: float) -> None:
        self.dtype = dtype
        self.max_batch = max_batch
        self.device = device
        self.interval_us = interval_us
        self.timeout_s = timeout_s
        self.statuses = np.zeros(0, dtype=np.int32)
        self._own_stream: Stream | None = None
        if stream is None:
            if runtime.is_fake():
                stream = self._own_stream = Stream(device)
            else:
                torch = _torch()

                stream = torch.cuda.current_stream(device)
        self.stream = stream
        self.pinned = PinnedPool(pool, backend="cuda")
        self._batches: list[_DeviceBatch] = []

    def _finish(self, placed: int, statuses: np.ndarray) -> None:
        self.statuses = statuses.astype(np.int32, copy=True)

    def close(self) -> None:
        """Wait for work in flight, unregister the pool and free the device buffers (every tensor
        returned by gather() must be gone)."""
        self.pinned.close(timeout_s=self.timeout_s)
        for b in self._batches:
            b.close()
        self._batches.clear()
        if self._own_stream is not None:
            self._own_stream.close()
            self._own_stream = None


class GpuDmaGatherer(_CudaGatherer):
    """``gpu_dma``: the GPU-DMA kernel into a preallocated float32 device batch (uint8 fused / 255)."""

    method = "gpu_dma"

    def __init__(self, pool: Any, input_shape: tuple[int, ...], dtype: str, max_batch: int, device: int,
                 stream: Any = None, interval_us: float = 20, timeout_s: float = DEFAULT_TIMEOUT_S,
                 out: Any = None) -> None:
        torch = _torch()

        if out is not None:
            _check_out(out, max_batch, input_shape)  # before the pool is registered
        super().__init__(pool, input_shape, dtype, max_batch, device, stream, interval_us, timeout_s)
        self.batch = _DeviceBatch(device, max_batch, input_shape, torch.float32, out)
        self._batches.append(self.batch)
        self.normalize = UNIT if dtype == "uint8" else None

    def gather(self, recs: np.ndarray) -> Any:
        """float32 rows for `recs` in device memory (valid until the next gather); per-row verdicts
        in ``statuses``. Waits for the kernel with Sync-lite (cudaEventQuery every interval_us)."""
        arr = _records(recs, self.max_batch)
        st = np.zeros(arr.size, dtype=np.int32)
        job = gpu_dma_async(self.pinned.packets(arr), arr.size, self.batch.rows, self.device, stream=self.stream,
                            normalize=self.normalize, expect_dtype=-1, statuses=st)
        placed = job.wait(self.interval_us, timeout_s=self.timeout_s)
        self._finish(placed, st)
        return self.batch.tensor[:arr.size]


class CudaCopyGatherer(_CudaGatherer):
    """``cuda_copy``: host gather into pinned staging, cudaMemcpyAsync to the device, transform there."""

    method = "cuda_copy"

    def __init__(self, pool: Any, input_shape: tuple[int, ...], dtype: str, max_batch: int, device: int,
                 stream: Any = None, interval_us: float = 20, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        torch = _torch()

        super().__init__(pool, input_shape, dtype, max_batch, device, stream, interval_us, timeout_s)
        self.batch = _DeviceBatch(device, max_batch, input_shape, torch.uint8 if dtype == "uint8" else torch.float32)
        self._batches.append(self.batch)

    def gather(self, recs: np.ndarray) -> Any:
        """float32 rows for `recs` on the device; per-row verdicts in ``statuses``."""
        torch = _torch()

        arr = _records(recs, self.max_batch)
        st = np.zeros(arr.size, dtype=np.int32)
        placed = cuda_copy_gather(self.pinned.packets(arr), arr.size, self.batch.rows, self.device,
                                  stream=self.stream, expect_dtype=-1, statuses=st)
        self._finish(placed, st)
        rows = self.batch.tensor[:arr.size]
        if self.clock is not None:
            self.clock.lap("gather")
        if self.dtype == "uint8":
            rows = rows.to(torch.float32).div_(255.0)
            if self.clock is not None:
                self.clock.lap("preprocess")
        return rows


def make_gatherer(backend: str, pool: Any, input_shape: tuple[int, ...], dtype: str, max_batch: int,
                  device: int = 0, method: Method | None = None, *, stream: Any = None, interval_us: float = 20,
                  timeout_s: float = DEFAULT_TIMEOUT_S, out: Any = None) -> Gatherer:
    """The gather step for one instance (see the module docstring).

    `backend` is the resolved backend (``cpu`` or ``cuda``); `pool` the instance's PacketPool;
    `input_shape` and `dtype` (``uint8`` or ``float32``) the app's request body; `max_batch` the
    largest batch (<= 512); `device` the GPU index; `method` defaults to :func:`default_method`.
    `stream` (cuda) is where the gather runs, torch's current stream by default (so the model that
    follows on it is ordered after the gather); `interval_us` the Sync-lite polling interval;
    `timeout_s` how long a gather may take before it raises TimeoutError. `out` (``gpu_dma`` only): a
    contiguous float32 device tensor ``(max_batch, *input_shape)`` to gather into instead of a buffer of
    the gatherer's own, such as an engine's static input (``gpuprims.engines.Engine.static_input``), so a
    request goes pool -> kernel -> engine with no copy; the caller keeps it alive and frees it.
    """
    method = default_method(backend) if method is None else method
    shape = tuple(input_shape)
    _check_args(backend, shape, dtype, max_batch, method)
    if out is not None and method != "gpu_dma":
        raise ValueError(f"out= is taken by the gpu_dma method only (the GPU-DMA kernel writes it), not {method!r}")
    if method == "host":
        return HostGatherer(pool, shape, dtype, max_batch)
    if method == "gpu_dma":
        return GpuDmaGatherer(pool, shape, dtype, max_batch, device, stream, interval_us, timeout_s, out)
    return CudaCopyGatherer(pool, shape, dtype, max_batch, device, stream, interval_us, timeout_s)


class ModelRunner:
    """The run step: ``run(model, x)`` returns the model's completed output.

    cpu: the model under torch.inference_mode. cuda: :func:`gpuprims.cuda.sync_lite` on `stream`
    (cudaEventRecord after the model, cudaEventQuery every `interval_us` with the GIL released). On the
    fake runtime the model runs on the fake stream's worker and the same event polling waits for it.
    """

    def __init__(self, backend: str, device: int = 0, *, stream: Any = None, interval_us: float = 100,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if backend not in ("cpu", "cuda"):
            raise ValueError(f"backend must be 'cpu' or 'cuda', got {backend!r}")
        self.backend = backend
        self.device = device
        self.stream = stream
        self.interval_us = interval_us
        self.timeout_s = timeout_s
        self._event: Event | None = None
        self._own_stream: Stream | None = None

    def run(self, model: Any, x: Any) -> Any:
        torch = _torch()

        if self.backend == "cpu":
            with torch.inference_mode():
                return model(x)
        if not runtime.is_fake():
            with torch.inference_mode():
                return sync_lite(model, x, interval_us=self.interval_us, stream=self.stream, timeout_s=self.timeout_s)
        return self._run_fake(model, x)

    def _run_fake(self, model: Any, x: Any) -> Any:
        torch = _torch()

        rt = runtime.cuda()
        if self.stream is None:
            self.stream = self._own_stream = Stream(self.device)
        if self._event is None:
            self._event = Event(self.device)
        handle = stream_handle(self.stream)
        if getattr(model, "asynchronous", False):
            # An engine that enqueues its own work (a CUDA graph replay, TensorRT's enqueue) is called on
            # this thread, as on a GPU: a CUDA call inside a stream callback is not permitted.
            with torch.inference_mode():
                out = model(x)
            self._event.record(handle)
            self._event.wait(self.interval_us, timeout_s=self.timeout_s)
            return out
        box: list[Any] = []

        def infer() -> None:
            try:
                with torch.inference_mode():
                    box.append(model(x))
            except Exception as e:  # raised on the host below, as torch raises a failed enqueue
                box.append(e)

        rt.launch_host_func(handle, infer)  # type: ignore[attr-defined]
        self._event.record(handle)
        self._event.wait(self.interval_us, timeout_s=self.timeout_s)
        out = box[0]
        if isinstance(out, Exception):
            raise out
        return out

    def close(self) -> None:
        if self._event is not None:
            self._event.close()
            self._event = None
        if self._own_stream is not None:
            self._own_stream.close()
            self._own_stream = None
