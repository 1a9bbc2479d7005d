from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuprims import tensorwire as tw
from gpuprims.tensors import DataType
from gpuprims.tensorwire import TensorBodyError, WireTensor, decode, decode_arrays, encode, encode_arrays

NUMERIC = [d for d in DataType if d.numeric]
NAMES = ["x", "input 0", "été/ü", "日本語 テンソル", "a" * 255, "with\ttab", "🙂"]


def _values(dt: DataType, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    want = dt.numpy
    if dt is DataType.BOOL:
        return rng.integers(0, 2, shape).astype(np.bool_)
    if want.kind == "f":
        return rng.standard_normal(shape).astype(want)
    info = np.iinfo(want)
    return rng.integers(info.min, info.max, shape, dtype=want, endpoint=True)


def _same(a: WireTensor, b: WireTensor) -> None:
    assert (a.name, a.datatype) == (b.name, b.datatype)
    assert b.array.shape == np.asarray(a.array).shape and b.array.dtype == a.datatype.numpy
    np.testing.assert_array_equal(b.array, a.array)


@pytest.mark.parametrize("dt", NUMERIC, ids=lambda d: d.value)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (3, 5), (2, 0, 4), (1, 1, 1, 1, 3)], ids=str)
def test_round_trip_every_numeric_datatype_and_shape(dt: DataType, shape: tuple[int, ...]) -> None:
    t = WireTensor("t", dt, _values(dt, shape, len(shape)))
    body = encode([t])
    assert len(body) % tw.ALIGN == 0
    (got,) = decode(body)
    _same(t, got)


def test_round_trip_many_tensors_keeps_order_names_and_aligned_read_only_views() -> None:
    items = [WireTensor(f"{NAMES[i % len(NAMES)][:250]}{i}", dt, _values(dt, (i % 3 + 1, i % 5), i))
             for i, dt in enumerate(NUMERIC)]  # some empty (i % 5 == 0)
    body = encode(items)
    got = decode(body)
    assert [t.name for t in got] == [t.name for t in items]
    base = np.frombuffer(body, np.uint8).ctypes.data
    for want, t in zip(items, got):
        _same(want, t)
        assert t.array.flags.aligned and not t.array.flags.writeable
        if t.array.nbytes:  # a view into the body (zero-copy), its data 8-aligned within it
            offset = t.array.ctypes.data - base
            assert 0 < offset < len(body) and offset % tw.ALIGN == 0
        with pytest.raises(ValueError):
            t.array[...] = 0


def test_bf16_travels_as_its_uint16_bits() -> None:
    bits = np.array([0x3F80, 0xC000, 0x7FC0, 0], np.uint16)  # 1.0, -2.0, NaN, 0
    (got,) = decode(encode([WireTensor("h", DataType.BF16, bits)]))
    assert got.datatype is DataType.BF16 and got.array.dtype == np.uint16
    np.testing.assert_array_equal(got.array, bits)
    # encode_arrays infers from numpy: uint16 is UINT16, never BF16.
    (u,) = decode(encode_arrays({"h": bits}))
    assert u.datatype is DataType.UINT16


def test_encode_arrays_infers_datatypes_and_takes_any_layout_and_byte_order() -> None:
    big = np.arange(12, dtype=">i4").reshape(3, 4)[:, ::2]  # big-endian, not contiguous
    m = {"f": np.float16([1.5, -2]), "b": np.array([True, False]), "big": big, "u64": np.uint64([2**64 - 1]),
         "scalar": np.float64(3.25)}
    got = decode_arrays(encode_arrays(m))
    assert list(got) == list(m)
    for k, v in m.items():
        np.testing.assert_array_equal(got[k], v)
    assert got["big"].dtype == np.dtype("<i4") and got["scalar"].shape == ()
    assert [t.datatype for t in decode(encode_arrays(m))] == [DataType.FP16, DataType.BOOL, DataType.INT32,
                                                              DataType.UINT64, DataType.FP64]


def test_decode_takes_bytes_memoryview_ndarray_and_copies_only_a_misaligned_start() -> None:
    body = encode_arrays({"a": np.arange(5, dtype=np.float64), "b": np.arange(3, dtype=np.int8)})
    for form in (body, bytearray(body), memoryview(body), np.frombuffer(body, np.uint8)):
        got = decode_arrays(form)
        np.testing.assert_array_equal(got["a"], np.arange(5.0))
        assert not got["a"].flags.writeable  # even over a writable buffer
    shifted = memoryview(b"\x00" * 3 + body)[3:]  # the body itself starts off alignment
    a = decode_arrays(shifted)["a"]
    assert a.flags.aligned and not a.flags.writeable
    np.testing.assert_array_equal(a, np.arange(5.0))
    assert decode(encode([])) == [] and len(encode([])) == tw.BODY_HEADER_SIZE


def test_layout_is_the_documented_one_byte_by_byte() -> None:
    body = encode([WireTensor("ab", DataType.INT16, np.array([[1, 2, 3]], np.int16))])
    magic, version, flags, count = struct.unpack_from("<IBBH", body, 0)
    assert body[:4] == b"GPTB" and (magic, version, flags, count) == (tw.MAGIC, 1, 0, 1)
    name_len, code, ndim, reserved, data_len = struct.unpack_from("<HBBIQ", body, 8)
    assert (name_len, code, ndim, reserved, data_len) == (2, DataType.INT16.code, 2, 0, 6)
    assert struct.unpack_from("<2Q", body, 24) == (1, 3)
    assert body[40:42] == b"ab" and body[42:48] == bytes(6)  # name, zero padding to 8
    assert body[48:54] == struct.pack("<3h", 1, 2, 3) and body[54:56] == bytes(2)  # data, padding to 8
    assert len(body) == 56


