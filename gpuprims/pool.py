"""Shared-memory packet pool: the slots datagrams land in, and the queues of complete requests.

The pool is one POSIX shared-memory object (layout in ``native/include/gpuprims/pool.h``) that the
ingest creates and every app instance maps by name. The native ingest receives datagrams straight
into its fixed-size slots, reassembles requests and pushes the index of each complete request's
record to the ring of a consumer (an app instance). The consumer copies the payloads into a batch
(``gather``; on CUDA, GPU-DMA reads the slots directly) and answers each request by publishing its
status and result to its answer ring (``Consumer.answer``): the ingest sends the response and recycles
the slots. The ingest is the only sender, so a request gets one answer even if its consumer dies
mid-batch (an answer published before is sent; the rest are requeued or answered INSTANCE_FAILED). An active and a shadow instance can both reach every packet, which is what makes
Overlapped-Execution switch without copying or losing requests.
"""

from __future__ import annotations

import os
import secrets
import weakref
from typing import Any

import numpy as np

from gpuprims import _native
from gpuprims.wire import DType, Status

#: numpy dtype of one request record (a copy of the native Record, 128 bytes).
RECORD_DTYPE = np.dtype(
    {
        "names": [
            "state", "owner", "app_id", "dtype", "addr_len", "chunk_count", "chunks_received", "stride",
            "total_len", "deadline_us", "generation", "request_id", "client_ts_ns", "first_ns", "complete_ns",
            "addr", "flags",
        ],
        "formats": ["<u4", "<u4", "<u2", "u1", "u1", "<u4", "<u4", "<u4", "<u4", "<u4", "<u4", "<u8", "<u8",
                    "<u8", "<u8", ("u1", 28), "u1"],
        "offsets": [0, 4, 8, 10, 11, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 72, 100],
        "itemsize": 128,
    }
)

#: A record as an opaque item of RECORD_DTYPE's size (see PacketPool.requests).
_RAW_RECORD = np.dtype((np.void, RECORD_DTYPE.itemsize))

REC_FREE, REC_FILLING, REC_DELIVERED = 0, 1, 2

#: ``row_bytes`` for :meth:`LocalQueue.take` that takes bodies of any length (multi-tensor bodies, whose
#: size varies per request); the dtype check still applies and ``rows`` must be None (no row to copy to).
ANY_SIZE: int = _native.LEDGER_ANY_SIZE


def _fresh_name() -> str:
    return f"/gpuprims-{os.getpid()}-{secrets.token_hex(4)}"


