"""A whole node on the cuda backend, run on the fake CUDA runtime (no GPU here).

The instances take the cuda serving path: the pool registered for GPU-DMA, the gather kernel's
reference writing each batch into a preallocated "device" buffer, the model awaited with Sync-lite
on the fake stream. Every answer must equal the model run directly in torch on the same input.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from apps.zoo import load_model
from gpuprims.cuda import runtime
from gpuprims.gather import preprocess
from gpuprims.wire import Status
from orchestrator.config.schema import load_config
from orchestrator.control.errors import StartError
from orchestrator.node.node import Node
from tests.orchestrator.client import ask

pytestmark = pytest.mark.slow

CONFIG = """
node:
  listen: {host: 127.0.0.1, port: 0}
  backend: cuda
  mps: off
  run_dir: RUN_DIR
  pool: {slot_count: 2048, max_chunks: 64, record_count: 256}
apps:
  - {name: cls, model: mobilenet_v2, input_shape: [3, 32, 32], slo_ms: 10000, gpu_pct: 50, max_batch: 4,
     app_id: 1, num_classes: 10, seed: 3, shadow: false}
  - {name: det, model: resnet18, input_shape: [3, 32, 32], dtype: uint8, slo_ms: 10000, gpu_pct: 50,
     max_batch: 4, app_id: 2, num_classes: 10, seed: 4, shadow: false}
"""


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # The node and the instances it spawns (which inherit the environment) run on the fake runtime.
    monkeypatch.setenv(runtime.FAKE_ENV, "1")
    yield


def test_a_node_on_the_fake_runtime_serves_with_gpu_dma_and_sync_lite(tmp_path: Path, fake_cuda: None) -> None:
    p = tmp_path / "apps.yaml"
    p.write_text(CONFIG.replace("RUN_DIR", str(tmp_path / "run")))
    node = Node(load_config(p), warmup=False, heartbeat_ms=100).start()
    try:
        assert node.backend == "cuda"
        rng = np.random.default_rng(0)
        xs: dict[int, tuple[int, np.ndarray]] = {}
        for rid in range(24):
            if rid % 2:
                xs[rid] = (2, rng.integers(0, 256, (3, 32, 32), dtype=np.uint8))
            else:
                xs[rid] = (1, rng.random((3, 32, 32), dtype=np.float32))
        got = ask(node, xs)
        for _ in range(5):
            node.step(100)  # heartbeats
        status = node.status()
        deadline = time.monotonic() + 30  # and every instance's memory read (a couple per loop pass)
        while time.monotonic() < deadline and any(
                i["memory"]["pss_bytes"] is None or i["memory"]["device_bytes"] is None
                for a in status["apps"].values() for i in a["instances"]):
            node.step(100)
            status = node.status()
    finally:
        node.stop()
    assert sorted(got) == sorted(xs)
    models = {1: load_model("mobilenet_v2", seed=3, num_classes=10, input_shape=(3, 32, 32)).eval(),
              2: load_model("resnet18", seed=4, num_classes=10, input_shape=(3, 32, 32)).eval()}
    for rid, (app, x) in xs.items():
        r = got[rid]
        assert r.status == Status.OK, (rid, r.status)
        with torch.inference_mode():
            ref = models[app](preprocess(torch.from_numpy(x)[None], "uint8" if app == 2 else "float32"))
        np.testing.assert_allclose(r.array(), ref.numpy().reshape(-1), rtol=1e-4, atol=1e-5)
    for app in ("cls", "det"):
        assert status["apps"][app]["ok"] == 12
        # Device memory: each instance's own, counted by the CUDA layer (its GPU-DMA buffers at least).
        for i in status["apps"][app]["instances"]:
            assert i["memory"]["device_bytes"] > 0 and i["memory"]["pss_bytes"] > 0, i
        assert status["apps"][app]["memory"]["device_bytes"] > 0
    assert status["node"]["memory"]["total"]["device_bytes"] == sum(
        status["apps"][a]["memory"]["device_bytes"] for a in ("cls", "det"))


TWO_GPUS = """
node:
  listen: {host: 127.0.0.1, port: 0}
  backend: cuda
  mps: off
  run_dir: RUN_DIR
  shadow_settle_s: 0
  pool: {slot_count: 2048, max_chunks: 64, record_count: 256}
apps:
  - {name: left, model: mobilenet_v2, input_shape: [3, 32, 32], slo_ms: 10000, gpu_pct: 100, gpu: 0,
     max_batch: 4, app_id: 1, num_classes: 10, seed: 3}
  - {name: right, model: resnet18, input_shape: [3, 32, 32], slo_ms: 10000, gpu_pct: 100, gpu: 1,
     max_batch: 4, app_id: 2, num_classes: 10, seed: 4, shadow: false}
"""


def test_two_apps_at_100_percent_on_two_gpus_serve_and_change_per_gpu(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Two fake devices: an instance placed on GPU 1 makes its streams and buffers there (the fake
    # refuses a device index it does not have), and the share of each GPU is its own 100 %.
    monkeypatch.setenv(runtime.FAKE_ENV, "devices=2")
    p = tmp_path / "apps.yaml"
    p.write_text(TWO_GPUS.replace("RUN_DIR", str(tmp_path / "run")))
    node = Node(load_config(p), warmup=False, heartbeat_ms=100).start()
    try:
        st = node.status()
        assert st["node"]["gpus"] == {"0": 100, "1": 100}
        assert (st["apps"]["left"]["gpu"], st["apps"]["right"]["gpu"]) == (0, 1)
        assert {i["gpu"] for i in st["apps"]["right"]["instances"]} == {1}
        rng = np.random.default_rng(1)
        xs = {rid: (1 + rid % 2, rng.random((3, 32, 32), dtype=np.float32)) for rid in range(8)}
        got = ask(node, xs)
        assert sorted(got) == sorted(xs) and all(r.status == Status.OK for r in got.values())
        # Overlapped-Execution on GPU 0 while GPU 1 is full: only GPU 0's apps count against it.
        ch = node.set_gpu("left", 60)
        deadline = time.monotonic() + 120
        while not ch.phase.terminal and time.monotonic() < deadline:
            node.step(50)
        assert ch.phase.value == "done", ch.to_dict()
        got = ask(node, {100 + rid: (1, rng.random((3, 32, 32), dtype=np.float32)) for rid in range(4)})
        assert len(got) == 4 and all(r.status == Status.OK for r in got.values())
        st = node.status()
    finally:
        node.stop()
    assert st["node"]["gpus"] == {"0": 60, "1": 100}
    active = [i for i in st["apps"]["left"]["instances"] if i["role"] == "active"]
    assert active and all(i["gpu"] == 0 and i["gpu_pct"] == 60 for i in active)


def test_an_app_on_a_gpu_the_machine_does_not_have_fails_the_start(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(runtime.FAKE_ENV, "devices=1")
    p = tmp_path / "apps.yaml"
    p.write_text(TWO_GPUS.replace("RUN_DIR", str(tmp_path / "run")))
    with pytest.raises(StartError, match="right"):
        Node(load_config(p), warmup=False, heartbeat_ms=100, ready_timeout_s=120).start()
