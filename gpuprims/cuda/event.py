"""Events and streams (CONTRIBUTING.md, house style 5), for CUDA and for the CPU backend with the same methods.

CUDA: :class:`Event` wraps a cudaEvent_t, :class:`Stream` a cudaStream_t (owned, or borrowed from
torch or a raw handle). CPU: :class:`CpuStream` is an in-order worker thread (the CPU's stand-in for
a device queue) and :class:`CpuEvent` a marker recorded into it, so Sync-lite and its baselines run
the same algorithm on both backends.

Raw handles are ints and print in hex.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from gpuprims.cuda import runtime

StreamLike = Any  # Stream | torch.cuda.Stream | int (raw cudaStream_t) | None


def stream_handle(stream: StreamLike) -> int:
    """The raw cudaStream_t of `stream` as an int: a :class:`Stream`, a torch.cuda.Stream (its
    ``cuda_stream``), a raw int handle, or None for the legacy default stream (0)."""
    if stream is None:
        return 0
    if isinstance(stream, bool):
        raise TypeError(f"not a stream: {stream!r}")
    if isinstance(stream, int):
        if stream < 0:
            raise ValueError(f"a raw stream handle is a non-negative int, got {stream}")
        return stream
    if isinstance(stream, Stream):
        return stream.handle
    handle = getattr(stream, "cuda_stream", None)
    if isinstance(handle, int):
        return handle
    raise TypeError(f"not a CUDA stream: {stream!r} (give a gpuprims Stream, a torch.cuda.Stream or an int)")


class Stream:
    """A CUDA stream: created here (cudaStreamCreateWithPriority, non-blocking by default) or borrowed
    with :meth:`from_handle` (never destroyed by us)."""

    def __init__(self, device: int = 0, *, non_blocking: bool = True, priority: int = 0) -> None:
        rt = runtime.cuda()
        self.device = device
        self.handle = int(rt.cuda_stream_create(device, runtime.STREAM_NON_BLOCKING if non_blocking else 0,
                                                priority))
        self._finalizer: weakref.finalize | None = weakref.finalize(self, runtime._release, rt.cuda_stream_destroy, self.handle)
        self._finalizer.atexit = False

    @classmethod
    def from_handle(cls, handle: StreamLike, device: int = 0) -> Stream:
        """Borrow an existing stream (a raw handle or a torch.cuda.Stream); close() leaves it alone."""
        s = cls.__new__(cls)
        s.device = device
        s.handle = stream_handle(handle)
        s._finalizer = None
        return s

    def query(self) -> bool:
        """True if all work queued so far has finished (cudaStreamQuery); never blocks."""
        return bool(runtime.cuda().cuda_stream_query(self.handle))

    @property
    def done(self) -> bool:
        return self.query()

    def synchronize(self) -> None:
        """Block until the stream's work is done (cudaStreamSynchronize), GIL released. How the thread
        waits (spin or sleep) follows the device's schedule flag (runtime.set_schedule)."""
        runtime.cuda().cuda_stream_synchronize(self.handle)

    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for `event` (cudaStreamWaitEvent)."""
        runtime.cuda().cuda_stream_wait_event(self.handle, event.handle)

    def close(self) -> None:
        """Destroy the stream if we created it (cudaStreamDestroy)."""
        if self._finalizer is not None:
            self._finalizer()

    def __repr__(self) -> str:
        return f"Stream(handle=0x{self.handle:x}, device={self.device})"


class Event:
    """A CUDA event (cudaEventCreateWithFlags). Timing is off by default (cheaper to record and query);
    ``blocking=True`` adds cudaEventBlockingSync so :meth:`synchronize` sleeps instead of spinning."""

    def __init__(self, device: int = 0, *, blocking: bool = False, timing: bool = False,
                 interprocess: bool = False) -> None:
        if interprocess and timing:
            raise ValueError("an interprocess event cannot have timing (cudaEventInterprocess needs "
                             "cudaEventDisableTiming)")
        flags = ((runtime.EVENT_BLOCKING_SYNC if blocking else 0) | (0 if timing else runtime.EVENT_DISABLE_TIMING)
                 | (runtime.EVENT_INTERPROCESS if interprocess else 0))
        rt = runtime.cuda()
        self.device = device
        self.flags = flags
        self.handle = int(rt.cuda_event_create(device, flags))
        self.last_polls = 0
        self.last_wait_ns = 0
        self._finalizer = weakref.finalize(self, runtime._release, rt.cuda_event_destroy, self.handle)
        self._finalizer.atexit = False

    def record(self, stream: StreamLike = None) -> None:
        """Mark the point after all work queued so far on `stream` (cudaEventRecord)."""
        runtime.cuda().cuda_event_record(self.handle, stream_handle(stream))

    def query(self) -> bool:
        """True once the recorded work has finished (cudaEventQuery); never blocks."""
        return bool(runtime.cuda().cuda_event_query(self.handle))

    @property
    def done(self) -> bool:
        return self.query()

    def synchronize(self) -> None:
        """Block until the event completes (cudaEventSynchronize), GIL released."""
        runtime.cuda().cuda_event_synchronize(self.handle)

    def wait(self, interval_us: float = 100, *, timeout_s: float | None = None, wake_at_ns: int = 0) -> int:
        """Sync-lite wait: poll cudaEventQuery every `interval_us` (0 spins), sleeping in between with
        the GIL released; first sleep until `wake_at_ns` (CLOCK_MONOTONIC, as time.monotonic_ns) if it
        is in the future. Returns the number of queries. Raises TimeoutError after `timeout_s`."""
        interval = _check_interval(interval_us)
        timeout_us = -1 if timeout_s is None else _check_timeout(timeout_s)
        polls, elapsed_ns = runtime.cuda().cuda_event_poll(self.handle, int(wake_at_ns), interval, timeout_us)
        polls = int(polls)
        # What the wait achieved, for reports: the requested interval is a floor that sleeps stretch.
        self.last_polls = abs(polls)
        self.last_wait_ns = int(elapsed_ns)
        if polls < 0:
            raise TimeoutError(f"event not complete after {timeout_s} s ({-polls} queries)")
        return polls

    @property
    def achieved_interval_us(self) -> float:
        """Mean time between queries in the last :meth:`wait` (the native poll lowers the thread's
        timer slack to 1 us, so this is close to the requested interval plus one query)."""
        return self.last_wait_ns / 1e3 / max(1, self.last_polls - 1) if self.last_polls > 1 else 0.0

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds between this event and `end` (cudaEventElapsedTime); both need timing=True."""
        return float(runtime.cuda().cuda_event_elapsed_ms(self.handle, end.handle))

    def close(self) -> None:
        """Destroy the event (cudaEventDestroy)."""
        self._finalizer()

    def __repr__(self) -> str:
        return f"Event(handle=0x{self.handle:x}, device={self.device})"


