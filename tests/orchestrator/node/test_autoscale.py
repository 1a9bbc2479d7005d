"""A scripted rate step (paper Fig. 8, scaled to this machine) triggers an automatic GPU% change."""

from __future__ import annotations

import collections
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from gpuprims import wire
from orchestrator.config.schema import load_config, parse_config
from orchestrator.node.monitor import Decision, Monitor, MonitorPolicy
from orchestrator.node.node import Node
from orchestrator.node.reconfig import Phase
from orchestrator.node.state import AppState

pytestmark = pytest.mark.slow

CONFIG = """
node:
  listen: {host: 127.0.0.1, port: 0}
  backend: cpu
  pool: {slot_count: 16384, max_chunks: 64, record_count: 1024}
apps:
  - {name: a, model: resnet18, input_shape: [3, 64, 64], dtype: uint8, slo_ms: 400, gpu_pct: 40, max_batch: 4,
     app_id: 1, num_classes: 10, shadow: true}
"""


def test_rate_step_triggers_an_automatic_change(tmp_path: Path) -> None:
    p = tmp_path / "apps.yaml"
    p.write_text(CONFIG)
    policy = MonitorPolicy(interval_s=0.5, window_s=2.0, confirm=2, dwell_s=30.0, step_pct=40, underuse_util=0.0,
                           slo_target=0.95, min_served=5)
    node = Node(load_config(p), heartbeat_ms=100, monitor=Monitor(policy), warmup=False).start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.settimeout(0.05)
    x = np.random.default_rng(0).integers(0, 256, (3, 64, 64), dtype=np.uint8)
    schedule = [(5.0, 3.0), (400.0, 6.0)]  # (requests/s, seconds): low, then far above one core
    sent = [0]
    got: dict[int, list[int]] = collections.defaultdict(list)
    stop = threading.Event()

    def send() -> None:
        k = 0
        for rate, secs in schedule:
            end = time.monotonic() + secs
            while time.monotonic() < end and not stop.is_set():
                for d in wire.encode_request(1, k, x):
                    sock.sendto(d, ("127.0.0.1", node.ingest.ports[0]))
                k += 1
                sent[0] = k
                time.sleep(max(0.0, 1.0 / rate - 0.0002))

    def recv() -> None:
        asm = wire.ResponseAssembler()
        while not stop.is_set():
            try:
                r = asm.feed(sock.recv(65536))
            except TimeoutError:
                continue
            if r is not None:
                got[r.request_id].append(r.status)

    threads = [threading.Thread(target=send), threading.Thread(target=recv)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 90
        while threads[0].is_alive() and time.monotonic() < deadline:
            node.step(20)
        end = time.monotonic() + 30
        while len(got) < sent[0] and time.monotonic() < end:
            node.step(20)
        # The change the step asked for may still be loading on a busy machine: let it end.
        end = time.monotonic() + node.cfg.node.change_timeout_s
        while node.changes.running and time.monotonic() < end:
            node.step(20)
        decisions = [e for e in node.events if e["event"] == "decision"]
    finally:
        stop.set()
        for t in threads:
            t.join()
        sock.close()
        node.stop()
    assert decisions, "the rate step did not trigger a change"
    d = decisions[0]
    assert d["verdict"] == "overloaded" and d["ok"], d
    assert d["from_pct"] == 40 and d["to_pct"] > 40
    assert node.apps["a"].gpu_pct == d["to_pct"]
    # No request lost or answered twice across the automatic switch.
    assert sorted(got) == list(range(sent[0]))
    assert all(len(v) == 1 for v in got.values())


# -- the node's side of automatic changes (no processes: the monitor's decisions are scripted) ----------------

class _Scripted(Monitor):
    """A monitor whose next sample returns the given decisions."""

    def __init__(self, policy: MonitorPolicy) -> None:
        super().__init__(policy, needed_pct=lambda app, rps: None)
        self.next: list[Decision] = []
        self.told: list[tuple[str, float]] = []

    def sample(self, now: float, status: Any) -> list[Decision]:
        out, self.next = self.next, []
        return out

    def changed(self, app: str, now: float) -> None:
        self.told.append((app, now))
        super().changed(app, now)


def _node(monkeypatch: pytest.MonkeyPatch, cores_per_pct: dict[int, int]) -> tuple[Node, _Scripted, list[Any]]:
    cfg = parse_config({"node": {"backend": "cpu", "listen": {"host": "127.0.0.1", "port": [0]}},
                        "apps": [{"name": "a", "model": "mobilenet_v2", "app_id": 1, "input_shape": [3, 32, 32],
                                  "slo_ms": 100, "gpu_pct": 50, "shadow": True}]}, source="test")
    mon = _Scripted(MonitorPolicy(max_util_after=0.7))
    node = Node(cfg, monitor=mon)
    node.apps["a"] = AppState(cfg=cfg.apps[0], gpu_pct=50, instances=1)
    # Whole cores per share, as on a 4-core machine (independent of this machine's cores).
    monkeypatch.setattr(node.placement, "capacity", lambda pct: cores_per_pct[min(cores_per_pct, key=lambda p: abs(p - pct))])
    asked: list[Any] = []

    def set_gpu(app: str, pct: int, **kw: Any) -> Any:
        asked.append((app, pct, kw))
        return SimpleNamespace(id=len(asked))

    monkeypatch.setattr(node, "set_gpu", set_gpu)
    return node, mon, asked


def _decision(verdict: str, from_pct: int, to_pct: int, util: float) -> Decision:
    return Decision(t=0.0, app="a", from_pct=from_pct, to_pct=to_pct, verdict=verdict, reason=f"{verdict} because",
                    window={"utilisation": util})


def test_a_step_down_that_would_leave_the_instance_busy_is_not_made(monkeypatch: pytest.MonkeyPatch) -> None:
    node, mon, asked = _node(monkeypatch, {25: 1, 50: 2, 75: 3, 100: 4})
    mon.next = [_decision("underused", 50, 25, util=0.4)]  # 2 cores -> 1 would make it 80 % busy
    mon.autoscale(node, time.monotonic())
    assert asked == []
    ev = [e for e in node.events if e["event"] == "decision"][-1]
    assert ev["ok"] is False and "would be busy 80%" in ev["result"] and ev["reason"] == "underused because"
    assert node.status()["decisions"][-1] == ev  # visible in status
    mon.next = [_decision("underused", 50, 25, util=0.25)]  # -> 50 %: made, with its reason
    mon.autoscale(node, time.monotonic())
    assert asked == [("a", 25, {"origin": "monitor", "reason": "underused: underused because"})]
    ev = [e for e in node.events if e["event"] == "decision"][-1]
    assert ev["ok"] is True and ev["to_pct"] == 25


def test_a_change_the_monitor_asked_for_carries_its_reason_into_status(monkeypatch: pytest.MonkeyPatch) -> None:
    node, _mon, _ = _node(monkeypatch, {25: 1, 50: 2, 75: 3, 100: 4})
    monkeypatch.setattr(node.changes, "check", lambda app, pct: None)
    ch = Node.set_gpu(node, "a", 75, origin="monitor", reason="overloaded: SLO attainment 90.0% < 99%")
    recent = node.status()["changes"]["recent"][-1]
    assert recent["id"] == ch.id and recent["origin"] == "monitor"
    assert recent["reason"] == "overloaded: SLO attainment 90.0% < 99%"
    assert any(e["event"] == "change_accepted" and e["reason"] == recent["reason"] for e in node.events)


def test_the_monitor_is_told_of_running_and_finished_changes_once(monkeypatch: pytest.MonkeyPatch) -> None:
    node, mon, _ = _node(monkeypatch, {25: 1, 50: 2, 75: 3, 100: 4})
    monkeypatch.setattr(node.changes, "check", lambda app, pct: None)
    ch = Node.set_gpu(node, "a", 75)
    mon.autoscale(node, time.monotonic())
    assert [a for a, _ in mon.told] == ["a"]  # running: its window restarts every sample
    ch._enter(Phase.DONE)
    node.changes.running.clear()
    node.changes.finished.append(ch)
    mon.autoscale(node, time.monotonic())
    mon.autoscale(node, time.monotonic())
    assert mon.told[1:] == [("a", ch.ended)]  # finished: once, dwell counted from its end
