"""Several versions of a repository model served at once (``version_policy: all``), each version an app of
its own behind one model name, on a real node (CPU backend, poll mode, HTTP and gRPC front door):

- each version answers as its file does, over tritonclient HTTP and gRPC (``/versions/<v>``) and over UDP at
  its own app id (the version's config gives it); an unversioned request reaches the highest version;
- metadata, readiness, config, statistics and the index speak per version;
- a version that appears under load is served as a new app with every request answered once and OK (the
  unversioned route moves to it once it is ready), and a version whose directory goes is unloaded;
- the repository API unloads one version's app by its name, and the model by its name (every
  version); a load by name loads every version again (explicit mode).

The detector of tests/modelfiles.py tells the versions apart: version v keeps the scores above its threshold.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from gpuprims.client import Client
from gpuprims.wire import Status
from orchestrator.config.schema import load_config
from orchestrator.node.node import Node

from ...modelfiles import DETECTOR_CONFIG, detector_onnx

pytestmark = pytest.mark.slow

CONFIG = """
node:
  listen: {{host: 127.0.0.1, port: 0}}
  backend: cpu
  run_dir: {run_dir}
  http_port: {http}
  grpc_port: {grpc}
  autoscale: false
  shadow_settle_s: 0
  model_repository: repo
  model_control_mode: {mode}
  repository_poll_s: 0.2
  load_models: {load}
  repository: {{enabled: true}}
