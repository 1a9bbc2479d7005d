"""The instance's serving loop against a real pool and ingest, in this process (no orchestrator)."""

from __future__ import annotations

import collections
import concurrent.futures
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuprims import wire
from gpuprims.batching import BatchDecision, LatencyModel
from gpuprims.client import Client, Result
from gpuprims.ingest import Ingest, LocalAnswer
from gpuprims.pool import PacketPool
from gpuprims.stats import STAGES
from gpuprims.wire import Status
from orchestrator.worker import instance as instance_mod
from orchestrator.worker.instance import LATENCY_MEMORY_S, PROBE_AFTER_S, Instance, InstanceSpec
from orchestrator.worker.loops.trace import TRACE_ENV, read_trace

SHAPE = (3, 32, 32)


def _instance(slo_ms: float = 500.0, max_wait_ms: float = 0.0,
              max_batch: int = 4) -> Iterator[tuple[Instance, Ingest, socket.socket]]:
    pool = PacketPool.create(slot_count=1024, record_count=64, max_chunks=64, consumer_count=1)
    ing = Ingest(pool, [("127.0.0.1", 0)]).start()
    ing.set_route(1, [0])
    spec = InstanceSpec(name="t-0", app="t", app_id=1, model="mobilenet_v2", pool=pool.name, consumer=0,
                        input_shape=SHAPE, num_classes=10, slo_ms=slo_ms, max_batch=max_batch, max_wait_ms=max_wait_ms,
                        warmup=False)
    inst = Instance(spec, control=None)
    inst.init_compute(100)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(5.0)
    yield inst, ing, sock
    sock.close()
    inst.close()
    ing.stop()
    pool.close()


@pytest.fixture
def setup() -> Iterator[tuple[Instance, Ingest, socket.socket]]:
    yield from _instance()


@pytest.fixture
def waiting() -> Iterator[tuple[Instance, Ingest, socket.socket]]:
    """An instance that may wait up to 2 s to fill a batch of up to 4 (longer than a closed loop's turn
    takes on any machine, so the rule before waited on every request), with a deadline no busy machine
    misses (a minute), so only the batching rule decides what it does."""
    yield from _instance(slo_ms=60_000.0, max_wait_ms=2000.0)


@pytest.fixture
def waiting16() -> Iterator[tuple[Instance, Ingest, socket.socket]]:
    """`waiting` with batches of up to 16: a MultiStream query of 8 is not a full batch, so only the
    query's own signal (wire FLAG_MORE) makes the instance hold its first samples for the rest."""
    yield from _instance(slo_ms=60_000.0, max_wait_ms=2000.0, max_batch=16)


def _send(ing: Ingest, sock: socket.socket, rid: int) -> None:
    x = np.random.default_rng(rid).random(SHAPE, dtype=np.float32)
    for d in wire.encode_request(1, rid, x):
        sock.sendto(d, ("127.0.0.1", ing.ports[0]))


def _serve_all(inst: Instance, sock: socket.socket, n: int) -> dict[int, wire.Response]:
    """Step the instance until n responses arrived (each request id once) or a deadline passes."""
    asm, got = wire.ResponseAssembler(), {}
    sock.settimeout(0.01)
    deadline = time.monotonic() + 30
    while len(got) < n and time.monotonic() < deadline:
        inst.step(max_wait_ms=10)
        try:
            r = asm.feed(sock.recv(65536))
        except TimeoutError:
            continue
        if r is not None:
            assert r.request_id not in got, f"request {r.request_id} answered twice"
            got[r.request_id] = r
    assert len(got) == n, f"{len(got)} of {n} answered"
    return got


def _answer(inst: Instance, sock: socket.socket) -> wire.Response:
    """The next response (stepping the instance until it comes)."""
    return next(iter(_serve_all(inst, sock, 1).values()))


def test_pessimistic_latency_model_recovers_through_a_probe(setup: tuple[Instance, Ingest, socket.socket]) -> None:
    inst, ing, sock = setup
    for _ in range(40):
        inst.policy.observe(1, 10_000.0)  # one bad stretch: every request now "cannot make it"
    assert inst.policy.expired(0.0, 500.0)
    # Nothing has run for a while, so the request goes through as a probe instead of expiring.
    _send(ing, sock, 1)
    assert _answer(inst, sock).status == Status.OK
    # Right after a run the (still pessimistic) prediction is trusted: a new request expires.
    _send(ing, sock, 2)
    assert _answer(inst, sock).status == Status.DEADLINE_MISSED
    # Once the prediction is stale again, the next request is served and measured.
    time.sleep(PROBE_AFTER_S + 0.1)
    _send(ing, sock, 3)
    assert _answer(inst, sock).status == Status.OK


