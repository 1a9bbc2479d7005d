"""The node's model repository: validation of a load's entry, the token, and a node loading, changing and
unloading apps over HTTP on loopback (tests/orchestrator/frontdoor/test_repository_api.py holds the HTTP
routes' own checks). The node's rules run on played instances (tests/orchestrator/conftest.py's
``node_factory``); the same test marked real also checks, on real instance processes, what each loaded
or changed app answers."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from apps.zoo import build_model
from gpuprims.gather import preprocess
from orchestrator.config.schema import ConfigError, load_config, parse_config
from orchestrator.control.errors import StartError
from orchestrator.node.node import Node, read_repository_token
from orchestrator.node.repository import RepositoryError, RepositoryPoller, validate_entry
from orchestrator.node.state import AppState
from tests.orchestrator.conftest import NodeFactory, played

from ...modelfiles import DETECTOR_CONFIG, detector_onnx

TOKEN = "a-test-token-of-enough-length"


def _cfg(**node: Any) -> Any:
    return parse_config({"node": {"backend": "cpu", "http_port": 8000, **node},
                         "apps": [{"name": "cls", "model": "mobilenet_v2", "slo_ms": 100, "gpu_pct": 50}]},
                        source="test")


def _apps(cfg: Any) -> dict[str, AppState]:
    return {a.name: AppState(cfg=a, gpu_pct=50, instances=1) for a in cfg.apps}


def test_a_load_entry_is_validated_like_an_apps_yaml_entry() -> None:
    cfg = _cfg()
    new = validate_entry(cfg, _apps(cfg), "det", {"model": "resnet18", "slo_ms": 50, "gpu_pct": 30})
    assert new.name == "det" and new.app_id == 2 and new.gpu_pct == 30  # the next free app id


def test_a_running_app_keeps_its_app_id_when_the_entry_does_not_name_one() -> None:
    cfg = _cfg()
    again = validate_entry(cfg, _apps(cfg), "cls", {"model": "mobilenet_v2", "slo_ms": 100, "gpu_pct": 40})
    assert again.app_id == 1 and again.gpu_pct == 40


@pytest.mark.parametrize(("entry", "message"), [
    ({"model": "resnet18", "slo_ms": -1}, "config.slo_ms: Input should be greater than 0"),
    ({"model": "resnet18", "slo_ms": 50, "gpu_pcts": 3}, "unknown key 'gpu_pcts' (did you mean 'gpu_pct'?)"),
    ({"model": "resnet_18", "slo_ms": 50}, "unknown zoo model 'resnet_18'"),
    ({"model": "resnet18", "slo_ms": 50, "app_id": 1}, "duplicate app_id 1"),
    ({"model": "resnet18", "slo_ms": 50, "gpu_pct": 60}, "GPU 0 is oversubscribed"),
    ({"model": "resnet18", "slo_ms": 50, "port": 9100}, "port: cannot be given in a load"),
    ({"name": "other", "model": "resnet18", "slo_ms": 50}, "differs from the model name in the URL"),
    (["resnet18"], "must be a JSON object"),
])
def test_a_bad_load_entry_is_refused_naming_the_key(entry: Any, message: str) -> None:
    cfg = _cfg()
    with pytest.raises(RepositoryError, match="load of 'det'") as e:
        validate_entry(cfg, _apps(cfg), "det", entry)
    assert e.value.kind == "invalid" and message in str(e.value)


def test_the_repository_is_refused_off_loopback_without_a_token() -> None:
    with pytest.raises(ConfigError, match=r"node.repository: .*needs token_file or token_env"):
        _cfg(listen={"host": "0.0.0.0"}, repository={"enabled": True})
    _cfg(listen={"host": "0.0.0.0"}, repository={"enabled": True, "token_env": "T"})
    with pytest.raises(ConfigError, match=r"repository.enabled: .*node.http_port"):
        parse_config({"node": {"repository": {"enabled": True}},
                      "apps": [{"name": "a", "model": "resnet18", "slo_ms": 9}]}, source="test")
    with pytest.raises(ConfigError, match="token_file or token_env, not both"):
        _cfg(repository={"enabled": True, "token_env": "T", "token_file": "f"})


def test_the_token_comes_from_a_file_or_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    assert read_repository_token(_cfg(repository={"enabled": True, "token_file": str(f)}).node.repository) == TOKEN
    monkeypatch.setenv("GPUPRIMS_TEST_TOKEN", TOKEN)
    assert read_repository_token(_cfg(repository={"enabled": True, "token_env": "GPUPRIMS_TEST_TOKEN"})
                                 .node.repository) == TOKEN
    with pytest.raises(StartError, match="cannot be read"):
        read_repository_token(_cfg(repository={"enabled": True, "token_file": str(tmp_path / "no")}).node.repository)
    f.write_text("short")
    with pytest.raises(StartError, match="a too short token"):
        read_repository_token(_cfg(repository={"enabled": True, "token_file": str(f)}).node.repository)
    monkeypatch.delenv("GPUPRIMS_TEST_TOKEN")
    with pytest.raises(StartError, match="holds no token"):
        read_repository_token(_cfg(repository={"enabled": True, "token_env": "GPUPRIMS_TEST_TOKEN"})
                              .node.repository)


# -- a node on loopback: played instances, and real ones for the answers -------------------------------

CONFIG = """
node:
  listen: {host: 127.0.0.1, port: 0}
  backend: cpu
  run_dir: RUN_DIR
  http_port: HTTP_PORT
  autoscale: false
  shadow_settle_s: 0
  pool: {slot_count: 4096, max_chunks: 64, record_count: 512}
  repository: {enabled: true, token_file: TOKEN_FILE}
