from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from gpuprims import wire
from gpuprims.ingest import Ingest, LocalPort, packet_balance
from gpuprims.pool import PacketPool
from gpuprims.wire import Status

APP = 7


#: How long the ingest may take to react (take in datagrams, answer, expire) on a busy machine. Waits
#: end as soon as their condition holds, so this costs nothing when it reacts at once; it is also the
#: default reassembly timeout, so a test's chunks never expire while the test is descheduled between
#: two sends (tests of the timeout set a short one).
REACT_S = 30.0


class Node:
    """A pool + ingest on loopback with a client socket, for tests."""

    def __init__(self, *, slot_count: int = 2048, record_count: int = 64, consumers: int = 2,
                 timeout_ms: float = REACT_S * 1000, max_chunks: int = 256, listen_app: int | None = None,
                 gro: bool = True, answer_ring_bytes: int = 1 << 20) -> None:
        self.pool = PacketPool.create(slot_count=slot_count, record_count=record_count, max_chunks=max_chunks,
                                      consumer_count=consumers, answer_ring_bytes=answer_ring_bytes)
        listen = [("127.0.0.1", 0)] if listen_app is None else [("127.0.0.1", 0, listen_app)]
        # Held answers of requests without a deadline outlive any stall of the test (see REACT_S).
        self.ingest = Ingest(self.pool, listen, timeout_ms=timeout_ms, gro=gro, answer_hold_ms=REACT_S * 1000).start()
        self.ingest.set_route(APP, [0])
        self.addr = ("127.0.0.1", self.ingest.ports[0])
        self.client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.client.bind(("127.0.0.1", 0))
        self.client.settimeout(REACT_S)

    def send(self, datagrams: list[bytes]) -> None:
        for d in datagrams:
            self.client.sendto(d, self.addr)

    def wait(self, cond: Callable[[dict[str, int]], bool], timeout_s: float = REACT_S) -> dict[str, int]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            c = self.ingest.counters()
            if cond(c):
                return c
            time.sleep(0.005)
        raise AssertionError(f"condition not met; counters: {self.ingest.counters()}")

    def take(self, n: int, consumer: int = 0, timeout_s: float = REACT_S) -> np.ndarray:
        c = self.pool.consumer(consumer)
        got: list[int] = []
        deadline = time.monotonic() + timeout_s
        while len(got) < n and time.monotonic() < deadline:
            got += c.poll(64, 100).tolist()
        assert len(got) == n, f"got {len(got)} of {n} requests"
        return np.array(got, np.uint32)

    def responses(self, n: int) -> list[wire.Response]:
        asm, out = wire.ResponseAssembler(), []
        while len(out) < n:
            r = asm.feed(self.client.recv(65536))
            if r is not None:
                out.append(r)
        return out

    def close(self) -> None:
        self.ingest.stop()
        self.client.close()
        self.pool.close()


@pytest.fixture(params=[True, False], ids=["gro", "zerocopy"])
def node(request: pytest.FixtureRequest) -> Iterator[Node]:
    n = Node(gro=request.param)
    yield n
    n.close()


def test_gso_batches_are_split_into_datagrams(node: Node) -> None:
    # One sendmsg with UDP_SEGMENT: the kernel sends equal-size datagrams; with GRO the ingest gets
    # them as one buffer and must split it, without GRO it gets them one by one.
    body = _body(7, 1024 * 8)
    dgrams = wire.encode_request(APP, 7, body)
    seg = len(dgrams[0])
    udp_segment = 103
    node.client.sendmsg([b"".join(dgrams)], [(socket.SOL_UDP, udp_segment, struct.pack("=H", seg))], 0, node.addr)
    recs = node.take(1)
    out = np.zeros((1, body.size), np.uint8)
    node.pool.gather(recs, out)
    np.testing.assert_array_equal(out[0], body)
    c = node.ingest.counters()
    assert c["packets_received"] == 8 and packet_balance(c) == 0


def _body(seed: int, nbytes: int = 5000) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _patch(d: bytes, field: str, value: int) -> bytes:
    off, code = wire.FIELDS[field]
    b = bytearray(d)
    struct.pack_into("<" + code, b, off, value)
    return bytes(b)


def test_reassembles_shuffled_requests_and_gathers(node: Node) -> None:
    rng = np.random.default_rng(1)
    bodies = {rid: _body(rid) for rid in range(10)}
    dgrams = [d for rid, b in bodies.items() for d in wire.encode_request(APP, rid, b)]
    rng.shuffle(dgrams)
    node.send(dgrams)
    recs = node.take(10)
    info = node.pool.requests(recs)
    out = np.zeros((10, 5000), np.uint8)
    node.pool.gather(recs, out)
    for i, r in enumerate(info):
        np.testing.assert_array_equal(out[i], bodies[int(r["request_id"])])
        assert r["app_id"] == APP and r["total_len"] == 5000 and r["chunk_count"] == 5
    node.pool.consumer(0).release(recs)
    c = node.wait(lambda c: c["requests_released"] == 10)
    assert c["packets_accepted"] == 50 and c["requests_completed"] == 10 and packet_balance(c) == 0
    assert c["free_slots"] == 2048 and c["free_records"] == 64


def test_gather_into_torch_tensor(node: Node) -> None:
    torch = pytest.importorskip("torch")
    img = np.arange(3 * 8 * 8, dtype=np.float32).reshape(3, 8, 8)
    node.send(wire.encode_request(APP, 1, img))
    recs = node.take(1)
    out = torch.zeros((1, 3, 8, 8))
    node.pool.gather(recs, out)
    assert torch.equal(out[0], torch.from_numpy(img))
    with pytest.raises(ValueError, match="bytes but the batch row has"):
        node.pool.gather(recs, np.zeros((1, 10), np.float32))