class PacketPool:
    """A mapping of the shared packet pool, created (and unlinked on close) or attached by name.

    Use :meth:`create` in the process that runs the ingest and :meth:`attach` in app instances.
    ``close()`` (or leaving a ``with`` block) unmaps it; the creator also removes the name.
    """

    def __init__(self, native: Any) -> None:
        self._native = native
        self._records = native.region("records").view(RECORD_DTYPE)
        # The same records as opaque 128-byte items: copying those is one memcpy each, where a copy of
        # the structured dtype (explicit offsets) goes field by field (about 5x slower per request).
        self._records_raw = self._records.view(_RAW_RECORD)
        # A dropped pool unmaps (and, for the creator, unlinks) even without close().
        self._finalizer = weakref.finalize(self, PacketPool._finalize, native)

    @staticmethod
    def _finalize(native: Any) -> None:
        native.close()

    @classmethod
    def create(cls, *, slot_count: int = 65536, max_payload: int = 1024, record_count: int = 1024,
               max_chunks: int = 1024, consumer_count: int = 8, answer_ring_bytes: int = 1 << 20,
               name: str | None = None) -> PacketPool:
        """Create a new pool. ``max_payload`` is the largest datagram payload a slot holds (bytes).

        A request of N chunks needs N free slots; ``max_chunks`` bounds N (a 224x224x3 float32 image in
        1 KiB chunks is 588). ``consumer_count`` is how many consumer endpoints (instances) it serves.
        ``answer_ring_bytes`` (a power of two) is each consumer's answer ring; one result may take at
        most half of it.
        """
        for key, val, lo in (("slot_count", slot_count, 1), ("max_payload", max_payload, 1),
                             ("record_count", record_count, 1), ("max_chunks", max_chunks, 1),
                             ("consumer_count", consumer_count, 1), ("answer_ring_bytes", answer_ring_bytes, 1)):
            if not isinstance(val, int) or val < lo:
                raise ValueError(f"{key} must be a positive integer, got {val!r}")
        name = name or _fresh_name()
        return cls(_native.Pool.create(name, slot_count, max_payload, record_count, max_chunks, consumer_count,
                                       answer_ring_bytes))

    @classmethod
    def attach(cls, name: str) -> PacketPool:
        """Map an existing pool by name (in another process). Raises RuntimeError if there is none."""
        return cls(_native.Pool.attach(name))

    # -- description -------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return str(self._native.name)

    @property
    def owner(self) -> bool:
        return bool(self._native.owner)

    @property
    def address(self) -> int:
        """Base address of the mapping in this process (for cudaHostRegister / GPU-DMA)."""
        return int(self._native.address)

    @property
    def nbytes(self) -> int:
        return int(self._native.nbytes)

    @property
    def layout(self) -> dict[str, int]:
        """Sizes and region offsets of the mapping (see pool.h)."""
        return dict(self._native.layout())

    @property
    def native(self) -> Any:
        """The private native object (for other native primitives such as GPU-DMA)."""
        return self._native

    def region(self, which: str) -> np.ndarray:
        """A uint8 view of 'slots', 'records' or 'chunkmap' (valid while the pool is open)."""
        return self._native.region(which)

    @property
    def closed(self) -> bool:
        return bool(self._native.closed)

    # -- consumers ---------------------------------------------------------------------------------
    def consumer(self, index: int) -> Consumer:
        """The consumer endpoint ``index`` (an app instance's queue)."""
        if not 0 <= index < self.layout["consumer_count"]:
            raise ValueError(f"consumer index {index} out of range 0..{self.layout['consumer_count'] - 1}")
        return Consumer(self, index)

    def requests(self, recs: np.ndarray) -> np.ndarray:
        """Copies of the records ``recs`` (RECORD_DTYPE): ids, sizes, client address, timestamps."""
        return self._records_raw.take(np.asarray(recs, dtype=np.intp)).view(RECORD_DTYPE)

    def peek(self, consumer: int, from_pos: int = 0, max_n: int | None = None) -> tuple[np.ndarray, int, int]:
        """Look at consumer ``consumer``'s queue without taking anything: ``(recs, head, tail)``.

        ``recs`` are the record indices at ring positions ``max(from_pos, head)`` onwards (at most
        ``max_n``, default the ring capacity), in delivery order; ``head`` is the position of the
        next request the consumer will take and ``tail`` one past the last delivered. Positions only
        grow, so passing the last ``tail`` as ``from_pos`` returns just the new arrivals. Read-only:
        the orchestrator's scheduler uses it to see queues it does not consume.
        """
        cap = self.layout["ring_capacity"]
        out = np.empty(cap if max_n is None else max(0, min(max_n, cap)), dtype=np.uint32)
        n, head, tail = self.native.peek(consumer, max(0, int(from_pos)), out)
        return out[:n], int(head), int(tail)

    def gather(self, recs: np.ndarray, out: Any) -> Any:
        """Copy each request's payload into row i of ``out`` (numpy array or CPU torch tensor).

        Each row must have exactly the request's byte size. Raises ValueError naming the request
        otherwise. This is the CPU equivalent of GPU-DMA.
        """
        recs = np.ascontiguousarray(recs, dtype=np.uint32)
        if hasattr(out, "numpy") and not isinstance(out, np.ndarray):  # torch tensor
            if out.device.type != "cpu" or not out.is_contiguous():
                raise ValueError("gather needs a contiguous CPU tensor")
            target = out.numpy()  # shares memory with the tensor
        else:
            target = out
        if not isinstance(target, np.ndarray) or not target.flags.c_contiguous:
            raise ValueError("gather needs a C-contiguous numpy array or CPU tensor")
        if target.ndim == 0 or target.shape[0] < recs.size:
            raise ValueError(f"gather output needs at least {recs.size} rows, got shape {target.shape}")
        self._native.gather(recs, target.reshape(target.shape[0], -1).view(np.uint8))
        return out

    def close(self) -> None:
        """Unmap the pool (and remove its name if this process created it)."""
        self._records = np.empty(0, RECORD_DTYPE)
        self._records_raw = self._records.view(_RAW_RECORD)
        self._finalizer()

    def __enter__(self) -> PacketPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.nbytes / 2**20:.1f} MiB"
        return f"PacketPool({self.name!r}, {state})"


