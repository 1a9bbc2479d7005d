"""
gpuprims private native layer (wire format, packet pool, ingest, gather, CUDA kernels)
"""

from collections.abc import Sequence
from typing import Annotated, overload

import numpy
from numpy.typing import NDArray

CUDA_KERNELS_BUILT: bool = True

WIRE_MAGIC: int = 1297240135

WIRE_VERSION: int = 1

WIRE_HEADER_SIZE: int = 48

def wire_layout() -> dict:
    """
    Field name -> (offset, size) of the wire header as compiled into the native code.
    """

def check_request(datagram: bytes) -> int:
    """
    Stateless verdict (0 = ok) of one request datagram, as the ingest computes it.
    """

def verdict_name(verdict: int) -> str: ...

def send_request(fd: int, host: str, port: int, app_id: int, request_id: int, body: Annotated[NDArray[numpy.uint8], dict(shape=(None,), order='C', device='cpu', writable=False)], chunk_payload: int, dtype: int, flags: int, deadline_us: int, client_ts_ns: int) -> int:
    """
    Send one request's datagrams (wire format v1, as gpuprims.wire.encode_request makes them) to host:port (numeric) through the UDP socket fd with sendmmsg; returns how many were sent (fewer than all only when a non-blocking socket's buffer filled: send the rest). OSError as sendto.
    """

RECORD_SIZE: int = 128

def record_layout() -> dict: ...

class Pool:
    @staticmethod
    def create(name: str, slot_count: int, max_payload: int, record_count: int, max_chunks: int, consumer_count: int, answer_ring_bytes: int = 1048576) -> Pool: ...

    @staticmethod
    def attach(name: str) -> Pool: ...

    def close(self) -> None: ...

    @property
    def closed(self) -> bool: ...

    @property
    def name(self) -> str: ...

    @property
    def owner(self) -> bool: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def address(self) -> int: ...

    def layout(self) -> dict: ...

    def region(self, which: str) -> Annotated[NDArray[numpy.uint8], dict(shape=(None,))]:
        """
        A uint8 numpy view of one region of the mapping, keeping the pool alive.
        """

    def poll(self, consumer: int, out: Annotated[NDArray[numpy.uint32], dict(shape=(None,), order='C', device='cpu')], timeout_us: int, spin_us: int = 50) -> int: ...

    def release(self, consumer: int, recs: Annotated[NDArray[numpy.uint32], dict(shape=(None,), order='C', device='cpu', writable=False)]) -> int: ...

    def answer(self, consumer: int, recs: Annotated[NDArray[numpy.uint32], dict(shape=(None,), order='C', device='cpu', writable=False)], gens: Annotated[NDArray[numpy.uint32], dict(shape=(None,), order='C', device='cpu', writable=False)], statuses: Annotated[NDArray[numpy.uint16], dict(shape=(None,), order='C', device='cpu', writable=False)], body: Annotated[NDArray[numpy.uint8], dict(shape=(None, None), order='C', device='cpu', writable=False)] | None, dtype: int, timeout_us: int) -> int:
        """
        Publish one answer per record to the consumer's answer ring (the ingest sends it). Returns how many.
        """

    def queue_depth(self, consumer: int) -> int: ...

    def peek(self, consumer: int, from_pos: int, out: Annotated[NDArray[numpy.uint32], dict(shape=(None,), order='C', device='cpu')]) -> tuple:
        """
        Copy deliver-ring entries from max(from_pos, head) without consuming them: (n, head, tail).
        """

    def set_attached(self, consumer: int, pid: int) -> None: ...

    def gather(self, recs: Annotated[NDArray[numpy.uint32], dict(shape=(None,), order='C', device='cpu', writable=False)], out: Annotated[NDArray, dict(order='C', device='cpu')]) -> None:
        """
        Copy each delivered record's payload into row i of out (CPU gather, GIL released).
        """