@pytest.mark.parametrize(
    ("mutate", "counter"),
    [
        (lambda d: d[:30], "drop_truncated"),
        (lambda d: _patch(d, "magic", 0x11223344), "drop_bad_magic"),
        (lambda d: _patch(d, "version", 9), "drop_bad_version"),
        (lambda d: _patch(d, "kind", wire.KIND_RESPONSE), "drop_bad_kind"),
        (lambda d: _patch(d, "payload_len", 4000), "drop_bad_length"),
        (lambda d: _patch(d, "chunk_index", 50), "drop_bad_chunk"),
        (lambda d: _patch(d, "total_len", 100_001), "drop_bad_total"),
        (lambda d: _patch(d, "dtype", 77), "drop_bad_dtype"),
        (lambda d: _patch(d, "app_id", 999), "drop_unknown_app"),
    ],
)
def test_malformed_datagrams_are_counted_and_do_not_corrupt_others(
    node: Node, mutate: Callable[[bytes], bytes], counter: str
) -> None:
    good = wire.encode_request(APP, 1, _body(1))
    bad = [mutate(d) for d in wire.encode_request(APP, 2, _body(2))]
    # Interleave bad datagrams among the good request's chunks.
    node.send([x for pair in zip(good, bad) for x in pair])
    c = node.wait(lambda c: c["packets_received"] == 10)
    assert c[counter] == 5, c
    assert packet_balance(c) == 0
    recs = node.take(1)
    out = np.zeros((1, 5000), np.uint8)
    node.pool.gather(recs, out)
    np.testing.assert_array_equal(out[0], _body(1))
    assert node.ingest.running


def test_oversized_datagram_is_dropped() -> None:
    n = Node()
    try:
        big = wire.encode_request(APP, 1, _body(1, 3000), chunk_payload=2000)
        n.send(big)
        c = n.wait(lambda c: c["packets_received"] == 2)
        assert c["drop_oversize"] == 2 and packet_balance(c) == 0
    finally:
        n.close()


def test_too_many_chunks_is_dropped() -> None:
    n = Node(max_chunks=4)
    try:
        n.send(wire.encode_request(APP, 1, _body(1, 6000))[:2])
        c = n.wait(lambda c: c["packets_received"] == 2)
        assert c["drop_too_many_chunks"] == 2 and packet_balance(c) == 0
        # Answered once (BAD_REQUEST), not once per datagram.
        (resp,) = n.responses(1)
        assert resp.status == Status.BAD_REQUEST and resp.request_id == 1
        assert c["responses_sent"] == 1
    finally:
        n.close()


def test_duplicate_chunks_and_duplicate_requests(node: Node) -> None:
    d = wire.encode_request(APP, 1, _body(1))
    node.send([d[0], d[0], *d[1:], d[3]])
    node.take(1)
    c = node.wait(lambda c: c["packets_received"] == 7)
    assert c["drop_duplicate"] == 2 and c["requests_completed"] == 1 and packet_balance(c) == 0


def test_inconsistent_chunk_is_dropped(node: Node) -> None:
    d = wire.encode_request(APP, 1, _body(1))
    other = wire.encode_request(APP, 1, _body(1, 3000))  # same id, different size
    node.send([d[0], other[1], *d[1:]])
    node.take(1)
    c = node.wait(lambda c: c["packets_received"] == 6)
    assert c["drop_inconsistent"] == 1 and packet_balance(c) == 0


def test_incomplete_request_times_out_frees_slots_and_late_chunks_are_counted() -> None:
    n = Node(timeout_ms=100)
    try:
        d = wire.encode_request(APP, 1, _body(1))
        n.send(d[:3])
        # The timeout is counted, then its slots are freed: on a busy machine a snapshot between the two
        # shows the count with the slots still held, so wait for both.
        c = n.wait(lambda c: c["requests_timed_out"] == 1 and c["free_slots"] == 2048 and c["filling"] == 0)
        assert c["requests_timed_out"] == 1
        (resp,) = n.responses(1)
        assert resp.status == Status.DEADLINE_MISSED and resp.request_id == 1
        n.send(d[3:])
        c = n.wait(lambda c: c["packets_received"] == 5)
        assert c["drop_late"] == 2 and packet_balance(c) == 0
        assert n.pool.consumer(0).poll(8, 50).size == 0
    finally:
        n.close()


def test_flood_larger_than_pool_is_refused_whole_and_admitted_requests_complete() -> None:
    # 64 slots hold 12 requests of 5 chunks; 30 requests arrive before any is consumed.
    n = Node(slot_count=64, record_count=64)
    try:
        for rid in range(30):
            n.send(wire.encode_request(APP, rid, _body(rid)))
        c = n.wait(lambda c: c["packets_received"] == 150)
        assert c["requests_completed"] == 12
        assert c["requests_rejected_pool_full"] == 18 and c["drop_pool_full"] == 18 * 5
        assert packet_balance(c) == 0
        recs = n.take(12)
        out = np.zeros((12, 5000), np.uint8)
        n.pool.gather(recs, out)
        for i, r in enumerate(n.pool.requests(recs)):
            np.testing.assert_array_equal(out[i], _body(int(r["request_id"])))
        statuses = [r.status for r in n.responses(18)]
        assert statuses == [Status.OVERLOADED] * 18
        n.pool.consumer(0).release(recs)
        n.wait(lambda c: c["free_slots"] == 64)
        # The pool serves again once slots are back.
        n.send(wire.encode_request(APP, 100, _body(100)))
        n.take(1)
    finally:
        n.close()


def test_request_table_full_is_refused() -> None:
    n = Node(record_count=2)
    try:
        for rid in range(3):
            n.send(wire.encode_request(APP, rid, _body(rid))[:1])
        c = n.wait(lambda c: c["packets_received"] == 3)
        assert c["requests_rejected_no_record"] == 1 and c["drop_no_record"] == 1
        (resp,) = n.responses(1)
        assert resp.status == Status.OVERLOADED and resp.request_id == 2
    finally:
        n.close()


def test_queue_full_answers_overloaded() -> None:
    # A ring holds next_pow2(record_count) = 4 requests; the fifth cannot be queued.
    n = Node(record_count=4)
    try:
        for rid in range(4):
            n.send(wire.encode_request(APP, rid, _body(rid)))
        n.wait(lambda c: c["requests_delivered"] == 4)
        n.send(wire.encode_request(APP, 9, _body(9)))
        c = n.wait(lambda c: c["packets_received"] == 25)
        # The request table is full, so the fifth is refused at admission.
        assert c["requests_rejected_no_record"] + c["requests_rejected_queue_full"] == 1
    finally:
        n.close()


def test_port_restricted_to_one_app() -> None:
    n = Node(listen_app=APP)
    try:
        n.ingest.set_route(8, [1])
        n.send(wire.encode_request(8, 1, _body(1)))
        n.send(wire.encode_request(APP, 2, _body(2)))
        c = n.wait(lambda c: c["packets_received"] == 10)
        assert c["drop_unknown_app"] == 5 and c["requests_completed"] == 1 and packet_balance(c) == 0
        # The request for another app on this app's port is answered UNKNOWN_APP, once.
        (resp,) = n.responses(1)
        assert resp.status == Status.UNKNOWN_APP and resp.request_id == 1 and c["responses_sent"] == 1
    finally:
        n.close()


