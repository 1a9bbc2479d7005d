"""The live schedulers (node.scheduler spatiotemporal / temporal) on the CPU backend.

Their rules run on played instances (tests/orchestrator/conftest.py's ``node_factory``): each says Ready
with warm-up latencies and answers every RunBatch with a BatchDone, so what the scheduler decides (shares,
runs, rejections, the replacement of a dead instance) is checked without a model. The tests marked real
check the same on real instance processes, with every answer against the model's own."""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from apps.zoo import RECOG_ROUTER_LABELS, load_model
from gpuprims import wire
from gpuprims.wire import Status
from orchestrator.config.schema import load_config
from orchestrator.control.messages import BatchDone, RunBatch
from orchestrator.control.records import NodeView
from orchestrator.control.status_format import format_status
from orchestrator.node.node import Node
from orchestrator.node.reconfig import change_gpu_pct
from tests.orchestrator.client import ask
from tests.orchestrator.conftest import NodeFactory, PlayedLauncher, played
from tests.orchestrator.fake_launcher import FakeInstance

SHAPE = (3, 32, 32)
#: The tests that serve answer 60 requests sent at once: beside two busy loops a run takes 150-250 ms, so
#: the last ones wait about 5 s for their turn, and a 5 s SLO had the scheduler (rightly) reject them. The
#: SLO is a minute so those tests check serving; the deadline tests set their own.
CONFIG = """
node:
  listen: {{host: 127.0.0.1, port: 0}}
  backend: cpu
  scheduler: {scheduler}
  round_ms: 30
  pool: {{slot_count: 4096, max_chunks: 64, record_count: 256}}
apps:
  - name: recog
    slo_ms: 60000
    max_batch: 4
    app_id: 5
    input_shape: [3, 32, 32]
    seed: 3
    stages:
      - {{name: router, model: recog_router, gpu_pct: 50, routes: [face, car]}}
      - {{name: face, model: vgg_face, gpu_pct: 50}}
      - {{name: car, model: resnet_car, gpu_pct: 50}}
  - name: cls
    model: mobilenet_v2
    slo_ms: 60000
    max_batch: 4
    app_id: 6
    gpu_pct: 50
    input_shape: [3, 32, 32]
    num_classes: 10
"""


def _oracle_recog(x: np.ndarray, models: dict[str, torch.nn.Module]) -> tuple[str, np.ndarray]:
    branches = {"person": "vgg_face", "vehicle": "resnet_car"}
    with torch.inference_mode():
        t = torch.from_numpy(x)[None]
        route = models["recog_router"](t)
        label = RECOG_ROUTER_LABELS[int(route.argmax())]
        ref = models[branches[label]](t) if label in branches else route
    return label, ref.numpy()[0]


