from __future__ import annotations

import os
import pickle
import socket
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuprims import _native, wire
from gpuprims.wire import DType, Status, Verdict, WireError


def test_python_layout_matches_native() -> None:
    native = _native.wire_layout()
    python = {name: (off, struct.calcsize("<" + code)) for name, (off, code) in wire.FIELDS.items()}
    assert python == native
    assert _native.WIRE_HEADER_SIZE == wire.HEADER_SIZE == wire.HEADER_DTYPE.itemsize
    assert _native.WIRE_MAGIC == wire.MAGIC and _native.WIRE_VERSION == wire.VERSION
    for name, (off, _size) in native.items():
        assert wire.HEADER_DTYPE.fields[name][1] == off


def test_verdict_names_match_native() -> None:
    for v in Verdict:
        assert _native.verdict_name(int(v)) == v.name.lower()


def test_paper_image_is_588_packets() -> None:
    img = np.zeros((224, 224, 3), np.float32)
    dgrams = wire.encode_request(3, 77, img, client_ts_ns=5, deadline_us=30_000)
    assert len(dgrams) == 588
    assert all(len(d) == wire.HEADER_SIZE + 1024 for d in dgrams)
    h = wire.unpack_header(dgrams[10])
    assert (h.app_id, h.request_id, h.chunk_index, h.chunk_count, h.total_len) == (3, 77, 10, 588, 602112)
    assert h.dtype == DType.FLOAT32 and h.deadline_us == 30_000 and h.client_ts_ns == 5


@pytest.mark.parametrize("total", [1, 1023, 1024, 1025, 5000, 150528])
def test_encode_decode_roundtrip(total: int) -> None:
    body = np.random.default_rng(total).integers(0, 256, total, dtype=np.uint8)
    dgrams = wire.encode_request(1, 9, body)
    assert len(dgrams) == wire.chunk_count_for(total)
    parts = {}
    for d in reversed(dgrams):
        assert wire.check_request(d) == Verdict.OK
        assert _native.check_request(d) == 0
        h, payload = wire.decode_request(d)
        parts[h.chunk_index] = bytes(payload)
    assert b"".join(parts[i] for i in range(len(parts))) == body.tobytes()


def test_response_roundtrip_and_out_of_order() -> None:
    logits = np.arange(1000, dtype=np.float32)
    dgrams = wire.encode_response(2, 41, Status.OK, logits, client_ts_ns=123)
    asm = wire.ResponseAssembler()
    results = [asm.feed(d) for d in reversed(dgrams)]
    done = [r for r in results if r is not None]
    assert len(done) == 1 and asm.pending() == 0
    r = done[0]
    assert (r.app_id, r.request_id, r.status, r.client_ts_ns) == (2, 41, Status.OK, 123)
    np.testing.assert_array_equal(r.array(), logits)


def test_empty_error_response() -> None:
    (d,) = wire.encode_response(2, 5, Status.DEADLINE_MISSED)
    r = wire.ResponseAssembler().feed(d)
    assert r is not None and r.status == Status.DEADLINE_MISSED and r.body == b""


def _valid() -> bytes:
    return wire.encode_request(1, 2, b"x" * 3000)[0]


def _patch(buf: bytes, field: str, value: int) -> bytes:
    off, code = wire.FIELDS[field]
    out = bytearray(buf)
    struct.pack_into("<" + code, out, off, value)
    return bytes(out)


@pytest.mark.parametrize(
    ("datagram", "verdict"),
    [
        (b"", Verdict.TRUNCATED),
        (_valid()[:47], Verdict.TRUNCATED),
        (_patch(_valid(), "magic", 0xDEADBEEF), Verdict.BAD_MAGIC),
        (_patch(_valid(), "version", 2), Verdict.BAD_VERSION),
        (_patch(_valid(), "kind", wire.KIND_RESPONSE), Verdict.BAD_KIND),
        (_patch(_valid(), "payload_len", 2000), Verdict.BAD_LENGTH),
        (_valid()[:-1], Verdict.BAD_LENGTH),
        (_patch(_valid(), "chunk_index", 3), Verdict.BAD_CHUNK),
        (_patch(_patch(_valid(), "chunk_count", 0), "chunk_index", 0), Verdict.BAD_CHUNK),
        (_patch(_valid(), "total_len", 9000), Verdict.BAD_TOTAL),
        (_patch(_valid(), "dtype", 99), Verdict.BAD_DTYPE),
        (_patch(_valid(), "dtype", int(max(DType)) + 1), Verdict.BAD_DTYPE),
    ],
)
def test_bad_datagrams_same_verdict_both_decoders(datagram: bytes, verdict: Verdict) -> None:
    assert wire.check_request(datagram) == verdict
    assert _native.check_request(datagram) == int(verdict)
    with pytest.raises(WireError) as ei:
        wire.decode_request(datagram)
    assert ei.value.verdict == verdict


