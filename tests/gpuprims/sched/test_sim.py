from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuprims.profile import paper_profiles
from gpuprims.sched.dag import App, Stage, dnn_recog, single
from gpuprims.sched.scheduler import make_scheduler
from gpuprims.sched.sim import Arrival, Workload, simulate
from tests.gpuprims.sched._profiles import grid

# Latency tables (ms) with known answers; 100% is half the 50% latency.
MR = grid("mr", {50: {1: 2.0, 2: 3.0, 4: 5.0}, 100: {1: 1.0, 2: 1.5, 4: 2.5}})
MS = grid("ms", {50: {1: 4.0, 2: 6.0, 4: 10.0}, 100: {1: 2.0, 2: 3.0, 4: 5.0}})
MF = grid("mf", {50: {1: 3.0, 2: 4.0, 4: 6.0}, 100: {1: 1.5, 2: 2.0, 4: 3.0}})
PROFILES = {"mr": MR, "ms": MS, "mf": MF}
R = App("r", (Stage("r", "mr", 50, {"x": "s"}), Stage("s", "ms", 50)), 20.0)
F = single("f", "mf", 50, 20.0)
# One burst at t=0 (the next would come at 100 ms, after the end): 2 requests for r, 4 for f.
WL = [Workload(R, Arrival("constant", 20.0, burst=2), {"r": {"x": 1.0}}),
      Workload(F, Arrival("constant", 40.0, burst=4))]


def _rows(res: dict) -> list[tuple]:
    return [(d["app"], d["stage"], d["gpu_pct"], d["batch_size"], d["start_ms"], d["end_ms"])
            for d in res["dispatches"]]


def test_spatiotemporal_hand_computed_schedule() -> None:
    # t=0: r (b2, 50%) runs 0-3 and s is reserved 3-9 at 50%; f (b4, 50%) fits beside both, 0-6.
    # t=3: r completes, both requests go to s, which starts in its slot, 3-9.
    res = simulate(make_scheduler("spatiotemporal", [R, F], PROFILES), WL, duration_ms=50.0,
                   record_dispatches=True)
    assert _rows(res) == [("r", "r", 50, 2, 0.0, 3.0), ("f", "mf", 50, 4, 0.0, 6.0), ("r", "s", 50, 2, 3.0, 9.0)]
    assert res["simulated"] is True and res["apps"]["r"]["simulated"] is True
    assert res["apps"]["r"]["latency_p50_ms"] == 9.0 and res["apps"]["f"]["latency_p50_ms"] == 6.0
    assert res["total"]["offered"] == 6 and res["total"]["met"] == 6 and res["total"]["miss_rate"] == 0.0
    assert res["apps"]["r"]["throughput_rps"] == pytest.approx(2 / 0.05)
    # GPU busy integral: (50*3 + 50*6 + 50*6) / (100 * 50 ms)
    assert res["gpu_util"] == [pytest.approx(750 / 5000)]


def test_temporal_hand_computed_schedule() -> None:
    # Exclusive: r 0-1.5, then its later stage s 1.5-4.5, then f's turn 4.5-7.5, all at 100%.
    res = simulate(make_scheduler("temporal", [R, F], PROFILES), WL, duration_ms=50.0, record_dispatches=True)
    assert _rows(res) == [("r", "r", 100, 2, 0.0, 1.5), ("r", "s", 100, 2, 1.5, 4.5), ("f", "mf", 100, 4, 4.5, 7.5)]
    assert res["apps"]["r"]["latency_p99_ms"] == 4.5 and res["apps"]["f"]["latency_p99_ms"] == 7.5


def test_rejections_and_deadline_misses_are_counted() -> None:
    # f alone, 8 requests at once, deadline 5 ms: at 50% batch 4 takes 6 ms, batch 3 (interpolated) 5 ms.
    f = single("f", "mf", 50, 5.0)
    res = simulate(make_scheduler("spatiotemporal", [f], PROFILES), [Workload(f, Arrival("constant", 80, burst=8))],
                   duration_ms=50.0, record_dispatches=True)
    acts = [(d["action"], d["batch_size"], d["start_ms"]) for d in res["dispatches"]]
    # batch 3 runs 0-5; at t=5 the remaining 5 cannot finish by 5 ms: rejected
    assert acts == [("run", 3, 0.0), ("reject", 5, 5.0)]
    a = res["apps"]["f"]
    assert (a["offered"], a["met"], a["rejected"], a["late"]) == (8, 3, 5, 0)
    assert a["miss_rate"] == pytest.approx(0.625)


def test_learning_a_wrong_profile_reduces_misses() -> None:
    ps = paper_profiles()
    app = single("y", "yolov3", 60, 30.0)
    wl = [Workload(app, Arrival("poisson", 400.0))]
    slow = simulate(make_scheduler("spatiotemporal", [app], ps, learn_rate=0.0), wl, duration_ms=3000,
                    true_scale={"yolov3": 1.6}, seed=3)
    learn = simulate(make_scheduler("spatiotemporal", [app], ps, learn_rate=0.3), wl, duration_ms=3000,
                     true_scale={"yolov3": 1.6}, seed=3)
    assert learn["apps"]["y"]["late"] < slow["apps"]["y"]["late"]