def _settle(node: Node, timeout_s: float = 10.0) -> dict:
    """Pump the node until its scheduler has heard back about every batch it sent."""
    end = time.monotonic() + timeout_s
    while node.dispatcher.inflight and time.monotonic() < end:
        node.step(10)
    return node.status()


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("scheduler", ["spatiotemporal", "temporal"])
def test_live_scheduler_serves_dag_and_single_apps_correctly(tmp_path: Path, scheduler: str) -> None:
    p = tmp_path / "apps.yaml"
    p.write_text(CONFIG.format(scheduler=scheduler))
    node = Node(load_config(p), warmup=False).start()
    try:
        st = node.status()
        assert st["scheduler"]["name"] == scheduler
        # one dispatched instance per app, no shadows; the DAG's instance has its largest stage's share
        insts = {a: [i["gpu_pct"] for i in st["apps"][a]["instances"]] for a in ("recog", "cls")}
        assert insts == ({"recog": [50], "cls": [50]} if scheduler == "spatiotemporal"
                         else {"recog": [100], "cls": [100]})
        rng = np.random.default_rng(0)
        xs = {rid: (5 if rid % 2 else 6, rng.random(SHAPE, dtype=np.float32)) for rid in range(60)}
        got = ask(node, xs)
        st = _settle(node)
        log = list(node.dispatcher.run_log)
        ok, text = change_gpu_pct(node, "cls", 30)
    finally:
        node.stop()
    assert sorted(got) == sorted(xs)
    assert not ok and "scheduler" in text
    sch = st["scheduler"]
    assert sch["runs"] > 0 and sch["run_requests"] >= 60 and sch["aborted"] == 0 and sch["short_batches"] == 0
    # every completed run is in the run log, with the time the model took and what the round trip added
    assert len(log) == sch["runs"] and sum(r.batch for r in log if r.key in ("cls/main", "recog/router")) >= 60
    assert all(r.measured_ms > 0 and r.predicted_ms > 0 and r.overhead_ms >= 0 for r in log)
    assert all(r.late == (r.measured_ms + r.overhead_ms > r.predicted_ms + r.slack_ms) for r in log)
    assert sch["inflight"] == 0 and not sch["queued"]
    text = format_status(NodeView.from_dict(st))
    assert f"scheduler: {scheduler}" in text and "measured/predicted: " in text and "recog/face=" in text
    models = {n: load_model(n, seed=3, input_shape=SHAPE).eval() for n in ("recog_router", "vgg_face", "resnet_car")}
    cls_model = load_model("mobilenet_v2", seed=0, num_classes=10, input_shape=SHAPE).eval()
    seen = set()
    for rid, (app, x) in xs.items():
        assert got[rid].status == Status.OK, (rid, got[rid].status)
        if app == 5:
            label, ref = _oracle_recog(x, models)
            seen.add(label)
        else:
            with torch.inference_mode():
                ref = cls_model(torch.from_numpy(x)[None]).numpy()[0]
        out = got[rid].array()
        assert out.shape == ref.shape, f"request {rid} answered by the wrong stage"
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    assert seen == {"person", "vehicle", "other"}


@pytest.mark.real
@pytest.mark.slow
def test_requests_that_cannot_make_their_deadline_are_rejected(tmp_path: Path) -> None:
    cfg = CONFIG.format(scheduler="spatiotemporal").replace("slo_ms: 60000", "slo_ms: 0.5\n    max_wait_ms: 0")
    p = tmp_path / "apps.yaml"
    p.write_text(cfg)
    node = Node(load_config(p), warmup=False).start()
    try:
        rng = np.random.default_rng(1)
        xs = {rid: (6, rng.random(SHAPE, dtype=np.float32)) for rid in range(10)}
        got = ask(node, xs, timeout_s=30)
        sch = _settle(node)["scheduler"]
    finally:
        node.stop()
    assert sorted(got) == sorted(xs)
    # The profile condemns every request; once a second the scheduler still runs the queue head (a
    # probe, so a too-slow profile cannot starve the app): one run, the other nine rejected at once.
    assert sch["probes"] == 1 and sch["runs"] == 1 and sch["rejected_requests"] == 9
    statuses = [r.status for r in got.values()]
    assert statuses.count(Status.DEADLINE_MISSED) >= 9
    assert set(statuses) <= {Status.DEADLINE_MISSED, Status.OK}


@pytest.mark.real
@pytest.mark.slow
def test_instance_crash_aborts_its_runs_and_the_replacement_is_scheduled(tmp_path: Path) -> None:
    p = tmp_path / "apps.yaml"
    p.write_text(CONFIG.format(scheduler="spatiotemporal"))
    node = Node(load_config(p), warmup=False).start()
    try:
        victim = next(i for i in node.instances.values() if i.app == "cls")
        victim.proc.kill()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            node.step(50)
            fresh = [i for i in node.instances.values() if i.app == "cls" and i.ready]
            if fresh and fresh[0].name != victim.name:
                break
        assert node.dispatcher.entries["cls"].instance == fresh[0].name
        rng = np.random.default_rng(2)
        xs = {rid: (6, rng.random(SHAPE, dtype=np.float32)) for rid in range(12)}
        got = ask(node, xs)
        st = node.status()
    finally:
        node.stop()
    assert sorted(got) == sorted(xs) and all(r.status == Status.OK for r in got.values())
    assert st["apps"]["cls"]["restarts"] == 1


