"""The adaptive serving mode of an instance against a real pool and ingest, in this process (no orchestrator):
expiry and its probe, early drop, the gather's refusals, the stage clock, closed loops, bursts, MultiStream
queries and OIP requests of several rows."""

from __future__ import annotations

import collections
import concurrent.futures
import math
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest

from gpuprims import wire
from gpuprims.batching import BatchDecision, LatencyModel
from gpuprims.client import Client, Result
from gpuprims.cuda.errors import CudaError
from gpuprims.ingest import Ingest, LocalAnswer
from gpuprims.stats import STAGES
from gpuprims.wire import Status
from orchestrator.worker.instance import Instance
from orchestrator.worker.loops import base as loops_base
from orchestrator.worker.loops.base import CONTEXT_LOST_EXIT, LATENCY_MEMORY_S, PROBE_AFTER_S
from tests.orchestrator.worker.inproc import SHAPE, answer, send, send_body, serve_all, step_until


@pytest.mark.slow
def test_pessimistic_latency_model_recovers_through_a_probe(setup: tuple[Instance, Ingest, socket.socket]) -> None:
    inst, ing, sock = setup
    for _ in range(40):
        inst.policy.observe(1, 10_000.0)  # one bad stretch: every request now "cannot make it"
    assert inst.policy.expired(0.0, inst.spec.slo_ms)
    # Nothing has run for a while, so the request goes through as a probe instead of expiring.
    send(ing, sock, 1)
    assert answer(inst, sock).status == Status.OK
    # Right after a run the (still pessimistic) prediction is trusted: a new request expires.
    send(ing, sock, 2)
    assert answer(inst, sock).status == Status.DEADLINE_MISSED
    # Once the prediction is stale again, the next request is served and measured.
    time.sleep(PROBE_AFTER_S + 0.1)
    send(ing, sock, 3)
    assert answer(inst, sock).status == Status.OK


def test_a_spell_of_slow_batches_is_forgotten_once_it_is_old(setup: tuple[Instance, Ingest, socket.socket]) -> None:
    inst, ing, sock = setup
    over = time.monotonic() - LATENCY_MEMORY_S - 1.0
    for _ in range(40):  # slow batches measured more than LATENCY_MEMORY_S ago (a neighbour's start-up)
        inst.policy.model.observe(1, 10_000.0, at_s=over)
    send(ing, sock, 1)
    assert answer(inst, sock).status == Status.OK
    # Right after a run, and yet served: the spell no longer predicts a miss.
    send(ing, sock, 2)
    assert answer(inst, sock).status == Status.OK
    assert inst.policy.model.samples(1) == 2 and inst.policy.predict(1) < 10_000.0


def test_a_backlog_gives_up_its_head_so_a_full_batch_makes_it(setup: tuple[Instance, Ingest, socket.socket]) -> None:
    inst, ing, sock = setup
    # Six requests whose own deadline is 33 ms, then six with the app's SLO (seconds); batches take 6 ms
    # alone and 16 ms full (4). All 25 ms old, the short ones allow batches of one only, and a full
    # batch right after one would end too late for them, while a full batch of the others is in
    # time: the six short ones are given up on (DEADLINE_MISSED) instead of holding up the rest.
    x = np.random.default_rng(0).random(SHAPE, dtype=np.float32)
    for rid in range(12):
        for d in wire.encode_request(1, rid, x, deadline_us=33_000 if rid < 6 else 0):
            sock.sendto(d, ("127.0.0.1", ing.ports[0]))
    deadline = time.monotonic() + 10
    while len(inst.queue) < 12 and time.monotonic() < deadline:
        inst._pull(50)
    assert len(inst.queue) == 12
    inst.policy.model = LatencyModel(profile={1: 6.0, 4: 16.0})
    now = time.monotonic_ns()
    for i in range(len(inst.queue)):  # the instance's own copies of the records: set their ages exactly
        inst.queue.set_first_ns(i, now - 25_000_000)
    inst._early_drop(now)
    assert len(inst.queue) == 6 and inst.stats.counts["early_dropped"] == 6
    got: dict[int, int] = {}
    asm = wire.ResponseAssembler()
    sock.settimeout(5.0)
    while len(got) < 6:
        r = asm.feed(sock.recv(65536))
        if r is not None:
            got[r.request_id] = r.status
    assert got == {rid: Status.DEADLINE_MISSED for rid in range(6)}
    # Without a backlog nothing is given up.
    inst._early_drop(now)
    assert len(inst.queue) == 6


def test_expire_tolerates_a_request_newer_than_its_clock(setup: tuple[Instance, Ingest, socket.socket]) -> None:
    inst, ing, sock = setup
    send(ing, sock, 7)
    deadline = time.monotonic() + 5
    while not inst.queue and time.monotonic() < deadline:
        inst._pull(50)
    assert inst.queue
    before = inst.queue.first_ns(0) - 1_000_000  # a clock read taken before the arrival
    inst._expire(before)  # must not raise on the negative age
    assert len(inst.queue) == 1
    assert answer(inst, sock).status == Status.OK


