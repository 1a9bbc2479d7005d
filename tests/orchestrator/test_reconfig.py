"""Overlapped-Execution on the CPU backend: GPU% changes under load lose and duplicate nothing."""

from __future__ import annotations

import collections
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpuprims import wire
from gpuprims.wire import Status
from orchestrator.config import load_config
from orchestrator.node import Node
from orchestrator.reconfig import change_gpu_pct, restart_gpu_pct

pytestmark = pytest.mark.slow

CONFIG = """
node:
  listen: {host: 127.0.0.1, port: 0}
  backend: cpu
  pool: {slot_count: 4096, max_chunks: 64, record_count: 512}
apps:
  - {name: a, model: MODEL_A, input_shape: [3, 32, 32], slo_ms: 3000, gpu_pct: 50, max_batch: 8, app_id: 1,
     num_classes: 10, shadow: true}
  - {name: b, model: resnet18, input_shape: [3, 32, 32], slo_ms: 3000, gpu_pct: 50, max_batch: 8, app_id: 2,
     num_classes: 10, shadow: false}
"""


class Load:
    """Steady requests for app 1 from a thread, responses collected by another."""

    def __init__(self, port: int, rate_rps: float = 100.0) -> None:
        self.addr = ("127.0.0.1", port)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.settimeout(0.05)
        self.rate = rate_rps
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
            for d in wire.encode_request(1, self.sent, self._x, client_ts_ns=time.monotonic_ns()):
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
    assert all(v[0][0] == Status.OK for v in load.got.values())
    after = [st for st in node.instances.values() if st.app == "a" and st.role == "active"]
    assert len(after) == 1 and after[0].name not in before and after[0].spec.gpu_pct == 30
    assert node.apps["a"].gpu_pct == 30
    # A fresh shadow is prepared for the next change.
    assert node.shadow_of("a") is not None
    changed = [e for e in node.events if e["event"] == "changed"]
    assert changed and changed[-1]["switched"][0]["route_switch_ms"] < 1000
    c = node.ingest.counters()
    assert c["drop_unknown_app"] == 0


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
        assert all(v[0][0] == Status.OK for v in load.got.values())
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


def test_kill_and_restart_baseline(node: Node) -> None:
    load = Load(node.ingest.ports[0], rate_rps=50)
    _pump(node, 0.5)
    ok, msg = restart_gpu_pct(node, "a", 30)
    assert ok, msg
    _pump(node, 0.5)
    load.finish(node)
    assert node.apps["a"].gpu_pct == 30
    # Every request is answered once: OK, INSTANCE_FAILED for what the killed instance held, or
    # DEADLINE_MISSED for those that waited out the restart (the downtime this baseline shows).
    assert sorted(load.got) == list(range(load.sent))
    assert all(len(v) == 1 for v in load.got.values())
    assert {v[0][0] for v in load.got.values()} <= {Status.OK, Status.INSTANCE_FAILED, Status.DEADLINE_MISSED}
