from __future__ import annotations

import os

import numpy as np
import pytest

from gpuprims import _native
from gpuprims.pool import RECORD_DTYPE, PacketPool


def test_record_dtype_matches_native_layout() -> None:
    native = _native.record_layout()
    assert RECORD_DTYPE.itemsize == _native.RECORD_SIZE
    for name, (off, size) in native.items():
        field_dtype, field_off = RECORD_DTYPE.fields[name][:2]
        assert (field_off, field_dtype.itemsize) == (off, size), name


def test_create_attach_layout_and_unlink() -> None:
    pool = PacketPool.create(slot_count=100, max_payload=1024, record_count=10, max_chunks=16, consumer_count=3)
    lay = pool.layout
    assert lay["slot_size"] == 1088 and lay["slot_size"] % 64 == 0
    assert lay["max_payload"] >= 1024
    assert lay["slots_offset"] % 4096 == 0 and pool.address % 4096 == 0
    assert lay["ring_capacity"] == 16
    assert pool.owner
    shm_path = "/dev/shm" + pool.name
    assert os.path.exists(shm_path)
    assert oct(os.stat(shm_path).st_mode & 0o777) == "0o600"
    other = PacketPool.attach(pool.name)
    assert not other.owner and other.layout == lay
    # Writes through one mapping are seen through the other.
    pool.region("slots")[:4] = [1, 2, 3, 4]
    assert other.region("slots")[:4].tolist() == [1, 2, 3, 4]
    other.close()
    assert os.path.exists(shm_path)
    pool.close()
    assert not os.path.exists(shm_path)
    assert pool.closed
    pool.close()  # idempotent


def test_dropped_pool_is_unlinked() -> None:
    pool = PacketPool.create(slot_count=8, record_count=2, consumer_count=1)
    path = "/dev/shm" + pool.name
    del pool
    assert not os.path.exists(path)


def test_attach_refuses_missing_and_foreign_segments(tmp_path: object) -> None:
    with pytest.raises(RuntimeError, match="cannot open packet pool"):
        PacketPool.attach("/gpuprims-no-such-pool")
    name = f"/gpuprims-foreign-{os.getpid()}"
    with open("/dev/shm" + name, "wb") as f:
        f.write(b"\0" * 8192)
    try:
        with pytest.raises(RuntimeError, match="not a gpuprims packet pool"):
            PacketPool.attach(name)
    finally:
        os.unlink("/dev/shm" + name)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"slot_count": 0}, "slot_count"),
        ({"max_payload": 70000}, "max_payload"),
        ({"record_count": -1}, "record_count"),
        ({"consumer_count": 0}, "consumer_count"),
        ({"name": "no-slash"}, "pool name"),
    ],
)
def test_create_validates(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PacketPool.create(**kwargs)  # type: ignore[arg-type]


def test_create_refuses_existing_name() -> None:
    with PacketPool.create(slot_count=8, record_count=2, consumer_count=1) as pool, \
            pytest.raises(RuntimeError, match="cannot create"):
        PacketPool.create(slot_count=8, record_count=2, consumer_count=1, name=pool.name)


def test_consumer_index_and_release_validation() -> None:
    with PacketPool.create(slot_count=8, record_count=2, consumer_count=1) as pool:
        with pytest.raises(ValueError, match="out of range"):
            pool.consumer(1)
        with pytest.raises(IndexError):
            pool.consumer(0).release(np.array([5], np.uint32))


def test_gather_refuses_undelivered_records() -> None:
    with PacketPool.create(slot_count=8, record_count=2, consumer_count=1) as pool:
        with pytest.raises(ValueError, match="not a delivered request"):
            pool.gather(np.array([0], np.uint32), np.zeros((1, 8), np.uint8))
        with pytest.raises(ValueError, match="rows"):
            pool.gather(np.array([0, 1], np.uint32), np.zeros((1, 8), np.uint8))


def test_requests_are_copies_of_the_records_in_the_order_asked() -> None:
    """`requests` copies the records as opaque items: every field as in the shared records, in the order
    of ``recs``, and nothing later written to the records shows through (the ingest reuses them)."""
    pool = PacketPool.create(slot_count=16, max_payload=1024, record_count=8, max_chunks=4, consumer_count=1)
    try:
        recs = pool._records
        recs["request_id"] = np.arange(100, 108)
        recs["first_ns"] = np.arange(8) * 1_000_003
        recs["addr"][:, 3] = np.arange(8)
        got = pool.requests(np.array([5, 2, 5], np.uint32))
        assert got.dtype == RECORD_DTYPE and got.shape == (3,)
        assert got["request_id"].tolist() == [105, 102, 105]
        assert got["first_ns"].tolist() == [5_000_015, 2_000_006, 5_000_015]
        assert got["addr"][:, 3].tolist() == [5, 2, 5]
        for name in RECORD_DTYPE.names:
            assert np.array_equal(got[name], recs[name][[5, 2, 5]]), name
        recs["request_id"] = 0
        assert got["request_id"].tolist() == [105, 102, 105]
        assert pool.requests(np.array([], np.uint32)).shape == (0,)
    finally:
        pool.close()
