"""CPU overflow on a real node (issue 18), loopback, CPU backend: the accelerator instance and the
app's CPU instance both answer correctly, the ingest sends work to the CPU only when the accelerator's
queue is long, and a SIGKILLed CPU instance leaves the accelerator serving with every request answered
exactly once."""

from __future__ import annotations

import collections
import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from prometheus_client import generate_latest

from apps.zoo import load_model
from gpuprims.gather import preprocess
from gpuprims.profile import save_profile, with_stages
from gpuprims.wire import Status
from orchestrator.config.schema import load_config
from orchestrator.control.records import NodeView, Role
from orchestrator.control.status_format import format_status
from orchestrator.node.metrics import MetricsServer
from orchestrator.node.node import Node
from tests.gpuprims.sched._profiles import grid
from tests.orchestrator.node.test_node import Client

pytestmark = pytest.mark.slow

SHAPE = (3, 32, 32)
CONFIG = """
node:
  listen: {host: 127.0.0.1, port: 0}
  backend: cpu
  run_dir: RUN_DIR
  pool: {slot_count: 8192, max_chunks: 64, record_count: 1024}
  reassembly_timeout_ms: 5000
  overflow_profiles: PROFILES
apps:
  - {name: cls, model: mobilenet_v2, input_shape: [3, 32, 32], slo_ms: 60000, gpu_pct: 50, max_batch: 8,
     app_id: 1, num_classes: 10, seed: 3, shadow: false, overflow: cpu, overflow_cores: 1,
     overflow_alpha_ms: 20}
"""


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    tmp = tmp_path_factory.mktemp("overflow")
    (tmp / "profiles").mkdir()
    # A CPU profile of the model on one core, slower than this machine measures (as a CPU is against
    # a GPU): a CPU that is never used keeps its profiled time, so this is what keeps light load on
    # the accelerator under contention; the node corrects both from measured batch times. No
    # accelerator profile: it is seeded from this one until measured.
    cpu = with_stages(grid("mobilenet_v2", {100: {1: 60.0, 8: 240.0}}), [], device_kind="cpu", cpu_cores=1)
    save_profile(cpu, tmp / "profiles" / "mobilenet_v2.cpu.json")
    cfg = tmp / "apps.yaml"
    cfg.write_text(CONFIG.replace("RUN_DIR", str(tmp / "run")).replace("PROFILES", str(tmp / "profiles")))
    n = Node(load_config(cfg), warmup=True, heartbeat_ms=100).start()
    yield n
    n.stop()


@pytest.fixture(scope="module")
def inputs() -> list[tuple[np.ndarray, np.ndarray]]:
    """Four inputs and what direct torch answers for each."""
    model = load_model("mobilenet_v2", seed=3, num_classes=10, input_shape=SHAPE).eval()
    rng = np.random.default_rng(0)
    out = []
    for _ in range(4):
        x = rng.random(SHAPE, dtype=np.float32)
        with torch.inference_mode():
            out.append((x, model(preprocess(torch.from_numpy(x)[None], "float32")).numpy()[0]))
    return out


def _split(node: Node, routed: int, timeout_s: float = 30.0) -> dict:
    """The app's overflow split once the instances' heartbeats account for ``routed`` requests."""
    deadline = time.monotonic() + timeout_s
    while True:
        node.step(20)
        split = node.status()["apps"]["cls"]["overflow"]
        total = split["accelerator"]["routed"] + split["cpu"]["routed"]
        answered = split["accelerator"]["answered"] + split["cpu"]["answered"]
        if (total >= routed and answered >= routed) or time.monotonic() > deadline:
            return split


def _check(client: Client, sent: dict[int, int], inputs: list) -> collections.Counter:
    assert sorted(client.responses) == sorted(sent), "a request got no answer"
    assert all(len(v) == 1 for v in client.responses.values()), "a request got two answers"
    for rid, k in sent.items():
        (r,) = client.responses[rid]
        if r.status == Status.OK:
            np.testing.assert_allclose(r.array(), inputs[k][1], rtol=1e-4, atol=1e-5)
    return collections.Counter(v[0].status for v in client.responses.values())