def _check_interval(interval_us: float) -> int:
    if isinstance(interval_us, bool) or not isinstance(interval_us, (int, float)) or not interval_us >= 0:
        raise ValueError(f"interval_us must be a number >= 0, got {interval_us!r}")
    return int(interval_us)


def _check_timeout(timeout_s: float) -> int:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s >= 0:
        raise ValueError(f"timeout_s must be a number >= 0 or None, got {timeout_s!r}")
    return int(timeout_s * 1e6)


_STOP = object()


class CpuStream:
    """The CPU backend's stream: one worker thread running submitted callables in order, so work is
    queued asynchronously and completes in submission order, as on a CUDA stream."""

    def __init__(self, name: str = "gpuprims-cpu-stream") -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._last: Future[Any] | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=_cpu_stream_worker, args=(self._q,), name=name, daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, self._q.put, _STOP)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        """Queue fn(*args, **kwargs) after the work already queued; returns its Future."""
        if not self._finalizer.alive:
            raise ValueError("stream is closed")
        fut: Future[Any] = Future()
        with self._lock:
            self._last = fut
            self._q.put((fut, fn, args, kwargs))
        return fut

    def query(self) -> bool:
        """True if everything queued so far has finished; never blocks."""
        last = self._last
        return last is None or last.done()

    @property
    def done(self) -> bool:
        return self.query()

    def synchronize(self) -> None:
        """Block until everything queued so far has finished (a condition-variable wait: no spin)."""
        last = self._last
        if last is not None:
            last.exception()

    def close(self) -> None:
        """Finish the queued work and stop the worker thread."""
        self._finalizer()
        self._thread.join()