def test_routing_across_consumers_and_route_change(node: Node) -> None:
    node.ingest.set_route(APP, [0, 1])
    for rid in range(8):
        node.send(wire.encode_request(APP, rid, _body(rid)))
    node.wait(lambda c: c["requests_delivered"] == 8)
    d0, d1 = node.pool.consumer(0).depth(), node.pool.consumer(1).depth()
    assert d0 + d1 == 8 and d0 > 0 and d1 > 0
    node.ingest.set_route(APP, [1])
    assert node.ingest.route(APP) == [1]
    node.send(wire.encode_request(APP, 50, _body(50)))
    node.wait(lambda c: c["requests_delivered"] == 9)
    assert node.pool.consumer(1).depth() == d1 + 1


def test_reclaim_requeues_or_fails_held_requests(node: Node) -> None:
    node.ingest.set_route(APP, [0, 1])
    node.ingest.set_route(APP, [0])
    for rid in range(4):
        node.send(wire.encode_request(APP, rid, _body(rid)))
    node.wait(lambda c: c["requests_delivered"] == 4)
    held = node.pool.consumer(0).poll(2, 1000)  # consumer 0 holds two, leaves two queued, then dies
    assert held.size == 2
    node.ingest.set_route(APP, [0, 1])
    failed, requeued = node.ingest.reclaim(0, requeue=True)
    assert (failed, requeued) == (0, 4)
    assert node.ingest.route(APP) == [1]
    recs = node.take(4, consumer=1)
    assert sorted(node.pool.requests(recs)["request_id"].tolist()) == [0, 1, 2, 3]
    # Consumer 1 dies with nowhere to requeue: its requests are answered INSTANCE_FAILED.
    failed, requeued = node.ingest.reclaim(1, requeue=True)
    assert (failed, requeued) == (4, 0)
    assert [r.status for r in node.responses(4)] == [Status.INSTANCE_FAILED] * 4
    c = node.wait(lambda c: c["free_slots"] == 2048)
    assert c["requests_reclaimed_failed"] == 4 and c["requests_requeued"] == 4


def test_double_release_is_counted(node: Node) -> None:
    node.send(wire.encode_request(APP, 1, _body(1)))
    recs = node.take(1)
    cons = node.pool.consumer(0)
    cons.release(recs)
    node.wait(lambda c: c["requests_released"] == 1)
    cons.release(recs)
    c = node.wait(lambda c: c["bad_releases"] == 1)
    assert c["free_slots"] == 2048


def _child_consume(pool_name: str, n: int, q: mp.Queue) -> None:  # type: ignore[type-arg]
    pool = PacketPool.attach(pool_name)
    cons = pool.consumer(1)
    got: list[int] = []
    deadline = time.monotonic() + REACT_S
    while len(got) < n and time.monotonic() < deadline:
        got += cons.poll(16, 100).tolist()
    recs = np.array(got, np.uint32)
    out = np.zeros((len(got), 5000), np.uint8)
    pool.gather(recs, out)
    ids = pool.requests(recs)["request_id"].tolist()
    cons.release(recs)
    q.put([(rid, bytes(row[:16])) for rid, row in zip(ids, out)])
    pool.close()


def test_consumer_in_another_process() -> None:
    n = Node()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child_consume, args=(n.pool.name, 5, q))
    try:
        n.ingest.set_route(APP, [1])
        p.start()
        for rid in range(5):
            n.send(wire.encode_request(APP, rid, _body(rid)))
        res = q.get(timeout=REACT_S + 60)  # the child's own wait, plus its start-up (spawn, imports)
        assert sorted(rid for rid, _ in res) == list(range(5))
        for rid, head in res:
            assert head == _body(rid)[:16].tobytes()
        n.wait(lambda c: c["requests_released"] == 5)
    finally:
        p.join(timeout=REACT_S)
        if p.is_alive():
            p.kill()
            p.join()
        n.close()


def test_poll_times_out_without_work(node: Node) -> None:
    assert node.pool.consumer(0).poll(8, timeout_ms=20).size == 0
    with pytest.raises(ValueError):
        node.pool.consumer(0).poll(0)


def test_ingest_argument_validation() -> None:
    with PacketPool.create(slot_count=16, record_count=4, consumer_count=1) as pool:
        with pytest.raises(ValueError, match="listen"):
            Ingest(pool, [])
        with pytest.raises(ValueError, match="timeout_ms"):
            Ingest(pool, [("127.0.0.1", 0)], timeout_ms=0)
        with pytest.raises(ValueError, match="batch"):
            Ingest(pool, [("127.0.0.1", 0)], batch=0)
        with pytest.raises(RuntimeError, match="resolve"):
            Ingest(pool, [("no.such.host.invalid", 0)])
        ing = Ingest(pool, [("127.0.0.1", 0)])
        with pytest.raises(ValueError, match="consumer 3 out of range"):
            ing.set_route(1, [3])
        ing.stop()


def test_peek_sees_the_queue_without_taking_it(node: Node) -> None:
    recs, head, tail = node.pool.peek(0)
    assert recs.size == 0 and head == tail == 0
    node.send([d for rid in range(5) for d in wire.encode_request(APP, rid, _body(rid, 100))])
    node.wait(lambda c: c["requests_completed"] == 5)
    recs, head, tail = node.pool.peek(0)
    assert (head, tail, recs.size) == (0, 5, 5)
    assert sorted(node.pool.requests(recs)["request_id"].tolist()) == list(range(5))
    again, _, _ = node.pool.peek(0, from_pos=3)  # only what arrived after position 3
    np.testing.assert_array_equal(again, recs[3:])
    assert node.pool.peek(0, max_n=2)[0].size == 2
    taken = node.pool.consumer(0).poll(2, 1000)
    np.testing.assert_array_equal(taken, recs[:2])  # the consumer gets exactly what peek showed, in order
    rest, head, tail = node.pool.peek(0)
    assert (head, tail) == (2, 5)
    np.testing.assert_array_equal(rest, recs[2:])
    assert node.pool.peek(0, from_pos=99)[0].size == 0
    with pytest.raises(IndexError):
        node.pool.peek(7)
    node.pool.consumer(0).release(np.concatenate([taken, node.take(3)]))


# -- answers: the consumer publishes, the ingest is the only sender --------------------------------


