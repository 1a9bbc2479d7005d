"""Overlapped-Execution on the CPU backend: GPU% changes under load lose and duplicate nothing."""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from gpuprims import wire
from gpuprims.cpushare import thread_priority
from gpuprims.wire import Status
from orchestrator.config.schema import load_config
from orchestrator.control.records import InstanceStats
from orchestrator.node import reconfig
from orchestrator.node.node import Node
from orchestrator.node.reconfig import Change, Phase, change_gpu_pct, restart_gpu_pct
from orchestrator.node.supervisor import SHADOW_IMPORT_NICE

pytestmark = pytest.mark.slow

CONFIG = """
node:
  listen: {host: 127.0.0.1, port: 0}
  backend: cpu
  pool: {slot_count: 4096, max_chunks: 64, record_count: 512}
  shadow_settle_s: 2
apps:
  - {name: a, model: MODEL_A, input_shape: [3, 32, 32], slo_ms: 3000, gpu_pct: 50, max_batch: 8, app_id: 1,
     num_classes: 10, shadow: true}
  - {name: b, model: resnet18, input_shape: [3, 32, 32], slo_ms: 3000, gpu_pct: 50, max_batch: 8, app_id: 2,
     num_classes: 10, shadow: cold}
"""


class Load:
    """Steady requests for app 1 from a thread, responses collected by another."""

    def __init__(self, port: int, rate_rps: float = 100.0, app_id: int = 1) -> None:
        self.addr = ("127.0.0.1", port)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.settimeout(0.05)
        self.rate = rate_rps
        self.app_id = app_id
        self.sent = 0
        self.got: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
        self._stop_send = threading.Event()
        self._stop_recv = threading.Event()
        self._x = np.random.default_rng(0).random((3, 32, 32), dtype=np.float32)
        self._threads = [threading.Thread(target=self._send), threading.Thread(target=self._recv)]
        for t in self._threads:
            t.start()

    def _send(self) -> None:
        t0 = time.monotonic()
        while not self._stop_send.is_set() and self.sent < 20_000:
            for d in wire.encode_request(self.app_id, self.sent, self._x, client_ts_ns=time.monotonic_ns()):
                self.sock.sendto(d, self.addr)
            self.sent += 1
            time.sleep(max(0.0, t0 + self.sent / self.rate - time.monotonic()))

    def _recv(self) -> None:
        asm = wire.ResponseAssembler()
        while not self._stop_recv.is_set():
            try:
                r = asm.feed(self.sock.recv(65536))
            except TimeoutError:
                continue
            if r is not None:
                self.got[r.request_id].append((r.status, time.monotonic_ns()))

    def finish(self, node: Node, timeout_s: float = 30.0) -> None:
        self._stop_send.set()
        self._threads[0].join()
        deadline = time.monotonic() + timeout_s
        while len(self.got) < self.sent and time.monotonic() < deadline:
            node.step(20)
        self._stop_recv.set()
        self._threads[1].join()
        self.sock.close()


def start(tmp_path: Path, model_a: str = "mobilenet_v2") -> Node:
    p = tmp_path / "apps.yaml"
    p.write_text(CONFIG.replace("MODEL_A", model_a))
    return Node(load_config(p), heartbeat_ms=100, warmup=False).start()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = start(tmp_path)
    yield n
    n.stop()


