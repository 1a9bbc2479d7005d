"""orchestrator.node.handlers: each control message type has its handler in the table; "ready" is logged once
per instance; commands are answered exactly once."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from orchestrator.control.errors import ChangeError
from orchestrator.control.messages import (
    BatchDone,
    Ended,
    Error,
    Heartbeat,
    Ready,
    Result,
    SetGpuRequest,
    StatusReply,
    StatusRequest,
    StopRequest,
)
from orchestrator.node.handlers import HANDLERS, handle
from orchestrator.node.state import Role


class _Node:
    """The ControlHost surface over plain records."""

    def __init__(self) -> None:
        self.apps: dict[str, Any] = {}
        self.instances: dict[str, Any] = {}
        self.dispatcher = None
        self.calls: list[tuple[str, Any]] = []
        self.replies: list[tuple[Any, Any]] = []
        self.supervisor = SimpleNamespace(
            route=lambda app: self.calls.append(("route", app)),
            shadow_ok=lambda app: self.calls.append(("shadow_ok", app)),
            overflow_ok=lambda st: self.calls.append(("overflow_ok", st.name)),
            reported=lambda name, error: self.calls.append(("reported", (name, error))))
        self.stopped: list[bool] = []

    def add(self, name: str, role: Role) -> Any:
        st = SimpleNamespace(name=name, app="a", role=role, ready=False, initialized=False, info={},
                             spec=SimpleNamespace(consumer=3), ended=False)
        self.instances[name] = st
        return st

    def status(self) -> dict[str, Any]:
        return {"node": {"backend": "cpu"}}

    def request_stop(self, drain: bool = True) -> None:
        self.stopped.append(drain)

    def set_gpu(self, app: str, gpu_pct: int) -> Any:
        if gpu_pct > 90:
            raise ChangeError("too much")
        return SimpleNamespace(phase=SimpleNamespace(terminal=False), id=1, app=app, from_pct=50, to_pct=gpu_pct,
                               to_dict=lambda: {"id": 1})

    def reply(self, item: Any, msg: Any) -> None:
        self.replies.append((item, msg))


def _in(msg: Any) -> Any:
    return SimpleNamespace(msg=msg)


def test_every_message_type_the_node_takes_has_a_handler() -> None:
    assert set(HANDLERS) == {Heartbeat, Ready, BatchDone, Ended, Error, StatusRequest, StopRequest, SetGpuRequest}


def test_a_shadow_logs_ready_once_for_its_first_its_warm_and_its_initialised_ready(
        caplog: pytest.LogCaptureFixture) -> None:
    node = _Node()
    node.add("a-s1", Role.SHADOW)
    with caplog.at_level(logging.DEBUG, logger="gpuprims.node"):
        handle(node, _in(Ready(instance="a-s1", pid=7, info={"initialized": False})))
        handle(node, _in(Ready(instance="a-s1", pid=7, info={"initialized": False, "warm": True, "prewarm": "warm"})))
        handle(node, _in(Ready(instance="a-s1", pid=7, info={"initialized": True})))
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == ["a-s1 ready (pid 7)"]
    assert node.calls == [("shadow_ok", "a")] * 3
    assert node.instances["a-s1"].ready and node.instances["a-s1"].initialized


def test_an_active_is_routed_when_ready_and_an_unknown_instance_is_ignored() -> None:
    node = _Node()
    node.add("a-0", Role.ACTIVE)
    handle(node, _in(Ready(instance="a-0", pid=8, info={"initialized": True})))
    handle(node, _in(Ready(instance="gone", pid=9, info={})))
    handle(node, _in(Ended(instance="a-0", drained_count=2)))
    assert node.calls == [("route", "a")] and node.instances["a-0"].ended


def test_an_error_is_kept_by_the_supervisor_even_for_an_instance_gone() -> None:
    node = _Node()
    handle(node, _in(Error(instance="a-9", kind="model", message="bad file")))
    assert node.calls == [("reported", ("a-9", "model: bad file"))]


def test_each_command_is_answered_exactly_once() -> None:
    node = _Node()
    items = [_in(StatusRequest()), _in(StopRequest(drain=False)), _in(SetGpuRequest(app="a", gpu_pct=70)),
             _in(SetGpuRequest(app="a", gpu_pct=95))]
    for item in items:
        handle(node, item)
    assert [id(i) for i, _ in node.replies] == [id(i) for i in items]
    status, stop, ok, refused = (m for _, m in node.replies)
    assert isinstance(status, StatusReply) and status.status["node"]["backend"] == "cpu"
    assert isinstance(stop, Result) and stop.ok and node.stopped == [False]
    assert ok.ok and ok.message == "change 1 accepted: a 50% -> 70%" and ok.data == {"change": {"id": 1}}
    assert not refused.ok and refused.message == "too much"


def test_a_message_type_without_a_handler_is_ignored() -> None:
    node = _Node()
    handle(node, _in(object()))
    assert node.replies == [] and node.calls == []