def test_a_spell_of_slow_batches_is_forgotten_once_it_is_old(setup: tuple[Instance, Ingest, socket.socket]) -> None:
    inst, ing, sock = setup
    over = time.monotonic() - LATENCY_MEMORY_S - 1.0
    for _ in range(40):  # slow batches measured more than LATENCY_MEMORY_S ago (a neighbour's start-up)
        inst.policy.model.observe(1, 10_000.0, at_s=over)
    _send(ing, sock, 1)
    assert _answer(inst, sock).status == Status.OK
    # Right after a run, and yet served: the spell no longer predicts a miss.
    _send(ing, sock, 2)
    assert _answer(inst, sock).status == Status.OK
    assert inst.policy.model.samples(1) == 2 and inst.policy.predict(1) < 10_000.0


def test_a_backlog_gives_up_its_head_so_a_full_batch_makes_it(setup: tuple[Instance, Ingest, socket.socket]) -> None:
    inst, ing, sock = setup
    # Six requests whose own deadline is 33 ms, then six with the app's 500 ms; batches take 6 ms
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
    _send(ing, sock, 7)
    deadline = time.monotonic() + 5
    while not inst.queue and time.monotonic() < deadline:
        inst._pull(50)
    assert inst.queue
    before = inst.queue.first_ns(0) - 1_000_000  # a clock read taken before the arrival
    inst._expire(before)  # must not raise on the negative age
    assert len(inst.queue) == 1
    assert _answer(inst, sock).status == Status.OK


def _send_body(ing: Ingest, sock: socket.socket, rid: int, body: np.ndarray | bytes) -> None:
    for d in wire.encode_request(1, rid, body):
        sock.sendto(d, ("127.0.0.1", ing.ports[0]))


