from __future__ import annotations

import itertools
from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuprims.sched.dag import App, Stage, single
from gpuprims.sched.scheduler import (
    Dispatch,
    SpatioTemporalScheduler,
    TemporalScheduler,
    make_scheduler,
)
from tests.gpuprims.sched._profiles import grid

PCTS = (10, 25, 50, 75, 100)


def _lin(model: str, base_ms: float, per_item_ms: float) -> object:
    return grid(model, {p: {b: (base_ms + per_item_ms * b) * 100 / p for b in (1, 2, 4, 8)} for p in PCTS})


PROFILES = {"m1": _lin("m1", 1.0, 0.5), "m2": _lin("m2", 2.0, 1.0), "m3": _lin("m3", 0.5, 0.25)}


def test_selected_by_name_and_bad_names() -> None:
    apps = [single("a", "m1", 50, 30)]
    assert isinstance(make_scheduler("spatiotemporal", apps, PROFILES), SpatioTemporalScheduler)
    assert isinstance(make_scheduler("temporal", apps, PROFILES), TemporalScheduler)
    with pytest.raises(ValueError, match="unknown scheduler 'fifo'"):
        make_scheduler("fifo", apps, PROFILES)


@pytest.mark.parametrize(("kw", "needle"), [
    ({"num_gpus": 0}, "num_gpus"), ({"round_ms": 0}, "round_ms"), ({"learn_rate": 1.5}, "learn_rate"),
    ({"max_batch": 0}, "max_batch"), ({"stat": "p90"}, "stat"), ({"probe_ms": 0}, "probe_ms"),
])
def test_bad_construction(kw: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SpatioTemporalScheduler([single("a", "m1", 50, 30)], PROFILES, **kw)


def test_bad_apps() -> None:
    with pytest.raises(ValueError, match="at least one app"):
        TemporalScheduler([], PROFILES)
    with pytest.raises(ValueError, match="gpu 2 does not exist"):
        TemporalScheduler([single("a", "m1", 50, 30, gpu=2)], PROFILES, num_gpus=2)
    with pytest.raises(ValueError, match="no profile"):
        TemporalScheduler([single("a", "zz", 50, 30)], PROFILES)
    short = {"s": grid("s", {10: {1: 5.0}, 50: {1: 2.0}})}
    with pytest.raises(ValueError, match="runs 's' at 100% GPU"):
        TemporalScheduler([single("a", "s", 50, 30)], short)
    with pytest.raises(ValueError, match="route_margin_sigma"):
        SpatioTemporalScheduler([single("a", "m1", 50, 30)], PROFILES, route_margin_sigma=-1)


def test_spatial_sharing_and_batch_choice() -> None:
    apps = [single("a", "m1", 50, 20), single("b", "m2", 50, 20), single("c", "m3", 25, 20)]
    s = SpatioTemporalScheduler(apps, PROFILES)
    q = {"a/m1": [20.0] * 8, "b/m2": [20.0] * 8, "c/m3": [20.0] * 8}
    ds = s.plan(0.0, q)
    # a and b fit side by side at 50% each; c (25%) has no room left
    assert [(d.app, d.gpu_pct, d.batch_size) for d in ds] == [("a", 50, 8), ("b", 50, 8)]
    assert ds[1].predicted_ms == pytest.approx((2 + 8) * 2)  # m2 batch 8 at 50%
    assert s.next_wakeup_ms(0.0) == 30.0


def test_temporal_is_exclusive_round_robin() -> None:
    apps = [single("a", "m1", 50, 20), single("b", "m2", 50, 20)]
    s = TemporalScheduler(apps, PROFILES)
    q = {"a/m1": deque([20.0] * 4), "b/m2": deque([20.0] * 4)}
    (d1,) = s.plan(0.0, q)
    assert (d1.app, d1.gpu_pct, d1.batch_size) == ("a", 100, 4)
    assert s.plan(0.5, q) == []  # GPU busy
    for _ in range(d1.batch_size):
        q["a/m1"].popleft()
    s.completed(d1, d1.predicted_ms)
    q["a/m1"].extend([25.0] * 4)
    (d2,) = s.plan(3.0, q)
    assert d2.app == "b"  # b's turn, though a has work again
    assert s.next_wakeup_ms(3.0) is None


def test_rejects_requests_that_cannot_meet_their_deadline() -> None:
    s = SpatioTemporalScheduler([single("a", "m1", 50, 20)], PROFILES)
    ds = s.plan(10.0, {"a/m1": [10.5, 11.0, 40.0]})
    # batch 1 at 50% takes 3 ms: the first two cannot make it; the third runs
    assert [(d.action, d.batch_size) for d in ds] == [("reject", 2), ("run", 1)]


def test_learns_from_measured_latency() -> None:
    s = SpatioTemporalScheduler([single("a", "m1", 50, 100)], PROFILES, learn_rate=0.5)
    (d,) = s.plan(0.0, {"a/m1": [100.0]})
    assert d.predicted_ms == pytest.approx(3.0)
    s.completed(d, 6.0)
    assert s.correction("m1", 50) == pytest.approx(1.5)
    (d2,) = s.plan(10.0, {"a/m1": [110.0]})
    assert d2.predicted_ms == pytest.approx(4.5)
    with pytest.raises(ValueError, match="not running"):
        s.completed(d, 1.0)
    with pytest.raises(ValueError, match="measured_ms"):
        s.completed(d2, -1.0)
    fake = Dispatch(999, "a", "m1", "m1", 7, 50, 1, 0.0, 1.0)
    with pytest.raises(ValueError, match="not running"):
        s.completed(fake, 1.0)


def test_dag_reserves_later_stages_and_respects_order() -> None:
    app = App("r", (Stage("s1", "m3", 25, {"x": "s2"}), Stage("s2", "m2", 100)), 40.0)
    s = SpatioTemporalScheduler([app, single("f", "m1", 25, 40)], PROFILES)
    q: dict[str, list[float]] = {"r/s1": [40.0] * 4, "r/s2": [], "f/m1": [40.0] * 8}
    ds = s.plan(0.0, q)
    assert [d.key for d in ds] == ["r/s1", "f/m1"]
    s1, f = ds
    # s2 is reserved at 100% from s1's predicted end (6 ms), so f (25%) is a gap fill that must end
    # by then: m1 at 25% takes (1 + 0.5 b) * 4 ms, so batch 1 (6 ms) is the largest
    assert s1.predicted_end_ms == pytest.approx(6.0)
    assert (f.batch_size, f.predicted_end_ms) == (1, pytest.approx(6.0))
    # nothing for s2 is dispatched before s1 completes, even with requests waiting in its queue
    q["r/s2"] = [40.0] * 4
    assert all(d.key != "r/s2" for d in s.plan(0.1, q))
    s.completed(f, f.predicted_ms)
    s.completed(s1, s1.predicted_ms)
    q["r/s1"], q["f/m1"] = [], []
    ds = s.plan(s1.predicted_end_ms, q)
    assert [(d.key, d.batch_size, d.gpu_pct) for d in ds] == [("r/s2", 4, 100)]


def test_multi_gpu_placement() -> None:
    apps = [single(f"a{i}", "m1", 50, 30) for i in range(4)] + [single("p", "m1", 50, 30, gpu=0)]
    s = SpatioTemporalScheduler(apps, PROFILES, num_gpus=3)
    assert s.placement["p"] == 0
    assert sorted(s.placement[f"a{i}"] for i in range(4)) == [0, 1, 1, 2] or \
        sorted(s.placement[f"a{i}"] for i in range(4)) == [1, 1, 2, 2]
    q = {f"a{i}/m1": [30.0] for i in range(4)} | {"p/m1": [30.0]}
    ds = s.plan(0.0, q)
    for g in range(3):
        assert sum(d.gpu_pct for d in ds if d.gpu == g and d.action == "run") <= 100


# --- property: never above 100% per GPU, whatever the profiles, apps, queues and timings ----------

@st.composite
def _scenario(draw: st.DrawFn) -> tuple:
    profiles = {}
    for m in ("p", "q", "r"):
        base = draw(st.floats(0.2, 10.0))
        per = draw(st.floats(0.0, 5.0))
        profiles[m] = _lin(m, base, per)
    n_apps = draw(st.integers(1, 6))
    apps: list[App] = []
    for i in range(n_apps):
        pct = draw(st.sampled_from([10, 20, 25, 40, 50, 60, 75, 90, 100]))
        dl = draw(st.floats(5.0, 100.0))
        if draw(st.booleans()):
            pct2 = draw(st.sampled_from([10, 25, 50, 75, 100]))
            apps.append(App(f"d{i}", (Stage("a", draw(st.sampled_from("pqr")), pct, {"x": "b"}),
                                      Stage("b", draw(st.sampled_from("pqr")), pct2)), dl))
        else:
            apps.append(single(f"s{i}", draw(st.sampled_from("pqr")), pct, dl))
    gpus = draw(st.integers(1, 3))
    steps = draw(st.lists(st.tuples(st.floats(0.0, 20.0), st.integers(0, 12), st.floats(0.3, 3.0)),
                          min_size=1, max_size=25))
    return profiles, apps, gpus, steps


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_scenario(), st.sampled_from(["spatiotemporal", "temporal"]), st.sampled_from([None, 2.0]))
def test_never_above_100_pct_and_stage_order(scn: tuple, name: str, probe_ms: float | None) -> None:
    profiles, apps, gpus, steps = scn
    s = make_scheduler(name, apps, profiles, num_gpus=gpus, probe_ms=probe_ms)
    queues: dict[str, deque[float]] = {a.key(st_.name): deque() for a in apps for st_ in a.stages}
    running: dict[int, tuple[Dispatch, float, list[float]]] = {}
    now = 0.0
    for gap, arrivals, slow in steps:
        now += gap
        # complete whatever has ended, routing every request of a first stage onwards
        for did, (d, end, dls) in sorted(running.items(), key=lambda kv: kv[1][1]):
            if end <= now:
                del running[did]
                s.completed(d, end - d.start_ms)
                app = s.apps[d.app]
                for nxt in app.successors(d.stage):
                    queues[app.key(nxt)].extend(dls)
        for a in apps[: 1 + arrivals % len(apps)]:
            queues[a.key(a.entry.name)].extend([now + a.deadline_ms] * (arrivals // 2 + 1))
        for d in s.plan(now, queues):
            q = queues[d.key]
            assert 1 <= d.batch_size <= len(q)
            dls = [q.popleft() for _ in range(d.batch_size)]
            if d.action == "reject":
                continue
            assert d.start_ms == now
            running[d.id] = (d, now + d.predicted_ms * slow, dls)
            for g in range(gpus):
                assert sum(r.gpu_pct for r, _, _ in running.values() if r.gpu == g) <= 100
            # one run at a time per stage instance
            keys = [r.key for r, _, _ in running.values()]
            assert len(keys) == len(set(keys))


def test_gpu_hint_limits_planning_and_is_validated() -> None:
    apps = [single("a", "m1", 50, 30, gpu=0), single("b", "m1", 50, 30, gpu=1)]
    s = TemporalScheduler(apps, PROFILES, num_gpus=2)
    q = {"a/m1": [30.0], "b/m1": [30.0]}
    assert [d.app for d in s.plan(0.0, q, gpus=[1])] == ["b"]
    assert [d.app for d in s.plan(0.0, q, gpus=[0, 1])] == ["a"]  # b is already running
    with pytest.raises(ValueError, match=r"gpus \[2\] must be in 0..1"):
        s.plan(0.0, q, gpus=[2])


def test_can_start_and_stage_deadlines() -> None:
    app = App("r", (Stage("s1", "m3", 25, {"x": "s2"}), Stage("s2", "m2", 100)), 40.0)
    s = SpatioTemporalScheduler([app, single("f", "m1", 80, 40)], PROFILES)
    assert s.can_start("r/s1") and s.can_start("f/m1")
    s.plan(0.0, {"r/s1": [40.0], "f/m1": []})
    assert not s.can_start("r/s1")  # running
    assert not s.can_start("f/m1")  # 25 + 80 > 100
    with pytest.raises(ValueError, match="unknown queue key"):
        s.can_start("nope/x")
    t = TemporalScheduler([single("f", "m1", 80, 40), single("g", "m2", 10, 40)], PROFILES)
    t.plan(0.0, {"f/m1": [40.0], "g/m2": []})
    assert not t.can_start("g/m2")
    dl = s.stage_deadlines_ms()
    assert set(dl) == {"r/s1", "r/s2", "f/m1"} and dl["f/m1"] == 40.0
    assert dl["r/s1"] + dl["r/s2"] == pytest.approx(40.0)


def test_aborted_frees_gpu_and_reservations() -> None:
    app = App("r", (Stage("s1", "m3", 25, {"x": "s2"}), Stage("s2", "m2", 100)), 40.0)
    s = SpatioTemporalScheduler([app], PROFILES)
    (d,) = s.plan(0.0, {"r/s1": [40.0], "r/s2": []})
    assert s.gpus[0].reservations
    s.aborted(d)
    assert s.running(0) == [] and s.gpus[0].reservations == [] and s.correction("m3", 25) == 1.0
    with pytest.raises(ValueError, match="not running"):
        s.aborted(d)


def _dag(name: str = "d", deadline: float = 60.0) -> App:
    return App(name, (Stage("r", "m1", 25, {"x": "f"}), Stage("f", "m2", 50)), deadline)


def test_stages_sharing_an_instance_never_overlap() -> None:
    from gpuprims.sched.sim import Arrival, Workload, simulate

    apps = [_dag()]
    inst = {"d/r": "d-0", "d/f": "d-0"}
    wl = [Workload(apps[0], Arrival("poisson", 400.0), {"r": {"x": 0.7}})]
    for name in ("spatiotemporal", "temporal"):
        sch = make_scheduler(name, apps, PROFILES, instances=inst)
        assert sch.instance_key("d/r") == sch.instance_key("d/f") != "d/r"
        res = simulate(sch, wl, duration_ms=2000.0, seed=3, record_dispatches=True)
        runs = sorted((r for r in res["dispatches"] if r["action"] == "run"), key=lambda r: r["start_ms"])
        assert any(r["stage"] == "f" for r in runs)
        for a, b in itertools.pairwise(runs):
            assert b["start_ms"] >= a["end_ms"] - 1e-9, (a, b)
    # Without the mapping the two stages may run at once (each its own instance).
    free = simulate(make_scheduler("spatiotemporal", apps, PROFILES), wl, duration_ms=2000.0, seed=3,
                    record_dispatches=True)
    runs = sorted((r for r in free["dispatches"] if r["action"] == "run"), key=lambda r: r["start_ms"])
    assert any(b["start_ms"] < a["end_ms"] - 1e-9 for a, b in itertools.pairwise(runs))


def test_instances_mapping_is_validated() -> None:
    with pytest.raises(ValueError, match="unknown stage keys"):
        SpatioTemporalScheduler([_dag()], PROFILES, instances={"d/zz": "x"})
    with pytest.raises(ValueError, match="runs stages of two apps"):
        SpatioTemporalScheduler([_dag("d"), _dag("e")], PROFILES, instances={"d/r": "x", "e/r": "x"})


# --- probes: a profile far slower than reality must not starve an app forever ---------------------

# The profile says batch 1 takes 30 ms at 50% (15 ms at 100%); the "real" model takes 3 ms (or 1.5 ms).
SLOW = {"m1": _lin("m1", 10.0, 5.0)}
DL = 12.0


def _serve(s: object, queues: dict[str, deque[float]], now: float, real_ms: float) -> list[Dispatch]:
    """Plan at `now`, apply the dispatches, complete every run after `real_ms`; the dispatches."""
    ds = s.plan(now, queues)  # type: ignore[attr-defined]
    for d in ds:
        for _ in range(d.batch_size):
            queues[d.key].popleft()
    for d in ds:
        if d.action == "run":
            s.completed(d, real_ms)  # type: ignore[attr-defined]
    return ds


@pytest.mark.parametrize("name", ["spatiotemporal", "temporal"])
def test_without_a_probe_a_too_slow_profile_rejects_forever(name: str) -> None:
    s = make_scheduler(name, [single("a", "m1", 50, DL)], SLOW)
    q = {"a/m1": deque()}
    for t in range(0, 3000, 100):
        q["a/m1"].extend([t + DL] * 2)
        assert all(d.action == "reject" for d in _serve(s, q, float(t), 3.0))
    assert s.correction("m1", 50 if name == "spatiotemporal" else 100) == 1.0 and s.probes == 0


@pytest.mark.parametrize("name", ["spatiotemporal", "temporal"])
def test_probe_runs_a_doomed_head_learns_and_the_app_is_served(name: str) -> None:
    pct = 50 if name == "spatiotemporal" else 100
    real = 3.0 * pct / 100
    s = make_scheduler(name, [single("a", "m1", 50, DL)], SLOW, probe_ms=1000.0, learn_rate=0.5)
    q = {"a/m1": deque([DL, DL, DL])}
    ds = _serve(s, q, 0.0, real)
    # the head runs alone as a probe; the other doomed requests are rejected as before
    assert [(d.action, d.batch_size) for d in ds] == [("run", 1), ("reject", 2)] and s.probes == 1
    assert s.correction("m1", pct) < 1.0
    # no second probe within probe_ms: an ordinary run if the prediction now fits, else a reject
    q["a/m1"].extend([100.0 + DL])
    fits = s.predict_ms("m1", 1, pct) <= DL
    assert name == "temporal" or not fits  # at 50% one probe is not enough to learn the 10x
    assert [d.action for d in _serve(s, q, 100.0, real)] == ["run" if fits else "reject"] and s.probes == 1
    # a probe every probe_ms until the prediction fits; then ordinary runs, no more probes
    for t in range(1000, 12000, 50):
        q["a/m1"].append(t + DL)
        _serve(s, q, float(t), real)
    assert s.predict_ms("m1", 1, pct) <= DL
    probes = s.probes
    assert 1 <= probes <= 12  # at most one a second (one is enough at 100%)
    q["a/m1"].append(12000.0 + DL)
    assert [d.action for d in _serve(s, q, 12000.0, real)] == ["run"] and s.probes == probes


def test_no_probe_while_the_instance_or_its_share_is_busy() -> None:
    s = SpatioTemporalScheduler([single("a", "m1", 50, 20), single("b", "m2", 60, 500)],
                                {"m1": SLOW["m1"], "m2": PROFILES["m2"]}, probe_ms=1000.0)
    q = {"a/m1": deque(), "b/m2": deque([500.0])}
    (run_b,) = s.plan(0.0, q)
    q["b/m2"].popleft()
    q["a/m1"].append(20.0)
    ds = s.plan(1.0, q)  # b holds 60%: a's 50% does not fit, so a is rejected, not probed
    assert [(d.app, d.action) for d in ds] == [("a", "reject")] and s.probes == 0
    q["a/m1"].popleft()
    s.completed(run_b, 5.0)
    q["a/m1"].append(30.0)
    ds = s.plan(10.0, q)
    assert [(d.app, d.action) for d in ds] == [("a", "run")] and s.probes == 1


@pytest.mark.parametrize("name", ["spatiotemporal", "temporal"])
def test_exclusive_apps_take_turns(name: str) -> None:
    apps = [single("a", "m1", 25, 50), single("b", "m2", 25, 50), single("c", "m3", 25, 50)]
    s = make_scheduler(name, apps, PROFILES, exclusive=[["a", "b"]])
    q = {"a/m1": deque([50.0]), "b/m2": deque([50.0]), "c/m3": deque([50.0])}
    ds = s.plan(0.0, q)
    running = {d.app for d in ds if d.action == "run"}
    assert not {"a", "b"} <= running  # never both at once
    if name == "spatiotemporal":
        assert running == {"a", "c"}
        (first,) = [d for d in ds if d.app == "a"]
        q["a/m1"].popleft()
        q["c/m3"].popleft()
        s.completed(first, first.predicted_ms)
        assert [d.app for d in s.plan(first.predicted_ms, q)] == ["b"]
    with pytest.raises(ValueError, match="unknown apps"):
        make_scheduler(name, apps, PROFILES, exclusive=[["a", "zz"]])
    with pytest.raises(ValueError, match="in two groups"):
        make_scheduler(name, apps, PROFILES, exclusive=[["a", "b"], ["b", "c"]])


@pytest.mark.parametrize("name", ["spatiotemporal", "temporal"])
def test_a_later_stage_is_probed_too(name: str) -> None:
    """A stale, too pessimistic correction of a DAG's later stage must not starve the chain."""
    app = App("d", (Stage("r", "m1", 50, {"x": "f"}), Stage("f", "s", 50)), DL)
    profiles = {"m1": PROFILES["m1"], "s": SLOW["m1"].model_copy(update={"model": "s"})}
    for probe_ms, want in ((None, ["reject"]), (1000.0, ["run"])):
        s = make_scheduler(name, [app], profiles, probe_ms=probe_ms)
        ds = s.plan(0.0, {"d/r": deque(), "d/f": deque([DL])})
        assert [(d.stage, d.action) for d in ds] == [("f", a) for a in want]
