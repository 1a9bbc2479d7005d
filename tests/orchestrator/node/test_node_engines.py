"""A node whose apps run on ONNX Runtime (``engine: onnxruntime``), end to end on loopback, CPU backend:
answers equal eager's within the engine's tolerance, exactly once; the engine is built once (at the first
start) and every later instance (the shadow's pre-warm, a change of share, a restart) takes it from the
cache; a model that will not export is served by eager while the node's other apps keep their engine."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gpuprims.engines import EngineCache
from gpuprims.wire import Status
from orchestrator.config.schema import load_config
from orchestrator.control.records import NodeView
from orchestrator.control.status_format import format_status
from orchestrator.node.node import Node
from orchestrator.node.reconfig import change_gpu_pct
from tests.orchestrator.node.test_node import MODELS, Client, make_input, reference

pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
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
  - {name: cls, model: mobilenet_v2, input_shape: [3, 32, 32], slo_ms: 5000, gpu_pct: 50, max_batch: 8,
     app_id: 1, num_classes: 10, seed: 3, engine: onnxruntime}
  - {name: det, model: resnet18, input_shape: [3, 32, 32], dtype: uint8, slo_ms: 5000, gpu_pct: 50,
     max_batch: 8, app_id: 2, num_classes: 10, seed: 4, engine: {kind: onnxruntime, provider: cpu},
     shadow: false}
"""
#: engine: onnxruntime's tolerance against eager (gpuprims.engines.onnxruntime.OnnxRuntimeEngine.tolerance)
RTOL, ATOL = 1e-3, 1e-4


def _config(tmp: Path, name: str, text: str = CONFIG) -> Path:
    p = tmp / f"{name}.yaml"
    p.write_text(text.replace("RUN_DIR", str(tmp / f"run-{name}")).replace("CACHE", str(tmp / "cache")))
    return p


def _until(node: Node, cond: Any, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        node.step(20)


def _engines(node: Node, role: str = "active") -> dict[str, dict[str, Any]]:
    """The engine each instance of the role reports in status, by app."""
    out = {}
    for app, a in node.status()["apps"].items():
        for i in a["instances"]:
            if i["role"] == role and i.get("engine"):
                out[app] = i["engine"]
    return out


def _serve_and_check(node: Node, n: int, seed: int) -> None:
    """n requests over both apps: each answered once, OK, equal to eager within the tolerance."""
    client = Client(node.ingest.ports[0])
    rng = np.random.default_rng(seed)
    inputs = {}
    try:
        for rid in range(n):
            app = 1 + rid % 2
            inputs[rid] = (app, make_input(app, rng))
            client.send(app, rid, inputs[rid][1])
        client.collect(n, node, timeout_s=120)
    finally:
        client.close()
    assert sorted(client.responses) == list(range(n)), "every request answered"
    assert all(len(v) == 1 for v in client.responses.values()), "none answered twice"
    for rid, (app, x) in inputs.items():
        r = client.responses[rid][0]
        assert r.status == Status.OK, (rid, r.status)
        got = r.array().reshape(-1)
        torch.testing.assert_close(torch.from_numpy(got.copy()), torch.from_numpy(reference(app, x)), rtol=RTOL, atol=ATOL,
                                   msg=f"request {rid} of app {MODELS[app][0]}")


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="module")
def node(tmp: Path) -> Iterator[Node]:
    n = Node(load_config(_config(tmp, "first")), warmup=True, heartbeat_ms=100).start()
    yield n
    n.stop()


def test_answers_equal_eager_exactly_once_and_the_first_start_builds(node: Node, tmp: Path) -> None:
    _until(node, lambda: len(_engines(node)) == 2, 30, "the actives' heartbeats")
    eng = _engines(node)
    for app in ("cls", "det"):
        assert eng[app]["kind"] == "onnxruntime" and eng[app]["cache_hit"] is False and eng[app]["build_ms"] > 0
        assert eng[app]["param_share"] is False
    assert sorted(EngineCache(tmp / "cache").entries()) == sorted(e["fingerprint"] for e in eng.values())
    _serve_and_check(node, 24, seed=0)
    assert "engine cls-0: onnxruntime" in format_status(NodeView.from_dict(node.status()))