def _pump(node: Node, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        node.step(20)


def test_change_under_load_loses_and_duplicates_nothing(node: Node) -> None:
    load = Load(node.ingest.ports[0])
    _pump(node, 1.0)
    before = {st.name for st in node.instances.values() if st.app == "a" and st.role == "active"}
    ok, msg = change_gpu_pct(node, "a", 30)
    assert ok, msg
    _pump(node, 1.0)
    load.finish(node)
    assert load.sent > 50
    assert sorted(load.got) == list(range(load.sent)), "every request answered"
    assert all(len(v) == 1 for v in load.got.values()), "none answered twice"
    statuses = collections.Counter(Status(v[0][0]).name for v in load.got.values())
    assert set(statuses) == {"OK"}, statuses
    after = [st for st in node.instances.values() if st.app == "a" and st.role == "active"]
    assert len(after) == 1 and after[0].name not in before and after[0].spec.gpu_pct == 30
    assert node.apps["a"].gpu_pct == 30
    # A fresh shadow is prepared for the next change, once the new active has had its cores alone
    # for node.shadow_settle_s.
    _until(node, lambda: node.shadow_of("a") is not None, 120, "the next shadow")
    ended = next(ch for ch in node.changes.finished if ch.app == "a").ended
    assert ended is not None
    started = [e["t"] for e in node.events if e["event"] == "shadow_started" and e["app"] == "a"][-1]
    assert started - ended >= node.cfg.node.shadow_settle_s == 2
    changed = [e for e in node.events if e["event"] == "changed"]
    assert changed and changed[-1]["switched"][0]["route_switch_ms"] < 1000
    c = node.ingest.counters()
    assert c["drop_unknown_app"] == 0


def test_a_cold_shadow_is_started_by_the_change_which_loses_and_duplicates_nothing(node: Node) -> None:
    # b has `shadow: cold`: no shadow is kept; the change starts one and pays its start, while the old
    # active goes on serving until the new one is ready.
    assert node.shadow_of("b") is None and node.shadow_of("a") is not None
    load = Load(node.ingest.ports[0], rate_rps=50.0, app_id=2)
    _pump(node, 1.0)
    before = {st.name for st in node.instances.values() if st.app == "b"}
    ok, msg = change_gpu_pct(node, "b", 30)
    assert ok, msg
    _pump(node, 1.0)
    load.finish(node)
    assert load.sent > 50
    assert sorted(load.got) == list(range(load.sent)), "every request answered"
    assert all(len(v) == 1 for v in load.got.values()), "none answered twice"
    statuses = collections.Counter(Status(v[0][0]).name for v in load.got.values())
    # A loaded machine answers some late or overloaded (explicit answers); none is lost to the change.
    assert set(statuses) <= {"OK", "DEADLINE_MISSED", "OVERLOADED"} and statuses["OK"] > 0, statuses
    ch = next(ch for ch in node.changes.finished if ch.app == "b")
    assert ch.phase is Phase.DONE and ch.switched[0]["from"] in before and ch.switched[0]["to"] not in before
    after = [st for st in node.instances.values() if st.app == "b" and st.role == "active"]
    assert [st.name for st in after] == [ch.switched[0]["to"]] and after[0].spec.gpu_pct == 30
    _pump(node, node.cfg.node.shadow_settle_s + 1.0)  # past the settle time a warm app's shadow would start
    assert node.shadow_of("b") is None
    assert not [e for e in node.events if e["event"] == "shadow_started" and e["app"] == "b"]


def test_oversubscription_is_refused(node: Node) -> None:
    ok, msg = change_gpu_pct(node, "a", 80)
    assert not ok and "130%" in msg and "allow_oversubscribe" in msg
    assert node.apps["a"].gpu_pct == 50
    ok, msg = change_gpu_pct(node, "nope", 10)
    assert not ok and "no app named 'nope'" in msg


def test_second_change_during_one_is_refused(node: Node) -> None:
    node.changing.add("a")
    ok, msg = change_gpu_pct(node, "a", 40)
    assert not ok and "already in progress" in msg
    node.changing.discard("a")


def test_shadow_init_failure_keeps_the_active_serving(tmp_path: Path) -> None:
    flag = tmp_path / "fail-now"
    mod = tmp_path / "flaky_model.py"
    mod.write_text(
        "import os\nfrom apps.zoo import build_model\n"
        f"def factory(**kw):\n    if os.path.exists({str(flag)!r}):\n        raise RuntimeError('out of memory')\n"
        "    return build_model('mobilenet_v2', **kw)\n")
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{old}" if old else str(tmp_path)
    try:
        n = start(tmp_path, "flaky_model:factory")
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    try:
        active = next(st for st in n.instances.values() if st.app == "a" and st.role == "active")
        flag.write_text("1")
        load = Load(n.ingest.ports[0], rate_rps=50)
        ok, msg = change_gpu_pct(n, "a", 30)
        assert not ok and "out of memory" in msg and "keeps serving at 50%" in msg
        _pump(n, 0.5)
        load.finish(n)
        assert active.name in n.instances and n.instances[active.name].role == "active"
        assert n.apps["a"].gpu_pct == 50
        assert sorted(load.got) == list(range(load.sent))
        statuses = collections.Counter(Status(v[0][0]).name for v in load.got.values())
        assert statuses == {"OK": load.sent}, (statuses, n.status())
    finally:
        n.stop()


def test_active_dying_while_draining_hands_its_requests_on(node: Node) -> None:
    # Simulate the middle of a switch: the shadow is active, the old active is draining and dies.
    ok, msg = change_gpu_pct(node, "a", 40)
    assert ok, msg
    new_active = next(st for st in node.instances.values() if st.app == "a" and st.role == "active")
    victim = next(st for st in node.instances.values() if st.app == "b")
    victim.role = "finishing"
    os.kill(victim.pid, signal.SIGKILL)
    victim.proc.wait()
    node.step(10)
    assert victim.name not in node.instances
    assert any(e["event"] == "died_draining" and e["instance"] == victim.name for e in node.events)
    assert new_active.name in node.instances


def test_an_instance_the_node_kills_while_draining_is_not_reported_as_a_crash(
        node: Node, caplog: pytest.LogCaptureFixture) -> None:
    # A change kills a replacement that was still starting at its switch (or one that would not drain).
    victim = next(st for st in node.instances.values() if st.app == "b")
    node.supervisor.kill(victim, role="finishing")
    victim.proc.wait()
    with caplog.at_level(logging.INFO, logger="gpuprims.node"):
        node.step(10)
    assert victim.name not in node.instances
    assert any(e["event"] == "killed_draining" and e["instance"] == victim.name for e in node.events)
    assert not any(e["event"] == "died_draining" for e in node.events)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR and victim.name in r.getMessage()]
    assert any("killed by its change" in r.getMessage() for r in caplog.records)


