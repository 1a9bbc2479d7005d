"""Sync-lite (paper V-A) and the completion-notification baselines it is measured against.

All three run the model on a stream and differ only in how the host learns that it finished:

* :func:`sync_lite`: record an event after the model's work and poll it (cudaEventQuery) every
  ``interval_us``, sleeping in between with the GIL released. With ``adaptive=AdaptiveWait()`` it
  sleeps until shortly before the expected completion (learnt from measured latencies) and then
  polls finely.
* :func:`sync_blocking`: cudaDeviceSynchronize (``how="device"``), cudaStreamSynchronize
  (``"stream"``) or cudaEventSynchronize on a cudaEventBlockingSync event (``"event"``). Whether the
  first two spin or sleep follows the device's schedule flag (:func:`gpuprims.cuda.runtime.set_schedule`).
* :func:`sync_callback`: cudaLaunchHostFunc after the model signals the waiting thread.

The batch's device picks the backend. On the CPU backend the model runs on a :class:`CpuStream`
(an in-order worker thread) and the same three notification schemes wait for it: event polling,
a blocking wait, and a callback queued behind the model.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from gpuprims.cuda import runtime
from gpuprims.cuda.event import CpuEvent, CpuStream, Event, Stream, StreamLike, stream_handle

Model = Callable[[Any], Any]
BlockingHow = Literal["device", "stream", "event"]

_local = threading.local()
_cpu_default: CpuStream | None = None
_cpu_default_lock = threading.Lock()


def _torch() -> Any:
    """torch, imported on first use rather than at this module's head: the instance code imports
    this module in processes that serve an ONNX file and map no torch (tests/test_layers.py,
    TORCH_FREE)."""
    import torch

    return torch


class AdaptiveWait:
    """When to start polling: sleep until ``quantile`` of recent latencies minus ``margin_us`` after
    the start, then poll every ``fine_interval_us``. Learns from :meth:`observe`; until ``warmup``
    samples are in, it polls from the start. Keep one per model and batch shape."""

    def __init__(self, *, fine_interval_us: float = 10, margin_us: float = 150, quantile: float = 5,
                 window: int = 64, warmup: int = 5) -> None:
        for label, v in (("fine_interval_us", fine_interval_us), ("margin_us", margin_us)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"{label} must be a number >= 0, got {v!r}")
        if isinstance(quantile, bool) or not isinstance(quantile, (int, float)) or not 0 <= quantile <= 100:
            raise ValueError(f"quantile must be in 0..100, got {quantile!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or not 1 <= warmup <= window:
            raise ValueError(f"warmup must be an int in 1..window, got {warmup!r}")
        self.fine_interval_us = fine_interval_us
        self.margin_ns = int(margin_us * 1000)
        self.quantile = quantile
        self.warmup = warmup
        self._samples: deque[int] = deque(maxlen=window)

    def wake_at(self, start_ns: int) -> int:
        """CLOCK_MONOTONIC ns at which to start polling for work started at `start_ns` (0 = now)."""
        if len(self._samples) < self.warmup:
            return 0
        expected = float(np.percentile(np.fromiter(self._samples, dtype=np.int64), self.quantile))
        return start_ns + max(0, int(expected) - self.margin_ns)

    def observe(self, latency_ns: int) -> None:
        """Add one measured latency (start to detected completion)."""
        if latency_ns > 0:
            self._samples.append(int(latency_ns))


def _check_model_batch(model: Model, batch: Any) -> None:
    if not callable(model):
        raise TypeError(f"model must be callable, got {type(model).__name__}")
    torch = _torch()

    if not isinstance(batch, torch.Tensor):
        raise TypeError(f"batch must be a torch.Tensor, got {type(batch).__name__}")


def _check_interval(interval_us: float) -> None:
    if isinstance(interval_us, bool) or not isinstance(interval_us, (int, float)) or not interval_us >= 0:
        raise ValueError(f"interval_us must be a number >= 0, got {interval_us!r}")


def _check_timeout(timeout_s: float | None) -> None:
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or not timeout_s >= 0):
        raise ValueError(f"timeout_s must be a number >= 0 or None, got {timeout_s!r}")


def default_cpu_stream() -> CpuStream:
    """The process's shared CPU-backend stream (created on first use)."""
    global _cpu_default
    with _cpu_default_lock:
        if _cpu_default is None:
            _cpu_default = CpuStream()
        return _cpu_default


def _infer(model: Model, batch: Any) -> Any:
    torch = _torch()

    with torch.no_grad():
        return model(batch)


def _cpu_submit(model: Model, batch: Any, stream: StreamLike) -> tuple[Any, CpuStream]:
    s = default_cpu_stream() if stream is None else stream
    if not isinstance(s, CpuStream):
        raise TypeError(f"a CPU batch runs on a CpuStream (or stream=None), got {stream!r}")
    return s.submit(_infer, model, batch), s


def _cuda_run(model: Model, batch: Any, stream: StreamLike) -> tuple[Any, Any]:
    """Enqueue model(batch) on `stream` (default: torch's current stream); return (output, torch stream)."""
    torch = _torch()

    runtime.cuda()  # the fork guard and the kernels check, before torch touches the device
    dev = batch.device
    cur = torch.cuda.current_stream(dev)
    if stream is None:
        ts = cur
    elif isinstance(stream, torch.cuda.Stream):
        ts = stream
    elif isinstance(stream, (Stream, int)) and not isinstance(stream, bool):
        ts = torch.cuda.ExternalStream(stream_handle(stream), device=dev)
    else:
        raise TypeError(f"stream must be a torch.cuda.Stream, a gpuprims Stream, an int handle or None, got {stream!r}")
    if ts.device != dev:
        raise ValueError(f"stream is on {ts.device} but the batch is on {dev}")
    if ts != cur:
        ts.wait_stream(cur)  # the batch was produced on the current stream
    with torch.no_grad(), torch.cuda.stream(ts):
        out = model(batch)
    if ts != cur:
        batch.record_stream(ts)
    return out, ts


