"""A scripted rate step (paper Fig. 8, scaled to this machine) triggers an automatic GPU% change."""

from __future__ import annotations

import collections
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from gpuprims import wire
from orchestrator.config import load_config
from orchestrator.monitor import Monitor, MonitorPolicy
from orchestrator.node import Node

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
