from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

from gpuprims import _native, wire
from gpuprims.ingest import Ingest
from gpuprims.pool import ANY_SIZE, RECORD_DTYPE, LocalQueue, PacketPool
from gpuprims.stats import DURATION_BOUNDS_S, RequestHistograms
from gpuprims.wire import Status


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


# -- LocalQueue: the serving loop's native local queue and per-batch bookkeeping -----------------------

#: How long the ingest may take to react on a busy machine; waits end as soon as their condition holds.
REACT_S = 30.0
ROW = 64  # bytes of the app's input in these tests (16 float32)


class _Node:
    """A pool, an ingest routing app 1 to consumer 0, a client socket and the consumer's LocalQueue."""

    def __init__(self, answer_ring_bytes: int = 1 << 20) -> None:
        self.pool = PacketPool.create(slot_count=256, record_count=32, max_chunks=8, consumer_count=1,
                                      answer_ring_bytes=answer_ring_bytes)
        self.ingest = Ingest(self.pool, [("127.0.0.1", 0)], timeout_ms=REACT_S * 1000,
                             answer_hold_ms=REACT_S * 1000).start()
        self.ingest.set_route(1, [0])
        self.client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.client.bind(("127.0.0.1", 0))
        self.client.settimeout(REACT_S)
        self.q = LocalQueue(self.pool.consumer(0))

    def send(self, rid: int, body: np.ndarray | bytes, deadline_us: int = 0) -> None:
        for d in wire.encode_request(1, rid, body, deadline_us=deadline_us):
            self.client.sendto(d, ("127.0.0.1", self.ingest.ports[0]))

    def pull(self, n: int) -> list[float]:
        got: list[float] = []
        end = time.monotonic() + REACT_S
        while len(got) < n and time.monotonic() < end:
            got += self.q.pull(64, 100_000)
        assert len(got) == n and len(self.q) == n
        return got

    def responses(self, n: int) -> dict[int, wire.Response]:
        """The next n responses by request id; a second answer to any request fails the test."""
        asm, out = wire.ResponseAssembler(), {}
        while len(out) < n:
            r = asm.feed(self.client.recv(65536))
            if r is not None:
                assert r.request_id not in out, f"request {r.request_id} answered twice"
                out[r.request_id] = r
        return out

    def no_more_responses(self) -> None:
        self.client.settimeout(0.2)
        with pytest.raises(TimeoutError):
            self.client.recv(65536)
        self.client.settimeout(REACT_S)

    def close(self) -> None:
        self.ingest.stop()
        self.client.close()
        self.pool.close()


@pytest.fixture
def lq() -> Iterator[_Node]:
    n = _Node()
    yield n
    n.close()


def _answer(q: LocalQueue, body: np.ndarray, dtype: wire.DType, default_ms: float, lat: np.ndarray,
            hist: RequestHistograms | None = None, compute_s: float = 0.0) -> tuple[int, ...]:
    h = hist or RequestHistograms()
    return q.answer_batch(body, int(dtype), default_ms, 5_000_000, lat, compute_s, DURATION_BOUNDS_S,
                          h.request.counts, h.queue.counts, h.compute.counts)


def _ok_dtypes() -> np.ndarray:
    ok = np.zeros(256, np.uint8)
    ok[[int(wire.DType.FLOAT32), int(wire.DType.BYTES)]] = 1
    return ok


