from __future__ import annotations

import pytest

from gpuprims.profile import paper_profiles
from gpuprims.sched.dag import App, Stage, dnn_recog, single, stage_latency_ms, validate_apps


def test_dnn_recog_structure() -> None:
    a = dnn_recog()
    assert a.entry.model == "recog_router"
    assert a.successors("router") == ["face", "car"]
    assert a.paths() == [["router", "face"], ["router", "car"]]
    assert a.key("face") == "dnn_recog/face"


def test_deadline_split_is_proportional_to_profiled_latency() -> None:
    ps = paper_profiles()
    a = dnn_recog(deadline_ms=30.0).with_deadline_split(ps)
    lat = {s.name: stage_latency_ms(s, ps) for s in a.stages}
    worst = max(lat["router"] + lat["face"], lat["router"] + lat["car"])
    assert a.stage("router").deadline_ms == pytest.approx(30.0 * lat["router"] / worst)
    assert a.stage("face").deadline_ms == pytest.approx(30.0 * lat["face"] / (lat["router"] + lat["face"]))
    for path in a.paths():
        assert sum(a.stage(n).deadline_ms for n in path) <= 30.0 + 1e-9
    # the slower path uses the whole deadline
    assert max(sum(a.stage(n).deadline_ms for n in p) for p in a.paths()) == pytest.approx(30.0)
    assert a.with_deadline_split(ps) is a  # already split


def test_given_stage_deadlines_must_add_up() -> None:
    App("ok", (Stage("a", "m", 50, {"x": "b"}, deadline_ms=10), Stage("b", "m", 50, deadline_ms=20)), 30)
    with pytest.raises(ValueError, match="add up to 31 ms"):
        App("x", (Stage("a", "m", 50, {"x": "b"}, deadline_ms=11), Stage("b", "m", 50, deadline_ms=20)), 30)
    with pytest.raises(ValueError, match="every stage or for none"):
        App("x", (Stage("a", "m", 50, {"x": "b"}, deadline_ms=10), Stage("b", "m", 50)), 30)


@pytest.mark.parametrize(("stages", "needle"), [
    ((Stage("a", "m", 50, {"x": "b"}), Stage("b", "m", 50, {"y": "a"})), "cycle a -> b -> a"),
    ((Stage("a", "m", 50, {"x": "a"}),), "cycle a -> a"),
    ((Stage("a", "m", 50, {"x": "zz"}),), "unknown stage 'zz'"),
    ((Stage("a", "m", 50), Stage("a", "m", 50)), "duplicate stage names"),
    ((Stage("a", "m", 50), Stage("b", "m", 50)), "not reachable"),
    ((), "at least one stage"),
])
def test_invalid_dags(stages: tuple[Stage, ...], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        App("app", stages, 30.0)


@pytest.mark.parametrize(("kw", "needle"), [
    ({"name": "", "model": "m", "gpu_pct": 50}, "stage name"),
    ({"name": "a/b", "model": "m", "gpu_pct": 50}, "stage name"),
    ({"name": "a", "model": "", "gpu_pct": 50}, "model"),
    ({"name": "a", "model": "m", "gpu_pct": 0}, "gpu_pct"),
    ({"name": "a", "model": "m", "gpu_pct": 101}, "gpu_pct"),
    ({"name": "a", "model": "m", "gpu_pct": 50, "deadline_ms": 0}, "deadline_ms"),
])
def test_invalid_stage(kw: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Stage(**kw)


def test_invalid_app_fields_and_sets() -> None:
    with pytest.raises(ValueError, match="deadline_ms"):
        single("a", "m", 50, 0.0)
    with pytest.raises(ValueError, match="gpu must be"):
        single("a", "m", 50, 10.0, gpu=-1)
    with pytest.raises(ValueError, match="app name"):
        single("a/b", "m", 50, 10.0)
    with pytest.raises(ValueError, match="no stage 'q'"):
        single("a", "m", 50, 10.0).stage("q")
    ps = paper_profiles()
    with pytest.raises(ValueError, match="duplicate app names"):
        validate_apps([single("a", "yolov3", 50, 30), single("a", "yolov3", 50, 30)], ps)
    with pytest.raises(ValueError, match="no profile for model 'bert'"):
        validate_apps([single("a", "bert", 50, 30)], ps)
    with pytest.raises(ValueError, match="gpu_pct 5 is outside"):
        validate_apps([single("a", "yolov3", 5, 30)], ps)
    with pytest.raises(ValueError, match="no profile"):
        single("a", "bert", 50, 30).with_deadline_split(ps)
