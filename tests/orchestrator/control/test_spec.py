"""The instance's spec across the process boundary: its engine choice and DAG stages travel as typed
records (EngineSpec, StageSpec) and come back the same; a malformed spec is refused with the reason."""

from __future__ import annotations

import json

import pytest

from orchestrator.control.records import EngineSpec, StageSpec
from orchestrator.control.spec import InstanceSpec


def _spec(**kw: object) -> InstanceSpec:
    return InstanceSpec(name="d-0", app="d", app_id=1, model="", pool="p", consumer=0, **kw)  # type: ignore[arg-type]


def test_engine_and_stages_round_trip() -> None:
    spec = _spec(engine=EngineSpec("onnxruntime", {"provider": "cpu"}),
                 stages=[StageSpec("r", "recog_router", ("face",), EngineSpec("onnxruntime")), StageSpec("face", "vgg")],
                 entry="r")
    assert isinstance(spec.stages, tuple)  # a list given is kept as a tuple
    back = InstanceSpec.from_json(spec.to_json())
    assert back == spec
    assert back.engine.kind == "onnxruntime" and back.stages is not None and back.stages[1].engine == EngineSpec()
    assert InstanceSpec.from_json(_spec().to_json()).engine == EngineSpec("eager")


@pytest.mark.parametrize(("change", "needle"), [
    ({"engine": "onnxruntime"}, "engine spec"),
    ({"engine": {"kind": "eager", "provider": "cpu"}}, "engine spec"),
    ({"stages": {"name": "r"}}, "stages must be a list"),
    ({"stages": [{"name": "r", "model": "m", "routes": "face"}]}, "stage"),
    ({"stages": [{"name": "r", "model": "m", "engine": {"kind": ""}}]}, "engine spec"),
])
def test_a_malformed_spec_is_refused(change: dict[str, object], needle: str) -> None:
    data = json.loads(_spec().to_json())
    data.update(change)
    with pytest.raises(ValueError, match=needle):
        InstanceSpec.from_json(json.dumps(data))


def test_the_spec_takes_records_only() -> None:
    with pytest.raises(TypeError, match="EngineSpec"):
        _spec(engine="onnxruntime")
    with pytest.raises(TypeError, match="StageSpecs"):
        _spec(stages=[{"name": "r", "model": "m"}])