class Ingest:
    def __init__(self, pool: Pool, listen: Sequence[tuple[str, int, int]], timeout_ms: float = 500.0, dedup_window_ms: float = 2000.0, batch: int = 64, rcvbuf_bytes: int = 33554432, answer_drops: bool = True, gro: bool = True, answer_hold_ms: float = 1000.0, answer_hold_bytes: int = 33554432) -> None: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    @property
    def running(self) -> bool: ...

    @property
    def ports(self) -> list[int]: ...

    def set_route(self, app_id: int, consumers: Sequence[int]) -> None: ...

    def route(self, app_id: int) -> list[int]: ...

    def reclaim(self, consumer: int, requeue: bool, timeout_ms: int = 5000) -> tuple[int, int]: ...

    def local_open(self) -> int:
        """
        Open a local port (answer queue + eventfd) for submit(); returns its index.
        """

    def local_close(self, port: int) -> None:
        """
        Close a local port; answers still coming to it are dropped (local_dropped).
        """

    def local_fd(self, port: int) -> int:
        """The port's eventfd: readable while answers wait."""

    def submit(self, port: int, app_id: int, rows: Annotated[NDArray[numpy.uint8], dict(shape=(None, None), order='C', device='cpu', writable=False)], dtype: int, deadline_us: int, token0: int) -> None:
        """
        Place each row (uint8 [n, row_bytes]) in the pool as a complete request of app_id and route it; row i is answered at the local port with token token0 + i.
        """

    def take_local(self, port: int) -> list:
        """
        Answers waiting at the local port: [(token, status, dtype, placed_ns, answered_ns, body)], oldest first.
        """

    def set_blocked_port(self, port: int) -> None:
        """
        Fault seam: answers to clients with this UDP port fail as on a full send buffer (0 clears).
        """

    def counters(self) -> dict: ...

DMA_MAX_BATCH: int = 512

DMA_MODE_COPY: int = 0

DMA_MODE_U8_TO_F32: int = 1

DMA_MAX_CHANNELS: int = 4

def get_timer_slack_ns() -> int:
    """This thread's Linux timer slack (PR_GET_TIMERSLACK), ns."""

def set_timer_slack_ns(ns: int) -> None:
    """
    Set this thread's Linux timer slack (PR_SET_TIMERSLACK), ns (0 is taken as 1).
    """

def dma_record_layout() -> dict:
    """Record field name -> (offset, size) as the GPU-DMA kernel reads them."""

class PoolGeometry:
    def __init__(self, nbytes: int, slots_offset: int, records_offset: int, chunkmap_offset: int, slot_size: int, slot_count: int, record_count: int, max_chunks: int) -> None: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def slot_size(self) -> int: ...

    @property
    def slot_count(self) -> int: ...

    @property
    def record_count(self) -> int: ...

    @property
    def max_chunks(self) -> int: ...

    @property
    def max_payload(self) -> int: ...

def dma_gather_cpu(base: int, geometry: PoolGeometry, records: Annotated[NDArray[numpy.uint32], dict(shape=(None,), order='C', device='cpu', writable=False)], out: int, out_nbytes: int, row_stride: int, row_src_bytes: int, expect_dtype: int, mode: int, channels: int, a: Sequence[float], b: Sequence[float], d: Sequence[float], status: Annotated[NDArray[numpy.int32], dict(shape=(None,), order='C', device='cpu')]) -> int:
    """
    CPU reference of the GPU-DMA kernel: same checks, verdicts and bytes. Returns rows placed.
    """

def cuda_error_name(arg: int, /) -> str: ...

def cuda_error_string(arg: int, /) -> str: ...

def cuda_raise(arg0: int, arg1: str, /) -> None:
    """
    Raises CudaError for status s (no-op for cudaSuccess): the choke point, for tests.
    """

def cuda_runtime_version() -> int: ...

def cuda_driver_version() -> int: ...

def cuda_kernel_image(arg: int, /) -> dict:
    """
    Loads the GPU-DMA kernels for device dev (cudaFuncGetAttributes): their registers, local memory and the PTX/binary versions of the image the driver picked; raises CudaError (cudaErrorNoKernelImageForDevice, cudaErrorUnsupportedPtxVersion, ...) if none can run there.
    """

def cuda_device_capability(arg: int, /) -> tuple: ...

def cuda_device_name(arg: int, /) -> str: ...

def cuda_device_count() -> int: ...

def cuda_get_device() -> int: ...

def cuda_set_device_flags(arg0: int, arg1: int, /) -> None: ...

def cuda_get_device_flags(arg: int, /) -> int: ...

def cuda_device_synchronize(arg: int, /) -> None: ...

def cuda_mem_get_info(arg: int, /) -> tuple: ...

def cuda_pci_bus_id(arg: int, /) -> str: ...

def cuda_device_by_pci_bus_id(arg: str, /) -> int: ...

def cuda_stream_create(arg0: int, arg1: int, arg2: int, /) -> int: ...

def cuda_stream_destroy(arg: int, /) -> None: ...

def cuda_stream_synchronize(arg: int, /) -> None: ...

def cuda_stream_query(arg: int, /) -> bool: ...