def _body() -> bytes:
    return encode([WireTensor("x", DataType.FP32, np.arange(4, dtype=np.float32)),
                   WireTensor("y", DataType.BOOL, np.array([True, False]))])


def _patched(fmt: str, offset: int, *values: int) -> bytes:
    b = bytearray(_body())
    struct.pack_into(fmt, b, offset, *values)
    return bytes(b)


# x: header at 8 (dims at 24, name at 32, data at 40..56); y: header at 56 (dims 72, name 80, data 88..96)
@pytest.mark.parametrize(("body", "message"), [
    (b"", "truncated"),
    (b"GPTB\x01\x00", "truncated"),
    (_patched("<I", 0, 0x4D525047), "bad magic"),
    (_patched("<B", 4, 2), "version 2"),
    (_patched("<B", 5, 1), "flags"),
    (_patched("<H", 6, tw.MAX_TENSORS + 1), "tensors, at most 1024"),
    (_patched("<H", 6, 3), "truncated: tensor 2"),
    (_patched("<H", 6, 1), "bytes after the last"),
    (_body()[:60], "truncated: tensor 1"),
    (_body()[:84], "truncated"),
    (_body()[:92], "truncated"),
    (_patched("<B", 10, 99), "unknown datatype code 99"),
    (_patched("<B", 10, 0), "unknown datatype code 0"),
    (_patched("<B", 10, DataType.BYTES.code), "BYTES tensors are not supported yet"),
    (_patched("<B", 11, tw.MAX_NDIM + 1), "dimensions, at most 16"),
    (_patched("<I", 12, 1), "reserved"),
    (_patched("<Q", 16, 12), "length mismatch"),
    (_patched("<Q", 24, 5), "length mismatch"),
    (_patched("<H", 8, 0), "name of 0 bytes"),
    (_patched("<H", 8, 256), "name of 256 bytes"),
    (_patched("<B", 32, 0xFF), "not UTF-8"),
    (_patched("<B", 80, ord("x")), "duplicate tensor name"),
    (_patched("<B", 33, 1), "padding"),
    (_patched("<B", 95, 1), "padding"),
    (_patched("<B", 88, 2), "BOOL"),
    (_patched("<Q", 24, 2**40), "too large"),
])
def test_malformed_bodies_say_what_is_wrong(body: bytes, message: str) -> None:
    with pytest.raises(TensorBodyError, match=message):
        decode(body)


def test_encode_refuses_what_it_cannot_carry() -> None:
    ok = np.zeros(2, np.float32)
    cases: list[tuple[list[WireTensor], str]] = [
        ([WireTensor("s", DataType.BYTES, np.array([b"a"], object))], "BYTES tensors are not supported yet"),
        ([WireTensor("x", DataType.FP32, np.zeros(2, np.float64))], "does not hold FP32"),
        ([WireTensor("x", DataType.BF16, np.zeros(2, np.float16))], "does not hold BF16"),
        ([WireTensor("x", DataType.FP32, ok), WireTensor("x", DataType.FP32, ok)], "duplicate"),
        ([WireTensor("", DataType.FP32, ok)], "non-empty name"),
        ([WireTensor("é" * 128, DataType.FP32, ok)], "256 UTF-8 bytes"),
        ([WireTensor("\ud800", DataType.FP32, ok)], "not valid UTF-8"),
        ([WireTensor("x", DataType.FP32, np.zeros((1,) * 17, np.float32))], "17 dimensions"),
        ([WireTensor("x", "FP32", ok)], "must be a DataType"),  # type: ignore[arg-type]
    ]
    for items, message in cases:
        with pytest.raises(TensorBodyError, match=message):
            encode(items)
    with pytest.raises(TensorBodyError, match="more than 1024"):
        encode(WireTensor(f"t{i}", DataType.UINT8, np.zeros(0, np.uint8)) for i in range(1025))
    assert len(decode(encode(WireTensor(f"t{i}", DataType.UINT8, np.zeros(0, np.uint8)) for i in range(1024)))) \
        == 1024
    with pytest.raises(TensorBodyError, match="BYTES tensors are not supported yet"):
        encode_arrays({"s": np.array(["text"])})
    with pytest.raises(TensorBodyError, match="no tensor datatype"):
        encode_arrays({"c": np.zeros(2, np.complex64)})
    with pytest.raises(ValueError):  # TensorBodyError is a ValueError, for callers that catch those
        encode_arrays({"c": np.zeros(2, np.complex64)})


# -- fuzz: decode never raises anything but TensorBodyError, and what it returns re-encodes the same ---

_SEEDS = [
    _body(),
    encode([]),
    encode_arrays({"é": np.array(1.5, np.float64), "e": np.zeros((0, 2), np.int64), "h": np.float16([1, 2, 3])}),
    encode([WireTensor("b", DataType.BF16, np.arange(5, dtype=np.uint16).reshape(5, 1))]),
]


def _check(data: bytes) -> None:
    try:
        got = decode(data)
    except TensorBodyError:
        return
    # A body decode accepts is canonical: encoding its tensors gives back the same bytes.
    assert encode(got) == data


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    _check(data)
    _check(b"GPTB\x01\x00" + data)  # past the magic, into the tensor headers


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.sampled_from(_SEEDS),
       edits=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255), st.sampled_from(["set", "cut", "insert"])),
                      min_size=1, max_size=4))
def test_fuzz_mutated_bodies(seed: bytes, edits: list[tuple[int, int, str]]) -> None:
    b = bytearray(seed)
    for pos, value, op in edits:
        pos = pos % (len(b) + 1)
        if op == "set" and pos < len(b):
            b[pos] = value
        elif op == "cut":
            del b[pos:]
        else:
            b[pos:pos] = bytes([value])
    _check(bytes(b))
