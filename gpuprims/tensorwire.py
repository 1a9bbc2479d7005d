"""The multi-tensor body: several named tensors of any numeric datatype in one request or answer.

A v1 datagram whose header says ``dtype = 5`` (``wire.DType.TENSORS``) carries this body instead of one
bare tensor: a model's named inputs in a request, its named outputs in an answer. The layout, byte by
byte, is in docs/wire-format.md ("Multi-tensor bodies (dtype 5)"); in short, all little-endian:

- body header (8 bytes): ``magic`` u32 ``0x42545047`` (``G P T B``), ``version`` u8 ``1``, ``flags``
  u8 ``0``, ``count`` u16 (tensors that follow, at most :data:`MAX_TENSORS`);
- per tensor: a 16-byte header (``name_len`` u16, ``datatype`` u8 = ``DataType.code``, ``ndim`` u8,
  ``reserved`` u32 ``0``, ``data_len`` u64), ``ndim`` dimensions (u64 each), the UTF-8 name, zero
  padding to a multiple of 8, the data (C order), zero padding to a multiple of 8.

Every tensor's data starts at a multiple of 8 bytes from the body's start, so :func:`decode` returns
views into the body without copying (a body whose own start is not aligned for a datatype is the one
case copied). BF16 travels as its raw 16 bits: the array is ``uint16`` and the datatype BF16. BYTES
tensors (strings) are not supported yet: both directions refuse them.

Importing this module imports numpy only.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import numpy as np

from gpuprims.tensors import DataType

MAGIC = 0x42545047  # the bytes b"GPTB" little-endian
VERSION = 1
BODY_HEADER_SIZE = 8
TENSOR_HEADER_SIZE = 16
ALIGN = 8
MAX_TENSORS = 1024
MAX_NDIM = 16
MAX_NAME_BYTES = 255
#: Largest product of a tensor's non-zero dimensions times its item size. A body's total_len is a u32,
#: so no tensor with data is larger; bounding empty tensors' shapes the same way keeps them inside what
#: numpy can represent (it refuses a shape such as (0, 2**32, 2**32) outright).
MAX_SHAPE_BYTES = 2**32 - 1

_BODY = struct.Struct("<IBBH")
_TENSOR = struct.Struct("<HBBIQ")
assert _BODY.size == BODY_HEADER_SIZE and _TENSOR.size == TENSOR_HEADER_SIZE
_DIMS = [struct.Struct(f"<{n}Q") for n in range(MAX_NDIM + 1)]
_PAD = bytes(ALIGN)


class TensorBodyError(ValueError):
    """A multi-tensor body (or the tensors given to encode) is malformed; the message says what and
    where (byte offset, tensor index or name)."""


class WireTensor(NamedTuple):
    """One named tensor of a multi-tensor body. ``array.shape`` is the tensor's shape; its dtype is
    ``datatype.numpy`` (``uint16`` for BF16)."""

    name: str
    datatype: DataType
    array: np.ndarray


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _shape_bytes(dims: tuple[int, ...], itemsize: int) -> int:
    return math.prod(d for d in dims if d) * itemsize


def _check_name(name: object, where: str) -> bytes:
    if not isinstance(name, str):
        raise TensorBodyError(f"{where}: a tensor name must be a str, got {type(name).__name__}")
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:
        raise TensorBodyError(f"{where}: tensor name {name!r} is not valid UTF-8 text") from None
    if not raw:
        raise TensorBodyError(f"{where}: a tensor needs a non-empty name")
    if len(raw) > MAX_NAME_BYTES:
        raise TensorBodyError(f"{where}: tensor name of {len(raw)} UTF-8 bytes, at most {MAX_NAME_BYTES}")
    return raw


def _wire_array(t: WireTensor, where: str) -> np.ndarray:
    """The tensor's array as its datatype's little-endian C-contiguous array, or TensorBodyError."""
    if not isinstance(t.datatype, DataType):
        raise TensorBodyError(f"{where}: datatype must be a DataType, got {t.datatype!r}")
    if t.datatype is DataType.BYTES:
        raise TensorBodyError(f"{where}: BYTES tensors are not supported yet")
    arr = np.asarray(t.array)
    want = t.datatype.numpy
    if arr.dtype.newbyteorder("=") != want.newbyteorder("="):
        raise TensorBodyError(f"{where}: array of dtype {arr.dtype} does not hold {t.datatype.value} "
                              f"(numpy {want})")
    if arr.ndim > MAX_NDIM:
        raise TensorBodyError(f"{where}: {arr.ndim} dimensions, at most {MAX_NDIM}")
    if _shape_bytes(arr.shape, want.itemsize) > MAX_SHAPE_BYTES:
        raise TensorBodyError(f"{where}: shape {list(arr.shape)} too large (its non-zero dims span over "
                              f"{MAX_SHAPE_BYTES} bytes)")
    # Big-endian input is byte-swapped; the wire is little-endian whatever the host.
    # astype, not ascontiguousarray: that one turns a 0-d tensor into a 1-d one.
    return arr.astype(want, order="C", copy=False)


def encode(items: Iterable[WireTensor]) -> bytes:
    """The multi-tensor body carrying ``items`` in order.

    Each array must hold its datatype (``datatype.numpy``, any byte order; BF16 as ``uint16``); it is
    copied once, into the body. Raises :class:`TensorBodyError` naming the tensor for a BYTES tensor,
    a dtype that does not match, a repeated or bad name (empty, over 255 UTF-8 bytes), more than 16
    dimensions or more than 1024 tensors.
    """
    parts: list[bytes | memoryview] = []
    seen: set[str] = set()
    count = 0
    for i, t in enumerate(items):
        if count >= MAX_TENSORS:
            raise TensorBodyError(f"more than {MAX_TENSORS} tensors in one body")
        if not isinstance(t, tuple) or len(t) != 3:
            raise TensorBodyError(f"tensor {i}: need a WireTensor(name, datatype, array), got {type(t).__name__}")
        t = WireTensor(*t)
        where = f"tensor {i} {t.name!r}"
        raw = _check_name(t.name, where)
        if t.name in seen:
            raise TensorBodyError(f"{where}: duplicate tensor name")
        seen.add(t.name)
        arr = _wire_array(t, where)
        ndim = arr.ndim
        head = _TENSOR.pack(len(raw), t.datatype.code, ndim, 0, arr.nbytes) + _DIMS[ndim].pack(*arr.shape) + raw
        parts.append(head)
        parts.append(_PAD[:_padded(len(head)) - len(head)])
        if arr.nbytes:
            parts.append(arr.reshape(-1).view(np.uint8))  # join copies it straight from the array
        parts.append(_PAD[:_padded(arr.nbytes) - arr.nbytes])
        count += 1
    return _BODY.pack(MAGIC, VERSION, 0, count) + b"".join(parts)


def encode_arrays(m: Mapping[str, np.ndarray]) -> bytes:
    """The multi-tensor body of ``{name: array}`` in the mapping's order, each tensor's datatype the
    one its numpy dtype carries (``DataType.from_numpy``: a ``uint16`` array is UINT16; send BF16 with
    :func:`encode`). Raises :class:`TensorBodyError` as :func:`encode` does, and for a dtype no
    datatype holds."""
    items = []
    for name, value in m.items():
        arr = np.asarray(value)
        try:
            # Little-endian first: from_numpy knows the host's order only, and big-endian arrays are
            # welcome (encode swaps them).
            dt = DataType.from_numpy(arr.dtype.newbyteorder("<"))
        except ValueError as e:
            raise TensorBodyError(f"tensor {name!r}: {e}") from None
        items.append(WireTensor(name, dt, arr))
    return encode(items)


def _as_bytes_array(body: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """The body as a 1-D uint8 array over the same memory (a copy only for a non-contiguous buffer)."""
    if isinstance(body, np.ndarray):
        arr = body if body.flags.c_contiguous else np.ascontiguousarray(body)
        return arr.reshape(-1).view(np.uint8)
    view = memoryview(body)
    if not view.c_contiguous:
        return np.frombuffer(view.tobytes(), np.uint8)
    return np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view, np.uint8)


def decode(body: bytes | bytearray | memoryview | np.ndarray) -> list[WireTensor]:
    """The tensors of a multi-tensor body, in the body's order.

    Each array is a read-only view into ``body`` (it keeps ``body`` alive) of its datatype's numpy
    dtype and shape; only where ``body`` itself starts at an address not aligned for a datatype is
    that tensor copied. Never reads outside ``body``; raises :class:`TensorBodyError` saying what is
    malformed and at which byte: truncated, bad magic or version, unknown or BYTES datatype code, too
    many tensors or dimensions, a name that is empty or not UTF-8, a duplicate name, a data length
    that disagrees with the shape, padding or reserved bytes not zero, bytes after the last tensor,
    a BOOL byte other than 0 or 1.
    """
    buf = _as_bytes_array(body)
    size = buf.size
    if size < BODY_HEADER_SIZE:
        raise TensorBodyError(f"truncated: {size} bytes, a multi-tensor body starts with {BODY_HEADER_SIZE}")
    magic, version, flags, count = _BODY.unpack_from(buf, 0)
    if magic != MAGIC:
        raise TensorBodyError(f"bad magic 0x{magic:08x} (a multi-tensor body starts with 0x{MAGIC:08x}, 'GPTB')")
    if version != VERSION:
        raise TensorBodyError(f"unsupported multi-tensor body version {version} (this side reads {VERSION})")
    if flags != 0:
        raise TensorBodyError(f"body flags 0x{flags:02x}, must be 0")
    if count > MAX_TENSORS:
        raise TensorBodyError(f"{count} tensors, at most {MAX_TENSORS}")
    out: list[WireTensor] = []
    seen: set[str] = set()
    off = BODY_HEADER_SIZE
    for i in range(count):
        where = f"tensor {i} at byte {off}"
        if size - off < TENSOR_HEADER_SIZE:
            raise TensorBodyError(f"truncated: {where} needs a {TENSOR_HEADER_SIZE}-byte header, "
                                  f"{size - off} bytes left")
        name_len, code, ndim, reserved, data_len = _TENSOR.unpack_from(buf, off)
        if reserved != 0:
            raise TensorBodyError(f"{where}: reserved header bytes not zero")
        if ndim > MAX_NDIM:
            raise TensorBodyError(f"{where}: {ndim} dimensions, at most {MAX_NDIM}")
        if not 1 <= name_len <= MAX_NAME_BYTES:
            raise TensorBodyError(f"{where}: name of {name_len} bytes, must be 1..{MAX_NAME_BYTES}")
        try:
            datatype = DataType.from_code(code)
        except ValueError:
            raise TensorBodyError(f"{where}: unknown datatype code {code}") from None
        if datatype is DataType.BYTES:
            raise TensorBodyError(f"{where}: BYTES tensors are not supported yet")
        head_end = off + TENSOR_HEADER_SIZE + 8 * ndim + name_len
        if head_end > size:
            raise TensorBodyError(f"truncated: {where} needs {head_end - off} bytes of header, dims and "
                                  f"name, {size - off} left")
        dims = _DIMS[ndim].unpack_from(buf, off + TENSOR_HEADER_SIZE)
        raw = buf[head_end - name_len:head_end].tobytes()
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise TensorBodyError(f"{where}: name is not UTF-8 ({raw[:32]!r})") from None
        where = f"tensor {i} {name!r} at byte {off}"
        if name in seen:
            raise TensorBodyError(f"{where}: duplicate tensor name")
        seen.add(name)
        if _shape_bytes(dims, datatype.itemsize) > MAX_SHAPE_BYTES:
            raise TensorBodyError(f"{where}: shape {list(dims)} too large (its non-zero dims span over "
                                  f"{MAX_SHAPE_BYTES} bytes)")
        want = math.prod(dims) * datatype.itemsize
        if data_len != want:
            raise TensorBodyError(f"{where}: length mismatch: {data_len} data bytes, shape {list(dims)} of "
                                  f"{datatype.value} takes {want}")
        data_off = off + _padded(head_end - off)
        end = data_off + _padded(data_len)
        if end > size:
            raise TensorBodyError(f"truncated: {where} needs {end - off} bytes with its data, {size - off} left")
        if buf[head_end:data_off].any() or buf[data_off + data_len:end].any():
            raise TensorBodyError(f"{where}: padding bytes not zero")
        arr = buf[data_off:data_off + data_len].view(datatype.numpy).reshape(dims)
        if datatype is DataType.BOOL and data_len and buf[data_off:data_off + data_len].max() > 1:
            raise TensorBodyError(f"{where}: BOOL data holds bytes other than 0 and 1")
        if not arr.flags.aligned:  # only when the body's own start is misaligned for this datatype
            arr = arr.copy()
        arr.flags.writeable = False
        out.append(WireTensor(name, datatype, arr))
        off = end
    if off != size:
        raise TensorBodyError(f"{size - off} bytes after the last of {count} tensors (byte {off} of {size})")
    return out


def decode_arrays(body: bytes | bytearray | memoryview | np.ndarray) -> dict[str, np.ndarray]:
    """``{name: array}`` of :func:`decode` (BF16 stays its ``uint16`` bits; the datatypes are dropped)."""
    return {t.name: t.array for t in decode(body)}