def cuda_stream_wait_event(arg0: int, arg1: int, /) -> None: ...

def cuda_event_create(arg0: int, arg1: int, /) -> int: ...

def cuda_event_destroy(arg: int, /) -> None: ...

def cuda_event_record(arg0: int, arg1: int, /) -> None: ...

def cuda_event_query(arg: int, /) -> bool: ...

def cuda_event_synchronize(arg: int, /) -> None: ...

def cuda_event_elapsed_ms(arg0: int, arg1: int, /) -> float: ...

def cuda_event_poll(event: int, wake_at_ns: int, interval_us: int, timeout_us: int) -> tuple:
    """
    cudaEventQuery every interval_us (after sleeping until wake_at_ns, CLOCK_MONOTONIC) with the GIL released and the thread's timer slack at 1 us; returns (queries, elapsed_ns), queries negative if timeout_us passed first.
    """

def cuda_callback_wait(stream: int, timeout_us: int) -> bool:
    """
    Enqueues cudaLaunchHostFunc on stream and blocks (GIL released) until it runs; False on timeout; raises CudaError if the stream faults meanwhile (CUDA then never runs the function).
    """

@overload
def monotonic_ns() -> int: ...

@overload
def monotonic_ns() -> int:
    """CLOCK_MONOTONIC in ns (the clock of time.monotonic_ns())."""

def cuda_host_register(arg0: int, arg1: int, arg2: int, /) -> None: ...

def cuda_host_unregister(arg: int, /) -> None: ...

def cuda_host_get_device_pointer(arg0: int, arg1: int, /) -> int: ...

def cuda_host_alloc(arg0: int, arg1: int, /) -> int: ...

def cuda_free_host(arg: int, /) -> None: ...

def cuda_malloc(arg0: int, arg1: int, /) -> int: ...

def cuda_free(arg0: int, arg1: int, /) -> None: ...

def cuda_memset(arg0: int, arg1: int, arg2: int, arg3: int, /) -> None: ...

def cuda_memcpy_async(arg0: int, arg1: int, arg2: int, arg3: int, /) -> None: ...

def cuda_ipc_get_mem_handle(arg0: int, arg1: int, /) -> bytes: ...

def cuda_ipc_open_mem_handle(arg0: int, arg1: bytes, /) -> int: ...

def cuda_ipc_close_mem_handle(arg0: int, arg1: int, /) -> None: ...

def dma_launch(device: int, stream: int, geometry: PoolGeometry, pool_dev: int, records: Annotated[NDArray[numpy.uint32], dict(shape=(None,), order='C', device='cpu', writable=False)], out: int, out_nbytes: int, row_stride: int, row_src_bytes: int, expect_dtype: int, mode: int, channels: int, a: Sequence[float], b: Sequence[float], d: Sequence[float], status_dev: int, result_dev: int, blocks_per_row: int) -> None: ...

TRAFFIC_RECORD_SIZE: int = 72

class TrafficSender:
    """Paced batch sender (sendmmsg, UDP GSO) for gpuprims.traffic."""

    def __init__(self, fds: Sequence[int], gso: bool = True, max_batch_pkts: int = 1024, spin_ns: int = 20000) -> None: ...

    def run(self, pool: Annotated[NDArray[numpy.uint8], dict(shape=(None,), order='C', device='cpu', writable=False)], pkt_off: Annotated[NDArray[numpy.uint64], dict(shape=(None,), order='C', device='cpu', writable=False)], pkt_len: Annotated[NDArray[numpy.uint32], dict(shape=(None,), order='C', device='cpu', writable=False)], pkt_patch: Annotated[NDArray[numpy.uint8], dict(shape=(None,), order='C', device='cpu', writable=False)], unit_first: Annotated[NDArray[numpy.uint32], dict(shape=(None,), order='C', device='cpu', writable=False)], unit_count: Annotated[NDArray[numpy.uint32], dict(shape=(None,), order='C', device='cpu', writable=False)], dest_ip: Annotated[NDArray[numpy.uint32], dict(shape=(None,), order='C', device='cpu', writable=False)], dest_port: Annotated[NDArray[numpy.uint16], dict(shape=(None,), order='C', device='cpu', writable=False)], ev_time: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu', writable=False)], ev_unit: Annotated[NDArray[numpy.uint32], dict(shape=(None,), order='C', device='cpu', writable=False)], ev_rid: Annotated[NDArray[numpy.uint64], dict(shape=(None,), order='C', device='cpu', writable=False)], ev_sock: Annotated[NDArray[numpy.uint16], dict(shape=(None,), order='C', device='cpu', writable=False)], ev_dest: Annotated[NDArray[numpy.uint16], dict(shape=(None,), order='C', device='cpu', writable=False)], ev_sent: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu')], t0_ns: int, stop_at_ns: int = 0) -> int:
        """
        Send events at t0_ns + ev_time[i] (GIL released); ev_sent[i] receives each request's send time.
        """

    def stop(self) -> None: ...

    def progress(self) -> tuple[int, int, int]:
        """(events, packets, bytes) sent so far."""

    def stats(self) -> dict: ...