def _by_id(responses: list[wire.Response]) -> dict[int, wire.Response]:
    out: dict[int, wire.Response] = {}
    for r in responses:
        assert r.request_id not in out, f"request {r.request_id} answered twice"
        out[r.request_id] = r
    return out


def _no_more_datagrams(node: Node) -> None:
    """Nothing else arrives: every answer was counted once already."""
    node.client.settimeout(0.3)
    with pytest.raises(TimeoutError):
        node.client.recv(65536)
    node.client.settimeout(REACT_S)


def test_answers_are_sent_by_the_ingest_with_their_results(node: Node) -> None:
    for rid in range(6):
        node.send(wire.encode_request(APP, rid, _body(rid)))
    recs = node.take(6)
    info = node.pool.requests(recs)
    cons = node.pool.consumer(0)
    rows = np.stack([np.arange(3000, dtype=np.float32) + int(r) for r in info["request_id"]])  # 3 chunks each
    cons.answer(recs[:4], info[:4], Status.OK, rows[:4])
    cons.answer_status(recs[4:], info[4:], Status.DEADLINE_MISSED)
    got = _by_id(node.responses(6))
    for rid in range(4):
        assert got[rid].status == Status.OK
        np.testing.assert_array_equal(got[rid].array(), np.arange(3000, dtype=np.float32) + rid)
    assert got[4].status == got[5].status == Status.DEADLINE_MISSED
    c = node.wait(lambda c: c["requests_answered"] == 6 and c["free_slots"] == 2048)
    assert c["bad_answers"] == 0
    _no_more_datagrams(node)


def test_answer_ring_wraps_and_waits_for_room() -> None:
    """A 4 KiB ring and 300 answers of mixed sizes: fillers at the end of the ring, a consumer that
    waits for the ingest to send, and every answer intact and sent once."""
    n = Node(answer_ring_bytes=4096, record_count=512, slot_count=4096)
    try:
        cons = n.pool.consumer(0)
        assert n.pool.layout["max_answer_bytes"] == 2048 - 24
        sent = 0
        got: dict[int, wire.Response] = {}
        for _wave in range(3):
            for rid in range(sent, sent + 100):
                n.send(wire.encode_request(APP, rid, _body(rid, 64)))
            recs = n.take(100)
            info = n.pool.requests(recs)
            for i in range(100):  # one answer per call, sizes 0..1980 bytes: the ring wraps many times
                k = (int(info["request_id"][i]) * 37) % 496
                row = np.full((1, k), float(info["request_id"][i]), np.float32)
                cons.answer(recs[i:i + 1], info[i:i + 1], Status.OK, row)
                if i % 10 == 9:  # read as we go: the client's socket buffer holds only so many datagrams
                    for r in n.responses(10):
                        assert r.request_id not in got, f"request {r.request_id} answered twice"
                        got[r.request_id] = r
            sent += 100
        for rid, r in got.items():
            k = (rid * 37) % 496
            np.testing.assert_array_equal(r.array() if k else np.zeros(0, np.float32),
                                          np.full(k, float(rid), np.float32))
        assert sorted(got) == list(range(300))
        c = n.wait(lambda c: c["requests_answered"] == 300 and c["free_slots"] == 4096)
        assert c["bad_answers"] == 0
    finally:
        n.close()


def test_a_result_too_large_for_the_ring_is_refused_with_the_reason(node: Node) -> None:
    node.send(wire.encode_request(APP, 1, _body(1)))
    recs = node.take(1)
    info = node.pool.requests(recs)
    cons = node.pool.consumer(0)
    big = np.zeros((1, node.pool.layout["max_answer_bytes"] + 1), np.uint8)
    with pytest.raises(ValueError, match="answer_ring_kb"):
        cons.answer(recs, info, Status.OK, big)
    cons.answer_status(recs, info, Status.INTERNAL)  # the record is still held and can be answered
    assert node.responses(1)[0].status == Status.INTERNAL
    with pytest.raises(ValueError, match="info"):
        cons.answer(recs, info[:0], Status.OK)


def test_published_answers_survive_their_consumer_and_the_rest_fail_once(node: Node) -> None:
    """The exactly-once window: a consumer that published some answers and died holding the others.
    The reclaim sends what was published and answers the rest INSTANCE_FAILED: one answer each."""
    for rid in range(8):
        node.send(wire.encode_request(APP, rid, _body(rid)))
    recs = node.take(8)
    info = node.pool.requests(recs)
    node.pool.consumer(0).answer(recs[:5], info[:5], Status.OK, np.ones((5, 4), np.float32))
    failed, requeued = node.ingest.reclaim(0, requeue=False)
    assert (failed, requeued) == (3, 0)
    got = _by_id(node.responses(8))
    ids = info["request_id"].tolist()
    assert {rid: got[rid].status for rid in ids} == {rid: Status.OK if i < 5 else Status.INSTANCE_FAILED
                                                    for i, rid in enumerate(ids)}
    _no_more_datagrams(node)


def test_an_answer_after_the_record_was_taken_back_is_refused(node: Node) -> None:
    node.ingest.set_route(APP, [0, 1])
    node.ingest.set_route(APP, [0])
    node.send(wire.encode_request(APP, 1, _body(1)))
    recs = node.take(1)
    info = node.pool.requests(recs)
    node.ingest.set_route(APP, [0, 1])
    assert node.ingest.reclaim(0, requeue=True) == (0, 1)  # a hung consumer, its request moved on
    node.pool.consumer(0).answer(recs, info, Status.OK, np.ones((1, 4), np.float32))  # it wakes up
    node.wait(lambda c: c["bad_answers"] == 1)
    recs1 = node.take(1, consumer=1)
    info1 = node.pool.requests(recs1)
    assert int(info1["generation"][0]) == int(info["generation"][0])  # the same request, moved
    node.pool.consumer(1).answer(recs1, info1, Status.OK, np.full((1, 4), 2.0, np.float32))
    (r,) = node.responses(1)
    assert r.status == Status.OK and r.array().tolist() == [2.0] * 4
    _no_more_datagrams(node)


