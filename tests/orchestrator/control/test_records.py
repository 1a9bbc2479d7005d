"""The node's typed vocabulary (orchestrator/control/records.py): roles, the heartbeat body, the view of
a node and its status JSON, the engine choice and DAG stages across the process boundary."""

from __future__ import annotations

import json
from typing import Any

import pytest

from orchestrator.control.records import (
    SERVING_ROLES,
    AppTotals,
    AppView,
    EngineSpec,
    InstanceStats,
    InstanceView,
    NodeView,
    Role,
    StageSpec,
)
from orchestrator.worker.loops.stats import LatencyStats


def test_roles_are_their_own_status_text() -> None:
    assert [str(r) for r in Role] == ["active", "shadow", "overflow", "loading", "finishing", "stopping"]
    assert Role("shadow") is Role.SHADOW and Role.ACTIVE == "active"
    assert json.dumps({"role": Role.OVERFLOW}) == '{"role": "overflow"}'
    assert {Role.ACTIVE, Role.OVERFLOW} == SERVING_ROLES
    with pytest.raises(ValueError):
        Role("primary")


def test_instance_stats_round_trip_through_json() -> None:
    s = InstanceStats(received=5, ok=4, errors=1, p50_ms=1.25, batch_sizes={"2": 2}, engine={"kind": "eager"},
                      gpu_pct=30, initialized=True, mps_pct="30", device_bytes=1 << 20)
    back = InstanceStats.from_wire(json.loads(json.dumps(s.to_wire())))
    assert back == s and back.answered == 5
    assert InstanceStats.from_wire({}) == InstanceStats()  # a missing field takes its default