def test_kill_and_restart_baseline(node: Node) -> None:
    load = Load(node.ingest.ports[0], rate_rps=50)
    _pump(node, 0.5)
    ok, msg = restart_gpu_pct(node, "a", 30)
    assert ok, msg
    _pump(node, 0.5)
    load.finish(node)
    assert node.apps["a"].gpu_pct == 30
    # Every request is answered once: OK, INSTANCE_FAILED for what the killed instance held,
    # DEADLINE_MISSED for those that waited out the restart (the downtime this baseline shows), or
    # OVERLOADED when a slow restart on a busy machine let the replacement's queue fill up.
    assert sorted(load.got) == list(range(load.sent))
    assert all(len(v) == 1 for v in load.got.values())
    assert {v[0][0] for v in load.got.values()} <= {Status.OK, Status.INSTANCE_FAILED, Status.DEADLINE_MISSED,
                                                    Status.OVERLOADED}


def _until(node: Node, cond: Any, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        node.step(20)


def test_a_prewarmed_shadow_switches_without_loading_and_the_switch_is_measured_on_the_data_path(
        node: Node) -> None:
    # The shadow loads its model ahead of the change in a nice-19 thread (cpu backend). On a quiet
    # machine that takes about a second; beside busy loops it can take minutes, so the change does not
    # wait for it: it then raises the thread (when this process may) and waits for it, or loads itself.
    _until(node, lambda: (sh := node.shadow_of("a")) is not None and sh.ready, 180, "the shadow's start")
    end = time.monotonic() + 10
    while not node.shadow_of("a").info.get("warm") and time.monotonic() < end:
        node.step(20)
    shadow = node.shadow_of("a")
    assert shadow is not None
    warm_before = bool(shadow.info.get("warm"))
    # It imported its code at a lowered priority too (orchestrator.worker.launch), as the supervisor asked,
    # or it imported nothing: it was forked from the fork server (orchestrator.worker.forkserver).
    imp = shadow.info["import"]
    assert imp.get("forked") is True or imp["nice"] == SHADOW_IMPORT_NICE, shadow.info
    # The actives did not import at a lowered priority: their start is urgent.
    assert all(st.info.get("import", {}).get("nice") is None for st in node.instances.values() if st.role == "active")
    if warm_before:
        assert shadow.info["priority"] == "nice"
        entry = next(i for i in node.status()["apps"]["a"]["instances"] if i["name"] == shadow.name)
        assert entry["role"] == "shadow" and entry["warm"] is True
    load = Load(node.ingest.ports[0], rate_rps=50)
    _until(node, lambda: load.got, 60, "first answers")
    ok, msg = change_gpu_pct(node, "a", 30)
    assert ok, msg
    ch = node.changes.finished[-1]
    sw = ch.switched[0]
    assert sw["to"] == shadow.name
    assert sw["prewarmed"] is (warm_before or bool(thread_priority()["can_raise"]))
    # The serving thread of the new active runs at normal priority (only the pre-warm thread was lowered).
    assert os.sched_getscheduler(shadow.pid) == os.SCHED_OTHER
    assert os.getpriority(os.PRIO_PROCESS, shadow.pid) == 0
    _until(node, lambda: sw["data_path"] != "waiting", 60, "the new instance's first answer")
    load.finish(node)
    assert sw["data_path"] == "measured"
    assert sw["old_last_answer_ns"] and sw["new_first_answer_ns"] and sw["new_first_answer_ns"] > sw["switch_ns"]
    assert sw["answer_gap_ms"] == pytest.approx((sw["new_first_answer_ns"] - sw["old_last_answer_ns"]) / 1e6, abs=1e-3)
    assert sw["downtime_ms"] == max(0.0, min(sw["answer_gap_ms"], sw["new_first_wait_ms"]))
    recent = node.status()["changes"]["recent"][-1]
    assert recent["switched"][0]["downtime_ms"] == sw["downtime_ms"]
    assert any(e["event"] == "switch_measured" and e["change"] == ch.id for e in node.events)
    assert sorted(load.got) == list(range(load.sent))
    assert all(len(v) == 1 and v[0][0] == Status.OK for v in load.got.values())


def test_a_shadow_stopped_while_it_prewarms_exits_cleanly(tmp_path: Path) -> None:
    n = start(tmp_path)
    try:
        _until(n, lambda: (sh := n.shadow_of("a")) is not None and sh.ready, 180, "the shadow's start")
        shadow = n.shadow_of("a")
        assert shadow is not None
    finally:
        n.stop()
    # Exit status 0, whether its pre-warm thread was still inside torch (no std::terminate) or done.
    assert shadow.proc.returncode == 0


# -- a switch's downtime from the data path, on a stand-in instance table --------------------------------

class _Host:
    """A stand-in instance table for Change.observe_data_path."""

    def __init__(self) -> None:
        self.instances: dict[str, Any] = {}
        self.events: list[dict[str, Any]] = []

    def record(self, event: dict[str, Any]) -> None:
        self.events.append(event)


def _change(old_last: int | None, switch_ns: int) -> Change:
    ch = Change(id=1, app="a", from_pct=50, to_pct=30)
    ch.switched = [{"from": "a-0", "to": "a-s1", "switch_ns": switch_ns, **reconfig._pending_data_path(),
                    "old_last_answer_ns": old_last}]
    ch._enter(Phase.DONE)
    return ch


def test_a_pause_in_answers_counts_only_as_long_as_the_new_instance_made_a_request_wait() -> None:
    host = _Host()
    now = time.monotonic_ns()
    ch = _change(old_last=now - 20_000_000, switch_ns=now - 15_000_000)
    host.instances["a-s1"] = SimpleNamespace(stats=InstanceStats(first_ok_ns=0))
    assert ch.observe_data_path(host) is True  # nothing answered yet: still waiting
    # Its first request arrived 1.4 ms before it answered, of which 1 ms ran the model.
    host.instances["a-s1"].stats = InstanceStats(first_ok_ns=now, first_request_ns=now - 1_400_000, first_model_ms=1.0)
    assert ch.observe_data_path(host) is False
    sw = ch.switched[0]
    assert sw["data_path"] == "measured"
    assert sw["answer_gap_ms"] == pytest.approx(20.0)  # no request arrived for a while: not downtime
    assert sw["downtime_ms"] == pytest.approx(0.4)
    assert host.events[-1]["event"] == "switch_measured" and host.events[-1]["downtime_ms"] == pytest.approx(0.4)


def test_overlapping_answers_are_no_downtime() -> None:
    host = _Host()
    now = time.monotonic_ns()
    ch = _change(old_last=now + 5_000_000, switch_ns=now - 1_000_000)  # the old one still draining
    host.instances["a-s1"] = SimpleNamespace(stats=InstanceStats(first_ok_ns=now, first_request_ns=now - 3_000_000,
                                                                 first_model_ms=1.0))
    ch.observe_data_path(host)
    assert ch.switched[0]["answer_gap_ms"] == pytest.approx(-5.0)
    assert ch.switched[0]["downtime_ms"] == 0.0


def test_a_request_requeued_from_a_killed_instance_counts_its_wait_from_the_switch() -> None:
    host = _Host()
    now = time.monotonic_ns()
    ch = _change(old_last=now - 2_000_000_000, switch_ns=now - 1_500_000_000)
    # The replacement's first request arrived (at the old instance) before the switch; it answered
    # 1.5 s after the switch, 5 ms of which was the model.
    host.instances["a-s1"] = SimpleNamespace(stats=InstanceStats(first_ok_ns=now, first_request_ns=now - 1_800_000_000,
                                                                 first_model_ms=5.0))
    ch.observe_data_path(host)
    assert ch.switched[0]["new_first_wait_ms"] == pytest.approx(1495.0)
    assert ch.switched[0]["downtime_ms"] == pytest.approx(1495.0)


def test_a_new_instance_that_never_answers_leaves_the_downtime_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    host = _Host()
    ch = _change(old_last=None, switch_ns=time.monotonic_ns())
    host.instances["a-s1"] = SimpleNamespace(stats=None)
    assert ch.observe_data_path(host) is True
    monkeypatch.setattr(reconfig, "DATA_PATH_WAIT_S", 0.0)
    assert ch.observe_data_path(host) is False
    assert ch.switched[0]["data_path"].startswith("unknown") and ch.switched[0]["downtime_ms"] is None
    # Gone before it answered: unknown as well.
    del host.instances["a-s1"]
    ch3 = _change(old_last=None, switch_ns=time.monotonic_ns())
    assert ch3.observe_data_path(host) is False
    assert ch3.switched[0]["data_path"].startswith("unknown")


# -- the change's own bookkeeping, on a table of instances without processes -------------------------------


class _Table:
    """A ChangeHost over plain records: enough for Change.advance; reaping is done by the test."""

    def __init__(self) -> None:
        self.apps = {"a": SimpleNamespace(gpu_pct=50)}
        self.instances: dict[str, Any] = {}
        self.events: list[tuple[str, str]] = []

    def add(self, name: str, role: str, pct: int, *, ready: bool = True, replaces: str | None = None) -> Any:
        st = SimpleNamespace(name=name, app="a", role=role, spec=SimpleNamespace(gpu_pct=pct), ready=ready,
                             initialized=role == "active", error=None, ended=False, stats=None, info={},
                             replaces=replaces)
        self.instances[name] = st
        return st

    def actives(self) -> list[str]:
        return sorted(n for n, st in self.instances.items() if st.role == "active")

    def shadow_of(self, app_name: str) -> Any:
        return next((st for st in self.instances.values() if st.role == "shadow"), None)

    def spawn_shadow(self, app_name: str) -> Any:
        return self.add(f"a-s{len(self.instances)}", "shadow", 50)

    def spawn_active(self, app_name: str, gpu_pct: int, share: Any) -> Any:
        return self.add(f"a-k{len(self.instances)}", "active", gpu_pct)

    def init_shadow(self, st: Any, gpu_pct: int, share: Any) -> None:
        self.events.append(("init", st.name))

    def share_for(self, app_name: str, gpu_pct: int, index: int) -> None:
        return None

    def route(self, app_name: str) -> None:
        self.events.append(("route", ",".join(self.actives())))

    def finish(self, st: Any) -> None:
        st.role = "finishing"
        self.events.append(("finish", st.name))

    def kill(self, st: Any, role: str = "stopping") -> None:
        st.role = role
        self.events.append(("kill", st.name))

    def record(self, event: dict[str, Any]) -> None:
        pass


@pytest.mark.parametrize("replacement_ready", [True, False], ids=["ready", "starting"])
def test_an_active_killed_during_a_change_does_not_leave_an_extra_instance(replacement_ready: bool) -> None:
    """The active a change is replacing dies before the switch, and the supervisor starts a replacement
    for it: the change replaces that one instead, so the app ends with as many actives as it had (before,
    each such kill added one, until the pool had no consumer left for a shadow or a replacement)."""
    t = _Table()
    t.add("a-0", "active", 50)
    t.add("a-s1", "shadow", 50)
    ch = Change(id=1, app="a", from_pct=50, to_pct=70)
    ch.advance(t)
    assert ch.phase is Phase.INITIALISING and ("init", "a-s1") in t.events
    del t.instances["a-0"]  # SIGKILLed and reaped; the supervisor's replacement:
    t.add("a-r2", "active", 50, ready=replacement_ready, replaces="a-0")
    t.instances["a-s1"].initialized = True
    ch.advance(t)
    assert ch.phase is Phase.DRAINING
    assert t.actives() == ["a-s1"]  # the replacement left the route with the switch
    assert (("finish" if replacement_ready else "kill"), "a-r2") in t.events
    if replacement_ready:
        t.instances["a-r2"].ended = True
    del t.instances["a-r2"]  # it exits (Ended, or killed) and is reaped
    ch.advance(t)
    assert ch.phase is Phase.DONE and t.apps["a"].gpu_pct == 70
    assert t.actives() == ["a-s1"]


def test_a_change_with_nothing_to_adopt_keeps_the_new_instance_only() -> None:
    """The old active died and no replacement could start (no free consumer): the switch leaves the app
    with the new instance, and the change ends."""
    t = _Table()
    t.add("a-0", "active", 50)
    t.add("a-s1", "shadow", 50)
    ch = Change(id=2, app="a", from_pct=50, to_pct=70)
    ch.advance(t)
    del t.instances["a-0"]
    t.instances["a-s1"].initialized = True
    ch.advance(t)
    assert ch.phase is Phase.DONE and t.actives() == ["a-s1"]