def test_a_consumer_cannot_end_a_request_it_has_not_taken(node: Node) -> None:
    # Found by the fuzz harness: an answer (or a release) naming a record still waiting in the
    # consumer's queue used to end it, and the consumer then took the ended record from its queue.
    node.send(wire.encode_request(APP, 1, _body(1)))
    node.wait(lambda c: c["requests_delivered"] == 1)
    queued, head, tail = node.pool.peek(0)
    assert len(queued) == 1 and tail - head == 1
    info = node.pool.requests(queued)
    node.pool.consumer(0).answer(queued, info, Status.OK, np.ones((1, 4), np.float32))  # not taken yet
    node.wait(lambda c: c["bad_answers"] == 1)
    node.pool.consumer(0).release(queued)
    node.wait(lambda c: c["bad_releases"] == 1)
    recs = node.take(1)  # still there, still the same request
    assert recs.tolist() == queued.tolist()
    assert int(node.pool.requests(recs)["generation"][0]) == int(info["generation"][0])
    node.pool.consumer(0).answer(recs, info, Status.OK, np.full((1, 4), 2.0, np.float32))
    (r,) = node.responses(1)
    assert r.status == Status.OK and r.array().tolist() == [2.0] * 4
    _no_more_datagrams(node)


def test_a_corrupt_answer_ring_is_counted_and_the_ingest_goes_on(node: Node) -> None:
    node.send(wire.encode_request(APP, 1, _body(1)))
    recs = node.take(1)
    lay = node.pool.layout
    base = lay["answers_offset"]  # consumer 0's ring; its control words are in the consumer block
    data = np.frombuffer((ctypes.c_uint8 * lay["total_size"]).from_address(node.pool.address), np.uint8)
    data[base:base + 24].view(np.uint32)[:] = [int(recs[0]), 0, 7, 0, 0, 0]  # entry_len 7: not an entry
    ctl = lay["rings_offset"] + 2 * 192  # ConsumerBlock: deliver ring, release ring, then the answer words
    data[ctl + 64:ctl + 72].view(np.uint64)[0] = 32  # publish it
    node.wait(lambda c: c["bad_answers"] == 1)
    # The record is still held (nothing trustworthy answered it) and is answered normally.
    info = node.pool.requests(recs)
    node.pool.consumer(0).answer_status(recs, info, Status.INTERNAL)
    assert node.responses(1)[0].status == Status.INTERNAL
    node.wait(lambda c: c["requests_answered"] == 1 and c["free_slots"] == 2048)


def _child_answer_then_die(pool_name: str, n_answer: int) -> None:
    """An instance that answers part of what it holds and is then killed (os._exit, no clean-up)."""
    pool = PacketPool.attach(pool_name)
    cons = pool.consumer(1)
    got: list[int] = []
    deadline = time.monotonic() + REACT_S
    while len(got) < 6 and time.monotonic() < deadline:
        got += cons.poll(16, 100).tolist()
    recs = np.array(got, np.uint32)
    info = pool.requests(recs)
    cons.answer(recs[:n_answer], info[:n_answer], Status.OK, np.ones((n_answer, 300), np.float32))
    os._exit(0)


@pytest.mark.slow
def test_a_consumer_process_that_dies_after_answering_gets_each_request_one_answer() -> None:
    n = Node()
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_child_answer_then_die, args=(n.pool.name, 4))
    try:
        n.ingest.set_route(APP, [1])
        p.start()
        for rid in range(6):
            n.send(wire.encode_request(APP, rid, _body(rid)))
        p.join(timeout=REACT_S + 60)
        assert p.exitcode == 0
        n.ingest.reclaim(1, requeue=False)
        got = _by_id(n.responses(6))
        assert sorted(got) == list(range(6))
        assert sorted(r.status for r in got.values()) == [Status.OK] * 4 + [Status.INSTANCE_FAILED] * 2
        _no_more_datagrams(n)
    finally:
        if p.is_alive():
            p.kill()
        p.join()
        n.close()


def _deliver_one(node: Node, rid: int) -> tuple[int, int]:
    """Send one request, wait for its delivery; the depth of consumers 0 and 1 after it."""
    before = node.ingest.counters()["requests_delivered"]
    node.send(wire.encode_request(APP, rid, _body(rid)))
    node.wait(lambda c: c["requests_delivered"] == before + 1)
    return node.pool.consumer(0).depth(), node.pool.consumer(1).depth()


def test_cost_models_route_to_the_earliest_predicted_finish() -> None:
    n = Node(consumers=3)
    try:
        n.ingest.set_route(APP, [0, 1])
        # Queue 0 ("accelerator"): 1 ms a request; queue 1 ("CPU"): 4.5 ms fixed + 1 ms a request.
        # Finish on 0 with q waiting: 1000 (q + 1); on 1 (empty): 5500. So 0 takes five, then 1.
        n.ingest.set_cost(0, 0.0, 1000.0)
        n.ingest.set_cost(1, 4500.0, 1000.0)
        assert n.ingest.cost(0) == (0.0, 1000.0) and n.ingest.cost(2) is None
        depths = [_deliver_one(n, rid) for rid in range(7)]
        assert depths[:5] == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 0)]
        assert depths[5] == (5, 1)  # 6000 on 0 against 5500 on 1
        assert depths[6] == (6, 1)  # 6000 on 0 against 6500 on 1
        # A queue without a cost model puts the app back on least-loaded routing.
        n.ingest.clear_cost(1)
        assert n.ingest.cost(1) is None
        assert _deliver_one(n, 7) == (6, 2)
    finally:
        n.close()


def test_cost_model_arguments_are_checked() -> None:
    n = Node(consumers=2)
    try:
        for bad in ((0, float("nan"), 1.0), (0, 1.0, -1.0), (0, 1.0, float("inf"))):
            with pytest.raises(ValueError, match="finite"):
                n.ingest.set_cost(*bad)
        with pytest.raises(ValueError, match="out of range"):
            n.ingest.set_cost(2, 0.0, 1.0)
        with pytest.raises(ValueError, match="out of range"):
            n.ingest.cost(-1)
    finally:
        n.close()


