"""The agent without Ray (it is a plain class that Ray hosts): it runs an unchanged orchestrator with no
apps, loads and unloads through the repository API, serves the routing table, and its orchestrator
dies with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from gpuprims.client import Client
from gpuprims.wire import Status
from orchestrator.fleet.agent import Agent
from orchestrator.frontdoor.forward import route_model
from tests.orchestrator.fleet.helpers import post_until_ok

pytestmark = pytest.mark.slow

NODE = {"backend": "cpu", "pool": {"slot_count": 2048, "max_chunks": 64, "record_count": 256}}
ENTRY = {"name": "cls", "model": "mobilenet_v2", "input_shape": [3, 32, 32], "num_classes": 10, "slo_ms": 5000,
         "gpu_pct": 50, "max_batch": 4, "shadow": False, "app_id": 7}


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_the_agent_runs_a_node_and_applies_app_sets(tmp_path: Path) -> None:
    agent = Agent("node-a", NODE, base_dir=str(tmp_path))
    try:
        info = agent.info()
        assert info["udp_port"] > 0 and agent.state()["apps"] == {}
        assert agent.apply({"cls": ENTRY}) == {"cls": "ok"}
        assert agent.apply({"cls": ENTRY}) == {}  # nothing to do
        with Client(("127.0.0.1", info["udp_port"]), timeout_s=60) as c:
            r = c.infer(7, np.zeros((3, 32, 32), np.float32))
        assert r.status == Status.OK and r.output is not None and r.output.shape == (10,)
        st = agent.state()
        assert st["apps"]["cls"]["gpu"] == "cpu" and st["apps"]["cls"]["gpu_pct"] == 50
        bad = agent.apply({"cls": ENTRY, "bad": {**ENTRY, "name": "bad", "app_id": 8, "slo_ms": -1}})
        assert bad == {"bad": bad["bad"]} and "config.slo_ms" in bad["bad"]  # one failure, the rest unchanged
        assert agent.set_routes({"version": 3, "apps": {"cls": {}}}) == 3
        assert agent.set_routes({"version": 2, "apps": {}}) == 3  # an older table is ignored
        with urllib.request.urlopen(f"http://127.0.0.1:{info['routes_port']}/fleet/routes", timeout=10) as resp:
            assert json.loads(resp.read())["version"] == 3
        # The node's front door follows its agent's table: an app it does not host by that name ("far",
        # routed to this node's own ingest as app 7) is forwarded over the wire format and answered.
        route = {"app_id": 7, "primary": {"host": "127.0.0.1", "udp_port": info["udp_port"], "http_port": 0,
                                          "node": "node-a", "gpu": 0}, "standby": None, "model": route_model(ENTRY)}
        agent.set_routes({"version": 4, "apps": {"far": route}})
        doc = post_until_ok(f"http://127.0.0.1:{info['http_port']}/v2/models/far/infer",
                        {"inputs": [{"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32",
                                     "data": [0.0] * 3072}]}, timeout_s=30)
        assert doc["model_name"] == "far" and doc["outputs"][0]["shape"] == [1, 10]
        assert agent.apply({}) == {"cls": "ok"} and agent.state()["apps"] == {}
    finally:
        agent.stop()
    assert _gone(info["node_pid"], 30) and not Path(agent.dir).exists()


CHILD = """
import json, sys, time
from orchestrator.fleet.agent import Agent
a = Agent("node-b", json.loads(sys.argv[1]), base_dir=sys.argv[2])
print(a.proc.pid, flush=True)
time.sleep(600)
"""


def test_the_orchestrator_dies_with_its_agent(tmp_path: Path) -> None:
    p = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(NODE), str(tmp_path)], stdout=subprocess.PIPE,
                         text=True)
    try:
        line = p.stdout.readline() if p.stdout else ""
        node_pid = int(line)
        p.send_signal(signal.SIGKILL)  # no clean-up of its own: only PR_SET_PDEATHSIG can stop the node
        p.wait(timeout=30)
        assert _gone(node_pid, 60), "the orchestrator outlived its agent"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