def test_light_load_stays_on_the_accelerator(node: Node, inputs: list) -> None:
    client = Client(node.ingest.ports[0])
    try:
        sent = {}
        for rid in range(12):  # one at a time: the accelerator's queue is empty at every arrival
            sent[rid] = rid % 4
            client.send(1, rid, inputs[rid % 4][0])
            client.collect(rid + 1, node)
        assert _check(client, sent, inputs) == {Status.OK: 12}
    finally:
        client.close()
    split = _split(node, 12)
    assert split["accelerator"]["routed"] == 12 and split["cpu"]["routed"] == 0, \
        (split, node.overflow.costs if node.overflow else None)


def test_a_long_accelerator_queue_overflows_to_the_cpu_with_equal_answers(node: Node, inputs: list) -> None:
    before = _split(node, 12)
    client = Client(node.ingest.ports[0])
    try:
        sent = {}
        for rid in range(100, 260):  # a burst: far more than the accelerator drains while it arrives
            sent[rid] = rid % 4
            client.send(1, rid, inputs[rid % 4][0])
        client.collect(len(sent), node, timeout_s=120)
        assert _check(client, sent, inputs) == {Status.OK: len(sent)}
    finally:
        client.close()
    split = _split(node, 12 + len(sent))
    cpu = split["cpu"]["routed"] - before["cpu"]["routed"]
    acc = split["accelerator"]["routed"] - before["accelerator"]["routed"]
    assert acc + cpu == len(sent) and cpu > 0 and acc > 0, split
    assert split["cpu"]["answered"] == split["cpu"]["routed"]
    # status text and Prometheus show the split
    text = format_status(NodeView.from_dict(node.status()))
    assert f"overflow cls: accelerator routed={split['accelerator']['routed']}" in text
    srv = MetricsServer(0)  # never started: its registry renders what it was given
    srv.update(node.view())
    body = generate_latest(srv.registry).decode()
    assert f'gpuprims_overflow_routed_total{{app="cls",device="cpu"}} {float(split["cpu"]["routed"])}' in body
    assert 'gpuprims_overflow_cpu_instance_failures_total{app="cls"} 0.0' in body


def test_sigkill_of_the_cpu_instance_leaves_the_accelerator_serving(node: Node, inputs: list) -> None:
    victim = next(st for st in node.instances.values() if st.role == Role.OVERFLOW)
    app_before = node.status()["apps"]["cls"]
    client = Client(node.ingest.ports[0])
    try:
        sent = {}
        for rid in range(1000, 1160):
            sent[rid] = rid % 4
            client.send(1, rid, inputs[rid % 4][0])
            if rid == 1080:
                os.kill(victim.pid, signal.SIGKILL)  # mid-burst: it holds some of the overflow
        client.collect(len(sent), node, timeout_s=120)
        statuses = _check(client, sent, inputs)
        app = node.status()["apps"]["cls"]
        failed = app["failed_by_crash"] - app_before["failed_by_crash"]
        # What it held went to the accelerator (requeued) or, when nothing could take it, was
        # answered INSTANCE_FAILED: never lost, never twice.
        assert statuses[Status.OK] + statuses[Status.INSTANCE_FAILED] == len(sent)
        assert statuses[Status.INSTANCE_FAILED] == failed
        assert app["overflow"]["cpu_instance_failures"] == 1
        assert app["restarts"] == app_before["restarts"]  # the accelerator instance never stopped
        # Requests sent after the death were served (by the accelerator, until the replacement is up).
        assert all(client.responses[rid][0].status == Status.OK for rid in range(1100, 1160))
        # A new CPU instance starts after the back-off and is routed to once it is ready.
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            node.step(50)
            new = [st for st in node.instances.values() if st.role == Role.OVERFLOW and st.ready]
            if new and len(node.ingest.route(1)) == 2:
                break
        assert new and new[0].name != victim.name, "no replacement CPU instance became ready"
        node.overflow.update(node.instances.values(), node.ingest, time.monotonic(), force=True)  # type: ignore[union-attr]
        assert node.ingest.cost(new[0].spec.consumer) is not None  # it has its cost model again
    finally:
        client.close()