apps:
  - {name: cls, model: mobilenet_v2, input_shape: [3, 32, 32], slo_ms: 5000, gpu_pct: 50, max_batch: 4,
     num_classes: 10, seed: 3}
"""
DET = {"model": "resnet18", "input_shape": [3, 32, 32], "dtype": "uint8", "slo_ms": 5000, "gpu_pct": 40,
       "max_batch": 4, "num_classes": 10, "seed": 4, "shadow": False}


class Serving:
    """A node whose loop runs in a thread while the test calls its HTTP front door."""

    def __init__(self, node: Node) -> None:
        self.node = node
        assert node.frontdoor is not None and node.frontdoor.http_url is not None
        self.url = node.frontdoor.http_url
        self.thread = threading.Thread(target=node.serve, name="test-node", daemon=True)
        self.thread.start()

    def post(self, path: str, body: Any = None, token: str | None = TOKEN, timeout_s: float = 300) -> tuple[int, Any]:
        data = b"" if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        if token is not None:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def infer(self, name: str, x: np.ndarray) -> tuple[int, Any]:
        dt = "UINT8" if x.dtype == np.uint8 else "FP32"
        body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": dt, "data": x.reshape(-1).tolist()}],
                "parameters": {"timeout": 60_000_000}}
        return self.post(f"/v2/models/{name}/infer", body, token=None)

    def close(self) -> None:
        self.node.request_stop()
        self.thread.join(timeout=60)
        self.node.stop()


@pytest.fixture
def serving(tmp_path: Path, node_factory: NodeFactory) -> Iterator[Serving]:
    tok = tmp_path / "token"
    tok.write_text(TOKEN)
    tok.chmod(0o600)
    p = tmp_path / "apps.yaml"
    p.write_text(CONFIG.replace("RUN_DIR", str(tmp_path / "run")).replace("TOKEN_FILE", str(tok))
                 .replace("HTTP_PORT", str(_free_tcp_port())))
    node = node_factory(load_config(p), warmup=False, heartbeat_ms=100, ready_timeout_s=240).start()
    s = Serving(node)
    try:
        yield s
    finally:
        s.close()


def _free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _want(model: str, seed: int, x: np.ndarray, dtype: str) -> np.ndarray:
    m = build_model(model, seed=seed, num_classes=10, input_shape=(3, 32, 32)).eval()
    with torch.inference_mode():
        return m(preprocess(torch.from_numpy(x), dtype)).numpy()


@pytest.mark.parametrize("instances", ["played", pytest.param("real", marks=(pytest.mark.real, pytest.mark.slow))])
def test_load_change_unload(serving: Serving, instances: str) -> None:
    real = instances == "real"  # only a real instance runs the model and answers
    if not real:  # the unimportable model's instance reports what a real one does, and exits
        played(serving.node).fail_apps["bad"] = ("model_load", "No module named 'gpuprims_no_such_module'")
    rng = np.random.default_rng(0)
    xd = rng.integers(0, 256, (2, 3, 32, 32), dtype=np.uint8)
    xc = rng.random((2, 3, 32, 32), dtype=np.float32)
    # No token, a wrong one: refused before anything is read or done.
    assert serving.post("/v2/repository/models/det/load", {"parameters": {"config": DET}}, token=None)[0] == 401
    assert serving.post("/v2/repository/models/det/load", {"parameters": {"config": DET}}, token="x" * 30)[0] == 401
    assert "det" not in serving.node.apps
    # A load of a new app: it serves, through the front door, the model's own answers.
    code, body = serving.post("/v2/repository/models/det/load", {"parameters": {"config": json.dumps(DET)}})
    assert code == 200, body
    assert serving.node.frontdoor.core.stats["det"] is serving.node.apps["det"].stats  # type: ignore[union-attr]
    if real:
        code, out = serving.infer("det", xd)
        assert code == 200, out
        np.testing.assert_allclose(np.asarray(out["outputs"][0]["data"]).reshape(2, 10),
                                   _want("resnet18", 4, xd, "uint8"), rtol=1e-4, atol=1e-4)
        # The front door counted it in the loaded app's one statistics record (status, metrics, OIP stats).
        oip = serving.node.status()["apps"]["det"]["oip"]
        assert oip["execution_count"] == 1 and oip["inference_count"] == 2 and oip["statuses"] == {"OK": 2}
    _, index = serving.post("/v2/repository/index", token=None)
    assert {"name": "det", "version": "1", "state": "READY"} in index
    # A load whose instance cannot start fails and leaves the node as it was.
    bad = {**DET, "model": "gpuprims_no_such_module:make", "gpu_pct": 5}
    code, body = serving.post("/v2/repository/models/bad/load", {"parameters": {"config": bad}})
    assert code == 400 and "failed to start" in body["error"], body
    assert "bad" not in serving.node.status()["apps"]
    # A bad entry: the key and what is wrong.
    code, body = serving.post("/v2/repository/models/x/load", {"parameters": {"config": {**DET, "slo_ms": 0}}})
    assert code == 400 and "config.slo_ms" in body["error"]
    # A load of a running app with another model is refused; the old app keeps serving.
    code, body = serving.post("/v2/repository/models/det/load",
                              {"parameters": {"config": {**DET, "model": "mobilenet_v2"}}})
    assert code == 400 and "model differ" in body["error"], body
    assert "det" in serving.node.status()["apps"]
    if real:
        assert serving.infer("det", xd)[0] == 200
    # A load of a running app with a new share is an Overlapped-Execution change, not a restart.
    cls = {"model": "mobilenet_v2", "input_shape": [3, 32, 32], "slo_ms": 5000, "gpu_pct": 60, "max_batch": 4,
           "num_classes": 10, "seed": 3, "app_id": 1}
    pids = {i["pid"] for i in serving.node.status()["apps"]["cls"]["instances"] if i["role"] == "active"}
    code, body = serving.post("/v2/repository/models/cls/load", {"parameters": {"config": cls}})
    assert code == 200 and "Overlapped-Execution" in body["message"], body
    st = serving.node.status()
    assert st["apps"]["cls"]["gpu_pct"] == 60 and st["changes"]["recent"][-1]["origin"] == "repository"
    assert not pids & {i["pid"] for i in st["apps"]["cls"]["instances"] if i["role"] == "active"}
    if real:
        code, out = serving.infer("cls", xc)
        assert code == 200
        np.testing.assert_allclose(np.asarray(out["outputs"][0]["data"]).reshape(2, 10),
                                   _want("mobilenet_v2", 3, xc, "float32"), rtol=1e-4, atol=1e-4)
    # Unload: gone from the node and the front door.
    code, body = serving.post("/v2/repository/models/det/unload")
    assert code == 200, body
    assert serving.infer("det", xd)[0] == 404
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(i.app == "det" for i in list(serving.node.instances.values())):
        time.sleep(0.05)  # polls a condition with a deadline: the node's loop thread retires the instances
    assert "det" not in serving.node.status()["apps"]
    assert serving.post("/v2/repository/models/det/unload")[0] == 404
    assert serving.node.errors == {}


def test_a_poll_adds_and_removes_the_apps_of_versions(tmp_path: Path) -> None:
    """A model whose policy serves several versions: each version's app is loaded when its directory appears
    and unloaded when it goes; the model gone unloads every one; an apps.yaml app is never touched."""
    repo = tmp_path / "repo"
    for v in (1, 2):
        detector_onnx(repo / "det" / str(v) / "model.onnx", 0.2 * v)
    (repo / "det" / "config.pbtxt").write_text(DETECTOR_CONFIG.format(name="det") + "version_policy { all { } }\n")
    poller = RepositoryPoller(str(repo), 60.0, slo_ms=100.0, backend="cpu")
    poller.scan_once()
    first = poller.due({}, ())
    assert [(a.kind, a.name) for a in first] == [("load", "det-v1"), ("load", "det-v2")]
    assert poller.due({}, ()) == []  # nothing new scanned
    zoo = {"name": "other", "model": "mobilenet_v2", "slo_ms": 100}
    cfg = parse_config({"node": {"backend": "cpu"}, "apps": [zoo, *(a.entry for a in first)]}, source="test")
    served = {a.name: a for a in cfg.apps}
    poller.scan_once()
    assert poller.due(served, ()) == []  # served as the repository has them
    detector_onnx(repo / "det" / "3" / "model.onnx", 0.6)
    (repo / "det" / "1" / "model.onnx").unlink()
    (repo / "det" / "1").rmdir()
    poller.scan_once()
    assert sorted((a.kind, a.name) for a in poller.due(served, ())) == [("load", "det-v3"), ("unload", "det-v1")]
    poller.scan_once()
    assert [(a.kind, a.name) for a in poller.due(served, {"det-v1", "det-v3"})] == []  # busy: left alone
    shutil.rmtree(repo / "det")
    poller.scan_once()
    assert sorted((a.kind, a.name) for a in poller.due(served, ())) == [("unload", "det-v1"), ("unload", "det-v2")]
