"""The fleet agent reads its node's status reply by field (a NodeView), and an unusable reply as no
apps, without starting a node (the agent's own methods over a stand-in)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from orchestrator.control.records import AppTotals, AppView, InstanceStats, InstanceView, NodeView, Role
from orchestrator.fleet.agent import Agent


def _agent(status: dict[str, Any]) -> Any:
    return SimpleNamespace(name="node-a", status=lambda: status, info=lambda: {"node": "node-a"},
                           loaded={"cls": {}}, proc=SimpleNamespace(poll=lambda: None))


def _reply() -> dict[str, Any]:
    def inst(name: str, role: Role) -> InstanceView:
        return InstanceView(name=name, pid=1, role=role, ready=True, gpu_pct=40, gpu=0, consumer=0,
                            stats=InstanceStats(ok=3))
    app = AppView(name="cls", app_id=7, model="mobilenet_v2", slo_ms=50.0, gpu_pct=40, gpu=0,
                  instances=(inst("cls-0", Role.ACTIVE), inst("cls-1", Role.ACTIVE), inst("cls-s2", Role.SHADOW)),
                  totals=AppTotals(arrival_rps=12.5, service_rps=12.0, slo_attainment=0.98))
    view = NodeView(apps={"cls": app}, node={"gpus": {"0": 80}, "errors": {"monitor": 1}})
    return json.loads(json.dumps(view.to_dict()))


def test_the_state_reads_the_reply_by_field() -> None:
    st = Agent.state(_agent(_reply()))
    assert st["apps"] == {"cls": {"gpu": 0, "gpu_pct": 40, "arrival_rps": 12.5, "service_rps": 12.0,
                                  "slo_attainment": 0.98, "instances": 2}}
    assert st["held"] == {"0": 80} and st["errors"] == {"monitor": 1} and st["loaded"] == ["cls"]
    assert st["orchestrator"] is True and st["node"] == "node-a"


def test_an_unreachable_or_malformed_reply_reads_as_no_apps(caplog: pytest.LogCaptureFixture) -> None:
    assert Agent.state(_agent({"error": "timed out"}))["apps"] == {}
    bad = _reply()
    bad["apps"]["cls"]["instances"][0]["role"] = "primary"
    with caplog.at_level(logging.WARNING, logger="gpuprims.fleet"):
        st = Agent.state(_agent(bad))
    assert st["apps"] == {} and st["held"] == {}
    assert "malformed" in caplog.text and "role must be one of" in caplog.text