class Consumer:
    """One consumer endpoint: polls complete requests and releases them when done."""

    def __init__(self, pool: PacketPool, index: int) -> None:
        self.pool = pool
        self.index = index
        self._buf = np.empty(pool.layout["ring_capacity"], dtype=np.uint32)
        pool.native.set_attached(index, os.getpid())

    def poll(self, max_n: int = 32, timeout_ms: float = 100.0, *, spin_us: int = 50) -> np.ndarray:
        """Record indices of up to ``max_n`` complete requests, waiting up to ``timeout_ms``.

        Waits on a futex after a ``spin_us`` spin, so an idle consumer costs no core. Returns an
        empty array on timeout. ``timeout_ms < 0`` waits until something arrives.
        """
        if max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {max_n}")
        out = self._buf[: min(max_n, self._buf.size)]
        timeout_us = -1 if timeout_ms < 0 else int(timeout_ms * 1000)
        n = self.pool.native.poll(self.index, out, timeout_us, spin_us)
        return out[:n].copy()

    def answer(self, recs: np.ndarray, info: np.ndarray, statuses: np.ndarray | int,
               body: np.ndarray | None = None, *, timeout_s: float = 5.0, dtype: DType | None = None) -> None:
        """Answer requests: the ingest sends each one's response and recycles its record.

        ``info`` is what :meth:`PacketPool.requests` returned for ``recs`` when they were polled (its
        generations tell a request from a later one in the same record), ``statuses`` one Status per
        request (or one for all), ``body`` one result row per request (sent only with OK), whose wire
        dtype is ``dtype`` when given (else the one of its numpy dtype, or BYTES). Each answer
        is published with one store, so a request is answered once even if this process dies halfway:
        the ingest sends what was published and takes back the rest.

        Raises ValueError if a result row can never fit the answer ring, RuntimeError if the ingest
        took nothing for ``timeout_s`` (it is gone or stuck).
        """
        recs = np.ascontiguousarray(recs, dtype=np.uint32)
        n = recs.size
        if info.dtype != RECORD_DTYPE or info.shape != (n,):
            raise ValueError("info must be the records PacketPool.requests() returned for recs")
        if n == 0:
            return
        st = (np.full(n, int(statuses), np.uint16) if np.isscalar(statuses)
              else np.ascontiguousarray(statuses, np.uint16))
        if st.shape != (n,):
            raise ValueError(f"need {n} statuses, got shape {st.shape}")
        rows = None
        given, dtype = dtype, (DType.BYTES if dtype is None else dtype)
        if body is not None:
            body = np.ascontiguousarray(body)
            if body.shape[0] != n:
                raise ValueError(f"need {n} body rows, got {body.shape[0]}")
            if given is None:
                try:
                    dtype = DType.from_numpy(body.dtype)
                except ValueError:
                    dtype = DType.BYTES
            rows = body.reshape(n, -1).view(np.uint8)
        gens = np.ascontiguousarray(info["generation"], dtype=np.uint32)
        done = self.pool.native.answer(self.index, recs, gens, st, rows, int(dtype), int(timeout_s * 1e6))
        if done != n:
            raise RuntimeError(f"the ingest took no answers of consumer {self.index} for {timeout_s:g} s "
                               f"({done} of {n} published): it is gone or stuck")

    def answer_status(self, recs: np.ndarray, info: np.ndarray, status: Status) -> None:
        """Answer every request in ``recs`` with ``status`` and no body."""
        self.answer(recs, info, int(status))

    def release(self, recs: np.ndarray) -> None:
        """Give records back to the ingest unanswered; it recycles their slots (no response is sent)."""
        recs = np.ascontiguousarray(recs, dtype=np.uint32)
        done = self.pool.native.release(self.index, recs)
        if done != recs.size:
            raise RuntimeError(f"release ring of consumer {self.index} full after {done} of {recs.size}: "
                               "records were released more than once")

    def depth(self) -> int:
        """Complete requests waiting in this consumer's queue."""
        return int(self.pool.native.queue_depth(self.index))


