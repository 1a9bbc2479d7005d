"""model_control_mode poll: on a real node under load, a new version is swapped in by Overlapped-Execution
with every request answered once and OK; a new model is loaded, a removed one unloaded, and a version whose
files are broken leaves the served one serving, as rules on played instances (tests/orchestrator/conftest.py's
``node_factory``) and, marked real, with each model's answers."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from gpuprims.client import Client, RequestLost, Result
from gpuprims.ingest import packet_balance
from gpuprims.wire import Status
from orchestrator.config.schema import load_config
from orchestrator.node.node import Node
from tests.orchestrator.conftest import NodeFactory

from ...modelfiles import DETECTOR_CONFIG, detector_onnx

CONFIG = """
node:
  listen: {host: 127.0.0.1, port: 0}
  backend: cpu
  run_dir: RUN_DIR
  autoscale: false
  shadow_settle_s: 0
  model_repository: repo
  model_control_mode: poll
  repository_poll_s: 0.2
apps: []
"""
#: The input whose answer tells the versions apart: version 1 keeps scores above 0.5, version 2 above 0.3.
SCORES = np.array([0.4, 0.6, 0.1], np.float32)
V1, V2 = [1], [0, 1]


def _config(name: str) -> str:
    """The detector's config with a share of its own (auto would give the first model all of the device,
    leaving none for a model the poll finds later)."""
    return DETECTOR_CONFIG.format(name=name) + 'parameters { key: "gpu_pct" value { string_value: "40" } }\n'


def _version(repo: Path, model: str, v: int, threshold: float) -> None:
    """Version ``v`` of ``model`` appears whole (written aside, then renamed in: a poll never sees half)."""
    tmp = repo / f".{model}-{v}.tmp"
    detector_onnx(tmp / "model.onnx", threshold)
    os.replace(tmp, repo / model / str(v))


def _until(node: Node, cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        node.step(20)


class Load:
    """A client thread that keeps four requests of app ``app_id`` in flight and keeps every answer by id."""

    def __init__(self, port: int, app_id: int) -> None:
        self.client = Client(("127.0.0.1", port), timeout_s=60.0)
        self.app_id = app_id
        self.results: dict[int, object] = {}
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pending = []
        while not self._stop.is_set() or pending:
            while not self._stop.is_set() and len(pending) < 4:
                pending.append((self.sent, self.client.submit(self.app_id, {"scores": SCORES})))
                self.sent += 1
            i, fut = pending.pop(0)
            try:
                self.results[i] = fut.result()
            except RequestLost as e:
                self.results[i] = e

    def answers(self) -> list[list[int]]:
        """The ``idx`` of every OK answer, in the order the requests were sent."""
        done = [self.results[i] for i in sorted(self.results)]
        return [r.outputs["idx"].tolist() for r in done  # type: ignore[union-attr]
                if isinstance(r, Result) and r.status == Status.OK and r.outputs is not None]

    def finish(self, node: Node) -> None:
        self._stop.set()
        deadline = time.monotonic() + 120
        while self._thread.is_alive() and time.monotonic() < deadline:
            node.step(20)
        assert not self._thread.is_alive()
        self.client.close()


@pytest.fixture
def node(tmp_path: Path, node_factory: NodeFactory) -> Iterator[Node]:
    repo = tmp_path / "repo"
    (repo / "det").mkdir(parents=True)
    (repo / "det" / "config.pbtxt").write_text(_config("det"))
    _version(repo, "det", 1, 0.5)
    p = tmp_path / "apps.yaml"
    p.write_text(CONFIG.replace("RUN_DIR", str(tmp_path / "run")))
    n = node_factory(load_config(p), warmup=True, heartbeat_ms=100).start()
    n.repo = repo  # type: ignore[attr-defined]
    try:
        yield n
    finally:
        n.stop()


@pytest.mark.real  # every request answered once, by real instances, across the swap
@pytest.mark.slow
def test_a_new_version_is_swapped_in_under_load_with_every_request_answered_once(node: Node) -> None:
    repo: Path = node.repo  # type: ignore[attr-defined]
    assert node.ingest is not None
    load = Load(node.ingest.ports[0], node.apps["det"].cfg.app_id)
    _until(node, lambda: len(load.results) >= 20 and node.shadow_of("det") is not None, 120, "answers of version 1")
    _version(repo, "det", 2, 0.3)
    _until(node, lambda: V2 in load.answers()[-3:], 180, "answers of version 2")
    n_after = len(load.results)
    _until(node, lambda: len(load.results) >= n_after + 20, 120, "more answers of version 2")
    # The change ends (and is recorded) once the old active has drained, which on a busy machine can come
    # after version 2's first answers: wait for it, still under load.
    _until(node, lambda: any(e["event"] == "changed" and e["app"] == "det" for e in node.events), 120,
           "the change's end")
    load.finish(node)
    assert load.client.stray == 0, "an answer came twice (or to no request)"
    assert sorted(load.results) == list(range(load.sent)), "every request answered"
    lost = [i for i, r in load.results.items() if isinstance(r, BaseException)]
    assert not lost, f"{len(lost)} requests lost"
    statuses = {r.status for r in load.results.values()}  # type: ignore[union-attr]
    assert statuses == {Status.OK}, statuses
    answers = load.answers()
    first_v2 = answers.index(V2)
    assert set(map(tuple, answers[:first_v2])) == {tuple(V1)} and set(map(tuple, answers[first_v2:])) == {tuple(V2)}
    assert node.apps["det"].cfg.file is not None and node.apps["det"].cfg.file.version == 2
    swapped = [e for e in node.events if e["event"] == "changed" and e["app"] == "det"]
    assert swapped, "the swap was a change (Overlapped-Execution)"
    assert packet_balance(node.ingest.counters()) == 0


@pytest.mark.parametrize("instances", ["played", pytest.param("real", marks=(pytest.mark.real, pytest.mark.slow))])
def test_models_come_and_go_and_broken_files_leave_the_served_version(node: Node, instances: str) -> None:
    real = instances == "real"  # only a real instance runs the model and answers
    repo: Path = node.repo  # type: ignore[attr-defined]
    (repo / "second").mkdir()
    (repo / "second" / "config.pbtxt").write_text(_config("second"))
    _version(repo, "second", 1, 0.05)
    _until(node, lambda: "second" in node.apps and any(
        st.app == "second" and st.role == "active" and st.ready for st in node.instances.values()), 180, "a load")
    assert node.ingest is not None
    with Client(("127.0.0.1", node.ingest.ports[0]), timeout_s=30.0) as c:
        if real:
            r = c.infer(node.apps["second"].cfg.app_id, {"scores": SCORES})
            assert r.status == Status.OK and r.outputs is not None and r.outputs["idx"].tolist() == [0, 1, 2]
        # A broken version 2 of det: det keeps serving version 1.
        tmp = repo / ".broken"
        tmp.mkdir()
        (tmp / "model.onnx").write_bytes(b"not onnx")
        os.replace(tmp, repo / "det" / "2")
        scans = node.poller.scans  # type: ignore[union-attr]
        _until(node, lambda: node.poller.scans >= scans + 3, 60, "three polls")  # type: ignore[union-attr]
        assert node.apps["det"].cfg.file is not None and node.apps["det"].cfg.file.version == 1
        if real:
            r = c.infer(node.apps["det"].cfg.app_id, {"scores": SCORES})
            assert r.status == Status.OK and r.outputs is not None and r.outputs["idx"].tolist() == V1
        # The second model leaves the repository: it is unloaded.
        shutil.rmtree(repo / "second")
        _until(node, lambda: "second" not in node.apps, 120, "an unload")
    assert not any(st.app == "second" for st in node.instances.values())
    assert node.errors == {}
