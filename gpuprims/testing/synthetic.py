"""A packet-pool memory image with the layout of ``native/include/gpuprims/pool.h``, filled with
requests as the ingest would leave them (datagrams in slots, chunk map, delivered records).

For tests and benchmarks of GPU-DMA and its baseline without running the ingest: it is page-aligned
anonymous memory, so it can be registered with cudaHostRegister like the real pool. It has the
attributes :class:`gpuprims.cuda.dma.PoolLayout` reads from a pool (``address``, ``nbytes``,
``layout``).
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import numpy as np

from gpuprims import wire

PAGE = 4096
RECORD_SIZE = 128
STATE_FREE = 0
STATE_FILLING = 1
STATE_DELIVERED = 2

#: One pool Record (pool.h), as numpy sees it.
RECORD_DTYPE = np.dtype({
    "names": ["state", "owner", "app_id", "dtype", "addr_len", "chunk_count", "chunks_received", "stride",
              "total_len", "deadline_us", "generation", "request_id", "client_ts_ns", "first_ns", "complete_ns"],
    "formats": ["<u4", "<u4", "<u2", "u1", "u1", "<u4", "<u4", "<u4", "<u4", "<u4", "<u4", "<u8", "<u8", "<u8",
                "<u8"],
    "offsets": [0, 4, 8, 10, 11, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64],
    "itemsize": RECORD_SIZE,
})


def _align(v: int, a: int) -> int:
    return (v + a - 1) // a * a


class SyntheticPool:
    """Pool memory with `slot_count` slots of `max_payload` bytes of payload, `record_count` records
    of up to `max_chunks` chunks. Slots are handed out in a random order (seeded), so the packets of
    a request are scattered and out of order in memory, as they are after real reception."""

    def __init__(self, *, slot_count: int = 4096, max_payload: int = 1024, record_count: int = 64,
                 max_chunks: int = 1024, seed: int = 0) -> None:
        for label, v in (("slot_count", slot_count), ("max_payload", max_payload), ("record_count", record_count),
                         ("max_chunks", max_chunks)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{label} must be a positive int, got {v!r}")
        slot_size = _align(wire.HEADER_SIZE + max_payload, 64)
        slots_offset = PAGE
        records_offset = _align(slots_offset + slot_count * slot_size, PAGE)
        chunkmap_offset = _align(records_offset + record_count * RECORD_SIZE, PAGE)
        nbytes = _align(chunkmap_offset + record_count * max_chunks * 4, PAGE)
        self._map = mmap.mmap(-1, nbytes)
        self.buffer = np.frombuffer(self._map, dtype=np.uint8)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.nbytes = nbytes
        self.layout: dict[str, Any] = {
            "slot_size": slot_size, "max_payload": slot_size - wire.HEADER_SIZE, "slot_count": slot_count,
            "slots_offset": slots_offset, "records_offset": records_offset, "record_count": record_count,
            "chunkmap_offset": chunkmap_offset, "max_chunks": max_chunks,
        }
        self.records = self.buffer[records_offset:records_offset + record_count * RECORD_SIZE].view(RECORD_DTYPE)
        self.chunkmap = self.buffer[chunkmap_offset:chunkmap_offset + record_count * max_chunks * 4].view(
            "<u4").reshape(record_count, max_chunks)
        self._rng = np.random.default_rng(seed)
        self._free_slots = list(self._rng.permutation(slot_count).tolist())
        self._free_records = list(range(record_count))

    def slot(self, index: int) -> np.ndarray:
        """The bytes of slot `index` (header then payload)."""
        size = self.layout["slot_size"]
        start = self.layout["slots_offset"] + index * size
        return self.buffer[start:start + size]

    def chunk_slot(self, record: int, chunk: int) -> int:
        """The slot holding chunk `chunk` of record `record`."""
        return int(self.chunkmap[record, chunk])

    def add_request(self, app_id: int, request_id: int, body: np.ndarray | bytes, *,
                    chunk_payload: int | None = None, dtype: int | None = None) -> int:
        """Place one request's datagrams in free slots (scattered), fill its chunk map and mark its
        record delivered, as the ingest does when the last chunk arrives. Returns the record index."""
        chunk_payload = self.layout["max_payload"] if chunk_payload is None else chunk_payload
        if not 0 < chunk_payload <= self.layout["max_payload"]:
            raise ValueError(f"chunk_payload must be in 1..{self.layout['max_payload']}, got {chunk_payload}")
        datagrams = wire.encode_request(app_id, request_id, body, chunk_payload=chunk_payload, dtype=dtype)
        if len(datagrams) > self.layout["max_chunks"]:
            raise ValueError(f"request needs {len(datagrams)} chunks, more than max_chunks={self.layout['max_chunks']}")
        if len(datagrams) > len(self._free_slots) or not self._free_records:
            raise ValueError("pool is full")
        r = self._free_records.pop(0)
        for c, dgram in enumerate(datagrams):
            s = self._free_slots.pop()
            self.slot(s)[:len(dgram)] = np.frombuffer(dgram, dtype=np.uint8)
            self.chunkmap[r, c] = s
        h = wire.unpack_header(datagrams[0])
        rec = self.records[r]
        rec["state"] = STATE_DELIVERED
        rec["app_id"] = app_id
        rec["dtype"] = h.dtype
        rec["chunk_count"] = len(datagrams)
        rec["chunks_received"] = len(datagrams)
        rec["stride"] = h.payload_len
        rec["total_len"] = h.total_len
        rec["request_id"] = request_id
        return r

    def release(self, record: int) -> None:
        """Free a record and its slots for reuse."""
        rec = self.records[record]
        for c in range(int(rec["chunk_count"])):
            self._free_slots.append(int(self.chunkmap[record, c]))
        rec["state"] = STATE_FREE
        rec["chunk_count"] = 0
        self._free_records.append(record)

    def set_header_field(self, record: int, chunk: int, field: str, value: int) -> None:
        """Overwrite one header field of a chunk's datagram in place (to test the checks)."""
        off, code = wire.FIELDS[field]
        dt = np.dtype("<" + {"I": "u4", "B": "u1", "H": "u2", "Q": "u8"}[code])
        slot = self.slot(self.chunk_slot(record, chunk))
        slot[off:off + dt.itemsize] = np.frombuffer(np.array([value], dtype=dt).tobytes(), dtype=np.uint8)

    def close(self) -> None:
        """Unmap the memory (every view of it must be gone, and any PinnedRegion over it closed)."""
        self.records = self.chunkmap = self.buffer = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:
            pass  # a view of it is still alive; the mapping goes when the last one does