def test_core_groups_joins_apps_whose_cores_overlap() -> None:
    from orchestrator.node.dispatch import core_groups

    assert core_groups({"yolo": [0], "recog": [1], "resnext": [1]}) == [["yolo"], ["recog", "resnext"]]
    # overlap is transitive; apps without a core set (GPU backend) are left out
    assert core_groups({"a": [0, 1], "b": [1], "c": [2], "d": [2, 3], "e": None}) == [["a", "b"], ["c", "d"]]
    assert core_groups({}) == []


def test_exclusive_apps_are_one_instance_to_the_scheduler() -> None:
    """Apps on the same core never run at the same time; an app on its own core still runs beside them."""
    from gpuprims.sched.scheduler import Dispatch
    from orchestrator.config.schema import parse_config
    from orchestrator.node.dispatch import LiveScheduler, measured_profile

    apps = [{"name": n, "model": "mobilenet_v2", "app_id": i + 1, "input_shape": [3, 32, 32], "slo_ms": 1000,
             "gpu_pct": 30, "max_batch": 4} for i, n in enumerate(("a", "b", "c"))]
    cfg = parse_config({"node": {"backend": "cpu", "scheduler": "spatiotemporal", "allow_oversubscribe": True},
                        "apps": apps}, source="test")
    profiles = {f"{n}.main": measured_profile(f"{n}.main", {1: 5.0, 2: 8.0, 4: 12.0}, 30, backend="cpu",
                                              input_shape=(3, 32, 32), dtype="float32", note="test")
                for n in ("a", "b", "c")}
    sent: list[tuple[str, object]] = []
    live = LiveScheduler("spatiotemporal", list(cfg.apps), {n: {"main": 30} for n in "abc"}, profiles, pool=None,
                         send=lambda inst, msg: sent.append((inst, msg)), exclusive=[["a", "b"], ["c"]])
    assert live.status()["exclusive"] == [["a", "b"]]
    sch = live.scheduler
    assert sch.instance_key("a/main") == sch.instance_key("b/main") != sch.instance_key("c/main")
    ds: list[Dispatch] = sch.plan(0.0, {"a/main": [500.0], "b/main": [500.0], "c/main": [500.0]})
    assert sorted(d.app for d in ds if d.action == "run") == ["a", "c"]  # b waits for a: same core
    with pytest.raises(ValueError, match="unknown apps"):
        LiveScheduler("spatiotemporal", list(cfg.apps), {n: {"main": 30} for n in "abc"}, profiles, pool=None,
                      send=lambda inst, msg: None, exclusive=[["a", "zz"]])


# -- the same rules on played instances -------------------------------------------------------------------

#: The warm-up latencies a played instance reports per stage ({batch: ms}, as a real one's Ready carries).
MEASURED = {"1": 4.0, "2": 6.0, "4": 10.0}
#: The model time a played instance reports per run (small: the round trip must be longer than it).
PLAYED_RUN_MS = 1e-3