def test_arrivals() -> None:
    rng = np.random.default_rng(0)
    c = Arrival("constant", 100.0, burst=2, offset_ms=5.0).times_ms(50.0, rng)
    assert c.tolist() == [5.0, 5.0, 25.0, 25.0, 45.0, 45.0]
    p = Arrival("poisson", 1000.0).times_ms(10_000.0, rng)
    assert abs(p.size - 10_000) < 500 and np.all(np.diff(p) >= 0) and p[-1] < 10_000
    assert Arrival("constant", 10.0, offset_ms=100.0).times_ms(50.0, rng).size == 0


@pytest.mark.parametrize(("kw", "needle"), [
    ({"kind": "uniform", "rate_rps": 1.0}, "kind"), ({"kind": "poisson", "rate_rps": 0.0}, "rate_rps"),
    ({"kind": "poisson", "rate_rps": float("inf")}, "rate_rps"),
    ({"kind": "constant", "rate_rps": 1.0, "burst": 0}, "burst"),
    ({"kind": "poisson", "rate_rps": 1.0, "burst": 2}, "burst"),
    ({"kind": "poisson", "rate_rps": 1.0, "offset_ms": -1.0}, "offset_ms"),
])
def test_bad_arrival(kw: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Arrival(**kw)


def test_bad_simulation_input() -> None:
    s = make_scheduler("temporal", [R, F], PROFILES)
    with pytest.raises(ValueError, match="duration_ms"):
        simulate(s, WL, duration_ms=0)
    with pytest.raises(ValueError, match="warmup_ms"):
        simulate(s, WL, duration_ms=10, warmup_ms=10)
    with pytest.raises(ValueError, match="jitter_sigma"):
        simulate(s, WL, duration_ms=10, jitter_sigma=-1)
    with pytest.raises(ValueError, match="true_scale"):
        simulate(s, WL, duration_ms=10, true_scale={"mr": 0})
    with pytest.raises(ValueError, match="drain_ms"):
        simulate(s, WL, duration_ms=10, drain_ms=-1)
    with pytest.raises(ValueError, match="workloads cover apps"):
        simulate(s, WL[:1], duration_ms=10)
    other = App("r", (Stage("r", "mr", 50),), 20.0)
    with pytest.raises(ValueError, match="differs"):
        simulate(s, [Workload(other, Arrival("poisson", 1.0)), WL[1]], duration_ms=10)
    with pytest.raises(ValueError, match="route probabilities"):
        Workload(R, Arrival("poisson", 1.0), {"r": {"x": 0.7, "y": 0.6}})
    with pytest.raises(ValueError, match="no stage"):
        Workload(R, Arrival("poisson", 1.0), {"zz": {"x": 1.0}})


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["spatiotemporal", "temporal"]), st.integers(0, 10_000), st.floats(50, 1500),
       st.floats(0.0, 0.4))
def test_paper_mix_never_oversubscribes_and_keeps_stage_order(name: str, seed: int, rate: float,
                                                              jitter: float) -> None:
    ps = paper_profiles()
    apps = [dnn_recog(), single("yolo", "yolov3", 60, 30.0), single("resnext", "resnext50", 50, 30.0)]
    wl = [Workload(apps[0], Arrival("poisson", rate), {"router": {"person": 0.5, "vehicle": 0.4}}),
          Workload(apps[1], Arrival("poisson", rate / 4)), Workload(apps[2], Arrival("poisson", rate / 8))]
    # simulate() itself raises if a GPU goes above 100% or a busy instance is started again
    res = simulate(make_scheduler(name, apps, ps), wl, duration_ms=300.0, seed=seed, jitter_sigma=jitter,
                   record_dispatches=True)
    runs = [d for d in res["dispatches"] if d["action"] == "run"]
    for d in runs:
        # the simulator treats events less than 1e-9 ms apart as simultaneous (completions first)
        live = [e for e in runs if e["start_ms"] <= d["start_ms"] < e["end_ms"] - 1e-6]
        assert sum(e["gpu_pct"] for e in live) <= 100
    # every later-stage run starts no earlier than the end of some router run before it
    router_ends = sorted(d["end_ms"] for d in runs if d["stage"] == "router")
    for d in runs:
        if d["app"] == "dnn_recog" and d["stage"] != "router":
            assert router_ends and router_ends[0] <= d["start_ms"]
    t = res["total"]
    assert t["offered"] == t["met"] + t["late"] + t["rejected"] + t["unfinished"]


def test_sharded_simulation_matches_one_process_and_splits_by_gpu() -> None:
    from gpuprims.sched.scenarios import many_apps
    from gpuprims.sched.sim import simulate_sharded

    ps = paper_profiles()
    wl = many_apps(num_gpus=4, num_apps=8, rate_rps=100.0)
    one = simulate(make_scheduler("spatiotemporal", [w.app for w in wl], ps, num_gpus=4), wl, duration_ms=500.0)
    same = simulate_sharded("spatiotemporal", wl, ps, num_gpus=4, processes=1, duration_ms=500.0)
    for k in ("offered", "met", "late", "rejected"):
        assert same["total"][k] == one["total"][k]
    assert same["gpu_util"] == one["gpu_util"] and same["processes"] == 1
    two = simulate_sharded("temporal", wl, ps, num_gpus=4, processes=2, duration_ms=500.0, record_dispatches=True)
    assert two["simulated"] and two["processes"] == 2 and set(two["apps"]) == {w.app.name for w in wl}
    assert {d["gpu"] for d in two["dispatches"]} == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="processes"):
        simulate_sharded("temporal", wl, ps, num_gpus=4, processes=0, duration_ms=500.0)
    with pytest.raises(ValueError, match="duration_ms"):
        simulate_sharded("temporal", wl, ps, num_gpus=4, processes=2, duration_ms=0.0)
