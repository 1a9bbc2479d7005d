"""The live schedulers (node.scheduler spatiotemporal / temporal) on the CPU backend."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from apps.zoo import RECOG_ROUTER_LABELS, load_model
from gpuprims.wire import Status
from orchestrator.config.schema import load_config
from orchestrator.control.status_format import format_status
from orchestrator.node.node import Node
from orchestrator.node.reconfig import change_gpu_pct
from tests.orchestrator.client import ask

pytestmark = pytest.mark.slow

SHAPE = (3, 32, 32)
CONFIG = """
node:
  listen: {{host: 127.0.0.1, port: 0}}
  backend: cpu
  scheduler: {scheduler}
  round_ms: 30
  pool: {{slot_count: 4096, max_chunks: 64, record_count: 256}}
apps:
  - name: recog
    slo_ms: 5000
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
    slo_ms: 5000
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
    text = format_status(st)
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


def test_requests_that_cannot_make_their_deadline_are_rejected(tmp_path: Path) -> None:
    cfg = CONFIG.format(scheduler="spatiotemporal").replace("slo_ms: 5000", "slo_ms: 0.5\n    max_wait_ms: 0")
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