class Runs:
    """Plays the dispatched instances' side: every RunBatch is answered with a BatchDone; a router's batch
    passes its requests on to ``face`` and ``car`` in turn, so every stage of the DAG runs."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.launcher: PlayedLauncher = played(node)
        self.answered: dict[str, int] = {}  # instance -> RunBatch messages it has answered
        self.seen: list[RunBatch] = []
        self._turn = 0

    def step(self, ms: float = 5) -> None:
        self.node.step(ms)
        for inst in self.launcher.launched:
            if inst.returncode is None:
                self._answer(inst)

    def _answer(self, inst: FakeInstance) -> None:
        runs = [m for m in inst.received if isinstance(m, RunBatch)]
        for msg in runs[self.answered.get(inst.spec.name, 0):]:
            self.seen.append(msg)
            routed: dict[str, list[float]] = {}
            if msg.action == "run" and msg.stage == "router":
                assert self.node.dispatcher is not None
                deadline = self.node.dispatcher.clock_ms() + 5000
                for _ in range(msg.batch):
                    routed.setdefault(("face", "car")[self._turn % 2], []).append(deadline)
                    self._turn += 1
            inst.send(BatchDone(instance=inst.spec.name, id=msg.id, taken=msg.batch, measured_ms=PLAYED_RUN_MS,
                                routed=routed))
        self.answered[inst.spec.name] = len(runs)

    def until(self, cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.step()


def _played(tmp_path: Path, node_factory: NodeFactory, config: str) -> tuple[Node, Runs]:
    p = tmp_path / "apps.yaml"
    p.write_text(config)
    node = node_factory(load_config(p))
    launcher = played(node)
    launcher.ready_info["recog"] = {"measured": {s: MEASURED for s in ("router", "face", "car")}}
    launcher.ready_info["cls"] = {"measured": {"main": MEASURED}}
    node.start()
    return node, Runs(node)


def _send(node: Node, xs: dict[int, tuple[int, np.ndarray]]) -> None:
    assert node.ingest is not None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for rid, (app, x) in xs.items():
            for d in wire.encode_request(app, rid, x):
                s.sendto(d, ("127.0.0.1", node.ingest.ports[0]))


def _runs_of(runs: Runs, app: str) -> int:
    """Requests of ``app``'s entry stage that the scheduler ran."""
    entry = "router" if app == "recog" else "main"
    return sum(m.batch for m in runs.seen if m.action == "run" and m.instance.startswith(app) and m.stage == entry)


@pytest.mark.parametrize("scheduler", ["spatiotemporal", "temporal"])
def test_live_scheduler_runs_every_stage_of_the_dag_and_single_apps_on_played_instances(
        tmp_path: Path, node_factory: NodeFactory, scheduler: str) -> None:
    node, runs = _played(tmp_path, node_factory, CONFIG.format(scheduler=scheduler))
    st = node.status()
    assert st["scheduler"]["name"] == scheduler
    # one dispatched instance per app, no shadows; the DAG's instance has its largest stage's share
    insts = {a: [i["gpu_pct"] for i in st["apps"][a]["instances"]] for a in ("recog", "cls")}
    assert insts == ({"recog": [50], "cls": [50]} if scheduler == "spatiotemporal"
                     else {"recog": [100], "cls": [100]})
    rng = np.random.default_rng(0)
    xs = {rid: (5 if rid % 2 else 6, rng.random(SHAPE, dtype=np.float32)) for rid in range(60)}
    _send(node, xs)
    assert node.dispatcher is not None
    runs.until(lambda: _runs_of(runs, "recog") >= 30 and _runs_of(runs, "cls") >= 30
               and not node.dispatcher.inflight and not any(node.dispatcher.queues.values()),  # type: ignore[union-attr]
               "every request run through its stages")
    st = node.status()
    log = list(node.dispatcher.run_log)
    ok, text = change_gpu_pct(node, "cls", 30)
    assert not ok and "scheduler" in text
    sch = st["scheduler"]
    assert sch["runs"] > 0 and sch["run_requests"] >= 60 and sch["aborted"] == 0 and sch["short_batches"] == 0
    assert sch["rejected_requests"] == 0  # 5 s of SLO against 10 ms profiles: nothing is condemned
    # every completed run is in the run log, with the time the model took and what the round trip added
    assert len(log) == sch["runs"] and sum(r.batch for r in log if r.key in ("cls/main", "recog/router")) >= 60
    assert all(r.measured_ms > 0 and r.predicted_ms > 0 and r.overhead_ms >= 0 for r in log)
    assert all(r.late == (r.measured_ms + r.overhead_ms > r.predicted_ms + r.slack_ms) for r in log)
    assert sch["inflight"] == 0 and not sch["queued"]
    # the router's requests reached both branches; no batch is over max_batch; each went to its app's instance
    assert {m.stage for m in runs.seen} == {"router", "face", "car", "main"}
    assert all(1 <= m.batch <= 4 for m in runs.seen)
    assert all(m.instance.startswith("recog" if m.stage != "main" else "cls") for m in runs.seen)
    text = format_status(NodeView.from_dict(st))
    assert f"scheduler: {scheduler}" in text and "measured/predicted: " in text and "recog/face=" in text
    assert node.errors == {}


