"""Triton's perf_analyzer measures models of a Triton model repository served by a real node, over HTTP and gRPC.

The repository is tests/modelfiles.py's: ``multi`` (three named inputs, FP32 with a dynamic width, INT64 and
BOOL; a name with a space, ``image in``, whose width perf_analyzer is given with ``--shape "image in:3,5"``:
it splits the argument at its last ':', so the space passes as it is) and ``detector`` (max_batch_size 0,
an input of any length, ``--shape scores:16``). The node loads just those two (explicit mode). perf_analyzer
comes from ``scripts/install-tools.sh`` as in frontdoor/test_perf_analyzer.py, whose short windows this
test uses too; the node's own statistics must count what perf_analyzer reports it sent.

``multi`` is given its values with ``--input-data`` (a JSON file of :func:`multi_inputs`' requests), as a
Triton user gives a BOOL model's: perf_analyzer's default random data fills a BOOL tensor with random
bytes, and the node refuses BOOL bytes other than 0 and 1 (gpuprims.tensorwire.decode), answering
BAD_REQUEST where Triton would pass them to the model.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.http as httpclient

from orchestrator.config.schema import load_config
from orchestrator.node.node import Node

from ...modelfiles import multi_inputs, repository
from .test_perf_analyzer import TIMEOUT_S, _env, perf_analyzer  # noqa: F401 - perf_analyzer is a fixture

pytestmark = [pytest.mark.tools, pytest.mark.slow]

CONFIG = """
node:
  listen: {{host: 127.0.0.1, port: 0}}
  backend: cpu
  run_dir: {run_dir}
  http_port: {http}
  grpc_port: {grpc}
  pool: {{slot_count: 4096, max_chunks: 256, record_count: 512}}
  autoscale: false
  model_repository: {repo}
  model_control_mode: explicit
  load_models: [multi, detector]
apps: []
"""

#: Each model's perf_analyzer shape arguments: the dims its config leaves open (-1).
SHAPES = {"multi": ["--shape", "image in:3,5"], "detector": ["--shape", "scores:16"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("perfrepo")
    repository(tmp / "repo")
    p = tmp / "apps.yaml"
    p.write_text(CONFIG.format(run_dir=tmp / "run", http=_free_port(), grpc=_free_port(), repo=tmp / "repo"))
    n = Node(load_config(p), warmup=True, heartbeat_ms=100).start()
    n.files = tmp  # type: ignore[attr-defined]
    try:
        yield n
    finally:
        n.stop()


def _input_data(path: Path) -> Path:
    """perf_analyzer's ``--input-data`` file of four requests of ``multi`` (width 5), one a step."""
    x = multi_inputs(4, width=5, seed=3)
    steps = [{name: a[i].reshape(-1).tolist() for name, a in x.items()} for i in range(4)]
    path.write_text(json.dumps({"data": steps}))
    return path


def _successes(node: Node, model: str) -> int:
    """The node's count of requests of ``model`` answered OK (its OIP statistics, all versions)."""
    assert node.frontdoor is not None and node.frontdoor.http_url is not None
    with httpclient.InferenceServerClient(node.frontdoor.http_url.removeprefix("http://")) as c:
        stats = c.get_inference_statistics(model)["model_stats"]
    return sum(int(s["inference_stats"]["success"]["count"]) for s in stats)


@pytest.mark.parametrize("model", ["multi", "detector"])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_a_repository_model(node: Node, perf_analyzer: str,  # noqa: F811 - the fixture
                                                   model: str, protocol: str) -> None:
    assert node.frontdoor is not None
    url = node.frontdoor.http_url.removeprefix("http://") if protocol == "http" else node.frontdoor.grpc_target
    assert url is not None
    data = ["--input-data", str(_input_data(node.files / f"{protocol}.json"))] if model == "multi" else []  # type: ignore[attr-defined]
    before = _successes(node, model)
    r = subprocess.run([perf_analyzer, "-m", model, "-u", url, "-i", protocol, *SHAPES[model], *data,
                        "--measurement-interval", "500", "-s", "1000"],
                       capture_output=True, text=True, env=_env(), timeout=TIMEOUT_S)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert not re.search(r"error|failed", out, re.IGNORECASE), out[-3000:]
    m = re.search(r"Concurrency: 1, throughput: ([0-9.]+) infer/sec", out)
    assert m is not None and float(m.group(1)) > 0, out[-3000:]
    sent = re.search(r"Client:\s+Request count: ([0-9]+)", out)
    assert sent is not None and int(sent.group(1)) > 0, out[-3000:]
    # The node answered at least what perf_analyzer counted in its last window (its other windows and its
    # warm-up requests come on top), and its figures reached perf_analyzer's server-side lines.
    assert _successes(node, model) - before >= int(sent.group(1))
    assert re.search(r"Server:\s+Inference count: [1-9]", out), out[-3000:]
