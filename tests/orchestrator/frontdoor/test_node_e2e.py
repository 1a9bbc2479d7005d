"""A real node (orchestrator.node.node.Node, CPU backend, instance processes) with the front door beside it."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from apps.zoo import build_model
from gpuprims.gather import preprocess
from gpuprims.ingest import packet_balance
from orchestrator.config.schema import load_config
from orchestrator.frontdoor import start_frontdoor
from orchestrator.node.node import Node

pytestmark = pytest.mark.slow

#: The deadline the end-to-end requests carry (the OIP "timeout" parameter, microseconds).
BUSY_DEADLINE_US = 10_000_000

CONFIG = """
node:
  listen: {host: 127.0.0.1, port: 0}
  backend: cpu
  run_dir: RUN_DIR
  pool: {slot_count: 4096, max_chunks: 64, record_count: 512}
  reassembly_timeout_ms: 200
  autoscale: false
apps:
  - {name: cls, model: mobilenet_v2, input_shape: [3, 32, 32], slo_ms: 5000, gpu_pct: 100, max_batch: 8,
     app_id: 1, num_classes: 10, seed: 3, shadow: false}
"""


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("oipnode")
    p = tmp / "apps.yaml"
    p.write_text(CONFIG.replace("RUN_DIR", str(tmp / "run")))
    n = Node(load_config(p), warmup=True, heartbeat_ms=100).start()
    try:
        yield n
    finally:
        n.stop()


@pytest.mark.parametrize("via", ["pool", "udp"])
def test_tritonclient_through_a_real_node(node: Node, via: str) -> None:
    assert node.ingest is not None
    cfg = node.cfg
    model = build_model("mobilenet_v2", seed=3, num_classes=10, input_shape=(3, 32, 32))
    x = np.random.default_rng(0).standard_normal((4, 3, 32, 32)).astype(np.float32)
    with torch.inference_mode():
        want = model(preprocess(torch.from_numpy(x), "float32")).numpy()
    before = node.ingest.counters()["requests_completed"]
    with start_frontdoor(cfg.apps, ("127.0.0.1", node.ingest.ports[0]), http_port=0, grpc_port=0,
                         ingest=node.ingest if via == "pool" else None) as door:
        assert door.http_url is not None and door.grpc_target is not None
        with httpclient.InferenceServerClient(door.http_url.removeprefix("http://")) as h:
            t = httpclient.InferInput("input", list(x.shape), "FP32")
            t.set_data_from_numpy(x, binary_data=True)
            out_http = h.infer("cls", [t]).as_numpy("logits")
        with grpcclient.InferenceServerClient(door.grpc_target) as g:
            t2 = grpcclient.InferInput("input", list(x.shape), "FP32")
            t2.set_data_from_numpy(x)
            out_grpc = g.infer("cls", [t2]).as_numpy("logits")
    np.testing.assert_allclose(out_http, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out_grpc, want, rtol=1e-4, atol=1e-4)
    # The 8 rows went through the node's own ingest and instance, and its accounting saw them.
    c = node.ingest.counters()
    assert c["requests_completed"] - before == 8 and packet_balance(c) == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and node.status()["apps"]["cls"]["ok"] < 8:
        node.step(20)  # the node's control loop takes the instance's heartbeats in
    assert node.status()["apps"]["cls"]["ok"] >= 8


def test_an_instance_killed_holding_front_door_rows_answers_them_once(node: Node) -> None:
    """The active instance is stopped, takes an HTTP inference's rows into its queue and is killed:
    the supervisor replaces it and the ingest's reclaim hands the rows to the replacement (or answers
    INSTANCE_FAILED): one answer per row, one reply to the client, whichever way. (A controlled
    version with INSTANCE_FAILED every time is test_transport.py's.)"""
    assert node.ingest is not None
    st = next(s for s in node.instances.values() if s.app == "cls" and s.role == "active")
    x = np.random.default_rng(1).standard_normal((4, 3, 32, 32)).astype(np.float32)
    before = node.ingest.counters()
    replies: list[object] = []
    with start_frontdoor(node.cfg.apps, ("127.0.0.1", node.ingest.ports[0]), http_port=0, grpc_port=None,
                         timeout_s=300, ingest=node.ingest) as door:
        assert door.http_url is not None and door.core is not None
        url = door.http_url.removeprefix("http://")

        def call() -> None:
            with httpclient.InferenceServerClient(url, network_timeout=600) as h:
                t = httpclient.InferInput("input", list(x.shape), "FP32")
                t.set_data_from_numpy(x, binary_data=True)
                try:
                    replies.append(h.infer("cls", [t], parameters={"timeout": BUSY_DEADLINE_US}).as_numpy("logits"))
                except InferenceServerException as e:
                    replies.append(e)

        os.kill(st.pid, signal.SIGSTOP)  # it holds what is delivered to it, and answers nothing
        t = threading.Thread(target=call)
        t.start()
        deadline = time.monotonic() + 60
        while node.ingest.counters()["requests_delivered"] - before["requests_delivered"] < 4:
            assert time.monotonic() < deadline, "the rows never reached the instance"
            time.sleep(0.01)
        os.kill(st.pid, signal.SIGKILL)
        deadline = time.monotonic() + 300
        while t.is_alive() and time.monotonic() < deadline:
            node.step(50)  # reaps the dead instance, starts its replacement, reclaims the rows
            t.join(0.01)
        assert not t.is_alive(), "no reply within 300 s"
        assert len(replies) == 1
        # The replacement may start after the rows' deadline on a busy machine: DEADLINE_MISSED then.
        if isinstance(replies[0], InferenceServerException):
            e = replies[0]
            assert any(e.status() == code and name in str(e.message())
                       for code, name in (("503", "INSTANCE_FAILED"), ("504", "DEADLINE_MISSED"))), e
        else:
            assert np.asarray(replies[0]).shape == (4, 10)
        stats = door.core.stats["cls"].totals().oip["statuses"]
        assert sum(stats.values()) == 4 and set(stats) <= {"OK", "INSTANCE_FAILED", "DEADLINE_MISSED"}
        c = node.ingest.counters()
        assert c["local_submitted"] - before["local_submitted"] == 4
        assert c["local_answered"] - before["local_answered"] == 4
        assert door.core.transport.stray == 0  # type: ignore[attr-defined]


def _free_tcp_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_node_started_from_the_example_serves_tritonclient(tmp_path_factory: pytest.TempPathFactory) -> None:
    """examples/apps.yaml as shipped (front door on), with ports and run dir made private to the test."""
    from pathlib import Path

    from orchestrator.config.schema import parse_config

    tmp = tmp_path_factory.mktemp("example")
    example = load_config(Path(__file__).resolve().parents[3] / "examples" / "apps.yaml")
    assert example.node.http_port and example.node.grpc_port, "the example turns the front door on"
    data = example.model_dump()
    data["node"].update(listen={"host": "127.0.0.1", "port": [0]}, run_dir=str(tmp / "run"), backend="cpu",
                        engine_cache=str(tmp / "engines"),
                        autoscale=False, http_port=_free_tcp_port(), grpc_port=_free_tcp_port())
    cfg = parse_config(data, source="examples/apps.yaml (test ports)")
    node = Node(cfg, warmup=False, heartbeat_ms=100).start()
    try:
        assert node.frontdoor is not None and node.frontdoor.http_url and node.frontdoor.grpc_target
        rng = np.random.default_rng(1)
        for app in cfg.apps:
            model = build_model(app.model or "", seed=app.seed, num_classes=app.num_classes,
                                input_shape=tuple(app.input_shape))
            if app.dtype == "uint8":
                x = rng.integers(0, 256, (2, *app.input_shape), dtype=np.uint8)
                dt = "UINT8"
            else:
                x = rng.random((2, *app.input_shape), dtype=np.float32)
                dt = "FP32"
            with torch.inference_mode():
                want = model.eval()(preprocess(torch.from_numpy(x), app.dtype)).numpy()
            with httpclient.InferenceServerClient(node.frontdoor.http_url.removeprefix("http://")) as h:
                assert h.is_model_ready(app.name)
                t = httpclient.InferInput("input", list(x.shape), dt)
                t.set_data_from_numpy(x, binary_data=True)
                # A deadline far past the SLO: the models are not warmed up (warmup=False), and on a busy
                # machine a first run can take longer than the app's SLO; this test is about the answers.
                out_http = h.infer(app.name, [t], timeout=BUSY_DEADLINE_US).as_numpy("logits")
            with grpcclient.InferenceServerClient(node.frontdoor.grpc_target) as g:
                t2 = grpcclient.InferInput("input", list(x.shape), dt)
                t2.set_data_from_numpy(x)
                out_grpc = g.infer(app.name, [t2], timeout=BUSY_DEADLINE_US).as_numpy("logits")
            np.testing.assert_allclose(out_http, want, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(out_grpc, want, rtol=1e-4, atol=1e-4)
    finally:
        node.stop()
    assert node.frontdoor is None