@pytest.mark.parametrize(("bad", "needle"), [
    ({"ok": 1.5}, "InstanceStats.ok"),
    ({"queue_len": -1}, "InstanceStats.queue_len"),
    ({"initialized": 1}, "InstanceStats.initialized"),
    ({"busy_ms": float("inf")}, "InstanceStats.busy_ms"),
    ({"mps_pct": 30}, "InstanceStats.mps_pct"),
    ({"stages": None}, "InstanceStats.stages"),
    ({"role": "active"}, "unknown fields ['role']"),
    ("ok=1", "JSON object"),
])
def test_instance_stats_from_wire_refuses_bad_fields(bad: Any, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        InstanceStats.from_wire(bad)


def _view() -> NodeView:
    stats = InstanceStats(received=9, ok=8, queue_len=2, busy_ms=5.0, engine={"kind": "onnxruntime"}, gpu_pct=40)
    insts = (InstanceView(name="a-0", pid=11, role=Role.ACTIVE, ready=True, gpu_pct=40, gpu=0, consumer=0,
                          cores=(0, 1), stats=stats, engine=stats.engine, memory={"pss_bytes": 1, "device_bytes": None}),
             InstanceView(name="a-s1", pid=12, role=Role.SHADOW, ready=True, gpu_pct=40, gpu=0, consumer=1,
                          warm=True, prewarm="warm"),
             InstanceView(name="a-1", pid=13, role=Role.ACTIVE, ready=False, gpu_pct=40, gpu=0, consumer=2))
    a = AppView(name="a", app_id=1, model="resnet18", slo_ms=50.0, gpu_pct=40, gpu=0, instances=insts,
                totals=AppTotals(received=9, ok=8, within_slo=8, slo_attainment=1.0), restarts=1)
    return NodeView(apps={"a": a}, node={"backend": "cpu", "fork_servers": []}, drops={"bad_magic": 1})


def test_the_active_instances_of_an_app_in_one_call() -> None:
    v = _view()
    assert [i.name for i in v.active("a")] == ["a-0", "a-1"]
    assert [i.name for i in v.apps["a"].with_role(Role.SHADOW)] == ["a-s1"]
    assert v.active("nope") == ()
    assert [i.queue_len for i in v.active("a")] == [2, 0]  # no heartbeat yet: nothing queued


def test_the_status_json_is_the_view_flattened_as_before() -> None:
    st = json.loads(json.dumps(_view().to_dict()))
    a = st["apps"]["a"]
    assert a["app_id"] == 1 and a["received"] == 9 and a["slo_attainment"] == 1.0 and a["restarts"] == 1
    first, shadow, _ = a["instances"]
    # The heartbeat's fields flattened into the instance's entry; engine and memory last.
    assert first["role"] == "active" and first["ok"] == 8 and first["cores"] == [0, 1]
    assert first["engine"] == {"kind": "onnxruntime"} and first["memory"]["pss_bytes"] == 1
    # Before its first heartbeat an instance's entry has none of the heartbeat's fields.
    assert shadow["role"] == "shadow" and shadow["warm"] is True and "ok" not in shadow
    assert st["drops"] == {"bad_magic": 1} and st["node"]["backend"] == "cpu" and st["repository"] is None
    assert "model_file" not in a


def test_engine_spec_and_stage_spec_cross_as_json() -> None:
    e = EngineSpec("onnxruntime", {"threads": 2})
    assert EngineSpec.from_wire(json.loads(json.dumps(e.to_wire()))) == e
    s = StageSpec("face", "resnet18", ("a", "b"), e)
    assert StageSpec.from_wire(json.loads(json.dumps(s.to_wire()))) == s
    assert StageSpec.from_wire({"name": "x", "model": "m"}) == StageSpec("x", "m")


@pytest.mark.parametrize("bad", [{"kind": ""}, {"kind": 3}, {"kind": "eager", "options": []},
                                 {"kind": "eager", "extra": 1}, "eager"])
def test_engine_spec_refuses_bad_wire(bad: Any) -> None:
    with pytest.raises(ValueError, match="engine spec"):
        EngineSpec.from_wire(bad)


@pytest.mark.parametrize("bad", [{"name": "x"}, {"name": "x", "model": "m", "routes": "a"},
                                 {"name": "x", "model": "m", "routes": [1]}, {"name": "x", "model": "m", "z": 1}, []])
def test_stage_spec_refuses_bad_wire(bad: Any) -> None:
    with pytest.raises(ValueError, match="stage"):
        StageSpec.from_wire(bad)


def test_a_status_reply_reads_back_as_the_view() -> None:
    v = _view()
    back = NodeView.from_dict(json.loads(json.dumps(v.to_dict())))
    assert back.to_dict() == json.loads(json.dumps(v.to_dict()))
    a = back.apps["a"]
    assert [i.name for i in a.active] == ["a-0", "a-1"] and a.totals.slo_attainment == 1.0
    assert a.instances[0].stats == v.apps["a"].instances[0].stats and a.instances[1].stats is None
    assert NodeView.from_dict({}) == NodeView()


@pytest.mark.parametrize(("change", "needle"), [
    (lambda st: st.update(apps=[]), "apps must be a JSON object"),
    (lambda st: st["apps"]["a"].update(gpu_pct="50"), r"app 'a'.gpu_pct"),
    (lambda st: st["apps"]["a"].pop("slo_ms"), r"app 'a' lacks \['slo_ms'\]"),
    (lambda st: st["apps"]["a"].pop("model"), r"app 'a' lacks \['model'\]"),
    (lambda st: st["apps"]["a"].update(instances={}), "instances must be a list"),
    (lambda st: st["apps"]["a"].update(slo_attainment="all"), "slo_attainment"),
    (lambda st: st["apps"]["a"]["instances"][0].update(role="primary"), "role must be one of"),
    (lambda st: st["apps"]["a"]["instances"][0].update(ok=-1), "InstanceStats.ok"),
    (lambda st: st["apps"]["a"]["instances"][1].pop("pid"), r"lacks \['pid'\]"),
    (lambda st: st.update(decisions={}), "decisions"),
    ("not a dict", "must be a JSON object"),
])
def test_a_malformed_status_reply_is_refused_with_the_reason(change: Any, needle: str) -> None:
    st: Any = json.loads(json.dumps(_view().to_dict()))
    if callable(change):
        change(st)
    else:
        st = change
    with pytest.raises(ValueError, match=needle):
        NodeView.from_dict(st)


def test_the_instances_snapshot_is_an_instance_stats() -> None:
    """The heartbeat's producer (orchestrator/worker/loops/stats.py) names exactly the record's fields:
    a new figure is one field here and one key there, or the instance's heartbeat fails this first."""
    snap = LatencyStats(100.0).snapshot(3, 1)
    stats = InstanceStats(**snap, gpu_pct=50, initialized=True)
    assert InstanceStats.from_wire(json.loads(json.dumps(stats.to_wire()))) == stats
    assert stats.queue_len == 3 and stats.held == 1
