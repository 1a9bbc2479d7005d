"""The instance process in this process (no orchestrator): a shadow's pre-warm and the heartbeat. Its serving
loop's behaviour is tested in tests/orchestrator/worker/loops/."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from gpuprims.ingest import Ingest
from gpuprims.wire import Status
from orchestrator.worker import instance as instance_mod
from orchestrator.worker.instance import Instance, InstanceSpec
from tests.orchestrator.worker.inproc import answer, send

# -- a shadow's pre-warm when InitGpu comes first ---------------------------------------------------------------

def _prewarming(monkeypatch: pytest.MonkeyPatch, may_raise: bool) -> tuple[Instance, threading.Event]:
    """An instance whose pre-warm thread is held inside its model load until the event is set."""
    inst = Instance.__new__(Instance)  # only the pre-warm's state: no pool, no control
    inst.spec = InstanceSpec(name="s", app="a", app_id=1, model="m", pool="p", consumer=0, defer_init=True,
                             prewarm=True, warmup=False)
    inst.prewarm_state, inst.prewarm_info, inst._prewarmed = "idle", {}, None
    inst._prewarm_lock, inst._prewarm_thread = threading.Lock(), None
    release = threading.Event()

    def build(device: object) -> dict[str, object]:
        release.wait(30)
        return {"model": lambda x: x}

    monkeypatch.setattr(inst, "_build_models", build)
    monkeypatch.setattr(instance_mod, "raise_low_threads", lambda: (1, 0) if may_raise else (0, 1))
    inst.start_prewarm()
    assert inst.prewarm_state == "warming"
    return inst, release


def test_initgpu_before_the_prewarm_ends_abandons_it_when_the_thread_cannot_be_raised(
        monkeypatch: pytest.MonkeyPatch) -> None:
    inst, release = _prewarming(monkeypatch, may_raise=False)
    assert inst._take_prewarmed() is None  # the caller loads on the serving thread
    assert inst.prewarm_state == "abandoned" and inst.prewarm_info["raised"] == 0
    release.set()
    inst._prewarm_thread.join(30)
    assert inst.prewarm_state == "abandoned" and inst._prewarmed is None  # its late result is dropped


def test_initgpu_before_the_prewarm_ends_waits_for_it_when_the_thread_can_be_raised(
        monkeypatch: pytest.MonkeyPatch) -> None:
    inst, release = _prewarming(monkeypatch, may_raise=True)
    threading.Timer(0.2, release.set).start()
    built = inst._take_prewarmed()
    assert built is not None and callable(built["model"])
    assert inst.prewarm_state == "used" and inst.prewarm_info["raised"] == 1


class _Control:
    """Records what the instance sends (the heartbeat is all this test drives)."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, msg: object) -> None:
        self.sent.append(msg)


def test_a_due_heartbeat_waits_for_an_idle_moment_up_to_half_a_period(
        setup: tuple[Instance, Ingest, socket.socket]) -> None:
    inst, ing, sock = setup
    control = _Control()
    inst.control = control  # type: ignore[assignment]
    inst.spec.heartbeat_ms = 10_000.0  # the test moves the clock by hand: no beat falls due on its own
    inst._last_beat = time.monotonic()
    inst.heartbeat()
    assert control.sent == []  # not due
    inst._last_beat = time.monotonic() - 10.5  # due, within the slack
    send(ing, sock, 1)
    deadline = time.monotonic() + 10
    while not inst.serving.busy() and time.monotonic() < deadline:
        time.sleep(0.001)  # the ingest reassembles the request into the ring
    assert inst.serving.busy()
    inst.heartbeat()
    assert control.sent == []  # a request waits: the snapshot waits for it to be served
    assert answer(inst, sock).status == Status.OK
    inst.heartbeat()
    assert len(control.sent) == 1  # idle: sent
    (beat,) = control.sent
    assert beat.stats.ok == 1 and beat.stats.p50_ms > 0  # type: ignore[attr-defined]
    send(ing, sock, 2)
    while not inst.serving.busy() and time.monotonic() < deadline:
        time.sleep(0.001)
    inst._last_beat = time.monotonic() - 15.5  # past the slack: sent though a request waits
    inst.heartbeat()
    assert len(control.sent) == 2
    inst.heartbeat(force=True)  # forced (Finish, Shutdown): sent at once
    assert len(control.sent) == 3
    assert answer(inst, sock).status == Status.OK


def test_the_heartbeat_recomputes_percentiles_only_after_new_answers(
        setup: tuple[Instance, Ingest, socket.socket]) -> None:
    inst, ing, sock = setup
    send(ing, sock, 1)
    assert answer(inst, sock).status == Status.OK
    first = inst.serving.snapshot()
    again = inst.serving.snapshot()
    assert again["stages"] is first["stages"] and again["p99_ms"] == first["p99_ms"]  # nothing new: reused
    send(ing, sock, 2)
    assert answer(inst, sock).status == Status.OK
    after = inst.serving.snapshot()
    assert after["stages"] is not first["stages"] and after["stages"]["batches"] == 2 and after["ok"] == 2