def test_local_queue_pulls_copies_and_takes_a_batch_answering_bad_bodies(lq: _Node) -> None:
    x = np.arange(16, dtype=np.float32)
    lq.send(1, x, deadline_us=7_000)
    lq.send(2, b"\x00" * 10)  # not the app's input size
    lq.send(3, np.repeat(x.astype(np.uint8), 4))  # the right size, but a uint8 body
    lq.send(4, x)
    arrivals = lq.pull(4)
    assert len(lq.q) == 4 and bool(lq.q)
    assert lq.q.deadline_ms(0, 50.0) == 7.0 and lq.q.deadline_ms(3, 50.0) == 50.0
    assert all(a > 0 for a in arrivals) and lq.q.first_ns(0) <= lq.q.first_ns(3)
    with pytest.raises(IndexError):
        lq.q.first_ns(4)
    recs = np.zeros(32, np.uint32)
    ok = _ok_dtypes()
    ok[int(wire.DType.UINT8)] = 0
    n = lq.q.take(4, ROW, ok, 5_000_000, recs)
    assert n == 2 and len(lq.q) == 0
    info = lq.q.batch_info()
    assert info.dtype == RECORD_DTYPE and info["request_id"].tolist() == [1, 4]
    assert np.array_equal(lq.q.batch_recs(), recs[:2])
    got = lq.responses(2)
    assert {rid: r.status for rid, r in got.items()} == {2: Status.BAD_REQUEST, 3: Status.BAD_REQUEST}
    # The batch's answer: OK with each row, latencies measured, the oldest request's timestamps.
    body = np.stack([x, x * 2]).astype(np.float32)
    lat = np.full(32, -1.0)
    hist = RequestHistograms()
    within, done_ns, first, complete, request_s, queue_s, compute_s = _answer(
        lq.q, body.view(np.uint8), wire.DType.FLOAT32, 1e6, lat, hist, compute_s=0.004)
    assert within == 2 and first == int(info["first_ns"].min()) and complete >= first
    assert done_ns >= complete
    assert np.allclose(lat[:2], (done_ns - info["first_ns"].astype(np.int64)) / 1e6) and lat[2] == -1.0
    # Counted as observe_answered counts the same batch (request, queue and compute histograms).
    want = RequestHistograms()
    want.observe_answered(info["first_ns"], compute_s=0.004, done_ns=done_ns)
    for k, added in [("request", request_s), ("queue", queue_s), ("compute", compute_s)]:
        assert getattr(hist, k).counts.tolist() == getattr(want, k).counts.tolist(), k
        assert added == pytest.approx(getattr(want, k).sum_s, rel=1e-6, abs=1e-9), k
    got = lq.responses(2)
    assert got[1].status == Status.OK and np.array_equal(got[1].array(), x)
    assert got[4].status == Status.OK and np.array_equal(got[4].array(), x * 2)
    # Answered: the batch is empty, so a second answer sends nothing.
    assert lq.q.batch_recs().size == 0
    assert _answer(lq.q, np.zeros((0, 64), np.uint8), wire.DType.FLOAT32, 1e6, lat, hist)[0] == 0
    assert hist.request.count == 2
    lq.no_more_responses()


def test_local_queue_expires_the_head_that_cannot_make_it_and_stops_at_the_first_that_can(lq: _Node) -> None:
    x = np.zeros(16, np.float32)
    for rid, d in [(1, 1_000), (2, 0), (3, 1_000), (4, 100_000)]:
        lq.send(rid, x, deadline_us=d)
    lq.pull(4)
    for i in range(4):
        lq.q.set_first_ns(i, 1_000_000_000)
    now = 1_000_000_000 + 5_000_000  # each is 5 ms old; deadlines 1 ms, 50 ms (the app's), 1 ms, 100 ms
    assert lq.q.expire(now, 50.0, -1.0, 5_000_000) == 1  # past its deadline: only the first
    assert len(lq.q) == 3 and lq.q.deadline_ms(0, 50.0) == 50.0
    assert lq.q.expire(now, 50.0, 44.0, 5_000_000) == 0  # 5 + 44 <= 50: the head can make it, so nothing
    assert lq.q.expire(now, 50.0, 46.0, 5_000_000) == 2  # 5 + 46 > 50 and the 1 ms one: both; 100 ms stays
    assert len(lq.q) == 1 and lq.q.deadline_ms(0, 50.0) == 100.0
    assert lq.q.expire(now - 10_000_000, 50.0, -1.0, 5_000_000) == 0  # a clock read before the arrival: age 0
    assert lq.q.fail_head(5, int(Status.INTERNAL), 5_000_000) == 1 and len(lq.q) == 0
    got = lq.responses(4)
    assert {rid: r.status for rid, r in got.items()} == {
        1: Status.DEADLINE_MISSED, 2: Status.DEADLINE_MISSED, 3: Status.DEADLINE_MISSED, 4: Status.INTERNAL}
    lq.no_more_responses()


def test_local_queue_keeps_a_batch_whose_rows_cannot_fit_so_it_is_answered_once_with_an_error() -> None:
    node = _Node(answer_ring_bytes=4096)
    try:
        node.send(9, np.zeros(16, np.float32))
        node.pull(1)
        recs = np.zeros(32, np.uint32)
        assert node.q.take(1, ROW, _ok_dtypes(), 5_000_000, recs) == 1
        lat = np.zeros(32)
        with pytest.raises(ValueError, match="does not fit the answer ring"):
            _answer(node.q, np.zeros((1, 8192), np.uint8), wire.DType.BYTES, 50.0, lat)
        info = node.q.batch_info()  # still the current batch: answer it with an error instead
        assert info["request_id"].tolist() == [9]
        node.pool.consumer(0).answer_status(recs[:1], info, Status.INTERNAL)
        node.q.clear_batch()
        assert node.q.batch_recs().size == 0
        assert node.responses(1)[9].status == Status.INTERNAL
        node.no_more_responses()
    finally:
        node.close()