@pytest.mark.slow
def test_fuzzed_answer_ring_entries_never_crash_the_ingest_nor_answer_a_held_request() -> None:
    """A consumer writing nonsense into its answer ring (random entries, lengths, fillers, tails that
    are unaligned, short of a header or a ring ahead): each drain counts it and moves on; the ring
    is small so positions near its end (where a header would not fit) come up often."""
    cap = 4096
    n = Node(answer_ring_bytes=cap)
    try:
        n.send(wire.encode_request(APP, 1, _body(1)))
        recs = n.take(1)
        lay = n.pool.layout
        data = np.frombuffer((ctypes.c_uint8 * lay["total_size"]).from_address(n.pool.address), np.uint8)
        ring = data[lay["answers_offset"]:lay["answers_offset"] + cap]
        ctl = lay["rings_offset"] + 2 * 192  # consumer 0: deliver ring, release ring, then AnswerCtl
        head_word = data[ctl:ctl + 8].view(np.uint64)
        tail_word = data[ctl + 64:ctl + 72].view(np.uint64)
        rng = np.random.default_rng(14)
        for i in range(400):
            tail = int(tail_word[0])
            pos = tail % cap
            room = cap - pos
            kind = i % 4
            if kind == 0:  # random bytes
                k = int(rng.integers(1, room + 1))
                ring[pos:pos + k] = rng.integers(0, 256, k, dtype=np.uint8)
                delta = int(rng.integers(1, 2 * cap))
            else:  # a header with plausible, edge or wrong fields
                rec = int(rng.choice([int(recs[0]), 0xFFFFFFFF, int(rng.integers(0, 2**32))]))
                entry_len = int(rng.choice([0, 7, 24, 32, 64, room, room + 32, cap, int(rng.integers(0, 2**32))]))
                body_len = int(rng.choice([0, 8, entry_len, int(rng.integers(0, 2**32))]))
                hdr = np.array([rec, int(rng.integers(0, 2**32)), entry_len, body_len, 0, 0], np.uint32)
                raw = hdr.view(np.uint8)[:min(24, room)]
                ring[pos:pos + raw.size] = raw
                delta = int(rng.choice([entry_len % (2 * cap), 32, 8, 24, room, cap + 32]))
            tail_word[0] = np.uint64(tail + delta)
            # The ingest drains the ring (a wake is not needed: it drains whenever it looks at answers).
            n.wait(lambda c, t=tail + delta: int(head_word[0]) == t)
            assert n.ingest.running
        c = n.ingest.counters()
        assert c["bad_answers"] > 0 and c["responses_sent"] == 0 and c["requests_answered"] == 0
        # The held request was never answered by the nonsense; taken back, it is answered once.
        n.ingest.reclaim(0, requeue=False)
        assert n.responses(1)[0].status == Status.INSTANCE_FAILED
        c = n.wait(lambda c: c["requests_reclaimed_failed"] == 1)
        assert c["requests_answered"] == 0 and c["responses_sent"] == 1
        # The reclaim left the ring clean for the consumer's next process.
        assert int(head_word[0]) == int(tail_word[0]) and int(tail_word[0]) % 32 == 0
        n.ingest.set_route(APP, [0])
        n.send(wire.encode_request(APP, 2, _body(2)))
        recs = n.take(1)
        n.pool.consumer(0).answer_status(recs, n.pool.requests(recs), Status.OK)
        assert n.responses(1)[0].request_id == 2
    finally:
        n.close()


def test_a_consumer_refuses_to_answer_into_a_ring_whose_control_words_are_corrupt(node: Node) -> None:
    node.send(wire.encode_request(APP, 1, _body(1)))
    recs = node.take(1)
    lay = node.pool.layout
    data = np.frombuffer((ctypes.c_uint8 * lay["total_size"]).from_address(node.pool.address), np.uint8)
    ctl = lay["rings_offset"] + 2 * 192
    data[ctl + 64:ctl + 72].view(np.uint64)[0] = 7  # an unaligned tail, one the ingest cannot have left
    with pytest.raises(RuntimeError, match="corrupt"):
        node.pool.consumer(0).answer_status(recs, node.pool.requests(recs), Status.OK)
    node.wait(lambda c: c["bad_answers"] == 1)  # and the ingest counted it and moved on


def test_a_datagram_sent_after_set_route_returns_is_routed_by_it() -> None:
    """The route is read after the receive: while the ingest thread is kept looping by a stream of
    datagrams for another app, an app's route is taken away and given back, then a request is sent;
    it must be delivered every time (never refused as unknown_app by the route of before)."""
    n = Node()
    stop = threading.Event()

    def noise() -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        d = wire.encode_request(APP + 1, 1, _body(0, 64))[0]
        try:
            while not stop.is_set():
                s.sendto(d, n.addr)
        finally:
            s.close()

    t = threading.Thread(target=noise, daemon=True)
    t.start()
    try:
        c = n.pool.consumer(0)
        for rid in range(1000):
            n.ingest.set_route(APP, [])
            n.ingest.set_route(APP, [0])
            n.send(wire.encode_request(APP, rid, _body(rid, 64)))
            recs = n.take(1)
            c.answer_status(recs, n.pool.requests(recs), Status.OK)
        assert n.ingest.counters()["drop_unknown_app"] > 0  # the noise was there
    finally:
        stop.set()
        t.join(REACT_S)
        n.close()


# In-process requests (Ingest.submit, the front door's way in): placed in the pool, answered back in-process.


def _local(port: LocalPort, n: int, timeout_s: float = REACT_S) -> dict[int, Any]:
    """Wait (on the port's fd, as the front door does) until n answers came; each token at most once."""
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        select.select([port.fd], [], [], max(0.0, deadline - time.monotonic()))
        for a in port.take():
            assert a.token not in out, f"token {a.token} answered twice"
            out[a.token] = a
    assert len(out) == n, f"got {len(out)} of {n} answers"
    return out


def _no_more_local(port: LocalPort) -> None:
    assert select.select([port.fd], [], [], 0.3)[0] == [] or port.take() == []


def test_submitted_rows_are_gathered_and_answered_in_process(node: Node) -> None:
    port = node.ingest.local_port()
    rows = np.random.default_rng(0).standard_normal((3, 1250)).astype(np.float32)  # 5000 bytes: 5 chunks each
    port.submit(APP, rows, token0=100, deadline_us=7000)
    recs = node.take(3)
    info = node.pool.requests(recs)
    assert sorted(info["request_id"].tolist()) == [100, 101, 102]
    assert (info["deadline_us"] == 7000).all() and (info["total_len"] == 5000).all()
    x = np.empty((3, 1250), np.float32)
    node.pool.gather(recs, x)
    np.testing.assert_array_equal(x, rows[info["request_id"] - 100])
    cons = node.pool.consumer(0)
    cons.answer(recs[:2], info[:2], Status.OK, x[:2] * 2)
    cons.answer_status(recs[2:], info[2:], Status.DEADLINE_MISSED)
    got = _local(port, 3)
    by_rec = dict(zip(info["request_id"].tolist(), range(3), strict=True))
    for tok in info["request_id"][:2].tolist():
        assert got[tok].status == Status.OK
        np.testing.assert_array_equal(got[tok].output, rows[tok - 100] * 2)
        assert 0 < got[tok].placed_ns <= got[tok].answered_ns <= time.monotonic_ns()
    last = int(info["request_id"][2])
    assert got[last].status == Status.DEADLINE_MISSED and got[last].output is None and by_rec[last] == 2
    c = node.wait(lambda c: c["free_slots"] == 2048)
    assert c["local_submitted"] == c["local_answered"] == 3 and c["requests_answered"] == 3
    assert c["responses_sent"] == 0 and c["packets_received"] == 0 and c["bad_answers"] == 0
    _no_more_local(port)
    _no_more_datagrams(node)


