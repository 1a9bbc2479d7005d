"""The node on a GPU: correct answers with backend cuda, and instances under MPS with their GPU%.

Marked ``gpu``: skipped with a reason where no GPU with a driver is present.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from apps.zoo import load_model
from gpuprims.wire import Status
from orchestrator.config.schema import load_config
from orchestrator.node.node import Node
from orchestrator.node.reconfig import change_gpu_pct
from tests.orchestrator.client import ask

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

CONFIG = """
node:
  listen: {host: 127.0.0.1, port: 0}
  backend: cuda
  mps: MPS_MODE
  pool: {slot_count: 8192, max_chunks: 256, record_count: 256}
apps:
  - {name: a, model: resnet50, input_shape: [3, 64, 64], slo_ms: 2000, gpu_pct: 30, max_batch: 8, app_id: 1,
     num_classes: 10, seed: 1, shadow: true}
  - {name: b, model: mobilenet_v2, input_shape: [3, 64, 64], dtype: uint8, slo_ms: 2000, gpu_pct: 50, max_batch: 8,
     app_id: 2, num_classes: 10, seed: 2, shadow: false}
"""


def _start(tmp_path: Path, mps: str) -> Node:
    p = tmp_path / "apps.yaml"
    p.write_text(CONFIG.replace("MPS_MODE", mps))
    return Node(load_config(p), heartbeat_ms=100).start()


def test_cuda_node_answers_like_torch(tmp_path: Path) -> None:
    node = _start(tmp_path, "best_effort")
    try:
        rng = np.random.default_rng(0)
        xs = {rid: (1, rng.random((3, 64, 64), dtype=np.float32)) if rid % 2 else
              (2, rng.integers(0, 256, (3, 64, 64), dtype=np.uint8)) for rid in range(32)}
        got = ask(node, xs)
    finally:
        node.stop()
    models = {1: load_model("resnet50", seed=1, num_classes=10, input_shape=(3, 64, 64)).cuda().eval(),
              2: load_model("mobilenet_v2", seed=2, num_classes=10, input_shape=(3, 64, 64)).cuda().eval()}
    assert sorted(got) == sorted(xs)
    for rid, (app, x) in xs.items():
        t = torch.from_numpy(x)[None].cuda()
        t = t.float() / 255 if app == 2 else t
        with torch.inference_mode():
            ref = models[app](t).float().cpu().numpy()[0]
        assert got[rid].status == Status.OK
        # TF32/cuDNN algorithm choice can differ between batch sizes: a looser tolerance than on CPU.
        np.testing.assert_allclose(got[rid].array(), ref, rtol=2e-2, atol=2e-2)


def test_instances_run_under_mps_with_their_share(tmp_path: Path) -> None:
    node = _start(tmp_path, "require")
    try:
        for _ in range(20):
            node.step(50)
        clients = node.mps.clients()
        for st in node.instances.values():
            if st.role != "active":
                continue
            assert st.pid in clients, f"{st.name} is not an MPS client"
            assert st.stats is not None and st.stats.mps_pct == str(st.spec.gpu_pct)
        ok, msg = change_gpu_pct(node, "a", 60)
        assert ok, msg
        for _ in range(20):
            node.step(50)
        a = next(st for st in node.instances.values() if st.app == "a" and st.role == "active")
        assert a.stats is not None and a.stats.mps_pct == "60" and a.pid in node.mps.clients()
    finally:
        node.stop()
