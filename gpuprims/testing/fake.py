"""A fake CUDA runtime: the native layer's CUDA functions emulated on the host, for machines without
a GPU (this project's development machines and CI).

Selected with the environment variable ``GPUPRIMS_FAKE_CUDA`` (any value but ``0``), read by
:func:`gpuprims.cuda.runtime.cuda`, which then returns this runtime instead of ``gpuprims._native``.
Optional settings in the same variable, comma-separated: ``driver=12040`` and ``runtime=12080``
(versions reported, to emulate a driver too old for the runtime), ``devices=N``, ``delay_us=D`` (how
long a kernel "runs"), ``capability=8.6``, ``no_kernel_image`` (the kernels cannot load).

What it emulates, with the semantics of the CUDA runtime API that the Python layer relies on:

* **Streams**: each an in-order worker thread. ``0`` is the legacy default stream.
* **Events**: recorded into a stream; complete once the stream passes them. A never-recorded event
  counts as complete (as cudaEventQuery says for a fresh event).
* **Memory**: device memory is host memory (a device pointer is a host address), so the GPU-DMA CPU
  reference can run as the "kernel". cudaHostRegister/Unregister and cudaHostGetDevicePointer keep
  the rules: only registered or cudaHostAlloc'd memory has a device pointer, registering twice or
  unregistering what is not registered fails. Device memory for IPC comes from POSIX shared memory,
  so cudaIpcOpenMemHandle works across processes.
* **Kernels**: ``dma_launch`` queues the CPU reference on the stream after ``delay_us``; if any buffer
  it touches was freed or unregistered meanwhile, the "kernel" faults with cudaErrorIllegalAddress.
* **Errors**: :meth:`FakeRuntime.inject` makes the next call(s) of a function fail with a status;
  sticky statuses (illegal address, launch failure, ...) poison the context as on a GPU: every later
  call returns them, queued work is dropped, and host functions never run.
* **Ledger**: live resources by kind, and every free/unregister/destroy done while queued work still
  referenced it (:attr:`FakeRuntime.unsafe_frees`), which is the bug class the tests look for.
* **IPC lifetimes across processes**: "calling cudaFree on an exported memory region before calling
  cudaIpcCloseMemHandle in the importing context will result in undefined behavior" (the
  cudaIpcOpenMemHandle documentation), and a process's exit frees everything it allocated. The
  exporter holds an exclusive ``flock`` on the allocation's shared-memory file from its first
  cudaIpcGetMemHandle until cudaFree or its exit (the kernel drops it even on SIGKILL), and cudaFree
  of an exported allocation poisons it (0xFF bytes: NaN in float32). An importer probes that lock
  before each operation that reads its mappings: a kernel or copy whose ranges overlap a mapping
  whose exporter freed it or exited, or a host function or graph launch (the fake's stand-ins for a
  model's kernels, which may read any mapping of the process) while any such mapping is open, faults
  with cudaErrorIllegalAddress (sticky, as an access to unmapped device memory does on a GPU), is
  listed in :attr:`FakeRuntime.ipc_use_after_free` and, when ``GPUPRIMS_FAKE_CUDA_FAULT_LOG`` names
  a file, appended to it as one JSON line (so a test counts them over every process of a node).
  Opening a handle whose exporter freed it or exited fails with cudaErrorInvalidValue.

Errors are raised as :class:`gpuprims.cuda.errors.CudaError`, as the native ``check()`` does.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import itertools
import json
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuprims import _native
from gpuprims.cuda.errors import STICKY_STATUSES, CudaError
from gpuprims.cuda.runtime import FAKE_ENV

#: A file every process on the fake runtime appends its IPC use-after-free faults to (JSON lines).
FAULT_LOG_ENV = "GPUPRIMS_FAKE_CUDA_FAULT_LOG"

# cudaError_t values used here (driver_types.h).
SUCCESS = 0
INVALID_VALUE = 1
MEMORY_ALLOCATION = 2
INSUFFICIENT_DRIVER = 35
INVALID_DEVICE = 101
NO_KERNEL_IMAGE = 209
INVALID_RESOURCE_HANDLE = 400
NOT_READY = 600
ILLEGAL_ADDRESS = 700
LAUNCH_FAILURE = 719
HOST_MEMORY_ALREADY_REGISTERED = 712
HOST_MEMORY_NOT_REGISTERED = 713
ILLEGAL_STATE = 401
NOT_PERMITTED = 800
CAPTURE_UNSUPPORTED = 900
CAPTURE_INVALIDATED = 901
CAPTURE_UNMATCHED = 903
CAPTURE_UNJOINED = 904
CAPTURE_ISOLATION = 905
CAPTURE_IMPLICIT = 906
CAPTURED_EVENT = 907
CAPTURE_WRONG_THREAD = 908

# cudaStreamCaptureMode and cudaStreamCaptureStatus (driver_types.h).
CAPTURE_MODE_GLOBAL = 0
CAPTURE_MODE_THREAD_LOCAL = 1
CAPTURE_MODE_RELAXED = 2
CAPTURE_STATUS_NONE = 0
CAPTURE_STATUS_ACTIVE = 1
CAPTURE_STATUS_INVALIDATED = 2

_NAMES = {
    INVALID_VALUE: ("cudaErrorInvalidValue", "invalid argument"),
    MEMORY_ALLOCATION: ("cudaErrorMemoryAllocation", "out of memory"),
    INSUFFICIENT_DRIVER: ("cudaErrorInsufficientDriver",
                          "CUDA driver version is insufficient for CUDA runtime version"),
    INVALID_DEVICE: ("cudaErrorInvalidDevice", "invalid device ordinal"),
    NO_KERNEL_IMAGE: ("cudaErrorNoKernelImageForDevice", "no kernel image is available for execution on the device"),
    INVALID_RESOURCE_HANDLE: ("cudaErrorInvalidResourceHandle", "invalid resource handle"),
    NOT_READY: ("cudaErrorNotReady", "device not ready"),
    ILLEGAL_ADDRESS: ("cudaErrorIllegalAddress", "an illegal memory access was encountered"),
    LAUNCH_FAILURE: ("cudaErrorLaunchFailure", "unspecified launch failure"),
    HOST_MEMORY_ALREADY_REGISTERED: ("cudaErrorHostMemoryAlreadyRegistered",
                                     "part or all of the requested memory range is already mapped"),
    HOST_MEMORY_NOT_REGISTERED: ("cudaErrorHostMemoryNotRegistered",
                                 "pointer does not correspond to a registered memory region"),
    ILLEGAL_STATE: ("cudaErrorIllegalState", "the operation cannot be performed in the present state"),
    NOT_PERMITTED: ("cudaErrorNotPermitted", "operation not permitted"),
    CAPTURE_UNSUPPORTED: ("cudaErrorStreamCaptureUnsupported", "operation not permitted when stream is capturing"),
    CAPTURE_INVALIDATED: ("cudaErrorStreamCaptureInvalidated",
                          "operation failed due to a previous error during capture"),
    CAPTURE_UNMATCHED: ("cudaErrorStreamCaptureUnmatched", "capture was not initiated in this stream"),
    CAPTURE_UNJOINED: ("cudaErrorStreamCaptureUnjoined", "capturing stream has unjoined work"),
    CAPTURE_ISOLATION: ("cudaErrorStreamCaptureIsolation",
                        "dependency created on uncaptured work in another stream"),
    CAPTURE_IMPLICIT: ("cudaErrorStreamCaptureImplicit",
                       "operation would make the legacy stream depend on a capturing blocking stream"),
    CAPTURED_EVENT: ("cudaErrorCapturedEvent",
                     "operation not permitted on an event last recorded in a capturing stream"),
    CAPTURE_WRONG_THREAD: ("cudaErrorStreamCaptureWrongThread",
                           "attempt to terminate a thread-local capture sequence from another thread"),
}
#: Statuses that corrupt the context: once one happens, every later call returns it (sticky).
STICKY = STICKY_STATUSES

_ALIGN = 256


def error(status: int, call: str) -> CudaError:
    """The CudaError the native check() would raise for `status` from `call`."""
    name, msg = _NAMES.get(status, (f"cudaError{status}", f"fake CUDA error {status}"))
    return CudaError(status, name, msg, call)


@dataclass
class Resource:
    """One live allocation, registration, stream, event or IPC mapping."""

    kind: str
    handle: int
    nbytes: int = 0
    keep: Any = None  # what keeps the host memory alive (numpy buffer / SharedMemory)
    info: dict[str, Any] = field(default_factory=dict)


def _nothing() -> None:
    pass


@dataclass
class _Op:
    fn: Callable[[], None]
    touches: tuple[tuple[int, int], ...] = ()  # (address, nbytes) ranges the op reads or writes
    is_host_func: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    label: str = ""
    kind: str = ""  # as _enqueue's: "host", "memcpy", "kernel", "graph"; "" for bookkeeping


#: Set on a stream worker while it runs a host function: CUDA calls from there are refused.
_worker = threading.local()


@dataclass
class GraphNode:
    """One captured operation: what it runs, the nodes it depends on (indices into the graph's node
    list, always earlier ones), and the stream it was captured from (for inspection by tests)."""

    index: int
    kind: str  # "host" (cudaLaunchHostFunc), "memcpy", "kernel", "graph" (a child graph launch)
    fn: Callable[[], None]
    deps: tuple[int, ...]
    stream: int
    label: str = ""
    is_host_func: bool = False


@dataclass
class _Capture:
    """A capture sequence: begun on ``origin``, joined by the streams that waited on its events."""

    id: int
    origin: int
    mode: int
    thread: int
    nodes: list[GraphNode] = field(default_factory=list)
    streams: set[int] = field(default_factory=set)
    invalid: bool = False
    ended: bool = False


def _run_host_func(fn: Callable[[], None]) -> None:
    _worker.in_host_func = True
    try:
        fn()
    finally:
        _worker.in_host_func = False


class _FakeStream:
    def __init__(self, rt: FakeRuntime, handle: int) -> None:
        self.rt = rt
        self.handle = handle
        self.q: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self.pending: list[_Op] = []
        self.lock = threading.Lock()
        # Stream capture state: the capture this stream belongs to and its frontier (the nodes the next
        # captured operation on this stream depends on).
        self.capture: _Capture | None = None
        self.frontier: tuple[int, ...] = ()
        self.non_blocking = False  # created with cudaStreamNonBlocking (set by cuda_stream_create)
        self.thread = threading.Thread(target=self._run, name=f"fake-cuda-stream-{handle:x}", daemon=True)
        self.thread.start()

    def submit(self, op: _Op) -> _Op:
        with self.lock:
            self.pending.append(op)
        self.q.put(op)
        return op

    def _run(self) -> None:
        while True:
            op = self.q.get()
            if op is None:
                return
            try:
                if self.rt.sticky == SUCCESS:
                    self.rt._guard_ipc(op)
                    if op.is_host_func:
                        _run_host_func(op.fn)
                    else:
                        op.fn()
            except CudaError as e:
                self.rt.fault(e.status)
            finally:
                with self.lock:
                    self.pending.remove(op)
                op.fn = _nothing  # drop what the work held (buffers, the pool geometry)
                op.touches = ()
                op.done.set()

    def idle(self) -> bool:
        with self.lock:
            return not self.pending

    def last(self) -> _Op | None:
        with self.lock:
            return self.pending[-1] if self.pending else None

    def stop(self) -> None:
        self.q.put(None)


class FakeRuntime:
    """The emulated runtime; one per process (:func:`runtime`). Method names and signatures follow
    the native ``cuda_*``/``dma_*`` functions of ``gpuprims._native``."""

    def __init__(self, spec: str = "") -> None:
        _sweep_dead_processes()
        opts = dict(kv.split("=", 1) if "=" in kv else (kv, "1") for kv in spec.split(",") if kv and kv != "1")
        self.driver = int(opts.get("driver", 13000))
        self.runtime_ver = int(opts.get("runtime", 13000))
        self.ndevices = int(opts.get("devices", 1))
        self.delay_s = float(opts.get("delay_us", 200)) / 1e6
        self.capability = tuple(int(x) for x in opts.get("capability", "8.6").split("."))
        self.kernel_image = "no_kernel_image" not in opts
        self.sticky = SUCCESS
        self.lock = threading.RLock()
        self.resources: dict[tuple[str, int], Resource] = {}
        self.unsafe_frees: list[str] = []
        #: Every operation that read IPC-mapped memory whose exporter had freed it or exited.
        self.ipc_use_after_free: list[str] = []
        self.calls: dict[str, int] = {}
        self._inject: dict[str, list[int]] = {}
        self._ids = itertools.count(0x1000)
        self._streams: dict[int, _FakeStream] = {0: _FakeStream(self, 0)}
        self._captures: dict[int, _Capture] = {}
        self._graphs: dict[int, list[GraphNode]] = {}
        self._execs: dict[int, dict[str, Any]] = {}
        #: Every capture begun (cudaStreamBeginCapture that succeeded), for tests that count them.
        self.captures_begun = 0
        self._events: dict[int, dict[str, Any]] = {}
        self._device = 0
        self._flags: dict[int, int] = {}
        self.pid = os.getpid()

    # -- control of the fake ------------------------------------------------------------------------
    def inject(self, call: str, status: int, count: int = 1) -> None:
        """Make the next `count` calls of `call` (e.g. ``"cuda_event_query"``, ``"dma_launch"``) fail
        with `status`; a sticky status also poisons the context, as a device fault would.
        ``"kernel"`` fails the next GPU-DMA kernel while it runs (an asynchronous fault)."""
        with self.lock:
            self._inject.setdefault(call, []).extend([int(status)] * count)

    def fault(self, status: int) -> None:
        """A device fault: the context becomes unusable with `status` (sticky)."""
        with self.lock:
            if status in STICKY and self.sticky == SUCCESS:
                self.sticky = status

    def live(self, kind: str | None = None) -> list[Resource]:
        """Live resources (of one kind: device, host_alloc, registered, stream, event, ipc_open)."""
        with self.lock:
            return [r for (k, _), r in self.resources.items() if kind is None or k == kind]

    def shutdown(self) -> None:
        """Stop the stream workers once their queued work is done (the runtime is being replaced), and
        remove the names of the device memory still allocated (its mappings stay valid until exit)."""
        for s in list(self._streams.values()):
            s.stop()
        for r in self.live("device"):
            if isinstance(r.keep, _ShmMap):
                r.keep.unlink()

    def quiesce(self, timeout_s: float = 10.0) -> None:
        """Wait until every stream is idle (for tests and shutdown)."""
        deadline = time.monotonic() + timeout_s
        for s in list(self._streams.values()):
            while not s.idle():
                if time.monotonic() > deadline:
                    raise TimeoutError("fake CUDA streams still busy")
                time.sleep(0.001)

    # -- internals ----------------------------------------------------------------------------------
    def _enter(self, call: str) -> None:
        with self.lock:
            self.calls[call] = self.calls.get(call, 0) + 1
            if getattr(_worker, "in_host_func", False):
                # cudaLaunchHostFunc: "The host function must not make any CUDA API calls. Attempting
                # to use a CUDA API may result in cudaErrorNotPermitted" (and a deadlock on a GPU).
                raise error(NOT_PERMITTED, f"{call} (from inside a host function)")
            if os.getpid() != self.pid:
                raise error(3, call)  # cudaErrorInitializationError: the context does not survive fork
            inj = self._inject.get(call)
            if inj:
                status = inj.pop(0)
                self.fault(status)
                raise error(status, call)
            if self.sticky != SUCCESS:
                raise error(self.sticky, call)
            if self.driver // 1000 < self.runtime_ver // 1000 and call not in (
                    "cuda_runtime_version", "cuda_driver_version"):
                raise error(INSUFFICIENT_DRIVER, call)

    def _dev(self, dev: int, call: str) -> None:
        if not 0 <= dev < self.ndevices:
            raise error(INVALID_DEVICE, call)

    def _alloc(self, nbytes: int) -> tuple[int, Any]:
        buf = np.zeros(nbytes + _ALIGN, dtype=np.uint8)
        addr = buf.ctypes.data
        pad = (-addr) % _ALIGN
        return addr + pad, buf

    def _stream(self, handle: int, call: str) -> _FakeStream:
        s = self._streams.get(handle)
        if s is None:
            raise error(INVALID_RESOURCE_HANDLE, call)
        return s

    def _in_use(self, addr: int, nbytes: int) -> list[str]:
        hits = []
        for s in self._streams.values():
            with s.lock:
                for op in s.pending:
                    for a, n in op.touches:
                        if a < addr + max(nbytes, 1) and addr < a + n:
                            hits.append(f"stream 0x{s.handle:x}")
        return hits

    def _release(self, kind: str, addr: int, call: str, what: str) -> Resource:
        with self.lock:
            r = self.resources.get((kind, addr))
            if r is None:
                raise error(HOST_MEMORY_NOT_REGISTERED if kind == "registered" else INVALID_VALUE, call)
            users = self._in_use(addr, r.nbytes)
            if users:
                self.unsafe_frees.append(f"{call} of {what} 0x{addr:x} ({r.nbytes} B) while work queued on "
                                         + ", ".join(sorted(set(users))))
            del self.resources[(kind, addr)]
            return r

    def _mapped(self, addr: int, nbytes: int) -> bool:
        """True if [addr, addr+nbytes) lies in memory the device may touch (an IPC mapping only while
        its exporter keeps the allocation)."""
        with self.lock:
            for (kind, a), r in self.resources.items():
                if kind in ("device", "registered", "host_alloc", "ipc_open") and a <= addr and addr + nbytes <= a + r.nbytes:
                    if kind == "ipc_open":
                        return _owner_holds(r.info["probe_fd"])
                    return kind != "host_alloc" or bool(r.info.get("mapped", True))
        return False

    def _dead_ipc(self, op: _Op) -> list[Resource]:
        """The IPC mappings ``op`` may read whose exporter freed the allocation or exited: those its
        ranges overlap (a kernel, a copy), or every one (a host function or graph launch, which stand in
        for a model's kernels here and may read any mapping of the process)."""
        with self.lock:
            maps = [r for (kind, _), r in self.resources.items() if kind == "ipc_open"]
        if not maps or op.kind not in ("host", "graph", "kernel", "memcpy"):
            return []
        if op.kind in ("kernel", "memcpy"):
            maps = [r for r in maps if any(a < r.handle + r.nbytes and r.handle < a + n for a, n in op.touches if n)]
        return [r for r in maps if not _owner_holds(r.info["probe_fd"])]

    def _guard_ipc(self, op: _Op) -> None:
        """Fault (cudaErrorIllegalAddress, sticky) an operation about to read IPC memory its exporter
        freed or took with it when it exited, and record it (:attr:`ipc_use_after_free`, the fault log)."""
        dead = self._dead_ipc(op)
        if not dead:
            return
        for r in dead:
            what = (f"{op.label or op.kind} read IPC-mapped memory 0x{r.handle:x} ({r.nbytes} B) exported by pid "
                    f"{r.info['owner']}, which freed it or exited")
            with self.lock:
                self.ipc_use_after_free.append(what)
            _log_fault({"pid": os.getpid(), "fault": "ipc_use_after_free", "op": op.label or op.kind,
                        "owner": r.info["owner"], "nbytes": r.nbytes, "what": what})
        raise error(ILLEGAL_ADDRESS, op.label or op.kind)

    # -- versions and devices -----------------------------------------------------------------------
    def cuda_runtime_version(self) -> int:
        self._enter("cuda_runtime_version")
        return self.runtime_ver

    def cuda_driver_version(self) -> int:
        self._enter("cuda_driver_version")
        return self.driver

    def cuda_device_count(self) -> int:
        self._enter("cuda_device_count")
        return self.ndevices

    def cuda_get_device(self) -> int:
        self._enter("cuda_get_device")
        return self._device

    def cuda_device_name(self, dev: int) -> str:
        self._enter("cuda_device_name")
        self._dev(dev, "cudaGetDeviceProperties")
        return f"Fake GPU {dev} (sm_{self.capability[0]}{self.capability[1]})"

    def cuda_device_capability(self, dev: int) -> tuple[int, int]:
        self._enter("cuda_device_capability")
        self._dev(dev, "cudaDeviceGetAttribute")
        return self.capability[0], self.capability[1]

    def cuda_kernel_image(self, dev: int) -> dict[str, int]:
        self._enter("cuda_kernel_image")
        self._dev(dev, "cudaFuncGetAttributes")
        if not self.kernel_image:
            raise error(NO_KERNEL_IMAGE, "cudaFuncGetAttributes (GPU-DMA kernels for this device)")
        cc = self.capability[0] * 10 + self.capability[1]
        return {"gather_regs": 64, "gather_local_bytes": 0, "gather_ptx_version": cc, "gather_binary_version": cc,
                "finalize_regs": 10}

    def cuda_set_device_flags(self, dev: int, flags: int) -> None:
        self._enter("cuda_set_device_flags")
        self._dev(dev, "cudaSetDeviceFlags")
        self._flags[dev] = int(flags)

    def cuda_get_device_flags(self, dev: int) -> int:
        self._enter("cuda_get_device_flags")
        self._dev(dev, "cudaGetDeviceFlags")
        return self._flags.get(dev, 0)

    def cuda_device_synchronize(self, dev: int) -> None:
        self._enter("cuda_device_synchronize")
        self._dev(dev, "cudaDeviceSynchronize")
        with self.lock:
            me = threading.get_ident()
            active = [c for c in self._captures.values() if not c.ended and (
                c.mode == CAPTURE_MODE_GLOBAL or (c.mode == CAPTURE_MODE_THREAD_LOCAL and c.thread == me))]
            for c in active:
                # A device-wide synchronize is a "potentially unsafe API call": refused while a global
                # capture is under way anywhere, or a thread-local one in this thread, and the capture
                # is invalidated (cudaStreamCaptureMode's rules).
                self._invalidate(c)
            if active:
                raise error(CAPTURE_UNSUPPORTED, "cudaDeviceSynchronize")
        for s in list(self._streams.values()):
            last = s.last()
            if last is not None:
                last.done.wait()
        if self.sticky:
            raise error(self.sticky, "cudaDeviceSynchronize")

    def cuda_mem_get_info(self, dev: int) -> tuple[int, int]:
        self._enter("cuda_mem_get_info")
        self._dev(dev, "cudaMemGetInfo")
        total = 16 << 30
        used = sum(r.nbytes for r in self.live("device"))
        return total - used, total

    def cuda_pci_bus_id(self, dev: int) -> str:
        self._enter("cuda_pci_bus_id")
        self._dev(dev, "cudaDeviceGetPCIBusId")
        return f"0000:{dev + 1:02x}:00.0"

    def cuda_device_by_pci_bus_id(self, bus: str) -> int:
        self._enter("cuda_device_by_pci_bus_id")
        for d in range(self.ndevices):
            if bus.lower() == f"0000:{d + 1:02x}:00.0":
                return d
        raise error(INVALID_DEVICE, "cudaDeviceGetByPCIBusId")

    # -- streams ------------------------------------------------------------------------------------
    def cuda_stream_create(self, dev: int, flags: int, priority: int) -> int:
        self._enter("cuda_stream_create")
        self._dev(dev, "cudaStreamCreateWithPriority")
        with self.lock:
            h = next(self._ids) << 4
            self._streams[h] = _FakeStream(self, h)
            self._streams[h].non_blocking = bool(flags & 0x01)  # cudaStreamNonBlocking
            self.resources[("stream", h)] = Resource("stream", h, info={"device": dev})
        return h

    def cuda_stream_destroy(self, s: int) -> None:
        self._enter("cuda_stream_destroy")
        with self.lock:
            st = self._streams.get(s)
            if st is None or s == 0:
                raise error(INVALID_RESOURCE_HANDLE, "cudaStreamDestroy")
            if st.capture is not None:  # destroying a stream mid-capture ruins the capture
                self._invalidate(st.capture)
                st.capture.streams.discard(s)
                st.capture = None
            del self._streams[s]
            del self.resources[("stream", s)]
        st.stop()  # cudaStreamDestroy lets queued work finish, then releases the stream

    def cuda_stream_synchronize(self, s: int) -> None:
        self._enter("cuda_stream_synchronize")
        st = self._stream(s, "cudaStreamSynchronize")
        self._refuse_sync_while_capturing(st, "cudaStreamSynchronize")
        last = st.last()
        if last is not None:
            last.done.wait()
        if self.sticky:
            raise error(self.sticky, "cudaStreamSynchronize")

    def cuda_stream_query(self, s: int) -> bool:
        self._enter("cuda_stream_query")
        st = self._stream(s, "cudaStreamQuery")
        self._refuse_sync_while_capturing(st, "cudaStreamQuery")
        return st.idle()

    def cuda_stream_wait_event(self, s: int, e: int) -> None:
        self._enter("cuda_stream_wait_event")
        st = self._stream(s, "cudaStreamWaitEvent")
        ev = self._event(e, "cudaStreamWaitEvent")
        with self.lock:
            cap: _Capture | None = ev.get("capture")
            if cap is not None and not cap.ended:
                # An event recorded in a capture: the waiting stream joins that capture (the CUDA
                # programming guide's cross-stream dependencies: "cudaStreamWaitEvent ... pulls the
                # stream into the capture"); its next operations depend on the event's nodes.
                if st.capture is None:
                    self._check_implicit(st, "cudaStreamWaitEvent")
                    st.capture, st.frontier = cap, tuple(ev["frontier"])
                    cap.streams.add(st.handle)
                    return
                if st.capture is cap:
                    self._check_valid(st, "cudaStreamWaitEvent")
                    st.frontier = tuple(dict.fromkeys(st.frontier + tuple(ev["frontier"])))
                    return
                # "It is invalid to merge two separate capture graphs by waiting on a captured event from
                # a stream which is being captured and is associated with a different capture graph."
                self._invalidate(st.capture)
                raise error(CAPTURE_ISOLATION, "cudaStreamWaitEvent")
            if st.capture is not None:
                # "It is invalid to wait on a non-captured event from a stream which is being captured
                # without specifying the cudaEventWaitExternal flag."
                self._check_valid(st, "cudaStreamWaitEvent")
                self._invalidate(st.capture)
                raise error(CAPTURE_ISOLATION, "cudaStreamWaitEvent")
        marker: _Op | None = ev.get("op")
        self._enqueue(st, _Op(lambda: marker.done.wait() if marker is not None else None), "cudaStreamWaitEvent")

    # -- stream capture and graphs -------------------------------------------------------------------
    # Emulates the CUDA runtime's stream capture (cudaStreamBeginCapture / cudaStreamEndCapture /
    # cudaStreamIsCapturing) and executable graphs (cudaGraphInstantiate / cudaGraphLaunch /
    # cudaGraphExecDestroy / cudaGraphDestroy), with the rules of the CUDA programming guide's "Stream
    # Capture" section: work issued to a capturing stream is recorded, not run; an event recorded in a
    # capture and waited on by another stream pulls that stream into the capture (fork), and its work
    # must be joined back (the origin waits on an event recorded after it) before the capture ends; an
    # operation that would synchronize with captured work is refused and invalidates the capture.

    def _enqueue(self, st: _FakeStream, op: _Op, call: str, kind: str = "") -> _Op | None:
        """Queue ``op`` on ``st``, or record it as a graph node if ``st`` is capturing (then nothing
        runs now and None is returned). Bookkeeping ops (``kind`` empty) are never recorded."""
        with self.lock:
            cap = st.capture
            if cap is None:
                self._check_implicit(st, call)
                op.kind = kind
                return st.submit(op)
            self._check_valid(st, call)
            if kind:
                node = GraphNode(len(cap.nodes), kind, op.fn, st.frontier, st.handle, op.label or call,
                                 op.is_host_func)
                cap.nodes.append(node)
                st.frontier = (node.index,)
            return None

    def _check_valid(self, st: _FakeStream, call: str) -> None:
        """Work on a stream whose capture was invalidated fails until the capture is ended."""
        if st.capture is not None and st.capture.invalid:
            raise error(CAPTURE_INVALIDATED, call)

    def _check_implicit(self, st: _FakeStream, call: str) -> None:
        """The legacy stream (0) synchronizes implicitly with every blocking stream. The programming guide:
        "When any stream in the same context is being captured, and it was not created with
        cudaStreamNonBlocking, any attempted use of the legacy stream is invalid": refused
        (cudaErrorStreamCaptureImplicit), and those captures are invalidated."""
        if st.handle != 0:
            return
        blocking = [c for c in self._captures.values() if not c.ended and any(
            not self._streams[h].non_blocking for h in c.streams if h in self._streams)]
        for c in blocking:
            self._invalidate(c)
        if blocking:
            raise error(CAPTURE_IMPLICIT, call)

    def _invalidate(self, cap: _Capture) -> None:
        """A violation of the capture rules: the sequence stays open, but everything issued to its
        streams fails with cudaErrorStreamCaptureInvalidated and cudaStreamEndCapture returns no graph."""
        cap.invalid = True

    def _refuse_sync_while_capturing(self, st: _FakeStream, call: str) -> None:
        """"Synchronizing or querying the execution status of a stream which is being captured ... is
        invalid": cudaErrorStreamCaptureUnsupported, and the capture is invalidated."""
        with self.lock:
            if st.capture is not None:
                self._check_valid(st, call)
                self._invalidate(st.capture)
                raise error(CAPTURE_UNSUPPORTED, call)

    def cuda_stream_begin_capture(self, s: int, mode: int = CAPTURE_MODE_GLOBAL) -> None:
        """cudaStreamBeginCapture: later work on ``s`` is recorded into a new graph."""
        self._enter("cuda_stream_begin_capture")
        if mode not in (CAPTURE_MODE_GLOBAL, CAPTURE_MODE_THREAD_LOCAL, CAPTURE_MODE_RELAXED):
            raise error(INVALID_VALUE, "cudaStreamBeginCapture")
        with self.lock:
            if s == 0:  # "Capture may not be initiated if stream is cudaStreamLegacy."
                raise error(CAPTURE_UNSUPPORTED, "cudaStreamBeginCapture (the legacy default stream)")
            st = self._stream(s, "cudaStreamBeginCapture")
            if st.capture is not None:
                raise error(ILLEGAL_STATE, "cudaStreamBeginCapture (the stream is already capturing)")
            cap = _Capture(next(self._ids), s, mode, threading.get_ident(), streams={s})
            self._captures[cap.id] = cap
            st.capture, st.frontier = cap, ()
            self.captures_begun += 1

    def cuda_stream_is_capturing(self, s: int) -> int:
        """cudaStreamIsCapturing: 0 none, 1 active, 2 invalidated (cudaStreamCaptureStatus)."""
        self._enter("cuda_stream_is_capturing")
        with self.lock:
            st = self._stream(s, "cudaStreamIsCapturing")
            if st.capture is None:
                return CAPTURE_STATUS_NONE
            return CAPTURE_STATUS_INVALIDATED if st.capture.invalid else CAPTURE_STATUS_ACTIVE

    def cuda_stream_end_capture(self, s: int) -> int:
        """cudaStreamEndCapture: the captured graph's handle. Every stream leaves the capture whatever
        happens; an invalidated capture gives cudaErrorStreamCaptureInvalidated (the real call returns
        a NULL graph with it), a fork not joined back cudaErrorStreamCaptureUnjoined."""
        self._enter("cuda_stream_end_capture")
        with self.lock:
            st = self._stream(s, "cudaStreamEndCapture")
            cap = st.capture
            if cap is None:
                raise error(ILLEGAL_STATE, "cudaStreamEndCapture (the stream is not capturing)")
            if cap.origin != s:  # the capture must be ended on the stream that began it
                raise error(CAPTURE_UNMATCHED, "cudaStreamEndCapture")
            if cap.mode != CAPTURE_MODE_RELAXED and cap.thread != threading.get_ident():
                raise error(CAPTURE_WRONG_THREAD, "cudaStreamEndCapture")
            cap.ended = True
            self._captures.pop(cap.id, None)
            members = [self._streams[h] for h in cap.streams if h in self._streams]
            tails = {h: m.frontier for m in members for h in (m.handle,)}
            for m in members:
                m.capture, m.frontier = None, ()
            if cap.invalid:
                raise error(CAPTURE_INVALIDATED, "cudaStreamEndCapture")
            joined = _ancestors(cap.nodes, tails.get(s, ()))
            for h, tail in tails.items():
                if h != s and not set(tail) <= joined:
                    raise error(CAPTURE_UNJOINED, f"cudaStreamEndCapture (stream 0x{h:x} was not joined back)")
            g = next(self._ids) << 4 | 0x4
            self._graphs[g] = list(cap.nodes)
            self.resources[("graph", g)] = Resource("graph", g, info={"nodes": len(cap.nodes)})
            return g

    def graph_nodes(self, g: int) -> list[GraphNode]:
        """The nodes of a captured graph, in capture order (inspection for tests; not a CUDA call)."""
        with self.lock:
            nodes = self._graphs.get(g)
            if nodes is None:
                raise error(INVALID_VALUE, "cudaGraphGetNodes")
            return list(nodes)

    def cuda_graph_instantiate(self, g: int) -> int:
        """cudaGraphInstantiate: an executable graph (a snapshot: later changes to ``g`` do not reach it)."""
        self._enter("cuda_graph_instantiate")
        with self.lock:
            nodes = self._graphs.get(g)
            if nodes is None:
                raise error(INVALID_VALUE, "cudaGraphInstantiate")
            x = next(self._ids) << 4 | 0xc
            self._execs[x] = {"nodes": tuple(nodes), "last": None, "launches": 0}
            self.resources[("graph_exec", x)] = Resource("graph_exec", x, info={"nodes": len(nodes)})
            return x

    def cuda_graph_launch(self, x: int, s: int) -> None:
        """cudaGraphLaunch: run the graph's nodes on ``s`` in dependency order (a legal schedule of the
        graph; a GPU may overlap independent nodes). "Each launch is ordered behind both any previous
        work in stream and any previous launches of graphExec"; a destroyed or unknown executable graph
        is cudaErrorInvalidValue (the documented return codes of cudaGraphLaunch)."""
        self._enter("cuda_graph_launch")
        st = self._stream(s, "cudaGraphLaunch")
        with self.lock:
            ex = self._execs.get(x)
            if ex is None:
                raise error(INVALID_VALUE, "cudaGraphLaunch (the executable graph does not exist or was destroyed)")
            nodes: tuple[GraphNode, ...] = ex["nodes"]
            prev: _Op | None = ex["last"]

            def replay() -> None:
                if prev is not None:
                    prev.done.wait()
                for node in nodes:
                    if node.is_host_func:
                        _run_host_func(node.fn)
                    else:
                        node.fn()

            op = self._enqueue(st, _Op(replay, label=f"graph 0x{x:x}"), "cudaGraphLaunch", kind="graph")
            if op is not None:
                ex["last"] = op
                ex["launches"] += 1

    def cuda_graph_exec_destroy(self, x: int) -> None:
        """cudaGraphExecDestroy (a launch already queued still completes: it holds its nodes)."""
        self._enter("cuda_graph_exec_destroy")
        with self.lock:
            if self._execs.pop(x, None) is None:
                raise error(INVALID_VALUE, "cudaGraphExecDestroy")
            del self.resources[("graph_exec", x)]

    def cuda_graph_destroy(self, g: int) -> None:
        """cudaGraphDestroy."""
        self._enter("cuda_graph_destroy")
        with self.lock:
            if self._graphs.pop(g, None) is None:
                raise error(INVALID_VALUE, "cudaGraphDestroy")
            del self.resources[("graph", g)]

    # -- events -------------------------------------------------------------------------------------
    def _event(self, e: int, call: str) -> dict[str, Any]:
        ev = self._events.get(e)
        if ev is None:
            raise error(INVALID_RESOURCE_HANDLE, call)
        return ev

    def cuda_event_create(self, dev: int, flags: int) -> int:
        self._enter("cuda_event_create")
        self._dev(dev, "cudaEventCreateWithFlags")
        with self.lock:
            h = next(self._ids) << 4 | 0x8
            self._events[h] = {"op": None, "flags": flags, "t_ns": 0, "capture": None, "frontier": ()}
            self.resources[("event", h)] = Resource("event", h, info={"device": dev, "flags": flags})
        return h

    def cuda_event_destroy(self, e: int) -> None:
        self._enter("cuda_event_destroy")
        with self.lock:
            if self._events.pop(e, None) is None:
                raise error(INVALID_RESOURCE_HANDLE, "cudaEventDestroy")
            del self.resources[("event", e)]

    def cuda_event_record(self, e: int, s: int) -> None:
        self._enter("cuda_event_record")
        ev = self._event(e, "cudaEventRecord")
        st = self._stream(s, "cudaEventRecord")
        with self.lock:
            if st.capture is not None:
                # Recorded in a capture: the event stands for the stream's captured frontier (what a
                # later cudaStreamWaitEvent depends on), not for work scheduled for execution.
                self._check_valid(st, "cudaEventRecord")
                ev["op"], ev["capture"], ev["frontier"] = None, st.capture, st.frontier
                return
            ev["capture"] = None

        def mark() -> None:
            ev["t_ns"] = time.perf_counter_ns()

        ev["op"] = self._enqueue(st, _Op(mark), "cudaEventRecord")

    def _event_done(self, e: int, call: str) -> bool:
        self._enter(call)
        ev = self._event(e, call)
        self._check_captured_event(ev, "cudaEventQuery")
        op = ev.get("op")
        return op is None or op.done.is_set()

    def _check_captured_event(self, ev: dict[str, Any], call: str) -> None:
        """The programming guide: "It is invalid to query the execution status of or synchronize on a
        captured event, because it does not represent items scheduled for execution"; the capture it
        belongs to is invalidated."""
        with self.lock:
            cap: _Capture | None = ev.get("capture")
            if cap is not None and not cap.ended:
                self._invalidate(cap)
                raise error(CAPTURED_EVENT, call)

    def cuda_event_query(self, e: int) -> bool:
        return self._event_done(e, "cuda_event_query")

    def cuda_event_synchronize(self, e: int) -> None:
        self._enter("cuda_event_synchronize")
        ev = self._event(e, "cudaEventSynchronize")
        self._check_captured_event(ev, "cudaEventSynchronize")
        op = ev.get("op")
        if op is not None:
            while not op.done.wait(0.01):
                if self.sticky:
                    break
        if self.sticky:
            raise error(self.sticky, "cudaEventSynchronize")

    def cuda_event_elapsed_ms(self, start: int, end: int) -> float:
        self._enter("cuda_event_elapsed_ms")
        a, b = self._event(start, "cudaEventElapsedTime"), self._event(end, "cudaEventElapsedTime")
        return (b["t_ns"] - a["t_ns"]) / 1e6

    def cuda_event_poll(self, e: int, wake_at_ns: int, interval_us: int, timeout_us: int) -> tuple[int, int]:
        """As the native event_poll: (queries, elapsed_ns), queries negative on timeout."""
        t0 = time.monotonic_ns()
        deadline = None if timeout_us < 0 else t0 + timeout_us * 1000
        polls = 0
        if wake_at_ns > t0:
            polls += 1
            if self._event_done(e, "cuda_event_query"):
                return polls, time.monotonic_ns() - t0
            until = wake_at_ns if deadline is None else min(wake_at_ns, deadline)
            time.sleep(max(0, until - time.monotonic_ns()) / 1e9)
        while True:
            polls += 1
            if self._event_done(e, "cuda_event_query"):
                return polls, time.monotonic_ns() - t0
            if deadline is not None and time.monotonic_ns() >= deadline:
                return -polls, time.monotonic_ns() - t0
            time.sleep(interval_us / 1e6)

    def cuda_callback_wait(self, s: int, timeout_us: int) -> bool:
        """As the native callback_wait: a host function queued on `s`, waited for in slices that check
        the stream for a fault (a faulted context never runs host functions)."""
        self._enter("cuda_launch_host_func")
        fired = threading.Event()
        st = self._stream(s, "cudaLaunchHostFunc")
        self._refuse_sync_while_capturing(st, "cudaStreamQuery (callback wait)")
        self._enqueue(st, _Op(fired.set, is_host_func=True), "cudaLaunchHostFunc")
        deadline = None if timeout_us < 0 else time.monotonic() + timeout_us / 1e6
        while True:
            left = 0.01 if deadline is None else min(0.01, deadline - time.monotonic())
            if left <= 0:
                return False
            if fired.wait(left):
                return True
            if self.sticky:
                raise error(self.sticky, "cudaStreamQuery (while waiting for cudaLaunchHostFunc)")

    def launch_host_func(self, s: int, fn: Callable[[], None]) -> None:
        """cudaLaunchHostFunc: run `fn` on the stream's worker after the work queued before it (the
        fake's way to run a model "on the device")."""
        self._enter("cuda_launch_host_func")

        def call() -> None:
            try:
                fn()
            except Exception:
                self.fault(LAUNCH_FAILURE)
                raise

        self._enqueue(self._stream(s, "cudaLaunchHostFunc"), _Op(call, is_host_func=True, label=_name_of(fn)),
                      "cudaLaunchHostFunc", kind="host")

    # -- memory -------------------------------------------------------------------------------------
    def cuda_host_register(self, p: int, n: int, flags: int) -> None:
        self._enter("cuda_host_register")
        if p <= 0 or n <= 0:
            raise error(INVALID_VALUE, "cudaHostRegister")
        with self.lock:
            for (kind, a), r in self.resources.items():
                if kind == "registered" and a < p + n and p < a + r.nbytes:
                    raise error(HOST_MEMORY_ALREADY_REGISTERED, "cudaHostRegister")
            self.resources[("registered", p)] = Resource("registered", p, n, info={"flags": flags})

    def cuda_host_unregister(self, p: int) -> None:
        self._enter("cuda_host_unregister")
        self._release("registered", p, "cudaHostUnregister", "registered host memory")

    def cuda_host_get_device_pointer(self, p: int, dev: int) -> int:
        self._enter("cuda_host_get_device_pointer")
        self._dev(dev, "cudaHostGetDevicePointer")
        with self.lock:
            for (kind, a), r in self.resources.items():
                if kind in ("registered", "host_alloc") and a <= p < a + r.nbytes:
                    if kind == "registered" and not r.info["flags"] & 0x02:
                        break
                    if kind == "host_alloc" and not r.info.get("mapped"):
                        break
                    return p  # UVA: the device sees the host address
        raise error(INVALID_VALUE, "cudaHostGetDevicePointer")

    def cuda_host_alloc(self, n: int, flags: int) -> int:
        self._enter("cuda_host_alloc")
        addr, buf = self._alloc(n)
        with self.lock:
            self.resources[("host_alloc", addr)] = Resource("host_alloc", addr, n, buf, {"mapped": bool(flags & 0x02)})
        return addr

    def cuda_free_host(self, p: int) -> None:
        self._enter("cuda_free_host")
        self._release("host_alloc", p, "cudaFreeHost", "pinned host memory")

    def cuda_malloc(self, dev: int, n: int) -> int:
        self._enter("cuda_malloc")
        self._dev(dev, "cudaMalloc")
        shm = _ShmMap.create(n)
        with self.lock:
            self.resources[("device", shm.addr)] = Resource("device", shm.addr, n, shm, {"device": dev})
        return shm.addr

    def cuda_free(self, dev: int, p: int) -> None:
        self._enter("cuda_free")
        r = self._release("device", p, "cudaFree", "device memory")
        lock_fd = r.info.pop("lock_fd", None)
        if lock_fd is not None:
            # Exported: importers may still map it. On a GPU they would now read whatever the memory is
            # reused for; here they read poison, and their next operation on it faults (the lock is gone).
            ctypes.memset(r.handle, 0xFF, r.nbytes)
            os.close(lock_fd)
        r.keep.close(unlink=True)

    def cuda_memset(self, dev: int, p: int, value: int, n: int) -> None:
        self._enter("cuda_memset")
        if not self._mapped(p, n):
            raise error(INVALID_VALUE, "cudaMemset")
        ctypes.memset(p, value, n)

    def cuda_memcpy_async(self, dst: int, src: int, n: int, s: int) -> None:
        self._enter("cuda_memcpy_async")
        st = self._stream(s, "cudaMemcpyAsync")

        def copy() -> None:
            if not self._mapped(dst, n) or not (self._mapped(src, n) or self._host_ok(src)):
                raise error(ILLEGAL_ADDRESS, "cudaMemcpyAsync")
            ctypes.memmove(dst, src, n)

        self._enqueue(st, _Op(copy, ((dst, n), (src, n)), label=f"memcpy {n} B"), "cudaMemcpyAsync", kind="memcpy")

    def _host_ok(self, addr: int) -> bool:
        return addr > 0  # a pageable host source is allowed for cudaMemcpyAsync (staged by the driver)

    # -- IPC ----------------------------------------------------------------------------------------
    def cuda_ipc_get_mem_handle(self, dev: int, p: int) -> bytes:
        self._enter("cuda_ipc_get_mem_handle")
        with self.lock:
            r = self.resources.get(("device", p))
            if r is None:
                raise error(INVALID_VALUE, "cudaIpcGetMemHandle")
            if "lock_fd" not in r.info:
                # The exporter keeps the allocation until cudaFree or its exit: an exclusive lock on its
                # file says so to importers, and the kernel drops it with the process, even on SIGKILL.
                fd = os.open(f"/dev/shm/{r.keep.name}", os.O_RDONLY | os.O_CLOEXEC)
                fcntl.flock(fd, fcntl.LOCK_EX)
                r.info["lock_fd"] = fd
            name = r.keep.name.encode()
            head = b"FAKEIPC" + bytes([len(name)]) + r.nbytes.to_bytes(8, "little") + \
                (0).to_bytes(4, "little") + self.pid.to_bytes(4, "little")
        raw = head + name
        if len(raw) > 64:
            raise error(INVALID_VALUE, "cudaIpcGetMemHandle")
        return raw + bytes(64 - len(raw))

    def cuda_ipc_open_mem_handle(self, dev: int, handle: bytes) -> int:
        if len(handle) != 64:
            raise ValueError(f"a CUDA IPC memory handle is 64 bytes, got {len(handle)}")
        self._enter("cuda_ipc_open_mem_handle")
        if not handle.startswith(b"FAKEIPC"):
            raise error(INVALID_VALUE, "cudaIpcOpenMemHandle")
        ln = handle[7]
        nbytes = int.from_bytes(handle[8:16], "little")
        offset = int.from_bytes(handle[16:20], "little")
        owner = int.from_bytes(handle[20:24], "little")
        if owner == self.pid:
            raise error(INVALID_VALUE, "cudaIpcOpenMemHandle")  # a process cannot open its own handle
        name = handle[24:24 + ln].decode()
        try:
            probe = os.open(f"/dev/shm/{name}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            raise error(INVALID_VALUE, "cudaIpcOpenMemHandle") from None
        try:
            if not _owner_holds(probe):  # freed, or its process exited (SIGKILL leaves the name behind)
                raise error(INVALID_VALUE, "cudaIpcOpenMemHandle")
            shm = _ShmMap.open(name, nbytes)
        except OSError:
            os.close(probe)
            raise error(INVALID_VALUE, "cudaIpcOpenMemHandle") from None
        except CudaError:
            os.close(probe)
            raise
        addr = shm.addr + offset
        with self.lock:
            self.resources[("ipc_open", addr)] = Resource("ipc_open", addr, nbytes, shm,
                                                          {"probe_fd": probe, "owner": owner})
        return addr

    def cuda_ipc_close_mem_handle(self, dev: int, p: int) -> None:
        self._enter("cuda_ipc_close_mem_handle")
        r = self._release("ipc_open", p, "cudaIpcCloseMemHandle", "an IPC mapping")
        os.close(r.info["probe_fd"])
        r.keep.close(unlink=False)

    # -- GPU-DMA ------------------------------------------------------------------------------------
    def dma_launch(self, device: int, stream: int, geometry: Any, pool_dev: int, records: np.ndarray, out: int,
                   out_nbytes: int, row_stride: int, row_src_bytes: int, expect_dtype: int, mode: int,
                   channels: int, a: list[float], b: list[float], d: list[float], status_dev: int,
                   result_dev: int, blocks_per_row: int) -> None:
        """Queue the GPU-DMA "kernel" (the CPU reference) on `stream`; argument checks as the native."""
        self._enter("dma_launch")
        self._dev(device, "launch_gather")
        st = self._stream(stream, "launch_gather")
        n = int(records.shape[0])
        if n > _native.DMA_MAX_BATCH:
            raise ValueError(f"at most {_native.DMA_MAX_BATCH} rows per launch, got {n}")
        recs = records.copy()  # kernel parameters are copied at launch
        pool_bytes = int(geometry.nbytes)
        touches = ((pool_dev, pool_bytes), (out, out_nbytes), (status_dev, 4 * n), (result_dev, 4 * (n + 1)))
        delay = self.delay_s

        def kernel() -> None:
            time.sleep(delay)
            with self.lock:
                inj = self._inject.get("kernel")
                failed = inj.pop(0) if inj else SUCCESS
            if failed:
                raise error(failed, "gather_kernel")
            for addr, nbytes in touches:
                if nbytes and not self._mapped(addr, nbytes):
                    raise error(ILLEGAL_ADDRESS, "gather_kernel")
            status = np.zeros(max(n, 1), dtype=np.int32)
            placed = _native.dma_gather_cpu(pool_dev, geometry, recs, out, out_nbytes, row_stride, row_src_bytes,
                                            expect_dtype, mode, channels, a, b, d, status) if n else 0
            res = (ctypes.c_int32 * (n + 1)).from_address(result_dev)
            res[0] = placed
            for i in range(n):
                res[1 + i] = int(status[i])

        # The native layer validates the same arguments before launching (check_rows).
        _native.dma_gather_cpu(0, geometry, recs[:0], out, out_nbytes, row_stride, row_src_bytes, expect_dtype, mode,
                               channels, a, b, d, np.zeros(1, np.int32))
        self._enqueue(st, _Op(kernel, touches, label="gather_kernel"), "launch_gather", kind="kernel")

    # -- error names (as the native layer's) ---------------------------------------------------------
    def cuda_error_name(self, s: int) -> str:
        return _NAMES.get(s, (f"cudaError{s}", ""))[0]

    def cuda_error_string(self, s: int) -> str:
        return _NAMES.get(s, ("", f"fake CUDA error {s}"))[1]

    def cuda_raise(self, s: int, call: str) -> None:
        if s:
            raise error(s, call)

    def monotonic_ns(self) -> int:
        return time.monotonic_ns()


def _ancestors(nodes: list[GraphNode], tail: tuple[int, ...]) -> set[int]:
    """The nodes ``tail`` depends on, directly or not, and ``tail`` itself."""
    seen: set[int] = set()
    todo = list(tail)
    while todo:
        i = todo.pop()
        if i not in seen:
            seen.add(i)
            todo.extend(nodes[i].deps)
    return seen


def _name_of(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_PROT_RW = 0x1 | 0x2
_MAP_SHARED = 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value


class _ShmMap:
    """Fake device memory: a POSIX shared-memory file mapped with mmap/munmap (so another process can
    open it as an IPC mapping, and closing really unmaps)."""

    def __init__(self, name: str, nbytes: int, addr: int) -> None:
        self.name, self.nbytes, self.addr = name, nbytes, addr

    @classmethod
    def create(cls, nbytes: int) -> _ShmMap:
        name = f"{_SHM_PREFIX}{os.getpid()}-{next(_shm_ids)}"
        fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        _own_names.add(name)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            return cls(name, nbytes, cls._map(fd, nbytes))
        finally:
            os.close(fd)

    @classmethod
    def open(cls, name: str, nbytes: int) -> _ShmMap:
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        try:
            return cls(name, nbytes, cls._map(fd, nbytes))
        finally:
            os.close(fd)

    @staticmethod
    def _map(fd: int, nbytes: int) -> int:
        addr = _libc.mmap(None, max(nbytes, 1), _PROT_RW, _MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), "mmap failed")
        return int(addr)

    def close(self, *, unlink: bool) -> None:
        _libc.munmap(self.addr, max(self.nbytes, 1))
        if unlink:
            self.unlink()

    def unlink(self) -> None:
        """Remove the name (another process can no longer open it; the mapping stays valid)."""
        _own_names.discard(self.name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{self.name}")


_SHM_PREFIX = "gpuprims-fakecuda-"
_shm_ids = itertools.count()
#: Names of this process's fake device memory still on /dev/shm: removed at exit, so a process that
#: never frees its fake allocations (or whose runtime is replaced) leaves nothing behind.
_own_names: set[str] = set()


@atexit.register
def _unlink_own() -> None:
    for name in list(_own_names):
        with contextlib.suppress(OSError):
            os.unlink(f"/dev/shm/{name}")
    _own_names.clear()


def _owner_holds(fd: int) -> bool:
    """True while the exporting process holds its allocation (its exclusive lock on the file ``fd`` is
    open on): a shared lock cannot be taken then."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _log_fault(doc: dict[str, Any]) -> None:
    """Append one fault to the file ``GPUPRIMS_FAKE_CUDA_FAULT_LOG`` names, if any (one write of one
    line with O_APPEND, so processes writing at once do not interleave)."""
    path = os.environ.get(FAULT_LOG_ENV)
    if not path:
        return
    line = (json.dumps(doc, separators=(",", ":")) + "\n").encode()
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def read_fault_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The faults appended to a ``GPUPRIMS_FAKE_CUDA_FAULT_LOG`` file (none if it does not exist)."""
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _sweep_dead_processes() -> None:
    """Remove fake device memory left by processes that died without exiting cleanly (SIGKILL)."""
    with contextlib.suppress(OSError):
        for name in os.listdir("/dev/shm"):
            if not name.startswith(_SHM_PREFIX):
                continue
            pid = name[len(_SHM_PREFIX):].split("-", 1)[0]
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                with contextlib.suppress(OSError):
                    os.unlink(f"/dev/shm/{name}")
            except PermissionError:
                pass  # alive, another user's


_runtime: FakeRuntime | None = None
_runtime_lock = threading.Lock()


def runtime() -> FakeRuntime:
    """This process's fake runtime, made on first use from ``GPUPRIMS_FAKE_CUDA``."""
    global _runtime
    with _runtime_lock:
        if _runtime is None or _runtime.pid != os.getpid():
            _runtime = FakeRuntime(os.environ.get(FAKE_ENV, "1"))
        return _runtime


def reset(spec: str | None = None) -> FakeRuntime:
    """A fresh fake runtime (tests): ``spec`` as in ``GPUPRIMS_FAKE_CUDA``, default the variable's."""
    global _runtime
    with _runtime_lock:
        if _runtime is not None and _runtime.pid == os.getpid():
            _runtime.shutdown()
        _runtime = FakeRuntime(os.environ.get(FAKE_ENV, "1") if spec is None else spec)
        return _runtime