def test_submitted_rows_refused_at_admission_get_one_answer_each() -> None:
    n = Node(slot_count=16, record_count=8, max_chunks=8)
    try:
        port = n.ingest.local_port()
        port.submit(APP + 1, np.zeros((2, 100), np.uint8), token0=1)  # no route
        port.submit(APP, np.zeros((1, 9 * 1100), np.uint8), token0=3)  # more chunks than a record maps
        got = _local(port, 3)
        assert [got[t].status for t in (1, 2, 3)] == [Status.UNKNOWN_APP] * 2 + [Status.BAD_REQUEST]
        assert got[1].placed_ns == 0
        # 3 slots a row, 16 slots: five rows fit, the sixth is refused whole (OVERLOADED).
        port.submit(APP, np.zeros((6, 3000), np.uint8), token0=10)
        got = _local(port, 1)
        assert got[15].status == Status.OVERLOADED
        recs = n.take(5)
        n.pool.consumer(0).answer_status(recs, n.pool.requests(recs), Status.INTERNAL)
        got = _local(port, 5)
        assert sorted(got) == [10, 11, 12, 13, 14] and {a.status for a in got.values()} == {Status.INTERNAL}
        c = n.wait(lambda c: c["free_slots"] == 16)
        assert c["local_submitted"] == c["local_answered"] == 9 and c["requests_rejected_pool_full"] == 1
        _no_more_local(port)
    finally:
        n.close()


def test_submitted_rows_held_by_a_dead_consumer_are_requeued_or_fail_once() -> None:
    """answer_drops=False silences refusals to UDP clients, never an in-process answer."""
    pool = PacketPool.create(slot_count=256, record_count=16, max_chunks=8, consumer_count=2)
    ing = Ingest(pool, [("127.0.0.1", 0)], timeout_ms=REACT_S * 1000, answer_drops=False).start()
    port = ing.local_port()
    try:
        ing.set_route(APP, [0])
        port.submit(APP, np.arange(4 * 2000, dtype=np.uint8).reshape(4, 2000) % 251, token0=1)
        # It holds two (the ingest may deliver them one at a time on a busy machine), two stay queued,
        # then it dies.
        deadline, held = time.monotonic() + REACT_S, []
        while len(held) < 2 and time.monotonic() < deadline:
            held += pool.consumer(0).poll(2 - len(held), 100).tolist()
        assert len(held) == 2
        ing.set_route(APP, [0, 1])
        assert ing.reclaim(0, requeue=True) == (0, 4)
        deadline, got = time.monotonic() + REACT_S, []
        while len(got) < 4 and time.monotonic() < deadline:
            got += pool.consumer(1).poll(8, 100).tolist()
        recs = np.array(got[:2], np.uint32)
        pool.consumer(1).answer(recs, pool.requests(recs), Status.OK, np.ones((2, 10), np.float32))
        assert ing.reclaim(1, requeue=True) == (2, 0)  # nowhere left to go
        ans = _local(port, 4)
        assert sorted(a.status for a in ans.values()) == [Status.OK] * 2 + [Status.INSTANCE_FAILED] * 2
        # A submitted request given back unanswered (release) is answered too: as an error.
        ing.set_route(APP, [0])
        port.submit(APP, np.zeros((1, 10), np.uint8), token0=50)
        deadline, rel = time.monotonic() + REACT_S, np.zeros(0, np.uint32)
        while not rel.size and time.monotonic() < deadline:
            rel = pool.consumer(0).poll(1, 100)
        pool.consumer(0).release(rel)
        assert _local(port, 1)[50].status == Status.INTERNAL
        c = ing.counters()
        assert c["local_submitted"] == c["local_answered"] == 5 and c["responses_sent"] == 0
        _no_more_local(port)
    finally:
        ing.stop()
        pool.close()


def _child_take_then_die(pool_name: str, n_answer: int, n_hold: int) -> None:
    """An instance that answers part of the front door's requests it holds and is killed (no clean-up)."""
    pool = PacketPool.attach(pool_name)
    cons = pool.consumer(1)
    got: list[int] = []
    deadline = time.monotonic() + REACT_S
    while len(got) < n_hold and time.monotonic() < deadline:
        got += cons.poll(16, 100).tolist()
    recs = np.array(got, np.uint32)
    info = pool.requests(recs)
    cons.answer(recs[:n_answer], info[:n_answer], Status.OK, np.ones((n_answer, 300), np.float32))
    os._exit(0)


@pytest.mark.slow
def test_a_consumer_process_killed_holding_submitted_rows_answers_each_once() -> None:
    n = Node()
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_child_take_then_die, args=(n.pool.name, 2, 6))
    try:
        n.ingest.set_route(APP, [1])
        p.start()
        port = n.ingest.local_port()
        port.submit(APP, np.ones((6, 4000), np.float32), token0=1)
        p.join(timeout=REACT_S + 60)
        assert p.exitcode == 0
        n.ingest.reclaim(1, requeue=False)
        got = _local(port, 6)
        assert sorted(got) == list(range(1, 7))
        assert sorted(a.status for a in got.values()) == [Status.OK] * 2 + [Status.INSTANCE_FAILED] * 4
        _no_more_local(port)
        _no_more_datagrams(n)
    finally:
        if p.is_alive():
            p.kill()
        p.join()
        n.close()


def test_submit_refuses_bad_arguments_with_the_value() -> None:
    n = Node()
    try:
        rows = np.zeros((1, 8), np.float32)
        port = n.ingest.local_port()
        with pytest.raises(ValueError, match="70000"):
            port.submit(70000, rows, token0=1)
        with pytest.raises(ValueError, match="deadline_us"):
            port.submit(APP, rows, token0=1, deadline_us=-1)
        with pytest.raises(ValueError, match="token0"):
            port.submit(APP, rows, token0=-1)
        with pytest.raises(ValueError, match="non-empty"):
            port.submit(APP, np.zeros((0, 8), np.float32), token0=1)
        with pytest.raises(ValueError, match="float64"):
            port.submit(APP, np.zeros((1, 8)), token0=1)
        assert n.ingest.counters()["local_submitted"] == 0
    finally:
        n.close()