def test_the_shadow_takes_its_engine_from_the_cache_in_its_prewarm(node: Node) -> None:
    _until(node, lambda: (sh := node.shadow_of("cls")) is not None and sh.ready and sh.info.get("warm"), 240,
           "the shadow's pre-warm")
    sh = node.shadow_of("cls")
    assert sh is not None and not sh.initialized  # built (from the cache) before any InitGpu: off the serving path
    warm = sh.info["engine_prewarm"]["main"]
    assert warm["kind"] == "onnxruntime" and warm["cache_hit"] is True and warm["build_ms"] == 0


def test_a_change_of_share_builds_nothing(node: Node, tmp: Path) -> None:
    before = EngineCache(tmp / "cache").entries()
    old = {st.name for st in node.instances.values() if st.app == "cls" and st.role == "active"}
    ok, msg = change_gpu_pct(node, "cls", 25)
    assert ok, msg
    new = [st for st in node.instances.values() if st.app == "cls" and st.role == "active"]
    assert len(new) == 1 and new[0].name not in old
    eng = new[0].info["engine"]  # its Ready after InitGpu, at the new share
    assert eng["kind"] == "onnxruntime" and eng["cache_hit"] is True and eng["build_ms"] == 0
    assert EngineCache(tmp / "cache").entries() == before
    _serve_and_check(node, 12, seed=1)


def test_a_restart_hits_the_cache(node: Node, tmp: Path) -> None:
    before = EngineCache(tmp / "cache").entries()
    second = Node(load_config(_config(tmp, "second")), warmup=False, heartbeat_ms=100).start()
    try:
        _until(second, lambda: len(_engines(second)) == 2, 30, "the actives' heartbeats")
        for app, e in _engines(second).items():
            assert e["cache_hit"] is True and e["build_ms"] == 0, (app, e)
        assert EngineCache(tmp / "cache").entries() == before
    finally:
        second.stop()


UNEXPORTABLE = """
import torch


class Spectral(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(3 * 32 * 32, 10)

    def forward(self, x):
        return self.fc(torch.fft.fft(x.flatten(1)).real)  # no ONNX symbolic for aten::fft_fft


def build(num_classes=10, input_shape=(3, 32, 32)):
    return Spectral().eval()
"""


def test_a_model_that_will_not_export_is_served_by_eager_and_the_others_keep_their_engine(tmp: Path) -> None:
    (tmp / "spectral_node_model.py").write_text(UNEXPORTABLE)
    text = CONFIG.replace("model: mobilenet_v2", "model: 'spectral_node_model:build'")
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = f"{tmp}{os.pathsep}{old}" if old else str(tmp)
    try:
        n = Node(load_config(_config(tmp, "spectral", text)), warmup=False, heartbeat_ms=100).start()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    try:
        _until(n, lambda: len(_engines(n)) == 2, 30, "the actives' heartbeats")
        eng = _engines(n)
        assert eng["cls"]["kind"] == "eager" and "does not export to ONNX" in eng["cls"]["fallback"]
        assert eng["det"]["kind"] == "onnxruntime" and "fallback" not in eng["det"]
        client = Client(n.ingest.ports[0])
        try:
            rng = np.random.default_rng(5)
            for rid in range(6):
                app = 1 + rid % 2
                client.send(app, rid, make_input(app, rng))
            client.collect(6, n, timeout_s=120)
        finally:
            client.close()
        assert sorted(client.responses) == list(range(6))
        assert all(len(v) == 1 and v[0].status == Status.OK for v in client.responses.values())
    finally:
        n.stop()