def _thread_event(device: int, blocking: bool) -> Event:
    events: dict[tuple[int, bool], Event] | None = getattr(_local, "events", None)
    if events is None:
        events = _local.events = {}
    ev = events.get((device, blocking))
    if ev is None:
        ev = events[(device, blocking)] = Event(device, blocking=blocking)
    return ev


def sync_lite(model: Model, batch: Any, *, interval_us: float = 100, stream: StreamLike = None,
              adaptive: AdaptiveWait | None = None, timeout_s: float | None = None) -> Any:
    """Run ``model(batch)`` (no autograd) and return its output once it is complete.

    CUDA: enqueue the model on `stream` (default: torch's current stream), cudaEventRecord after it,
    then poll cudaEventQuery every `interval_us` (0 = spin) sleeping in between with the GIL released.
    With `adaptive`, first sleep until shortly before the expected completion, then poll every
    ``adaptive.fine_interval_us``. CPU: the same on a :class:`CpuStream` with a :class:`CpuEvent`.
    Raises TimeoutError after `timeout_s`.
    """
    _check_model_batch(model, batch)
    _check_interval(interval_us)
    _check_timeout(timeout_s)
    if adaptive is not None and not isinstance(adaptive, AdaptiveWait):
        raise TypeError(f"adaptive must be an AdaptiveWait or None, got {type(adaptive).__name__}")
    t0 = time.monotonic_ns()
    wake_at = adaptive.wake_at(t0) if adaptive is not None else 0
    interval = adaptive.fine_interval_us if adaptive is not None and wake_at else interval_us
    if batch.is_cuda:
        out, ts = _cuda_run(model, batch, stream)
        ev = _thread_event(batch.device.index, False)
        ev.record(ts.cuda_stream)
        ev.wait(interval, timeout_s=timeout_s, wake_at_ns=wake_at)
    else:
        fut, s = _cpu_submit(model, batch, stream)
        cev = CpuEvent()
        cev.record(s)
        cev.wait(interval, timeout_s=timeout_s, wake_at_ns=wake_at)
        out = fut.result()
    if adaptive is not None:
        adaptive.observe(time.monotonic_ns() - t0)
    return out


def sync_blocking(model: Model, batch: Any, *, how: BlockingHow = "stream", stream: StreamLike = None) -> Any:
    """Baseline: run ``model(batch)`` and block until it is done.

    CUDA: cudaDeviceSynchronize (``how="device"``), cudaStreamSynchronize (``"stream"``), or
    cudaEventSynchronize on a cudaEventBlockingSync event (``"event"``), each with the GIL released;
    spinning or sleeping follows the device's schedule flag. CPU: a blocking wait on the work (after
    all queued work for ``"device"``).
    """
    _check_model_batch(model, batch)
    if how not in ("device", "stream", "event"):
        raise ValueError(f"how must be 'device', 'stream' or 'event', got {how!r}")
    if batch.is_cuda:
        out, ts = _cuda_run(model, batch, stream)
        rt = runtime.cuda()
        if how == "device":
            rt.cuda_device_synchronize(batch.device.index)
        elif how == "stream":
            rt.cuda_stream_synchronize(ts.cuda_stream)
        else:
            ev = _thread_event(batch.device.index, True)
            ev.record(ts.cuda_stream)
            ev.synchronize()
        return out
    fut, s = _cpu_submit(model, batch, stream)
    if how == "device":
        s.synchronize()
    return fut.result()


#: How long sync_callback waits by default: CUDA never runs a host function in a faulted context, so
#: the native wait also checks the stream for a fault every 10 ms; this bounds the rest (a model that
#: never finishes).
CALLBACK_TIMEOUT_S = 60.0


def sync_callback(model: Model, batch: Any, *, stream: StreamLike = None,
                  timeout_s: float | None = CALLBACK_TIMEOUT_S) -> Any:
    """Baseline: run ``model(batch)``, enqueue a host callback after it (cudaLaunchHostFunc) that
    signals this thread, and block (GIL released) until it fires. CPU: a callback queued behind the
    model on the CpuStream sets a threading.Event. Raises CudaError at once if the device faults
    meanwhile (the callback would never run), TimeoutError after `timeout_s` (None: no deadline)."""
    _check_model_batch(model, batch)
    _check_timeout(timeout_s)
    if batch.is_cuda:
        out, ts = _cuda_run(model, batch, stream)
        timeout_us = -1 if timeout_s is None else int(timeout_s * 1e6)
        if not runtime.cuda().cuda_callback_wait(ts.cuda_stream, timeout_us):
            raise TimeoutError(f"host callback did not run within {timeout_s} s: the model's work is still "
                               "running on the stream (raise timeout_s for longer models)")
        return out
    fut, s = _cpu_submit(model, batch, stream)
    fired = threading.Event()
    s.submit(fired.set)
    if not fired.wait(timeout_s):
        raise TimeoutError(f"callback did not run within {timeout_s} s")
    return fut.result()
