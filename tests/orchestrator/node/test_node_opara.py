"""A node serving GoogLeNet through Opara's multi-stream CUDA graphs (``engine: cudagraph``, ``streams:
opara``), end to end on loopback, on the fake CUDA runtime (no GPU here; ``runtime.FAKE_ENV`` makes the
node and the instances it spawns use it). One app uncapped, one capped at two streams: every request is
answered exactly once, OK, equal to eager within the engine's stated tolerance, and the status shows
each engine with its plan (streams and events). DUET and Chrion apps in a node are
tests/orchestrator/node/test_node_coexec.py (a third instance here would add a third to this test's time)."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from apps.zoo import load_model
from gpuprims.cuda import runtime
from gpuprims.engines.cudagraph import CudaGraphEngine
from gpuprims.wire import Status
from orchestrator.config.schema import load_config
from orchestrator.node.node import Node
from tests.orchestrator.node.test_node import Client

pytestmark = pytest.mark.slow

# GoogLeNet at 32x32 keeps the full branch structure (28 streams at batch 1) with small tensors; max_batch
# 2 gives two buckets, each planned and captured on its own.
CONFIG = """
node:
  listen: {host: 127.0.0.1, port: 0}
  backend: cuda
  mps: off
  run_dir: RUN_DIR
  engine_cache: CACHE
  shadow_settle_s: 0
  pool: {slot_count: 4096, max_chunks: 64, record_count: 512}
  reassembly_timeout_ms: 200
apps:
  - {name: opara, model: googlenet, input_shape: [3, 32, 32], slo_ms: 10000, gpu_pct: 40, max_batch: 2,
     app_id: 1, num_classes: 10, seed: 5, engine: {kind: cudagraph, streams: opara, warmup: 1}, shadow: false}
  - {name: capped, model: googlenet, input_shape: [3, 32, 32], slo_ms: 10000, gpu_pct: 40, max_batch: 2,
     app_id: 2, num_classes: 10, seed: 6, engine: {kind: cudagraph, streams: opara, max_streams: 2, warmup: 1},
     shadow: false}
"""
#: app id -> (app name, seed, the engine's tolerance against eager)
APPS = {1: ("opara", 5, CudaGraphEngine.tolerance), 2: ("capped", 6, CudaGraphEngine.tolerance)}
SHAPE = (3, 32, 32)


@functools.cache
def _model(app: int) -> torch.nn.Module:
    return load_model("googlenet", seed=APPS[app][1], num_classes=10, input_shape=SHAPE).eval()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("opara")
    p = tmp / "apps.yaml"
    p.write_text(CONFIG.replace("RUN_DIR", str(tmp / "run")).replace("CACHE", str(tmp / "cache")))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(runtime.FAKE_ENV, "1")  # the node and the instances it spawns run on the fake runtime
        n = Node(load_config(p), warmup=False, heartbeat_ms=100).start()
        try:
            yield n
        finally:
            n.stop()


def _engines(node: Node) -> dict[str, dict[str, Any]]:
    out = {}
    for app, a in node.status()["apps"].items():
        for i in a["instances"]:
            if i["role"] == "active" and i.get("engine"):
                out[app] = i["engine"]
    return out


def test_status_shows_each_engine_and_its_opara_plan(node: Node) -> None:
    assert node.backend == "cuda"
    end = time.monotonic() + 120
    while len(_engines(node)) < len(APPS):
        assert time.monotonic() < end, f"timed out waiting for the actives' heartbeats: {sorted(_engines(node))}"
        node.step(20)
    eng = _engines(node)
    for app in ("opara", "capped"):
        e = eng[app]
        assert e["kind"] == "cudagraph" and e["streams"] == "opara" and e["runtime"] == "fake", e
        plans = e["opara"]["buckets"]
        assert sorted(int(b) for b in plans) == [1, 2]
        for p in plans.values():
            assert p["num_events"] > 0 and p["num_waits"] >= p["num_events"] and p["ops"] > 100
    # Uncapped: GoogLeNet's 28 streams (the paper's count); capped: exactly the cap, from 28 chains.
    assert eng["opara"]["opara"]["num_streams"] == 28 and eng["opara"]["opara"]["max_streams"] is None
    assert eng["capped"]["opara"]["max_streams"] == 2
    for p in eng["capped"]["opara"]["buckets"].values():
        assert p["num_streams"] == 2 and p["chains"] == 28


def test_every_request_is_answered_once_equal_to_eager(node: Node) -> None:
    n = 24
    client = Client(node.ingest.ports[0])
    rng = np.random.default_rng(0)
    inputs: dict[int, tuple[int, np.ndarray]] = {}
    try:
        for rid in range(n):
            app = 1 + rid % len(APPS)
            inputs[rid] = (app, rng.random(SHAPE, dtype=np.float32))
            client.send(app, rid, inputs[rid][1])
        client.collect(n, node, timeout_s=180)
    finally:
        client.close()
    assert sorted(client.responses) == list(range(n)), "every request answered"
    assert all(len(v) == 1 for v in client.responses.values()), "none answered twice"
    for rid, (app, x) in inputs.items():
        r = client.responses[rid][0]
        assert r.status == Status.OK, (rid, APPS[app][0], r.status)
        with torch.inference_mode():
            want = _model(app)(torch.from_numpy(x)[None])[0]
        rtol, atol = APPS[app][2]
        torch.testing.assert_close(torch.from_numpy(r.array().reshape(-1).copy()), want, rtol=rtol, atol=atol,
                                   msg=lambda m, rid=rid, app=app: f"request {rid} of app {APPS[app][0]}: {m}")
    for _ in range(5):
        node.step(100)  # heartbeats carry the counts
    st = node.status()["apps"]
    for app, (name, _, _) in APPS.items():
        assert st[name]["ok"] == sum(1 for a, _ in inputs.values() if a == app), (name, st[name])
    eng = _engines(node)
    assert eng["opara"]["replays"] > 0 and eng["capped"]["replays"] > 0
