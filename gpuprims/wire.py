"""Wire format v1: datagram header, request chunking and responses.

The layout is defined once for the native code in ``native/include/gpuprims/wire.h``; this module
mirrors it for tools and tests, and ``tests/gpuprims/test_wire.py`` checks the two against each other
(``_native.wire_layout()``). ``docs/wire-format.md`` has the byte-level table.

A request (one tensor, or a multi-tensor body of named tensors: dtype TENSORS, ``gpuprims.tensorwire``)
travels as ``chunk_count`` datagrams, each a 48-byte header followed by a payload chunk. Every chunk but
the last carries ``stride`` bytes (default 1024); the last carries the rest. Responses use the same header with ``kind = KIND_RESPONSE`` and a ``status``.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

MAGIC = 0x4D525047  # b"GPRM" little-endian
VERSION = 1
KIND_REQUEST = 0
KIND_RESPONSE = 1
HEADER_SIZE = 48
DEFAULT_CHUNK_PAYLOAD = 1024
#: Request flag (header ``flags``, native ``wire::kFlagMore``): another request of the same query follows
#: from this client (set on every request of a query but its last, e.g. ``Client.infer_many``). A hint for
#: the instance's batcher (MultiStream); no check rejects a request for its flags.
FLAG_MORE = 1
MAX_DATAGRAM_PAYLOAD = 65507 - HEADER_SIZE  # largest UDP/IPv4 payload less our header

# Field name -> (offset, struct code). The one Python statement of the layout.
FIELDS: dict[str, tuple[int, str]] = {
    "magic": (0, "I"),
    "version": (4, "B"),
    "kind": (5, "B"),
    "status": (6, "H"),
    "app_id": (8, "H"),
    "dtype": (10, "B"),
    "flags": (11, "B"),
    "chunk_index": (12, "I"),
    "chunk_count": (16, "I"),
    "payload_len": (20, "I"),
    "request_id": (24, "Q"),
    "total_len": (32, "I"),
    "deadline_us": (36, "I"),
    "client_ts_ns": (40, "Q"),
}
_STRUCT = struct.Struct("<" + "".join(code for _, code in FIELDS.values()))
assert _STRUCT.size == HEADER_SIZE

#: numpy dtype of the header, for building many headers at once (traffic generation).
HEADER_DTYPE = np.dtype(
    {
        "names": list(FIELDS),
        "formats": ["<" + code.replace("I", "u4").replace("B", "u1").replace("H", "u2").replace("Q", "u8")
                    for _, code in FIELDS.values()],
        "offsets": [off for off, _ in FIELDS.values()],
        "itemsize": HEADER_SIZE,
    }
)


class DType(enum.IntEnum):
    """Element type of a request or response body.

    TENSORS is a multi-tensor body: named tensors of any datatype, encoded and decoded by
    ``gpuprims.tensorwire`` (docs/wire-format.md, "Multi-tensor bodies"); as elements it is bytes.
    """

    BYTES = 0
    FLOAT32 = 1
    UINT8 = 2
    FLOAT16 = 3
    INT64 = 4
    TENSORS = 5

    @property
    def numpy(self) -> np.dtype:
        return _NUMPY_OF[self]

    @classmethod
    def from_numpy(cls, dtype: np.dtype | str) -> DType:
        dt = np.dtype(dtype)
        found = _WIRE_DTYPES.get(dt)
        if found is None:
            raise ValueError(f"no wire dtype for numpy dtype {dt}")
        return found


_NUMPY_OF: dict[DType, np.dtype] = {DType.BYTES: np.dtype(np.uint8), DType.FLOAT32: np.dtype(np.float32),
                                    DType.UINT8: np.dtype(np.uint8), DType.FLOAT16: np.dtype(np.float16),
                                    DType.INT64: np.dtype(np.int64), DType.TENSORS: np.dtype(np.uint8)}

#: numpy dtype -> wire dtype (built once: every answer looks its result's dtype up). TENSORS is never
#: inferred from an array: a uint8 array is UINT8, a multi-tensor body is asked for by name.
_WIRE_DTYPES: dict[np.dtype, DType] = {np.dtype(np.float32): DType.FLOAT32, np.dtype(np.uint8): DType.UINT8,
                                       np.dtype(np.float16): DType.FLOAT16, np.dtype(np.int64): DType.INT64}


class Status(enum.IntEnum):
    """Response status codes."""

    OK = 0
    DEADLINE_MISSED = 1
    OVERLOADED = 2
    INSTANCE_FAILED = 3
    BAD_REQUEST = 4
    UNKNOWN_APP = 5
    INTERNAL = 6
    SHUTTING_DOWN = 7


class Verdict(enum.IntEnum):
    """Stateless check of one request datagram; the native ingest returns the same codes."""

    OK = 0
    TRUNCATED = 1
    BAD_MAGIC = 2
    BAD_VERSION = 3
    BAD_KIND = 4
    BAD_LENGTH = 5
    BAD_CHUNK = 6
    BAD_TOTAL = 7
    BAD_DTYPE = 8


class WireError(ValueError):
    """A datagram that is not a valid v1 datagram; ``verdict`` says why."""

    def __init__(self, verdict: Verdict, detail: str = "") -> None:
        self.verdict = verdict
        super().__init__(f"{verdict.name.lower()}{': ' + detail if detail else ''}")

    def __reduce__(self) -> tuple[type, tuple[Verdict, str]]:
        return (type(self), (self.verdict, str(self).partition(": ")[2]))


@dataclass(frozen=True, slots=True)
class Header:
    """One decoded datagram header."""

    app_id: int
    request_id: int
    chunk_index: int
    chunk_count: int
    payload_len: int
    total_len: int
    kind: int = KIND_REQUEST
    status: int = 0
    dtype: int = DType.BYTES
    flags: int = 0
    deadline_us: int = 0
    client_ts_ns: int = 0
    magic: int = MAGIC
    version: int = VERSION

    def pack(self) -> bytes:
        return _STRUCT.pack(*(getattr(self, name) for name in FIELDS))


def chunk_stride(h: Header) -> int:
    """Payload bytes of every chunk but the last, implied by one chunk's header; 0 if inconsistent."""
    if h.payload_len == 0 or h.total_len == 0 or h.payload_len > h.total_len:
        return 0
    if h.chunk_count == 1:
        return h.payload_len if h.payload_len == h.total_len else 0
    if h.chunk_index + 1 < h.chunk_count:
        need = -(-h.total_len // h.payload_len)
        return h.payload_len if need == h.chunk_count else 0
    rest = h.total_len - h.payload_len
    if rest % (h.chunk_count - 1):
        return 0
    p = rest // (h.chunk_count - 1)
    return p if h.payload_len <= p <= 0xFFFFFFFF else 0


def unpack_header(buf: bytes | memoryview) -> Header:
    """Decode the first 48 bytes of ``buf`` without checking them."""
    if len(buf) < HEADER_SIZE:
        raise WireError(Verdict.TRUNCATED, f"{len(buf)} bytes < {HEADER_SIZE}")
    vals = _STRUCT.unpack_from(buf, 0)
    return Header(**dict(zip(FIELDS, vals)))


def check_request(buf: bytes | memoryview) -> Verdict:
    """The verdict the native ingest gives this datagram (same rules, same order)."""
    if len(buf) < HEADER_SIZE:
        return Verdict.TRUNCATED
    h = unpack_header(buf)
    if h.magic != MAGIC:
        return Verdict.BAD_MAGIC
    if h.version != VERSION:
        return Verdict.BAD_VERSION
    if h.kind != KIND_REQUEST:
        return Verdict.BAD_KIND
    if h.payload_len != len(buf) - HEADER_SIZE:
        return Verdict.BAD_LENGTH
    if h.chunk_count == 0 or h.chunk_index >= h.chunk_count:
        return Verdict.BAD_CHUNK
    if h.dtype > max(DType):
        return Verdict.BAD_DTYPE
    if chunk_stride(h) == 0:
        return Verdict.BAD_TOTAL
    return Verdict.OK


def decode_request(buf: bytes | memoryview) -> tuple[Header, memoryview]:
    """Check and decode one request datagram into its header and payload, or raise WireError."""
    v = check_request(buf)
    if v != Verdict.OK:
        raise WireError(v)
    return unpack_header(buf), memoryview(buf)[HEADER_SIZE:]


def chunk_count_for(total_len: int, chunk_payload: int = DEFAULT_CHUNK_PAYLOAD) -> int:
    """Number of datagrams a body of ``total_len`` bytes takes."""
    if total_len <= 0:
        raise ValueError(f"total_len must be positive, got {total_len}")
    if not 0 < chunk_payload <= MAX_DATAGRAM_PAYLOAD:
        raise ValueError(f"chunk_payload must be in 1..{MAX_DATAGRAM_PAYLOAD}, got {chunk_payload}")
    return -(-total_len // chunk_payload)


def _encode(kind: int, app_id: int, request_id: int, body: bytes | memoryview | np.ndarray, *,
            chunk_payload: int, dtype: int, status: int, deadline_us: int,
            client_ts_ns: int, flags: int = 0) -> list[bytes]:
    data = memoryview(np.ascontiguousarray(body)).cast("B") if isinstance(body, np.ndarray) else memoryview(body)
    total = len(data)
    if not 0 <= app_id <= 0xFFFF:
        raise ValueError(f"app_id must be in 0..65535, got {app_id}")
    if not 0 <= request_id < 2**64:
        raise ValueError(f"request_id must be a u64, got {request_id}")
    if total >= 2**32:
        raise ValueError(f"body of {total} bytes does not fit a u32 total_len")
    if total == 0:
        # An empty body (e.g. an error response) is one datagram with payload_len 0.
        if kind == KIND_REQUEST:
            raise ValueError("a request needs a non-empty body")
        return [_STRUCT.pack(MAGIC, VERSION, kind, status, app_id, dtype, flags, 0, 1, 0, request_id, 0,
                             deadline_us, client_ts_ns)]
    n = chunk_count_for(total, chunk_payload)
    out = []
    for i in range(n):
        piece = data[i * chunk_payload:(i + 1) * chunk_payload]
        hdr = _STRUCT.pack(MAGIC, VERSION, kind, status, app_id, dtype, flags, i, n, len(piece), request_id,
                           total, deadline_us, client_ts_ns)
        out.append(hdr + bytes(piece))
    return out


def encode_request(app_id: int, request_id: int, body: bytes | memoryview | np.ndarray, *,
                   chunk_payload: int = DEFAULT_CHUNK_PAYLOAD, dtype: int | None = None,
                   deadline_us: int = 0, client_ts_ns: int = 0, flags: int = 0) -> list[bytes]:
    """Split one request body into its datagrams, in chunk order.

    ``dtype`` defaults to the wire type of ``body`` when it is a numpy array, else BYTES. ``flags`` is
    the header's flags byte (`FLAG_MORE`), the same in every datagram.
    """
    if dtype is None:
        dtype = DType.from_numpy(body.dtype) if isinstance(body, np.ndarray) else DType.BYTES
    if not 0 <= deadline_us < 2**32:
        raise ValueError(f"deadline_us must be a u32, got {deadline_us}")
    if isinstance(flags, bool) or not isinstance(flags, int) or not 0 <= flags <= 0xFF:
        raise ValueError(f"flags must be a u8, got {flags!r}")
    return _encode(KIND_REQUEST, app_id, request_id, body, chunk_payload=chunk_payload, dtype=int(dtype),
                   status=0, deadline_us=deadline_us, client_ts_ns=client_ts_ns, flags=flags)


def encode_response(app_id: int, request_id: int, status: int, body: bytes | np.ndarray = b"", *,
                    chunk_payload: int = DEFAULT_CHUNK_PAYLOAD, dtype: int | None = None,
                    client_ts_ns: int = 0) -> list[bytes]:
    """Datagrams of one response: status plus an optional result body, echoing ``client_ts_ns``."""
    if dtype is None:
        dtype = DType.from_numpy(body.dtype) if isinstance(body, np.ndarray) else DType.BYTES
    return _encode(KIND_RESPONSE, app_id, request_id, body, chunk_payload=chunk_payload, dtype=int(dtype),
                   status=int(status), deadline_us=0, client_ts_ns=client_ts_ns)


def check_response(buf: bytes | memoryview) -> Header:
    """Decode one response datagram, raising WireError if it is not a valid v1 response."""
    h = unpack_header(buf)
    if h.magic != MAGIC:
        raise WireError(Verdict.BAD_MAGIC)
    if h.version != VERSION:
        raise WireError(Verdict.BAD_VERSION)
    if h.kind != KIND_RESPONSE:
        raise WireError(Verdict.BAD_KIND)
    if h.payload_len != len(buf) - HEADER_SIZE:
        raise WireError(Verdict.BAD_LENGTH)
    if h.chunk_count == 0 or h.chunk_index >= h.chunk_count:
        raise WireError(Verdict.BAD_CHUNK)
    if h.total_len and chunk_stride(h) == 0:
        raise WireError(Verdict.BAD_TOTAL)
    return h


@dataclass(slots=True)
class Response:
    """One reassembled response."""

    app_id: int
    request_id: int
    status: int
    dtype: int
    client_ts_ns: int
    body: bytes

    def array(self) -> np.ndarray:
        """The body as a 1-D numpy array of its wire dtype."""
        return np.frombuffer(self.body, dtype=DType(self.dtype).numpy)


class ResponseAssembler:
    """Reassembles response datagrams (any order) into Responses. Keyed by (app_id, request_id)."""

    def __init__(self) -> None:
        self._partial: dict[tuple[int, int], tuple[Header, dict[int, bytes]]] = {}

    def feed(self, datagram: bytes | memoryview) -> Response | None:
        """Add one datagram; return the Response it completes, if any. Raises WireError if invalid."""
        h = check_response(datagram)
        payload = bytes(memoryview(datagram)[HEADER_SIZE:])
        if h.chunk_count == 1:
            return Response(h.app_id, h.request_id, h.status, h.dtype, h.client_ts_ns, payload)
        key = (h.app_id, h.request_id)
        first, parts = self._partial.setdefault(key, (h, {}))
        if (first.chunk_count, first.total_len) != (h.chunk_count, h.total_len):
            raise WireError(Verdict.BAD_TOTAL, "chunk disagrees with earlier chunks of the response")
        parts[h.chunk_index] = payload
        if len(parts) < h.chunk_count:
            return None
        del self._partial[key]
        body = b"".join(parts[i] for i in range(h.chunk_count))
        return Response(h.app_id, h.request_id, h.status, h.dtype, h.client_ts_ns, body)

    def pending(self) -> int:
        return len(self._partial)

    def forget(self, app_id: int, request_id: int) -> bool:
        """Drop the incomplete response of one request (e.g. after its client gave up); True if any."""
        return self._partial.pop((app_id, request_id), None) is not None

    def drop_pending(self) -> Iterator[tuple[int, int]]:
        """Forget every incomplete response, yielding their keys."""
        keys = list(self._partial)
        self._partial.clear()
        yield from keys