def test_gather_answers_a_body_of_the_wrong_size_or_dtype_bad_request(
        setup: tuple[Instance, Ingest, socket.socket]) -> None:
    inst, ing, sock = setup
    n = int(np.prod(SHAPE))
    # float32 bytes of the right size, but sent as uint8 elements: not this app's input
    wrong_dtype = np.zeros(4 * n, np.uint8)
    _send_body(ing, sock, 1, wrong_dtype)
    assert _answer(inst, sock).status == Status.BAD_REQUEST
    # the right dtype, the wrong size
    _send_body(ing, sock, 2, np.zeros(n // 2, np.float32))
    assert _answer(inst, sock).status == Status.BAD_REQUEST
    # untyped bytes of the right size are taken as the app's float32 input
    x = np.random.default_rng(3).random(SHAPE, dtype=np.float32)
    _send_body(ing, sock, 3, x.tobytes())
    r = _answer(inst, sock)
    assert r.status == Status.OK and r.array().shape == (10,)
    assert inst.stats.counts["error"] == 2 and inst.stats.counts["ok"] == 1


def test_stage_breakdown_of_a_served_batch_is_in_the_stats(setup: tuple[Instance, Ingest, socket.socket]) -> None:
    inst, ing, sock = setup
    _send(ing, sock, 11)
    assert _answer(inst, sock).status == Status.OK
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
    _send(ing, sock, 21)
    deadline = time.monotonic() + 10
    while inst.stats.counts["ok"] == 0 and time.monotonic() < deadline:
        polls.clear()
        inst.step(max_wait_ms=10)
    assert inst.stats.counts["ok"] == 1
    assert polls == [10]  # the step that served it polled once (waiting), not once more with timeout 0


def test_a_batch_that_all_expired_leaves_no_stage_clock_running(setup: tuple[Instance, Ingest, socket.socket]) -> None:
    inst, ing, sock = setup
    _send(ing, sock, 31)
    assert _answer(inst, sock).status == Status.OK  # a batch ran just now: predictions are trusted
    for _ in range(40):
        inst.policy.observe(1, 10_000.0)  # every request now "cannot make it"
    _send(ing, sock, 32)
    assert _answer(inst, sock).status == Status.DEADLINE_MISSED
    assert not inst.stats.stages.running  # its wait is not carried into the next served batch
    assert inst.stats.stages.batches == 1


# -- a shadow's pre-warm when InitGpu comes first ---------------------------------------------------------------

def _prewarming(monkeypatch: pytest.MonkeyPatch, may_raise: bool) -> tuple[Instance, threading.Event]:
    """An instance whose pre-warm thread is held inside its model load until the event is set."""
    inst = Instance.__new__(Instance)  # only the pre-warm's state: no pool, no control
    inst.spec = InstanceSpec(name="s", app="a", app_id=1, model="m", pool="p", consumer=0, defer_init=True,
                             prewarm=True, warmup=False)
    inst.prewarm_state, inst.prewarm_info, inst._prewarmed = "idle", {}, None
    inst._prewarm_lock, inst._prewarm_thread = threading.Lock(), None
    release = threading.Event()

    def build(device: object) -> dict[str, object]:
        release.wait(30)
        return {"model": lambda x: x}

    monkeypatch.setattr(inst, "_build_models", build)
    monkeypatch.setattr(instance_mod, "raise_low_threads", lambda: (1, 0) if may_raise else (0, 1))
    inst.start_prewarm()
    assert inst.prewarm_state == "warming"
    return inst, release


def test_initgpu_before_the_prewarm_ends_abandons_it_when_the_thread_cannot_be_raised(
        monkeypatch: pytest.MonkeyPatch) -> None:
    inst, release = _prewarming(monkeypatch, may_raise=False)
    assert inst._take_prewarmed() is None  # the caller loads on the serving thread
    assert inst.prewarm_state == "abandoned" and inst.prewarm_info["raised"] == 0
    release.set()
    inst._prewarm_thread.join(30)
    assert inst.prewarm_state == "abandoned" and inst._prewarmed is None  # its late result is dropped


def test_initgpu_before_the_prewarm_ends_waits_for_it_when_the_thread_can_be_raised(
        monkeypatch: pytest.MonkeyPatch) -> None:
    inst, release = _prewarming(monkeypatch, may_raise=True)
    threading.Timer(0.2, release.set).start()
    built = inst._take_prewarmed()
    assert built is not None and callable(built["model"])
    assert inst.prewarm_state == "used" and inst.prewarm_info["raised"] == 1


class _Control:
    """Records what the instance sends (the heartbeat is all this test drives)."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, msg: object) -> None:
        self.sent.append(msg)


def test_a_due_heartbeat_waits_for_an_idle_moment_up_to_half_a_period(
        setup: tuple[Instance, Ingest, socket.socket]) -> None:
    inst, ing, sock = setup
    control = _Control()
    inst.control = control  # type: ignore[assignment]
    inst.spec.heartbeat_ms = 10_000.0  # the test moves the clock by hand: no beat falls due on its own
    inst._last_beat = time.monotonic()
    inst.heartbeat()
    assert control.sent == []  # not due
    inst._last_beat = time.monotonic() - 10.5  # due, within the slack
    _send(ing, sock, 1)
    deadline = time.monotonic() + 10
    while not inst.serving.busy() and time.monotonic() < deadline:
        time.sleep(0.001)  # the ingest reassembles the request into the ring
    assert inst.serving.busy()
    inst.heartbeat()
    assert control.sent == []  # a request waits: the snapshot waits for it to be served
    assert _answer(inst, sock).status == Status.OK
    inst.heartbeat()
    assert len(control.sent) == 1  # idle: sent
    (beat,) = control.sent
    assert beat.stats.ok == 1 and beat.stats.p50_ms > 0  # type: ignore[attr-defined]
    _send(ing, sock, 2)
    while not inst.serving.busy() and time.monotonic() < deadline:
        time.sleep(0.001)
    inst._last_beat = time.monotonic() - 15.5  # past the slack: sent though a request waits
    inst.heartbeat()
    assert len(control.sent) == 2
    inst.heartbeat(force=True)  # forced (Finish, Shutdown): sent at once
    assert len(control.sent) == 3
    assert _answer(inst, sock).status == Status.OK


def test_the_heartbeat_recomputes_percentiles_only_after_new_answers(
        setup: tuple[Instance, Ingest, socket.socket]) -> None:
    inst, ing, sock = setup
    _send(ing, sock, 1)
    assert _answer(inst, sock).status == Status.OK
    first = inst.serving.snapshot()
    again = inst.serving.snapshot()
    assert again["stages"] is first["stages"] and again["p99_ms"] == first["p99_ms"]  # nothing new: reused
    _send(ing, sock, 2)
    assert _answer(inst, sock).status == Status.OK
    after = inst.serving.snapshot()
    assert after["stages"] is not first["stages"] and after["stages"]["batches"] == 2 and after["ok"] == 2


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


def test_rows_a_gather_refuses_are_answered_bad_request_and_the_rest_ok_once(
        setup: tuple[Instance, Ingest, socket.socket]) -> None:
    inst, ing, sock = setup
    inst.serving.gatherer = _RefusingGatherer(inst.serving.gatherer)  # type: ignore[assignment]
    inst.policy.model = LatencyModel(profile={1: 1.0, 4: 2.0})  # known and fast: the three go as one batch
    for rid in range(3):
        _send(ing, sock, rid)
    deadline = time.monotonic() + 30
    while len(inst.queue) < 3 and time.monotonic() < deadline:
        inst._pull(50)
    got = _serve_all(inst, sock, 3)
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
    _send(ing, sock, 1)
    assert _serve_all(inst, sock, 1)[1].status == Status.INTERNAL
    inst.runner.model = model
    _send(ing, sock, 2)
    assert _serve_all(inst, sock, 1)[2].status == Status.OK
    assert inst.stats.counts["error"] == 1 and inst.stats.counts["ok"] == 1
    assert len(inst.queue) == 0 and inst.serving.held() == 0


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
        _send(ing, sock, rid)
        assert _answer(inst, sock).status == Status.OK
        if rid == 1:
            decisions.clear()  # the first two teach the policy the traffic (the first waits, as before)
    assert decisions and all(queued == 1 and d.take == 1 for queued, d in decisions), decisions
    assert dict(inst.stats.batch_sizes) == {1: 12}
    assert inst.policy.held.mean_gap_ms() == math.inf  # nothing ever came while a request was held
    # An open-loop burst: twelve at once, served once the ring holds them all.
    for rid in range(100, 112):
        _send(ing, sock, rid)
    deadline = time.monotonic() + 30
    while inst.consumer.depth() < 12 and time.monotonic() < deadline:
        time.sleep(0.001)  # the ingest reassembles them
    assert inst.consumer.depth() == 12
    got = _serve_all(inst, sock, 12)
    assert all(r.status == Status.OK for r in got.values()), {k: r.status for k, r in got.items()}
    burst = inst.stats.batch_sizes - collections.Counter({1: 12})
    assert sum(b * n for b, n in burst.items()) == 12 and max(burst) == 4  # batched as max_batch allows
    assert inst.policy.held.came_held() >= 11  # and learnt that requests now come while others are held


def _step_until(inst: Instance, done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not done() and time.monotonic() < deadline:
        inst.step(max_wait_ms=10)
    assert done(), what


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
            _step_until(inst, lambda fs=futs: all(f.done() for f in fs), f"query {q} answered")
            assert [f.result().status for f in futs] == [Status.OK] * 8
        assert dict(inst.stats.batch_sizes) == {8: 4}  # one engine call per query, not eight
        assert all(d.take == 0 for n, more, d in decisions if more)  # held while more were on their way
        # infer_many itself (from a thread, the instance stepped here): one batch of 8 again.
        many: concurrent.futures.Future[list[Result]] = concurrent.futures.Future()
        t = threading.Thread(target=lambda: many.set_result(client.infer_many(1, list(x))), daemon=True)
        t.start()
        _step_until(inst, many.done, "infer_many answered")
        t.join(timeout=30)
        assert [r.status for r in many.result()] == [Status.OK] * 8
        assert dict(inst.stats.batch_sizes) == {8: 5}
        # A closed loop of single requests right after: each served alone, none held for a batch.
        decisions.clear()
        for rid in range(6):
            f = client.submit(1, x[rid])
            _step_until(inst, f.done, f"single {rid} answered")
            assert f.result().status == Status.OK
        assert decisions and all(n == 1 and d.take == 1 for n, _, d in decisions), decisions
        assert dict(inst.stats.batch_sizes) == {8: 5, 1: 6}
        # And a query after them (the policy now sure nothing comes while a request is held): still one
        # batch, held for its samples by their flag alone.
        futs = [client.submit(1, row, more=i < 7) for i, row in enumerate(x)]
        _step_until(inst, lambda: all(f.done() for f in futs), "the last query answered")
        assert dict(inst.stats.batch_sizes) == {8: 6, 1: 6}
    assert inst.policy.held.mean_gap_ms() == math.inf  # no query ever came while another was held


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

        _step_until(inst, all_answered, "8 answers")
        assert len(answers) == 8
        assert sorted(a.token for a in answers) == list(range(100, 108))
        assert all(a.status == Status.OK for a in answers)
        assert dict(inst.stats.batch_sizes) == {8: 1}
    finally:
        port.close()


def test_a_traced_instance_writes_each_requests_stage_timestamps_in_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "trace"))
    for inst, ing, sock in _instance(slo_ms=60_000.0):  # a deadline no cold first run misses
        assert inst.serving.trace is not None
        for rid in (7, 8, 9):
            _send(ing, sock, rid)
            assert _answer(inst, sock).status == Status.OK
    rows = read_trace(tmp_path / "trace")
    assert sorted(r.request_id for r in rows) == [7, 8, 9]
    for r in rows:
        assert r.instance == "t-0" and r.batch == 1
        assert 0 < r.first_ns <= r.complete_ns <= r.woke_ns <= r.take_ns <= r.gathered_ns <= r.model_ns <= r.answered_ns


def test_an_instance_is_untraced_by_default_and_when_the_trace_directory_cannot_be_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TRACE_ENV, raising=False)
    for inst, _, _ in _instance():
        assert inst.serving.trace is None
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(TRACE_ENV, str(blocker / "trace"))
    for inst, ing, sock in _instance(slo_ms=60_000.0):
        assert inst.serving.trace is None  # logged, and served untraced
        _send(ing, sock, 1)
        assert _answer(inst, sock).status == Status.OK
