"""A DAG app (the paper's DNN-Recog) served live on the CPU backend answers with the right branch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from apps.zoo import RECOG_ROUTER_LABELS, load_model
from gpuprims.wire import Status
from orchestrator.config.schema import load_config
from orchestrator.node.node import Node
from tests.orchestrator.client import ask

pytestmark = pytest.mark.slow

SHAPE = (3, 32, 32)
CONFIG = """
node:
  listen: {host: 127.0.0.1, port: 0}
  backend: cpu
  pool: {slot_count: 4096, max_chunks: 64, record_count: 256}
apps:
  - name: recog
    slo_ms: 10000
    max_batch: 8
    app_id: 5
    input_shape: [3, 32, 32]
    seed: 3
    shadow: false
    stages:
      - {name: router, model: recog_router, gpu_pct: 40, routes: [face, car]}
      - {name: face, model: vgg_face, gpu_pct: 30}
      - {name: car, model: resnet_car, gpu_pct: 30}
"""


def test_dnn_recog_answers_with_the_right_branch(tmp_path: Path) -> None:
    p = tmp_path / "apps.yaml"
    p.write_text(CONFIG)
    node = Node(load_config(p), warmup=False).start()
    try:
        assert node.status()["apps"]["recog"]["gpu_pct"] == 100
        rng = np.random.default_rng(0)
        xs = {rid: rng.random(SHAPE, dtype=np.float32) for rid in range(40)}
        got = ask(node, {rid: (5, x) for rid, x in xs.items()})
    finally:
        node.stop()
    assert sorted(got) == sorted(xs)
    models = {name: load_model(name, seed=3, input_shape=SHAPE).eval()
              for name in ("recog_router", "vgg_face", "resnet_car")}
    branches = {"person": "vgg_face", "vehicle": "resnet_car"}
    seen = set()
    for rid, x in xs.items():
        with torch.inference_mode():
            t = torch.from_numpy(x)[None]
            route = models["recog_router"](t)
            label = RECOG_ROUTER_LABELS[int(route.argmax())]
            ref = models[branches[label]](t) if label in branches else route
        seen.add(label)
        assert got[rid].status == Status.OK
        out = got[rid].array()
        assert out.shape == ref.shape[1:], f"request {rid} ({label}) answered by the wrong stage"
        np.testing.assert_allclose(out, ref.numpy()[0], rtol=1e-4, atol=1e-4)
    # The inputs (with this seed) reach every branch, so the routing itself is tested.
    assert seen == {"person", "vehicle", "other"}
