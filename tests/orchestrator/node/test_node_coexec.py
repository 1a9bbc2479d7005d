"""A node serving apps through the co-execution engines, end to end on loopback, CPU backend: GoogLeNet
with ``engine: duet`` (DUET's subgraph placement) and the zoo's unrolled LSTM with ``engine: chrion``
(Chrion's cell placement). Every request is answered exactly once, OK, equal to eager within the
engine's tolerance, status shows each instance's plan, and a change of share starts an instance that
plans again and answers every request."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from apps.zoo import load_model
from gpuprims.engines.chrion import ChrionEngine
from gpuprims.engines.duet import DuetEngine
from gpuprims.wire import Status
from orchestrator.config.schema import load_config
from orchestrator.node.node import Node
from orchestrator.node.reconfig import change_gpu_pct
from tests.orchestrator.node.test_node import Client

pytestmark = pytest.mark.slow

CONFIG = """
node:
  listen: {host: 127.0.0.1, port: 0}
  backend: cpu
  run_dir: RUN_DIR
  engine_cache: CACHE
  shadow_settle_s: 0
  pool: {slot_count: 4096, max_chunks: 64, record_count: 512}
  reassembly_timeout_ms: 200
apps:
  - {name: branches, model: googlenet, input_shape: [3, 32, 32], slo_ms: 10000, gpu_pct: 50, max_batch: 4,
     app_id: 1, num_classes: 10, seed: 5, engine: {kind: duet, repeats: 1}, shadow: false}
  - {name: cells, model: lstm, input_shape: [1, 5, 16], slo_ms: 10000, gpu_pct: 50, max_batch: 4,
     app_id: 2, num_classes: 10, seed: 6, engine: {kind: chrion, repeats: 3}, shadow: false}
"""
#: app id -> (model, seed, input shape, the engine's tolerance against eager)
APPS = {1: ("googlenet", 5, (3, 32, 32), DuetEngine.tolerance), 2: ("lstm", 6, (1, 5, 16), ChrionEngine.tolerance)}


@functools.cache
def _model(app: int) -> torch.nn.Module:
    name, seed, shape, _ = APPS[app]
    return load_model(name, seed=seed, num_classes=10, input_shape=shape).eval()


def _serve_and_check(node: Node, n: int, seed: int) -> None:
    """n requests over both apps: each answered once, OK, equal to eager within the engine's tolerance."""
    client = Client(node.ingest.ports[0])
    rng = np.random.default_rng(seed)
    inputs: dict[int, tuple[int, np.ndarray]] = {}
    try:
        for rid in range(n):
            app = 1 + rid % 2
            inputs[rid] = (app, rng.random(APPS[app][2], dtype=np.float32))
            client.send(app, rid, inputs[rid][1])
        client.collect(n, node, timeout_s=180)
    finally:
        client.close()
    assert sorted(client.responses) == list(range(n)), "every request answered"
    assert all(len(v) == 1 for v in client.responses.values()), "none answered twice"
    for rid, (app, x) in inputs.items():
        r = client.responses[rid][0]
        assert r.status == Status.OK, (rid, r.status)
        with torch.inference_mode():
            want = _model(app)(torch.from_numpy(x)[None])[0]
        rtol, atol = APPS[app][3]
        torch.testing.assert_close(torch.from_numpy(r.array().reshape(-1).copy()), want, rtol=rtol, atol=atol,
                                   msg=lambda m, rid=rid, app=app: f"request {rid} of app {APPS[app][0]}: {m}")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("coexec")
    p = tmp / "apps.yaml"
    p.write_text(CONFIG.replace("RUN_DIR", str(tmp / "run")).replace("CACHE", str(tmp / "cache")))
    n = Node(load_config(p), warmup=True, heartbeat_ms=100).start()
    yield n
    n.stop()


def _engines(node: Node) -> dict[str, dict[str, Any]]:
    out = {}
    for app, a in node.status()["apps"].items():
        for i in a["instances"]:
            if i["role"] == "active" and i.get("engine"):
                out[app] = i["engine"]
    return out


def test_duet_and_chrion_apps_answer_every_request_once_equal_to_eager(node: Node) -> None:
    end = time.monotonic() + 120
    while len(_engines(node)) < 2:
        assert time.monotonic() < end, "timed out waiting for the actives' heartbeats"
        node.step(20)
    eng = _engines(node)
    assert eng["branches"]["kind"] == "duet" and eng["cells"]["kind"] == "chrion"
    plan = eng["branches"]["plan"]
    assert plan["subgraphs"] == len(plan["placement"]) > 1 and plan["same_cores"] is True
    assert eng["cells"]["plan"]["on_cpu"] + eng["cells"]["plan"]["on_accelerator"] == eng["cells"]["plan"]["cells"] + 1
    _serve_and_check(node, 16, seed=0)


def test_a_change_of_share_replans_and_answers_every_request(node: Node) -> None:
    old = {st.name for st in node.instances.values() if st.app == "branches" and st.role == "active"}
    ok, msg = change_gpu_pct(node, "branches", 25)
    assert ok, msg
    new = [st for st in node.instances.values() if st.app == "branches" and st.role == "active"]
    assert len(new) == 1 and new[0].name not in old
    eng = new[0].info["engine"]  # the new active's Ready: its own plan, made at its start
    assert eng["kind"] == "duet" and eng["plan"]["subgraphs"] == len(eng["plan"]["placement"])
    _serve_and_check(node, 12, seed=1)
