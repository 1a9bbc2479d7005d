"""A real node (CPU backend, instance processes) serving a Triton model repository and a model file named in
apps.yaml, driven by tritonclient over HTTP and gRPC and by gpuprims.client over UDP from several clients at
once; every answer is compared with the file run directly in ONNX Runtime."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from gpuprims.client import Client
from gpuprims.ingest import packet_balance
from orchestrator.config.schema import load_config
from orchestrator.node.node import Node

from ...modelfiles import multi_inputs, multi_io_onnx, repository, run_onnx, unrunnable_onnx

pytestmark = pytest.mark.slow

CONFIG = """
node:
  listen: {host: 127.0.0.1, port: 0}
  backend: cpu
  run_dir: RUN_DIR
  http_port: HTTP
  grpc_port: GRPC
  pool: {slot_count: 4096, max_chunks: 256, record_count: 512}
  autoscale: false
  model_repository: repo
apps:
  - name: yaml-multi
    model: files/multi.onnx
    slo_ms: 5000
    shadow: false
    config: {max_batch_size: 4, dynamic_batching: {max_queue_delay_microseconds: 1000}}
"""


UNRUNNABLE_CONFIG = """
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("filenode")
    repository(tmp / "repo")
    unrunnable_onnx(tmp / "repo" / "unrunnable" / "1" / "model.onnx")  # fails only when its engine loads it
    (tmp / "repo" / "unrunnable" / "config.pbtxt").write_text(UNRUNNABLE_CONFIG)
    multi_io_onnx(tmp / "files" / "multi.onnx")
    p = tmp / "apps.yaml"
    p.write_text(CONFIG.replace("RUN_DIR", str(tmp / "run")).replace("HTTP", str(_free_port()))
                 .replace("GRPC", str(_free_port())))
    n = Node(load_config(p), warmup=True, heartbeat_ms=100).start()
    n.files = tmp  # type: ignore[attr-defined]
    try:
        yield n
    finally:
        n.stop()


def _model_file(node: Node, app: str) -> Path:
    f = node.cfg.app_by_name(app).file
    assert f is not None
    return Path(f.path)


def _http(node: Node) -> httpclient.InferenceServerClient:
    assert node.frontdoor is not None and node.frontdoor.http_url is not None
    return httpclient.InferenceServerClient(node.frontdoor.http_url.removeprefix("http://"), concurrency=4)


def _grpc(node: Node) -> grpcclient.InferenceServerClient:
    assert node.frontdoor is not None and node.frontdoor.grpc_target is not None
    return grpcclient.InferenceServerClient(node.frontdoor.grpc_target)


_DT = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64", np.dtype(bool): "BOOL"}


def _http_inputs(x: dict[str, np.ndarray], binary: bool = True) -> list[httpclient.InferInput]:
    out = []
    for name, arr in x.items():
        t = httpclient.InferInput(name, list(arr.shape), _DT[arr.dtype])
        t.set_data_from_numpy(arr, binary_data=binary)
        out.append(t)
    return out


