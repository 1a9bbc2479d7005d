"""``start --model-repository DIR --model-control-mode explicit`` serves the repository API, and tritonclient's
own ``load_model``/``unload_model`` load and unload the repository's models by name: on played instances
(tests/orchestrator/conftest.py's ``node_factory``), and on a real node, where the loaded model also answers.

The config side (``orchestrator.cli.node._load``) is tested without a node: explicit mode turns on
``node.repository.enabled`` (no token on loopback), and a CONFIG that cannot serve the API says which key to
set. The real node (CPU backend) starts with only ``multi`` of tests/modelfiles.py's repository loaded; its
UDP side is also replayed by gpuprims-traffic's multi-tensor apps (``--app ID:tensors:...``).

gRPC's RepositoryModelLoad/Unload answer UNIMPLEMENTED in the front door (frontdoor/grpc_server.py), so the
gRPC client's ``load_model`` is not exercised here.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import click
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from gpuprims import tensorwire
from gpuprims.traffic import AppStream, run
from gpuprims.traffic.cli import parse_app
from gpuprims.traffic.stream import tensor_values
from orchestrator.cli.node import REPOSITORY_DEFAULTS, _load
from orchestrator.node.node import Node
from tests.orchestrator.conftest import NodeFactory, played

from ...modelfiles import detector_onnx, multi_io_onnx, repository, run_onnx

CONFIG = """
node:
  listen: {{host: {host}, port: 0}}
  backend: cpu
  run_dir: {run_dir}
  {ports}
  pool: {{slot_count: 4096, max_chunks: 256, record_count: 512}}
  autoscale: false
apps: []
"""

#: How long a load through the API may take on a busy machine (it starts an instance process).
LOAD_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(tmp: Path, host: str = "127.0.0.1", http: bool = True) -> str:
    ports = f"http_port: {_free_port()}\n  grpc_port: {_free_port()}" if http else f"grpc_port: {_free_port()}"
    p = tmp / "apps.yaml"
    p.write_text(CONFIG.format(host=host, run_dir=tmp / "run", ports=ports))
    return str(p)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/modelfiles.py's repository, ``multi`` holding half the device: a model loaded at start in explicit
    mode without a gpu_pct takes all of it, and a later load of one without a gpu_pct is refused (0% left)."""
    root = repository(tmp_path_factory.mktemp("explicit") / "repo")
    cfg = root / "multi" / "config.pbtxt"
    cfg.write_text(cfg.read_text() + 'parameters { key: "gpu_pct" value { string_value: "50" } }\n')
    return root


def test_explicit_mode_without_config_serves_the_repository_api_on_loopback(repo: Path) -> None:
    cfg, _ = _load(None, str(repo), ("multi",), "explicit")
    assert cfg.node.repository.enabled and not cfg.node.repository.has_token
    assert cfg.node.http_port == REPOSITORY_DEFAULTS["http_port"] and cfg.node.listen.host == "127.0.0.1"
    assert [a.name for a in cfg.apps] == ["multi"]
    # --load-model alone means explicit mode, and so the API too; mode none (every model served) keeps it off.
    assert _load(None, str(repo), ("multi",))[0].node.repository.enabled
    assert not _load(None, str(repo))[0].node.repository.enabled


def test_explicit_mode_with_a_config_turns_the_api_on_or_says_what_to_set(repo: Path, tmp_path: Path) -> None:
    cfg, _ = _load(_config(tmp_path), str(repo), ("multi",), "explicit")
    assert cfg.node.repository.enabled and cfg.node.model_control_mode == "explicit"
    (tmp_path / "b").mkdir()
    with pytest.raises(click.ClickException, match=r"set node\.http_port"):
        _load(_config(tmp_path / "b", http=False), str(repo), ("multi",), "explicit")
    (tmp_path / "c").mkdir()
    with pytest.raises(click.ClickException, match=r"not loopback.*node\.repository\.token_file or token_env"):
        _load(_config(tmp_path / "c", host="0.0.0.0"), str(repo), ("multi",), "explicit")
    # Without explicit mode a CONFIG without http_port is as before.
    assert not _load(_config(tmp_path / "b", http=False), str(repo))[0].node.repository.enabled