class LocalQueue:
    """A serving loop's local queue of one consumer, and its per-batch bookkeeping, in native code.

    It holds copies of the records polled from the consumer's ring, oldest first, and answers through
    the consumer's answer ring. Each step of a batch is one native call (issue 26): :meth:`pull`
    (poll and copy), :meth:`expire` (answer DEADLINE_MISSED at the head), :meth:`fail_head`,
    :meth:`take` (the next batch; bodies that are not the app's input are answered BAD_REQUEST) and
    :meth:`answer_batch` (OK with the results; each latency written to ``lat_ms`` and counted in the
    request, queue and compute duration histograms' count arrays, whose added sums it returns). The batch's
    records are :meth:`batch_recs` and :meth:`batch_info` (views valid until the next :meth:`take`).

    A request leaves the queue only with its answer published, or into the current batch, which the
    caller answers (:meth:`answer_batch`, or :meth:`Consumer.answer` on the batch's views, then
    :meth:`clear_batch`). If the process dies, the ingest answers what it held (INSTANCE_FAILED or a
    requeue), so each request is answered once. Not thread-safe: one serving thread owns it.

    ``timeout_us`` arguments bound the wait for room in the answer ring; RuntimeError if the ingest
    took nothing for that long (it is gone or stuck), ValueError if a result row can never fit it.
    """

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self._native = _native.Ledger(consumer.pool.native, consumer.index)
        n = self._native
        # The native methods themselves (no Python frame per call on the hot path).
        self.pull = n.pull  #: pull(max_n, timeout_us, spin_us=50) -> completion times (ms) of those queued
        self.expire = n.expire  #: expire(now_ns, default_ms, need_ms, timeout_us) -> how many answered
        self.fail_head = n.fail_head  #: fail_head(k, status, timeout_us) -> how many answered
        #: take(k, row_bytes, dtype_ok[256] uint8, timeout_us, recs_out, rows=None) -> batch size;
        #: row_bytes ANY_SIZE takes bodies of any length (rows None then)
        self.take = n.take
        #: answer_batch(body, dtype, default_ms, timeout_us, lat_ms, compute_s, bounds, request, queue, compute)
        self.answer_batch = n.answer_batch
        self.batch_recs = n.batch_recs  #: the current batch's record indices (uint32 view)
        self.clear_batch = n.clear_batch  #: forget the current batch (answered another way)
        self.first_ns = n.first_ns  #: first_ns(i): arrival (CLOCK_MONOTONIC ns) of queued request i
        self.set_first_ns = n.set_first_ns  #: set_first_ns(i, ns): re-time queued request i
        self.deadline_ms = n.deadline_ms  #: deadline_ms(i, default_ms): its deadline after arrival
        self.flags = n.flags  #: flags(i): its wire flags (``gpuprims.wire.FLAG_MORE``: more of its query follow)

    def __len__(self) -> int:
        return len(self._native)

    def __bool__(self) -> bool:
        return len(self._native) > 0

    def batch_info(self) -> np.ndarray:
        """The current batch's records (RECORD_DTYPE view, valid until the next :meth:`take`)."""
        return self._native.batch_records().view(RECORD_DTYPE).reshape(-1)
