"""What a node costs in imports (issue 46): the node process maps no torch whatever its apps' engines,
and an instance serving a model file on ONNX Runtime maps no torch either. Each check runs in a
subprocess of its own, so what it finds in ``sys.modules`` and /proc/<pid>/maps is that process's alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.modelfiles import multi_io_onnx

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.real  # child interpreters, one a real node

#: Every engine kind that runs on the cpu backend, on a zoo model each, and two ONNX files.
APPS = """
  - {name: e, model: mobilenet_v2, input_shape: [3, 8, 8], slo_ms: 60000, gpu_pct: 10, max_batch: 2, app_id: 1,
     num_classes: 10, engine: eager}
  - {name: c, model: mobilenet_v2, input_shape: [3, 8, 8], slo_ms: 60000, gpu_pct: 10, max_batch: 2, app_id: 2,
     num_classes: 10, engine: compile}
  - {name: o, model: mobilenet_v2, input_shape: [3, 8, 8], slo_ms: 60000, gpu_pct: 10, max_batch: 2, app_id: 3,
     num_classes: 10, engine: {kind: onnxruntime, optimization: basic}}
  - {name: v, model: mobilenet_v2, input_shape: [3, 8, 8], slo_ms: 60000, gpu_pct: 10, max_batch: 2, app_id: 4,
     num_classes: 10, engine: openvino}
  - {name: d, model: mobilenet_v2, input_shape: [3, 8, 8], slo_ms: 60000, gpu_pct: 10, max_batch: 2, app_id: 5,
     num_classes: 10, engine: duet}
  - {name: h, model: lstm, input_shape: [1, 8, 16], slo_ms: 60000, gpu_pct: 10, max_batch: 2, app_id: 6, engine: chrion}
  - {name: a, model: mobilenet_v2, input_shape: [3, 8, 8], slo_ms: 60000, gpu_pct: 10, max_batch: 2, app_id: 7,
     num_classes: 10, engine: auto}
  - {name: f, model: multi.onnx, slo_ms: 60000, gpu_pct: 10, app_id: 8}
  - {name: g, model: multi.onnx, slo_ms: 60000, gpu_pct: 10, app_id: 9, engine: openvino}
"""

#: As `gpuprims-orchestrator start` does it (the config read and checked, backend auto resolved), then a
#: node on played instances (tests/orchestrator/fake_launcher.py): the node process's own imports.
_NODE = """
import json, sys
from pathlib import Path
from orchestrator.cli import node as cli_node
from orchestrator.node.node import Node
from orchestrator.control.records import NodeView
from orchestrator.control.status_format import format_status
from tests.orchestrator.fake_launcher import FakeLauncher
cfg, source = cli_node._load(sys.argv[1], None)
cli_node._check_engines(cfg, source)
node = Node(cfg, control_kind="inproc", launcher=FakeLauncher(), warmup=False, share_params=False, ready_timeout_s=60)
with node:
    node.step(20)
    status = node.status()
    format_status(NodeView.from_dict(status))
print(json.dumps({"torch": "torch" in sys.modules, "libtorch": "libtorch" in Path("/proc/self/maps").read_text(),
                  "zoo": "apps.zoo.registry" in sys.modules, "apps": sorted(status["apps"]),
                  "engine_modules": sorted(m for m in sys.modules if m.startswith("gpuprims.engines.")
                                           and m.rsplit(".", 1)[1] not in ("base", "cache", "errors", "files", "kinds"))}))
"""


def _config(tmp_path: Path, apps: str, **node: str) -> Path:
    multi_io_onnx(tmp_path / "multi.onnx")
    extra = "".join(f"  {k}: {v}\n" for k, v in node.items())
    path = tmp_path / "apps.yaml"
    path.write_text(f"node:\n  listen: {{host: 127.0.0.1, port: 0}}\n  run_dir: {tmp_path / 'run'}\n"
                    f"  pool: {{slot_count: 256, max_chunks: 8, record_count: 64}}\n{extra}apps:{apps}")
    return path


def test_a_node_with_every_cpu_engine_kind_maps_no_torch(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
    pytest.importorskip("openvino", reason="the openvino extra is not installed")
    cfg = _config(tmp_path, APPS, backend="auto")
    r = subprocess.run([sys.executable, "-c", _NODE, str(cfg)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"torch": False, "libtorch": False, "zoo": False, "apps": list("acdefghov"), "engine_modules": []}


#: A real node (fork-server launcher, real instances) serving one ONNX file: the pids of the node, its
#: instances and its fork servers, and whether each maps libtorch, once the instances are ready.
_REAL = """
import json, sys, time
from pathlib import Path
from orchestrator.config.schema import load_config
from orchestrator.node.node import Node

def libtorch(pid):
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()

node = Node(load_config(sys.argv[1]), ready_timeout_s=240)
with node:
    deadline = time.monotonic() + 240  # the shadow too (it loads after the active)
    while True:
        node.step(20)
        st = node.status()
        insts = [i for a in st["apps"].values() for i in a["instances"]]
        if all(i["ready"] for i in insts) or time.monotonic() > deadline:
            break
    out = {"node": libtorch(st["node"]["pid"]), "ready": all(i["ready"] for i in insts),
           "instances": {i["name"]: libtorch(i["pid"]) for i in insts},
           "fork_servers": [(s["holds"], libtorch(s["pid"])) for s in st["node"]["fork_servers"] if s["ready"]]}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_an_onnx_file_instance_and_its_node_map_no_torch(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
    cfg = _config(tmp_path, "\n  - {name: f, model: multi.onnx, slo_ms: 60000, gpu_pct: 50, app_id: 8}\n",
                  backend="cpu")
    r = subprocess.run([sys.executable, "-c", _REAL, str(cfg)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["ready"] and got["node"] is False, got
    assert got["instances"] and not any(got["instances"].values()), got  # the active and its shadow
    for holds, mapped in got["fork_servers"]:  # the one for ONNX files, if it was ready by then
        assert "torch" not in holds and not mapped and "onnxruntime" in holds