def _cpu_stream_worker(q: queue.SimpleQueue[Any]) -> None:
    while True:
        item = q.get()
        if item is _STOP:
            return
        fut, fn, args, kwargs = item
        if not fut.set_running_or_notify_cancel():
            continue
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            fut.set_exception(exc)


@contextlib.contextmanager
def _low_timer_slack(ns: int = 1000) -> Iterator[None]:
    """This thread's Linux timer slack lowered to `ns` for a polling loop (PR_SET_TIMERSLACK; the
    default 50 us stretches every short sleep), restored afterwards."""
    native = runtime.native()
    prev = int(native.get_timer_slack_ns())
    if prev > ns:
        native.set_timer_slack_ns(ns)
    try:
        yield
    finally:
        if prev > ns:
            native.set_timer_slack_ns(prev)


class CpuEvent:
    """The CPU backend's event: a marker queued into a :class:`CpuStream` behind the work before it."""

    def __init__(self) -> None:
        self._flag = threading.Event()
        self._flag.set()  # an event never recorded counts as complete, as a fresh cudaEvent does
        self._t_ns = 0
        self.last_polls = 0
        self.last_wait_ns = 0

    def record(self, stream: CpuStream) -> None:
        """Mark the point after all work queued so far on `stream`."""
        if not isinstance(stream, CpuStream):
            raise TypeError(f"a CpuEvent is recorded on a CpuStream, got {stream!r}")
        self._flag.clear()
        stream.submit(self._fire)

    def _fire(self) -> None:
        self._t_ns = time.perf_counter_ns()
        self._flag.set()

    def query(self) -> bool:
        """True once the marked work has finished; never blocks."""
        return self._flag.is_set()

    @property
    def done(self) -> bool:
        return self.query()

    def synchronize(self) -> None:
        """Block until the event completes (condition-variable wait)."""
        self._flag.wait()

    def wait(self, interval_us: float = 100, *, timeout_s: float | None = None, wake_at_ns: int = 0) -> int:
        """Sync-lite wait on the CPU: query every `interval_us`, sleeping in between (time.sleep
        releases the GIL); first sleep until `wake_at_ns` (time.monotonic_ns clock) if in the future."""
        interval = _check_interval(interval_us) / 1e6
        deadline = None if timeout_s is None else time.monotonic() + _check_timeout(timeout_s) / 1e6
        polls = 1
        self.last_polls, self.last_wait_ns = 1, 0
        if self._flag.is_set():
            return polls
        t0 = time.monotonic_ns()
        with _low_timer_slack():
            delay_ns = int(wake_at_ns) - time.monotonic_ns()
            if delay_ns > 0:
                time.sleep(delay_ns / 1e9 if deadline is None
                           else min(delay_ns / 1e9, max(0.0, deadline - time.monotonic())))
            while True:
                polls += 1
                self.last_polls, self.last_wait_ns = polls, time.monotonic_ns() - t0
                if self._flag.is_set():
                    return polls
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"event not complete after {timeout_s} s ({polls} queries)")
                if interval:
                    time.sleep(interval)

    @property
    def achieved_interval_us(self) -> float:
        """Mean time between queries in the last :meth:`wait`."""
        return self.last_wait_ns / 1e3 / max(1, self.last_polls - 1) if self.last_polls > 1 else 0.0

    def elapsed_time(self, end: CpuEvent) -> float:
        """Milliseconds between the completion of this event and of `end`."""
        if not (self.query() and end.query()):
            raise ValueError("both events must have completed")
        return (end._t_ns - self._t_ns) / 1e6

    def close(self) -> None:
        """Nothing to release; for symmetry with :class:`Event`."""
