"""The simulator's and schedulers' fast paths decide exactly as the plain code did.

The digests below were taken from the implementation before the speed work (commit cd2711b): every
dispatch of a run (id, app, stage, model, GPU, GPU%, batch, action, start, end, predicted) hashed.
Arrivals are constant so that only the routing draws (``Generator.random``) come from numpy's stream.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from gpuprims.profile import paper_profiles
from gpuprims.sched.dag import dnn_recog, single
from gpuprims.sched.scenarios import RECOG_ROUTES, many_apps, paper_table3
from gpuprims.sched.scheduler import (
    Dispatch,
    Scheduler,
    SpatioTemporalScheduler,
    TemporalScheduler,
    make_scheduler,
)
from gpuprims.sched.sim import Arrival, Workload, simulate

_FIELDS = ("id", "app", "stage", "model", "gpu", "gpu_pct", "batch_size", "action", "start_ms", "end_ms",
           "predicted_ms")


def _digest(res: dict) -> str:
    rows = [[r[k] for k in _FIELDS] for r in res["dispatches"]]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def _counts(res: dict) -> dict[str, tuple[int, int, int]]:
    return {a: (v["met"], v["late"], v["rejected"]) for a, v in res["apps"].items()}


@pytest.mark.parametrize(("name", "load", "n", "digest", "counts"), [
    ("spatiotemporal", 1.0, 503, "a0a41544d89d0241",
     {"dnn_recog": (808, 0, 0), "yolo": (202, 0, 0), "resnext": (91, 0, 10)}),
    ("spatiotemporal", 1.6, 602, "3330ee5b188b1364",
     {"dnn_recog": (1046, 0, 241), "yolo": (257, 0, 64), "resnext": (159, 0, 3)}),
    ("temporal", 1.0, 598, "331b177e4edf44ff",
     {"dnn_recog": (206, 0, 602), "yolo": (156, 0, 46), "resnext": (100, 0, 1)}),
    ("temporal", 1.6, 531, "7f24ae7117ac4a32",
     {"dnn_recog": (220, 0, 1067), "yolo": (306, 0, 15), "resnext": (156, 0, 6)}),
])
def test_table3_decisions_unchanged(name: str, load: float, n: int, digest: str,
                                    counts: dict[str, tuple[int, int, int]]) -> None:
    wl = paper_table3(load=load, kind="constant")
    sch = make_scheduler(name, [w.app for w in wl], paper_profiles())
    res = simulate(sch, wl, duration_ms=3000.0, seed=5, record_dispatches=True)
    assert (len(res["dispatches"]), _counts(res), _digest(res)) == (n, counts, digest)


def _two_gpu_mix() -> list[Workload]:
    return [Workload(dnn_recog("r1", 40.0), Arrival("constant", 400.0, burst=4), RECOG_ROUTES),
            Workload(single("a", "resnet50", 30, 40.0), Arrival("constant", 150.0, offset_ms=3.0)),
            Workload(single("b", "mobilenet", 15, 40.0), Arrival("constant", 300.0, burst=2, offset_ms=1.5)),
            Workload(single("c", "yolov3", 60, 50.0), Arrival("constant", 90.0, offset_ms=7.0)),
            Workload(dnn_recog("r2", 50.0), Arrival("constant", 200.0, burst=2, offset_ms=11.0),
                     {"router": {"person": 0.3, "vehicle": 0.6}})]


@pytest.mark.parametrize(("name", "n", "digest", "counts"), [
    ("spatiotemporal", 2223, "1999197fa864e220",
     {"r1": (1137, 0, 63), "a": (450, 0, 0), "b": (900, 0, 0), "c": (213, 0, 57), "r2": (598, 0, 0)}),
    ("temporal", 1701, "81ed722e76b4d7ed",
     {"r1": (429, 0, 771), "a": (367, 5, 78), "b": (900, 0, 0), "c": (270, 0, 0), "r2": (194, 0, 404)}),
])
def test_two_gpu_mix_with_learning_decisions_unchanged(name: str, n: int, digest: str,
                                                       counts: dict[str, tuple[int, int, int]]) -> None:
    # true_scale makes the schedulers learn corrections, which empties their prediction caches.
    wl = _two_gpu_mix()
    sch = make_scheduler(name, [w.app for w in wl], paper_profiles(), num_gpus=2)
    res = simulate(sch, wl, duration_ms=3000.0, seed=11, record_dispatches=True,
                   true_scale={"resnet50": 1.3, "vgg_face": 0.8})
    assert (len(res["dispatches"]), _counts(res), _digest(res)) == (n, counts, digest)


class _LoudSpatioTemporal(SpatioTemporalScheduler):
    _versioned_wakeups = False  # never let the simulator skip asking next_wakeup_ms

    def _quiet(self, now_ms: float, gpu: int) -> bool:
        return False  # never let the simulator skip a plan


class _LoudTemporal(TemporalScheduler):
    def _quiet(self, now_ms: float, gpu: int) -> bool:
        return False


def _strip(res: dict) -> dict:
    return {k: v for k, v in res.items() if k not in ("plans", "wall_s", "cpu_s", "sim_requests_per_wall_s",
                                                      "sim_requests_per_cpu_s")}


@pytest.mark.parametrize(("quiet_cls", "loud_cls"), [(SpatioTemporalScheduler, _LoudSpatioTemporal),
                                                     (TemporalScheduler, _LoudTemporal)])
@pytest.mark.parametrize("jitter", [0.0, 0.15])
def test_skipped_plans_and_wakeup_questions_would_have_changed_nothing(quiet_cls: type[Scheduler], loud_cls: type[Scheduler],
                                               jitter: float) -> None:
    for wl, gpus in ((many_apps(num_gpus=4, num_apps=12, rate_rps=60.0), 4), (paper_table3(kind="poisson"), 1),
                     (_two_gpu_mix(), 2)):
        runs = []
        for cls in (quiet_cls, loud_cls):
            sch = cls([w.app for w in wl], paper_profiles(), num_gpus=gpus)
            runs.append(simulate(sch, wl, duration_ms=1500.0, seed=3, jitter_sigma=jitter, record_dispatches=True))
        quiet, loud = runs
        assert _strip(quiet) == _strip(loud)
        assert quiet["plans"] < loud["plans"]


def test_scheduler_dispatches_are_plain_dispatches() -> None:
    wl = paper_table3()
    sch = make_scheduler("spatiotemporal", [w.app for w in wl], paper_profiles())
    res = simulate(sch, wl, duration_ms=200.0, record_dispatches=True)
    assert res["dispatches"]
    queues = {w.app.key(w.app.entry.name): [-1.0, 100.0, 100.0] for w in wl}  # the first ones too late
    fresh = make_scheduler("temporal", [w.app for w in wl], paper_profiles())
    ds = [*sch.plan(0.0, queues), *fresh.plan(0.0, queues)]
    assert {d.action for d in ds} == {"run", "reject"}
    for d in ds:
        plain = Dispatch(d.id, d.app, d.stage, d.model, d.gpu, d.gpu_pct, d.batch_size, d.start_ms,
                         d.predicted_ms, d.action)
        assert d == plain and hash(d) == hash(plain) and repr(d) == repr(plain)
        assert d.key == plain.key == f"{d.app}/{d.stage}"
        assert vars(d) == vars(plain)