def test_every_dtype_code_is_accepted_by_both_parsers_and_the_next_is_not() -> None:
    # TENSORS (5), a multi-tensor body, is the newest code; both parsers must move their limit together.
    assert int(max(DType)) == int(DType.TENSORS) == 5
    for code in DType:
        d = _patch(_valid(), "dtype", int(code))
        assert wire.check_request(d) == Verdict.OK and _native.check_request(d) == 0, code.name
    assert DType.TENSORS.numpy == np.uint8  # as elements a multi-tensor body is bytes
    assert DType.from_numpy(np.uint8) is DType.UINT8  # and never inferred from an array
    (d,) = wire.encode_response(1, 2, Status.OK, b"\x01\x02", dtype=DType.TENSORS)
    r = wire.ResponseAssembler().feed(d)
    assert r is not None and r.dtype == DType.TENSORS and r.array().tobytes() == b"\x01\x02"


def test_wire_error_pickles() -> None:
    e = WireError(Verdict.BAD_TOTAL, "detail")
    e2 = pickle.loads(pickle.dumps(e))
    assert e2.verdict == Verdict.BAD_TOTAL and str(e2) == str(e)


def test_encode_validates_arguments() -> None:
    with pytest.raises(ValueError, match="app_id"):
        wire.encode_request(70000, 1, b"x")
    with pytest.raises(ValueError, match="non-empty"):
        wire.encode_request(1, 1, b"")
    with pytest.raises(ValueError, match="chunk_payload"):
        wire.encode_request(1, 1, b"x", chunk_payload=0)


_header_fields = st.fixed_dictionaries(
    {
        "magic": st.sampled_from([wire.MAGIC, wire.MAGIC ^ 1, 0]),
        "version": st.sampled_from([1, 0, 2, 255]),
        "kind": st.integers(0, 3),
        "status": st.integers(0, 0xFFFF),
        "app_id": st.integers(0, 0xFFFF),
        "dtype": st.integers(0, 10),
        "flags": st.integers(0, 255),
        "chunk_index": st.integers(0, 12) | st.integers(0, 2**32 - 1),
        "chunk_count": st.integers(0, 12) | st.integers(0, 2**32 - 1),
        "payload_len": st.integers(0, 64) | st.integers(0, 2**32 - 1),
        "request_id": st.integers(0, 2**64 - 1),
        "total_len": st.integers(0, 800) | st.integers(0, 2**32 - 1),
        "deadline_us": st.integers(0, 2**32 - 1),
        "client_ts_ns": st.integers(0, 2**64 - 1),
    }
)


@pytest.mark.slow
@settings(max_examples=1000, deadline=None)
@given(fields=_header_fields, payload=st.integers(0, 70), cut=st.integers(0, 60))
def test_fuzz_header_parser_python_and_native_agree(fields: dict[str, int], payload: int, cut: int) -> None:
    hdr = wire.Header(**fields).pack()
    dgram = (hdr + b"\xab" * payload)[: max(0, len(hdr) + payload - cut)] if cut > 50 else hdr + b"\xab" * payload
    assert int(wire.check_request(dgram)) == _native.check_request(dgram)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=120))
def test_fuzz_random_bytes_agree(data: bytes) -> None:
    assert int(wire.check_request(data)) == _native.check_request(data)


def test_request_flags_are_in_every_datagram_and_no_check_refuses_them() -> None:
    body = np.zeros(3000, np.uint8)
    for flags in (0, wire.FLAG_MORE, 0xFF):  # unknown bits are ignored, not refused
        dgrams = wire.encode_request(1, 9, body, flags=flags)
        assert len(dgrams) == 3
        for d in dgrams:
            assert wire.unpack_header(d).flags == flags
            assert wire.check_request(d) == Verdict.OK and _native.check_request(d) == 0
    for bad in (-1, 256, True, 1.0):
        with pytest.raises(ValueError, match="flags must be a u8"):
            wire.encode_request(1, 9, body, flags=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("total", [1, 1023, 1024, 1025, 5000])
def test_native_send_request_sends_exactly_the_datagrams_encode_request_makes(total: int) -> None:
    body = np.random.default_rng(total).integers(0, 256, total, dtype=np.uint8)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
        rx.bind(("127.0.0.1", 0))
        rx.settimeout(5.0)
        port = rx.getsockname()[1]
        n = _native.send_request(tx.fileno(), "127.0.0.1", port, 7, 99, body, 1024, int(DType.UINT8), wire.FLAG_MORE,
                                 1500, 123)
        want = wire.encode_request(7, 99, body, dtype=DType.UINT8, flags=wire.FLAG_MORE, deadline_us=1500,
                                   client_ts_ns=123)
        assert n == len(want)
        assert [rx.recv(65536) for _ in range(n)] == want


def test_native_send_request_refuses_what_it_cannot_send() -> None:
    body = np.zeros(10, np.uint8)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
        with pytest.raises(ValueError, match="not a numeric"):
            _native.send_request(tx.fileno(), "localhost", 9, 1, 1, body, 1024, 0, 0, 0, 0)
        with pytest.raises(ValueError, match="non-empty"):
            _native.send_request(tx.fileno(), "127.0.0.1", 9, 1, 1, body[:0], 1024, 0, 0, 0, 0)
        with pytest.raises(ValueError, match="chunk_payload"):
            _native.send_request(tx.fileno(), "127.0.0.1", 9, 1, 1, body, 0, 0, 0, 0, 0)
    r, w = os.pipe()
    try:
        with pytest.raises(OSError):
            _native.send_request(w, "127.0.0.1", 9, 1, 1, body, 1024, 0, 0, 0, 0)  # not a socket
    finally:
        os.close(r)
        os.close(w)