class TrafficReceiver:
    """Batch receiver (recvmmsg) of response datagrams."""

    def __init__(self, fds: Sequence[int], batch: int = 256, record: bool = True, keep_payloads: bool = False, gro: bool = False, kernel_ts: bool = True) -> None: ...

    def run(self, until_ns: int = 0) -> None:
        """Receive until stop() or until_ns (GIL released)."""

    def stop(self) -> None: ...

    def drain(self) -> tuple[bytes, bytes]:
        """(records, payload bytes) received since the last drain."""

    def stats(self) -> dict: ...

def ingest_set_cost(ingest: Ingest, consumer: int, fixed_us: float, per_request_us: float) -> None:
    """
    Set consumer's cost model: predicted finish = fixed_us + per_request_us * (queued + 1); fixed_us < 0 clears it.
    """

def ingest_cost(ingest: Ingest, consumer: int) -> tuple[float, float]:
    """(fixed_us, per_request_us) of consumer; fixed_us < 0 when it has none."""

LEDGER_ANY_SIZE: int = 4294967295

class Ledger:
    def __init__(self, pool: Pool, consumer: int) -> None: ...

    def __len__(self) -> int: ...

    def pull(self, max_n: int, timeout_us: int, spin_us: int = 50) -> list[float]:
        """
        Queue copies of up to max_n delivered records (waiting up to timeout_us); their completion times in ms.
        """

    def first_ns(self, i: int) -> int: ...

    def set_first_ns(self, i: int, ns: int) -> None: ...

    def deadline_ms(self, i: int, default_ms: float) -> float: ...

    def flags(self, i: int) -> int: ...

    def expire(self, now_ns: int, default_ms: float, need_ms: float, timeout_us: int) -> int: ...

    def fail_head(self, k: int, status: int, timeout_us: int) -> int: ...

    def take(self, k: int, row_bytes: int, dtype_ok: Annotated[NDArray[numpy.uint8], dict(shape=(None,), order='C', device='cpu', writable=False)], timeout_us: int, recs_out: Annotated[NDArray[numpy.uint32], dict(shape=(None,), order='C', device='cpu')], rows: Annotated[NDArray[numpy.uint8], dict(shape=(None, None), order='C', device='cpu')] | None = None) -> int:
        """
        Take the oldest k queued requests as the current batch (bodies that are not row_bytes of a dtype dtype_ok allows are answered BAD_REQUEST; row_bytes LEDGER_ANY_SIZE takes any size, without rows); its record indices go to recs_out and, with rows, its payloads to rows (the CPU gather). Its size.
        """

    def batch_recs(self) -> Annotated[NDArray[numpy.uint32], dict(shape=(None,), writable=False)]:
        """
        The current batch's record indices (a read-only view, valid until the next take).
        """

    def batch_records(self) -> Annotated[NDArray[numpy.uint8], dict(shape=(None, None), writable=False)]:
        """
        The current batch's record copies as bytes (a read-only view, valid until the next take).
        """

    def answer_batch(self, body: Annotated[NDArray[numpy.uint8], dict(shape=(None, None), order='C', device='cpu', writable=False)], dtype: int, default_ms: float, timeout_us: int, lat_ms: Annotated[NDArray[numpy.float64], dict(shape=(None,), order='C', device='cpu')], compute_s: float, bounds: Annotated[NDArray[numpy.float64], dict(shape=(None,), order='C', device='cpu', writable=False)], request: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu')], queue: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu')], compute: Annotated[NDArray[numpy.int64], dict(shape=(None,), order='C', device='cpu')]) -> tuple:
        """
        Answer the current batch OK with one row each, each latency (ms) to lat_ms and each request counted in the request, queue and compute histograms over bounds (seconds): (answered within their deadline, done_ns, the oldest request's first_ns and complete_ns, and the three histograms' added sums).
        """

    def clear_batch(self) -> None: ...