def test_requests_that_cannot_make_their_deadline_are_rejected_on_played_instances(
        tmp_path: Path, node_factory: NodeFactory) -> None:
    cfg = CONFIG.format(scheduler="spatiotemporal").replace("slo_ms: 60000", "slo_ms: 0.5\n    max_wait_ms: 0")
    node, runs = _played(tmp_path, node_factory, cfg)
    rng = np.random.default_rng(1)
    _send(node, {rid: (6, rng.random(SHAPE, dtype=np.float32)) for rid in range(10)})
    assert node.dispatcher is not None
    runs.until(lambda: sum(m.batch for m in runs.seen) >= 10 and not node.dispatcher.inflight,  # type: ignore[union-attr]
               "every request run or rejected")
    sch = node.status()["scheduler"]
    # The profile condemns every request; once a second the scheduler still runs the queue head (a
    # probe, so a too-slow profile cannot starve the app): one run, the other nine rejected at once.
    assert sch["probes"] == 1 and sch["runs"] == 1 and sch["rejected_requests"] == 9
    assert sum(m.batch for m in runs.seen if m.action == "reject") == 9
    assert sum(m.batch for m in runs.seen if m.action == "run") == 1
    assert node.errors == {}


def test_instance_crash_aborts_its_runs_and_the_replacement_is_scheduled_on_played_instances(
        tmp_path: Path, node_factory: NodeFactory) -> None:
    node, runs = _played(tmp_path, node_factory, CONFIG.format(scheduler="spatiotemporal"))
    assert node.dispatcher is not None
    victim = next(i for i in node.instances.values() if i.app == "cls")
    # A run in flight when it dies: the victim is sent a RunBatch it never answers.
    _send(node, {100: (6, np.zeros(SHAPE, np.float32))})
    deadline = time.monotonic() + 30
    while not node.dispatcher.inflight:
        assert time.monotonic() < deadline, "the run was never dispatched"
        node.step(5)  # the played side does not answer here
    assert {inst for _, inst in node.dispatcher.inflight.values()} == {victim.name}
    played(node).by_name(victim.name).die(-signal.SIGKILL)
    runs.until(lambda: any(i.app == "cls" and i.ready and i.name != victim.name for i in node.instances.values()),
               "the replacement")
    fresh = next(i for i in node.instances.values() if i.app == "cls" and i.ready)
    assert node.dispatcher.entries["cls"].instance == fresh.name
    assert node.status()["scheduler"]["aborted"] == 1
    assert victim.name not in {inst for _, inst in node.dispatcher.inflight.values()}
    rng = np.random.default_rng(2)
    _send(node, {rid: (6, rng.random(SHAPE, dtype=np.float32)) for rid in range(12)})
    # The replacement runs the 12 and the one the victim held (the node passed it on when it died).
    runs.until(lambda: _runs_of(runs, "cls") >= 13 and not node.dispatcher.inflight,  # type: ignore[union-attr]
               "the 13 requests run on the replacement")
    assert {m.instance for m in runs.seen if m.action == "run"} == {fresh.name}
    assert node.status()["apps"]["cls"]["restarts"] == 1 and node.errors == {}