def test_submit_without_the_receive_thread_places_at_once() -> None:
    pool = PacketPool.create(slot_count=64, record_count=8, max_chunks=8, consumer_count=1)
    ing = Ingest(pool, [("127.0.0.1", 0)])
    port = ing.local_port()
    try:
        ing.set_route(APP, [0])
        port.submit(APP, np.full((2, 1500), 3, np.uint8), token0=1)
        recs = pool.consumer(0).poll(4, 0)
        assert recs.size == 2
        x = np.empty((2, 1500), np.uint8)
        pool.gather(recs, x)
        assert (x == 3).all()
    finally:
        ing.stop()
        pool.close()


def test_each_port_gets_its_own_answers_and_a_closed_one_none() -> None:
    n = Node()
    try:
        a, b = n.ingest.local_port(), n.ingest.local_port()
        assert a.index != b.index and a.fd != b.fd
        a.submit(APP, np.zeros((2, 100), np.uint8), token0=1)
        b.submit(APP, np.ones((1, 100), np.uint8), token0=1)  # the same token at another port
        recs = n.take(3)
        info = n.pool.requests(recs)
        cons = n.pool.consumer(0)
        cons.answer(recs, info, Status.OK, n.pool.requests(recs)["total_len"].reshape(3, 1).astype(np.float32))
        assert sorted(_local(a, 2)) == [1, 2] and sorted(_local(b, 1)) == [1]
        b.close()
        a.submit(APP, np.zeros((1, 100), np.uint8), token0=9)
        c = n.ingest.local_port()  # takes b's place
        b.close()  # closing twice does nothing
        recs = n.take(1)
        cons.answer_status(recs, n.pool.requests(recs), Status.INTERNAL)
        assert _local(a, 1)[9].status == Status.INTERNAL
        _no_more_local(c)
        a.close()
        c.submit(APP, np.zeros((1, 100), np.uint8), token0=5)
        c.close()  # closed while its request is held: the answer is dropped and counted
        recs = n.take(1)
        cons.answer_status(recs, n.pool.requests(recs), Status.INTERNAL)
        cnt = n.wait(lambda k: k["local_dropped"] == 1)
        assert cnt["local_submitted"] == 5 and cnt["local_answered"] == 4 and cnt["responses_sent"] == 0
    finally:
        n.close()


def _answer_all(node: Node, n: int, floats: int) -> np.ndarray:
    """Take n requests and answer each OK with a row of ``floats`` values marking its request id."""
    recs = node.take(n)
    info = node.pool.requests(recs)
    rows = np.stack([np.arange(floats, dtype=np.float32) + int(r) for r in info["request_id"]])
    node.pool.consumer(0).answer(recs, info, Status.OK, rows)
    return info["request_id"]


def test_answers_to_a_receiver_that_will_not_take_them_are_held_then_arrive_once() -> None:
    """Answers the socket refuses (a full send buffer, played by the fault seam: loopback never
    fills one, the kernel drops for a slow receiver instead) are held, not lost; another client's
    answers keep flowing meanwhile; once the receiver takes them each arrives exactly once."""
    node = Node()
    other = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        other.bind(("127.0.0.1", 0))
        other.settimeout(REACT_S)
        node.ingest.block_answers_to(node.client.getsockname()[1])
        for rid in range(6):
            node.send(wire.encode_request(APP, rid, _body(rid)))
        _answer_all(node, 6, 3000)
        held = 6 * -(-3000 * 4 // node.pool.layout["max_payload"])  # datagrams of six 12000-byte answers
        c = node.wait(lambda c: c["held_answers"] == held and c["requests_answered"] == 6)  # counted apart: wait for both
        assert c["requests_answered"] == 6 and c["answers_expired"] == 0 and c["response_send_errors"] == 0
        # Another client is served while the first one's answers wait.
        for rid in range(100, 103):
            for d in wire.encode_request(APP, rid, _body(rid)):
                other.sendto(d, node.addr)
        _answer_all(node, 3, 10)
        asm, theirs = wire.ResponseAssembler(), []
        while len(theirs) < 3:
            r = asm.feed(other.recv(65536))
            if r is not None:
                theirs.append(r)
        assert sorted(r.request_id for r in theirs) == [100, 101, 102]
        assert node.ingest.counters()["held_answers"] == held
        node.ingest.block_answers_to(0)  # the receiver drains its buffer
        got = _by_id(node.responses(6))
        for rid in range(6):
            assert got[rid].status == Status.OK
            np.testing.assert_array_equal(got[rid].array(), np.arange(3000, dtype=np.float32) + rid)
        c = node.wait(lambda c: c["held_answers"] == 0 and c["free_slots"] == 2048)
        assert c["answers_expired"] == 0 and c["response_send_errors"] == 0
        _no_more_datagrams(node)
    finally:
        other.close()
        node.close()


def test_held_answers_past_their_deadline_are_counted_expired_and_never_sent() -> None:
    node = Node()
    try:
        node.ingest.block_answers_to(node.client.getsockname()[1])
        for rid in range(4):
            node.send(wire.encode_request(APP, rid, _body(rid), deadline_us=20_000))
        _answer_all(node, 4, 3000)
        held = 4 * -(-3000 * 4 // node.pool.layout["max_payload"])
        c = node.wait(lambda c: c["answers_expired"] == held and c["held_answers"] == 0)
        assert c["requests_answered"] == 4 and c["response_send_errors"] == 0 and c["responses_sent"] == 0
        node.ingest.block_answers_to(0)
        _no_more_datagrams(node)
        # The ingest goes on: the next request is answered at once.
        node.send(wire.encode_request(APP, 9, _body(9)))
        _answer_all(node, 1, 4)
        assert node.responses(1)[0].request_id == 9
    finally:
        node.close()


def test_answer_hold_arguments_are_checked() -> None:
    pool = PacketPool.create(slot_count=64, record_count=8, max_chunks=8, consumer_count=1)
    try:
        with pytest.raises(ValueError, match="answer_hold_ms"):
            Ingest(pool, answer_hold_ms=0)
        with pytest.raises(ValueError, match="answer_hold_bytes"):
            Ingest(pool, answer_hold_bytes=-1)
        ing = Ingest(pool)
        with pytest.raises(ValueError, match="port"):
            ing.block_answers_to(70000)
    finally:
        pool.close()