def test_local_queue_refuses_bad_arguments(lq: _Node) -> None:
    with pytest.raises(ValueError, match="dtype_ok"):
        lq.q.take(1, ROW, np.zeros(8, np.uint8), 1000, np.zeros(4, np.uint32))
    lq.send(1, np.zeros(16, np.float32))
    lq.pull(1)
    with pytest.raises(ValueError, match="recs_out"):
        lq.q.take(1, ROW, _ok_dtypes(), 1000, np.zeros(0, np.uint32))
    assert len(lq.q) == 1  # nothing was taken
    assert lq.q.take(1, ROW, _ok_dtypes(), 1000, np.zeros(1, np.uint32)) == 1
    with pytest.raises(ValueError, match="one body row"):
        _answer(lq.q, np.zeros((2, ROW), np.uint8), wire.DType.FLOAT32, 50.0, np.zeros(4))
    with pytest.raises(ValueError, match="lat_ms"):
        _answer(lq.q, np.zeros((1, ROW), np.uint8), wire.DType.FLOAT32, 50.0, np.zeros(0))
    with pytest.raises(ValueError, match="one count per bound"):
        lq.q.answer_batch(np.zeros((1, ROW), np.uint8), int(wire.DType.FLOAT32), 50.0, 1000, np.zeros(1), 0.0,
                          DURATION_BOUNDS_S, np.zeros(3, np.int64), np.zeros(3, np.int64), np.zeros(3, np.int64))
    _answer(lq.q, np.zeros((1, ROW), np.uint8), wire.DType.FLOAT32, 50.0, np.zeros(1))
    assert lq.responses(1)[1].status == Status.OK


def test_local_queue_take_any_size_takes_bodies_of_every_length_and_still_checks_the_dtype(lq: _Node) -> None:
    # Multi-tensor bodies (wire dtype TENSORS) differ in size from request to request: the ingest admits
    # them, and take with ANY_SIZE batches them whatever their length (one datagram or several).
    sizes = {1: 8, 2: 3000, 3: 64, 5: 1}
    body = {rid: bytes(range(256)) * (size // 256) + bytes(size % 256) for rid, size in sizes.items()}
    for rid in sizes:
        for d in wire.encode_request(1, rid, body[rid], dtype=wire.DType.TENSORS):
            lq.client.sendto(d, ("127.0.0.1", lq.ingest.ports[0]))
    lq.send(4, np.zeros(16, np.float32))  # a dtype the app does not take: still BAD_REQUEST
    lq.pull(5)
    ok = np.zeros(256, np.uint8)
    ok[int(wire.DType.TENSORS)] = 1
    recs = np.zeros(32, np.uint32)
    with pytest.raises(ValueError, match="rows must be None"):
        lq.q.take(5, ANY_SIZE, ok, 5_000_000, recs, np.zeros((5, 64), np.uint8))
    assert len(lq.q) == 5  # nothing was taken
    assert lq.q.take(5, ANY_SIZE, ok, 5_000_000, recs) == 4 and len(lq.q) == 0
    info = lq.q.batch_info()
    assert dict(zip(info["request_id"].tolist(), info["total_len"].tolist())) == sizes
    assert (info["dtype"] == int(wire.DType.TENSORS)).all()
    assert {rid: r.status for rid, r in lq.responses(1).items()} == {4: Status.BAD_REQUEST}
    for rec, rid in zip(lq.q.batch_recs(), info["request_id"].tolist()):  # each body whole, in its own size
        got_body = lq.pool.gather(np.array([rec], np.uint32), np.zeros((1, sizes[rid]), np.uint8))
        assert got_body.tobytes() == body[rid]
    _answer(lq.q, np.zeros((4, 8), np.uint8), wire.DType.TENSORS, 50.0, np.zeros(4))
    got = lq.responses(4)
    assert set(got) == set(sizes) and all(r.status == Status.OK and r.dtype == wire.DType.TENSORS
                                          for r in got.values())
    lq.no_more_responses()


def test_local_queue_take_copies_the_batch_payloads_in_order_when_given_rows(lq: _Node) -> None:
    xs = [np.arange(16, dtype=np.float32) * (i + 1) for i in range(3)]
    lq.send(1, xs[0])
    lq.send(2, b"\x00" * 8)  # refused: its row is left to the next good request
    lq.send(3, xs[1])
    lq.send(4, xs[2])
    lq.pull(4)
    rows = np.full((32, ROW), 0xEE, np.uint8)
    recs = np.zeros(32, np.uint32)
    assert lq.q.take(4, ROW, _ok_dtypes(), 5_000_000, recs, rows) == 3
    assert np.array_equal(rows[:3].view(np.float32), np.stack(xs))
    assert (rows[3:] == 0xEE).all()  # nothing written past the batch
    with pytest.raises(ValueError, match="rows needs room"):
        lq.q.take(1, ROW, _ok_dtypes(), 1000, recs, np.zeros((1, ROW + 1), np.uint8))
    assert lq.responses(1)[2].status == Status.BAD_REQUEST
    _answer(lq.q, rows[:3], wire.DType.FLOAT32, 50.0, np.zeros(3))
    assert {rid: r.status for rid, r in lq.responses(3).items()} == {1: Status.OK, 3: Status.OK, 4: Status.OK}
