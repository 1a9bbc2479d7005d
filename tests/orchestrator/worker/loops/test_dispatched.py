"""The dispatched serving mode against a real pool and ingest, in this process: each RunBatch takes exactly
what it names, a DAG app's later stages hold what an earlier one routed there, and every request id is
answered once."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

from gpuprims import wire
from gpuprims.ingest import Ingest, packet_balance
from gpuprims.pool import PacketPool
from gpuprims.wire import Status
from orchestrator.control.messages import BatchDone, RunBatch
from orchestrator.control.records import StageSpec
from orchestrator.control.spec import InstanceSpec
from orchestrator.worker.loops import DispatchedLoop, serving_loop
from orchestrator.worker.zoo_runner import AppRunner

SHAPE = (3, 32, 32)
APP = 1
STAGES = (StageSpec("router", "recog_router", ("face", "car")), StageSpec("face", "vgg_face"),
          StageSpec("car", "resnet_car"))


class _Rig:
    """A dispatched loop over a pool whose ingest listens on loopback, and a client socket."""

    def __init__(self, stages: tuple[StageSpec, ...] | None) -> None:
        self.pool = PacketPool.create(slot_count=1024, record_count=64, max_chunks=64, consumer_count=1)
        self.ing = Ingest(self.pool, [("127.0.0.1", 0)]).start()
        self.ing.set_route(APP, [0])
        self.spec = InstanceSpec(name="d-0", app="d", app_id=APP, model="mobilenet_v2" if stages is None else "",
                                 pool=self.pool.name, consumer=0, input_shape=SHAPE, num_classes=10 if stages is None
                                 else None, seed=3, slo_ms=60_000.0, max_batch=8, warmup=False, dispatched=True,
                                 profile_batches=[1], stages=stages)
        self.runner = AppRunner(self.spec)
        self.runner.init_device(100)
        self.runner.install(self.runner.build(self.runner.device))
        self.loop = serving_loop(self.spec, self.pool, self.runner)
        self.loop.attach(self.runner.open_seams(self.pool))
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.asm = wire.ResponseAssembler()
        self.got: dict[int, wire.Response] = {}

    def send(self, rids: range) -> None:
        for rid in rids:
            x = np.random.default_rng(rid).random(SHAPE, dtype=np.float32)
            for d in wire.encode_request(APP, rid, x):
                self.sock.sendto(d, ("127.0.0.1", self.ing.ports[0]))
        deadline = time.monotonic() + 30
        while self.loop.consumer.depth() < len(rids):  # the scheduler sends RunBatch for what it saw queued
            assert time.monotonic() < deadline, f"{self.loop.consumer.depth()} of {len(rids)} reached the ring"
            time.sleep(0.005)

    def receive(self, n: int) -> dict[int, wire.Response]:
        """Wait for n more answers; a request id answered twice fails."""
        want = len(self.got) + n
        self.sock.settimeout(0.05)
        deadline = time.monotonic() + 30
        while len(self.got) < want and time.monotonic() < deadline:
            try:
                r = self.asm.feed(self.sock.recv(65536))
            except TimeoutError:
                continue
            if r is not None:
                assert r.request_id not in self.got, f"request {r.request_id} answered twice"
                self.got[r.request_id] = r
        assert len(self.got) == want, f"{len(self.got)} of {want} answered"
        return self.got

    def close(self) -> None:
        self.sock.close()
        self.runner.close()
        self.loop.close()
        self.runner.close_stream()
        self.ing.stop()
        self.pool.close()


@pytest.fixture
def rig() -> Iterator[_Rig]:
    r = _Rig(None)
    yield r
    r.close()


@pytest.fixture
def dag() -> Iterator[_Rig]:
    r = _Rig(STAGES)
    yield r
    r.close()


def _run(r: _Rig, id: int, stage: str, batch: int, action: str = "run") -> BatchDone:
    return r.loop.run_batch(RunBatch(instance=r.spec.name, id=id, stage=stage, batch=batch, action=action))


def test_a_dispatched_spec_gets_the_dispatched_loop_which_does_not_batch_on_its_own(rig: _Rig) -> None:
    assert type(rig.loop) is DispatchedLoop
    with pytest.raises(ValueError, match="a dispatched instance serves only what RunBatch names"):
        rig.loop.step()


def test_each_run_batch_takes_exactly_what_it_names_and_every_request_is_answered_once(rig: _Rig) -> None:
    rig.send(range(5))
    done = _run(rig, 1, "main", 3)
    assert (done.id, done.taken, done.error, done.routed) == (1, 3, "", {}) and done.measured_ms > 0
    assert rig.loop.consumer.depth() == 2  # the rest stays in the ring for the next RunBatch
    done = _run(rig, 2, "main", 2)
    assert done.taken == 2
    got = rig.receive(5)
    assert sorted(got) == list(range(5)) and {r.status for r in got.values()} == {Status.OK}
    assert rig.loop.stats.batch_sizes == {3: 1, 2: 1} and rig.loop.stats.counts["ok"] == 5
    assert _run(rig, 3, "main", 1).taken == 0  # nothing queued: taken 0 after a short wait
    assert packet_balance(rig.ing.counters()) == 0


def test_a_rejected_batch_is_answered_deadline_missed_and_an_unknown_stage_takes_nothing(rig: _Rig) -> None:
    rig.send(range(2))
    done = _run(rig, 1, "main", 2, action="reject")
    assert done.taken == 2 and done.measured_ms == 0.0
    assert {r.status for r in rig.receive(2).values()} == {Status.DEADLINE_MISSED}
    assert rig.loop.stats.counts["deadline_missed"] == 2
    done = _run(rig, 2, "nope", 1)
    assert done.taken == 0 and done.error == "unknown stage 'nope'"


@pytest.mark.slow  # builds three zoo models
def test_a_dag_stage_holds_what_the_router_sent_there_until_its_run_batch_or_the_drain(dag: _Rig) -> None:
    n = 16
    dag.send(range(n))
    routed: dict[str, int] = {}
    for i in range(2):  # the scheduler's batches are at most max_batch (8)
        done = _run(dag, i, "router", 8)
        assert done.taken == 8
        for stage, deadlines in done.routed.items():
            routed[stage] = routed.get(stage, 0) + len(deadlines)
    held = sum(routed.values())
    assert held and set(routed) <= {"face", "car"}  # the inputs (seed 3) reach a branch
    assert dag.loop.held() == held
    answered_by_router = n - held
    dag.receive(answered_by_router)
    first = sorted(routed)[0]
    take = min(8, routed[first])
    done = _run(dag, 2, first, take)  # one branch by its RunBatch
    assert done.taken == take and done.routed == {}
    dag.receive(take)
    assert dag.loop.held() == held - take
    drained = dag.loop.drain()  # what the branches still hold by the drain, as at Finish
    assert drained == held - take and dag.loop.held() == 0
    got = dag.receive(drained)
    assert sorted(got) == list(range(n)) and {r.status for r in got.values()} == {Status.OK}
    assert packet_balance(dag.ing.counters()) == 0
