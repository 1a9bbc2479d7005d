"""Param-Share in the node (CPU backend): instances of one model share one copy of the weights."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from apps.zoo import load_model
from gpuprims.wire import Status
from orchestrator.config import load_config
from orchestrator.node import Node
from tests.orchestrator.client import ask

pytestmark = pytest.mark.slow

CONFIG = """
node:
  listen: {host: 127.0.0.1, port: 0}
  backend: cpu
  allow_oversubscribe: true
  pool: {slot_count: 4096, max_chunks: 64, record_count: 256}
apps:
  - {name: a, model: resnet18, input_shape: [3, 32, 32], slo_ms: 10000, gpu_pct: 50, instances: 2, max_batch: 4,
     app_id: 1, num_classes: 10, seed: 5, shadow: false}
"""


def test_importers_answer_like_the_exporter_and_survive_its_death(tmp_path: Path) -> None:
    p = tmp_path / "apps.yaml"
    p.write_text(CONFIG)
    node = Node(load_config(p), warmup=False, heartbeat_ms=100).start()
    shm_names: list[str] = []
    try:
        insts = sorted(node.instances.values(), key=lambda st: st.name)
        assert [st.spec.share_params.split(":")[0] for st in insts] == ["export", "import"]
        for _ in range(10):
            node.step(50)
        assert sorted(st.stats.get("params") for st in node.instances.values()) == ["exported", "imported"]
        from gpuprims.cuda.ipc import ParameterHandles

        exp = next(iter(node.params.exports.values()))
        shm_names.append(ParameterHandles.from_bytes(Path(exp["path"]).read_bytes()).handle.decode())
        ref_model = load_model("resnet18", seed=5, num_classes=10, input_shape=(3, 32, 32)).eval()
        rng = np.random.default_rng(0)
        xs = {rid: rng.random((3, 32, 32), dtype=np.float32) for rid in range(16)}
        got = ask(node, {rid: (1, x) for rid, x in xs.items()})
        assert sorted(got) == sorted(xs)
        for rid, x in xs.items():
            with torch.inference_mode():
                ref = ref_model(torch.from_numpy(x)[None]).numpy()[0]
            np.testing.assert_allclose(got[rid].array(), ref, rtol=1e-4, atol=1e-4)
        # The exporter dies: the importer keeps serving from the shared weights, and the
        # replacement imports them too (on the CPU the shared object outlives its exporter).
        exporter = insts[0]
        os.kill(exporter.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
                st.name.startswith("a-r") and st.ready for st in node.instances.values()):
            node.step(50)
        repl = next(st for st in node.instances.values() if st.name.startswith("a-r"))
        assert repl.spec.share_params.startswith("import:")
        xs2 = {rid: rng.random((3, 32, 32), dtype=np.float32) for rid in range(100, 116)}
        got2 = ask(node, {rid: (1, x) for rid, x in xs2.items()})
        assert sorted(got2) == sorted(xs2) and all(r.status == Status.OK for r in got2.values())
        for rid, x in xs2.items():
            with torch.inference_mode():
                ref = ref_model(torch.from_numpy(x)[None]).numpy()[0]
            np.testing.assert_allclose(got2[rid].array(), ref, rtol=1e-4, atol=1e-4)
    finally:
        node.stop()
    assert not any(os.path.exists("/dev/shm/" + n) for n in shm_names), "stop removes the shared weights"


def test_param_share_can_be_turned_off(tmp_path: Path) -> None:
    p = tmp_path / "apps.yaml"
    p.write_text(CONFIG)
    node = Node(load_config(p), warmup=False, share_params=False).start()
    try:
        assert all(st.spec.share_params is None for st in node.instances.values())
    finally:
        node.stop()