def _grpc_inputs(x: dict[str, np.ndarray]) -> list[grpcclient.InferInput]:
    out = []
    for name, arr in x.items():
        t = grpcclient.InferInput(name, list(arr.shape), _DT[arr.dtype])
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def _close(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name, w in want.items():
        assert got[name].dtype == w.dtype and got[name].shape == w.shape, name
        np.testing.assert_allclose(got[name].astype(np.float64), w.astype(np.float64), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("app", ["multi", "noconfig", "yaml-multi"])
def test_tritonclient_http_and_grpc_answer_as_the_file(node: Node, app: str) -> None:
    path = _model_file(node, app)
    names = ["mean out", "half", "is pos", "k twice"]
    for width, n in ((3, 1), (6, 4)):
        x = multi_inputs(n, width, seed=width)
        want = run_onnx(path, x)
        with _http(node) as h:
            res = h.infer(app, _http_inputs(x))
            _close({k: res.as_numpy(k) for k in names}, want)
            json_res = h.infer(app, _http_inputs(x, binary=False),
                               outputs=[httpclient.InferRequestedOutput("k twice", binary_data=False)])
            assert json_res.as_numpy("mean out") is None  # only the output asked for
            np.testing.assert_array_equal(json_res.as_numpy("k twice"), want["k twice"])
        with _grpc(node) as g:
            res = g.infer(app, _grpc_inputs(x))
            _close({k: res.as_numpy(k) for k in names}, want)


def test_metadata_config_and_index_speak_for_the_files(node: Node) -> None:
    with _http(node) as h:
        md = h.get_model_metadata("multi")
        assert md["platform"] in ("onnxruntime_onnx", "onnxruntime")
        assert {t["name"]: (t["datatype"], t["shape"]) for t in md["inputs"]} == {
            "image in": ("FP32", [-1, 3, -1]), "scale.k": ("INT64", [-1, 1]), "flag": ("BOOL", [-1, 1])}
        assert {t["name"]: t["datatype"] for t in md["outputs"]} == {
            "mean out": "FP32", "half": "FP16", "is pos": "BOOL", "k twice": "INT64"}
        det = h.get_model_metadata("detector")
        assert det["inputs"] == [{"name": "scores", "datatype": "FP32", "shape": [-1]}]
        cfg = h.get_model_config("multi")
        assert cfg["max_batch_size"] == 8
        assert int(cfg["dynamic_batching"]["max_queue_delay_microseconds"]) == 2000
        index = {m["name"]: m for m in h.get_model_repository_index()}
        assert {index[n]["state"] for n in ("multi", "noconfig", "detector", "yaml-multi")} == {"READY"}
        assert index["broken"]["state"] == "UNAVAILABLE" and index["broken"]["reason"]
        # Read and checked, it failed only in its instance: it alone is UNAVAILABLE, with the engine's words.
        assert index["unrunnable"]["state"] == "UNAVAILABLE" and "Foo" in index["unrunnable"]["reason"]
        assert not h.is_model_ready("unrunnable")
    with _grpc(node) as g:
        md = g.get_model_metadata("noconfig", as_json=True)
        assert [t["name"] for t in md["inputs"]] == ["image in", "scale.k", "flag"]
        index = {m.name: m for m in g.get_model_repository_index().models}
        assert index["broken"].state == "UNAVAILABLE" and index["broken"].reason
        cfg = g.get_model_config("detector", as_json=True)["config"]
        assert cfg["name"] == "detector" and int(cfg.get("max_batch_size", 0)) == 0


def test_a_model_without_batching_answers_data_dependent_sizes(node: Node) -> None:
    path = _model_file(node, "detector")
    for scores in (np.array([0.2, 0.9, 0.6, 0.1], np.float32), np.zeros(3, np.float32)):
        want = run_onnx(path, {"scores": scores})["idx"]
        with _http(node) as h:
            t = httpclient.InferInput("scores", list(scores.shape), "FP32")
            t.set_data_from_numpy(scores)
            np.testing.assert_array_equal(h.infer("detector", [t]).as_numpy("idx"), want)
        with _grpc(node) as g:
            t2 = grpcclient.InferInput("scores", list(scores.shape), "FP32")
            t2.set_data_from_numpy(scores)
            np.testing.assert_array_equal(g.infer("detector", [t2]).as_numpy("idx"), want)


@pytest.mark.parametrize(("inputs", "match"), [
    ({"image in": np.zeros((1, 3, 2), np.float32), "scale.k": np.zeros((1, 1), np.int64)}, "missing input"),
    ({"image in": np.zeros((1, 4, 2), np.float32), "scale.k": np.zeros((1, 1), np.int64),
      "flag": np.zeros((1, 1), bool)}, "input 'image in' has shape"),
    ({"image in": np.zeros((1, 3, 2), np.float32), "scale.k": np.zeros((1, 1), np.float32),
      "flag": np.zeros((1, 1), bool)}, "input 'scale.k' is INT64, got FP32"),
    ({"image in": np.zeros((9, 3, 2), np.float32), "scale.k": np.zeros((9, 1), np.int64),
      "flag": np.zeros((9, 1), bool)}, "batch of 9"),
])
def test_wrong_inputs_are_refused_naming_the_tensor(node: Node, inputs: dict[str, np.ndarray], match: str) -> None:
    with _http(node) as h, pytest.raises(InferenceServerException, match=match) as e:
        h.infer("multi", _http_inputs(inputs))
    assert str(e.value.status()) == "400"
    with _grpc(node) as g, pytest.raises(InferenceServerException, match=match) as e2:
        g.infer("multi", _grpc_inputs(inputs))
    assert "INVALID_ARGUMENT" in str(e2.value.status())


def test_udp_http_and_grpc_clients_at_once_each_get_their_answer(node: Node) -> None:
    """Several clients at once, several shapes: every request answered once and as the file answers."""
    assert node.ingest is not None
    path = _model_file(node, "multi")
    app_id = node.cfg.app_by_name("multi").app_id
    errors: list[BaseException] = []
    before = node.ingest.counters()

    def udp(seed: int) -> None:
        try:
            with Client(("127.0.0.1", node.ingest.ports[0]), timeout_s=30.0) as c:  # type: ignore[union-attr]
                for i in range(6):
                    x = multi_inputs(1, 2 + (seed + i) % 5, seed=seed * 100 + i)
                    r = c.infer(app_id, {k: v[0] for k, v in x.items()})
                    r.raise_for_status()
                    assert r.outputs is not None
                    _close(r.outputs, {k: v[0] for k, v in run_onnx(path, x).items()})
        except BaseException as e:
            errors.append(e)

    def http(seed: int) -> None:
        try:
            with _http(node) as h:
                for i in range(4):
                    x = multi_inputs(2, 1 + (seed + i) % 4, seed=seed * 100 + i)
                    res = h.infer("multi", _http_inputs(x))
                    _close({k: res.as_numpy(k) for k in ("mean out", "half", "is pos", "k twice")}, run_onnx(path, x))
        except BaseException as e:
            errors.append(e)

    def grpc(seed: int) -> None:
        try:
            with _grpc(node) as g:
                for i in range(4):
                    x = multi_inputs(3, 1 + (seed + i) % 3, seed=seed * 100 + i)
                    res = g.infer("multi", _grpc_inputs(x))
                    _close({k: res.as_numpy(k) for k in ("mean out", "half", "is pos", "k twice")}, run_onnx(path, x))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=f, args=(s,)) for s, f in enumerate([udp, udp, http, http, grpc])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not [t for t in threads if t.is_alive()], "a client did not finish"
    assert not errors, errors
    c = node.ingest.counters()
    # 2 UDP clients x 6 + 2 HTTP x 4 x 2 rows + 1 gRPC x 4 x 3 rows, each completed once.
    assert c["requests_completed"] - before["requests_completed"] == 12 + 16 + 12
    assert packet_balance(c) == 0