def test_gather_answers_a_body_of_the_wrong_size_or_dtype_bad_request(
        setup: tuple[Instance, Ingest, socket.socket]) -> None:
    inst, ing, sock = setup
    n = int(np.prod(SHAPE))
    # float32 bytes of the right size, but sent as uint8 elements: not this app's input
    wrong_dtype = np.zeros(4 * n, np.uint8)
    send_body(ing, sock, 1, wrong_dtype)
    assert answer(inst, sock).status == Status.BAD_REQUEST
    # the right dtype, the wrong size
    send_body(ing, sock, 2, np.zeros(n // 2, np.float32))
    assert answer(inst, sock).status == Status.BAD_REQUEST
    # untyped bytes of the right size are taken as the app's float32 input
    x = np.random.default_rng(3).random(SHAPE, dtype=np.float32)
    send_body(ing, sock, 3, x.tobytes())
    r = answer(inst, sock)
    assert r.status == Status.OK and r.array().shape == (10,)
    assert inst.stats.counts["error"] == 2 and inst.stats.counts["ok"] == 1


def test_stage_breakdown_of_a_served_batch_is_in_the_stats(setup: tuple[Instance, Ingest, socket.socket]) -> None:
    inst, ing, sock = setup
    send(ing, sock, 11)
    assert answer(inst, sock).status == Status.OK
    snap = inst.stats.snapshot(0, 0)
    stages = snap["stages"]
    assert stages["batches"] == 1
    ms = {s: stages[s]["p50_ms"] for s in STAGES}
    # Every stage the batch went through took some time; a float32 app has no preprocessing.
    for s in ("reassembly", "delivery", "wait", "gather", "model", "respond"):
        assert ms[s] > 0, (s, ms)
    assert ms["preprocess"] >= 0
    # The stages cover the request's whole life: together they span at least what the instance measured
    # from its first datagram to its answer (the respond stage ends just after that measurement does),
    # and the model stage encloses the model call the instance times.
    assert sum(ms.values()) >= snap["p50_ms"] - 1e-3  # stage figures are rounded to 0.1 us
    assert ms["model"] >= inst.stats.model_ms.last() - 1e-3


def test_a_step_that_just_took_requests_does_not_poll_the_ring_again(
        setup: tuple[Instance, Ingest, socket.socket]) -> None:
    inst, ing, sock = setup
    polls: list[float] = []
    pull = inst.queue.pull

    def counting(max_n: int, timeout_us: int, spin_us: int = 50) -> list[float]:
        polls.append(timeout_us / 1000)
        return pull(max_n, timeout_us, spin_us)

    inst.queue.pull = counting  # the local queue's poll of the ring
    send(ing, sock, 21)
    deadline = time.monotonic() + 10
    while inst.stats.counts["ok"] == 0 and time.monotonic() < deadline:
        polls.clear()
        inst.step(max_wait_ms=10)
    assert inst.stats.counts["ok"] == 1
    assert polls == [10]  # the step that served it polled once (waiting), not once more with timeout 0


def test_a_batch_that_all_expired_leaves_no_stage_clock_running(setup: tuple[Instance, Ingest, socket.socket]) -> None:
    inst, ing, sock = setup
    send(ing, sock, 31)
    assert answer(inst, sock).status == Status.OK  # a batch ran just now: predictions are trusted
    for _ in range(40):
        inst.policy.observe(1, 10_000.0)  # every request now "cannot make it"
    send(ing, sock, 32)
    assert answer(inst, sock).status == Status.DEADLINE_MISSED
    assert not inst.stats.stages.running  # its wait is not carried into the next served batch
    assert inst.stats.stages.batches == 1


class _RefusingGatherer:
    """A gather with per-row verdicts (as GPU-DMA's): the host gather, refusing the batch's first row."""

    method = "refusing"

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.clock = None
        self.statuses = np.zeros(0, np.int32)

    def gather(self, recs: np.ndarray) -> object:
        x = self.inner.gather(recs)  # type: ignore[attr-defined]
        self.statuses = np.zeros(len(recs), np.int32)
        self.statuses[0] = 3  # a bad chunk header, say
        return x

    def close(self) -> None:
        self.inner.close()  # type: ignore[attr-defined]


@pytest.mark.slow
def test_rows_a_gather_refuses_are_answered_bad_request_and_the_rest_ok_once(
        setup: tuple[Instance, Ingest, socket.socket]) -> None:
    inst, ing, sock = setup
    inst.serving.gatherer = _RefusingGatherer(inst.serving.gatherer)  # type: ignore[assignment]
    inst.policy.model = LatencyModel(profile={1: 1.0, 4: 2.0})  # known and fast: the three go as one batch
    for rid in range(3):
        send(ing, sock, rid)
    deadline = time.monotonic() + 30
    while len(inst.queue) < 3 and time.monotonic() < deadline:
        inst._pull(50)
    got = serve_all(inst, sock, 3)
    statuses = sorted(int(r.status) for r in got.values())
    assert statuses == [Status.OK, Status.OK, Status.BAD_REQUEST]
    assert got[0].status == Status.BAD_REQUEST  # the oldest: the first row of the one batch of three
    assert inst.stats.counts["ok"] == 2 and inst.stats.counts["error"] == 1
    assert inst.stats.hist.request.count == 2


def test_a_failing_model_answers_its_batch_internal_once_and_the_next_batch_is_served(
        setup: tuple[Instance, Ingest, socket.socket]) -> None:
    inst, ing, sock = setup
    model = inst.runner.model

    def failing(x: object) -> object:
        raise RuntimeError("boom")

    inst.runner.model = failing
    send(ing, sock, 1)
    assert serve_all(inst, sock, 1)[1].status == Status.INTERNAL
    inst.runner.model = model
    send(ing, sock, 2)
    assert serve_all(inst, sock, 1)[2].status == Status.OK
    assert inst.stats.counts["error"] == 1 and inst.stats.counts["ok"] == 1
    assert len(inst.queue) == 0 and inst.serving.held() == 0


@pytest.mark.slow
def test_a_closed_loop_client_is_answered_without_waiting_while_an_open_loop_burst_is_batched(
        waiting: tuple[Instance, Ingest, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    inst, ing, sock = waiting
    inst.runner.warm_up(inst.policy.model)  # batch times known (and no cold first run among them)
    decisions: list[tuple[int, BatchDecision]] = []
    decide = inst.policy.decide

    def recording(queue_len: int, oldest_age_ms: float, **kw: float | None) -> BatchDecision:
        d = decide(queue_len, oldest_age_ms, **kw)
        decisions.append((queue_len, d))
        return d

    monkeypatch.setattr(inst.policy, "decide", recording)
    # A closed loop: one request at a time, the next sent once the last is answered.
    for rid in range(12):
        send(ing, sock, rid)
        assert answer(inst, sock).status == Status.OK
        if rid == 1:
            decisions.clear()  # the first two teach the policy the traffic (the first waits, as before)
    assert decisions and all(queued == 1 and d.take == 1 for queued, d in decisions), decisions
    assert dict(inst.stats.batch_sizes) == {1: 12}
    assert inst.policy.held.mean_gap_ms() == math.inf  # nothing ever came while a request was held
    # An open-loop burst: twelve at once, served once the ring holds them all.
    for rid in range(100, 112):
        send(ing, sock, rid)
    deadline = time.monotonic() + 30
    while inst.consumer.depth() < 12 and time.monotonic() < deadline:
        time.sleep(0.001)  # the ingest reassembles them
    assert inst.consumer.depth() == 12
    got = serve_all(inst, sock, 12)
    assert all(r.status == Status.OK for r in got.values()), {k: r.status for k, r in got.items()}
    burst = inst.stats.batch_sizes - collections.Counter({1: 12})
    assert sum(b * n for b, n in burst.items()) == 12 and max(burst) == 4  # batched as max_batch allows
    assert inst.policy.held.came_held() >= 11  # and learnt that requests now come while others are held


@pytest.mark.slow
def test_a_multistream_query_of_8_is_one_batch_and_single_requests_beside_it_go_at_once(
        waiting16: tuple[Instance, Ingest, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    inst, ing, _ = waiting16
    inst.runner.warm_up(inst.policy.model)
    decisions: list[tuple[int, bool, BatchDecision]] = []
    decide = inst.policy.decide

    def recording(queue_len: int, oldest_age_ms: float, **kw: Any) -> BatchDecision:
        d = decide(queue_len, oldest_age_ms, **kw)
        decisions.append((queue_len, bool(kw.get("more")), d))
        return d

    monkeypatch.setattr(inst.policy, "decide", recording)
    x = np.random.default_rng(0).random((8, *SHAPE), dtype=np.float32)
    with Client(("127.0.0.1", ing.ports[0]), timeout_s=60.0) as client:
        # Closed-loop MultiStream: queries of 8 (Client.infer_many), the next once the last is answered.
        for q in range(4):
            futs = [client.submit(1, row, more=i < 7) for i, row in enumerate(x)]  # what infer_many sends
            step_until(inst, lambda fs=futs: all(f.done() for f in fs), f"query {q} answered")
            assert [f.result().status for f in futs] == [Status.OK] * 8
        assert dict(inst.stats.batch_sizes) == {8: 4}  # one engine call per query, not eight
        assert all(d.take == 0 for n, more, d in decisions if more)  # held while more were on their way
        # infer_many itself (from a thread, the instance stepped here): one batch of 8 again.
        many: concurrent.futures.Future[list[Result]] = concurrent.futures.Future()
        t = threading.Thread(target=lambda: many.set_result(client.infer_many(1, list(x))), daemon=True)
        t.start()
        step_until(inst, many.done, "infer_many answered")
        t.join(timeout=30)
        assert [r.status for r in many.result()] == [Status.OK] * 8
        assert dict(inst.stats.batch_sizes) == {8: 5}
        # A closed loop of single requests right after: each served alone, none held for a batch.
        decisions.clear()
        for rid in range(6):
            f = client.submit(1, x[rid])
            step_until(inst, f.done, f"single {rid} answered")
            assert f.result().status == Status.OK
        assert decisions and all(n == 1 and d.take == 1 for n, _, d in decisions), decisions
        assert dict(inst.stats.batch_sizes) == {8: 5, 1: 6}
        # And a query after them (the policy now sure nothing comes while a request is held): still one
        # batch, held for its samples by their flag alone.
        futs = [client.submit(1, row, more=i < 7) for i, row in enumerate(x)]
        step_until(inst, lambda: all(f.done() for f in futs), "the last query answered")
        assert dict(inst.stats.batch_sizes) == {8: 6, 1: 6}
    assert inst.policy.held.mean_gap_ms() == math.inf  # no query ever came while another was held


@pytest.mark.slow
def test_an_oip_request_of_8_rows_is_queued_as_one_query_and_served_as_one_batch(
        waiting16: tuple[Instance, Ingest, socket.socket]) -> None:
    inst, ing, _ = waiting16
    inst.runner.warm_up(inst.policy.model)
    port = ing.local_port()
    try:
        x = np.random.default_rng(1).random((8, *SHAPE), dtype=np.float32)
        port.submit(1, x, token0=100)  # what the front door does for an inference request of batch 8
        deadline = time.monotonic() + 30
        while inst.consumer.depth() < 8 and time.monotonic() < deadline:
            time.sleep(0.001)
        inst._pull(0)
        assert len(inst.queue) == 8
        # Every row of the request but its last says more of its query follow.
        assert [inst.queue.flags(i) for i in range(8)] == [wire.FLAG_MORE] * 7 + [0]
        answers: list[LocalAnswer] = []

        def all_answered() -> bool:
            answers.extend(port.take())
            return len(answers) >= 8

        step_until(inst, all_answered, "8 answers")
        assert len(answers) == 8
        assert sorted(a.token for a in answers) == list(range(100, 108))
        assert all(a.status == Status.OK for a in answers)
        assert dict(inst.stats.batch_sizes) == {8: 1}
    finally:
        port.close()


class _Left(Exception):
    """What the test's exit_now raises instead of leaving the test process."""


def test_a_lost_cuda_context_leaves_the_batch_unanswered_for_the_node_to_requeue(
        setup: tuple[Instance, Ingest, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    """A sticky CUDA error (the weights the instance maps died with their holder: an illegal address) is
    no answer: the process leaves at once with CONTEXT_LOST_EXIT and its requests still held, so the
    supervisor requeues them to a live instance (each answered once there) instead of INTERNAL here."""
    inst, ing, sock = setup
    codes: list[int] = []

    def leave(rc: int) -> None:
        codes.append(rc)
        raise _Left

    def lost(x: object) -> object:
        raise CudaError(700, "cudaErrorIllegalAddress", "an illegal memory access was encountered", "cuda_event_query")

    monkeypatch.setattr(loops_base, "exit_now", leave)
    inst.runner.model = lost
    send(ing, sock, 1)
    with pytest.raises(_Left):
        step_until(inst, lambda: False, "the instance to leave")
    assert codes == [CONTEXT_LOST_EXIT]
    assert inst.stats.counts["error"] == 0 and inst.stats.counts["ok"] == 0  # nothing answered here
    sock.settimeout(0.2)
    with pytest.raises(TimeoutError):
        sock.recv(65536)


def test_a_cuda_error_that_keeps_the_context_answers_its_batch_internal(
        setup: tuple[Instance, Ingest, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    inst, ing, sock = setup
    monkeypatch.setattr(loops_base, "exit_now", lambda rc: pytest.fail(f"left with {rc} on a non-sticky error"))
    model = inst.runner.model

    def oom(x: object) -> object:
        raise CudaError(2, "cudaErrorMemoryAllocation", "out of memory", "cudaMalloc")

    inst.runner.model = oom
    send(ing, sock, 1)
    assert serve_all(inst, sock, 1)[1].status == Status.INTERNAL
    inst.runner.model = model