@pytest.fixture(scope="module")
def node(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("explicitnode")
    cfg, _ = _load(_config(tmp), str(repo), ("multi",), "explicit")
    n = Node(cfg, warmup=True, heartbeat_ms=100).start()
    # The repository API's operations are advanced by the node's loop: it runs beside the test.
    loop = threading.Thread(target=n.serve, name="test-node", daemon=True)
    loop.start()
    try:
        yield n
    finally:
        n.request_stop()
        loop.join(timeout=60)
        n.stop()


def _http(node: Node) -> httpclient.InferenceServerClient:
    assert node.frontdoor is not None and node.frontdoor.http_url is not None
    return httpclient.InferenceServerClient(node.frontdoor.http_url.removeprefix("http://"),
                                            network_timeout=LOAD_TIMEOUT_S, connection_timeout=LOAD_TIMEOUT_S)


def _detect(c: httpclient.InferenceServerClient, scores: np.ndarray) -> np.ndarray:
    t = httpclient.InferInput("scores", list(scores.shape), "FP32")
    t.set_data_from_numpy(scores)
    return c.infer("detector", [t]).as_numpy("idx")


def _load_and_unload(node: Node, tmp_path: Path, *, answers: bool) -> None:
    """tritonclient loads ``detector`` by name, it is ready (and, with ``answers``, answers as its ONNX file
    does), is unloaded, and a model the repository lacks is refused; ``multi`` serves throughout."""
    scores = np.array([0.9, 0.1, 0.7, 0.2, 0.6], np.float32)
    want = run_onnx(detector_onnx(tmp_path / "detector.onnx"), {"scores": scores})["idx"]
    with _http(node) as c:
        assert c.is_model_ready("multi") and not c.is_model_ready("detector")
        c.load_model("detector")  # no config: read from node.model_repository
        assert c.is_model_ready("detector")
        if answers:
            np.testing.assert_array_equal(_detect(c, scores), want)
        c.unload_model("detector")
        assert not c.is_model_ready("detector") and c.is_model_ready("multi")
        with pytest.raises(InferenceServerException):
            _detect(c, scores)
        with pytest.raises(InferenceServerException, match="nothere") as e:
            c.load_model("nothere")
        assert str(e.value.status()) == "400", str(e.value)
        assert not c.is_model_ready("nothere") and c.is_model_ready("multi")


def test_tritonclient_loads_and_unloads_a_repository_model_by_name_on_played_instances(
        repo: Path, tmp_path: Path, node_factory: NodeFactory) -> None:
    cfg, _ = _load(_config(tmp_path), str(repo), ("multi",), "explicit")
    node = node_factory(cfg, heartbeat_ms=100).start()
    loop = threading.Thread(target=node.serve, name="test-node", daemon=True)
    loop.start()
    try:
        _load_and_unload(node, tmp_path, answers=False)
        assert "detector" in {i.spec.app for i in played(node).launched}  # started by the load, on a double
        assert node.errors == {}
    finally:
        node.request_stop()
        loop.join(timeout=60)
        node.stop()
    assert not loop.is_alive()


@pytest.mark.real
@pytest.mark.slow
def test_tritonclient_loads_and_unloads_a_repository_model_by_name(node: Node, tmp_path: Path) -> None:
    _load_and_unload(node, tmp_path, answers=True)


@pytest.mark.real
@pytest.mark.slow
def test_a_traffic_replay_of_a_multi_tensor_app_is_answered_by_the_model(node: Node, tmp_path: Path) -> None:
    app_id = node.cfg.app_by_name("multi").app_id
    host, port = "127.0.0.1", node.ingest.ports[0]  # type: ignore[union-attr]
    spec = f"{app_id}:tensors:image in=3x5:float32;scale.k=1:int64;flag=1:bool,rate=50,count=20,variants=4"
    app = parse_app(spec, {"to": f"{host}:{port}"})
    assert isinstance(app, AppStream)
    r = run(app, timeout_s=30.0, keep_payloads=True)
    s = r.summary
    assert (s["sent"], s["answered"], s["lost"], s["duplicates"]) == (20, 20, 0, 0)
    assert s["status"] == {"OK": 20}
    model = multi_io_onnx(tmp_path / "multi.onnx")
    order = np.argsort(r.samples["request_id"])
    for k, event in enumerate(order):
        body = r.body(int(event))
        assert body is not None
        x = tensor_values(app.tensors or (), seed=k % 4)
        want = run_onnx(model, {n: v[None] for n, v in x.items()})
        got = tensorwire.decode_arrays(body)
        assert set(got) == set(want)
        for name, w in want.items():
            np.testing.assert_allclose(got[name].astype(np.float64).reshape(w[0].shape),
                                       w[0].astype(np.float64), rtol=1e-3, atol=1e-3)