apps: []
"""
SCORES = np.array([0.4, 0.6, 0.1], np.float32)
#: Each version's threshold and its answer for SCORES.
THRESHOLD = {1: 0.5, 2: 0.3, 3: 0.05}
ANSWER = {1: [1], 2: [0, 1], 3: [0, 1, 2]}
TIMEOUT_S = 180.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _version(repo: Path, v: int) -> None:
    """Version ``v`` of ``det`` appears whole (written aside, then renamed in: a poll never sees half)."""
    tmp = repo / f".det-{v}.tmp"
    detector_onnx(tmp / "model.onnx", THRESHOLD[v])
    os.replace(tmp, repo / "det" / str(v))


def _until(cond: Callable[[], bool], what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def node(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Node]:
    """A node of ``det`` (versions 1 and 2) in the control mode the test names (``poll`` or ``explicit``)."""
    mode = request.param
    repo = tmp_path / "repo"
    (repo / "det").mkdir(parents=True)
    (repo / "det" / "config.pbtxt").write_text(
        DETECTOR_CONFIG.format(name="det") + 'version_policy { all { } }\n'
        'parameters { key: "gpu_pct" value { string_value: "30" } }\n')
    _version(repo, 1)
    _version(repo, 2)
    p = tmp_path / "apps.yaml"
    p.write_text(CONFIG.format(run_dir=tmp_path / "run", http=_free_port(), grpc=_free_port(), mode=mode,
                               load="[det]" if mode == "explicit" else "[]"))
    n = Node(load_config(p), warmup=True, heartbeat_ms=100).start()
    n.repo = repo  # type: ignore[attr-defined]
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
                                            network_timeout=TIMEOUT_S, connection_timeout=TIMEOUT_S)


def _grpc(node: Node) -> grpcclient.InferenceServerClient:
    assert node.frontdoor is not None and node.frontdoor.grpc_target is not None
    return grpcclient.InferenceServerClient(node.frontdoor.grpc_target)


def _detect_http(c: httpclient.InferenceServerClient, version: str = "") -> tuple[list[int], str]:
    t = httpclient.InferInput("scores", [3], "FP32")
    t.set_data_from_numpy(SCORES)
    r = c.infer("det", [t], model_version=version)
    return r.as_numpy("idx").tolist(), str(r.get_response()["model_version"])


def _detect_grpc(c: grpcclient.InferenceServerClient, version: str = "") -> tuple[list[int], str]:
    t = grpcclient.InferInput("scores", [3], "FP32")
    t.set_data_from_numpy(SCORES)
    r = c.infer("det", [t], model_version=version)
    return r.as_numpy("idx").tolist(), r.get_response().model_version


@pytest.mark.parametrize("node", ["explicit"], indirect=True)
def test_each_version_is_an_app_answering_as_its_file(node: Node) -> None:
    assert set(node.apps) == {"det-v1", "det-v2"}
    with _http(node) as h, _grpc(node) as g:
        _until(lambda: h.is_model_ready("det", "1") and h.is_model_ready("det", "2"), "both versions ready")
        for v in (1, 2):
            assert _detect_http(h, str(v)) == (ANSWER[v], str(v))
            assert _detect_grpc(g, str(v)) == (ANSWER[v], str(v))
            assert g.is_model_ready("det", str(v))
            assert h.get_model_metadata("det", str(v))["versions"] == [str(v)]
            assert g.get_model_metadata("det", str(v)).versions == [str(v)]
            cfg = h.get_model_config("det", str(v))
            app = node.apps[f"det-v{v}"].cfg
            assert cfg["name"] == "det" and cfg["parameters"]["app_id"]["string_value"] == str(app.app_id)
            assert node.ingest is not None
            with Client(("127.0.0.1", node.ingest.ports[0]), timeout_s=30.0) as c:
                r = c.infer(app.app_id, {"scores": SCORES})  # UDP: the version's own app id
                assert r.status == Status.OK and r.outputs is not None and r.outputs["idx"].tolist() == ANSWER[v]
        assert _detect_http(h) == (ANSWER[2], "2") and _detect_grpc(g) == (ANSWER[2], "2")  # the highest
        index = [(m["name"], m["version"], m["state"]) for m in h.get_model_repository_index()]
        assert ("det", "1", "READY") in index and ("det", "2", "READY") in index
        stats = {s["version"]: s["inference_count"] for s in h.get_inference_statistics("det")["model_stats"]}
        assert stats["1"] >= 1 and stats["2"] >= 2, stats
        with pytest.raises(InferenceServerException, match="no version '7'") as e:
            _detect_http(h, "7")
        assert str(e.value.status()) == "404"
        # The repository API: one version's app by its name, then the model (every version) by its name.
        h.unload_model("det-v1")
        assert [m["version"] for m in h.get_model_repository_index() if m["name"] == "det"] == ["2"]
        with pytest.raises(InferenceServerException, match="no version '1'"):
            _detect_http(h, "1")
        assert _detect_http(h) == (ANSWER[2], "2")
        h.unload_model("det")
        assert not node.apps and not [m for m in h.get_model_repository_index() if m["state"] == "READY"]
        h.load_model("det")  # by name, from the repository: an app per version again
        assert set(node.apps) == {"det-v1", "det-v2"}
        assert _detect_http(h, "1") == (ANSWER[1], "1") and _detect_grpc(g) == (ANSWER[2], "2")


@pytest.mark.parametrize("node", ["poll"], indirect=True)
def test_a_version_appears_under_load_and_one_leaves(node: Node) -> None:
    repo: Path = node.repo  # type: ignore[attr-defined]
    results: list[object] = []
    stop = threading.Event()

    def load() -> None:  # unversioned requests over gRPC (thread-safe), one at a time, each result kept
        with _grpc(node) as c:
            while not stop.is_set():
                try:
                    idx, version = _detect_grpc(c)
                    results.append((tuple(idx), version))
                except InferenceServerException as e:
                    results.append(e)

    with _http(node) as h:
        _until(lambda: h.is_model_ready("det", "1") and h.is_model_ready("det", "2"), "both versions ready")
        t = threading.Thread(target=load, daemon=True)
        t.start()
        try:
            _until(lambda: len(results) >= 10, "answers of version 2")
            _version(repo, 3)
            _until(lambda: (tuple(ANSWER[3]), "3") in results[-3:], "answers of version 3")
            n = len(results)
            _until(lambda: len(results) >= n + 10, "more answers")
        finally:
            stop.set()
            t.join(timeout=TIMEOUT_S)
        assert not t.is_alive()
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors[:3]
        first = results.index((tuple(ANSWER[3]), "3"))
        assert set(results[:first]) == {(tuple(ANSWER[2]), "2")}
        assert set(results[first:]) == {(tuple(ANSWER[3]), "3")}
        assert "det-v3" in node.apps and _detect_http(h, "1") == (ANSWER[1], "1")
        # Version 1's directory goes: its app is unloaded, the others serve on.
        (repo / "det" / "1").rename(repo / ".gone")
        _until(lambda: "det-v1" not in node.apps, "the unload of version 1")
        assert [m["version"] for m in h.get_model_repository_index() if m["name"] == "det"] == ["2", "3"]
        assert _detect_http(h, "2") == (ANSWER[2], "2") and _detect_http(h) == (ANSWER[3], "3")
